"""Options of the asynchronous loops (`loop.mode=async` local, `loop.mode=ray`), section `async_loop` of the
training config. Everything that measures time is on the data clock: the queue (and with it the staleness bound)
is sized in rollouts; a bound given in steps is converted once, Q = steps x rollouts per step.

The queue size has one name in Python, `queue_rollouts` (`AsyncLoopConfig.queue_rollouts(B)`, the loop state's
`queue_rollouts`, the metric `async/queue_rollouts`); it is `Q` in the docs and is set in YAML with
`async_loop.max_staleness_rollouts` (or `max_staleness_steps`), keys kept for existing configs."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from covrl.settings import Section

__all__ = ["AsyncLoopConfig"]


class AsyncLoopConfig(Section):
    """Asynchronous RL: sampler(s) and trainer run concurrently through a rollout queue with admission control."""

    max_staleness_rollouts: int | None = Field(
        None, ge=0, description="queue size Q in rollouts: a rollout is only started if it will be trained at most "
                                "ceil(Q/B) steps after the weights that generate it (None: use max_staleness_steps)")
    max_staleness_steps: int = Field(
        1, ge=0, description="staleness bound in optimizer steps, converted once to Q = steps x rollouts per step "
                             "(used when max_staleness_rollouts is None); 0 = lockstep, identical to the sync loop")
    drop_older_than_rollouts: int | None = Field(
        None, ge=0, description="discard a finished rollout whose lag exceeds this many rollouts (None: never)")
    chunk_prompts: int | None = Field(
        None, ge=1, description="prompts per generate call (a chunk, whole groups); must divide "
                                "loop.prompts_per_step; None = loop.prompts_per_step")
    local_backend: Literal["thread", "process"] = Field(
        "thread", description="loop.mode=async: the sampler in a thread of the trainer's process, or in "
                              "num_samplers spawned processes (own torch thread budget, no shared GIL)")
    emulate: bool = Field(
        False, description="run the async schedule in one thread (the sampler fills the queue up to the bound "
                           "before every step): deterministic, for experiments; no speed-up")
    sampler_threads: int | None = Field(
        None, ge=1, description="torch CPU threads of each sampler process (Ray actor or local process); None = "
                                "sampler_cpus (a sampler thread shares the trainer's run.num_threads)")
    floor_probe_every: int = Field(
        0, ge=0, description="every this many chunks, measure the engine floor: kl_seq between the sampler and an "
                             "fp32 forward at the same weights on the chunk just generated (0: never)")
    partial_rollouts: bool = Field(
        False, description="weights published while a chunk generates reach it between two decode steps: the live "
                           "rows are prefilled again with the new weights and go on; each token records the version "
                           "that drew it (RolloutBatch.token_versions). local_backend=thread (or emulate); the hf "
                           "sampler between decode steps, vLLM between segments of sampler.vllm.segment_tokens; "
                           "single-turn tasks, and agent programs (task.agent: between calls), not task.env; "
                           "admission and the staleness bound stay by a row's first token "
                           "(docs/async.md)")
    ray_address: str | None = Field(
        None, description="Ray cluster to join (ray.init(address=...)), e.g. 'auto' or 'ray://head:10001'; "
                          "None = start a local Ray instance")
    num_samplers: int = Field(1, ge=1, description="sampler workers generating in parallel (Ray actors, or "
                                                   "processes with local_backend=process)")
    max_worker_restarts: int = Field(
        3, ge=0, description="sampler processes / Ray actors that die are restarted this many times in a run (their "
        "chunk is generated again, same tickets); after that the run stops and can be resumed")
    sampler_cpus: float = Field(1.0, gt=0, description="CPUs reserved per Ray sampler actor")
    sampler_gpus: float = Field(0.0, ge=0, description="GPUs reserved per Ray sampler actor")
    trainer_actor: bool = Field(
        True, description="Ray: run the trainer side in its own actor (placed by Ray; run folder written on its "
                          "node); false = in the driver process")
    trainer_cpus: float = Field(1.0, gt=0, description="CPUs reserved for the Ray trainer actor")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs reserved for the Ray trainer actor")
    ray_temp_dir: str | None = Field(None, description="Ray's session folder (local instance only; keep it short)")

    def queue_rollouts(self, rollouts_per_step: int) -> int:
        """The queue size Q in rollouts: max_staleness_rollouts, else max_staleness_steps x rollouts per step."""
        if self.max_staleness_rollouts is not None:
            return int(self.max_staleness_rollouts)
        return int(self.max_staleness_steps) * int(rollouts_per_step)

    def chunk_size(self, prompts_per_step: int) -> int:
        """Prompts per generate call; must divide prompts_per_step so that steps consume whole chunks."""
        k = self.chunk_prompts or prompts_per_step
        if prompts_per_step % k:
            raise ValueError(f"async_loop.chunk_prompts={k} must divide loop.prompts_per_step={prompts_per_step}")
        return k

    def check_against(self, *, prompts_per_step: int, group_size: int, sync_every: int) -> None:
        """Consistency with the loop: chunks tile a step, and weights synced every k steps leave the sampler up
        to k − 1 steps behind, so the queue must hold at least (k − 1)·B rollouts (else a deadlock)."""
        self.chunk_size(prompts_per_step)
        batch = prompts_per_step * group_size
        queue = self.queue_rollouts(batch)
        need = (sync_every - 1) * batch
        if queue < need:
            raise ValueError(f"async_loop: the queue of {queue} rollouts is smaller than (sampler.sync_every - 1) x "
                             f"rollouts per step = {need}: the sampler would wait for weights that never come; "
                             f"raise async_loop.max_staleness_steps to >= {math.ceil(need / batch)} or set "
                             "sampler.sync_every=1")
