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

import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from covrl.settings import debug_enabled, user_error
from covrl.train.asyncrl.ray_pool import ensure_ray, ray_module, train_ray
from covrl.train.asyncrl.source import prepare_async_run
from covrl.train.config import TrainConfig
from covrl.train.launch.exits import (
    is_sigterm,
    leave_summary_to_driver,
    print_err,
    print_summary_of,
    run_training,
    sigterm_as_interrupt,
)
from covrl.train.launch.ranks import PEER_DIED, train_distributed
from covrl.train.parallel.wrappers import free_port
from covrl.train.run.folder import choose_run_dir, mark_summary
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

    def process(self) -> tuple[str, int]:
        """The id of this actor's node (the group counts its ranks per node: LOCAL_WORLD_SIZE) and its process id
        (a SIGTERM to the driver is passed to it there: `_pass_sigterm`). Asked before `train`, which holds the
        actor until the run ends."""
        return ray_module().get_runtime_context().get_node_id(), os.getpid()

    def train(self, master: tuple[str, int] | None = None, local_world: int = 1) -> int:
        """The whole trainer side (covrl.train.launch.exits.run_training) or this rank of the group (joined at
        `master`; `local_world` ranks on this node); returns `covrl train`'s exit code (a follower: rank 0's,
        sent at stop)."""
        if self.cfg.trainer.parallel != "none":   # as torchrun sets it: run.num_threads=auto shares the node
            os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
        apply_num_threads(self.cfg)
        leave_summary_to_driver()
        try:
            with sigterm_as_interrupt():   # Ray's worker would exit at a SIGTERM; a local run stops cleanly (143)
                return self._train(master)
        finally:   # the last lines (`done: ...`) reach the worker's log before the driver kills the actor
            sys.stdout.flush()
            sys.stderr.flush()

    def _train(self, master: tuple[str, int] | None) -> int:
        if self.cfg.trainer.parallel == "none":
            return run_training(self.cfg, prepare_async_run, train_ray, config_path=self.config_path,
                                resume=self.resume)
        # the environment torchrun gives its ranks (torch.distributed's env:// rendezvous reads it); Ray gives
        # each actor its own GPUs (CUDA_VISIBLE_DEVICES), so its device is local rank 0
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK="0")
        return train_distributed(self.cfg, prepare_async_run, train_ray, config_path=self.config_path,
                                 resume=self.resume)


STOP_GRACE_S = 300.0   # how long SIGTERMed trainer actors may take to stop


def _sigterm(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:   # it ended meanwhile
        pass


def _pass_sigterm(ray, calls: list, places: list[tuple[str, int]], run_dir: Path) -> int:
    """The driver was sent SIGTERM while trainer actors train: send it to each actor's process, on its node (as
    torchrun does to its ranks), so the run stops as a local one does (summary.json "interrupted", exit code
    143; `--resume` continues from its last checkpoint), and return rank 0's exit code. Left to Ray, the
    actors were killed at the driver's exit (SIGABRT): the summary stayed "running"."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    print_err(f"terminated (SIGTERM): passing it to the trainer actor{'s' if len(places) > 1 else ''}")
    again = f"resume with: covrl train --resume --name {run_dir.name}"
    here = ray.get_runtime_context().get_node_id()
    send = ray.remote(num_cpus=0)(_sigterm)
    try:
        for node, pid in places:
            if node == here:
                _sigterm(pid)
        # on other nodes by a task placed there (a worker to start: seconds)
        ray.get([send.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid)
                 for node, pid in places if node != here], timeout=60)
        code = ray.get(calls[0], timeout=STOP_GRACE_S)
        if len(calls) > 1:   # the followers return once they hear "stop"
            ray.wait(calls[1:], num_returns=len(calls) - 1, timeout=60)
        return code
    except ray.exceptions.GetTimeoutError:
        print_err(f"the trainer actors did not stop within {STOP_GRACE_S:g} s; the run folder keeps its complete "
                  f"checkpoints; {again}")
    except ray.exceptions.RayError as err:   # it died meanwhile
        _mark_failed(run_dir, f"the Ray trainer actor died after SIGTERM ({type(err).__name__})")
        print_err(f"the trainer actor died before its own stop ({type(err).__name__}); {again}")
    return 143


def _train_group(ray, cfg, config_path: str | None, resume: bool, run_dir: Path) -> int:
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
        places = ray.get([a.process.remote() for a in actors])
        nodes = [node for node, _ in places]
        calls = [a.train.remote(master, nodes.count(node)) for a, node in zip(actors, nodes)]
        try:
            code = ray.get(calls[0])   # the leader ends the run: 6 when another rank died (its collective broke)
        except KeyboardInterrupt as err:
            if not is_sigterm(err):
                raise
            return _pass_sigterm(ray, calls, places, run_dir)
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


def _mark_failed(run_dir: Path, reason: str) -> None:
    """Finish the summary.json that a run which died without a word left "running" (when the run folder is on this node)."""
    try:
        running = json.loads((run_dir / "summary.json").read_text()).get("status") == "running"
    except (OSError, ValueError):
        running = False
    if running:
        mark_summary(run_dir, "failed", reason=reason, exit_code=PEER_DIED)


def _trainer_actor_lost(err: BaseException, run_dir: Path) -> int:
    """The trainer actor died without a word (killed, OOM, the Ray head or its node lost): it wrote no final
    summary, so the driver says what happened and marks the summary; its checkpoints are complete (each is
    published by one rename). Exit code 6, as for a dead trainer rank."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    reason = f"the Ray trainer actor died ({type(err).__name__}: {first[:300]})"
    _mark_failed(run_dir, reason)
    print_err(f"{reason}: its process, its node or the Ray cluster is gone; the run folder keeps its complete "
              f"checkpoints; resume with: covrl train --resume --name {run_dir.name}")
    return PEER_DIED


HEAD_POLL_S = 0.2


def _watch_local_head(ray, run_dir: Path) -> threading.Event | None:
    """For a local Ray instance this process started: a thread that polls its head (gcs_server, raylet). When
    the head dies, Ray ends this process itself without a word: at once from its C++ core worker (exit 1; one
    line in Ray's driver log, "The connection to the plasma store is failed. Terminate the process.") or after
    its 60 s GCS reconnect timeout. The watcher, when it is first, names the loss, marks the summary and exits 6
    (`os._exit`: what is on disk is what a kill leaves, which --resume handles). Returns the event that stops it
    (set before ray.shutdown, which stops the head on purpose); None when the head's processes are unknown."""
    node = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}
    head = [(name, info.process) for name in ("gcs_server", "raylet") for info in processes.get(name, [])
            if hasattr(getattr(info, "process", None), "poll")]
    if not head:
        return None
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(HEAD_POLL_S):
            gone = [(name, proc) for name, proc in head if proc.poll() is not None]
            if not gone:
                continue
            name, proc = gone[0]
            # a SIGTERM to the whole process group (a job scheduler) reached this process too: its own exit (143)
            if proc.returncode == -signal.SIGTERM and stop.wait(10.0):
                return
            if not stop.is_set():
                reason = f"the local Ray instance's head is gone ({name}, pid {proc.pid}, exit code {proc.returncode})"
                _mark_failed(run_dir, reason)
                print_err(f"{reason}: the run stops; the run folder keeps its complete checkpoints; resume with: "
                          f"covrl train --resume --name {run_dir.name}")
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(PEER_DIED)
                return   # (os._exit does not return)

    threading.Thread(target=watch, name="covrl-ray-head-watch", daemon=True).start()
    return stop


RAY_CONNECT_TIMEOUT_S = 5.0   # a cluster's head answers a TCP connect at once; Ray itself would retry for minutes


def _check_ray_address(address: str | None) -> None:
    """A ConnectionError at once when nothing listens at a `host:port` (or `ray://host:port`) address: ray.init
    would retry the connection for minutes before failing. `auto` is Ray's own quick lookup; None, `local`:
    covrl starts a local instance."""
    if not address or address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return   # a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise ConnectionError(f"nothing answers at {host}:{port} ({err.strerror or err})") from err


def _no_cluster(address: str, err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return (f"async_loop.ray_address={address!r}: no Ray cluster found at that address ({first}). Start one with "
            "`ray start --head` (then async_loop.ray_address=auto on the same machine, or the address it prints), "
            "or remove async_loop.ray_address to let covrl start a local Ray instance for the run")


def train_from_config_ray(cfg, *, config_path=None, resume: bool = False) -> int:
    """`covrl train` with loop.mode=ray: join or start Ray, then the trainer side (covrl.train.launch.exits.run_training,
    with the same exit codes and final summary.json statuses as the local loops) in this process or, with
    async_loop.trainer_actor, in an actor placed by Ray; with trainer.parallel, in a group of
    trainer.world_size actors (one torch.distributed rank each)."""
    try:
        ray = ray_module()
    except ImportError as err:
        return user_error("covrl train", err)
    acfg = cfg.async_loop
    try:
        _check_ray_address(acfg.ray_address)
        started = ensure_ray(acfg, cfg.logging.engine_logs)
    except ConnectionError as err:   # nothing answers at async_loop.ray_address
        if debug_enabled():
            raise
        return user_error("covrl train", _no_cluster(acfg.ray_address, err))
    head_watch = None
    try:
        shortfall = resource_shortfall(cfg, ray.cluster_resources())
        if shortfall is not None:   # Ray would wait for ever to place what does not fit
            print_err(shortfall)
            return 2
        run_dir = choose_run_dir(cfg, config_path=config_path, resume=resume)   # the folder the trainer side takes
        if started:
            head_watch = _watch_local_head(ray, run_dir)
        if cfg.trainer.parallel != "none":
            code = _train_group(ray, cfg, None if config_path is None else str(config_path), resume, run_dir)
            if code == 0:
                print_summary_of(run_dir)
            return code
        if acfg.trainer_actor:
            actor = ray.remote(TrainerActor).options(num_cpus=acfg.trainer_cpus, num_gpus=acfg.trainer_gpus).remote(
                cfg.model_dump(mode="json"), None if config_path is None else str(config_path), resume)
            call = None
            try:
                place = ray.get(actor.process.remote())
                call = actor.train.remote()
                code = ray.get(call)
                if code == 0:
                    print_summary_of(run_dir)
                return code
            except KeyboardInterrupt as err:
                if call is None or not is_sigterm(err):
                    raise
                return _pass_sigterm(ray, [call], [place], run_dir)
            except ray.exceptions.RayActorError as err:   # its process, its node or the whole cluster is gone
                return _trainer_actor_lost(err, run_dir)
        return run_training(cfg, prepare_async_run, train_ray, config_path=config_path, resume=resume)
    except KeyboardInterrupt as err:   # while waiting for the trainer actor (which writes its own summary)
        if is_sigterm(err):
            print_err("terminated (SIGTERM); resume with: covrl train --resume --name NAME")
            return 143
        print_err("interrupted; resume with: covrl train --resume --name NAME")
        return 130
    finally:
        if head_watch is not None:
            head_watch.set()
        if started:
            ray.shutdown()
