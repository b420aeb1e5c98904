"""Fault injection for the reliability tests: stop the process at the n-th hit of a named point.

The hooks are inert unless the environment asks for a fault, so production runs pay one dict lookup per hit.

    COVRL_FAULT="<point>:<n>[:<action>][,<point>:<n>[:<action>] ...]"
        at the n-th call of `fault_point(point)` in this process (n >= 1), do <action>:
          kill    (default) SIGKILL this process: no cleanup, no atexit, no flush -- what `kill -9` does
          enospc  raise OSError(ENOSPC, "No space left on device") at that spot (a full disk)
          erofs   raise OSError(EROFS, "Read-only file system") at that spot (a folder that became read-only;
                  what a chmod cannot show when the tests run as root, who ignores permission bits)
          abort   SIGABRT this process (os.abort): a native crash, as a C++ std::terminate in torch or gloo is
          term    SIGTERM this process (a scheduler's stop, `kill`) at that exact spot; its handler takes it from there
    COVRL_FAULT_RANK=<k>
        only the process whose RANK (torchrun's environment) is k injects: one rank of a distributed run dies
    COVRL_FAULT_TRACE=<file>
        append one line "<pid> <point> <hit>" per hit (before the action), so a test can count how many
        times a point is reached in an uninterrupted run and then draw a kill point among them.

Points wired into the code (one call each):

    generate           covrl.train.run.driver.train_sync, after `sampler.generate` returned: the step's rollouts exist
                       in memory only (drawn, not yet scored or trained)
    backward           covrl.train.step.trainer.Trainer.step, after each micro-batch's `loss.backward()`: gradients
                       half-accumulated, optimizer not stepped
    checkpoint-write   covrl.train.run.checkpoint.save_checkpoint, after the weights are written into the temporary
                       folder and before trainer_state.pt / COMPLETE: a half-written checkpoint on disk
    checkpoint-commit  save_checkpoint, after COMPLETE is written and before the temporary folder is renamed
                       into place
    checkpoint-shards  covrl.train.parallel.wrappers.save_sharded (trainer.parallel=fsdp2), as each rank starts
                       writing its torch.distributed.checkpoint shards into the temporary folder's dcp/: inside
                       DCP's collective, which gathers every rank's failure (COVRL_FAULT_RANK picks the rank)

`POINTS` lists them; `fault_point` refuses other names so a typo in a test cannot silently inject nothing.
"""

from __future__ import annotations

import errno
import os
import signal

__all__ = ["ACTIONS", "ENV", "POINTS", "RANK_ENV", "TRACE_ENV", "FaultSpecError", "fault_point", "parse_spec", "reset"]

ENV = "COVRL_FAULT"
RANK_ENV = "COVRL_FAULT_RANK"
TRACE_ENV = "COVRL_FAULT_TRACE"
POINTS = ("generate", "backward", "checkpoint-write", "checkpoint-commit", "checkpoint-shards")
ACTIONS = ("kill", "enospc", "erofs", "abort", "term")


class FaultSpecError(ValueError):
    """A malformed COVRL_FAULT value."""


def parse_spec(text: str) -> dict[str, tuple[int, str]]:
    """'backward:3,checkpoint-write:1:enospc' -> {'backward': (3, 'kill'), 'checkpoint-write': (1, 'enospc')}."""
    plan: dict[str, tuple[int, str]] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        fields = item.split(":")
        if len(fields) not in (2, 3):
            raise FaultSpecError(f"{ENV}={text!r}: item {item!r} is not <point>:<n>[:<action>]")
        point, count, action = fields[0], fields[1], (fields[2] if len(fields) == 3 else "kill")
        if point not in POINTS:
            raise FaultSpecError(f"{ENV}={text!r}: unknown point {point!r}; allowed: {', '.join(POINTS)}")
        if action not in ACTIONS:
            raise FaultSpecError(f"{ENV}={text!r}: unknown action {action!r}; allowed: {', '.join(ACTIONS)}")
        try:
            n = int(count)
        except ValueError:
            raise FaultSpecError(f"{ENV}={text!r}: hit count {count!r} is not an integer") from None
        if n < 1:
            raise FaultSpecError(f"{ENV}={text!r}: hit count must be >= 1, got {n}")
        plan[point] = (n, action)
    return plan


_plan: dict[str, tuple[int, str]] | None = None
_trace: str | None = None
_hits: dict[str, int] = {}


def reset() -> None:
    """Forget the parsed environment and the hit counters (tests that change COVRL_FAULT in-process)."""
    global _plan, _trace
    _plan, _trace = None, None
    _hits.clear()


def _load() -> dict[str, tuple[int, str]]:
    global _plan, _trace
    if _plan is None:
        rank = os.environ.get(RANK_ENV)
        mine = rank is None or rank == os.environ.get("RANK", "0")
        _plan = parse_spec(os.environ.get(ENV, "")) if mine else {}
        _trace = os.environ.get(TRACE_ENV) or None
    return _plan


def fault_point(point: str) -> None:
    """Count a hit of `point` and fire the configured fault when the count is reached (see module doc)."""
    plan = _load()
    if not plan and _trace is None:
        return
    if point not in POINTS:
        raise FaultSpecError(f"fault_point({point!r}): unknown point; allowed: {', '.join(POINTS)}")
    hit = _hits[point] = _hits.get(point, 0) + 1
    if _trace is not None:
        with open(_trace, "a") as f:
            f.write(f"{os.getpid()} {point} {hit}\n")
    target = plan.get(point)
    if target is None or hit != target[0]:
        return
    if target[1] == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV} at {point}:{hit})")
    if target[1] == "erofs":
        raise OSError(errno.EROFS, f"Read-only file system (injected by {ENV} at {point}:{hit})")
    if target[1] == "abort":
        os.abort()
    if target[1] == "term":
        os.kill(os.getpid(), signal.SIGTERM)   # the main thread's handler runs at its next bytecode
        return
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)  # pragma: no cover - platforms without SIGKILL
