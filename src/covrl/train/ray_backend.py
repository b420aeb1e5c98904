"""Ray backend of the async loop (`loop.mode=ray`): sampler actors generate chunks, the trainer side (the same
code as the local async loop: staleness queue, Trainer.step, eval, checkpoints) runs in a trainer actor or in the
driver, and weights travel through Ray's object store.

    driver ── ray.init(address=async_loop.ray_address) ── TrainerActor.train()  (or the driver itself)
                                                              │  dispatcher thread: admit chunk -> actor.generate
                      SamplerActor × num_samplers  <──────────┘  weights: ray.put(state_dict) once per sync;
                                                                 an actor fetches them only when its version is older

With trainer.parallel=ddp|fsdp2 the trainer side is a group of trainer.world_size TrainerActors, one
torch.distributed rank each (the driver asks rank 0's actor for a rendezvous address and port and gives it to
all); they run covrl.train.distributed_run as torchrun's ranks do: rank 0 the leader (run folder, sampler actors,
logging, eval, checkpoints), the others followers (docs/distributed.md).

Each sampler actor (`covrl.train.worker_pool.SamplerWorker`) is stateless apart from its weights: the generator
state before a chunk is sent with the chunk (and the state after it comes back), so a chunk can be regenerated
exactly after a resume and the trainer side's checkpoint holds every actor's RNG position. Ray is an optional extra (`pip install 'covrl[ray]'`), imported
lazily; the same config runs on a laptop (local Ray instance) or a cluster (`async_loop.ray_address='auto'`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from covrl._lazy import require
from covrl.train.async_loop import prepare_async_run, train_async
from covrl.train.async_pools import AsyncState
from covrl.train.config import TrainConfig
from covrl.train.distributed import free_port
from covrl.train.distributed_run import PEER_DIED, train_distributed
from covrl.train.runner import print_err, run_training
from covrl.train.threads import apply_num_threads
from covrl.train.worker_pool import DispatchPool, SamplerWorker

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


class SamplerActor(SamplerWorker):
    """A `SamplerWorker` as a Ray actor (wrapped with ray.remote at run time). Weights come as [ObjectRef] (a
    list, so Ray does not resolve it on every call); the actor fetches them only when they are sent."""

    def generate(self, weights_box: list | None, version: int, examples: list, positions: list[int],
                 rng_state: torch.Tensor, probe: bool) -> dict[str, Any]:
        weights = _ray().get(weights_box[0]) if weights_box is not None else None
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
    ray = _ray()
    actors = [new_sampler_actor(cfg, rank) for rank in range(cfg.async_loop.num_samplers)]
    ray.get([a.ready.remote() for a in actors])
    return actors


def new_sampler_actor(cfg, rank: int):
    """Start sampler actor `rank` for `cfg` (not waiting for it to be up)."""
    acfg = cfg.async_loop
    actor_cls = _ray().remote(SamplerActor)
    return actor_cls.options(num_cpus=acfg.sampler_cpus, num_gpus=acfg.sampler_gpus).remote(
        cfg.model_dump(mode="json"), rank)


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
    """The trainer side inside a Ray actor (placed where `trainer_cpus`/`trainer_gpus` are free). Alone
    (trainer.parallel=none) it is the whole trainer side: it writes the run folder on its node and creates the
    sampler actors. In a group (trainer.parallel=ddp|fsdp2, trainer.world_size actors) it is one rank of the
    torch.distributed trainer: rank 0 is that same trainer side as the leader, the others follow it
    (covrl.train.distributed_run, the code torchrun's ranks run)."""

    def __init__(self, cfg_dict: dict, config_path: str | None, resume: bool, rank: int = 0, world: int = 1):
        self.cfg = TrainConfig.model_validate(cfg_dict)
        self.config_path = config_path
        self.resume = resume
        self.rank, self.world = rank, world

    def endpoint(self) -> tuple[str, int]:
        """This actor's node address and a port free there: the group's rendezvous (MASTER_ADDR/PORT), asked of
        rank 0 because only its node knows which of its ports are free."""
        address = _ray().util.get_node_ip_address()
        return address, free_port(address)

    def node(self) -> str:
        """The id of this actor's node (the group counts its ranks per node: LOCAL_WORLD_SIZE)."""
        return _ray().get_runtime_context().get_node_id()

    def train(self, master: tuple[str, int] | None = None, local_world: int = 1) -> int:
        """The whole trainer side (covrl.train.runner.run_training) or this rank of the group (joined at
        `master`; `local_world` ranks on this node); returns `covrl train`'s exit code (a follower: rank 0's,
        sent at stop)."""
        if self.cfg.trainer.parallel != "none":   # as torchrun sets it: run.num_threads=auto shares the node
            os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
        apply_num_threads(self.cfg)
        try:
            if self.cfg.trainer.parallel == "none":
                return run_training(self.cfg, prepare_async_run, train_ray, config_path=self.config_path,
                                    resume=self.resume)
            # the environment torchrun gives its ranks (torch.distributed's env:// rendezvous reads it); Ray gives
            # each actor its own GPUs (CUDA_VISIBLE_DEVICES), so its device is local rank 0
            os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                              WORLD_SIZE=str(self.world), LOCAL_RANK="0")
            return train_distributed(self.cfg, prepare_async_run, train_ray, config_path=self.config_path,
                                     resume=self.resume)
        finally:   # the last lines (`done: ...`) reach the worker's log before the driver kills the actor
            sys.stdout.flush()
            sys.stderr.flush()


def _train_group(ray, cfg, config_path: str | None, resume: bool) -> int:
    """trainer.world_size trainer actors joined in one process group; rank 0's exit code. Plain actors calling
    init_process_group rather than ray.train's TorchTrainer: the ranks must run distributed_run exactly as
    under torchrun (leader / followers, the run folder and exit codes of covrl.train.runner), which TorchTrainer
    would wrap in its own run storage, reporting and failure policy; the group itself is these few lines."""
    acfg = cfg.async_loop
    world = cfg.trainer.world_size or 1
    cls = ray.remote(TrainerActor).options(num_cpus=acfg.trainer_cpus, num_gpus=acfg.trainer_gpus)
    actors = [cls.remote(cfg.model_dump(mode="json"), config_path, resume, rank, world) for rank in range(world)]
    try:
        master = ray.get(actors[0].endpoint.remote())
        nodes = ray.get([a.node.remote() for a in actors])
        calls = [a.train.remote(master, nodes.count(node)) for a, node in zip(actors, nodes)]
        try:
            code = ray.get(calls[0])   # the leader ends the run: 6 when another rank died (its collective broke)
        except ray.exceptions.RayActorError as err:   # the leader itself died: nobody wrote the final summary
            print_err(f"trainer rank 0 died ({type(err).__name__}); resume with: covrl train --resume --name NAME")
            return PEER_DIED
        if len(calls) > 1:   # the followers return once they hear "stop"
            ray.wait(calls[1:], num_returns=len(calls) - 1, timeout=cfg.trainer.timeout_s)
        return code
    finally:
        for a in actors:
            ray.kill(a)


def train_from_config_ray(cfg, *, config_path=None, resume: bool = False) -> int:
    """`covrl train` with loop.mode=ray: join or start Ray, then the trainer side (covrl.train.runner.run_training,
    with the same exit codes and final summary.json statuses as the local loops) in this process or, with
    async_loop.trainer_actor, in an actor placed by Ray; with trainer.parallel, in a group of
    trainer.world_size actors (one torch.distributed rank each)."""
    try:
        ray = _ray()
    except ImportError as err:
        print_err(str(err))
        return 2
    acfg = cfg.async_loop
    started = ensure_ray(acfg)
    try:
        if cfg.trainer.parallel != "none":
            return _train_group(ray, cfg, None if config_path is None else str(config_path), resume)
        if acfg.trainer_actor:
            actor = ray.remote(TrainerActor).options(num_cpus=acfg.trainer_cpus, num_gpus=acfg.trainer_gpus).remote(
                cfg.model_dump(mode="json"), None if config_path is None else str(config_path), resume)
            return ray.get(actor.train.remote())
        return run_training(cfg, prepare_async_run, train_ray, config_path=config_path, resume=resume)
    except KeyboardInterrupt:   # while waiting for the trainer actor (which writes its own summary)
        print_err("interrupted; resume with: covrl train --resume --name NAME")
        return 130
    finally:
        if started:
            ray.shutdown()
