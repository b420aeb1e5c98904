"""`covrl bench NAME [options]`: dispatches to the benchmark module, which adds its own options."""

from __future__ import annotations

import argparse
import importlib
import sys

from covrl.bench import BENCHES

# `covrl bench NAME ...`: the rest of the line is the benchmark's own options, parsed by its parser
FORWARDS_ARGUMENTS = True


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="one of: " + ", ".join(BENCHES))
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark (see NAME --help)")


def run(args: argparse.Namespace) -> int:
    if args.name not in BENCHES:
        print(f"unknown benchmark {args.name!r}; choose from: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHES[args.name])
    sub = argparse.ArgumentParser(prog=f"covrl bench {args.name}")
    module.configure(sub)
    return int(module.run(sub.parse_args(args.options)) or 0)
