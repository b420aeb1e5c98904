"""Drive one arm of an experiment step by step as a client of covrl.api, as the sync loop does: sample the
next prompts' groups through a `SamplingClient`, score them, `TrainingClient.train_step` (the run's Trainer), push
the new weights (`save_weights_and_get_sampling_client`), a record per step.

An experiment states its arm (`Arm`: config, run folder, optional sampler builder and starting weights), opens
an `ArmRunner` on it (a prepared run, `covrl.train.run.folder.prepare_run`, and `TrainingClient.from_run` over it),
evaluates what it needs through `runner.run`, and calls `runner.drive(...)` with hooks:

    before_step(step)          before the step's batch is generated (e.g. switch a sampler hook on)
    on_batch(step, batch)      after generation, before the update, same weights as the sampler; a returned
                               dict lands in `Step.extra` (e.g. a measurement on the batch)
    record(step: Step) -> dict the step's record (default: step number + the trainer's numeric metrics)
    after_step(step, record)   after the sync; returning True ends the drive (e.g. a token budget is spent)

Every batch comes from `ArmRunner.next_batch` and every weight sync goes through `ArmRunner.sync_weights`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from covrl.api import SamplingClient, TrainingClient
from covrl.train import (
    Run,
    TrainConfig,
    by_group_sizes,
    choose_prompts,
    observe_selection,
    prepare_run,
    score_rollouts,
)


@dataclass
class Arm:
    """One arm of an experiment: its config and run folder; `build_sampler_fn` as for `prepare_run`;
    `init_state` (model weights) is loaded and synced into the sampler before the first step, e.g. the SFT'd
    weights shared by all arms of a seed."""

    cfg: TrainConfig
    run_dir: Path
    build_sampler_fn: Callable | None = None
    init_state: dict | None = None


@dataclass
class Step:
    """What one step did: its 1-based index, the scored batch and its examples, the trainer's metrics, what
    `on_batch` returned, and the wall / process-CPU seconds of its phases."""

    index: int
    batch: Any
    examples: list
    metrics: dict
    extra: dict = field(default_factory=dict)
    wall_generate_s: float = 0.0
    wall_s: float = 0.0
    cpu_generate_s: float = 0.0
    cpu_update_s: float = 0.0
    cpu_sync_s: float = 0.0

    @property
    def cpu_s(self) -> float:
        return self.cpu_generate_s + self.cpu_update_s + self.cpu_sync_s

    @property
    def response_tokens(self) -> int:
        return int(self.batch.response_mask.sum())


def pick(metrics: dict, keys) -> dict[str, float]:
    """The `keys` of the trainer's metrics that are present, as floats."""
    return {k: float(metrics[k]) for k in keys if k in metrics}


def numeric(metrics: dict) -> dict[str, float]:
    """Every numeric metric, as a float."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def default_record(step: Step) -> dict:
    return {"step": step.index, **numeric(step.metrics)}


class ArmRunner:
    """A prepared run of one arm, stepped by `step` / `drive` through `client` (covrl.api); a context manager
    that closes the run."""

    def __init__(self, arm: Arm):
        self.arm = arm
        self.run: Run = prepare_run(arm.cfg, run_dir=arm.run_dir, console=False,
                                    build_sampler_fn=arm.build_sampler_fn)
        self.client = TrainingClient.from_run(self.run)
        self.sampling: SamplingClient = SamplingClient(self.client, self.client.version)  # prepare_run synced
        self.steps_done = 0
        if arm.init_state is not None:
            try:
                self.run.model.load_state_dict(arm.init_state)
                self.sync_weights()
            except BaseException:
                self.run.close()
                raise

    def __enter__(self) -> ArmRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.run.close()

    def sync_weights(self) -> None:
        """The trainer's current weights into the sampler (the one place an arm syncs)."""
        self.sampling = self.client.save_weights_and_get_sampling_client()

    def weights(self) -> dict:
        """A detached copy of the model's current weights."""
        return {k: v.detach().clone() for k, v in self.run.model.state_dict().items()}

    def next_batch(self):
        """(batch, examples): the next scored batch of the run, as the sync loop makes it
        (`covrl.train.run.sources.SyncSource`): the stream's next prompts, `loop.group_size` samples each from the
        sampling client (the run's sampler and generator), scored. The sampler's tensors are made under
        inference mode; they are cloned into normal tensors so that the trainer's autograd can use them."""
        run, loop = self.run, self.run.cfg.loop
        examples, positions, sizes = choose_prompts(run, loop.prompts_per_step, loop.group_size)
        prompts = [run.task.encode(run.tokenizer, ex) for ex in examples]
        if isinstance(sizes, int):
            generated = self.sampling.sample(prompts, sizes).batch
        else:   # adaptive group sizes: one row per completion, grouped by prompt
            rows = [p for p, size in zip(prompts, sizes) for _ in range(size)]
            generated = by_group_sizes(self.sampling.sample(rows, 1).batch, sizes)
        batch = score_rollouts(run.task, run.tokenizer, generated, examples, sizes, positions)
        observe_selection(run, positions, batch, sizes, examples)
        return replace(batch, **{k: v.clone() for k, v in batch.tensor_fields().items()}), list(examples)

    def step(self, on_batch: Callable[[int, Any], dict | None] | None = None) -> Step:
        """One step: generate + score, `on_batch`, `Trainer.step`, sync."""
        index = self.steps_done + 1
        w0, c0 = time.perf_counter(), time.process_time()
        batch, examples = self.next_batch()
        wall_generate, c1 = time.perf_counter() - w0, time.process_time()
        extra = (on_batch(index, batch) or {}) if on_batch is not None else {}
        c2 = time.process_time()
        metrics = self.client.train_step(batch)
        if self.run.sizing_adapter is not None:   # an auto-sized run adapts its sizes here as in the sync loop
            self.run.sizing_adapter.observe({}, batch)
        c3 = time.process_time()
        self.sync_weights()
        c4 = time.process_time()
        self.steps_done = index
        return Step(index=index, batch=batch, examples=examples, metrics=metrics, extra=extra,
                    wall_generate_s=wall_generate, wall_s=time.perf_counter() - w0, cpu_generate_s=c1 - c0,
                    cpu_update_s=c3 - c2, cpu_sync_s=c4 - c3)

    def drive(self, steps: int | None = None, *, before_step: Callable[[int], None] | None = None,
              on_batch: Callable[[int, Any], dict | None] | None = None,
              record: Callable[[Step], dict] = default_record,
              after_step: Callable[[Step, dict], bool | None] | None = None, log: bool = True) -> list[dict]:
        """Up to `steps` steps (None: until `after_step` returns True); each step's record is logged to the
        run's sinks (`log`) and returned in order."""
        if steps is None and after_step is None:
            raise ValueError("drive: give steps, or an after_step that ends the drive")
        records = []
        while steps is None or self.steps_done < steps:
            if before_step is not None:
                before_step(self.steps_done + 1)
            step = self.step(on_batch)
            rec = record(step)
            records.append(rec)
            if log:
                self.run.log(rec)
            if after_step is not None and after_step(step, rec):
                break
        return records
