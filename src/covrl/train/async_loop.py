"""Asynchronous RL loop on a data clock (RESEARCH §9): sampler(s) and trainer run concurrently through a rollout
queue with admission control (`covrl.train.staleness`).

    sampler worker(s): newest published weights -> admit a chunk (capacity check) -> generate -> score -> queue
    trainer:           next B rollouts in ticket order -> Trainer.step -> publish weights (every sync_every steps)

Backends ("pools" of sampler workers; the trainer side below is shared):
- `SerialPool`  (`async_loop.emulate=true`): one thread; before each step the sampler fills the queue up to the
  bound. Deterministic: the reference schedule of a saturated queue (used by the reproduction).
- `ThreadPool`  (`loop.mode=async`): one sampler thread beside the trainer, each running torch ops with the GIL
  released. Weights are handed over as a cloned state dict; the sampler loads them between chunks.
- `RayPool`     (`loop.mode=ray`, `covrl.train.ray_backend`): sampler actors, weights through the object store.

Exactness at staleness 0: with Q = 0 a chunk can only start with the newest weights and only for the next
step; the sampler draws prompts from the same deterministic stream position (ticket / group size) and uses the
run's generator in the same order, so the metrics equal the sync loop's on the same seed.

Checkpoint/resume: the queue (finished chunks with their rollouts and versions) and, for chunks still being
generated, their tickets and the generator state before them are saved with the checkpoint; after a resume these
chunks are generated again first (same prompts, same RNG state), so no rollout is lost or trained twice.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import fields
from typing import Any

import torch

from covrl.rollout.types import RolloutBatch
from covrl.train.async_config import AsyncLoopConfig
from covrl.train.staleness import Chunk, StalenessManager, TakeResult

__all__ = ["AsyncState", "SerialPool", "ThreadPool", "batch_from_state", "batch_to_state", "concat_batches",
           "train_async"]

TIMING_PREFIXES = ("time/", "async/")        # keys that legitimately differ between sync and async runs


# ------------------------------------------------------------------------------------------------ batches

def _pad_right(x: torch.Tensor, width: int, value: float = 0) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1], *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def _pad_left(x: torch.Tensor, width: int, value: float = 0) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1], *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x], dim=1)


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Stack chunks into one batch: prompts left-padded and responses right-padded to common widths, group ids
    offset so that groups stay distinct, per-row `info` lists concatenated, per-chunk timings summed."""
    if not batches:
        raise ValueError("concat_batches: no batches")
    if len(batches) == 1:
        return batches[0]
    P = max(b.prompt_ids.shape[1] for b in batches)
    T = max(b.response_ids.shape[1] for b in batches)
    out: dict[str, Any] = {}
    offset, gids = 0, []
    for b in batches:
        gids.append(b.group_ids + offset)
        offset += int(b.group_ids.max()) + 1 if len(b) else 0
    out["group_ids"] = torch.cat(gids)
    out["prompt_ids"] = torch.cat([_pad_left(b.prompt_ids, P, pad_id) for b in batches])
    out["prompt_mask"] = torch.cat([_pad_left(b.prompt_mask, P) for b in batches])
    out["response_ids"] = torch.cat([_pad_right(b.response_ids, T, pad_id) for b in batches])
    for name in ("response_mask", "sampler_logprobs", "sampler_topk_ids", "sampler_topk_logprobs"):
        parts = [getattr(b, name) for b in batches]
        out[name] = None if any(p is None for p in parts) else torch.cat([_pad_right(p, T) for p in parts])
    out["policy_version"] = torch.cat([b.policy_version for b in batches])
    rewards = [b.rewards for b in batches]
    if any(r is None for r in rewards):
        out["rewards"] = None
    elif rewards[0].dim() == 1:
        out["rewards"] = torch.cat(rewards)
    else:
        out["rewards"] = torch.cat([_pad_right(r, T) for r in rewards])
    idx = [b.prompt_index for b in batches]
    out["prompt_index"] = None if any(i is None for i in idx) else torch.cat(idx)
    info: dict[str, Any] = {}
    for b in batches:
        for k, v in b.info.items():
            if isinstance(v, list) and len(v) == len(b):
                info.setdefault(k, []).extend(v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and k.endswith("_s"):
                info[k] = info.get(k, 0.0) + v
            else:
                info.setdefault(k, v)
    out["info"] = info
    return RolloutBatch(**out)


def batch_to_state(batch: RolloutBatch) -> dict[str, Any]:
    """A RolloutBatch as a dict of tensors / plain values (loadable with torch.load(weights_only=True))."""
    state = {f.name: getattr(batch, f.name) for f in fields(batch) if f.name != "info"}
    state["info"] = {k: v for k, v in batch.info.items()
                     if isinstance(v, (int, float, str, bool, type(None), list, torch.Tensor))}
    return state


def batch_from_state(state: dict[str, Any]) -> RolloutBatch:
    return RolloutBatch(**state)


# ----------------------------------------------------------------------------------------- shared state

class SamplerWorkerError(RuntimeError):
    """A sampler worker (thread, process or Ray actor) died; the run stops and can be resumed."""

class AsyncState:
    """What sampler workers and the trainer share: the staleness manager under one condition variable, the
    newest published weights, timing counters and the chunk -> prompts mapping."""

    def __init__(self, run, acfg: AsyncLoopConfig):
        cfg = run.cfg
        lcfg = cfg.loop
        acfg.check_against(prompts_per_step=lcfg.prompts_per_step, group_size=lcfg.group_size,
                           sync_every=cfg.sampler.sync_every)
        self.run = run
        self.acfg = acfg
        self.group_size = lcfg.group_size
        self.chunk_prompts = acfg.chunk_size(lcfg.prompts_per_step)
        self.chunk_rollouts = self.chunk_prompts * lcfg.group_size
        self.batch_rollouts = lcfg.rollouts_per_step
        self.queue_rollouts = acfg.queue_rollouts(self.batch_rollouts)
        self.manager = StalenessManager(self.batch_rollouts, self.queue_rollouts,
                                        drop_older_than_rollouts=acfg.drop_rollouts())
        self.cond = threading.Condition()
        self.stop = False
        self.error: BaseException | None = None
        self.published: tuple[Any, int] | None = None     # (weights, version)
        self.sampler_idle_s = 0.0
        self.sampler_busy_s = 0.0
        self.trainer_idle_s = 0.0
        self.started = time.perf_counter()
        self.floor_ema: float | None = None
        self.floor_last: float | None = None
        self.floor_samples = 0
        self.floor_sum = 0.0
        self.chunks_generated = 0
        self.worker_restarts = 0
        self.num_samplers = 1
        self.start_consumed = 0
        self.pad_id = int(run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None
                          else run.tokenizer.eos_token_id)

    # chunk -> prompts: the stream position of the chunk's first prompt is its first ticket / group size, so the
    # prompt order is the sync loop's and a resumed run continues exactly where the data clock stands.
    def chunk_examples(self, chunk: Chunk) -> tuple[list, list[int]]:
        first = chunk.ticket // self.group_size
        positions = list(range(first, first + chunk.size // self.group_size))
        stream = self.run.stream
        return [stream.items[stream.index_at(p)] for p in positions], positions

    def record_floor(self, value: float) -> None:
        self.floor_last = value
        self.floor_samples += 1
        self.floor_sum += value
        self.floor_ema = value if self.floor_ema is None else 0.8 * self.floor_ema + 0.2 * value

    @property
    def floor_mean(self) -> float | None:
        return self.floor_sum / self.floor_samples if self.floor_samples else None

    def fail(self, err: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = err
            self.stop = True
            self.cond.notify_all()

    def request_stop(self) -> None:
        """Tell the sampler side to stop admitting and generating chunks."""
        with self.cond:
            self.stop = True
            self.cond.notify_all()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise SamplerWorkerError(f"async sampler worker failed: {self.error!r}") from self.error


def clone_weights(model) -> dict[str, torch.Tensor]:
    """A snapshot of the trainer's weights that later optimizer steps do not modify."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def floor_probe(reference_model, batch: RolloutBatch, temperature: float) -> float:
    """Engine floor on one generated chunk: kl_seq = mean_b Σ_t k3(ρ_t), ρ_t = p_ref(y_t)/q(y_t), where p_ref is an
    fp32 forward at the weights that generated the chunk and q the sampler's log-probs (RESEARCH §5, §9)."""
    from covrl.train.trainer import forward_response

    with torch.no_grad():
        fwd = forward_response(reference_model, batch, temperature, with_stats=False)
    mask = batch.response_mask.float()
    lr = (fwd.logprobs.float() - batch.sampler_logprobs.float()).clamp(-20, 20)
    k3 = (lr.exp() - 1 - lr) * mask
    return float(k3.sum(1).mean())


def generate_chunk(sampler, task, tokenizer, examples: list, positions: list[int], group_size: int,
                   generator: torch.Generator, version: int) -> tuple[RolloutBatch, dict[str, float]]:
    """Generate and score one chunk (whole groups); returns the scored batch and the task metrics."""
    from covrl.train.loop import score_rollouts

    prompts = [task.encode(tokenizer, ex) for ex in examples]
    t0 = time.perf_counter()
    batch = sampler.generate(prompts, group_size, generator=generator, policy_version=version)
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    task_metrics = score_rollouts(task, tokenizer, batch, examples, group_size, positions)
    batch.info["generate_s"] = t_gen
    batch.info["score_s"] = time.perf_counter() - t0
    return batch, task_metrics


# ------------------------------------------------------------------------------------------------- pools

class _LocalWorkerMixin:
    """Generation of one chunk by the run's own sampler (serial and thread pools)."""

    state: AsyncState

    def _generate(self, chunk: Chunk) -> None:
        st = self.state
        run = st.run
        if chunk.meta.get("restarted") and chunk.meta.get("rng_before") is not None:
            run.generator.set_state(chunk.meta["rng_before"])
        examples, positions = st.chunk_examples(chunk)
        batch, task_metrics = generate_chunk(run.sampler, run.task, run.tokenizer, examples, positions,
                                             st.group_size, run.generator, chunk.version)
        batch.info["task_metrics"] = task_metrics
        self._maybe_probe(batch)
        with st.cond:
            st.manager.complete(chunk, batch)
            st.chunks_generated += 1
            st.cond.notify_all()

    def _maybe_probe(self, batch: RolloutBatch) -> None:
        st = self.state
        every = st.acfg.floor_probe_every
        if not every or st.chunks_generated % every:
            return
        run = st.run
        ref = getattr(self, "_probe_model", None)
        if ref is None:
            ref = self._probe_model = copy.deepcopy(run.model).float().eval()
            for p in ref.parameters():
                p.requires_grad_(False)
        weights = self._probe_weights
        if weights is not None:
            ref.load_state_dict(weights, strict=True)
        st.record_floor(floor_probe(ref, batch, float(run.cfg.sampler.temperature)))

    _probe_weights: dict | None = None

    def _admit(self, version: int) -> Chunk | None:
        """Under the lock: admit the next chunk (a chunk left from a resume first), recording the generator
        state before it (for resume)."""
        st = self.state
        return st.manager.try_start(st.chunk_rollouts, version,
                                    meta={"rng_before": st.run.generator.get_state(), "sampler": 0})


class SerialPool(_LocalWorkerMixin):
    """Deterministic emulation: before each step, generate chunks while admission allows (a saturated queue)."""

    def __init__(self, state: AsyncState):
        self.state = state

    def start(self) -> None:
        pass

    def publish(self, model, version: int) -> None:
        self.state.run.sampler.load_weights(model, version)
        if self.state.acfg.floor_probe_every:
            self._probe_weights = clone_weights(model)

    def next_batch(self, trainer_version: int) -> TakeResult:
        st = self.state
        sampler = st.run.sampler
        while (chunk := self._admit(sampler.version)) is not None:   # a sampler infinitely faster than training
            self._generate(chunk)
        if not st.manager.ready(trainer_version):
            raise RuntimeError("async emulation stalled: the queue is full and the next batch is incomplete")
        return st.manager.take(trainer_version)

    def evaluate(self, label: str):
        return self.state.run.run_eval(label)

    def stop(self) -> None:
        pass


class ThreadPool(_LocalWorkerMixin):
    """One sampler thread beside the trainer (local backend). The sampler loads the newest published weights
    between chunks; generation never waits for the trainer except when admission control says so."""

    def __init__(self, state: AsyncState):
        self.state = state
        self.sampler_lock = threading.Lock()      # held while the sampler generates or loads weights
        self.thread = threading.Thread(target=self._loop, name="covrl-sampler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def publish(self, model, version: int) -> None:
        weights = clone_weights(model)
        with self.state.cond:
            self.state.published = (weights, int(version))
            self.state.cond.notify_all()

    def _sync_weights(self) -> None:
        st = self.state
        pub = st.published
        sampler = st.run.sampler
        if pub is not None and pub[1] > sampler.version:
            with self.sampler_lock:
                sampler.load_weights(pub[0], pub[1])
                if st.acfg.floor_probe_every:
                    self._probe_weights = pub[0]

    def _loop(self) -> None:
        st = self.state
        sampler = st.run.sampler
        try:
            while True:
                self._sync_weights()
                t_wait = time.perf_counter()
                with st.cond:
                    chunk = None
                    while not st.stop:
                        pub = st.published
                        if pub is not None and pub[1] > sampler.version:
                            break                      # newer weights: load them before admitting
                        chunk = self._admit(sampler.version)
                        if chunk is not None:
                            break
                        st.cond.wait(timeout=1.0)
                    st.sampler_idle_s += time.perf_counter() - t_wait
                    if st.stop:
                        return
                if chunk is None:
                    continue
                t0 = time.perf_counter()
                with self.sampler_lock:
                    self._generate(chunk)
                st.sampler_busy_s += time.perf_counter() - t0
        except BaseException as err:  # surface in the trainer thread
            st.fail(err)

    def next_batch(self, trainer_version: int) -> TakeResult:
        st = self.state
        t0 = time.perf_counter()
        with st.cond:
            while not st.manager.ready(trainer_version):
                st.raise_if_failed()
                if not self.thread.is_alive():
                    raise RuntimeError("the sampler thread stopped")
                st.cond.wait(timeout=1.0)
            res = st.manager.take(trainer_version)
            st.cond.notify_all()
        st.trainer_idle_s += time.perf_counter() - t0
        return res

    def evaluate(self, label: str):
        """Evaluate the trainer's current weights: the sampler is paused and synced first (as the sync loop
        evaluates right after its weight sync)."""
        run = self.state.run
        with self.sampler_lock:
            if run.sampler.version < run.trainer.version:
                run.sampler.load_weights(run.model, run.trainer.version)
                if self.state.acfg.floor_probe_every:   # the floor probe follows the sampler's weights
                    self._probe_weights = clone_weights(run.model)
            return run.run_eval(label)

    def stop(self) -> None:
        self.state.request_stop()
        if self.thread.is_alive():
            self.thread.join(timeout=600)


POOLS = {"serial": SerialPool, "thread": ThreadPool}


# ------------------------------------------------------------------------------------------ trainer side

ASYNC_STATE_KEY = "async"


def _async_checkpoint_state(state: AsyncState, pool) -> dict[str, Any]:
    """The queue and the sampler's RNG position, weights_only-safe. Chunks still generating are saved as
    descriptors with the generator state before them; finished chunks with their scored rollouts."""
    with state.cond:
        mgr_state = state.manager.state_dict()
        running = [c for c in mgr_state["chunks"] if not c["done"]]
        rng = running[0]["meta"].get("rng_before") if running else None
        if rng is None:
            rng = state.run.generator.get_state()
        for c in mgr_state["chunks"]:
            if c["payload"] is not None:
                payload = batch_to_state(c["payload"])
                payload["info"] = {k: v for k, v in payload["info"].items() if k != "task_metrics"} | {
                    "task_metrics": dict(c["payload"].info.get("task_metrics", {}))}
                c["payload"] = payload
            c["meta"] = {k: v for k, v in c["meta"].items() if k in ("rng_before", "sampler", "restarted")}
        pool_state = pool.extra_state() if hasattr(pool, "extra_state") else None
    return {"manager": mgr_state, "sampler_rng": rng, "queue_rollouts": state.queue_rollouts,
            "chunk_rollouts": state.chunk_rollouts, "pool": type(pool).__name__, "pool_state": pool_state}


def _restore_async_state(state: AsyncState, saved: dict[str, Any] | None) -> None:
    run = state.run
    mgr = state.manager
    if saved is None:   # fresh run, or a checkpoint written by the sync loop: the queue starts empty
        mgr.accepted = mgr.consumed = mgr.next_ticket = run.trainer.rollouts
        return
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


def _step_record(run, trainer, batch: RolloutBatch, res: TakeResult, metrics: dict[str, float],
                 state: AsyncState, t_step: float, t_sync: float) -> dict[str, Any]:
    """The sync loop's per-step record (same keys and values at staleness 0) plus the async metrics."""
    chunk_metrics = [c.payload.info.get("task_metrics", {}) for c in res.chunks]
    task_metrics: dict[str, float] = {}
    for m in chunk_metrics:     # chunk-weighted means (all chunks have the same size)
        for k, v in m.items():
            task_metrics[k] = task_metrics.get(k, 0.0) + v / len(chunk_metrics)
    t_gen = sum(float(c.payload.info.get("generate_s", 0.0)) for c in res.chunks)
    t_score = sum(float(c.payload.info.get("score_s", 0.0)) for c in res.chunks)
    step_s = time.perf_counter() - t_step
    record: dict[str, Any] = {"step": run.step, **metrics, **task_metrics}
    record.update({
        "time/generate": t_gen, "time/score": t_score, "time/sync": t_sync, "time/step": step_s,
        "tokens_per_s": float(batch.num_response_tokens) / max(step_s, 1e-9),
        "generate_tokens_per_s": float(batch.num_response_tokens) / max(t_gen, 1e-9),
        "epoch": run.stream.epoch, "policy_version": float(trainer.version),
        "staleness": float(trainer.version - 1 - batch.policy_version.float().mean())
        if metrics.get("skipped") == 0.0 else 0.0,
    })
    wall = max(time.perf_counter() - state.started, 1e-9)
    with state.cond:
        depth, outstanding = state.manager.queue_depth, state.manager.outstanding
        consumed = state.manager.consumed - state.start_consumed
    n_samplers = state.num_samplers
    record.update(res.metrics)
    record.update({
        "async/queue_depth": float(depth), "async/outstanding": float(outstanding),
        "async/queue_rollouts": float(state.queue_rollouts),
        "async/sampler_idle_frac": min(1.0, state.sampler_idle_s / (wall * n_samplers)),
        "async/trainer_idle_frac": min(1.0, state.trainer_idle_s / wall),
        "async/rollouts_per_s": consumed / wall,
        "async/sampler_version": float(getattr(run.sampler, "version", -1)),
        "async/worker_restarts": float(state.worker_restarts),
    })
    if "kl_seq" in metrics:
        record["gap/total"] = metrics["kl_seq"]
        if state.floor_ema is not None:
            record["gap/floor"] = state.floor_ema
            record["gap/staleness"] = metrics["kl_seq"] - state.floor_ema
    return record


def train_async(run, *, acfg: AsyncLoopConfig | None = None, pool: str | None = None,
                stop_after: int | None = None, pool_factory=None) -> dict[str, Any]:
    """Run the async loop until `loop.steps` steps are done (or `stop_after` more steps). `pool`: "thread"
    or "process" (`async_loop.local_backend`), "serial" (`async_loop.emulate`), or a `pool_factory(state)`
    (Ray).
    Evaluation and checkpoints follow the data clock exactly as in the sync loop. Returns the summary."""
    from covrl.train import checkpoint as ckpt
    from covrl.train.trainer import TrainingDivergedError

    cfg = run.cfg
    lcfg = cfg.loop
    acfg = acfg or getattr(cfg, "async_loop", None) or AsyncLoopConfig()
    trainer = run.trainer
    if getattr(run.sampler, "shares_weights", False):
        raise ValueError("the async loop needs a sampler with its own copy of the weights; build it with "
                         "sampler.share_weights='never' (covrl.train.async_loop.prepare_async_run does)")
    state = AsyncState(run, acfg)
    saved = None
    if run.resumed_from:
        saved = ckpt.load_state(run.resumed_from).get(ASYNC_STATE_KEY)
    _restore_async_state(state, saved)
    # the sampler holds the trainer's (checkpoint) weights at the trainer's version
    run.sampler.load_weights(run.model, trainer.version)
    start_consumed = state.start_consumed = state.manager.consumed
    pool_name = pool or ("serial" if acfg.emulate else acfg.local_backend)
    if pool_factory is None and pool_name == "process":
        from covrl.train.worker_pool import ProcessPool

        pool_factory = ProcessPool
    if pool_factory is None and pool_name not in POOLS:
        raise ValueError(f"unknown async pool {pool_name!r}; allowed: {', '.join([*POOLS, 'process'])}")
    worker_pool = pool_factory(state) if pool_factory is not None else POOLS[pool_name](state)
    state.num_samplers = getattr(worker_pool, "num_samplers", 1)
    if hasattr(worker_pool, "load_extra_state"):
        worker_pool.load_extra_state(saved.get("pool_state") if saved else None)
    if acfg.floor_probe_every and hasattr(worker_pool, "_probe_weights"):
        worker_pool._probe_weights = clone_weights(run.model)

    original_state_fn = run.checkpoint_state

    def checkpoint_state() -> dict[str, Any]:
        out = original_state_fn()
        out[ASYNC_STATE_KEY] = _async_checkpoint_state(state, worker_pool)
        return out

    run.checkpoint_state = checkpoint_state      # the Run saves the loop's extra state with each checkpoint
    if run.step == 0 and not run.evals and cfg.eval.before:
        run.run_eval("before")
    done_now = 0
    state.started = time.perf_counter()
    worker_pool.start()
    try:
        while run.step < lcfg.steps and (stop_after is None or done_now < stop_after):
            t_step = time.perf_counter()
            res = worker_pool.next_batch(trainer.version)
            batch = concat_batches([c.payload for c in res.chunks], state.pad_id)
            metrics = trainer.step(batch)
            if metrics.get("skipped"):   # no new policy version: admission must not wait for one
                with state.cond:
                    state.manager.batch_skipped()
                    state.cond.notify_all()
            run.step += 1
            done_now += 1
            # the data position of a consumed batch, as in the sync loop (prompts handed to the trainer)
            run.stream.position = trainer.rollouts // state.group_size
            t0 = time.perf_counter()
            if run.step % cfg.sampler.sync_every == 0 or run.step == lcfg.steps:
                worker_pool.publish(run.model, trainer.version)
            t_sync = time.perf_counter() - t0
            record = _step_record(run, trainer, batch, res, metrics, state, t_step, t_sync)
            if trainer.last_skip_reason:
                record["skip_reason"] = trainer.last_skip_reason
                run.message(f"step {run.step}: skipped ({trainer.last_skip_reason})")
            run.log(record)
            every = cfg.eval.every_rollouts
            if every and trainer.rollouts // every > run.last_eval_rollouts // every:
                worker_pool.evaluate(f"rollouts-{trainer.rollouts}")
            run.last_eval_rollouts = trainer.rollouts
            run.maybe_checkpoint()
    except TrainingDivergedError as err:
        worker_pool.stop()
        # the step that raised consumed its rollouts and was skipped like the ones before it: log it too
        run.step += 1
        run.log({"step": run.step, **err.metrics, "skip_reason": trainer.last_skip_reason})
        run.status = "diverged"
        run.message(f"training stopped: {err}")
        run.finish()
        raise
    except KeyboardInterrupt:
        worker_pool.stop()
        run.status = "interrupted"
        run.finish()
        raise
    except BaseException:
        worker_pool.stop()
        if state.error is not None:    # a dead sampler worker: record it in summary.json before raising
            run.status = "failed"
            run.message(f"training stopped: async sampler worker failed: {state.error!r}")
            run.finish()
        raise
    worker_pool.stop()
    if state.error is not None:
        run.status = "failed"
        run.finish()
    state.raise_if_failed()
    finished = run.step >= lcfg.steps
    if finished:
        if cfg.eval.after:
            if run.sampler.version < trainer.version:
                run.sampler.load_weights(run.model, trainer.version)
            run.run_eval("after")
        run.status = "completed"
    else:
        run.status = "stopped"
    if cfg.checkpoint.at_end and trainer.rollouts != run.last_ckpt_rollouts:
        run.save_checkpoint()
    summary = run.finish()
    wall = max(time.perf_counter() - state.started, 1e-9)
    summary["async"] = {
        "pool": type(worker_pool).__name__, "queue_rollouts": state.queue_rollouts,
        "staleness_bound_steps": state.manager.staleness_bound_steps,
        "rollouts_consumed": state.manager.consumed - start_consumed, "wall_s": wall,
        "rollouts_per_s": (state.manager.consumed - start_consumed) / wall,
        "sampler_idle_frac": state.sampler_idle_s / (wall * state.num_samplers),
        "trainer_idle_frac": state.trainer_idle_s / wall, "dropped_rollouts": state.manager.dropped,
        "floor_kl_seq": state.floor_mean, "floor_probes": state.floor_samples,
    }
    return summary


def build_async_sampler(cfg, model, tokenizer):
    """The configured sampler backend with its own copy of the weights (async loops must not share them)."""
    from covrl.rollout import build_sampler

    return build_sampler(cfg.model_copy(update={"share_weights": "never"}), model, tokenizer)


def prepare_async_run(cfg, **kwargs):
    """`prepare_run` with a sampler that owns its weights."""
    from covrl.train.run import prepare_run

    return prepare_run(cfg, build_sampler_fn=build_async_sampler, **kwargs)


def _sync_functions():
    from covrl.train.loop import train_sync
    from covrl.train.run import prepare_run

    return prepare_run, train_sync


def _async_functions():
    return prepare_async_run, train_async


# loop.mode -> () -> (prepare(cfg, config_path=..., resume=...) -> Run, train(run) -> summary); "ray" is driven by
# covrl.train.ray_backend.train_from_config_ray (its trainer side may live in an actor).
LOOP_MODES = {"sync": _sync_functions, "async": _async_functions}


def loop_functions(mode: str):
    """(prepare, train) of a loop mode (see LOOP_MODES)."""
    if mode not in LOOP_MODES:
        raise ValueError(f"loop.mode={mode!r} has no local loop; allowed here: {', '.join(LOOP_MODES)} "
                         "(ray runs through covrl.train.ray_backend)")
    return LOOP_MODES[mode]()

