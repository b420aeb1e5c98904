"""A run that makes no progress says so: the loop driver marks each phase of a step (`beat`), and a daemon thread
prints, when one phase has lasted `run.stall_warning_s`, what the run is waiting for — the phase, the step, what
the rollout source reports (`waiting_for`: the queue, the workers) and where the loop's thread is in the code —
and again every further period while it lasts. It never stops the run: a slow step and a hung one look the same
from outside, and the user decides."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable

__all__ = ["ProgressWatchdog"]


class ProgressWatchdog:
    """`beat(phase)` from the loop's thread; `stop()` at the end. `describe()` adds the source's view."""

    def __init__(self, period_s: float, report: Callable[[str], None], describe: Callable[[], str] | None = None):
        self.period_s = float(period_s)
        self.report = report
        self.describe = describe
        self.phase, self.step, self.ask_source = "starting", 0, False
        self.since = time.monotonic()
        self.reports = 0
        self._owner = threading.get_ident()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if self.period_s > 0:
            self._thread = threading.Thread(target=self._watch, name="covrl-watchdog", daemon=True)
            self._thread.start()

    def beat(self, phase: str, step: int | None = None, *, ask_source: bool = False) -> None:
        """A new phase starts now; `ask_source`: a stall in it is the rollout source's to explain."""
        self.phase, self.ask_source, self.since = phase, ask_source, time.monotonic()
        if step is not None:
            self.step = step

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        reported_for = None
        while not self._done.wait(min(self.period_s / 4, 5.0)):
            since, phase, ask = self.since, self.phase, self.ask_source
            waited = time.monotonic() - since
            nth = int(waited // self.period_s)
            if nth >= 1 and reported_for != (since, nth):
                reported_for = (since, nth)
                self.reports += 1
                self.report(self._message(phase, waited, ask))

    def _message(self, phase: str, waited: float, ask_source: bool) -> str:
        text = f"no progress for {waited:.0f} s" if waited >= 10 else f"no progress for {waited:.1f} s"
        text += f": {phase} (step {self.step + 1})"
        if ask_source and self.describe is not None:
            try:
                extra = self.describe()
            except Exception as err:  # noqa: BLE001 - a report must not fail the run
                extra = f"(the source could not say: {err!r})"
            if extra:
                text += f"; {extra}"
        where = _where(self._owner)
        return text + (f"; the loop is in {where}" if where else "")


def _where(thread_id: int) -> str:
    """The innermost frames of covrl code on `thread_id`'s stack (file:line function), outermost first."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame)
    ours = [f for f in frames if "covrl" in f.filename.replace("\\", "/").split("/site-packages/")[-1]]
    chosen = (ours or frames)[-2:]
    return " < ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(chosen))


def _short(path: str) -> str:
    path = path.replace("\\", "/")
    return path[path.rfind("covrl/"):] if "covrl/" in path else path.rsplit("/", 1)[-1]
