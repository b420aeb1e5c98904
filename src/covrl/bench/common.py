"""Machine and source description, process measurements and result writing shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import time
from pathlib import Path
from typing import Any


def machine_description() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info


def write_bench(name: str, results: dict[str, Any], table: str, out_dir: Path = Path("benchmarks")) -> Path:
    """Write benchmarks/<name>-<timestamp>.json and <name>.md (latest table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    payload = {"name": name, "machine": machine_description(), "written_at": stamp, "results": results}
    path = out_dir / f"{name}-{stamp}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    (out_dir / f"{name}.md").write_text(f"# bench {name} ({stamp})\n\n{table}\n")
    print(table)
    return path


def source_state() -> dict[str, Any]:
    """The git commit of the covrl source tree and the files of src/ that differ from it (benchmarks run on
    a tree other engineers edit, so a result names the code it measured)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
                                 cwd=here.parent, capture_output=True, text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": []}
    return {"commit": commit, "modified": sorted(line[3:] for line in changed if line.strip())}


def rss_peak_mb() -> float:
    """Peak resident set size of this process in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def load1() -> float:
    return os.getloadavg()[0]
