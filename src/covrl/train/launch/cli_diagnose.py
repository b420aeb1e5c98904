"""`covrl diagnose --run DIR` or `covrl diagnose --before DIR --after DIR`: the geometry of a training run's update
(covrl.diagnostics.report).

Writes `diagnose.json` and `diagnose.png` into `--out` (default: `<run>/diagnose/`, or `./diagnose/` with
--before/--after). With `--run`, 'after' is the run's latest complete checkpoint and 'before' the weights RL
started from: `checkpoints/initial/model` when the run saved them (`run.save_initial=true`, or a KL reference),
otherwise rebuilt from the run's config.yaml (model, seed, threads, warm-up) and accepted only when its
fingerprint equals the one the run recorded (summary.json `initial_weights`).

Stdlib-only imports at module top (`covrl --help` does not import torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", type=Path, help="a covrl run folder: the weights RL started from vs its latest "
                        "complete checkpoints/ckpt-*/model")
    parser.add_argument("--before", type=Path, help="HF model folder before training (with --after)")
    parser.add_argument("--after", type=Path, help="HF model folder after training (with --before)")
    parser.add_argument("--out", type=Path, help="output folder (default: <run>/diagnose or ./diagnose)")
    parser.add_argument("--k", type=int, default=8, help="top-k directions for the update energy (default 8)")
    parser.add_argument("--atol", type=float, default=1e-5, help="sparsity threshold |Δ| ≤ atol (default 1e-5)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="precision of the published sparsity measurement (default bfloat16)")
    parser.add_argument("--rtol", type=float, default=1e-3, help="relative sparsity threshold (× max |Δ| per tensor)")
    parser.add_argument("--no-fisher", action="store_true", help="skip the Fisher-vs-update concentration")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: the model folders, then the run)")
    parser.add_argument("--prompt", action="append", help="prompt for the Fisher samples (repeatable; default: 4 "
                        "generic prompts; BOS only when no tokenizer is found)")
    parser.add_argument("--samples", type=int, default=4, help="sampled responses per prompt (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="length of each sampled response")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for the Fisher batch")
    parser.add_argument("--fisher-params", default=None, help="regular expression selecting parameters for the "
                        "Fisher (default: every 2-D weight matrix)")
    parser.add_argument("--top-frac", type=float, default=0.2, help="'high-Fisher' = this top fraction (default 0.2)")
    parser.add_argument("--seed", type=int, default=0)


def _fail(text: str) -> int:
    print(f"covrl diagnose: {text}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from covrl.settings import user_error

    if args.k < 1 or args.samples < 1 or args.max_new_tokens < 1 or not (0 < args.top_frac <= 1):
        return _fail("--k, --samples and --max-new-tokens must be >= 1 and --top-frac in (0, 1]")
    try:
        before, after, out = _resolve(args)
        (m0, tok0), (m1, tok1) = _before_model(args, before), _model(after)
    except (ValueError, FileNotFoundError) as err:   # not a run or model folder, weights that do not match
        return user_error("covrl diagnose", err)
    import torch

    from covrl.diagnostics.report import update_report, write_figure

    torch.set_grad_enabled(True)
    tokenizer, tokenizer_from = _tokenizer(args, (tok1, str(after)), (tok0, str(before)))
    try:
        report = update_report(m0, m1, tokenizer, args, before=str(before), after=str(after),
                               tokenizer_from=tokenizer_from)
    except ValueError as err:
        return user_error("covrl diagnose", err)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnose.json").write_text(json.dumps(report, indent=2))
    write_figure(report, out / "diagnose.png")
    s = report["summary"]
    print(f"before: {before}\nafter:  {after}")
    print(f"matrices: {s['matrices']}, mean energy in top {args.k}: {s['energy_top_k_mean']:.3f}, "
          f"mean rank ratio: {s['rank_ratio_mean']:.3f}")
    print(f"sparsity ({args.dtype}, |Δ| ≤ {args.atol:g}): {s['sparsity']:.3f}; full precision: "
          f"{s['sparsity_full']:.3f}; absorbed share: {s['absorbed_share']:.3f}")
    if "update_top_fisher_share" in s:
        print(f"share of ‖Δ‖² in the top {args.top_frac:.0%} Fisher coordinates: {s['update_top_fisher_share']:.3f} "
              f"(uniform would be {args.top_frac:.2f}; Fisher's own top share {s['fisher_top_share']:.3f})")
    print(f"wrote {out / 'diagnose.json'} and {out / 'diagnose.png'}")
    return 0


# 'before' of a run whose initial weights are rebuilt from its config, not read from a folder
REBUILT = "rebuilt from config.yaml"


def _resolve(args) -> tuple[Path | str, Path, Path]:
    """(before: a model folder or REBUILT, after: a model folder, the output folder)."""
    if args.run is not None:
        if args.before is not None or args.after is not None:
            raise ValueError("use either --run or --before/--after, not both")
        root = args.run
        if not (root / "config.yaml").is_file():
            raise ValueError(f"{root} is not a covrl run folder (no config.yaml)")
        ckpts = sorted((p for p in (root / "checkpoints").glob("ckpt-*") if (p / "COMPLETE").is_file()),
                       key=lambda p: p.name) or [p for p in [root / "checkpoints" / "final"] if (p / "COMPLETE").is_file()]
        if not ckpts:   # (checkpoints/final: the weights a run keeps with checkpoint.final=weights)
            raise ValueError(f"no complete checkpoint (checkpoints/ckpt-*/COMPLETE) in {root}: the run saves one "
                             "at the end with checkpoint.at_end=true")
        initial = root / "checkpoints" / "initial" / "model"
        return (initial if initial.is_dir() else REBUILT), ckpts[-1] / "model", args.out or root / "diagnose"
    if args.before is None or args.after is None:
        raise ValueError("give --run DIR, or both --before DIR and --after DIR")
    for p in (args.before, args.after):
        if not p.is_dir():
            raise ValueError(f"model folder {p} does not exist")
    return args.before, args.after, args.out or Path("diagnose")


def _model(folder: Path):
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a transformers model folder (no config.json); give the folders a model "
                         "was saved to (save_pretrained), or --run a covrl run folder")
    from covrl.models import load_pretrained

    model, tokenizer = load_pretrained(folder)
    model.eval()
    return model, tokenizer


def _before_model(args, before: Path | str):
    if before != REBUILT:
        return _model(before)
    return _rebuilt_initial(args.run)


def _rebuilt_initial(run_dir: Path):
    """The run's initial weights rebuilt from its config, checked against the fingerprint it recorded."""
    from covrl.train.config import ConfigError, load_config
    from covrl.train.run.checkpoint import weights_fingerprint
    from covrl.train.run.components import rebuild_initial_model

    try:
        recorded = json.loads((run_dir / "summary.json").read_text()).get("initial_weights") or {}
    except (OSError, ValueError):
        recorded = {}
    if not recorded.get("fingerprint"):
        raise ValueError(f"{run_dir}: no checkpoints/initial/model and no recorded fingerprint of the initial "
                         "weights to rebuild them against (summary.json initial_weights); rerun with "
                         "run.save_initial=true")
    try:
        cfg = load_config(run_dir / "config.yaml")
    except ConfigError as err:
        raise ValueError(str(err)) from None
    print(f"rebuilding the initial weights from {run_dir / 'config.yaml'} ...", flush=True)
    model, tokenizer = rebuild_initial_model(cfg)
    if weights_fingerprint(model) != recorded["fingerprint"]:
        raise ValueError(f"{run_dir}: the initial weights rebuilt from config.yaml differ from the ones the run "
                         "started from (another CPU model, thread count or library version changes the warm-up's "
                         "float sums); rerun with run.save_initial=true to diagnose it")
    model.eval()
    if hasattr(model, "merge_and_unload"):   # a LoRA run: the merged weights, as the checkpoint's folder loads
        model = model.merge_and_unload()
    return model, tokenizer


def _tokenizer(args, *candidates):
    """The tokenizer of --tokenizer, else the first model folder that has one: (tokenizer or None, where)."""
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(args.tokenizer), local_files_only=True), str(args.tokenizer)
    for tokenizer, where in candidates:
        if tokenizer is not None:
            return tokenizer, where
    return None, None
