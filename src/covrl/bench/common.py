"""Machine and source description, process measurements and result writing shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import time
from pathlib import Path
from typing import Any

from covrl.train import versions


def machine_description() -> dict[str, Any]:
    """The run's provenance (covrl.train.versions: packages, CPU model) plus what a timing depends on."""
    import torch

    info: dict[str, Any] = {**versions(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads()}
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info


def cpu_slug(cpu_model: str | None) -> str:
    """The file name of a CPU model's baseline: `(R)`/`(TM)` dropped, lowercased, other characters as `-`
    ("Intel(R) Xeon(R) Processor" -> "intel-xeon-processor")."""
    text = re.sub(r"\((R|TM)\)", "", cpu_model or "unknown-cpu", flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "unknown-cpu"


def write_bench(name: str, results: dict[str, Any], table: str, out_dir: Path = Path("benchmarks"), *,
                headline: str) -> Path:
    """Write the baseline of benchmark `name` on this CPU model, `<out_dir>/<name>/<cpu>.json` (replacing the
    previous one: git keeps the history) with its table `<cpu>.md`, and regenerate `<out_dir>/README.md`, the
    summary of every baseline. `headline`: the one-line result the summary shows."""
    machine = machine_description()
    folder = Path(out_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    payload = {"name": name, "machine": machine, "written_at": stamp, "headline": headline, "results": results}
    path = folder / f"{cpu_slug(machine.get('cpu_model'))}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    path.with_suffix(".md").write_text(f"# bench {name}: {machine.get('cpu_model')}, {stamp}\n\n{table}\n")
    write_summary(Path(out_dir))
    print(table)
    print(f"baseline: {path}")
    return path


SUMMARY_HEAD = """# Benchmark baselines

The newest result of each benchmark on each CPU model, as written by `covrl bench NAME`: one JSON per
(benchmark, CPU), `benchmarks/<benchmark>/<cpu>.json`, with its table beside it (`<cpu>.md`). `<cpu>` is the
JSON's `machine.cpu_model` with `(R)` and `(TM)` removed, lowercased, and every run of other characters than
letters and digits replaced by `-`. A new run replaces the baseline of its CPU model; git keeps the older ones.
What each benchmark measures, its command and how to read it: [docs/performance.md](../docs/performance.md).
This file is generated (covrl.bench.common.write_summary).

| benchmark | cpu | date | headline | file |
|---|---|---|---|---|
"""


def write_summary(out_dir: Path) -> Path:
    """`<out_dir>/README.md`: one row per baseline JSON (benchmark, CPU model, date, headline, file)."""
    rows = []
    for path in sorted(Path(out_dir).glob("*/*.json")):
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rel = path.relative_to(out_dir).as_posix()
        rows.append(f"| {payload.get('name', path.parent.name)} | {payload.get('machine', {}).get('cpu_model')} | "
                    f"{str(payload.get('written_at', ''))[:10]} | {payload.get('headline', '')} | [{rel}]({rel}) |")
    target = Path(out_dir) / "README.md"
    target.write_text(SUMMARY_HEAD + "\n".join(rows) + "\n")
    return target


def rss_peak_mb() -> float:
    """Peak resident set size of this process in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def load1() -> float:
    return os.getloadavg()[0]


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: best of `repeats` copies of a `megabytes` fp32 tensor, counting the read
    and the write (STREAM 'copy' convention)."""
    import torch

    src = torch.randn(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t0))
    return best


def measure_matmul_flops(size: int = 1024, repeats: int = 5, dtype: str = "float32") -> float:
    """Dense matmul throughput in FLOP/s (best of `repeats`): 2 * size^3 per product."""
    import torch

    a = torch.randn(size, size, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, dtype=getattr(torch, dtype))
    a @ b
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - t0))
    return best


def count_flops(fn) -> float:
    """FLOPs of one call of `fn()` (forward and backward alike), as torch's FlopCounterMode counts them:
    matmuls, convolutions and attention kernels; element-wise work is not counted."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())
