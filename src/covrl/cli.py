"""`covrl` command line. Each sub-command lives in a light module (stdlib-only at import time)
exposing `configure(parser)` and `run(args) -> int`, so `covrl --help` stays fast.

A command's arguments are parsed intermixed: flags and positional `section.key=value` overrides in any order
(`covrl train --config C --name x a=b --no-progress c=d`), as people copy them into torchrun lines. A command
module that forwards the rest of its line to another parser (`covrl bench NAME ...`) sets
`FORWARDS_ARGUMENTS = True` and is parsed in order.

Bad input (a config, a file, a name, an address) is one message and exit code 2; `covrl --debug COMMAND ...` (or
COVRL_DEBUG=1) shows those errors with their traceback instead (covrl.settings.debug). Unexpected errors always
keep their traceback (exit code 1)."""

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
    "diagnose": ("covrl.train.launch.cli_diagnose", "report on the geometry of a run's update"),
    "serve": ("covrl.api.cli_serve", "serve Tinker's REST API locally (for Tinker's SDK and tinker-cookbook)"),
    "selfcheck": ("covrl.selfcheck", "quick check that the install works"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: --version, --help and the list of commands."""
    parser = argparse.ArgumentParser(
        prog="covrl", description="covrl: reinforcement learning for language models, measured from the sampler."
    )
    parser.add_argument("--version", action="version", version=f"covrl {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a bad-input error too (same as COVRL_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def command_parser(name: str):
    """(the command's module or None when it is missing from this build, its parser)."""
    module_name, help_text = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"covrl {name}", description=help_text)
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None, parser
    module.configure(parser)
    return module, parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    while argv and argv[0] == "--debug":   # `covrl --debug COMMAND ...`
        argv.pop(0)
        from covrl.settings.debug import enable_debug  # only here: `covrl --help` imports no pydantic

        enable_debug()
    if not argv or argv[0] not in COMMANDS:
        parser = build_parser()
        args = parser.parse_args(argv)   # --help, --version, or an unknown command: argparse says which
        parser.print_help()
        return 0
    name = argv[0]
    module, parser = command_parser(name)
    if module is None:
        print(f"covrl {name}: not available in this build ({COMMANDS[name][0]} missing)", file=sys.stderr)
        return 2
    if getattr(module, "FORWARDS_ARGUMENTS", False):
        args = parser.parse_args(argv[1:])
    else:
        args = parser.parse_intermixed_args(argv[1:])
    args.command = name
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
