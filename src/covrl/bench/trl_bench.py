"""`covrl bench trl`: the same GRPO step in covrl and in TRL's `GRPOTrainer`, run alternately.

Both sides: the same model folder, the same prompts (covrl's arithmetic task, `n_prompts` per step, in order),
`group_size` completions per prompt sampled at temperature 1 with up to `max_new_tokens` new tokens, the
task's reward, group-normalised advantages (GRPO), the clipped ratio loss averaged over all completion tokens,
AdamW at a constant lr, grad-norm clipping, one optimizer step per rollout batch, fp32, `threads` torch threads.
Each side runs in its own process; steps alternate (order flipped every step) so load on a shared machine
hits both alike. Reported per side: median step time and generation time, rollouts/s, generated tokens/s
(over generation time), trained tokens/s (completion tokens over the rest of the step), end-to-end tokens/s,
peak RSS; and covrl/TRL ratios. Both sides do the same rollouts per step, so the throughput ratio is the
ratio of median step times; tokens/s also depend on how long the sampled completions happen to be.

`--vllm`: both sides sample with vLLM (covrl `sampler.backend=vllm`, TRL `use_vllm=True, vllm_mode="colocate"`),
in the venv that has vLLM. A side that fails there (TRL's colocate weight sync on vLLM's CPU backend,
docs/performance.md) gets a row with its error instead of stopping the benchmark.

That the two sides compute the same step (TRL's own `compute_loss` and covrl's `compute_advantages('grpo')` +
`policy_loss('ppo_clip')` give the same loss and gradient on a shared batch) is a test:
tests/bench/test_trl_parity.py."""

from __future__ import annotations

import argparse
import os
import sys

from covrl.bench.alternate import WORKERS, run_alternating
from covrl.bench.common import add_output_options, output_dir, write_bench
from covrl.bench.models import DEFAULT_CACHE
from covrl.bench.settings import StepSettings, default_task_overrides
from covrl.train import git_state


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per side")
    parser.add_argument("--warmup-steps", type=int, default=1, help="untimed steps per side first")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per side")
    parser.add_argument("--sides", default="covrl,trl", help="which sides to run (comma-separated)")
    parser.add_argument("--cache-dir", default=None, help="model folder cache (default runs/cache)")
    add_output_options(parser)   # --out, --update-baseline (covrl.bench.common)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, short completions (tests)")
    parser.add_argument("--covrl-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override the covrl side's config (repeatable), e.g. sampler.compile=true: covrl "
                        "with a speed option; the table names every override")
    parser.add_argument("--vllm", action="store_true", help="both sides sample with vLLM (covrl sampler.backend="
                        "vllm, TRL use_vllm colocate); a side that fails gets a row with its error")


def settings_from_args(args: argparse.Namespace) -> StepSettings:
    if args.quick:
        args.model, args.steps, args.warmup_steps, args.prompts, args.group_size, args.max_new_tokens = (
            "tiny", 2, 1, 2, 2, 6)
    return StepSettings(
        model=args.model, cache_dir=str(args.cache_dir or DEFAULT_CACHE), threads=args.threads,
        n_prompts=args.prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
        learning_rate=args.lr, warmup_steps=args.warmup_steps, steps=args.steps,
        task=default_task_overrides(args.model), vllm=args.vllm, covrl_overrides=tuple(args.covrl_set),
    )


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if settings.covrl_overrides:   # a bad override stops here, before any model loads, naming the key
        from covrl.bench.covrl_side import covrl_run_config

        covrl_run_config(settings)
    sides = tuple(s.strip() for s in args.sides.split(",") if s.strip())
    unknown = set(sides) - set(WORKERS)
    if unknown:
        raise SystemExit(f"--sides: unknown {sorted(unknown)}; allowed: {', '.join(WORKERS)}")
    load_before = os.getloadavg()
    timing = run_alternating(settings, sides, progress=_progress, tolerate=sides if settings.vllm else ())
    summary, failed = timing["summary"], timing["failed"]
    ratios = {}
    if summary.get("covrl") and summary.get("trl"):
        c, t = summary["covrl"], summary["trl"]
        ratios = {
            # equal rollouts per step, so rollouts/s is the throughput at equal settings
            "throughput_covrl_over_trl": t["median_step_s"] / c["median_step_s"],
            "end_to_end_tokens_per_s_covrl_over_trl": c["step_tokens_per_s"] / t["step_tokens_per_s"],
            "gen_tokens_per_s_covrl_over_trl": c["gen_tokens_per_s"] / t["gen_tokens_per_s"],
            "trained_tokens_per_s_covrl_over_trl": c["trained_tokens_per_s"] / t["trained_tokens_per_s"],
            "peak_rss_covrl_over_trl": c["peak_rss_mb"] / t["peak_rss_mb"],
        }
    results = {"source": git_state(), "settings": vars(settings) | {"batch_size": settings.batch_size}, "sides": sides,
               "load_before": load_before, "load_after": os.getloadavg(),
               "ratios": ratios, **timing}
    rows = ["| side | median step s | median gen s | rollouts/s | gen tok/s | trained tok/s | end-to-end tok/s | gen tokens/step | "
            "peak RSS MiB | mean reward | load |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for side, reason in failed.items():
        rows.append(f"| {side} | failed: {reason.replace('|', '/')} |" + " |" * 9)
    for side, s in summary.items():
        if not s:
            continue
        rows.append(f"| {side} | {s['median_step_s']:.3f} | {s['median_gen_s']:.3f} | {s['rollouts_per_s']:.2f} | {s['gen_tokens_per_s']:.1f} | "
                    f"{s['trained_tokens_per_s']:.1f} | {s['step_tokens_per_s']:.1f} | "
                    f"{s['gen_tokens_per_step']:.0f} | {s['peak_rss_mb']:.0f} | {s['reward_mean']:.3f} | "
                    f"{s['mean_load1']:.1f} |")
    table = "\n".join(rows)
    if ratios:
        table += (f"\n\ncovrl/TRL throughput (rollouts/s = TRL/covrl median step time): "
                  f"**{ratios['throughput_covrl_over_trl']:.2f}x**; generated tokens/s "
                  f"{ratios['gen_tokens_per_s_covrl_over_trl']:.2f}x; trained tokens/s "
                  f"{ratios['trained_tokens_per_s_covrl_over_trl']:.2f}x; end-to-end tokens/s "
                  f"{ratios['end_to_end_tokens_per_s_covrl_over_trl']:.2f}x; peak RSS covrl/TRL "
                  f"{ratios['peak_rss_covrl_over_trl']:.2f}.")
    table += (f"\n\nmodel {settings.model}, {settings.n_prompts} prompts x {settings.group_size} completions, "
              f"{settings.max_new_tokens} new tokens, {settings.threads} thread(s), {settings.steps} timed steps "
              f"after {settings.warmup_steps} warm-up; load1 before {load_before[0]:.1f}"
              f"{'; both sides sample with vLLM' if settings.vllm else ''}"
              f"{'; covrl side with ' + ', '.join(settings.covrl_overrides) if settings.covrl_overrides else ''}.\n")
    name = (f"trl-{settings.model}" + ("-vllm" if settings.vllm else "") + ("-covrl-set" if settings.covrl_overrides
            else "") + ("-quick" if args.quick else ""))
    headline = (f"covrl/TRL throughput {ratios['throughput_covrl_over_trl']:.2f}x ({settings.n_prompts} x "
                f"{settings.group_size} rollouts, {settings.max_new_tokens} tokens)" if ratios else
                "failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    write_bench(name, results, table, output_dir(args), headline=headline)
    return 0 if any(summary.values()) else 1
