"""The sampler side of the Ray backend (`loop.mode=ray`): sampler actors generate chunks for the async loop's
staleness queue, and weights travel through Ray's object store. The trainer side (covrl.train.launch.ray) runs
the same code as the local async loop (staleness queue, Trainer.step, eval, checkpoints) in a trainer actor or in
the driver.

    driver ── ray.init(address=async_loop.ray_address) ── TrainerActor.train()  (or the driver itself)
                                                              │  dispatcher thread: admit chunk -> actor.generate
                      SamplerActor × num_samplers  <──────────┘  weights: ray.put(state_dict) once per sync;
                                                                 an actor fetches them only when its version is older

With trainer.parallel=ddp|fsdp2 the trainer side is a group of trainer.world_size TrainerActors, one
torch.distributed rank each (the driver asks rank 0's actor for a rendezvous address and port and gives it to
all); they run covrl.train.launch.ranks as torchrun's ranks do: rank 0 the leader (run folder, sampler actors,
logging, eval, checkpoints), the others followers (docs/distributed.md).

Each sampler actor (`covrl.train.asyncrl.process_pool.SamplerWorker`) is stateless apart from its weights: the generator
state before a chunk is sent with the chunk (and the state after it comes back), so a chunk can be regenerated
exactly after a resume and the trainer side's checkpoint holds every actor's RNG position. Ray is an optional extra (`pip install 'covrl[ray]'`), imported
lazily; the same config runs on a laptop (local Ray instance) or a cluster (`async_loop.ray_address='auto'`).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch

from covrl._lazy import require
from covrl.settings.quiet import apply_engine_logs, engine_log_env, engine_log_level
from covrl.train.asyncrl.pools import AsyncState
from covrl.train.asyncrl.process_pool import DispatchPool, SamplerWorker
from covrl.train.asyncrl.source import train_async
from covrl.train.run.threads import sampler_thread_count, thread_env

__all__ = ["RayPool", "SamplerActor", "ensure_ray", "ray_module", "start_sampler_actors", "train_ray"]


def ray_module():
    """The ray package (the `ray` extra), with an error naming the extra when it is not installed."""
    return require("ray", "ray")


def ensure_ray(acfg, engine_logs: str = "quiet") -> bool:
    """ray.init for the config: join `ray_address` or start a local instance. Returns True when this call
    started Ray (the caller shuts it down). `engine_logs` (logging.engine_logs): Ray's own log level here, and
    the engines' levels in every Ray worker of this job (their variables in its runtime environment, so a
    cluster's workers get them too). The actors' output still reaches this process (`log_to_driver`): the
    trainer actor's progress lines and every error are printed there."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    apply_engine_logs(engine_logs)
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True,
                              "logging_level": engine_log_level(engine_logs),
                              # an actor's output is never a terminal: no progress bars there
                              "runtime_env": {"env_vars": engine_log_env(engine_logs, bars=False)}}
    # ray.init replaces the SIGTERM handler with its own `sys.exit(15)`: a SystemExit that no stop path of the
    # run handles (the driver aborted with SIGABRT, its summary left "running"). Keep the one that was there.
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    if acfg.ray_address:
        ray.init(address=acfg.ray_address, **kwargs)
    else:
        if acfg.ray_temp_dir:
            kwargs["_temp_dir"] = acfg.ray_temp_dir
        ray.init(**kwargs)
    if callable(handler):
        signal.signal(signal.SIGTERM, handler)
    return True


class SamplerActor(SamplerWorker):
    """A `SamplerWorker` as a Ray actor (wrapped with ray.remote at run time). Weights come as [ObjectRef] (a
    list, so Ray does not resolve it on every call); the actor fetches them only when they are sent."""

    def generate(self, weights_box: list | None, version: int, examples: list, positions: list[int],
                 rng_state: torch.Tensor, probe: bool) -> dict[str, Any]:
        weights = ray_module().get(weights_box[0]) if weights_box is not None else None
        return self.generate_with(weights, version, examples, positions, rng_state, probe)


class RayPool(DispatchPool):
    """Sampler actors fed by the dispatcher thread; weights through the object store (one `ray.put` per sync)."""

    name = "ray"

    def __init__(self, state: AsyncState, actors: list, ray):
        super().__init__(state, len(actors))
        self.actors = actors
        self.ray = ray

    def _put_weights(self, weights: dict) -> Any:
        return self.ray.put(weights)

    def _submit(self, rank, weights_handle, version, examples, positions, rng, probe):
        box = [weights_handle] if weights_handle is not None else None
        return self.actors[rank].generate.remote(box, version, examples, positions, rng, probe)

    def _poll(self, timeout: float) -> list[tuple[Any, dict]]:
        done, _ = self.ray.wait(list(self.inflight), num_returns=1, timeout=timeout)
        out = []
        for call in done:
            try:
                out.append((call, self.ray.get(call)))
            except self.ray.exceptions.RayActorError as err:   # the actor died (killed, OOM, node lost)
                self._worker_lost(self.inflight[call][0], f"{type(err).__name__}")
        return out

    def _restart_worker(self, rank: int) -> None:
        try:
            self.ray.kill(self.actors[rank])
        except Exception:  # already gone
            pass
        self.actors[rank] = new_sampler_actor(self.state.run.cfg, rank)
        self.ray.get(self.actors[rank].ready.remote())

    def _collect(self, call: Any, timeout: float) -> dict:
        return self.ray.get(call, timeout=timeout)


def start_sampler_actors(cfg) -> list:
    """`async_loop.num_samplers` sampler actors for `cfg` (Ray must be initialised); waits until they are up."""
    ray = ray_module()
    actors = [new_sampler_actor(cfg, rank) for rank in range(cfg.async_loop.num_samplers)]
    ray.get([a.ready.remote() for a in actors])
    return actors


def new_sampler_actor(cfg, rank: int):
    """Start sampler actor `rank` for `cfg` (not waiting for it to be up)."""
    acfg = cfg.async_loop
    actor_cls = ray_module().remote(SamplerActor)
    # its thread pools are sized when its process starts (Ray would set OMP_NUM_THREADS alone, from num_cpus)
    env = {**engine_log_env(cfg.logging.engine_logs, bars=False), **thread_env(sampler_thread_count(acfg))}
    return actor_cls.options(num_cpus=acfg.sampler_cpus, num_gpus=acfg.sampler_gpus,
                             runtime_env={"env_vars": env}).remote(cfg, rank)


def train_ray(run, *, stop_after: int | None = None, actors: list | None = None) -> dict[str, Any]:
    """The async loop with Ray sampler actors (Ray must be initialised). `actors`: reuse running sampler actors
    built for the same model/task/sampler config (they are then left running). Returns the run summary."""
    ray = ray_module()
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
