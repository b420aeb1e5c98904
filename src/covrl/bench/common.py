"""Machine description and result writing shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
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
