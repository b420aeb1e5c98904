"""`covrl eval --run DIR | --checkpoint DIR [--config FILE] [--task NAME] [section.key=value ...]`.

Loads the weights of a run's latest complete checkpoint (or of one checkpoint / a transformers folder) and
reports held-out accuracy (greedy and sampled) on the task's eval prompts. Stdlib-only imports at the top."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run folder (runs/<name>): its config and latest complete checkpoint")
    src.add_argument("--checkpoint", help="a checkpoint folder (ckpt-*/ or initial/) or a transformers model folder")
    parser.add_argument("--config", help="YAML config (default: the run's config.yaml)")
    parser.add_argument("--task", help="task registry name to evaluate on (default: the run's task)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override config fields, e.g. task.n_eval=100 sampler.temperature=0.7")
    parser.add_argument("--no-sampled", action="store_true", help="greedy decoding only")
    parser.add_argument("--out", help="write the results as JSON to this file")


def _err(text: str) -> int:
    print(f"covrl eval: {text}", file=sys.stderr)
    return 2


def _locate(args) -> tuple[Path | None, Path | None, bool]:
    """(config path, weights folder, weights are a plain transformers folder)."""
    if args.run:
        run_dir = Path(args.run)
        if not run_dir.is_dir():
            raise FileNotFoundError(f"--run {run_dir}: no such folder")
        from covrl.train.run.checkpoint import MODEL_DIR, final_weights, latest_checkpoint

        latest = latest_checkpoint(run_dir) or final_weights(run_dir)   # final: checkpoint.final=weights
        if latest is None:
            raise FileNotFoundError(f"--run {run_dir}: no complete checkpoint under {run_dir}/checkpoints")
        return (Path(args.config) if args.config else run_dir / "config.yaml"), latest / MODEL_DIR, False
    ckpt = Path(args.checkpoint)
    if (ckpt / "model").is_dir():
        config = Path(args.config) if args.config else ckpt.parent.parent / "config.yaml"
        return config, ckpt / "model", False
    if (ckpt / "config.json").is_file():
        return (Path(args.config) if args.config else None), ckpt, True
    raise FileNotFoundError(f"--checkpoint {ckpt}: neither a covrl checkpoint (model/ inside) nor a "
                            f"transformers folder (config.json inside)")


def run(args: argparse.Namespace) -> int:
    from covrl.settings import user_error
    from covrl.train.config import ConfigError, load_config

    try:
        config_path, weights, plain_hf = _locate(args)
    except FileNotFoundError as err:
        return user_error("covrl eval", err)
    overrides = list(args.overrides)
    if args.task:
        overrides.append(f"task.name={args.task}")
    if plain_hf:
        overrides += ["model.source=hf", f"model.path={weights}"]
    if config_path is not None and not config_path.is_file():
        return _err(f"config {config_path} not found; pass --config FILE")
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as err:
        return user_error("covrl eval", err)

    from covrl._lazy import MissingExtraError
    from covrl.models import ModelNotFoundError, load_model
    from covrl.rollout import build_sampler
    from covrl.tasks import UserCodeError, build_task
    from covrl.train.run.agent_source import detached_player
    from covrl.train.run.checkpoint import CheckpointError, load_model_weights
    from covrl.train.run.components import resolve_device, seed_everything
    from covrl.train.run.evaluate import evaluate
    from covrl.train.run.sizing import fixed_sizes
    from covrl.train.run.threads import apply_num_threads

    cfg = fixed_sizes(cfg)   # a config with auto sizes (not a run folder's): the fallback numbers
    apply_num_threads(cfg)
    seed_everything(cfg.run.seed)
    try:
        model, tokenizer = load_model(cfg.model, seed=cfg.run.seed)
        if not plain_hf:
            load_model_weights(model, weights)
        model.to(resolve_device(cfg.run.device))
        task = build_task(cfg.task, response_budget=cfg.sampler.max_new_tokens)
        sampler = build_sampler(cfg.sampler, model, tokenizer)
        examples = task.eval[: cfg.eval.max_prompts] if cfg.eval.max_prompts else task.eval
        # an agent run is evaluated as it trained: its agent program plays the held-out prompts
        player = detached_player(cfg, sampler, tokenizer, task) if cfg.task.agent.enabled else None
        try:
            result = evaluate(sampler, task, tokenizer, examples, seed=cfg.run.seed + 17, greedy=True,
                              sampled=not args.no_sampled,
                              agent=player.evaluate_episodes if player is not None else None)
        finally:
            if player is not None:
                player.close()
    # a missing model, file or extra, a bad name or value, a reward function that keeps failing
    except (ModelNotFoundError, CheckpointError, ValueError, FileNotFoundError, MissingExtraError,
            UserCodeError) as err:
        return user_error("covrl eval", err)
    result["weights"] = str(weights)
    result["task"] = cfg.task.name
    if cfg.task.agent.enabled:
        result["agent"] = cfg.task.agent.spec
    st = result["settings"]
    accs = ", ".join(f"{m} {result[m]['accuracy']:.1%}" for m in ("greedy", "sampled") if m in result)
    print(f"{weights}: task {cfg.task.name}, {st['n_prompts']} held-out prompts: {accs} "
          f"(max_new_tokens {st['max_new_tokens']}, sampled at T={st['temperature']})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0
