"""Reproduction `python -m studies ensemble-linear` (docs/theory.md ¶5–6, docs/theory.md §10): linear Ensemble++ nearly matches
exact Thompson sampling with few particles.

Sections:

1. Russo-style finite-arm bandit (d = 10, 1000 arms with coordinates U[−1/√5, 1/√5], θ ~ N(0, 10 I), noise 1,
   T = 1000, 200 seeds on common instances): cumulative regret of exact LinTS and of Ensemble++ with gaussian and
   coordinate references (sphere perturbation) for M ∈ {2, 4, 8, 16, 64}, plus ensemble sampling.
   Criteria: Ensemble++ (gaussian) at M = 16 within 10 % of LinTS; gaussian beats coordinate at M = 2 and 4.
2. Smallest M (on a grid) whose regret is within 10 % of LinTS, as d grows (d ∈ {5, 10, 20, 40}) and as the number
   of arms grows (d = 10, arms ∈ {100, 1000, 5000}). Criteria: log-log slope of M* against d in [0.5, 1.5]
   (≈ linear growth); max/min of M* over arm counts ≤ 2 (flat).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from studies.common import pyplot, save_figure, start_repro

from covrl.explore.loop import run_bandit

CLAIM = (
    "Linear Ensemble++ (θ = μ + Aζ, Kalman-form particle updates) nearly matches exact linear Thompson sampling "
    "with M = 16 particles at d = 10; continuous references beat the coordinate one at small M; the smallest M "
    "that matches TS grows about linearly in d and is flat in the number of arms."
)


@dataclass
class Settings:
    d: int = 10
    arms: int = 1000
    steps: int = 1000
    seeds: int = 200
    Ms: tuple[int, ...] = (2, 4, 8, 16, 64)
    es_Ms: tuple[int, ...] = (8, 16)
    scan_ds: tuple[int, ...] = (5, 10, 20, 40)
    scan_arms: tuple[int, ...] = (100, 1000, 5000)
    scan_seeds: int = 200
    scan_arm_seeds: int = 100
    scan_Ms: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    tolerance: float = 0.10


FULL = Settings()
FAST = Settings(d=10, arms=200, steps=300, seeds=60, Ms=(2, 4, 16), es_Ms=(), scan_ds=(2, 16), scan_arms=(50, 400),
                scan_seeds=60, scan_arm_seeds=60, scan_Ms=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))


def _env_opts(d: int, arms: int) -> dict:
    return {"d": d, "n_arms": arms, "prior_var": 10.0, "noise_std": 1.0, "arm_scale": 1 / math.sqrt(5)}


def minimal_matching_M(d: int, arms: int, cfg: Settings, seeds: int, seed: int) -> dict:
    """Smallest M on the grid whose mean cumulative regret is ≤ (1 + tolerance) × exact LinTS's, on common
    instances; returns it with the whole regret curve over M (None if no grid M matches)."""

    opts = _env_opts(d, arms)
    ts = run_bandit("linear", "lints", steps=cfg.steps, seeds=seeds, seed=seed, env_options=opts)
    ts_regret = ts.metrics["final_regret_mean"]
    curve = {}
    found = None
    for M in cfg.scan_Ms:
        r = run_bandit("linear", "ensemble++", steps=cfg.steps, seeds=seeds, seed=seed, env_options=opts,
                       agent_options={"M": M, "reference": "gaussian", "perturbation": "sphere"})
        curve[M] = r.metrics["final_regret_mean"]
        if curve[M] <= (1 + cfg.tolerance) * ts_regret:
            found = M
            break
    return {"d": d, "arms": arms, "lints": ts_regret, "regret_by_M": curve, "M_star": found}


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):
    plt = pyplot()
    import torch


    cfg = FAST if fast else FULL
    result = start_repro("ensemble-linear", CLAIM, out_dir)
    opts = _env_opts(cfg.d, cfg.arms)

    # 1. regret table
    runs = {"lints": run_bandit("linear", "lints", steps=cfg.steps, seeds=cfg.seeds, seed=seed, env_options=opts)}
    for ref in ("gaussian", "coordinate"):
        for M in cfg.Ms:
            runs[f"ensemble++ {ref} M={M}"] = run_bandit(
                "linear", "ensemble++", steps=cfg.steps, seeds=cfg.seeds, seed=seed, env_options=opts,
                agent_options={"M": M, "reference": ref, "perturbation": "sphere"})
    for M in cfg.es_Ms:
        runs[f"ensemble-sampling M={M}"] = run_bandit("linear", "ensemble-sampling", steps=cfg.steps,
                                                      seeds=cfg.seeds, seed=seed, env_options=opts,
                                                      agent_options={"M": M})
    table = {k: {"regret": r.metrics["final_regret_mean"], "stderr": r.metrics["final_regret_stderr"],
                 "us_per_step": 1e6 * r.seconds_per_step} for k, r in runs.items()}
    result.numbers["settings"] = {"d": cfg.d, "arms": cfg.arms, "steps": cfg.steps, "seeds": cfg.seeds,
                                  "prior_var": 10.0, "noise_std": 1.0}
    result.numbers["regret_table"] = table
    ts = table["lints"]["regret"]
    m16 = max(M for M in cfg.Ms if M <= 16)
    ratio = table[f"ensemble++ gaussian M={m16}"]["regret"] / ts
    result.check(f"Ensemble++ (gaussian) M={m16} regret / LinTS", round(ratio, 3), "<= 1.10", ratio <= 1.10)
    small = [M for M in cfg.Ms if M <= 4]
    wins = {M: (table[f"ensemble++ gaussian M={M}"]["regret"], table[f"ensemble++ coordinate M={M}"]["regret"])
            for M in small}
    result.check("gaussian vs coordinate regret at M <= 4", {str(M): [round(a, 1), round(b, 1)]
                                                             for M, (a, b) in wins.items()},
                 "gaussian < coordinate at every M <= 4", all(a < b for a, b in wins.values()))

    # 2. minimal matching M vs d and vs arms
    by_d = [minimal_matching_M(d, cfg.arms, cfg, cfg.scan_seeds, seed) for d in cfg.scan_ds]
    by_arms = [minimal_matching_M(cfg.d, k, cfg, cfg.scan_arm_seeds, seed) for k in cfg.scan_arms]
    result.numbers["M_star_vs_d"] = by_d
    result.numbers["M_star_vs_arms"] = by_arms
    ds = [row["d"] for row in by_d if row["M_star"]]
    ms = [row["M_star"] for row in by_d if row["M_star"]]
    if len(ds) >= 2 and len(ds) == len(by_d):
        lx = torch.log(torch.tensor(ds, dtype=torch.float64))
        ly = torch.log(torch.tensor(ms, dtype=torch.float64))
        slope = float(((lx - lx.mean()) * (ly - ly.mean())).sum() / ((lx - lx.mean()) ** 2).sum())
    else:
        slope = float("nan")
    result.check("log-log slope of minimal matching M vs d", round(slope, 2) if math.isfinite(slope) else "n/a",
                 "in [0.5, 1.5] (about linear growth)", math.isfinite(slope) and 0.5 <= slope <= 1.5)
    arm_ms = [row["M_star"] for row in by_arms]
    flat = all(m is not None for m in arm_ms) and max(arm_ms) / min(arm_ms) <= 2
    result.check("minimal matching M over arm counts", {str(r["arms"]): r["M_star"] for r in by_arms},
                 "max / min <= 2 (flat)", flat)

    # figures
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    for name, r in runs.items():
        if name == "lints" or "M=16" in name or "M=2" in name or "M=64" in name or "M=4" in name:
            style = "k-" if name == "lints" else ("--" if "coordinate" in name else "-")
            ax.plot(r.cumulative.mean(0), style, label=name, lw=2 if name == "lints" else 1)
    ax.set_xlabel("round t")
    ax.set_ylabel("cumulative regret (mean over seeds)")
    ax.set_title(f"d={cfg.d}, {cfg.arms} arms, {cfg.seeds} seeds")
    ax.legend(fontsize=6)
    ax = axes[1]
    for ref, mk in (("gaussian", "o-"), ("coordinate", "s--")):
        ax.errorbar(cfg.Ms, [table[f"ensemble++ {ref} M={M}"]["regret"] for M in cfg.Ms],
                    yerr=[table[f"ensemble++ {ref} M={M}"]["stderr"] for M in cfg.Ms], fmt=mk, label=ref)
    ax.axhline(ts, color="k", label="LinTS")
    ax.axhline(ts * 1.1, color="k", ls=":", label="LinTS + 10%")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M")
    ax.set_ylabel(f"regret at T={cfg.steps}")
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.plot([r["d"] for r in by_d], [r["M_star"] or float("nan") for r in by_d], "o-", label="vs d (arms fixed)")
    ax2 = ax.twiny()
    ax2.plot([r["arms"] for r in by_arms], [r["M_star"] or float("nan") for r in by_arms], "s--", color="C1",
             label="vs arms (d fixed)")
    ax.set_xlabel("d")
    ax2.set_xlabel("number of arms")
    ax2.set_xscale("log")
    ax.set_ylabel("smallest M within 10% of LinTS")
    ax.legend(loc="upper left", fontsize=7)
    ax2.legend(loc="lower right", fontsize=7)
    save_figure(fig, out_dir / "ensemble_linear.png", dpi=120)
    result.figures.append("ensemble_linear.png")
    result.notes = ("Regret table (mean cumulative regret ± stderr at T): "
                    + "; ".join(f"{k}: {v['regret']:.1f} ± {v['stderr']:.1f}" for k, v in table.items()))
    return result
