"""`covrl train --config FILE [section.key=value ...] [--resume] [--name NAME]`.

Stdlib-only imports at module top: `covrl --help` lists the commands without importing torch, so the launcher
(covrl.train.launch.modes) is imported when the command runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config (e.g. configs/default.yaml); optional with --resume")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override config fields, e.g. optim.lr=2e-5 sampler.temperature=0.7")
    parser.add_argument("--resume", action="store_true",
                        help="continue runs/<name> from its latest complete checkpoint")
    parser.add_argument("--name", help="run folder name under run.output_dir (default: run.name or config stem); "
                                       "with --resume and no --config also a run folder path")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")


def _print_err(text: str) -> None:
    print(f"covrl train: {text}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from covrl.settings import user_error
    from covrl.train.config import ConfigError, load_config
    from covrl.train.launch.modes import train_from_config

    overrides = list(args.overrides)
    config_path = args.config
    name = args.name
    if config_path is None:
        if not args.resume:
            _print_err("--config FILE is required (e.g. --config configs/default.yaml)")
            return 2
        if not name:
            _print_err("--resume without --config needs --name NAME (the run folder to resume)")
            return 2
        # resume from the run's own resolved config: --name is a run name under runs/ or a run folder path
        folder = Path(name) if (Path(name) / "config.yaml").is_file() else Path("runs") / name
        if not (folder / "config.yaml").is_file():
            _print_err(f"--resume: {folder}/config.yaml not found; pass --config FILE or the run folder as --name")
            return 2
        config_path = str(folder / "config.yaml")
        overrides = [f"run.output_dir={folder.parent}", *overrides]
        name = folder.name
    if name:
        overrides.append(f"run.name={name}")
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as err:
        return user_error("covrl train", err)
    if args.no_progress:
        cfg.logging.progress_bar = False
    return train_from_config(cfg, config_path=config_path, resume=args.resume)
