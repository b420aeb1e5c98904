"""`covrl bench explore`: per-step time of linear Ensemble++ against exact linear Thompson sampling as d grows.

Exact LinTS needs a Cholesky factor of Σ_t every round (O(d³)); Ensemble++ needs O(d² + dM) (rank-one updates of
Σ and the particles, θ = μ + Aζ). Measured at M = ⌈d ln T⌉ (enough particles for the sequential-JL guarantee)
and at M = 8, on the finite-arm linear bandit, one seed, float64, with the cumulative regret alongside.
Timing is agent time (act + update) per round, `--threads` torch threads."""

from __future__ import annotations

import argparse
import math

from covrl.bench.common import add_output_options, output_dir, write_bench
from covrl.explore.loop import run_bandit


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dims", default="50,100,200,400,1000", help="comma-separated dimensions d")
    parser.add_argument("--steps", type=int, default=100, help="rounds T per run (M = ceil(d ln T))")
    parser.add_argument("--arms", type=int, default=100, help="arms of the finite-arm linear bandit")
    parser.add_argument("--small-M", type=int, default=8, help="the fixed small ensemble size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    add_output_options(parser)   # --out, --update-baseline (covrl.bench.common)


def run(args: argparse.Namespace) -> int:
    import torch


    torch.set_num_threads(args.threads)
    dims = [int(d) for d in args.dims.split(",") if d.strip()]
    if not dims or min(dims) < 1 or args.steps < 2:
        print("covrl bench explore: --dims must be positive integers and --steps >= 2")
        return 2
    rows = []
    for d in dims:
        env = {"d": d, "n_arms": args.arms, "prior_var": 1.0, "noise_std": 1.0}
        m_big = math.ceil(d * math.log(args.steps))
        runs = {"lints": run_bandit("linear", "lints", steps=args.steps, seeds=1, seed=args.seed, env_options=env),
                "epp_dlogT": run_bandit("linear", "ensemble++", steps=args.steps, seeds=1, seed=args.seed,
                                        env_options=env, agent_options={"M": m_big}),
                "epp_small": run_bandit("linear", "ensemble++", steps=args.steps, seeds=1, seed=args.seed,
                                        env_options=env, agent_options={"M": args.small_M})}
        ms = {k: 1e3 * r.median_seconds_per_step for k, r in runs.items()}
        rows.append({"d": d, "M_dlogT": m_big, "M_small": args.small_M,
                     "ms_per_step": ms, "regret": {k: r.metrics["final_regret_mean"] for k, r in runs.items()},
                     "ratio_lints_over_epp_dlogT": ms["lints"] / ms["epp_dlogT"],
                     "ratio_lints_over_epp_small": ms["lints"] / ms["epp_small"]})
        print(f"d={d}: LinTS {ms['lints']:.2f} ms, E++ M={m_big} {ms['epp_dlogT']:.2f} ms, "
              f"E++ M={args.small_M} {ms['epp_small']:.2f} ms", flush=True)
    head = (f"| d | LinTS ms/step | E++ M=d ln T (M) ms/step | E++ M={args.small_M} ms/step | "
            f"LinTS / E++(d ln T) | LinTS / E++({args.small_M}) | regret LinTS / E++(d ln T) / E++({args.small_M}) |")
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        ms, rg = r["ms_per_step"], r["regret"]
        lines.append(f"| {r['d']} | {ms['lints']:.3f} | {ms['epp_dlogT']:.3f} ({r['M_dlogT']}) | "
                     f"{ms['epp_small']:.3f} | {r['ratio_lints_over_epp_dlogT']:.2f}x | "
                     f"{r['ratio_lints_over_epp_small']:.2f}x | {rg['lints']:.1f} / {rg['epp_dlogT']:.1f} / "
                     f"{rg['epp_small']:.1f} |")
    table = (f"T = {args.steps} rounds, {args.arms} arms, 1 seed, float64, {args.threads} thread(s); "
             "time = median over rounds of agent act + update.\n\n" + "\n".join(lines))
    last = rows[-1]
    headline = (f"d = {last['d']}: LinTS / Ensemble++ (M = {last['M_small']}) time per step "
                f"{last['ratio_lints_over_epp_small']:.1f}x")
    out = output_dir(args)
    write_bench("explore", {"settings": vars(args) | {"out": str(out)}, "rows": rows}, table, out,
                headline=headline)
    return 0
