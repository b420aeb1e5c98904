"""Rollout sources: where the loop driver (`covrl.train.run.driver.run_loop`) gets each step's scored batch.

A source owns how rollouts are produced (the in-process sampler between steps, a staleness-managed pool of
sampler threads / processes / Ray actors beside the trainer, and later an inference engine), when new weights
reach the sampler, and how evaluation sees the trainer's weights. The driver owns everything else: the step,
the per-step record, the eval and checkpoint cadence on the data clock, the end of the run. A source that has
state to checkpoint registers itself with the run (`Run.register`).

    examples ─► source.next_batch ─► SourceBatch(ScoredBatch, metrics) ─► Trainer.step ─► StepResult
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from covrl.math import constant_groups
from covrl.rollout.episodes import EpisodeBatch, generate_episodes, score_episodes
from covrl.rollout.text import decode_responses
from covrl.rollout.types import RolloutBatch, ScoredBatch, concat_batches
from covrl.train.faults import fault_point
from covrl.train.step.results import StepResult

__all__ = ["DynamicSamplingError", "DynamicSamplingSource", "RolloutSource", "SourceBatch",
           "SyncSource", "build_sync_source", "generate_batch", "score_batch", "score_rollouts"]


@dataclass(frozen=True)
class SourceBatch:
    """One step's input: the scored batch, the source's own per-step metrics (queue lag, ...) and, where the
    source knows them, the task examples the rows answer (n rows each)."""

    batch: ScoredBatch
    metrics: dict[str, float] = field(default_factory=dict)
    examples: tuple = ()


@runtime_checkable
class RolloutSource(Protocol):
    """What the loop driver needs from a producer of scored rollouts."""

    def start(self) -> None:
        """Begin producing (called once, after the evaluation before training)."""

    def next_batch(self, trainer_version: int) -> SourceBatch:
        """The next step's rollouts (blocks until they are ready)."""

    def step_done(self, result: StepResult) -> None:
        """The trainer consumed the last batch (skipped updates included)."""

    def publish(self, model, version: int) -> None:
        """New trainer weights for the sampler(s), at the `sampler.sync_every` cadence."""

    def step_metrics(self, result: StepResult) -> dict[str, float]:
        """Extra keys of the step's record (after the step)."""

    def evaluate(self, label: str) -> dict[str, Any]:
        """Held-out evaluation of the current weights (`Run.run_eval`), the sampler paused if it runs beside."""

    def stop(self) -> None:
        """Stop producing; must be safe to call more than once."""

    def failure(self) -> BaseException | None:
        """The error that stopped a background producer (the driver raises it), or None."""

    def summary(self) -> dict[str, Any]:
        """Keys added to the run's summary (may be empty)."""

    def waiting_for(self) -> str:
        """What the next batch waits on, for the progress watchdog's report (may be empty)."""


def _sizes(n: int | list[int], k: int) -> list[int]:
    return [n] * k if isinstance(n, int) else [int(x) for x in n]


def by_group_sizes(batch: RolloutBatch, sizes: list[int]) -> RolloutBatch:
    """A batch generated one row per (prompt, completion) — prompts repeated by `sizes` — with the group ids of
    its prompts (adaptive group sizes)."""
    return replace(batch, group_ids=torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes)))


def choose_prompts(run, k: int, n: int) -> tuple[list, list[int], int | list[int]]:
    """(examples, stream positions, group size or per-prompt sizes) of the next step: the stream's next k, or
    the run's prompt selector's choice (selection.*); equal sizes come back as one int."""
    if run.selector is None:
        examples, positions = run.stream.take(k)
        return examples, positions, n
    examples, positions = run.selector.take(run.stream, k, n)
    sizes = run.selector.group_sizes(run.stream, positions, n)
    return examples, positions, (sizes if len(set(sizes)) > 1 else n)


def observe_selection(run, positions: list[int], scored: ScoredBatch, sizes, examples) -> dict[str, float]:
    """Tell the selector how the chosen groups scored; its metrics for the step's record."""
    cfg = run.cfg.selection
    if run.selector is None or (cfg.strategy == "uniform" and cfg.group_sizes == "fixed"):
        return {}
    run.selector.observe(run.stream, positions, scored.correct, sizes, examples)
    return run.selector.metrics()


def score_rollouts(task, tokenizer, batch: RolloutBatch, examples: list, n: int | list[int],
                   positions: list[int] | None = None) -> ScoredBatch:
    """Decode and score `batch` (the rows of `examples`, n each, or n[i] for example i) with the task's reward: a
    new ScoredBatch with rewards, per-row verdicts and texts, the task's metrics and `prompt_index` (stream
    positions, when given)."""
    t0 = time.perf_counter()
    texts = decode_responses(tokenizer, batch)
    sizes = _sizes(n, len(examples))
    row_examples = [ex for ex, size in zip(examples, sizes) for _ in range(size)]
    scored = task.score(texts, row_examples, lengths=batch.response_mask.sum(1).long().tolist())
    task_metrics = {f"task/{k.split('/', 1)[-1]}": float(v) for k, v in scored.metrics.items()
                    if k not in ("reward/mean", "reward/accuracy")}
    if positions is not None:
        batch = replace(batch, prompt_index=torch.tensor(positions, dtype=torch.long).repeat_interleave(
            torch.tensor(sizes)))
    return batch.scored(torch.tensor(scored.rewards, dtype=torch.float32), correct=scored.correct, texts=texts,
                        task_metrics=task_metrics, score_s=time.perf_counter() - t0, reward_terms=scored.terms,
                        reward_term_weights=scored.term_weights)


def generate_batch(sampler, task, tokenizer, task_cfg, examples: list, n: int | list[int], *,
                   generator: torch.Generator, version: int, refresh=None) -> RolloutBatch | EpisodeBatch:
    """n rollouts per example: multi-turn episodes for a task with an environment (`task.env.name`, with
    `task_cfg.chat_template` and `task_cfg.env.max_turns`), else single completions of the encoded prompts.
    Every source and sampler pool generates through here, so the sync, async and Ray loops get the same rows.
    `refresh`: in-flight weight updates (the sampler's `generate`), single-turn only. `n` a list: n[i]
    completions of example i (adaptive group sizes, single-turn), rows example-major, group ids by example."""
    if not isinstance(n, int):
        if getattr(task, "environment", None) is not None or refresh is not None:
            raise ValueError("adaptive group sizes take single-turn completions in the sync loop")
        prompts = [task.encode(tokenizer, ex) for ex, size in zip(examples, n) for _ in range(size)]
        return by_group_sizes(sampler.generate(prompts, 1, generator=generator, policy_version=version), list(n))
    if getattr(getattr(task_cfg, "agent", None), "enabled", False):   # the sync loop plays them (covrl.train.run.agent_source); the pools do not
        raise ValueError("task.agent: agent episodes run in the sync loop or the async loop's thread / serial "
                         "pool (process and Ray pools are not supported yet)")
    if getattr(task, "environment", None) is not None:
        if refresh is not None:
            raise ValueError("async_loop.partial_rollouts: multi-turn episodes (task.env) are generated turn by "
                             "turn and are not supported; set async_loop.partial_rollouts=false")
        return generate_episodes(sampler, tokenizer, task.environment, examples, n, generator=generator,
                                 chat_template=task_cfg.chat_template, max_turns=task_cfg.env.max_turns,
                                 policy_version=version, failures=task.env_failures)
    prompts = [task.encode(tokenizer, ex) for ex in examples]
    if refresh is not None:
        return sampler.generate(prompts, n, generator=generator, policy_version=version, refresh=refresh)
    return sampler.generate(prompts, n, generator=generator, policy_version=version)


def score_batch(task, tokenizer, generated: RolloutBatch | EpisodeBatch, examples: list, n: int | list[int],
                positions: list[int] | None = None) -> ScoredBatch:
    """Score what `generate_batch` returned: episodes by their environment (or the task), completions by the
    task; `prompt_index` from the stream positions, when given."""
    if isinstance(generated, EpisodeBatch):
        scored = score_episodes(task, tokenizer, generated, examples, n)
        if positions is None:
            return scored
        return replace(scored, prompt_index=torch.tensor(positions, dtype=torch.long).repeat_interleave(n))
    return score_rollouts(task, tokenizer, generated, examples, n, positions)


class SyncSource:
    """The run's own sampler, between steps: take the next prompts of the stream, generate `loop.group_size`
    completions each (multi-turn episodes for a task with an environment, `task.env.name`) with the run's
    generator, score them. Weights reach the sampler right after the step."""

    def __init__(self, run):
        self.run = run

    def start(self) -> None:
        pass

    def waiting_for(self) -> str:
        cfg = self.run.cfg
        return (f"the {cfg.sampler.backend} sampler generates {cfg.loop.rollouts_per_step} rollouts of up to "
                f"{cfg.sampler.max_new_tokens} tokens" + (" (episodes: a tool or environment may be slow)"
                                                          if cfg.task.env.name else ""))

    def next_batch(self, trainer_version: int) -> SourceBatch:
        run = self.run
        lcfg = run.cfg.loop
        # equal sizes come back as one int: the ordinary batched call (prefills shared, the same RNG stream)
        examples, positions, sizes = choose_prompts(run, lcfg.prompts_per_step, lcfg.group_size)
        generated = generate_batch(run.sampler, run.task, run.tokenizer, run.cfg.task, examples, sizes,
                                   generator=run.generator, version=trainer_version)
        fault_point("generate")  # reliability tests: COVRL_FAULT (no-op otherwise)
        scored = score_batch(run.task, run.tokenizer, generated, examples, sizes, positions)
        metrics = observe_selection(run, positions, scored, sizes, examples)
        return SourceBatch(scored, metrics=metrics, examples=tuple(examples))

    def step_done(self, result: StepResult) -> None:
        pass

    def publish(self, model, version: int) -> None:
        self.run.sampler.load_weights(model, version)

    def step_metrics(self, result: StepResult) -> dict[str, float]:
        return {}

    def evaluate(self, label: str) -> dict[str, Any]:
        return self.run.run_eval(label)

    def stop(self) -> None:
        pass

    def failure(self) -> BaseException | None:
        return None

    def summary(self) -> dict[str, Any]:
        return {}


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling kept no group in `loop.dynamic_sampling_max_rounds` rounds (every reward constant)."""


class DynamicSamplingSource(SyncSource):
    """DAPO's dynamic sampling on the sync loop (`loop.dynamic_sampling: true`): generate `loop.group_size`
    completions for the next prompts of the stream, drop the groups whose rewards are all equal (zero variance:
    no advantage, no gradient under a group baseline), and generate for as many new prompts as groups are missing
    until `loop.prompts_per_step` groups are kept. Nothing generated is trained twice or carried over.

    Cap: at most `loop.dynamic_sampling_max_rounds` generation rounds per step. When they are used up, the step
    trains on the groups kept so far (a smaller batch; `dynamic/short_step` = 1); a step that kept none raises
    DynamicSamplingError (exit code 2): every group was constant for that many rounds, the task is too easy or
    too hard for the model.

    Data clock: the trainer counts the rollouts it trained on (`rollouts`, the lr schedule and eval / checkpoint
    periods); this source counts every rollout it generated. Per step it logs `dynamic/generated_rollouts` and
    `dynamic/trained_rollouts` (cumulative), `dynamic/kept_groups`, `dynamic/dropped_groups`, `dynamic/rounds`,
    `dynamic/keep_rate` (kept / generated groups this step). Its counters are checkpointed
    (`run.register("dynamic_sampling", ...)`); the prompts drawn come from the run's stream and generator, which are
    checkpointed already, so a resumed run repeats the uninterrupted one exactly."""

    def __init__(self, run):
        super().__init__(run)
        self.generated_rollouts = 0
        self.trained_rollouts = 0
        self.dropped_groups = 0
        run.register("dynamic_sampling", self)

    def state_dict(self) -> dict[str, int]:
        return {"generated_rollouts": self.generated_rollouts, "trained_rollouts": self.trained_rollouts,
                "dropped_groups": self.dropped_groups}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.generated_rollouts = int(state["generated_rollouts"])
        self.trained_rollouts = int(state["trained_rollouts"])
        self.dropped_groups = int(state["dropped_groups"])

    def next_batch(self, trainer_version: int) -> SourceBatch:
        run, lcfg = self.run, self.run.cfg.loop
        n, want = lcfg.group_size, lcfg.prompts_per_step
        kept: list[ScoredBatch] = []
        kept_examples: list = []
        num_kept = rounds = dropped = generated = 0
        while num_kept < want and rounds < lcfg.dynamic_sampling_max_rounds:
            examples, positions = run.stream.take(want - num_kept)
            generated_batch = generate_batch(run.sampler, run.task, run.tokenizer, run.cfg.task, examples, n,
                                             generator=run.generator, version=trainer_version)
            fault_point("generate")
            scored = score_batch(run.task, run.tokenizer, generated_batch, examples, n, positions)
            rounds += 1
            generated += len(scored)
            # group g: rows g*n .. g*n+n-1
            same = constant_groups(scored.sequence_rewards, scored.group_ids, len(examples))
            keep = (~same).nonzero().flatten().tolist()
            dropped += len(examples) - len(keep)
            if keep:
                rows = [g * n + j for g in keep for j in range(n)]
                kept.append(scored.select(rows))
                kept_examples.extend(examples[g] for g in keep)
                num_kept += len(keep)
        self.generated_rollouts += generated
        self.dropped_groups += dropped
        if not kept:
            raise DynamicSamplingError(
                f"dynamic sampling kept no group in {rounds} rounds (loop.dynamic_sampling_max_rounds): every group "
                f"of {n} completions had equal rewards ({generated} rollouts generated); the task is too easy or "
                "too hard for the model, or the reward is constant. Raise the cap, change the task, or set "
                "loop.dynamic_sampling=false")
        tok = run.tokenizer
        out = concat_batches(kept, int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id))
        if len(kept) > 1:   # concat offsets group ids per chunk; renumber them 0..G-1 for the trainer
            out = replace(out, group_ids=torch.arange(num_kept).repeat_interleave(n))
        self.trained_rollouts += len(out)
        metrics = {"dynamic/generated_rollouts": float(self.generated_rollouts),
                   "dynamic/trained_rollouts": float(self.trained_rollouts),
                   "dynamic/kept_groups": float(num_kept), "dynamic/dropped_groups": float(dropped),
                   "dynamic/rounds": float(rounds), "dynamic/keep_rate": num_kept / max(num_kept + dropped, 1),
                   "dynamic/short_step": float(num_kept < want)}
        return SourceBatch(out, metrics=metrics, examples=tuple(kept_examples))

    def summary(self) -> dict[str, Any]:
        return {"dynamic_sampling": self.state_dict()}


def build_sync_source(run) -> SyncSource:
    """The sync loop's source: episodes for a task with an environment (`task.env.name`), DAPO's dynamic
    sampling with `loop.dynamic_sampling`, else plain completions."""
    # episodes or completions: generate_batch / score_batch dispatch on the task's environment
    return DynamicSamplingSource(run) if run.cfg.loop.dynamic_sampling else SyncSource(run)
