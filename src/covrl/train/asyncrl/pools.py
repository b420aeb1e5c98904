"""The sampler side of the asynchronous loops (docs/theory.md §9): the state that sampler workers and the trainer share
(the staleness queue under one condition variable, the newest published weights, counters) and the local pools
of sampler workers that fill the queue from the run's own sampler.

- `SerialPool`  (`async_loop.emulate=true`): one thread; before each step the sampler fills the queue up to the
  bound. Deterministic: the reference schedule of a saturated queue (used by the reproduction).
- `ThreadPool`  (`loop.mode=async`): one sampler thread beside the trainer, each running torch ops with the GIL
  released. Weights are handed over as a cloned state dict; the sampler loads them between chunks.

Pools of other processes (local processes, Ray actors) are in `covrl.train.asyncrl.process_pool`; the rollout source
that the loop driver reads from is `covrl.train.asyncrl.source.AsyncSource`.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from covrl.math import KL_ESTIMATORS, clamped_log_ratio, constant_groups
from covrl.rollout.types import RolloutBatch, ScoredBatch
from covrl.train.asyncrl.config import AsyncLoopConfig
from covrl.train.asyncrl.staleness import Chunk, StalenessManager, TakeResult
from covrl.train.run.sources import DynamicSamplingError, generate_batch, score_batch
from covrl.train.step.micro_step import forward_batch, truncation_replay

__all__ = ["AsyncState", "SamplerWorkerError", "SerialPool", "ThreadPool", "clone_weights", "floor_probe",
           "generate_chunk"]


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
        # loop.dynamic_sampling: chunks keep only their groups with reward contrast (see complete_chunk)
        self.dynamic = bool(lcfg.dynamic_sampling)
        self.dynamic_max_rounds = int(lcfg.dynamic_sampling_max_rounds)
        self.manager = StalenessManager(self.batch_rollouts, self.queue_rollouts,
                                        drop_older_than_rollouts=acfg.drop_older_than_rollouts,
                                        split=split_rows if self.dynamic else None)
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

    def chunk_size(self, version: int) -> int:
        """Rollouts of the next chunk: `chunk_rollouts`; with dynamic sampling at most the whole groups the
        queue has room for (filtered rows leave capacity that is not a whole chunk, and a batch can wait for it:
        a fixed size would deadlock there, a larger one break the staleness bound)."""
        if not self.dynamic:
            return self.chunk_rollouts
        room = self.manager.capacity(version) // self.group_size * self.group_size
        return max(min(self.chunk_rollouts, room), self.group_size)

    def complete_chunk(self, chunk: Chunk, batch: ScoredBatch) -> None:
        """Under the lock: a chunk's scored rollouts join the queue. With dynamic sampling only its groups
        whose rewards differ do (a constant group has no advantage under a group baseline); the others are
        counted and free queue capacity, so the sampler generates more. A batch that cannot be filled within
        `loop.dynamic_sampling_max_rounds` batches' worth of filtered rollouts stops the run
        (DynamicSamplingError), as the sync loop's cap does."""
        if not self.dynamic:
            self.manager.complete(chunk, batch)
            return
        n = self.group_size
        same = constant_groups(batch.sequence_rewards, batch.group_ids, len(batch) // n)
        keep = (~same).nonzero().flatten().tolist()
        kept = batch.select([g * n + j for g in keep for j in range(n)]) if keep else None
        self.manager.complete(chunk, kept, kept=len(keep) * n)
        cap = self.dynamic_max_rounds * self.batch_rollouts
        if self.manager.filtered_since_take >= cap and not self.manager.ready(self.run.trainer.version):
            raise DynamicSamplingError(
                f"dynamic sampling filtered {self.manager.filtered_since_take} rollouts (loop.dynamic_sampling_"
                f"max_rounds={self.dynamic_max_rounds} batches of {self.batch_rollouts}) without filling the "
                f"next batch: almost every group of {n} completions had equal rewards; the task is too easy or "
                "too hard for the model, or the reward is constant. Raise the cap, change the task, or set "
                "loop.dynamic_sampling=false")

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

    def failure(self) -> BaseException | None:
        """The error that stopped a sampler worker, as the SamplerWorkerError the run stops with (or None);
        the dynamic sampling cap is the run's verdict, not a worker's death: as it is."""
        if self.error is None:
            return None
        if isinstance(self.error, DynamicSamplingError):
            return self.error
        err = SamplerWorkerError(f"async sampler worker failed: {self.error!r}")
        err.__cause__ = self.error
        return err

    def raise_if_failed(self) -> None:
        failure = self.failure()
        if failure is not None:
            raise failure

    def take_when_ready(self, trainer_version: int, worker: threading.Thread, what: str) -> TakeResult:
        """The trainer's side of the queue: wait until the next batch is complete, then take it; raise if a
        worker failed or `worker` (the thread that fills the queue) stopped. The wait counts as trainer idle."""
        t0 = time.perf_counter()
        with self.cond:
            while not self.manager.ready(trainer_version):
                self.raise_if_failed()
                if not worker.is_alive():
                    raise RuntimeError(f"{what} stopped")
                self.cond.wait(timeout=1.0)
            res = self.manager.take(trainer_version)
            self.cond.notify_all()
        self.trainer_idle_s += time.perf_counter() - t0
        return res


def split_rows(batch: ScoredBatch, k: int) -> tuple[ScoredBatch, ScoredBatch]:
    """(the first k rows, the rest) of a chunk's batch: a step's batch may end inside a filtered chunk."""
    return batch.select(list(range(k))), batch.select(list(range(k, len(batch))))


def clone_weights(model) -> dict[str, torch.Tensor]:
    """A snapshot of the trainer's weights (a module, or weights already gathered: a dict) that later optimizer
    steps do not modify."""
    weights = model if isinstance(model, Mapping) else model.state_dict()
    return {k: v.detach().clone() for k, v in weights.items()}


def floor_probe(reference_model, batch: RolloutBatch, cfg) -> float:
    """Engine floor on one generated chunk: kl_seq = mean_b Σ_t k3(ρ_t), ρ_t = p_ref(y_t)/q(y_t), where p_ref is an
    fp32 forward at the weights that generated the chunk (on the sampler's kept sets, as the trainer scores them
    under trainer.truncation) and q the sampler's log-probs (docs/theory.md §5, §9, §12). `cfg`: the run's."""
    rule, replay = truncation_replay(cfg.sampler, cfg.trainer.truncation)
    with torch.no_grad():
        fwd = forward_batch(reference_model, batch, float(cfg.sampler.temperature), with_stats=False,
                            truncation=rule if replay else None, replay=replay)
    mask = batch.train_mask.float()   # the model's tokens: an episode's environment tokens have no sampler log-prob
    k3 = KL_ESTIMATORS["k3"](clamped_log_ratio(fwd.logprobs, batch.sampler_logprobs)) * mask
    return float(k3.sum(1).mean())


def generate_chunk(sampler, task, tokenizer, task_cfg, examples: list, positions: list[int], group_size: int,
                   generator: torch.Generator, version: int, refresh=None) -> ScoredBatch:
    """Generate and score one chunk (whole groups): completions, or episodes for a task with an environment.
    `refresh`: newer weights handed mid-generation (async_loop.partial_rollouts)."""
    generated = generate_batch(sampler, task, tokenizer, task_cfg, examples, group_size, generator=generator,
                               version=version, refresh=refresh)
    return score_batch(task, tokenizer, generated, examples, group_size, positions)


# ------------------------------------------------------------------------------------------------- pools

@runtime_checkable
class SamplerPool(Protocol):
    """Sampler workers that fill the staleness queue (local: SerialPool, ThreadPool; other processes:
    covrl.train.asyncrl.process_pool.ProcessPool, covrl.train.asyncrl.ray_pool.RayPool)."""

    num_samplers: int

    def start(self) -> None: ...

    def publish(self, model, version: int) -> None: ...

    def next_batch(self, trainer_version: int) -> TakeResult: ...

    def evaluate(self, label: str) -> dict[str, Any]: ...

    def stop(self) -> None: ...

    def sync_probe(self, model) -> None:
        """The weights the engine-floor probe compares against, at the start of training."""

    def state_dict(self) -> dict[str, Any] | None:
        """The pool's own checkpoint state (workers' RNG positions), or None."""

    def load_state_dict(self, saved: dict[str, Any] | None) -> None: ...

    def next_rng_state(self) -> torch.Tensor:
        """The generator state the next chunk would start from (when no chunk is generating)."""


class _LocalWorkerMixin:
    """Generation of one chunk by the run's own sampler (serial and thread pools)."""

    state: AsyncState
    num_samplers = 1

    def sync_probe(self, model) -> None:
        if self.state.acfg.floor_probe_every:
            self._probe_weights = clone_weights(model)

    def state_dict(self) -> dict[str, Any] | None:
        return None      # the run's own generator is checkpointed with the queue

    def next_rng_state(self) -> torch.Tensor:
        return self.state.run.generator.get_state()

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        pass

    def _generate(self, chunk: Chunk) -> None:
        st = self.state
        run = st.run
        if chunk.meta.get("restarted") and chunk.meta.get("rng_before") is not None:
            run.generator.set_state(chunk.meta["rng_before"])
        examples, positions = st.chunk_examples(chunk)
        refresh = self._refresh if st.acfg.partial_rollouts else None
        if run.agent is not None:   # task.agent: the chunk's episodes through the endpoint around this sampler
            batch = run.agent.play(examples, st.group_size, version=chunk.version, positions=positions,
                                   refresh=refresh)
        else:
            batch = generate_chunk(run.sampler, run.task, run.tokenizer, run.cfg.task, examples, positions,
                                   st.group_size, run.generator, chunk.version, refresh=refresh)
        self._maybe_probe(batch)
        with st.cond:
            st.complete_chunk(chunk, batch)
            st.chunks_generated += 1
            st.cond.notify_all()

    def _refresh(self) -> tuple[Any, int] | None:
        """Newer published weights for a chunk in flight (partial rollouts), else None. The serial pool
        publishes between chunks only, so it never hands any."""
        pub = self.state.published
        if pub is not None and pub[1] > self.state.run.sampler.version:
            if self.state.acfg.floor_probe_every:
                self._probe_weights = pub[0]
            return pub
        return None

    def _maybe_probe(self, batch: RolloutBatch) -> None:
        st = self.state
        every = st.acfg.floor_probe_every
        if not every or st.chunks_generated % every:
            return
        versions = batch.versions_per_token[batch.train_mask > 0]
        if versions.numel() and bool((versions != versions[0]).any()):
            return   # drawn by two versions: no single set of weights to compare the engine against
        run = st.run
        ref = getattr(self, "_probe_model", None)
        if ref is None:
            ref = self._probe_model = copy.deepcopy(run.model).float().eval()
            for p in ref.parameters():
                p.requires_grad_(False)
        weights = self._probe_weights
        if weights is not None:
            ref.load_state_dict(weights, strict=True)
        st.record_floor(floor_probe(ref, batch, run.cfg))

    _probe_weights: dict | None = None

    def _admit(self, version: int) -> Chunk | None:
        """Under the lock: admit the next chunk (a chunk left from a resume first), recording the generator
        state before it (for resume)."""
        st = self.state
        return st.manager.try_start(st.chunk_size(version), version,
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
        return st.take_when_ready(trainer_version, self.thread, "the sampler thread")

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
