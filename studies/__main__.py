"""`python -m studies NAME|all|list [options]` (from the repository root)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from studies import COMMANDS, STUDIES


def _reproduction_parser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m studies {name}")
    parser.add_argument("--out", type=Path, default=Path("runs/studies"), help="parent folder of the results")
    parser.add_argument("--fast", action="store_true", help="the small variant the test suite runs")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run_one(name: str, out_root: Path, *, fast: bool, seed: int):
    from studies.common import write_result

    module = importlib.import_module(STUDIES[name])
    out_dir = out_root / name
    t0 = time.perf_counter()
    result = module.run(out_dir, fast=fast, seed=seed)
    result.seconds = time.perf_counter() - t0
    write_result(result, out_dir)
    return result


def run_reproductions(names: list[str], out_root: Path, *, fast: bool, seed: int, index: bool) -> int:
    results = []
    for name in names:
        print(f"== study {name}", flush=True)
        res = run_one(name, out_root, fast=fast, seed=seed)
        results.append(res)
        for c in res.criteria:
            print(f"   [{'pass' if c.passed else 'FAIL'}] {c.name}: {c.measured} (target {c.target})", flush=True)
        print(f"   {'PASSED' if res.passed else 'FAILED'} in {res.seconds:.1f} s -> {out_root / name}", flush=True)
    if index:
        _write_index(results, out_root)
    return 0 if all(r.passed for r in results) else 1


def _write_index(results, out_root: Path) -> None:
    lines = ["# covrl reproductions", "", "| result | claim | criteria passed | seconds | figure |", "|---|---|---|---|---|"]
    for r in results:
        n_ok = sum(c.passed for c in r.criteria)
        fig = f"![]({r.name}/{r.figures[0]})" if r.figures else ""
        lines.append(f"| {r.name} | {r.claim} | {n_ok}/{len(r.criteria)} | {r.seconds:.0f} | {fig} |")
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "index.md").write_text("\n".join(lines) + "\n")


def run_command(name: str, argv: list[str]) -> int:
    module = importlib.import_module(COMMANDS[name])
    prog = f"python -m studies {name}"
    if hasattr(module, "configure"):
        parser = argparse.ArgumentParser(prog=prog)
        module.configure(parser)
        return int(module.run(parser.parse_args(argv)) or 0)
    sys.argv = [prog, *argv]   # a script-style study reads its own options
    out = module.main()
    return out if isinstance(out, int) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = [*STUDIES, *COMMANDS]
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("python -m studies NAME [options]   (NAME --help for its options)\n")
        print("reproductions (--fast, --out DIR, --seed N; 'all' runs every one):\n  " + "\n  ".join(STUDIES))
        print("study commands (their own options):\n  " + "\n  ".join(COMMANDS))
        return 0
    name, rest = argv[0], argv[1:]
    if name in COMMANDS:
        return run_command(name, rest)
    if name != "all" and name not in STUDIES:
        print(f"unknown study {name!r}; choose from: {', '.join([*names, 'all'])}", file=sys.stderr)
        return 2
    args = _reproduction_parser(name).parse_args(rest)
    chosen = list(STUDIES) if name == "all" else [name]
    return run_reproductions(chosen, args.out, fast=args.fast, seed=args.seed, index=name == "all")


if __name__ == "__main__":
    sys.exit(main())
