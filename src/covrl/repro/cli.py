"""`covrl repro NAME|all [--fast] [--out DIR] [--seed N]`."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from covrl.repro import REPROS


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="one of: " + ", ".join([*REPROS, "all"]))
    parser.add_argument("--out", type=Path, default=Path("runs/repro"), help="parent folder of the results")
    parser.add_argument("--fast", action="store_true", help="the small variant used by the test suite")
    parser.add_argument("--seed", type=int, default=0)


def run_one(name: str, out_root: Path, *, fast: bool, seed: int):
    from covrl.repro.common import write_result

    module = importlib.import_module(REPROS[name])
    out_dir = out_root / name
    t0 = time.perf_counter()
    result = module.run(out_dir, fast=fast, seed=seed)
    result.seconds = time.perf_counter() - t0
    write_result(result, out_dir)
    return result


def run(args: argparse.Namespace) -> int:
    names = list(REPROS) if args.name == "all" else [args.name]
    unknown = [n for n in names if n not in REPROS]
    if unknown:
        print(f"unknown reproduction {unknown[0]!r}; choose from: {', '.join([*REPROS, 'all'])}", file=sys.stderr)
        return 2
    results = []
    for name in names:
        print(f"== repro {name}", flush=True)
        try:
            res = run_one(name, args.out, fast=args.fast, seed=args.seed)
        except ModuleNotFoundError as err:
            print(f"   not available: {err}", flush=True)
            continue
        results.append(res)
        for c in res.criteria:
            print(f"   [{'pass' if c.passed else 'FAIL'}] {c.name}: {c.measured} (target {c.target})", flush=True)
        print(f"   {'PASSED' if res.passed else 'FAILED'} in {res.seconds:.1f} s -> {args.out / name}", flush=True)
    if args.name == "all":
        _write_index(results, args.out)
    return 0 if all(r.passed for r in results) else 1


def _write_index(results, out_root: Path) -> None:
    lines = ["# covrl reproductions", "", "| result | claim | criteria passed | seconds | figure |", "|---|---|---|---|---|"]
    for r in results:
        n_ok = sum(c.passed for c in r.criteria)
        fig = f"![]({r.name}/{r.figures[0]})" if r.figures else ""
        lines.append(f"| {r.name} | {r.claim} | {n_ok}/{len(r.criteria)} | {r.seconds:.0f} | {fig} |")
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "index.md").write_text("\n".join(lines) + "\n")
