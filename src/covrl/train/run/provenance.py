"""What produced a result: package versions and the CPU (its kernels decide float rounding, so the same seed and
thread count differ across CPU models), and the git state of the source tree covrl is imported from. Run
summaries and benchmark results both record it."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

__all__ = ["git_state", "versions"]


def versions() -> dict[str, str]:
    import importlib.metadata as md

    from covrl.models.precision import cpu_bf16_support, cpu_model

    out = {"python": platform.python_version(), "platform": platform.platform(), "cpu_model": cpu_model(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "cpu_bf16": ",".join(k for k, v in cpu_bf16_support().items() if v) or "none"}
    for pkg in ("covrl", "torch", "transformers", "peft", "pydantic", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def git_state() -> dict[str, Any]:
    """The commit of the source tree covrl is imported from and the tracked files of the package that differ
    from it (results are often produced on a tree being edited): {"commit", "dirty", "modified"}; commit None
    outside a git checkout."""
    here = Path(__file__).resolve().parents[2]   # the covrl package
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=here,
                                 capture_output=True, text=True, timeout=10).stdout.split("\n") if commit else []
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "modified": []}
    modified = sorted(line[3:] for line in changed if line.strip())
    return {"commit": commit, "dirty": bool(modified) if commit else None, "modified": modified}
