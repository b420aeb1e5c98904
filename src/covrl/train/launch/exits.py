"""How a training run ends, for every loop mode and launcher: `run_training` prepares a run, trains it and maps
every way it can end to an exit code and a final summary.json status (the exit table below).

    0 ok · 1 unexpected error (traceback kept) · 2 bad input (one message; its traceback too with `covrl --debug`
    or COVRL_DEBUG=1) · 3 diverged · 4 checkpoint write failed (disk full)
    5 a sampler worker died past its restart budget, or the vLLM engine's own process died · 6 another rank of
    a distributed run died (set by covrl.train.launch.ranks), or the Ray trainer actor died (covrl.train.launch.ray)
    · 7 the weight-sync alarm fired (sync_alarm.mode=raise) · 130 interrupted (Ctrl-C) · 143 terminated (SIGTERM)
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from covrl._lazy import MissingExtraError
from covrl.models import ModelNotFoundError
from covrl.rollout.vllm import VLLMEngineDiedError
from covrl.settings import debug_enabled
from covrl.tasks import PromptTooLongError, UserCodeError
from covrl.train.asyncrl.pools import SamplerWorkerError
from covrl.train.run.alarm import SyncAlarmError
from covrl.train.run.checkpoint import CheckpointError
from covrl.train.run.folder import choose_run_dir, mark_summary, storage_lines
from covrl.train.run.resume import RunComplete
from covrl.train.run.sources import DynamicSamplingError
from covrl.train.step.trainer import TrainingDivergedError

__all__ = ["Terminated", "is_sigterm", "leave_summary_to_driver", "print_err", "print_summary_of", "run_training",
           "sigterm_as_interrupt"]


def print_err(text: str) -> None:
    print(f"covrl train: {text}", file=sys.stderr)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler, `kill`, a container stop): ends the run like Ctrl-C, so the run folder records
    it; exit code 143 = 128 + SIGTERM, as a shell reports a process killed by it."""


_sigterm_seen = threading.Event()   # set by the handler below (reset as it is installed)


def is_sigterm(err: BaseException) -> bool:
    """Whether an interrupt stands for a SIGTERM: a Terminated, or the plain KeyboardInterrupt that a library
    raises in its place once the handler has run (Ray's `ray.get` does)."""
    return isinstance(err, Terminated) or (isinstance(err, KeyboardInterrupt) and _sigterm_seen.is_set())


@contextmanager
def sigterm_as_interrupt():
    if threading.current_thread() is not threading.main_thread():   # signal handlers live in the main thread
        yield
        return

    def handler(signum, frame):
        _sigterm_seen.set()
        raise Terminated("SIGTERM")

    _sigterm_seen.clear()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_training(cfg, prepare_fn, train_fn, *, config_path=None, resume: bool = False) -> int:
    """The trainer side of `covrl train` for any loop: choose the run folder, prepare (`prepare_fn`), train
    (`train_fn`), and map every way it can end to an exit code and a final summary.json status."""
    run_dir = choose_run_dir(cfg, config_path=config_path, resume=resume)
    before = _read_text(run_dir / "summary.json")
    try:
        run_state = prepare_fn(cfg, config_path=config_path, resume=resume, run_dir=run_dir)
    except RunComplete as done:   # --resume of a run that did all its steps: say so, touch nothing
        print(done)
        return 0
    except (Exception, KeyboardInterrupt) as err:
        code, status, text = _outcome(err, run_dir.name, setup=True)
        if _read_text(run_dir / "summary.json") != before:   # this attempt wrote into the folder before failing
            mark_summary(run_dir, status, reason=_reason(err), exit_code=1 if code is None else code)
        if code is None or (code == 2 and debug_enabled()):
            raise
        if code in (130, 143) and not (run_dir / "config.yaml").is_file():
            text = "interrupted (before the run folder was written)"
        if code == 2 and _about_output_dir(err, Path(cfg.run.output_dir)):
            text = f"run.output_dir={str(cfg.run.output_dir)!r}: cannot write the run folder {run_dir} ({err})"
        print_err(text)
        return code
    note = (f" (resumed from {run_state.resumed_from})" if run_state.resumed_from else
            " (no complete checkpoint to resume: started from scratch)" if run_state.started_fresh else "")
    print(f"run folder: {run_state.run_dir}{note}")
    try:
        summary = train_fn(run_state)
    except (Exception, KeyboardInterrupt) as err:   # other BaseExceptions (SystemExit) pass untouched
        code, status, text = _outcome(err, run_state.run_dir.name, setup=False)
        reason = _reason(err)
        if status == "diverged":   # the loop counted and logged the step that raised
            reason = f"step {run_state.step}: {reason}"
        run_state.end(status, reason=reason, exit_code=1 if code is None else code)
        if code is None or (code == 2 and debug_enabled()):
            raise
        print_err(text)
        return code
    finally:
        run_state.close()
    if _summary_here:
        print_summary(summary)
    return 0


# A Ray trainer actor's last lines can be lost when the driver shuts Ray down, so there the driver prints the
# final summary from summary.json (print_summary_of) and the actor does not.
_summary_here = True


def leave_summary_to_driver() -> None:
    global _summary_here
    _summary_here = False


def print_summary_of(run_dir: Path) -> None:
    """The final summary of a run that ended elsewhere (a Ray trainer actor), read from its summary.json."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):   # the run folder is on another node
        print(f"done; results: {run_dir} (on the trainer's node)")
        return
    print_summary(summary)


def _about_output_dir(err: BaseException, output_dir: Path) -> bool:
    """Whether `err` is an OSError on run.output_dir, a folder above it or one inside it (the run folder)."""
    name = getattr(err, "filename", None) if isinstance(err, OSError) else None
    if not name:
        return False
    path, out = Path(name).absolute(), output_dir.absolute()
    return path == out or out in path.parents or path in out.parents


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _reason(err: BaseException) -> str:
    text = str(err).strip()
    return (f"{type(err).__name__}: {text}" if text else type(err).__name__)[:2000]


def _outcome(err: BaseException, name: str, *, setup: bool) -> tuple[int | None, str, str]:
    """(exit code, summary status, message) for an exception that ends `covrl train`. Code None: unexpected,
    re-raised with its traceback."""
    again = f"covrl train --resume --name {name}"
    if is_sigterm(err):
        return 143, "interrupted", f"terminated (SIGTERM); resume with: {again}"
    if isinstance(err, KeyboardInterrupt):
        return 130, "interrupted", f"interrupted; resume with: {again}"
    if isinstance(err, TrainingDivergedError):
        return 3, "diverged", str(err)
    if isinstance(err, SyncAlarmError):
        return 7, "failed", f"{err}\nfix the cause, then resume with: {again}"
    if isinstance(err, SamplerWorkerError):
        user_error = _bad_input_behind(err)   # a reward or prompt error met by an async sampler worker
        if user_error is not None:
            return 2, "failed", f"{user_error}\nstopped; fix the cause, then: {again}"
        return 5, "failed", f"{err}\nstopped; resume with: {again}"   # past the worker restart budget
    if isinstance(err, VLLMEngineDiedError):   # sampler.vllm.engine_process: the sampler's engine is gone
        return 5, "failed", f"{err}\nstopped; resume with: {again}"
    # before training: a missing file or model, a bad value or name, an extra that is not installed
    if setup and isinstance(err, (ModelNotFoundError, FileNotFoundError, ValueError, CheckpointError,
                                  MissingExtraError, PermissionError, NotADirectoryError)):
        return 2, "failed", str(err)
    if isinstance(err, (PromptTooLongError, UserCodeError, DynamicSamplingError, CheckpointError)):  # mid-run
        return (4 if isinstance(err, CheckpointError) else 2), "failed", f"{err}\nstopped; fix the cause, then: {again}"
    return None, "failed", _reason(err)


def print_summary(summary: dict) -> None:
    print(f"done: {summary['steps']} steps, {summary['rollouts']} rollouts, {summary['wall_time_s']:.0f} s "
          f"wall ({summary['status']})")
    for label in ("eval_before", "eval_after"):
        e = summary.get(label)
        if e:
            st = e["settings"]
            accs = ", ".join(f"{m} {e[m]:.1%}" for m in ("greedy", "sampled") if m in e)
            print(f"  held-out accuracy {label.split('_')[1]:>6}: {accs}  ({st['n_prompts']} prompts, "
                  f"max_new_tokens {st['max_new_tokens']}, sampled at T={st['temperature']})")
    print(f"  results: {summary['run_dir']}/summary.json, metrics.jsonl, eval.json, curves.png")
    for line in storage_lines(summary):   # where the checkpoint is, how big, and the run folder's disk use
        print(line)


def _bad_input_behind(err: BaseException) -> BaseException | None:
    """The PromptTooLongError / UserCodeError in `err`'s cause chain (through Ray's wrapper of a remote
    exception too), or None."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        unwrap = getattr(current, "as_instanceof_cause", None)   # ray.exceptions.RayTaskError
        if unwrap is not None:
            try:
                current = unwrap()
            except Exception:  # noqa: BLE001 - an exception Ray cannot rebuild: keep the wrapper
                pass
        if isinstance(current, (PromptTooLongError, UserCodeError)):
            return current
        current = current.__cause__ or current.__context__
    return None
