"""What the engines covrl drives print on their own: their log levels and their progress bars, one rule for every
process of a run (`logging.engine_logs`; docs/engines.md, "Engine logs").

vLLM, Ray, transformers, huggingface_hub, datasets and torch.distributed log through Python's `logging`, and
several read a variable once, when they are imported (VLLM_LOGGING_LEVEL, TRANSFORMERS_VERBOSITY, ...). Their
default INFO/WARNING chatter is mostly harmless to a run (vLLM warns with a traceback that its chat-template
warm-up failed, because covrl starts the engine without a tokenizer, and at every weight push that
RotaryEmbedding has no weights to load), so the default setting shows their errors only:

    setting   their loggers   covrl's own lines
    quiet     ERROR           unchanged (progress, warnings, errors)   (default)
    info      INFO
    debug     DEBUG

`apply_engine_logs(setting)` sets the levels of the loggers already there and the variables, so that a module
imported later and every child process (vLLM's engine process, sampler processes, Ray's workers started by
this process) starts with the same levels. Ray's actors on a cluster get the variables through their runtime
environment (`engine_log_env`).

Progress bars (tqdm: the GGUF conversion of SmolLM2, hub and dataset downloads) are drawn only when stdout is
a terminal; in a log file, a pipe or a notebook's captured output they would be one endless line.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partialmethod
from typing import Any, Literal

__all__ = ["ENGINE_LOGGERS", "ENGINE_LOGS", "EngineLogs", "apply_engine_logs", "engine_log_env", "engine_log_level",
           "engine_warnings", "progress_bars_for_stdout", "progress_bars_enabled", "set_progress_bars", "stdout_is_terminal"]

EngineLogs = Literal["quiet", "info", "debug"]
ENGINE_LOGS: tuple[str, ...] = ("quiet", "info", "debug")

_LEVELS = {"quiet": logging.ERROR, "info": logging.INFO, "debug": logging.DEBUG}

# the loggers of the engines covrl starts or imports (each library logs under its package name)
ENGINE_LOGGERS: tuple[str, ...] = ("vllm", "ray", "transformers", "huggingface_hub", "datasets", "torch.distributed",
                                   "httpx", "uvicorn")

# output for a terminal only, off (these values) elsewhere: progress bars (tqdm reads TQDM_* when it is imported,
# the hub and datasets theirs; no "0" for on: tqdm reads TQDM_DISABLE=0 as bool("0"), True) and the colour codes
# of Ray's "(Actor pid=...)" prefixes
_BAR_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
            "RAY_COLOR_PREFIX": "0"}

_state: dict[str, Any] = {"setting": None, "tqdm_init": None, "bar_env": [], "bars_off": False}


def engine_log_level(setting: str) -> int:
    """The `logging` level of the engines' loggers for `setting` (quiet: ERROR, info: INFO, debug: DEBUG)."""
    try:
        return _LEVELS[setting]
    except KeyError:
        raise ValueError(f"logging.engine_logs must be one of {', '.join(ENGINE_LOGS)}; got {setting!r}") from None


def stdout_is_terminal() -> bool:
    isatty = getattr(sys.stdout, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:   # a closed stream
        return False


def engine_log_env(setting: str, *, bars: bool | None = None) -> dict[str, str]:
    """The variables that give a process started later `setting`'s levels (and, unless `bars`, no progress bars
    and no colour codes; None: those only when this process's stdout is a terminal)."""
    level = logging.getLevelName(engine_log_level(setting))
    env = {
        "VLLM_LOGGING_LEVEL": level,
        "TRANSFORMERS_VERBOSITY": level.lower(),
        "HF_HUB_VERBOSITY": level.lower(),
        "DATASETS_VERBOSITY": level.lower(),
        # torch's C++ side (c10d's process-group warnings) reads this when torch is imported
        "TORCH_CPP_LOG_LEVEL": "ERROR" if setting == "quiet" else ("INFO" if setting == "debug" else "WARNING"),
    }
    if setting == "debug":
        env["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
    if not (stdout_is_terminal() if bars is None else bars):
        env.update(_BAR_ENV)
    return env


def apply_engine_logs(setting: str = "quiet", *, bars: bool | None = None) -> dict[str, str]:
    """Give this process (and the processes it starts from now on) the engines' log levels of `setting` and
    turn progress bars off unless `bars` (None: on only when stdout is a terminal). Returns the variables set.
    Idempotent; called by every entry point that builds a run (with `run.num_threads`: threads.apply_num_threads)."""
    level = engine_log_level(setting)
    env = engine_log_env(setting, bars=bars)
    os.environ.update({k: v for k, v in env.items() if k not in _BAR_ENV})   # (the bars' own: set_progress_bars)
    for name in ENGINE_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in logger.handlers:   # the library's own handler (vLLM gives it the level read at import)
            handler.setLevel(level)
    # libraries that keep their own verbosity switch beside the logger (set again when they configure)
    hf = sys.modules.get("transformers.utils.logging")
    if hf is not None:
        hf.set_verbosity(level)
    hub = sys.modules.get("huggingface_hub.utils.logging")
    if hub is not None:
        hub.set_verbosity(level)
    set_progress_bars("TQDM_DISABLE" not in env)
    _state["setting"] = setting
    return env


def set_progress_bars(enabled: bool) -> None:
    """Progress bars on or off in this process and the processes it starts: the hub's, transformers' and
    datasets' switches, tqdm's default (`disable=True` unless a caller passes `disable` itself: what
    TQDM_DISABLE=1 does when it is set before tqdm is imported) and the variables children read."""
    if enabled:   # only what this module turned off is turned on again (a user's own TQDM_DISABLE=1 stays)
        for k in _state["bar_env"]:
            if os.environ.get(k) == _BAR_ENV[k]:
                del os.environ[k]
        _state["bar_env"] = []
    else:
        _state["bar_env"] = [k for k in _BAR_ENV if k not in os.environ or k in _state["bar_env"]]
        os.environ.update(_BAR_ENV)
    for module, on, off in (("huggingface_hub.utils", "enable_progress_bars", "disable_progress_bars"),
                            ("transformers.utils.logging", "enable_progress_bar", "disable_progress_bar"),
                            ("datasets.utils.logging", "enable_progress_bar", "disable_progress_bar")):
        mod = sys.modules.get(module)
        switch = getattr(mod, on if enabled else off, None) if mod is not None else None
        if switch is not None and (not enabled or _state["bars_off"]):
            with warnings.catch_warnings():   # the hub's: a variable read at its import keeps priority
                warnings.simplefilter("ignore")
                switch()
    _state["bars_off"] = not enabled
    std = sys.modules.get("tqdm.std")
    if std is None:   # not imported yet: it reads TQDM_DISABLE when it is
        return
    cls = std.tqdm
    if _state["tqdm_init"] is None:
        _state["tqdm_init"] = cls.__dict__["__init__"]   # tqdm's own (a partialmethod of its TQDM_* variables)
    original = _state["tqdm_init"]
    cls.__init__ = original if enabled else partialmethod(original, disable=True)


def progress_bars_enabled() -> bool:
    """Whether a tqdm bar made now in this process would draw (where its caller leaves `disable` alone)."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        return "TQDM_DISABLE" not in os.environ
    init = std.tqdm.__dict__["__init__"]
    return not (isinstance(init, partialmethod) and init.keywords.get("disable"))


@contextmanager
def engine_warnings(engine: str) -> Iterator[None]:
    """Around an engine's import or start: its deprecation warnings (FutureWarning, DeprecationWarning; vLLM's
    CPU build warns about torch names it uses) are hidden when the engine's logger shows errors only."""
    if logging.getLogger(engine).getEffectiveLevel() <= logging.WARNING:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


@contextmanager
def progress_bars_for_stdout() -> Iterator[None]:
    """Around a load that draws progress bars (a GGUF conversion, loading a checkpoint's shards) outside a run:
    no bars while stdout is not a terminal, then this process's rule as it was."""
    if stdout_is_terminal() or not progress_bars_enabled():
        yield
        return
    saved = dict(_state)
    set_progress_bars(False)
    try:
        yield
    finally:
        set_progress_bars(True)
        _state.update(saved)
