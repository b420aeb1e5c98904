"""`python -m studies time-to-accuracy`: training wall time until greedy held-out accuracy reaches the target
(default 90%) on one-digit addition, covrl's default run vs TRL's GRPO.

covrl side: the run `covrl train --config configs/default.yaml` builds (model loader, SFT warm-up if any,
sampler, Trainer, data stream), stepped like the sync loop. TRL side: `GRPOTrainer` on the same model
weights (the SmolLM2 folder), the same task (the covrl config's `task` section: same training prompts,
held-out prompts and grader), at the settings reported best on a 2-core CPU: 16 completions per step
(2 prompts x 8), 24 new tokens, lr 1e-5 (overridable).

Both sides step alternately in their own processes; each keeps a training clock (the sum of its step times,
plus covrl's SFT warm-up if the config has one; model loading excluded) and pauses it to evaluate greedy
accuracy on the same held-out prompts with the same decoder (covrl's HF sampler, `max_new_tokens` new
tokens) and grader each time `eval_interval_s` of training time has passed. The time to accuracy is the
training clock at the first evaluation at or above the target (so it is rounded up to the evaluation grid);
a side that does not reach the target within `budget_s` is reported as not reached."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from covrl.bench.alternate import run_alternating
from covrl.bench.common import write_bench
from covrl.bench.models import DEFAULT_CACHE, model_dir
from covrl.bench.settings import StepSettings
from covrl.config import dump_config, load_config, load_preset
from covrl.train import git_state
from covrl.train.run.sizing import fixed_sizes


def add_side_options(parser: argparse.ArgumentParser) -> None:
    """The options of the two sides and their shared evaluation (also `python -m studies suite`'s)."""
    parser.add_argument("--trl-prompts", type=int, default=2, help="TRL prompts per step")
    parser.add_argument("--trl-group-size", type=int, default=8, help="TRL completions per prompt")
    parser.add_argument("--trl-lr", type=float, default=1e-5)
    parser.add_argument("--max-new-tokens", type=int, default=24, help="TRL's completion length and the "
                        "evaluation's (both sides)")
    parser.add_argument("--target", type=float, default=0.9, help="greedy held-out accuracy to reach")
    parser.add_argument("--eval-prompts", type=int, default=50, help="held-out prompts per evaluation")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per side")
    parser.add_argument("--cache-dir", default=None, help="model folder cache (default runs/cache)")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--covrl-config", default="configs/default.yaml", help="covrl's run config (YAML)")
    add_side_options(parser)
    parser.add_argument("--budget-s", type=float, default=600.0, help="training time allowed per side")
    parser.add_argument("--eval-interval-s", type=float, default=30.0, help="training time between evaluations")
    parser.add_argument("--sides", default="covrl,trl")
    parser.add_argument("--out", default="runs/studies/time-to-accuracy", help="folder for the JSON + table")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model + configs/tiny.yaml without warm-up, seconds of budget (tests)")


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def _progress(text: str) -> None:
    import sys

    print(text, file=sys.stderr, flush=True)


def quick_config(model_folder: str, task_overrides: dict | None = None):
    """--quick: the tiny preset on the cached tiny model folder, two short steps per side (exercises the
    machinery). The model, warm-up, loop, sampler and optim sections are replaced whole (what they do not name is
    at its default), as the quick run has always been configured; `task_overrides` (dotted task.* keys) last."""
    return load_preset("tiny", {
        "model": {"source": "hf", "path": model_folder}, "sft_warmup": {"steps": 0},
        "loop": {"steps": 2, "prompts_per_step": 2, "group_size": 2},
        "sampler": {"max_new_tokens": 4, "max_batch": 8}, "optim": {"micro_batch_size": 4},
        "task.chat_template": False, "task.n_train": 20, "task.n_eval": 4, **(task_overrides or {}),
    })


def set_quick(args: argparse.Namespace) -> None:
    """--quick's side options: two short steps per side, an evaluation after each, four held-out prompts."""
    args.trl_prompts, args.trl_group_size, args.max_new_tokens = 2, 2, 4
    args.budget_s, args.eval_interval_s, args.eval_prompts = 0.0, 1e-9, 4


def side_settings(args: argparse.Namespace, cfg, config_path: str, stop_at_target: bool = True
                  ) -> dict[str, StepSettings]:
    """Each side's StepSettings: covrl runs `config_path` (= `cfg`) as `covrl train` would; TRL runs GRPO at the
    `--trl-*` settings on the same task section, seed, evaluator and budget."""
    common = dict(model="tiny" if args.quick else "smollm2", cache_dir=str(args.cache_dir or DEFAULT_CACHE),
                  threads=args.threads, seed=cfg.run.seed, max_new_tokens=args.max_new_tokens, warmup_steps=0,
                  eval_interval_s=args.eval_interval_s, eval_prompts=args.eval_prompts,
                  target_accuracy=args.target, budget_s=args.budget_s, stop_at_target=stop_at_target,
                  task=cfg.task.model_dump(mode="json"))
    max_steps = 2 if args.quick else 10_000
    return {
        "covrl": StepSettings(**common, steps=max_steps, covrl_config=config_path),
        "trl": StepSettings(**common, steps=max_steps, n_prompts=args.trl_prompts,
                            group_size=args.trl_group_size, learning_rate=args.trl_lr),
    }


def side_result(timing: dict, side: str, settings: StepSettings, cfg) -> dict:
    """One side's outcome from `run_alternating`'s records: accuracy before, every evaluation, the first one at
    or above the target (time and steps), the final accuracy and the step timings."""
    recs = timing["all_records"][side]
    evals = [(r["train_clock_s"], r["accuracy"], r["step"] + 1) for r in recs if "accuracy" in r]
    hit = next(((t, a, n) for t, a, n in evals if a >= settings.target_accuracy), None)
    rollouts = settings.batch_size if side == "trl" else cfg.loop.prompts_per_step * cfg.loop.group_size
    return {
        "accuracy_before": timing["ready"][side].get("accuracy_before"),
        "sft_s": timing["ready"][side].get("sft_s", 0.0),
        "reached": hit is not None, "time_to_target_s": hit[0] if hit else None,
        "steps_to_target": hit[2] if hit else None,
        "steps": len(recs), "final_accuracy": evals[-1][1] if evals else None,
        "train_clock_s": recs[-1]["train_clock_s"] if recs else 0.0,
        "evals": [{"train_clock_s": t, "accuracy": a, "steps": n} for t, a, n in evals],
        "mean_step_s": sum(r["step_time"] for r in recs) / max(len(recs), 1),
        "mean_load1": sum(r["load1"] for r in recs) / max(len(recs), 1), "rollouts_per_step": rollouts,
        "summary": timing["summary"][side],
    }


def run(args: argparse.Namespace) -> int:
    cache = str(args.cache_dir or DEFAULT_CACHE)
    config_path = args.covrl_config
    if args.quick:
        tmp = Path(tempfile.mkdtemp(prefix="covrl-tta-quick-")) / "tiny-quick.yaml"
        tmp.write_text(dump_config(quick_config(str(model_dir("tiny", cache)))))
        config_path = str(tmp)
        set_quick(args)
    cfg = fixed_sizes(load_config(config_path))   # auto sizes: the typed ones this study was built on
    per_side = side_settings(args, cfg, config_path)
    sides = tuple(s.strip() for s in args.sides.split(",") if s.strip())
    load_before = os.getloadavg()
    timing = run_alternating({s: per_side[s] for s in sides}, sides, timeout_s=7200.0, progress=_progress)
    results = {"source": git_state(), "target": args.target, "budget_s": args.budget_s, "eval_interval_s": args.eval_interval_s,
               "covrl_config": cfg.model_dump(mode="json"), "covrl_config_path": config_path,
               "trl_settings": vars(per_side["trl"]), "load_before": load_before, "load_after": os.getloadavg(),
               "sides": {}}
    rows = ["| side | accuracy before | reached | time to target s | steps | final accuracy | "
            "rollouts/step | mean step s | mean load |", "|---|---|---|---|---|---|---|---|---|"]
    for side in sides:
        info = side_result(timing, side, per_side[side], cfg)
        hit, rollouts = info["reached"], info["rollouts_per_step"]
        results["sides"][side] = info
        when = f"{info['time_to_target_s']:.0f}" if hit else f"> {info['train_clock_s']:.0f} (not reached)"
        before, final = _pct(info["accuracy_before"]), _pct(info["final_accuracy"])
        rows.append(f"| {side} | {before} | {'yes' if hit else 'no'} | {when} | {info['steps']} | {final} | "
                    f"{rollouts} | {info['mean_step_s']:.1f} | {info['mean_load1']:.1f} |")
    table = "\n".join(rows)
    s = results["sides"]
    if "covrl" in s and "trl" in s:
        c, t = s["covrl"], s["trl"]
        if c["reached"] and t["reached"]:
            ratio = c["time_to_target_s"] / t["time_to_target_s"]
            results["covrl_over_trl_time"] = ratio
            table += f"\n\ncovrl/TRL time to {args.target:.0%}: **{ratio:.2f}** (goal <= 0.5)."
        elif c["reached"]:
            bound = c["time_to_target_s"] / t["train_clock_s"]
            results["covrl_over_trl_time_upper_bound"] = bound
            table += f"\n\nTRL did not reach the target; covrl/TRL time < {bound:.2f}."
        else:
            table += "\n\ncovrl did not reach the target within the budget."
    table += (f"\n\nTarget {args.target:.0%} greedy accuracy on {args.eval_prompts} held-out prompts, evaluated every "
              f"{args.eval_interval_s:g} s of training time (clock paused), budget {args.budget_s:g} s per side, "
              f"{args.threads} thread(s) each; TRL: {per_side['trl'].n_prompts} x {per_side['trl'].group_size} "
              f"completions, {args.max_new_tokens} new tokens, lr {args.trl_lr:g}; covrl: {config_path}.\n")
    headline = "; ".join(f"{side}: " + (f"{v['time_to_target_s']:.0f} s to {args.target:.0%}" if v.get("reached")
                                        else "target not reached") for side, v in s.items())
    write_bench("time-to-accuracy" + ("-quick" if args.quick else ""), results, table, Path(args.out),
                headline=headline)
    if args.quick:
        shutil.rmtree(Path(config_path).parent, ignore_errors=True)
    return 0
