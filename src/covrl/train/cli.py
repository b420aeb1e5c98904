"""`covrl train --config FILE [section.key=value ...] [--resume] [--name NAME]`.

Stdlib-only imports at module top (the CLI lists commands without importing torch)."""

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
    from covrl.config import ConfigError, load_config

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
        _print_err(str(err))
        return 2
    if args.no_progress:
        cfg.logging.progress_bar = False
    return train_from_config(cfg, config_path=config_path, resume=args.resume)


def train_from_config(cfg, *, config_path=None, resume: bool = False) -> int:
    """Prepare the run, train, print where results went. Exit codes: 0 ok, 2 bad input, 3 diverged,
    4 checkpoint write failed (e.g. disk full), 5 a sampler worker died, 130 interrupted."""
    from covrl.models import ModelNotFoundError
    from covrl.tasks import PromptTooLongError, RewardFunctionError
    from covrl.train.checkpoint import CheckpointError
    from covrl.train.trainer import TrainingDivergedError

    if cfg.loop.mode == "ray":   # the trainer side may run in a Ray actor: the backend drives the whole run
        from covrl.train.ray_backend import train_from_config_ray

        return train_from_config_ray(cfg, config_path=config_path, resume=resume)
    from covrl.train.async_loop import SamplerWorkerError, loop_functions

    prepare_fn, train_fn = loop_functions(cfg.loop.mode)   # sync: prepare_run + train_sync
    try:
        run_state = prepare_fn(cfg, config_path=config_path, resume=resume)
    except (ModelNotFoundError, FileNotFoundError, ValueError, CheckpointError) as err:
        _print_err(str(err))
        return 2
    print(f"run folder: {run_state.run_dir}" + (f" (resumed from {run_state.resumed_from})"
                                                 if run_state.resumed_from else ""))
    try:
        summary = train_fn(run_state)
    except TrainingDivergedError as err:
        _print_err(str(err))
        return 3
    except (PromptTooLongError, RewardFunctionError, CheckpointError) as err:  # met mid-run: no traceback
        _print_err(f"{err}\nstopped; fix the cause, then: covrl train --resume --name {run_state.run_dir.name}")
        return 4 if isinstance(err, CheckpointError) else 2
    except SamplerWorkerError as err:   # past the worker restart budget: stop cleanly, checkpoints stay usable
        _print_err(f"{err}\nstopped; resume with: covrl train --resume --name {run_state.run_dir.name}")
        return 5
    except KeyboardInterrupt:
        _print_err(f"interrupted; resume with: covrl train --resume --name {run_state.run_dir.name}")
        return 130
    finally:
        run_state.close()
    _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    print(f"done: {summary['steps']} steps, {summary['rollouts']} rollouts, {summary['wall_time_s']:.0f} s "
          f"wall ({summary['status']})")
    for label in ("eval_before", "eval_after"):
        e = summary.get(label)
        if e:
            st = e["settings"]
            accs = ", ".join(f"{m} {e[m]:.1%}" for m in ("greedy", "sampled") if m in e)
            print(f"  held-out accuracy {label.split('_')[1]:>6}: {accs}  ({st['n_prompts']} prompts, "
                  f"max_new_tokens {st['max_new_tokens']}, sampled at T={st['temperature']})")
    print(f"  results: {summary['run_dir']}/summary.json, metrics.jsonl, eval.json, curves.png")
