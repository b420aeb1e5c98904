"""Machine and source description, process measurements and result writing shared by the benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import time
from pathlib import Path
from typing import Any


def machine_description() -> dict[str, Any]:
    """The run's provenance (covrl.train.versions: packages, CPU model) plus what a timing depends on."""
    import torch

    from covrl.train import versions  # here: the output options below stay importable without torch

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


# Where results go: one rule for every benchmark. A run writes under RESULTS (git ignores runs/); the committed
# baselines under BASELINES change only when asked (--update-baseline), never as a side effect of measuring.
BASELINES = Path("benchmarks")
RESULTS = Path("runs") / "bench"


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """`--out` and `--update-baseline`, the same for every benchmark (resolved by `output_dir`)."""
    parser.add_argument("--out", type=Path, default=None,
                        help=f"folder for the JSON + table (default: {RESULTS}; with --update-baseline: {BASELINES})")
    parser.add_argument("--update-baseline", action="store_true",
                        help=f"replace this CPU model's committed baseline {BASELINES}/<name>/<cpu>.json and "
                             f"regenerate {BASELINES}/README.md")


def output_dir(args: argparse.Namespace) -> Path:
    """The folder a benchmark writes into: `--out` when given, else the committed baselines with
    `--update-baseline`, else runs/bench."""
    if getattr(args, "out", None) is not None:
        return Path(args.out)
    return BASELINES if getattr(args, "update_baseline", False) else RESULTS


def write_bench(name: str, results: dict[str, Any], table: str, out_dir: Path | None = None, *,
                headline: str) -> Path:
    """Write the result of benchmark `name` on this CPU model, `<out_dir>/<name>/<cpu>.json` (replacing the
    previous one of that folder) with its table `<cpu>.md`, and regenerate `<out_dir>/README.md`, the summary of
    every result there. `out_dir`: runs/bench by default; `benchmarks` (the committed baselines) only when the
    caller asks for it (`output_dir` with --update-baseline). `headline`: the one-line result the summary shows."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS
    machine = machine_description()
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    payload = {"name": name, "machine": machine, "written_at": stamp, "headline": headline, "results": results}
    path = folder / f"{cpu_slug(machine.get('cpu_model'))}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    path.with_suffix(".md").write_text(f"# bench {name}: {machine.get('cpu_model')}, {stamp}\n\n{table}\n")
    baseline = _same_folder(out_dir, BASELINES)
    write_summary(out_dir, baseline=baseline)
    print(table)
    if baseline:
        print(f"baseline updated: {path} (and {out_dir / 'README.md'})")
    else:
        committed = BASELINES / name / path.name
        print(f"results: {path} (table {path.with_suffix('.md')}); the committed baseline {committed} is "
              "unchanged (--update-baseline replaces it)")
    return path


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


SUMMARY_HEADS = {
    True: """# Benchmark baselines

The newest result of each benchmark on each CPU model, as written by `covrl bench NAME --update-baseline` (a
run without it writes under `runs/bench/` and leaves this folder alone): one JSON per (benchmark, CPU),
`benchmarks/<benchmark>/<cpu>.json`, with its table beside it (`<cpu>.md`). `<cpu>` is the JSON's
`machine.cpu_model` with `(R)` and `(TM)` removed, lowercased, and every run of other characters than letters and
digits replaced by `-`. A new baseline replaces the one of its CPU model; git keeps the older ones.
What each benchmark measures, its command and how to read it: [docs/performance.md](../docs/performance.md).
This file is generated (covrl.bench.common.write_summary).
""",
    False: """# Benchmark results

The newest result of each benchmark on each CPU model written into this folder by `covrl bench NAME`: one JSON
per (benchmark, CPU), `<benchmark>/<cpu>.json`, with its table beside it (`<cpu>.md`). The committed baselines
are in `benchmarks/` (`covrl bench NAME --update-baseline` replaces them). This file is generated
(covrl.bench.common.write_summary).
""",
}
SUMMARY_TABLE_HEAD = """
| benchmark | cpu | date | headline | file |
|---|---|---|---|---|
"""


def write_summary(out_dir: Path, *, baseline: bool = True) -> Path:
    """`<out_dir>/README.md`: one row per result JSON (benchmark, CPU model, date, headline, file)."""
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
    target.write_text(SUMMARY_HEADS[baseline] + SUMMARY_TABLE_HEAD + "\n".join(rows) + "\n")
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
