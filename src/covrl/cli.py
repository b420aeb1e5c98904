"""`covrl` command line. Each sub-command lives in a light module (stdlib-only at import time)
exposing `configure(parser)` and `run(args) -> int`, so `covrl --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

from covrl import __version__

# name -> (module, one line of help). Modules import torch etc. only inside run().
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("covrl.train.launch.cli", "RL-train a language model from a YAML config (+ key=value overrides)"),
    "eval": ("covrl.train.launch.cli_eval", "evaluate a run or checkpoint on a task's held-out prompts"),
    "bandit": ("covrl.explore.cli", "run Ensemble++ and baselines on bandit environments"),
    "bench": ("covrl.bench.cli", "benchmarks against peers and the machine's limits"),
    "diagnose": ("covrl.diagnostics.cli", "report on the geometry of a run's updates"),
    "selfcheck": ("covrl.selfcheck", "quick check that the install works"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="covrl", description="covrl: reinforcement learning for language models, measured from the sampler."
    )
    parser.add_argument("--version", action="version", version=f"covrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            sp.set_defaults(_module=None, _module_name=module_name)
            continue
        module.configure(sp)
        sp.set_defaults(_module=module, _module_name=module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args._module is None:
        print(f"covrl {args.command}: not available in this build ({args._module_name} missing)", file=sys.stderr)
        return 2
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
