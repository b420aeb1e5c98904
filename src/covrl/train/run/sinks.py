"""Metric sinks: where the per-step metrics go (metrics.jsonl, console progress, TensorBoard, wandb).

A sink has `write(record: dict)` (one step: floats plus a few strings such as `skip_reason`), `message(text)`
and `close()`. Loops only talk to a list of sinks, so sync and async loops share them unchanged."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from covrl._lazy import require


class MetricSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def message(self, text: str) -> None: ...

    def close(self) -> None: ...


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlSink:
    """Appends one JSON object per step to `metrics.jsonl` (non-finite floats written as strings)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._f.flush()

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_jsonl(path: Path, keep: int) -> None:
    """Keep the first `keep` records (resume: steps after the checkpoint are re-run and re-logged)."""
    path = Path(path)
    # raw lines, not parsed records: a torn last line (disk full, power loss) after the checkpoint's lines
    # used to make the resume fail with a bare JSONDecodeError
    lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
    if len(lines) > keep or (lines and not lines[-1].endswith("\n")):
        path.write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines[:keep]))


# key metric -> (label, format) shown on the console
CONSOLE_KEYS = {
    "reward/mean": ("reward", "{:.3f}"),
    "accuracy": ("acc", "{:.2f}"),
    "response/length_mean": ("len", "{:.1f}"),
    "entropy": ("ent", "{:.3f}"),
    "grad_norm": ("gnorm", "{:.2f}"),
    "mismatch/k3": ("k3", "{:.1e}"),
    "lr": ("lr", "{:.1e}"),
    "time/step": ("s/step", "{:.1f}"),
}


# the subset shown in the live progress bar (it shares one terminal line with the bar)
LIVE_KEYS = ("reward/mean", "accuracy", "response/length_mean", "grad_norm", "time/step")


def format_console(record: dict[str, Any], keys=None) -> str:
    parts = []
    for key, (label, fmt) in CONSOLE_KEYS.items():
        if keys is not None and key not in keys:
            continue
        v = record.get(key)
        if isinstance(v, (int, float)):
            parts.append(f"{label} {fmt.format(v)}")
    errors, rows = record.get("task/errors"), record.get("batch_rows")
    if errors and rows:   # a user reward failing: the progress line says how often
        parts.append(f"reward errors {errors / rows:.0%}")
    if record.get("response/at_max_frac", 0.0) >= 0.25:   # answers cut by the token budget
        parts.append(f"cut {record['response/at_max_frac']:.0%}")
    if record.get("skipped"):
        parts.append(f"SKIPPED: {record.get('skip_reason', '')}")
    return "  ".join(parts)


class ConsoleSink:
    """A rich progress bar with the key metrics on a terminal; plain lines otherwise (a pipe, a file, CI, a
    notebook, or `live=False`): the first step, the last, and between them at most one line per `every_s` seconds
    (the step that crosses the period; 0: every step). A step not printed when the run ends (stopped early) is
    printed at `close`, so the last line always shows where the run stopped. Messages are printed at once."""

    def __init__(self, total_steps: int, *, start_step: int = 0, stream=None, live: bool = True,
                 every_s: float = 10.0, clock=time.monotonic):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.live = live and bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = float(every_s)
        self._clock = clock
        self._last_print: float | None = None   # when the last step line was printed (None: none yet)
        self._pending: dict[str, Any] | None = None   # the newest step not printed
        self._progress = None
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(bar_width=16), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                                      console=Console(file=self.stream), transient=False)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=format_console(record, LIVE_KEYS))
            return
        now = self._clock()
        due = (self._last_print is None or step >= self.total or self.every_s <= 0
               or now - self._last_print >= self.every_s)
        if not due:
            self._pending = record
            return
        self._pending = None
        self._last_print = now
        self._print_step(record)

    def _print_step(self, record: dict[str, Any]) -> None:
        print(f"step {int(record.get('step', 0))}/{self.total}  {format_console(record)}", file=self.stream,
              flush=True)

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            self._flush_pending()   # a message (an evaluation, a warning) follows the step it is about
            print(text, file=self.stream, flush=True)

    def _flush_pending(self) -> None:
        if self._pending is not None:
            self._print_step(self._pending)
            self._pending = None
            self._last_print = self._clock()

    def close(self) -> None:
        self._flush_pending()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        tb = require("torch.utils.tensorboard", "tensorboard")
        self._w = tb.SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("rollouts", record.get("step", 0)))
        for k, v in record.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self._w.add_scalar(k, v, global_step=step)

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        self._w.close()


class WandbSink:
    def __init__(self, project: str, name: str, config: dict[str, Any], run_dir: Path):
        wandb = require("wandb", "wandb")
        self._run = wandb.init(project=project, name=name, config=config, dir=str(run_dir))

    def write(self, record: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                      step=int(record.get("step", 0)))

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        self._run.finish()
