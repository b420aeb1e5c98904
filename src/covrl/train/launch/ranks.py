"""`covrl train` with `trainer.parallel` = ddp / fsdp2 under torchrun: rank 0 is the leader, the others follow.

    rank 0 (leader)                                   rank k > 0 (follower)
    run_training as in one process: run folder,       build the model (no warm-up: the first step's wrap
    sampler, eval, logging, checkpoints               broadcasts rank 0's weights), then obey the channel:
    after prepare: send ("start", trainer state)      ("start", state) -> Trainer(model, cfg), load state
    Trainer.step: send ("step", batch), then step     ("step", batch)  -> Trainer.step(batch)
    at exit: send ("stop", exit code)                 ("stop", code)   -> return

Why rank 0 generates and broadcasts the whole ScoredBatch rather than every rank generating the same batch:
only rank 0 needs a sampler (one engine, one set of weights to publish), the batch is token ids (small next to
the step), and every rank holding the full batch makes the global normaliser and the full-batch metrics local
arithmetic (each rank knows the full mask) with no all-reduce of normalisers. The sync and async sources stay
as they are: they run on rank 0 only.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading

import torch.distributed as dist

from covrl.models import frozen_copy, load_model
from covrl.train.launch.exits import Terminated, is_sigterm, run_training
from covrl.train.parallel.shards import ShardIOError
from covrl.train.parallel.wrappers import Channel, init_process_group
from covrl.train.run.components import build_teacher, resolve_device, seed_everything
from covrl.train.run.folder import mark_summary
from covrl.train.run.threads import apply_num_threads
from covrl.train.step.trainer import Trainer, TrainingDivergedError

__all__ = ["PEER_DIED", "follow", "train_distributed"]

PEER_DIED = 6   # rank 0's exit code when another rank died mid-run (covrl.train.launch.exits's table)


def train_distributed(cfg, prepare_fn, train_fn, *, config_path=None, resume: bool = False) -> int:
    """The exit code of this rank (rank 0: run_training's table; followers: rank 0's code, sent at stop)."""
    fsdp2 = cfg.trainer.parallel == "fsdp2"
    if fsdp2:   # the sampler cannot run the sharded model: it keeps its own copy, fed by a gather
        cfg.sampler.share_weights = "never"
    rank, world = init_process_group(cfg.trainer, cfg.run.device)
    if world > 1 and not faulthandler.is_enabled():
        # a native abort in one rank (gloo, a C++ terminate) otherwise leaves one line and no Python stack
        faulthandler.enable(all_threads=True)
    channel = Channel()
    try:
        if rank != 0:
            try:
                return follow(cfg, channel)
            except KeyboardInterrupt as err:   # SIGTERM / Ctrl-C (a launcher stopped passes it to every rank)
                code = 143 if is_sigterm(err) else 130
                print(f"covrl train: rank {rank} {'terminated (SIGTERM)' if code == 143 else 'interrupted'}",
                      file=sys.stderr)
                return code
        code = 1   # an exception escaping run_training (a traceback) still stops the followers

        run_dirs = []

        def prepare(cfg, **kwargs):
            run = prepare_fn(cfg, **kwargs)
            run_dirs.append(run.run_dir)
            channel.send(("start", run.trainer.state_dict()))   # a resumed optimizer / data clock too
            run.trainer.leader = channel
            if fsdp2:
                run.sampler = _GatheringSampler(run.sampler, run.trainer)
            return run

        crash: BaseException | None = None
        try:
            with _sigterm_between_collectives(channel):
                code = run_training(cfg, prepare, train_fn, config_path=config_path, resume=resume)
        except (RuntimeError, KeyboardInterrupt) as err:   # a collective's error, or SIGTERM during its handling
            crash = err
        # when a rank dies, the survivor's collective raises and torchrun's agent SIGTERMs it, in either order,
        # possibly while the lines above handle the first: finish the bookkeeping undisturbed
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) \
            if world > 1 and threading.current_thread() is threading.main_thread() else None
        try:
            lost = _stop(channel, code)
            if lost is not None and run_dirs:   # the group is broken: whatever came first, a rank died
                # this rank's own SIGTERM / Ctrl-C may be the launcher's (passed to every rank) or the one
                # torchrun sends the survivors of a dead rank: they cannot be told apart from here
                also = ("; this rank was terminated (SIGTERM) too: the launcher was stopped, or torchrun stopped "
                        "the survivors of a dead rank" if code == 143 else
                        "; this rank was interrupted too" if code == 130 else "")
                code, crash = PEER_DIED, None
                mark_summary(run_dirs[0], "failed", exit_code=code, reason=(
                    f"another rank died or became unreachable mid-run (the process group broke: {lost}){also}; "
                    f"resume with: covrl train --resume --name {run_dirs[0]}"))
                print(f"covrl train: another rank died (exit code {code}); resume with: covrl train --resume "
                      f"--name {run_dirs[0]}", file=sys.stderr)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if crash is not None:
            raise crash
        return code
    finally:
        with contextlib.suppress(RuntimeError):   # a group with a dead rank cannot always be torn down cleanly
            dist.destroy_process_group()


@contextlib.contextmanager
def _sigterm_between_collectives(channel: Channel):
    """Rank 0: a SIGTERM that comes while every rank is inside the collectives of a step (a gather, a checkpoint)
    takes effect once rank 0 has done its part (`Channel.close`). Raised midway, it left the others waiting
    there, where the stop message cannot reach them: every rank then hung until trainer.timeout_s or torchrun's
    SIGKILL (found by the SIGTERM trials of tests/reliability/test_distributed_faults.py)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        def act():
            if callable(previous):
                previous(signum, frame)   # sigterm_as_interrupt's: raises Terminated
            raise Terminated("SIGTERM")

        if channel.open is None:
            act()
        channel.deferred = act

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(channel: Channel, code: int) -> str | None:
    """Tell the followers to stop. None when they heard it; else why not (a dead rank broke the group: there is
    nobody to tell, and the run's exit code must not become this collective's traceback)."""
    try:
        channel.send(("stop", code))
    except RuntimeError as err:   # gloo / nccl: a peer's connection reset or a timeout
        return str(err).splitlines()[0][:200] if str(err).strip() else type(err).__name__
    return None


def follow(cfg, channel: Channel) -> int:
    """A follower rank: a trainer on its own copy of the model, stepping on the batches rank 0 sends."""
    apply_num_threads(cfg)
    seed_everything(cfg.run.seed)
    trainer = None
    while True:
        kind, payload = channel.recv()
        if kind == "stop":
            return int(payload)
        if kind == "start":
            model, tokenizer = load_model(cfg.model, seed=cfg.run.seed)
            model.to(resolve_device(cfg.run.device))
            # a KL reference: a replica, filled with rank 0's reference at the first step (Trainer._distribute)
            trainer = Trainer(model, cfg, ref_model=frozen_copy(model) if cfg.kl.coef > 0 else None,
                              teacher=build_teacher(cfg, tokenizer, model.device))
            trainer.load_state_dict(payload)
        elif kind == "gather":
            trainer.full_weights()
        elif kind == "checkpoint":    # rank 0 writes the folder's other files and the COMPLETE marker
            try:
                trainer.save_sharded(payload)
            except ShardIOError:   # a full disk / read-only folder: every rank raised it (DCP gathers the
                pass                  # failures); rank 0 removes the partial folder, ends the run (4), says stop
        elif kind == "step":
            try:
                trainer.step(payload)
            except TrainingDivergedError:   # rank 0 met the same skipped steps: it ends the run and says stop
                pass
        else:
            raise RuntimeError(f"follower: unknown message {kind!r} from rank 0")


class _GatheringSampler:
    """Rank 0's sampler under fsdp2: `load_weights(model)` gathers the full weights from the shards (the
    followers join the collective on a "gather" message); weights already gathered (a dict: the async pools
    gather at publish, in the loop's thread, and a sampler thread loads them later) pass through; everything
    else is the sampler's."""

    def __init__(self, sampler, trainer: Trainer):
        self.__dict__.update(_sampler=sampler, _trainer=trainer)

    def __getattr__(self, name):
        return getattr(self._sampler, name)

    def __setattr__(self, name, value):
        setattr(self._sampler, name, value)

    def load_weights(self, model, version: int) -> None:
        if model is not self._trainer.model or not self._trainer.sharded:   # gathered, or not sharded yet
            return self._sampler.load_weights(model, version)
        # the gather is a collective: only the loop's thread may start it (it orders rank 0's messages)
        self._sampler.load_weights(self._trainer.full_weights(), version)
