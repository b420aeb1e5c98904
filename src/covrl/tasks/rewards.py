"""Reward functions: a registry of built-ins, user functions named as `module:function` or
`path/to/file.py:function`, and isolated execution (exceptions and hangs become reward 0, counted).

Every reward function has one signature: `fn(completion: str, example: Example) -> float`.

Isolation of user functions (`task.reward_isolation`):
- "thread" (default): each call runs on a daemon worker thread and the caller waits at most `timeout_s`.
  A call that overruns is abandoned (Python cannot kill a thread): its worker is dropped and a fresh one
  serves the next call. Cheap (no process, no pickling, works with closures over any state); the price is
  that an abandoned call keeps running in the background until it returns (a busy loop keeps taking a
  share of the GIL) and that os._exit / a crash in native code ends the run.
- "process": the function is loaded by its spec inside a spawned worker process and called over a pipe
  (examples must be picklable). A call that overruns is killed with its process; a process that dies
  (os._exit, segfault) counts as an error and is replaced. Costs a process start (~1 s) and a pipe round
  trip per call.
Built-in rewards are trusted and called directly.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import queue
import re
import threading
from collections.abc import Callable
from pathlib import Path

from covrl.tasks.base import Example

RewardFn = Callable[[str, Example], float]

# A '-' is a sign only when it does not follow a digit or ')' ("10-4" is a subtraction, "is -4" a number).
_NUMBER = re.compile(r"(?<![\d)])-?\d[\d,]*(?:\.\d+)?")


def parse_last_number(text: str) -> float | None:
    """The last number in `text` (commas as thousands separators allowed), or None if there is none.
    Examples: "7+5=12" -> 12, "it is -3." -> -3, "1,000 apples" -> 1000, "no digits" -> None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _as_number(text: str) -> float | None:
    try:
        return float(text.strip().replace(",", ""))
    except ValueError:
        return None


def last_number(completion: str, example: Example) -> float:
    """1.0 if the last number in the completion equals the numeric answer (|diff| <= 1e-6), else 0.0."""
    target = _as_number(example.answer)
    got = parse_last_number(completion)
    if target is None or got is None:
        return 0.0
    return 1.0 if abs(got - target) <= 1e-6 else 0.0


def exact_match(completion: str, example: Example) -> float:
    """1.0 if the completion equals the answer after stripping surrounding whitespace, else 0.0."""
    return 1.0 if completion.strip() == example.answer.strip() else 0.0


def format_only(completion: str, example: Example) -> float:
    """1.0 if the completion is one bare number (the "answer with just the number" format), else 0.0.
    Says nothing about correctness; combine with a grader for accuracy."""
    return 1.0 if re.fullmatch(r"\s*-?\d[\d,]*(?:\.\d+)?\s*", completion) else 0.0


def last_number_format(completion: str, example: Example) -> float:
    """last_number, minus 0.1 when the completion holds more than the bare number (nudges the format)."""
    correct = last_number(completion, example)
    return correct - (0.0 if format_only(completion, example) else 0.1)


# name -> fn(completion, example) -> float
REWARDS: dict[str, RewardFn] = {
    "last_number": last_number,
    "exact_match": exact_match,
    "format": format_only,
    "last_number_format": last_number_format,
}


class RewardFunctionError(RuntimeError):
    pass


def load_user_reward(spec: str) -> RewardFn:
    """The function named by `spec`: "package.module:function" (imported) or "path/to/file.py:function"
    (the file is executed as a module). Only what the user names is loaded; strings are never evaluated."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"task.reward_fn={spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"task.reward_fn={spec!r}: file {path.resolve()} does not exist")
        mod_name = "covrl_user_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ImportError(f"task.reward_fn={spec!r}: cannot import module {target!r}: {err}") from err
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"task.reward_fn={spec!r}: {target} has no callable named {name!r}")
    return fn


def resolve_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"reward {name!r} is not registered; allowed: {sorted(REWARDS)} "
                         "(or set task.reward_fn to 'module:function' / 'file.py:function')")
    return REWARDS[name]


class _Box:
    __slots__ = ("done", "value", "error")

    def __init__(self):
        self.done = threading.Event()
        self.value = None
        self.error: BaseException | None = None


class _Worker:
    """A daemon thread that runs queued reward calls one at a time."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="covrl-reward").start()

    def _loop(self):
        while True:
            fn, args, box = self.jobs.get()
            try:
                box.value = fn(*args)
            except BaseException as err:  # noqa: BLE001 - isolate anything the user function throws
                box.error = err
            box.done.set()


def _process_main(spec: str, conn) -> None:
    """Body of a reward worker process: load the user function by its spec, then answer calls."""
    try:
        fn = load_user_reward(spec)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            completion, example = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", float(fn(completion, example))))
        except BaseException as err:  # noqa: BLE001 - SystemExit etc. become an error reply
            conn.send(("error", f"{type(err).__name__}: {err}"))


class _RemoteError(RuntimeError):
    """The user function raised inside the worker process (the process itself is fine)."""


class _ProcessWorker:
    """A spawned process that loads the user reward by its spec and serves calls over a pipe; a call that
    overruns, or a process that dies (os._exit, segfault), is killed and replaced on the next call."""

    def __init__(self, spec: str, startup_timeout_s: float = 120.0):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_process_main, args=(spec, child), daemon=True,
                                name="covrl-reward-process")
        self.proc.start()
        child.close()
        if not self.conn.poll(startup_timeout_s):
            self.kill()
            raise TimeoutError(f"reward worker process did not start within {startup_timeout_s} s")
        status, message = self.conn.recv()
        if status != "ready":
            self.kill()
            raise RuntimeError(f"reward worker process could not load {spec!r}: {message}")

    def call(self, completion: str, example: Example, timeout_s: float | None) -> float:
        self.conn.send((completion, example))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"took longer than {timeout_s} s")
        try:
            status, value = self.conn.recv()
        except EOFError as err:
            raise RuntimeError(f"reward worker process died (exit code {self.proc.exitcode})") from err
        if status != "ok":
            raise _RemoteError(value)
        return value

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardRunner:
    """Calls a reward function on a batch with exception isolation and an optional per-call timeout.

    on_error "zero": a raising / hanging / non-finite call gets reward 0.0 and counts in `errors`;
             "raise": the first failure raises RewardFunctionError naming the completion index."""

    def __init__(self, fn: RewardFn, *, name: str, timeout_s: float | None, on_error: str, isolate: bool,
                 process_spec: str | None = None):
        if on_error not in ("zero", "raise"):
            raise ValueError(f"task.reward_errors={on_error!r}; allowed: 'zero', 'raise'")
        self.fn, self.name, self.on_error = fn, name, on_error
        self.timeout_s = timeout_s if (timeout_s and isolate) else None
        self._worker: _Worker | None = None
        # process isolation: the user function runs in a spawned process loaded from this spec
        self.process_spec = process_spec
        self._process: _ProcessWorker | None = None

    def _call_process(self, completion: str, example: Example):
        if self._process is None or not self._process.proc.is_alive():
            self._process = _ProcessWorker(self.process_spec)
        try:
            return self._process.call(completion, example, self.timeout_s)
        except _RemoteError:
            raise
        except Exception as err:  # stuck, dead or broken pipe: the next call starts a fresh process
            self._process.kill()
            self._process = None
            if isinstance(err, TimeoutError):
                raise TimeoutError(f"reward function {self.name} {err}") from None
            raise RuntimeError(f"reward worker process failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Stop the worker process, if any."""
        if self._process is not None:
            self._process.kill()
            self._process = None

    def _call(self, completion: str, example: Example):
        if self.process_spec is not None:
            return self._call_process(completion, example)
        if self.timeout_s is None:
            try:
                return self.fn(completion, example)
            except (SystemExit, GeneratorExit) as err:  # sys.exit() inside a reward must not end the run
                raise RuntimeError(f"raised {type(err).__name__}({err})") from err
        if self._worker is None:
            self._worker = _Worker()
        box = _Box()
        self._worker.jobs.put((self.fn, (completion, example), box))
        if not box.done.wait(self.timeout_s):
            self._worker = None  # abandon the stuck thread; the next call gets a fresh worker
            raise TimeoutError(f"reward function {self.name} took longer than {self.timeout_s} s")
        if box.error is not None:
            if not isinstance(box.error, Exception):  # SystemExit/KeyboardInterrupt from user code on the worker
                raise RuntimeError(f"raised {type(box.error).__name__}({box.error})") from box.error
            raise box.error
        return box.value

    def __call__(self, completions: list[str], examples: list[Example]) -> tuple[list[float], int, int]:
        """(rewards, errors, timeouts)."""
        rewards: list[float] = []
        errors = timeouts = 0
        for i, (text, ex) in enumerate(zip(completions, examples)):
            try:
                value = float(self._call(text, ex))
                if not math.isfinite(value):
                    raise ValueError(f"returned a non-finite reward {value}")
            except Exception as err:  # noqa: BLE001
                if self.on_error == "raise":
                    raise RewardFunctionError(
                        f"reward function {self.name} failed on completion {i} "
                        f"(prompt {ex.prompt[:80]!r}): {type(err).__name__}: {err}") from err
                errors += 1
                timeouts += isinstance(err, TimeoutError)
                value = 0.0
            rewards.append(value)
        return rewards, errors, timeouts
