"""Asynchronous RL loop on a data clock (docs/theory.md §9): sampler(s) and trainer run concurrently through a rollout queue
with admission control (`covrl.train.asyncrl.staleness`). `AsyncSource` is the rollout source the loop driver
(`covrl.train.run.driver.run_loop`) reads from; the trainer side is the driver's, the same as the sync loop's.

    sampler worker(s): newest published weights -> admit a chunk (capacity check) -> generate -> score -> queue
    trainer:           next B rollouts in ticket order -> Trainer.step -> publish weights (every sync_every steps)

Pools of sampler workers (`POOLS`, picked by `async_loop.emulate` / `async_loop.local_backend`, or given as a
factory: the Ray backend's actors): `serial` and `thread` (covrl.train.asyncrl.pools), `process`
(covrl.train.asyncrl.process_pool).

Exactness at staleness 0: with Q = 0 a chunk can only start with the newest weights and only for the next
step; the sampler draws prompts from the same deterministic stream position (ticket / group size) and uses the
run's generator in the same order, so the metrics equal the sync loop's on the same seed.

Checkpoint/resume: the queue (finished chunks with their rollouts and versions) and, for chunks still being
generated, their tickets and the generator state before them are saved with the checkpoint (the source is
registered with the run's checkpointer as "async"); after a resume these chunks are generated again first
(same prompts, same RNG state), so no rollout is lost or trained twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from covrl.rollout import build_sampler
from covrl.rollout.types import batch_from_state, batch_to_state, concat_batches
from covrl.train.asyncrl.config import AsyncLoopConfig
from covrl.train.asyncrl.pools import AsyncState, SamplerPool, SerialPool, ThreadPool
from covrl.train.asyncrl.process_pool import ProcessPool, own_weights
from covrl.train.run.driver import run_loop
from covrl.train.run.folder import Run, prepare_run
from covrl.train.run.sources import SourceBatch
from covrl.train.step.results import StepResult

__all__ = ["POOLS", "AsyncSource", "build_async_sampler", "prepare_async_run", "train_async"]

# pool name -> factory(state); "ray" pools are made by covrl.train.asyncrl.ray_pool (its actors live outside)
POOLS: dict[str, Callable[[AsyncState], SamplerPool]] = {"serial": SerialPool, "thread": ThreadPool,
                                                          "process": ProcessPool}

ASYNC_STATE_KEY = "async"


def _async_checkpoint_state(state: AsyncState, pool: SamplerPool) -> dict[str, Any]:
    """The queue and the sampler's RNG position, weights_only-safe. Chunks still generating are saved as
    descriptors with the generator state before them; finished chunks with their scored rollouts."""
    with state.cond:
        mgr_state = state.manager.state_dict()
        running = [c for c in mgr_state["chunks"] if not c["done"]]
        rng = running[0]["meta"].get("rng_before") if running else None
        if rng is None:
            rng = pool.next_rng_state()
        for c in mgr_state["chunks"]:
            if c["payload"] is not None:
                c["payload"] = batch_to_state(c["payload"])
            c["meta"] = {k: v for k, v in c["meta"].items() if k in ("rng_before", "sampler", "restarted")}
        pool_state = pool.state_dict()
    return {"manager": mgr_state, "sampler_rng": rng, "queue_rollouts": state.queue_rollouts,
            "chunk_rollouts": state.chunk_rollouts, "pool": type(pool).__name__, "pool_state": pool_state}


def _restore_async_state(state: AsyncState, saved: dict[str, Any]) -> None:
    run = state.run
    mgr = state.manager
    if int(saved["chunk_rollouts"]) != state.chunk_rollouts:
        raise ValueError(f"resume: the checkpoint's chunks hold {saved['chunk_rollouts']} rollouts, this config "
                         f"{state.chunk_rollouts}; keep loop.prompts_per_step, loop.group_size and "
                         "async_loop.chunk_prompts unchanged across a resume")
    ms = saved["manager"]
    for c in ms["chunks"]:
        if c["payload"] is not None:
            c["payload"] = batch_from_state(c["payload"])
    mgr.load_state_dict(ms)
    run.generator.set_state(saved["sampler_rng"])


class AsyncSource:
    """Rollouts from a pool of sampler workers through the staleness queue (see the module docstring)."""

    def __init__(self, run: Run, acfg: AsyncLoopConfig | None = None, *, pool: str | None = None,
                 pool_factory: Callable[[AsyncState], SamplerPool] | None = None):
        acfg = acfg or run.cfg.async_loop
        if getattr(run.sampler, "shares_weights", False):
            raise ValueError("the async loop needs a sampler with its own copy of the weights; build it with "
                             "sampler.share_weights='never' (covrl.train.asyncrl.source.prepare_async_run does)")
        self.run = run
        self.state = state = AsyncState(run, acfg)
        mgr = state.manager   # a fresh queue starts at the data clock (a sync-written checkpoint resumes so too)
        mgr.accepted = mgr.consumed = mgr.next_ticket = run.trainer.rollouts
        # the sampler holds the trainer's (checkpoint) weights at the trainer's version
        run.sampler.load_weights(run.model, run.trainer.version)
        name = pool or ("serial" if acfg.emulate else acfg.local_backend) if pool_factory is None else "ray"
        if acfg.partial_rollouts:
            _check_partial_rollouts(run.cfg, name)
        if run.cfg.task.agent.enabled:
            # serial / thread pools: the run's sampler serves the agent's endpoint (with partial rollouts it takes
            # newer weights between calls); process / Ray workers each serve one around their own sampler
            # (process_pool.SamplerWorker), and the run's plays evaluations
            from covrl.train.run.agent_source import attach_agent

            attach_agent(run)
        if pool_factory is None:
            if name not in POOLS:
                raise ValueError(f"unknown async pool {name!r}; allowed: {', '.join(POOLS)}")
            pool_factory = POOLS[name]
        self.pool = pool_factory(state)
        state.num_samplers = self.pool.num_samplers
        run.register(ASYNC_STATE_KEY, self)     # restores the queue, RNG and workers' positions on a resume
        state.start_consumed = mgr.consumed
        self.pool.sync_probe(run.model)
        self._stopped = False
        self._failure: BaseException | None = None

    # -- checkpointer ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return _async_checkpoint_state(self.state, self.pool)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        _restore_async_state(self.state, saved)
        self.pool.load_state_dict(saved.get("pool_state"))

    # -- RolloutSource -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.state.started = time.perf_counter()
        self.pool.start()

    def next_batch(self, trainer_version: int) -> SourceBatch:
        res = self.pool.next_batch(trainer_version)
        batch = concat_batches([c.payload for c in res.chunks], self.state.pad_id)
        metrics = {**res.metrics, **token_lag_metrics(batch, trainer_version)}
        if self.state.dynamic:   # filtered chunks leave gaps in the group ids: 0..G-1 for the trainer
            batch = replace(batch, group_ids=torch.unique_consecutive(batch.group_ids, return_inverse=True)[1])
            metrics.update(self._dynamic_metrics())
        return SourceBatch(batch, metrics)

    def _dynamic_metrics(self) -> dict[str, float]:
        """The sync loop's dynamic/* keys on the async data clock: rollouts generated (every completed chunk)
        and trained (consumed), groups dropped for want of contrast (all time) and the share kept."""
        mgr, n = self.state.manager, self.state.group_size
        trained = mgr.consumed   # this batch included
        generated = mgr.accepted + mgr.filtered + mgr.dropped
        return {"dynamic/generated_rollouts": float(generated), "dynamic/trained_rollouts": float(trained),
                "dynamic/dropped_groups": float(mgr.filtered // n),
                "dynamic/keep_rate": mgr.accepted / max(generated, 1)}

    def step_done(self, result: StepResult) -> None:
        st = self.state
        if result.skipped:   # no new policy version: admission must not wait for one
            with st.cond:
                st.manager.batch_skipped()
                st.cond.notify_all()
        # the data position of a consumed batch, as in the sync loop (prompts handed to the trainer); with dynamic
        # sampling the first prompt not yet trained or filtered (the trainer's count trails the stream's)
        self.run.stream.position = (st.manager.frontier_ticket if st.dynamic else self.run.trainer.rollouts) \
            // st.group_size

    def publish(self, model, version: int) -> None:
        # a fully_shard-ed trainer (fsdp2) holds shards: gather the full weights here, in the loop's thread (a
        # collective the other ranks join between steps), so that no sampler thread ever starts one
        self.pool.publish(self.run.trainer.full_weights() if self.run.trainer.sharded else model, version)

    def step_metrics(self, result: StepResult) -> dict[str, float]:
        st = self.state
        wall = max(time.perf_counter() - st.started, 1e-9)
        with st.cond:
            depth, outstanding = st.manager.queue_depth, st.manager.outstanding
            consumed = st.manager.consumed - st.start_consumed
        n = st.num_samplers
        out = {
            "async/queue_depth": float(depth), "async/outstanding": float(outstanding),
            "async/queue_rollouts": float(st.queue_rollouts),
            "async/sampler_idle_frac": min(1.0, st.sampler_idle_s / (wall * n)),
            "async/trainer_idle_frac": min(1.0, st.trainer_idle_s / wall),
            "async/rollouts_per_s": consumed / wall,
            "async/sampler_version": float(getattr(self.run.sampler, "version", -1)),
            "async/worker_restarts": float(st.worker_restarts),
        }
        if "kl_seq" in result.metrics:
            out["gap/total"] = result.metrics["kl_seq"]
            if st.floor_ema is not None:
                out["gap/floor"] = st.floor_ema
                out["gap/staleness"] = result.metrics["kl_seq"] - st.floor_ema
        return out

    def evaluate(self, label: str) -> dict[str, Any]:
        try:
            return self.pool.evaluate(label)
        finally:
            if self._stopped and self.run.agent is not None:   # the evaluation after the loop: its endpoint
                self.run.agent.close()

    def waiting_for(self) -> str:
        st = self.state
        with st.cond:
            mgr = st.manager
            text = (f"the queue holds {mgr.queue_depth} finished rollouts of the {st.batch_rollouts} a step takes, "
                    f"{mgr.outstanding} admitted; sampler(s): {st.num_samplers}, at version "
                    f"{getattr(self.run.sampler, 'version', '?')}, trainer at {self.run.trainer.version}")
        if st.error is not None:
            text += f"; a sampler worker failed: {st.error!r}"
        if self.run.agent is not None:   # task.agent: the sampler thread plays episodes through the endpoint
            text += f"; {self.run.agent.waiting_for()}"
        return text

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self.pool.stop()
            if self.run.agent is not None:
                self.run.agent.close()

    def failure(self) -> BaseException | None:
        if self._failure is None and self.state.error is not None:
            self._failure = self.state.failure()
        return self._failure

    def summary(self) -> dict[str, Any]:
        st = self.state
        wall = max(time.perf_counter() - st.started, 1e-9)
        consumed = st.manager.consumed - st.start_consumed
        return {**(self.run.agent.summary() if self.run.agent is not None else {}), "async": {
            "pool": type(self.pool).__name__, "queue_rollouts": st.queue_rollouts,
            "staleness_bound_steps": st.manager.staleness_bound_steps,
            "rollouts_consumed": consumed, "wall_s": wall, "rollouts_per_s": consumed / wall,
            "sampler_idle_frac": st.sampler_idle_s / (wall * st.num_samplers),
            "trainer_idle_frac": st.trainer_idle_s / wall, "dropped_rollouts": st.manager.dropped,
            "floor_kl_seq": st.floor_mean, "floor_probes": st.floor_samples,
        }}


def _check_partial_rollouts(cfg, pool: str) -> None:
    """Partial rollouts need a sampler that takes weights between decode steps in the trainer's process."""
    if pool not in ("serial", "thread"):
        raise ValueError(f"async_loop.partial_rollouts=true needs async_loop.local_backend=thread (loop.mode="
                         f"async); the {pool!r} sampler workers take weights between chunks only")
    if cfg.sampler.compile:
        raise ValueError("async_loop.partial_rollouts=true needs the hf sampler's eager decode loop "
                         "(sampler.compile=false) or sampler.backend=vllm")
    if cfg.task.env.name:
        raise ValueError("async_loop.partial_rollouts=true: multi-turn episodes (task.env) are not supported")


def token_lag_metrics(batch, trainer_version: int) -> dict[str, float]:
    """The staleness ledger by token: lag = trainer version − the version that drew the token, over the
    model's tokens; rows drawn by more than one version (a push landed mid-generation)."""
    mask = batch.train_mask > 0
    versions = batch.versions_per_token
    lag = (int(trainer_version) - versions[mask]).float()
    if not lag.numel():
        return {}
    first = versions.masked_fill(~mask, torch.iinfo(versions.dtype).max).amin(1)
    last = versions.masked_fill(~mask, torch.iinfo(versions.dtype).min).amax(1)
    rows = mask.any(1)
    return {"async/token_lag_mean": float(lag.mean()), "async/token_lag_max": float(lag.max()),
            "async/mixed_rows_frac": float(((last > first) & rows).float().sum() / rows.float().sum().clamp(min=1))}


def train_async(run: Run, *, acfg: AsyncLoopConfig | None = None, pool: str | None = None,
                stop_after: int | None = None, pool_factory=None) -> dict[str, Any]:
    """Run the async loop until `loop.steps` steps are done (or `stop_after` more steps). `pool`: a `POOLS`
    name (default: "serial" with `async_loop.emulate`, else `async_loop.local_backend`), or a
    `pool_factory(state)` (Ray). Evaluation and checkpoints follow the data clock exactly as in the sync loop.
    Returns the summary."""
    return run_loop(run, AsyncSource(run, acfg, pool=pool, pool_factory=pool_factory), stop_after=stop_after)


def build_async_sampler(cfg, model, tokenizer):
    """The configured sampler backend with its own copy of the weights (async loops must not share them)."""
    return build_sampler(own_weights(cfg), model, tokenizer)


def prepare_async_run(cfg, **kwargs) -> Run:
    """`prepare_run` with a sampler that owns its weights."""
    return prepare_run(cfg, build_sampler_fn=build_async_sampler, **kwargs)
