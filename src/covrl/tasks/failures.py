"""User code that fails (reward functions, environments, tools): the first failure is shown at once with its
traceback, later ones are counted, and the run stops when the failures pass a rate over a window of calls —
a function failing on most calls stops within a few steps, one failing on a rare malformed row does not.

One rule for every kind of user code: `FailureWatch`. Tools are the exception by design: a tool's exception
is usually the model's doing (bad arguments) and is the model's observation, so a tool's first failure is shown
but never stops the run."""

from __future__ import annotations

import sys
import traceback
from collections import deque
from collections.abc import Callable

__all__ = ["FailureWatch", "UserCodeError", "format_error", "hint_for"]


class UserCodeError(RuntimeError):
    """User code failed often enough that the run stops (exit code 2: a bad input, not a crash of covrl)."""


def format_error(err: BaseException) -> str:
    """The exception with its traceback (the user function's frames), or the message of a timeout / a remote
    error that carries its traceback as text."""
    remote = getattr(err, "remote_traceback", None)
    if remote:
        return remote.rstrip()
    if isinstance(err, TimeoutError) or err.__traceback__ is None:
        return f"{type(err).__name__}: {err}"
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip()


def hint_for(err: BaseException) -> str:
    """The likely cause of an error on covrl's Example (code written for another library's rows)."""
    text = str(err)
    if "Example" in text and ("subscriptable" in text or "attribute" in text):
        return (" -- the example is covrl's Example: example.answer, example.prompt, example['field'] for the "
                "data row's other fields")
    if isinstance(err, KeyError) and "covrl's Example" in text:
        return " -- a field the data rows do not have"
    return ""


def print_warning(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


class FailureWatch:
    """The failures of one piece of user code. `what`: how messages name it ("reward function f", "environment
    E"); `unit`: what one call is ("completions", "environment steps"); `limits`: the settings behind the rule,
    named in the stop message. `max_rate` None: never stop (counted and the first failure shown only)."""

    def __init__(self, what: str, *, unit: str, window: int = 64, max_rate: float | None = 0.5,
                 limits: str = "", report: Callable[[str], None] | None = None,
                 error: type[Exception] = UserCodeError):
        self.what, self.unit, self.limits = what, unit, limits
        self.max_rate = max_rate
        self.recent: deque[bool] = deque(maxlen=window)
        self.first_error: str | None = None
        self.failures = 0
        self.report = report if report is not None else print_warning
        self.error = error

    def failed(self, err: BaseException, where: str, context: str = "") -> None:
        """Count one failure; the first is reported at once, with its traceback."""
        self.failures += 1
        if self.first_error is None:
            on = f" ({context})" if context else ""
            self.first_error = (f"{self.what} failed on {where}{on}: {type(err).__name__}: {err}{hint_for(err)}\n"
                                f"{format_error(err)}")
            rule = (f"; the run stops when more than {self.max_rate:.0%} of {self.recent.maxlen} {self.unit} in a "
                    "row fail" if self.max_rate is not None else "")
            self.report(f"{self.first_error}\n(the first failure: later ones are counted{rule})")

    def observe(self, calls: int, failures: int) -> None:
        """`calls` done, `failures` of them failed (already `failed`): stop when the rate over the window of
        the last calls passes max_rate."""
        self.recent.extend([True] * failures + [False] * (calls - failures))
        if self.max_rate is None or len(self.recent) < self.recent.maxlen:
            return
        rate = sum(self.recent) / len(self.recent)
        if rate > self.max_rate:
            limits = f" ({self.limits})" if self.limits else ""
            raise self.error(f"{self.what} failed on {rate:.0%} of its last {len(self.recent)} {self.unit}{limits}; "
                             f"the run stops instead of training on zeros. Its first error:\n{self.first_error}")
