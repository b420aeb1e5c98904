"""Sampler workers in other processes: the generation core shared by Ray actors and local worker processes, and
the dispatcher that feeds them chunks through the staleness queue.

- `SamplerWorker`: builds the model shape, task and sampler from the run config; weights arrive with the first
  chunk. `generate` is a pure function of (weights, version, prompts, generator state): the generator state
  before a chunk is sent with it and the state after it comes back, so any worker can regenerate any chunk
  exactly and the trainer side's checkpoint holds every worker's RNG position.
- `DispatchPool`: a dispatcher thread on the trainer side; whenever a worker is idle and admission allows, it
  gets the next chunk (one chunk in flight per worker). Subclasses say how weights and calls travel:
  `ProcessPool` (local processes, `async_loop.local_backend=process`) and `covrl.train.asyncrl.ray_pool.RayPool`.
"""

from __future__ import annotations

import io
import os
import queue as queue_lib
import threading
import time
import traceback
from typing import Any

import torch

from covrl.models import load_model
from covrl.rollout import build_sampler
from covrl.settings.quiet import apply_engine_logs
from covrl.tasks import build_task
from covrl.train.asyncrl.pools import (
    AsyncState,
    SamplerWorkerError,
    clone_weights,
    floor_probe,
    generate_chunk,
)
from covrl.train.run.threads import limit_process_threads, sampler_thread_count, thread_env

__all__ = ["DispatchPool", "ProcessPool", "SamplerWorker", "own_weights", "sampler_seed"]


def own_weights(sampler_cfg):
    """The sampler config with its own copy of the weights: async samplers must not share the trainer's."""
    return sampler_cfg.model_copy(update={"share_weights": "never"})


def sampler_seed(seed: int, rank: int, epoch: int = 0) -> int:
    """Sampler `rank`'s generator seed; rank 0 uses the run seed (as the local loops' generator does). `epoch`
    > 0 gives a rank a fresh stream after its old one was handed to a regenerated chunk."""
    return int(seed) + 7919 * int(rank) + 104729 * int(epoch)


class SamplerWorker:
    """One generation worker (a Ray actor or a local process)."""

    def __init__(self, cfg, rank: int):
        # before the model and the engine: their thread pools and log levels are fixed when they start
        limit_process_threads(sampler_thread_count(cfg.async_loop))
        apply_engine_logs(cfg.logging.engine_logs)
        self.cfg = cfg
        self.rank = rank
        model, tokenizer = load_model(cfg.model, seed=cfg.run.seed)
        if cfg.run.device != "cpu" and torch.cuda.is_available():
            model.to("cuda")
        self.tokenizer = tokenizer
        self.task = build_task(cfg.task, response_budget=cfg.sampler.max_new_tokens)
        self.sampler = build_sampler(own_weights(cfg.sampler), model, tokenizer)
        self.sampler.version = -1
        self._reference = None
        self.generator = torch.Generator()
        self.agent = None
        if cfg.task.agent.enabled:   # task.agent: this worker's episodes through an endpoint around its own sampler
            from covrl.train.run.agent_source import detached_player

            self.agent = detached_player(cfg, self.sampler, tokenizer, self.task, generator=self.generator)

    def ready(self) -> int:
        return os.getpid()

    def generate_with(self, weights: dict | None, version: int, examples: list, positions: list[int],
                      rng_state: torch.Tensor, probe: bool) -> dict[str, Any]:
        """Load `weights` if given (sent when this worker's are older, and with every probe chunk), generate and
        score one chunk from `rng_state`; returns the scored batch, the generator state after it, the busy
        time and (when `probe`) the engine floor measured at these weights."""
        t0 = time.perf_counter()
        if weights is not None and version != self.sampler.version:
            self.sampler.load_weights(weights, version)
        self.generator.set_state(rng_state)
        agent_failed = 0
        if self.agent is not None:
            failed_before = self.agent.failures.failures
            batch = self.agent.play(examples, self.cfg.loop.group_size, version=version, positions=positions)
            agent_failed = self.agent.failures.failures - failed_before
        else:
            batch = generate_chunk(self.sampler, self.task, self.tokenizer, self.cfg.task, examples, positions,
                                   self.cfg.loop.group_size, self.generator, version)
        floor = None
        if probe and weights is not None:
            if self._reference is None:      # the trainer's dtype, for the engine-floor probe
                self._reference = load_model(self.cfg.model, seed=self.cfg.run.seed)[0].eval()
            self._reference.load_state_dict(weights, strict=True)
            floor = floor_probe(self._reference, batch, self.cfg)
        return {"batch": batch, "rng_after": self.generator.get_state(), "busy_s": time.perf_counter() - t0,
                "floor": floor, "pid": os.getpid(), "agent_failed": agent_failed}


class DispatchPool:
    """Dispatcher thread + one chunk in flight per worker. Subclasses implement `_put_weights`, `_submit`,
    `_poll` and `_collect`."""

    name = "workers"

    def __init__(self, state: AsyncState, num_workers: int):
        self.state = state
        self.num_samplers = num_workers
        seed = state.run.cfg.run.seed
        self.worker_rng = [torch.Generator().manual_seed(sampler_seed(seed, r)).get_state()
                           for r in range(num_workers)]
        self.worker_version = [-1] * num_workers   # weights version each worker holds (-1: none sent yet)
        self.idle_since = [time.perf_counter()] * num_workers
        self.inflight: dict[Any, tuple[int, Any]] = {}
        self.restarts = 0          # workers restarted in this run (async_loop.max_worker_restarts)
        self.rng_epoch = [0] * num_workers
        self.thread = threading.Thread(target=self._loop, name=f"covrl-{self.name}-dispatch", daemon=True)

    # -- transport (subclasses) ------------------------------------------------------------------------------
    def _put_weights(self, weights: dict) -> Any:
        raise NotImplementedError

    def _submit(self, rank: int, weights_handle: Any, version: int, examples: list, positions: list[int],
                rng: torch.Tensor, probe: bool) -> Any:
        raise NotImplementedError

    def _poll(self, timeout: float) -> list[tuple[Any, dict]]:
        raise NotImplementedError

    def _collect(self, call: Any, timeout: float) -> dict:
        raise NotImplementedError

    def _restart_worker(self, rank: int) -> None:
        """Replace worker `rank` by a new one and return once it is up."""
        raise NotImplementedError

    def _check_idle_workers(self) -> None:
        """Notice workers that died while idle (transports that can tell without a call in flight)."""

    # -- lost workers ------------------------------------------------------------------------------------------
    def _worker_lost(self, rank: int, why: str) -> None:
        """Worker `rank` died: its chunk goes back to the queue's hand-out order (same tickets and randomness,
        so nothing is lost or generated twice) and a new worker takes its place, at most
        `async_loop.max_worker_restarts` times per run; then the run stops (SamplerWorkerError) and can be
        resumed from its last checkpoint."""
        st = self.state
        limit = st.acfg.max_worker_restarts
        if self.restarts >= limit:
            raise SamplerWorkerError(f"sampler worker {rank} ({self.name}) died: {why}; "
                                     f"async_loop.max_worker_restarts={limit} restarts already used")
        self.restarts += 1
        with st.cond:
            for call, (r, chunk) in list(self.inflight.items()):
                if r == rank:
                    del self.inflight[call]
                    st.manager.requeue(chunk)
            self.worker_version[rank] = -1
            st.worker_restarts = self.restarts
        print(f"covrl: sampler worker {rank} ({self.name}) died: {why}; restarting it "
              f"({self.restarts}/{limit})", flush=True)
        self._restart_worker(rank)
        self.idle_since[rank] = time.perf_counter()

    # -- checkpoint of the workers' RNG positions --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"worker_rng": list(self.worker_rng), "rng_epoch": list(self.rng_epoch)}

    def next_rng_state(self) -> torch.Tensor:
        # the workers, not the run's generator, hold the streams; a local pool resumed from this checkpoint
        # continues rank 0's (seeded like the local loops' generator), not the run generator's untouched state
        return self.worker_rng[0]

    def sync_probe(self, model) -> None:
        pass   # workers get the weights with every probe chunk

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        if saved:
            rngs = saved.get("worker_rng", [])
            for r, s in enumerate(rngs[: len(self.worker_rng)]):
                self.worker_rng[r] = s
            for r, e in enumerate(saved.get("rng_epoch", [])[: len(self.rng_epoch)]):
                self.rng_epoch[r] = int(e)

    # -- pool protocol -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.idle_since = [time.perf_counter()] * self.num_samplers   # start-up is not idle time
        self.publish(self.state.run.model, self.state.run.trainer.version)
        self.thread.start()

    def publish(self, model, version: int) -> None:
        handle = self._put_weights(clone_weights(model))
        with self.state.cond:
            self.state.published = (handle, int(version))
            self.state.cond.notify_all()

    def _dispatch(self) -> None:
        """Under the lock: give every idle worker a chunk while admission allows."""
        st = self.state
        busy = {rank for rank, _ in self.inflight.values()}
        handle, version = st.published
        for rank in range(self.num_samplers):
            if rank in busy:
                continue
            chunk = st.manager.try_start(st.chunk_size(version), version,
                                         meta={"rng_before": self.worker_rng[rank], "sampler": rank})
            if chunk is None:
                return
            rng = chunk.meta.get("rng_before", self.worker_rng[rank])
            chunk.meta["rng_before"] = rng
            origin = int(chunk.meta.get("sampler", rank))
            if origin != rank and origin < self.num_samplers:
                # a regenerated chunk continues its origin's stream here; the origin starts a fresh one, so no two
                # chunks ever start from the same generator state
                self.rng_epoch[origin] += 1
                self.worker_rng[origin] = torch.Generator().manual_seed(
                    sampler_seed(st.run.cfg.run.seed, origin, self.rng_epoch[origin])).get_state()
            chunk.meta["sampler"] = rank
            examples, positions = st.chunk_examples(chunk)
            probe = bool(st.acfg.floor_probe_every) and st.chunks_generated % st.acfg.floor_probe_every == 0
            send = handle if (self.worker_version[rank] != version or probe) else None
            call = self._submit(rank, send, version, examples, positions, rng, probe)
            self.worker_version[rank] = version
            self.inflight[call] = (rank, chunk)
            st.sampler_idle_s += time.perf_counter() - self.idle_since[rank]

    def _complete(self, call: Any, result: dict) -> None:
        st = self.state
        with st.cond:
            rank, chunk = self.inflight.pop(call)
            self.worker_rng[rank] = result["rng_after"]
            self.idle_since[rank] = time.perf_counter()
            st.sampler_busy_s += result["busy_s"]
            if result["floor"] is not None:
                st.record_floor(result["floor"])
            if result.get("agent_failed") and st.run.agent is not None:
                st.run.agent.count_worker_failures(result["agent_failed"])
            st.complete_chunk(chunk, result["batch"])
            st.chunks_generated += 1
            st.cond.notify_all()

    def _loop(self) -> None:
        st = self.state
        try:
            while True:
                with st.cond:
                    if st.stop:
                        return
                    self._dispatch()
                    idle = not self.inflight
                    if idle:
                        st.cond.wait(timeout=0.5)
                if idle:   # a worker that died while it had nothing to do is replaced now, not at its next chunk
                    self._check_idle_workers()
                    continue
                for call, result in self._poll(timeout=0.5):
                    self._complete(call, result)
        except BaseException as err:
            st.fail(err)

    def next_batch(self, trainer_version: int):
        return self.state.take_when_ready(trainer_version, self.thread, f"the {self.name} dispatcher")

    def evaluate(self, label: str):
        """Evaluation runs on the trainer side's own sampler (synced to the trainer's weights first)."""
        run = self.state.run
        if run.sampler.version < run.trainer.version:
            run.sampler.load_weights(run.model, run.trainer.version)
        return run.run_eval(label)

    def stop(self) -> None:
        self.state.request_stop()
        if self.thread.is_alive():
            self.thread.join(timeout=600)
        # let chunks already generating finish, so the final checkpoint holds them as finished
        for call in list(self.inflight):
            try:
                result = self._collect(call, timeout=600)
            except Exception:   # a lost worker: the chunk stays "running" and is generated again on resume
                continue
            self._complete(call, result)


# ------------------------------------------------------------------------------------------ local processes

def _dumps(obj: Any) -> bytes:
    """One byte string for a message (torch.save): queues would otherwise move every small tensor through its
    own shared-memory segment, which costs more than the copy for rollout batches and small models."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    # our own child process's messages (RolloutBatch, tokenizer-free python objects): full unpickling is needed
    return torch.load(io.BytesIO(data), weights_only=False)


def _process_main(cfg, rank: int, inbox, outbox) -> None:
    """Worker process: build the worker, then serve (call id, weights, version, examples, positions, rng,
    probe) requests until None."""
    try:
        worker = SamplerWorker(cfg, rank)
        outbox.put(("ready", rank, os.getpid()))
    except BaseException:
        outbox.put(("start_error", rank, traceback.format_exc()))
        return
    while True:
        msg = inbox.get()
        if msg is None:
            return
        call, weights, version, examples, positions, rng, probe = _loads(msg)
        try:
            result = worker.generate_with(weights, version, examples, positions, rng, probe)
            outbox.put(("done", call, _dumps(result)))
        except BaseException as err:
            try:   # the exception itself when it pickles (so the trainer side can tell a reward error apart)
                exc = _dumps(err)
            except Exception:  # noqa: BLE001
                exc = None
            outbox.put(("error", call, traceback.format_exc(), exc))


class ProcessPool(DispatchPool):
    """`async_loop.num_samplers` local worker processes (spawned; each with its own torch thread budget,
    `async_loop.sampler_threads`). Weights and rollouts travel through multiprocessing queues as torch.save
    byte strings."""

    name = "process"

    def __init__(self, state: AsyncState):
        import multiprocessing

        n = state.acfg.num_samplers
        super().__init__(state, n)
        self.ctx = multiprocessing.get_context("spawn")
        self.outbox = self.ctx.Queue()
        self.inboxes = [self.ctx.Queue() for _ in range(n)]
        self.cfg = state.run.cfg   # pickled into each spawned process
        self.env = thread_env(sampler_thread_count(state.acfg))
        self.procs = [self._spawn(r) for r in range(n)]
        self._results: dict[Any, dict] = {}
        self._failed: set[Any] = set()     # calls whose generation raised: no result will come
        self._calls = 0
        self._starting = set(range(n))
        while self._starting:
            try:
                self._receive(timeout=1.0)
            except queue_lib.Empty:
                dead = [(p.name, p.exitcode) for p in self.procs if not p.is_alive()]
                if dead:
                    self._terminate()
                    raise RuntimeError(f"sampler process(es) exited while starting: {dead}. Worker processes are "
                                       "spawned: a script that starts training must guard its entry point with "
                                       "`if __name__ == \"__main__\":`") from None

    def _spawn(self, rank: int):
        """Start worker process `rank`. Its thread pools are sized at `import torch`, before any code of ours runs
        there: the thread variables are set in the environment it inherits (as Ray does for its workers)."""
        proc = self.ctx.Process(target=_process_main, args=(self.cfg, rank, self.inboxes[rank], self.outbox),
                                daemon=True, name=f"covrl-sampler-{rank}")
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return proc

    def _restart_worker(self, rank: int) -> None:
        old = self.procs[rank]
        if old.is_alive():
            old.terminate()
        old.join(timeout=30)
        _abandon(self.inboxes[rank])
        self.inboxes[rank] = self.ctx.Queue()   # requests queued for the dead process must not reach the new one
        self._starting.add(rank)
        self.procs[rank] = self._spawn(rank)
        deadline = time.perf_counter() + 600
        while rank in self._starting:
            if not self.procs[rank].is_alive():
                raise SamplerWorkerError(f"restarted sampler process {rank} exited with code "
                                         f"{self.procs[rank].exitcode} while starting")
            if time.perf_counter() > deadline:
                raise SamplerWorkerError(f"restarted sampler process {rank} did not start within 600 s")
            try:
                self._receive(timeout=1.0)
            except queue_lib.Empty:
                continue

    def _check_idle_workers(self) -> None:
        self._check_alive()

    def _check_alive(self) -> None:
        for rank, p in enumerate(self.procs):
            if not p.is_alive():
                self._worker_lost(rank, f"process {p.pid} exited with code {p.exitcode}")

    def _put_weights(self, weights: dict) -> Any:
        return weights

    def _submit(self, rank, weights_handle, version, examples, positions, rng, probe):
        self._calls += 1
        call = self._calls
        self.inboxes[rank].put(_dumps((call, weights_handle, version, examples, positions, rng, probe)))
        return call

    def _receive(self, timeout: float) -> None:
        msg = self.outbox.get(timeout=timeout)
        kind = msg[0]
        if kind == "ready":
            self._starting.discard(msg[1])
        elif kind == "start_error":
            self._terminate()
            raise RuntimeError(f"sampler process {msg[1]} failed to start:\n{msg[2]}")
        elif kind == "error":
            self._failed.add(msg[1])
            cause = _loads(msg[3]) if msg[3] is not None else None
            raise RuntimeError(f"sampler process failed on call {msg[1]}:\n{msg[2]}") from cause
        else:
            _, call, result = msg
            self._results[call] = _loads(result)

    def _poll(self, timeout: float) -> list[tuple[Any, dict]]:
        try:
            self._receive(timeout)
        except queue_lib.Empty:
            pass
        self._check_alive()
        done = [(c, self._results.pop(c)) for c in list(self._results) if c in self.inflight]
        return done

    def _collect(self, call: Any, timeout: float) -> dict:
        deadline = time.perf_counter() + timeout
        rank = self.inflight[call][0]
        while call not in self._results:
            if call in self._failed:
                raise RuntimeError(f"sampler process {rank} failed on call {call}")
            if time.perf_counter() > deadline:
                raise TimeoutError(f"sampler process {rank} did not return call {call} within {timeout} s")
            try:
                self._receive(1.0)
            except queue_lib.Empty:
                if not self.procs[rank].is_alive():
                    raise RuntimeError(f"sampler process {rank} died before returning call {call}") from None
        return self._results.pop(call)

    def _terminate(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        for q in (*self.inboxes, self.outbox):
            _abandon(q)

    def stop(self) -> None:
        super().stop()
        self._terminate()


def _abandon(q) -> None:
    """Let a multiprocessing queue go without waiting for its feeder thread. A put to a process that was killed
    (weights bytes larger than the pipe's buffer) leaves the feeder blocked on a pipe nobody reads, and the
    queue's exit hook joins that thread: the interpreter would never exit (seen as a hung pytest after its
    summary line)."""
    q.cancel_join_thread()
    q.close()
