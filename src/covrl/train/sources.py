"""Rollout sources: where the loop driver (`covrl.train.loop.run_loop`) gets each step's scored batch.

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

from covrl.rollout.episodes import generate_episodes, score_episodes
from covrl.rollout.text import decode_responses
from covrl.rollout.types import RolloutBatch, ScoredBatch
from covrl.train.faults import fault_point
from covrl.train.results import StepResult

__all__ = ["EpisodeSource", "RolloutSource", "SourceBatch", "SyncSource", "score_rollouts", "sync_source"]


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


def score_rollouts(task, tokenizer, batch: RolloutBatch, examples: list, n: int,
                   positions: list[int] | None = None) -> ScoredBatch:
    """Decode and score `batch` (the rows of `examples`, n each) with the task's reward: a new ScoredBatch with
    rewards, per-row verdicts and texts, the task's metrics and `prompt_index` (stream positions, when given)."""
    t0 = time.perf_counter()
    texts = decode_responses(tokenizer, batch)
    row_examples = [ex for ex in examples for _ in range(n)]
    scored = task.score(texts, row_examples)
    task_metrics = {f"task/{k.split('/', 1)[-1]}": float(v) for k, v in scored.metrics.items()
                    if k not in ("reward/mean", "reward/accuracy")}
    if positions is not None:
        batch = replace(batch, prompt_index=torch.tensor(positions, dtype=torch.long).repeat_interleave(n))
    return batch.scored(torch.tensor(scored.rewards, dtype=torch.float32), correct=scored.correct, texts=texts,
                        task_metrics=task_metrics, score_s=time.perf_counter() - t0)


class SyncSource:
    """The run's own sampler, between steps: take the next prompts of the stream, generate `loop.group_size`
    completions each with the run's generator, score them. Weights reach the sampler right after the step."""

    def __init__(self, run):
        self.run = run

    def start(self) -> None:
        pass

    def next_batch(self, trainer_version: int) -> SourceBatch:
        run = self.run
        lcfg = run.cfg.loop
        examples, positions = run.stream.take(lcfg.prompts_per_step)
        prompts = [run.task.encode(run.tokenizer, ex) for ex in examples]
        batch = run.sampler.generate(prompts, lcfg.group_size, generator=run.generator,
                                     policy_version=trainer_version)
        fault_point("generate")  # reliability tests: COVRL_FAULT (no-op otherwise)
        scored = score_rollouts(run.task, run.tokenizer, batch, examples, lcfg.group_size, positions)
        return SourceBatch(scored, examples=tuple(examples))

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


class EpisodeSource(SyncSource):
    """SyncSource for a task with an environment (`task.env.name`): `loop.group_size` multi-turn episodes per
    prompt through the run's sampler (covrl.rollout.episodes), scored by the environment or the task."""

    def next_batch(self, trainer_version: int) -> SourceBatch:
        run = self.run
        lcfg = run.cfg.loop
        examples, positions = run.stream.take(lcfg.prompts_per_step)
        episodes = generate_episodes(run.sampler, run.tokenizer, run.task.environment, examples, lcfg.group_size,
                                     generator=run.generator, chat_template=run.cfg.task.chat_template,
                                     max_turns=run.cfg.task.env.max_turns, policy_version=trainer_version)
        fault_point("generate")
        scored = score_episodes(run.task, run.tokenizer, episodes, examples, lcfg.group_size)
        scored = replace(scored, prompt_index=torch.tensor(positions, dtype=torch.long).repeat_interleave(
            lcfg.group_size))
        return SourceBatch(scored, examples=tuple(examples))


def sync_source(run) -> SyncSource:
    """The in-process source for the run's task: episodes when it has an environment, else completions."""
    return EpisodeSource(run) if getattr(run.task, "environment", None) is not None else SyncSource(run)
