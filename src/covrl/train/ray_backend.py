"""Ray backend of the async loop (`loop.mode=ray`): sampler actors generate chunks, the trainer side (the same
code as the local async loop: staleness queue, Trainer.step, eval, checkpoints) runs in a trainer actor or in the
driver, and weights travel through Ray's object store.

    driver ── ray.init(address=async_loop.ray_address) ── TrainerActor.train()  (or the driver itself)
                                                              │  dispatcher thread: admit chunk -> actor.generate
                      SamplerActor × num_samplers  <──────────┘  weights: ray.put(state_dict) once per sync;
                                                                 an actor fetches them only when its version is older

Each sampler actor is stateless apart from its weights: the generator state before a chunk is sent with the chunk
(and the state after it comes back), so a chunk can be regenerated exactly after a resume and the driver's
checkpoint holds every actor's RNG position. Ray is an optional extra (`pip install 'covrl[ray]'`), imported
lazily; the same config runs on a laptop (local Ray instance) or a cluster (`async_loop.ray_address='auto'`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from covrl._lazy import require
from covrl.train.async_loop import (
    AsyncState,
    build_async_sampler,
    clone_weights,
    floor_probe,
    generate_chunk,
    prepare_async_run,
    train_async,
)

__all__ = ["RayPool", "SamplerActor", "TrainerActor", "ensure_ray", "start_sampler_actors", "train_from_config_ray",
           "train_ray"]


def _ray():
    return require("ray", "ray")


def ensure_ray(acfg) -> bool:
    """ray.init for the config: join `ray_address` or start a local instance. Returns True when this call
    started Ray (the caller shuts it down)."""
    ray = _ray()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if acfg.ray_address:
        ray.init(address=acfg.ray_address, **kwargs)
    else:
        if acfg.ray_temp_dir:
            kwargs["_temp_dir"] = acfg.ray_temp_dir
        ray.init(**kwargs)
    return True


def sampler_seed(seed: int, rank: int) -> int:
    """Sampler `rank`'s generator seed; rank 0 uses the run seed (as the local loops' generator does)."""
    return int(seed) + 7919 * int(rank)


class SamplerActor:
    """One generation worker (wrapped with ray.remote at run time). Builds the model shape, task and sampler
    from the config; weights arrive with the first chunk."""

    def __init__(self, cfg_dict: dict, rank: int):
        from covrl.models import load_model
        from covrl.tasks import build_task
        from covrl.train.config import TrainConfig

        cfg = TrainConfig.model_validate(cfg_dict)
        acfg = cfg.async_loop
        torch.set_num_threads(acfg.sampler_threads or max(1, int(acfg.sampler_cpus)))
        self.cfg = cfg
        self.rank = rank
        model, tokenizer = load_model(cfg.model, seed=cfg.run.seed)
        if cfg.run.device != "cpu" and torch.cuda.is_available():
            model.to("cuda")
        self.tokenizer = tokenizer
        self.task = build_task(cfg.task)
        self.sampler = build_async_sampler(cfg.sampler, model, tokenizer)
        self.sampler.version = -1
        self._reference = None
        self.generator = torch.Generator()

    def ready(self) -> int:
        return os.getpid()

    def generate(self, weights_box: list | None, version: int, examples: list, positions: list[int],
                 rng_state: torch.Tensor, probe: bool) -> dict[str, Any]:
        """Load newer weights if sent (`weights_box` = [ObjectRef]: not resolved by Ray, fetched only here),
        generate and score one chunk from `rng_state`; returns the scored batch, task metrics, the generator
        state after it, the busy time and (when `probe`) the engine floor."""
        ray = _ray()
        t0 = time.perf_counter()
        weights = None
        if weights_box is not None:     # sent when this actor's weights are older, and with every probe chunk
            weights = ray.get(weights_box[0])
            if version != self.sampler.version:
                self.sampler.load_weights(weights, version)
        self.generator.set_state(rng_state)
        batch, task_metrics = generate_chunk(self.sampler, self.task, self.tokenizer, examples, positions,
                                             self.cfg.loop.group_size, self.generator, version)
        floor = None
        if probe and weights is not None:
            if self._reference is None:      # the trainer's dtype, for the engine-floor probe
                from covrl.models import load_model

                self._reference = load_model(self.cfg.model, seed=self.cfg.run.seed)[0].eval()
            self._reference.load_state_dict(weights, strict=True)
            floor = floor_probe(self._reference, batch, float(self.cfg.sampler.temperature))
        batch.info["task_metrics"] = task_metrics
        return {"batch": batch, "rng_after": self.generator.get_state(), "busy_s": time.perf_counter() - t0,
                "floor": floor, "pid": os.getpid()}


class RayPool:
    """Sampler actors driven by a dispatcher thread on the trainer side: whenever an actor is idle and
    admission allows, it gets the next chunk (one chunk in flight per actor)."""

    def __init__(self, state: AsyncState, actors: list, ray):
        self.state = state
        self.actors = actors
        self.ray = ray
        self.num_samplers = len(actors)
        seed = state.run.cfg.run.seed
        self.actor_rng = [torch.Generator().manual_seed(sampler_seed(seed, r)).get_state()
                          for r in range(len(actors))]
        self.actor_version = [-1] * len(actors)   # weights version each actor holds (-1: none sent yet)
        self.idle_since = [time.perf_counter()] * len(actors)
        self.inflight: dict[Any, tuple[int, Any]] = {}
        self.weights_ref = None
        self.thread = threading.Thread(target=self._loop, name="covrl-ray-dispatch", daemon=True)

    # checkpoint of the actors' RNG positions
    def extra_state(self) -> dict[str, Any]:
        return {"actor_rng": list(self.actor_rng)}

    def load_extra_state(self, saved: dict[str, Any] | None) -> None:
        if saved:
            for r, s in enumerate(saved.get("actor_rng", [])[: len(self.actor_rng)]):
                self.actor_rng[r] = s

    def start(self) -> None:
        self.publish(self.state.run.model, self.state.run.trainer.version)
        self.thread.start()

    def publish(self, model, version: int) -> None:
        ref = self.ray.put(clone_weights(model))
        with self.state.cond:
            self.state.published = (ref, int(version))
            self.state.cond.notify_all()

    def _dispatch(self) -> None:
        """Under the lock: give every idle actor a chunk while admission allows."""
        st = self.state
        busy = {rank for rank, _ in self.inflight.values()}
        ref, version = st.published
        for rank in range(self.num_samplers):
            if rank in busy:
                continue
            chunk = st.manager.try_start(st.chunk_rollouts, version,
                                         meta={"rng_before": self.actor_rng[rank], "sampler": rank})
            if chunk is None:
                return
            rng = chunk.meta.get("rng_before", self.actor_rng[rank])
            chunk.meta["rng_before"] = rng
            examples, positions = st.chunk_examples(chunk)
            probe = bool(st.acfg.floor_probe_every) and st.chunks_generated % st.acfg.floor_probe_every == 0
            box = [ref] if (self.actor_version[rank] != version or probe) else None
            call = self.actors[rank].generate.remote(box, version, examples, positions, rng, probe)
            self.actor_version[rank] = version
            self.inflight[call] = (rank, chunk)
            st.sampler_idle_s += time.perf_counter() - self.idle_since[rank]

    def _loop(self) -> None:
        st = self.state
        try:
            while True:
                with st.cond:
                    if st.stop:
                        return
                    self._dispatch()
                    if not self.inflight:
                        st.cond.wait(timeout=0.5)
                        continue
                done, _ = self.ray.wait(list(self.inflight), num_returns=1, timeout=0.5)
                for call in done:
                    result = self.ray.get(call)
                    with st.cond:
                        rank, chunk = self.inflight.pop(call)
                        self.actor_rng[rank] = result["rng_after"]
                        self.idle_since[rank] = time.perf_counter()
                        st.sampler_busy_s += result["busy_s"]
                        if result["floor"] is not None:
                            st.record_floor(result["floor"])
                        st.manager.complete(chunk, result["batch"])
                        st.chunks_generated += 1
                        st.cond.notify_all()
        except BaseException as err:
            st.fail(err)

    def next_batch(self, trainer_version: int):
        st = self.state
        t0 = time.perf_counter()
        with st.cond:
            while not st.manager.ready(trainer_version):
                st.raise_if_failed()
                if not self.thread.is_alive():
                    raise RuntimeError("the Ray dispatcher stopped")
                st.cond.wait(timeout=1.0)
            res = st.manager.take(trainer_version)
            st.cond.notify_all()
        st.trainer_idle_s += time.perf_counter() - t0
        return res

    def evaluate(self, label: str):
        run = self.state.run
        if run.sampler.version < run.trainer.version:
            run.sampler.load_weights(run.model, run.trainer.version)
        return run.run_eval(label)

    def stop(self) -> None:
        st = self.state
        with st.cond:
            st.stop = True
            st.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=600)
        # let chunks already generating finish, so the final checkpoint holds them as finished
        for call, (rank, chunk) in list(self.inflight.items()):
            try:
                result = self.ray.get(call, timeout=600)
            except Exception:   # a lost actor: the chunk stays "running" and is generated again on resume
                continue
            with st.cond:
                self.actor_rng[rank] = result["rng_after"]
                st.manager.complete(chunk, result["batch"])
            self.inflight.pop(call, None)


def start_sampler_actors(cfg) -> list:
    """`async_loop.num_samplers` sampler actors for `cfg` (Ray must be initialised); waits until they are up."""
    ray = _ray()
    acfg = cfg.async_loop
    actor_cls = ray.remote(SamplerActor)
    cfg_dict = cfg.model_dump(mode="json")
    actors = [actor_cls.options(num_cpus=acfg.sampler_cpus, num_gpus=acfg.sampler_gpus).remote(cfg_dict, rank)
              for rank in range(acfg.num_samplers)]
    ray.get([a.ready.remote() for a in actors])
    return actors


def train_ray(run, *, stop_after: int | None = None, actors: list | None = None) -> dict[str, Any]:
    """The async loop with Ray sampler actors (Ray must be initialised). `actors`: reuse running sampler actors
    built for the same model/task/sampler config (they are then left running). Returns the run summary."""
    ray = _ray()
    own = actors is None
    if own:
        actors = start_sampler_actors(run.cfg)
    pools: list[RayPool] = []

    def factory(state: AsyncState) -> RayPool:
        pool = RayPool(state, actors, ray)
        pools.append(pool)
        return pool

    try:
        summary = train_async(run, pool_factory=factory, stop_after=stop_after)
    finally:
        if own:
            for a in actors:
                ray.kill(a)
    summary["async"]["num_samplers"] = len(actors)
    return summary


class TrainerActor:
    """The trainer side inside a Ray actor (placed where `trainer_cpus`/`trainer_gpus` are free); it writes
    the run folder on its node and creates the sampler actors."""

    def __init__(self, cfg_dict: dict, config_path: str | None, resume: bool):
        from covrl.train.config import TrainConfig

        self.cfg = TrainConfig.model_validate(cfg_dict)
        self.config_path = config_path
        self.resume = resume

    def train(self) -> dict[str, Any]:
        if self.cfg.run.num_threads:
            torch.set_num_threads(self.cfg.run.num_threads)
        run = prepare_async_run(self.cfg, config_path=self.config_path, resume=self.resume,
                                console=self.cfg.logging.console)
        try:
            return train_ray(run)
        finally:
            run.close()


def train_from_config_ray(cfg, *, config_path=None, resume: bool = False) -> int:
    """`covrl train` with loop.mode=ray: join or start Ray, run the trainer side (in an actor when
    async_loop.trainer_actor), print the summary. Exit codes as `covrl train`."""
    from covrl.train.cli import _print_err, _print_summary
    from covrl.train.trainer import TrainingDivergedError

    try:
        ray = _ray()
    except ImportError as err:
        _print_err(str(err))
        return 2
    acfg = cfg.async_loop
    started = ensure_ray(acfg)
    try:
        if acfg.trainer_actor:
            actor = ray.remote(TrainerActor).options(num_cpus=acfg.trainer_cpus, num_gpus=acfg.trainer_gpus).remote(
                cfg.model_dump(mode="json"), None if config_path is None else str(config_path), resume)
            try:
                summary = ray.get(actor.train.remote())
            except ray.exceptions.RayTaskError as err:
                cause = err.as_instanceof_cause()
                if isinstance(cause, TrainingDivergedError):
                    _print_err(str(cause))
                    return 3
                raise
        else:
            run = prepare_async_run(cfg, config_path=config_path, resume=resume)
            print(f"run folder: {run.run_dir}")
            try:
                summary = train_ray(run)
            except TrainingDivergedError as err:
                _print_err(str(err))
                return 3
            finally:
                run.close()
    except KeyboardInterrupt:
        _print_err("interrupted; resume with: covrl train --resume --name NAME")
        return 130
    finally:
        if started:
            ray.shutdown()
    _print_summary(summary)
    return 0
