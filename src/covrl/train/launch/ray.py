"""The trainer side of the Ray backend (`loop.mode=ray`): join or start Ray, then run the trainer side (the same
code as the local async loop, with Ray sampler actors: covrl.train.asyncrl.ray_pool) in the driver, in a trainer
actor, or in a group of trainer.world_size actors that are torch.distributed ranks.

    driver ── ray.init(address=async_loop.ray_address) ── TrainerActor.train()  (or the driver itself)
                                                              │  dispatcher thread: admit chunk -> actor.generate
                      SamplerActor × num_samplers  <──────────┘  weights: ray.put(state_dict) once per sync

With trainer.parallel=ddp|fsdp2 the driver asks rank 0's actor for a rendezvous address and port and gives it to
all; they run covrl.train.launch.ranks as torchrun's ranks do: rank 0 the leader (run folder, sampler actors,
logging, eval, checkpoints), the others followers (docs/distributed.md).
"""

from __future__ import annotations

import os
import sys

from covrl.train.asyncrl.ray_pool import ensure_ray, ray_module, train_ray
from covrl.train.asyncrl.source import prepare_async_run
from covrl.train.config import TrainConfig
from covrl.train.launch.exits import print_err, run_training
from covrl.train.launch.ranks import PEER_DIED, train_distributed
from covrl.train.parallel.wrappers import free_port
from covrl.train.run.threads import apply_num_threads

__all__ = ["TrainerActor", "train_from_config_ray"]


class TrainerActor:
    """The trainer side inside a Ray actor (placed where `trainer_cpus`/`trainer_gpus` are free). Alone
    (trainer.parallel=none) it is the whole trainer side: it writes the run folder on its node and creates the
    sampler actors. In a group (trainer.parallel=ddp|fsdp2, trainer.world_size actors) it is one rank of the
    torch.distributed trainer: rank 0 is that same trainer side as the leader, the others follow it
    (covrl.train.launch.ranks, the code torchrun's ranks run)."""

    def __init__(self, cfg_dict: dict, config_path: str | None, resume: bool, rank: int = 0, world: int = 1):
        self.cfg = TrainConfig.model_validate(cfg_dict)
        self.config_path = config_path
        self.resume = resume
        self.rank, self.world = rank, world

    def endpoint(self) -> tuple[str, int]:
        """This actor's node address and a port free there: the group's rendezvous (MASTER_ADDR/PORT), asked of
        rank 0 because only its node knows which of its ports are free."""
        address = ray_module().util.get_node_ip_address()
        return address, free_port(address)

    def node(self) -> str:
        """The id of this actor's node (the group counts its ranks per node: LOCAL_WORLD_SIZE)."""
        return ray_module().get_runtime_context().get_node_id()

    def train(self, master: tuple[str, int] | None = None, local_world: int = 1) -> int:
        """The whole trainer side (covrl.train.launch.exits.run_training) or this rank of the group (joined at
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
    under torchrun (leader / followers, the run folder and exit codes of covrl.train.launch.exits), which TorchTrainer
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


def resource_shortfall(cfg, resources: dict) -> str | None:
    """Why the run's actors cannot all be placed on a cluster with `resources` (ray.cluster_resources()), with
    the numbers and the options that change them; None when they fit (in total: a necessary condition)."""
    acfg = cfg.async_loop
    trainers = (cfg.trainer.world_size or 1) if cfg.trainer.parallel != "none" else int(acfg.trainer_actor)
    need = {"CPU": trainers * acfg.trainer_cpus + acfg.num_samplers * acfg.sampler_cpus,
            "GPU": trainers * acfg.trainer_gpus + acfg.num_samplers * acfg.sampler_gpus}
    short = {k: v for k, v in need.items() if v > float(resources.get(k, 0.0)) + 1e-9}
    if not short:
        return None
    parts = ", ".join(f"{v:g} {k} needed, {float(resources.get(k, 0.0)):g} in the cluster" for k, v in short.items())
    return (f"loop.mode=ray: the actors do not fit ({parts}): {trainers} trainer actor(s) x "
            f"async_loop.trainer_cpus={acfg.trainer_cpus:g} (+ trainer_gpus={acfg.trainer_gpus:g}) and "
            f"async_loop.num_samplers={acfg.num_samplers} x sampler_cpus={acfg.sampler_cpus:g} (+ sampler_gpus="
            f"{acfg.sampler_gpus:g}); Ray would wait for ever to place them. Lower async_loop.trainer_cpus / "
            "sampler_cpus (e.g. 0.5: actors share a core), run fewer samplers or trainer ranks "
            "(trainer.world_size), or join a larger cluster (async_loop.ray_address)")


def train_from_config_ray(cfg, *, config_path=None, resume: bool = False) -> int:
    """`covrl train` with loop.mode=ray: join or start Ray, then the trainer side (covrl.train.launch.exits.run_training,
    with the same exit codes and final summary.json statuses as the local loops) in this process or, with
    async_loop.trainer_actor, in an actor placed by Ray; with trainer.parallel, in a group of
    trainer.world_size actors (one torch.distributed rank each)."""
    try:
        ray = ray_module()
    except ImportError as err:
        print_err(str(err))
        return 2
    acfg = cfg.async_loop
    started = ensure_ray(acfg)
    try:
        shortfall = resource_shortfall(cfg, ray.cluster_resources())
        if shortfall is not None:   # Ray would wait for ever to place what does not fit
            print_err(shortfall)
            return 2
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
