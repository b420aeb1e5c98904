"""How a command reports a user-input error: one line on stderr and exit code 2, or, in debug mode
(`covrl --debug COMMAND ...` or the environment variable COVRL_DEBUG=1), the exception with its traceback.

Debug mode is an environment variable, not a flag passed around, so that every process of a run sees it:
torchrun's ranks, Ray's actors, spawned worker processes. Stdlib only: the `covrl` entry point imports it."""

from __future__ import annotations

import os
import sys

__all__ = ["DEBUG_ENV", "debug_enabled", "enable_debug", "user_error"]

DEBUG_ENV = "COVRL_DEBUG"


def debug_enabled() -> bool:
    """Whether user-input errors show their traceback (COVRL_DEBUG set to anything but '', 0, false, no, off)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def enable_debug() -> None:
    """Turn debug mode on for this process and the processes it starts."""
    os.environ[DEBUG_ENV] = "1"


def user_error(prog: str, err: BaseException | str) -> int:
    """Report a user-input error as `prog: message` on stderr and return exit code 2. In debug mode an exception
    is re-raised instead, with its traceback (call this inside the `except` block that caught it)."""
    if isinstance(err, BaseException) and debug_enabled():
        raise err
    print(f"{prog}: {err}", file=sys.stderr, flush=True)
    return 2
