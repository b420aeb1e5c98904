"""The sync loop's source for `task.agent`: each step's rollouts are episodes of the user's agent program, played
against covrl's OpenAI-compatible endpoint around the run's sampler (covrl.rollout.openai_api), turned into rows
from the recorded token ids (covrl.rollout.agents: the merge rule) and scored by the program's returned reward,
else by the task's reward of the episode's last assistant text.

Failures of the program (it raises, passes task.agent.timeout_s, returns something else than a number or None,
makes no call) follow covrl's user-code rule (covrl.tasks.failures.FailureWatch: the first traceback at once,
the run stops past task.max_reward_error_rate over task.reward_error_window episodes); a failed episode gives
no row. Per step: task/agent_failed, task/agent_timeouts (fractions of episodes), task/agent_calls and
task/agent_rows (per finished episode), task/agent_split_episodes (the fraction of finished episodes whose calls
gave more than one row: the chat template rewrote the history); time/agent_episode (mean seconds per episode:
a wall time, under time/ with the run's other timings)."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from covrl.rollout.agents import AgentEpisode, AgentRunner, agent_batch
from covrl.rollout.openai_api import PLAIN_AGENT_TEMPLATE, CallLog, OpenAIServer
from covrl.rollout.types import RolloutTiming, ScoredBatch
from covrl.tasks.agent import build_agent
from covrl.tasks.failures import FailureWatch
from covrl.train.faults import fault_point
from covrl.train.run.sources import SourceBatch, SyncSource, choose_prompts

__all__ = ["AgentPlayer", "AgentSource", "attach_agent", "count_failures", "episode_rewards",
           "detached_player", "score_agent_episodes"]


def _check(cfg) -> None:
    if cfg.loop.dynamic_sampling:
        raise ValueError("task.agent with loop.dynamic_sampling=true is not supported; set loop.dynamic_sampling=false")
    if cfg.task.env.name is not None or cfg.task.name == "verifiers":
        raise ValueError("task.agent: the agent plays its own episodes; leave task.env.name unset and use a data "
                         "task (task.name) for its examples")
    sel = cfg.selection
    if sel.strategy != "uniform" or sel.group_sizes != "fixed":
        raise ValueError("task.agent with selection.* other than uniform prompts and fixed group sizes is not "
                         "supported")


def count_failures(watch: FailureWatch, episodes: list[AgentEpisode], examples: list) -> None:
    """The failed episodes to the user-code rule: the first with its traceback, then counted; raises
    UserCodeError when they pass the rate."""
    failed = [k for k, ep in enumerate(episodes) if ep.error is not None]
    for k in failed:
        ep = episodes[k]
        watch.failed(ep.error, f"episode {k}", f"example {examples[ep.example].prompt[:60]!r}")
    watch.observe(len(episodes), len(failed))


def episode_rewards(task, episodes: list[AgentEpisode], examples: list
                    ) -> tuple[dict[int, float], dict[int, bool], dict[str, float]]:
    """The finished episodes' rewards and verdicts by episode index: the program's reward (>= 1 is correct), else
    the task's reward and grader of the last assistant text; and the task's scoring metrics (task/...)."""
    done = [k for k, ep in enumerate(episodes) if ep.error is None]
    rewards = {k: episodes[k].reward for k in done}
    correct = {k: rewards[k] is not None and rewards[k] >= 1.0 for k in done}
    metrics: dict[str, float] = {}
    todo = [k for k in done if rewards[k] is None]
    if todo:
        scored = task.score([episodes[k].final_text for k in todo], [examples[episodes[k].example] for k in todo])
        for j, k in enumerate(todo):
            rewards[k], correct[k] = float(scored.rewards[j]), bool(scored.correct[j])
        metrics.update({f"task/{key.split('/', 1)[-1]}": float(v) for key, v in scored.metrics.items()
                        if key not in ("reward/mean", "reward/accuracy")})
    return rewards, correct, metrics


def score_agent_episodes(task, tokenizer, episodes: list[AgentEpisode], examples: list, sampler, *,
                         policy_version: int, positions: list[int] | None = None,
                         generate_s: float = 0.0) -> ScoredBatch:
    """The rows of the finished episodes, scored: the program's reward, else the task's reward of the last
    assistant text (the task's grader says correct there; a returned reward >= 1 is correct). Every row of an
    episode carries its reward."""
    t0 = time.perf_counter()
    done = [k for k, ep in enumerate(episodes) if ep.error is None]
    rewards, correct, metrics = episode_rewards(task, episodes, examples)
    batch, owner = agent_batch(episodes, sampler, tokenizer, policy_version=policy_version,
                               timing=RolloutTiming(generate_s=generate_s))
    n_eps, n_done = max(len(episodes), 1), max(len(done), 1)
    rows_of = {k: owner.count(k) for k in done}
    metrics.update({
        "task/agent_failed": sum(ep.error is not None for ep in episodes) / n_eps,
        "task/agent_timeouts": sum(ep.timed_out for ep in episodes) / n_eps,
        "task/agent_calls": sum(len(episodes[k].calls) for k in done) / n_done,
        "task/agent_rows": sum(rows_of.values()) / n_done,
        "task/agent_split_episodes": sum(r > 1 for r in rows_of.values()) / n_done,
        "time/agent_episode": sum(ep.seconds for ep in episodes) / n_eps,
    })
    lengths = batch.response_mask.sum(1).long().tolist()
    texts = [tokenizer.decode(batch.response_ids[i, :lengths[i]].tolist(), skip_special_tokens=True)
             for i in range(len(owner))]
    row_rewards = torch.tensor([rewards[k] if k >= 0 else 0.0 for k in owner], dtype=torch.float32)
    out = batch.scored(row_rewards, correct=[correct[k] if k >= 0 else False for k in owner], texts=texts,
                       task_metrics=metrics, score_s=time.perf_counter() - t0)
    if positions is not None:
        out = replace(out, prompt_index=torch.tensor([positions[episodes[k].example] if k >= 0 else positions[0]
                                                      for k in owner], dtype=torch.long))
    return out


class AgentPlayer:
    """The run's agent program and the OpenAI-compatible endpoint around its sampler (made at the first use,
    closed by `close`; a later use opens it again): plays a step's or a chunk's episodes (`play`, the sync and
    async loops) and the held-out ones (`evaluate_episodes`, the run's evaluation), and keeps the failure rule."""

    def __init__(self, run):
        cfg = run.cfg
        _check(cfg)
        self.run = run
        self.acfg = cfg.task.agent
        self.fn = build_agent(self.acfg)
        self.failures = FailureWatch(
            f"agent {self.acfg.spec}", unit="episodes", window=cfg.task.reward_error_window,
            max_rate=cfg.task.max_reward_error_rate,
            limits=f"task.max_reward_error_rate={cfg.task.max_reward_error_rate} over "
                   f"task.reward_error_window={cfg.task.reward_error_window}")
        self.server: OpenAIServer | None = None
        self.runner: AgentRunner | None = None
        self.worker_failures = 0

    def _endpoint(self) -> OpenAIServer:
        if self.server is None:
            run = self.run
            tokenizer = run.tokenizer
            template = None if getattr(tokenizer, "chat_template", None) else PLAIN_AGENT_TEMPLATE
            self.server = OpenAIServer(run.sampler, tokenizer, calls=CallLog(strict=True), chat_template=template,
                                       generator=run.generator)
            self.runner = AgentRunner(self.server, self.fn, concurrency=self.acfg.concurrency,
                                      timeout_s=self.acfg.timeout_s)
        return self.server

    def play(self, examples: list, sizes: int | list[int], *, version: int, positions: list[int],
             refresh=None) -> ScoredBatch:
        """`sizes` episodes per example with the run's sampler (which holds the weights of `version`) and
        generator, failures counted, scored (covrl's rows: `score_agent_episodes`). `refresh` (the async loop's
        partial rollouts): newer weights are taken between calls, each call recording the version it drew from."""
        run = self.run
        server = self._endpoint()
        server.sampler, server.generator, server.greedy = run.sampler, run.generator, False
        server.version = (lambda: int(run.sampler.version)) if refresh is not None else (lambda: version)
        server.refresh = refresh
        t0 = time.perf_counter()
        try:
            episodes = self.runner.run(examples, sizes)
        finally:
            server.refresh = None
        generate_s = time.perf_counter() - t0
        fault_point("generate")  # reliability tests: COVRL_FAULT (no-op otherwise)
        count_failures(self.failures, episodes, examples)
        return score_agent_episodes(run.task, run.tokenizer, episodes, examples, run.sampler, policy_version=version,
                                    positions=positions, generate_s=generate_s)

    def evaluate_episodes(self, examples: list, generator, greedy: bool, n: int) -> dict[str, Any]:
        """n episodes per held-out example with the sampler's current weights (greedy: its greedy decoding),
        drawn from `generator`: accuracy (the grader's verdict, or a returned reward >= 1), the mean reward
        (failed episodes: 0, incorrect; shown like training's, not counted toward the stop rule), per-example
        correct counts, calls and sampled tokens per episode."""
        run = self.run
        server = self._endpoint()
        server.sampler, server.greedy, server.generator = run.sampler, greedy, generator
        server.version = lambda: run.trainer.version
        try:
            episodes = self.runner.run(examples, n)
        finally:
            server.greedy, server.generator = False, run.generator
        for k, ep in enumerate(episodes):
            if ep.error is not None:
                self.failures.failed(ep.error, f"held-out episode {k}", f"example {examples[ep.example].prompt[:60]!r}")
        rewards, correct, _ = episode_rewards(run.task, episodes, examples)
        counts = [0] * len(examples)
        for k, ok in correct.items():
            counts[episodes[k].example] += int(ok)
        total = max(len(episodes), 1)
        finals: dict[int, int] = {}
        for k, ep in enumerate(episodes):
            finals.setdefault(ep.example, k)
        return {
            "accuracy": sum(correct.values()) / total,
            "reward_mean": sum(rewards.values()) / total,
            "length_mean": sum(len(c.completion_ids) for ep in episodes for c in ep.calls) / total,
            "agent_failed": sum(ep.error is not None for ep in episodes) / total,
            "agent_calls": sum(len(ep.calls) for ep in episodes) / total,
            "n": len(episodes), "correct_counts": counts,
            "examples": [{"prompt": examples[i].prompt, "answer": examples[i].answer,
                          "completion": episodes[k].final_text, "correct": bool(correct.get(k, False)),
                          **({"error": f"{type(episodes[k].error).__name__}: {episodes[k].error}"}
                             if episodes[k].error is not None else {})}
                         for i, k in list(finals.items())[:5]],
        }

    def waiting_for(self) -> str:
        """The episodes being played now (the run's stall report): running / asked, the oldest one's age."""
        return self.runner.progress() if self.runner is not None else "the agent's endpoint is not open"

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.server is not None:
            self.server.close()
            self.server = None

    def count_worker_failures(self, n: int) -> None:
        """Failed episodes a sampler worker (process or Ray pool) played and counted by its own rule: the run's
        summary counts them too."""
        self.worker_failures += n

    def summary(self) -> dict[str, Any]:
        return {"agent": {"fn": self.acfg.fn, "command": self.acfg.command,
                          "failed_episodes": self.failures.failures + self.worker_failures}}


def detached_player(cfg, sampler, tokenizer, task, *, generator: torch.Generator | None = None,
                    version: int = 0) -> AgentPlayer:
    """An AgentPlayer outside a run, around `sampler` (which holds the weights of `version`): `covrl eval` of an
    agent run's checkpoint (`evaluate_episodes`), and a process or Ray sampler worker of the async loop (`play`,
    drawing from the worker's `generator`, its failures counted by the worker's own rule)."""
    holder = SimpleNamespace(cfg=cfg, sampler=sampler, tokenizer=tokenizer, task=task,
                             generator=generator if generator is not None else torch.Generator().manual_seed(
                                 cfg.run.seed),
                             trainer=SimpleNamespace(version=version))
    return AgentPlayer(holder)


def attach_agent(run) -> AgentPlayer:
    """The run's AgentPlayer (made once): the loops play through it, `Run.run_eval` evaluates through it."""
    if run.agent is None:
        run.agent = AgentPlayer(run)
    return run.agent


class AgentSource(SyncSource):
    """`task.agent`'s episodes (fn or command) between steps (the sync loop): the next prompts of the stream,
    `loop.group_size` episodes each, played by the run's AgentPlayer. Evaluation plays the agent on the held-out
    prompts (the run's eval settings: greedy = the sampler's greedy decoding, sampled = its temperature from the
    eval seed)."""

    def __init__(self, run):
        super().__init__(run)
        self.player = attach_agent(run)
        self.stopped = False     # after the loop: an evaluation opens the endpoint for itself, then closes it

    def waiting_for(self) -> str:
        return f"{self.player.waiting_for()}; the agent: {self.run.cfg.task.agent.spec}"

    def next_batch(self, trainer_version: int) -> SourceBatch:
        run = self.run
        lcfg = run.cfg.loop
        examples, positions, sizes = choose_prompts(run, lcfg.prompts_per_step, lcfg.group_size)
        scored = self.player.play(examples, sizes, version=trainer_version, positions=positions)
        return SourceBatch(scored, metrics={}, examples=tuple(examples))

    def evaluate(self, label: str) -> dict[str, Any]:
        try:
            return self.run.run_eval(label)
        finally:
            if self.stopped:
                self.player.close()

    def stop(self) -> None:
        self.stopped = True
        self.player.close()

    def summary(self) -> dict[str, Any]:
        return self.player.summary()
