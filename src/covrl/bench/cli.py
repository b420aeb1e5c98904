"""`covrl bench NAME [options]`: dispatches to the benchmark module, which adds its own options."""

from __future__ import annotations

import argparse
import difflib
import importlib

from covrl.bench import BENCHES

# `covrl bench NAME ...`: the rest of the line is the benchmark's own options, parsed by its parser
FORWARDS_ARGUMENTS = True


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="one of: " + ", ".join(BENCHES))
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark (see NAME --help)")


def run(args: argparse.Namespace) -> int:
    from covrl.settings import ConfigError, user_error

    if args.name not in BENCHES:
        close = difflib.get_close_matches(args.name, list(BENCHES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return user_error("covrl bench", f"unknown benchmark {args.name!r}; choose from: {', '.join(BENCHES)}{hint}")
    module = importlib.import_module(BENCHES[args.name])
    sub = argparse.ArgumentParser(prog=f"covrl bench {args.name}")
    module.configure(sub)
    try:
        return int(module.run(sub.parse_args(args.options)) or 0)
    except (ConfigError, FileNotFoundError) as err:   # a bad override or config, a missing file
        return user_error(f"covrl bench {args.name}", err)
