"""What every reproduction writes: `result.json` (claim, measured numbers, pass/fail per criterion),
PNG figures (`pyplot`, `save_figure`), and a short `report.md`. (Arms are driven step by step by
`covrl.experiment.harness`, a client of covrl.api.)"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The sizes configs/default.yaml typed before they became `auto`: the studies registered against that default
# (16 tokens, 4 prompts x 4) load it with these, so that they run as they were designed.
TYPED_DEFAULT_SIZES = {"sampler.max_new_tokens": 16, "loop.group_size": 4, "loop.prompts_per_step": 4}
TYPED_DEFAULT_OVERRIDES = [f"{k}={v}" for k, v in TYPED_DEFAULT_SIZES.items()]


@dataclass
class Criterion:
    """One checkable statement: `measured` compared against `target` (a human-readable rule)."""

    name: str
    measured: Any
    target: str
    passed: bool


@dataclass
class ReproResult:
    name: str
    claim: str
    criteria: list[Criterion] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    notes: str = ""
    seconds: float = 0.0

    def check(self, name: str, measured: Any, target: str, passed: bool) -> bool:
        self.criteria.append(Criterion(name, jsonable(measured), target, bool(passed)))
        return bool(passed)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.criteria)


def start_repro(name: str, claim: str, out_dir: Path) -> ReproResult:
    """The start every reproduction shares: one torch thread (results are bit-identical at a fixed thread
    count, and two threads on a loaded 2-core box are slower), the output folder, an empty result."""
    import torch

    torch.set_num_threads(1)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return ReproResult(name=name, claim=claim)


def jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def write_result(result: ReproResult, out_dir: Path) -> Path:
    """Write result.json and report.md into out_dir; returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = asdict(result)
    payload["passed"] = result.passed
    payload["machine"] = {"python": platform.python_version(), "platform": platform.platform()}
    payload["written_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    path = out_dir / "result.json"
    path.write_text(json.dumps(jsonable(payload), indent=2))
    lines = [f"# {result.name}", "", result.claim, "", "| criterion | measured | target | pass |", "|---|---|---|---|"]
    for c in result.criteria:
        lines.append(f"| {c.name} | {_short(c.measured)} | {c.target} | {'yes' if c.passed else 'NO'} |")
    lines += ["", *(f"![{f}]({f})" for f in result.figures)]
    if result.notes:
        lines += ["", result.notes]
    lines += ["", f"Ran in {result.seconds:.1f} s."]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    return path


def _short(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, list) and len(x) > 6:
        return "[" + ", ".join(_short(v) for v in x[:6]) + ", …]"
    if isinstance(x, list):
        return "[" + ", ".join(_short(v) for v in x) + "]"
    return str(x)


def pyplot():
    """matplotlib.pyplot on the Agg backend (figures are written to files, never shown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, *, dpi: int) -> str:
    """Lay out `fig`, write it to `path` (creating its folder) and close it; returns the file name (what
    `ReproResult.figures` lists)."""
    plt = pyplot()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path.name

