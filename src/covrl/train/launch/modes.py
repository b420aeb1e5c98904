"""`covrl train`'s launcher: the loop mode table and the entry that runs a config to its exit code.

    loop.mode  prepare                    train
    sync       prepare_run                train_sync   (SyncSource)
    async      prepare_async_run          train_async  (AsyncSource over the thread / process / serial pool)
    ray        train_from_config_ray: join or start Ray, then the same trainer side in an actor or here

trainer.parallel = ddp / fsdp2: covrl.train.launch.ranks, rank 0 runs the row above as the leader and the
other ranks follow it; the ranks are torchrun's (sync, async) or trainer.world_size Ray actors (ray;
covrl.train.launch.ray) (docs/distributed.md).
"""

from __future__ import annotations

from collections.abc import Callable

from covrl.settings import user_error
from covrl.train.asyncrl.source import prepare_async_run, train_async
from covrl.train.launch.exits import run_training, sigterm_as_interrupt
from covrl.train.launch.ranks import train_distributed
from covrl.train.launch.ray import train_from_config_ray
from covrl.train.parallel.wrappers import RendezvousError
from covrl.train.run.driver import train_sync
from covrl.train.run.folder import prepare_run

__all__ = ["LOOP_MODES", "train_from_config"]

# loop.mode -> (prepare(cfg, config_path=..., resume=..., run_dir=...) -> Run, train(run) -> summary)
LOOP_MODES: dict[str, tuple[Callable, Callable]] = {
    "sync": (prepare_run, train_sync),
    "async": (prepare_async_run, train_async),
}


def train_from_config(cfg, *, config_path=None, resume: bool = False) -> int:
    """Prepare the run, train, print where results went; returns the exit code (covrl.train.launch.exits's table).
    Every exit leaves summary.json with a final status, and for a failure the reason and the exit code (a
    refused --resume leaves the folder as it was)."""
    with sigterm_as_interrupt():
        if cfg.loop.mode == "ray":   # Ray is started or joined first; the trainer side may run in an actor
            return train_from_config_ray(cfg, config_path=config_path, resume=resume)
        if cfg.loop.mode not in LOOP_MODES:
            raise ValueError(f"loop.mode={cfg.loop.mode!r}; allowed: {', '.join([*LOOP_MODES, 'ray'])}")
        prepare_fn, train_fn = LOOP_MODES[cfg.loop.mode]
        if cfg.trainer.parallel != "none":
            try:
                return train_distributed(cfg, prepare_fn, train_fn, config_path=config_path, resume=resume)
            except RendezvousError as err:   # before any run folder exists: the message is the whole story
                return user_error("covrl train", err)
        return run_training(cfg, prepare_fn, train_fn, config_path=config_path, resume=resume)
