"""Reward functions: a registry of built-ins, user functions named as `module:function` or
`path/to/file.py:function`, and isolated execution (exceptions and hangs become reward 0, counted).

Two signatures (`task.reward_signature`, "auto" detects them from the function's parameters):
- covrl's, per completion: `fn(completion: str, example: Example) -> float`;
- TRL's, per batch: `fn(completions: list[str], **columns) -> list[float | None]`, called once per batch with
  `prompts` and `completions` and every dataset field as a list (the answer under its field name, e.g.
  `answer` / `solution`, and each other field of the row), as TRL's GRPOTrainer calls it. A function without
  `**kwargs` gets only the names it declares. `None` in the result means "no reward for this row" (TRL's
  convention): it counts 0. TRL's `completion_ids` and `trainer_state` are not passed.
A function that fails on every completion of `task.max_consecutive_reward_errors` batches in a row stops the run
with RewardFunctionError, showing its own exception and traceback (a reward that always raises would otherwise
train at reward 0 to the end).

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

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import queue
import re
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from covrl.settings import ConfigError
from covrl.tasks.base import Example
from covrl.tasks.failures import FailureWatch, UserCodeError, format_error
from covrl.tasks.graders import math_verify_reward, reasoning_gym_reward

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


_MARKED = re.compile(r"#\s*(-?\d+)")


def marked_number(text: str) -> int | None:
    """The integer right after the last '#' in `text` (GSM8K's "#### 42" convention), or None.
    Examples: "a:00+7=07;#07" -> 7, "#1 then #23" -> 23, "no marker 5" -> None, "#x" -> None."""
    at = text.rfind("#")
    if at < 0:
        return None
    m = _MARKED.match(text, at)
    return int(m.group(1)) if m else None


def final_answer(completion: str, example: Example) -> float:
    """1.0 if the number after the completion's last '#' equals the one after the reference's last '#' (a worked
    solution ending "...#15"), else 0.0: the working is free, only the marked result counts."""
    target = marked_number(example.answer)
    got = marked_number(completion)
    return 1.0 if target is not None and got == target else 0.0


# name -> fn(completion, example) -> float
REWARDS: dict[str, RewardFn] = {
    "last_number": last_number,
    "exact_match": exact_match,
    "format": format_only,
    "last_number_format": last_number_format,
    "final_answer": final_answer,
    "math_verify": math_verify_reward,       # extra covrl[reasoning]
    "reasoning_gym": reasoning_gym_reward,   # extra covrl[reasoning]; task.name=reasoning_gym only
}

# built-ins that can hang (a symbolic solver) run isolated like user rewards, with task.reward_timeout_s: the
# spec is what a reward worker process imports (task.reward_isolation=process)
ISOLATED_REWARDS: dict[str, str] = {"math_verify": "covrl.tasks.graders:math_verify_reward",
                                    "reasoning_gym": "covrl.tasks.graders:reasoning_gym_reward"}


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens with a budget of `max_tokens`:

        0                                            if length <= max_tokens - buffer
        -penalty * (length - (max_tokens - buffer)) / buffer   in the last `buffer` tokens (-penalty at the budget)
        -penalty                                     beyond the budget

    (verl's `overlong_buffer`: min(-exceed / buffer * penalty_factor, 0), capped at -penalty.)"""
    if buffer <= 0:
        return 0.0
    exceed = length - (max_tokens - buffer)
    return -penalty * min(max(exceed, 0), buffer) / buffer


class RewardFunctionError(UserCodeError):
    """A reward function failed too often (or once, with task.reward_errors=raise)."""


def load_user_reward(spec: str, field: str = "task.reward", kind: str = "function") -> RewardFn:
    """The function named by `spec`: "package.module:function" (imported) or "path/to/file.py:function"
    (the file is executed as a module). Only what the user names is loaded; strings are never evaluated.
    A spec that does not resolve is a ConfigError naming `field`, the file or module, and what it does define
    (`kind`: what the spec names, for that message)."""
    where = f"{field}={spec!r}"
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"{where}: expected 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{where}: file {path.resolve()} does not exist")
        mod_name = "covrl_user_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:   # the user's file fails as it is imported: say where in it
            raise ConfigError(f"{where}: importing {path} failed at {_user_line(err, path)}: "
                              f"{type(err).__name__}: {err}") from err
        source = f"file {path}"
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            missing = getattr(err, "name", None)
            if missing and (target == missing or target.startswith(missing + ".")):
                raise ConfigError(f"{where}: no module named {target!r} (not installed, not on PYTHONPATH; a file "
                                  "is named as path/to/file.py:function)") from err
            raise ConfigError(f"{where}: importing module {target!r} failed: {type(err).__name__}: {err}") from err
        source = f"module {target}"
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        defined = _defined_callables(module)
        close = difflib.get_close_matches(name, defined, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        what = f"defines no {kind}" if fn is None else "has no callable"
        raise ConfigError(f"{where}: {source} {what} {name!r}; it defines: "
                          f"{', '.join(defined) or '(no functions or classes)'}{hint}")
    return fn


def _defined_callables(module) -> list[str]:
    """The public functions and classes a user module defines itself (not the ones it imports)."""
    public = {k: v for k, v in vars(module).items() if not k.startswith("_") and callable(v)}
    own = [k for k, v in public.items() if getattr(v, "__module__", None) == module.__name__]
    return own or list(getattr(module, "__all__", None) or public)   # a package that re-exports its functions


def _user_line(err: BaseException, path: Path) -> str:
    """`file:line` of the innermost frame of `err` in the user's file (a SyntaxError's own line), else the file."""
    if isinstance(err, SyntaxError) and err.lineno:
        return f"{path}:{err.lineno}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return f"{path}:{frames[-1].lineno}" if frames else str(path)


def is_user_reward(spec: str) -> bool:
    """A reward spec names a user function ('module:function', 'file.py:function'); a bare name the registry."""
    return ":" in spec


def resolve_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"reward {name!r} is not registered; allowed: {sorted(REWARDS)} "
                         "(or a user function 'module:function' / 'file.py:function')")
    return REWARDS[name]


def detect_signature(fn: Callable, spec: str) -> str:
    """"trl" for `fn(completions, **columns)` (a parameter named `completions`), "covrl" for
    `fn(completion, example)` (two positional parameters); anything else is an error naming `spec`."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: covrl's by default
        return "covrl"
    if any(p.name == "completions" for p in params):
        return "trl"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params):
        return "covrl"
    raise ValueError(f"reward {spec!r}: cannot tell its signature from {inspect.signature(fn)}; expected covrl's "
                     "fn(completion, example) or TRL's fn(completions, **kwargs) (set task.reward_signature)")


def trl_kwargs(fn: Callable, completions: list[str], examples: list[Example], answer_field: str) -> dict[str, Any]:
    """The keyword arguments of a TRL-style call: prompts, completions and every dataset column as a list;
    only the names `fn` declares when it has no **kwargs."""
    columns: dict[str, list] = {"prompts": [ex.prompt for ex in examples], "completions": list(completions),
                                answer_field: [ex.answer for ex in examples]}
    keys = [k for ex in examples for k in ex.meta if k != "plain_prompt"]
    for key in dict.fromkeys(keys):
        if key not in columns:
            columns[key] = [ex.meta.get(key) for ex in examples]
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return columns
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return columns
    names = {p.name for p in params}
    return {k: v for k, v in columns.items() if k in names}


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
            fn, args, kwargs, box = self.jobs.get()
            try:
                box.value = fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - isolate anything the user function throws
                box.error = err
            box.done.set()


def _plain(value):
    """A picklable copy of a reward result: a float, or a list of floats / None (a batch call)."""
    if isinstance(value, (list, tuple)):
        return [None if v is None else float(v) for v in value]
    return float(value)


def _process_main(spec: str, conn) -> None:
    """Body of a reward worker process: load the user function by its spec, then answer calls."""
    try:
        fn = load_user_reward(spec)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        conn.send(("error", (f"{type(err).__name__}: {err}", traceback.format_exc())))
        return
    conn.send(("ready", None))
    while True:
        try:
            args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", _plain(fn(*args, **kwargs))))
        except BaseException as err:  # noqa: BLE001 - SystemExit etc. become an error reply
            conn.send(("error", (f"{type(err).__name__}: {err}", traceback.format_exc())))


class _RemoteError(RuntimeError):
    """The user function raised inside the worker process (the process itself is fine); `remote_traceback`
    is its traceback as formatted there."""

    def __init__(self, message: str, remote_traceback: str | None = None):
        super().__init__(message)
        self.remote_traceback = remote_traceback


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
            raise RuntimeError(f"reward worker process could not load {spec!r}: {message[0]}\n{message[1]}")

    def call(self, args: tuple, kwargs: dict, timeout_s: float | None):
        self.conn.send((args, kwargs))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"took longer than {timeout_s} s")
        try:
            status, value = self.conn.recv()
        except EOFError as err:
            raise RuntimeError(f"reward worker process died (exit code {self.proc.exitcode})") from err
        if status != "ok":
            raise _RemoteError(*value)
        return value

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardRunner:
    """Calls a reward function on a batch with exception isolation and an optional per-call timeout.

    signature "covrl": one call per completion, fn(completion, example); "trl": one call per batch,
    fn(completions=..., prompts=..., **columns) -> one value per completion (None counts 0).
    on_error "zero": a raising / hanging / non-finite call gets reward 0.0 and counts in `errors`;
             "raise": the first failure raises RewardFunctionError naming the completion index.
    max_consecutive_errors N: with "zero", N batches in a row on which the function failed for every
    completion raise RewardFunctionError with the function's last exception and traceback (None: never)."""

    def __init__(self, fn: RewardFn, *, name: str, timeout_s: float | None, on_error: str, isolate: bool,
                 process_spec: str | None = None, signature: str = "covrl", answer_field: str = "answer",
                 max_consecutive_errors: int | None = None, error_window: int = 64,
                 max_error_rate: float | None = 0.5, report=None):
        if on_error not in ("zero", "raise"):
            raise ValueError(f"task.reward_errors={on_error!r}; allowed: 'zero', 'raise'")
        if signature not in ("covrl", "trl"):
            raise ValueError(f"reward signature {signature!r}; allowed: 'covrl', 'trl'")
        self.fn, self.name, self.on_error = fn, name, on_error
        self.signature, self.answer_field = signature, answer_field
        self.max_consecutive_errors = max_consecutive_errors
        self.consecutive_failed_batches = 0
        # the error rate over the last `error_window` completions; the first failure is shown at once
        self.watch = FailureWatch(f"reward function {name}", unit="completions", window=error_window,
                                  max_rate=max_error_rate, report=report, error=RewardFunctionError,
                                  limits=f"task.max_reward_error_rate={max_error_rate} over "
                                         f"task.reward_error_window={error_window}")
        self.timeout_s = timeout_s if (timeout_s and isolate) else None
        self._worker: _Worker | None = None
        # process isolation: the user function runs in a spawned process loaded from this spec
        self.process_spec = process_spec
        self._process: _ProcessWorker | None = None

    def _call_process(self, args: tuple, kwargs: dict):
        if self._process is None or not self._process.proc.is_alive():
            self._process = _ProcessWorker(self.process_spec)
        try:
            return self._process.call(args, kwargs, self.timeout_s)
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

    def call(self, *args, **kwargs):
        """One isolated call returning the raw value; a failure or timeout raises (tools of
        covrl.tasks.tools run through this)."""
        return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        if self.process_spec is not None:
            return self._call_process(args, kwargs)
        if self.timeout_s is None:
            try:
                return self.fn(*args, **kwargs)
            except (SystemExit, GeneratorExit) as err:  # sys.exit() inside a reward must not end the run
                raise RuntimeError(f"raised {type(err).__name__}({err})") from err
        if self._worker is None:
            self._worker = _Worker()
        box = _Box()
        self._worker.jobs.put((self.fn, args, kwargs, box))
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
        if self.signature == "trl":
            rewards, errors, timeouts, last = self._call_batch(completions, examples)
        else:
            rewards, errors, timeouts, last = self._call_rows(completions, examples)
        self.watch.observe(len(completions), errors)
        if completions and errors == len(completions):
            self.consecutive_failed_batches += 1
            limit = self.max_consecutive_errors
            if limit is not None and self.consecutive_failed_batches >= limit:
                raise RewardFunctionError(
                    f"reward function {self.name} failed on every completion of {self.consecutive_failed_batches} "
                    f"batches in a row (task.max_consecutive_reward_errors={limit}); the run stops instead of "
                    f"training at reward 0. Its last error:\n{format_error(last)}") from last
        else:
            self.consecutive_failed_batches = 0
        return rewards, errors, timeouts

    def _failed(self, err: Exception, where: str, prompt: str) -> None:
        self.watch.failed(err, where, f"prompt {prompt[:80]!r}")   # shown once, at once; later ones counted
        if self.on_error == "raise":
            raise RewardFunctionError(
                f"reward function {self.name} failed on {where} (prompt {prompt[:80]!r}): "
                f"{type(err).__name__}: {err}\n{format_error(err)}") from err

    def _call_rows(self, completions, examples):
        rewards: list[float] = []
        errors = timeouts = 0
        last: Exception | None = None
        for i, (text, ex) in enumerate(zip(completions, examples)):
            try:
                value = float(self._call(text, ex))
                if not math.isfinite(value):
                    raise ValueError(f"returned a non-finite reward {value}")
            except Exception as err:  # noqa: BLE001
                self._failed(err, f"completion {i}", ex.prompt)
                errors += 1
                timeouts += isinstance(err, TimeoutError)
                last, value = err, 0.0
            rewards.append(value)
        return rewards, errors, timeouts, last

    def _call_batch(self, completions, examples):
        """One TRL-style call for the whole batch; a failed call fails every completion, a non-finite value
        fails its own."""
        n = len(completions)
        if n == 0:
            return [], 0, 0, None
        try:
            values = self._call(**trl_kwargs(self.fn, completions, examples, self.answer_field))
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != n:
                size = len(values) if hasattr(values, "__len__") else type(values).__name__
                raise ValueError(f"returned {size} values for {n} completions; a TRL-style reward returns a "
                                 "list with one float (or None) per completion")
            values = list(values)
        except Exception as err:  # noqa: BLE001
            self._failed(err, f"a batch of {n} completions", examples[0].prompt)
            return [0.0] * n, n, n * isinstance(err, TimeoutError), err
        rewards: list[float] = []
        errors = 0
        last: Exception | None = None
        for i, v in enumerate(values):
            try:
                value = 0.0 if v is None else float(v)
                if not math.isfinite(value):
                    raise ValueError(f"returned a non-finite reward {value} for completion {i}")
            except Exception as err:  # noqa: BLE001
                self._failed(err, f"completion {i}", examples[i].prompt)
                errors += 1
                last, value = err, 0.0
            rewards.append(value)
        return rewards, errors, 0, last
