"""Reproduction `python -m studies ensemble-neural` (docs/theory.md ¶6, docs/theory.md §10): an index-input network (Neural
Ensemble++) explores like an ensemble at a fraction of the compute.

Setup (the paper's quadratic bandit scaled to 2 CPU cores): f(x) = xᵀΘΘᵀx / d with Θ ∈ R^{d×d} Gaussian, d = 10,
a pool of 1000 unit-vector actions of which 50 are offered per round, noise 0.1, T = 1000, 10 seeds on common
instances (environment seeds 1000 + seed + s, disjoint from the seeds used to pick the prior scale). All agents
use a 2×64 ReLU MLP, Adam (lr 3e-3), G = 2 steps of batch 64 per round, σ_p = 0.1 and prior scale 3 (chosen among
{0.3, 1, 3, 5} for Ensemble++ on 8 other seeds, then shared by all agents): Neural Ensemble++ (M ∈ {2, 8, 32}
linear heads on one shared network), Ensemble+ (M ∈ {2, 8} whole networks with random priors), EpiNet (M = 8
index dimension), Greedy.
Measured: cumulative regret curves, parameter count (trainable + fixed priors) and agent seconds per round.
Criteria: Ensemble++ (M = 8) has lower regret than Greedy; no more regret than Ensemble+ (M = 8) with fewer
parameters (the fast smoke variant allows 1.25×); and it lies on the regret-vs-parameters and regret-vs-seconds
Pareto frontiers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from studies.common import pyplot, save_figure, start_repro

from covrl.explore.loop import run_bandit

CLAIM = (
    "Neural Ensemble++ (shared network, M linear heads on stop-gradient features, index as input) matches or "
    "beats Ensemble+ and EpiNet on a quadratic bandit, and beats Greedy, at a fraction of Ensemble+'s compute."
)


@dataclass
class Settings:
    d: int = 10
    n_actions: int = 1000
    n_offered: int = 50
    noise_std: float = 0.1
    steps: int = 1000
    seeds: int = 10
    hidden: tuple[int, ...] = (64, 64)
    lr: float = 3e-3
    sgd_steps: int = 2
    batch_size: int = 64
    noise_scale: float = 0.1
    prior_scale: float = 3.0
    eplus_tolerance: float = 1.0  # Ensemble++ regret may be up to this × Ensemble+'s (fast: a smoke test)
    agents: tuple[tuple[str, int], ...] = field(default_factory=lambda: (
        ("neural-ensemble++", 8), ("neural-ensemble++", 2), ("neural-ensemble++", 32),
        ("ensemble+", 8), ("ensemble+", 2), ("epinet", 8), ("greedy", 1)))


FULL = Settings()
FAST = Settings(d=4, n_actions=200, n_offered=20, steps=200, seeds=2, hidden=(32, 32), sgd_steps=1,
                eplus_tolerance=1.25,
                agents=(("neural-ensemble++", 8), ("ensemble+", 8), ("epinet", 8), ("greedy", 1)))

EVAL_SEED_OFFSET = 1000  # evaluation instances differ from the ones used to choose the prior scale (0..7)
LABELS = {"neural-ensemble++": "Ensemble++", "ensemble+": "Ensemble+", "epinet": "EpiNet", "greedy": "Greedy"}


def _pareto(points: dict[str, tuple[float, float]]) -> set[str]:
    """Names not dominated: no other point has cost ≤ and regret ≤ with one strict."""
    keep = set()
    for name, (c, r) in points.items():
        dominated = any((c2 <= c and r2 <= r) and (c2 < c or r2 < r) for n2, (c2, r2) in points.items() if n2 != name)
        if not dominated:
            keep.add(name)
    return keep


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):
    plt = pyplot()


    cfg = FAST if fast else FULL
    result = start_repro("ensemble-neural", CLAIM, out_dir)
    env_opts = {"d": cfg.d, "n_actions": cfg.n_actions, "n_offered": cfg.n_offered, "noise_std": cfg.noise_std}
    common = {"hidden_sizes": cfg.hidden, "lr": cfg.lr, "sgd_steps": cfg.sgd_steps, "batch_size": cfg.batch_size,
              "noise_scale": cfg.noise_scale, "prior_scale": cfg.prior_scale}
    runs = {}
    for agent, M in cfg.agents:
        name = LABELS[agent] + ("" if agent == "greedy" else f" M={M}")
        runs[name] = run_bandit("quadratic", agent, steps=cfg.steps, seeds=cfg.seeds,
                                seed=EVAL_SEED_OFFSET + seed, env_options=env_opts,
                                agent_options={**common, "M": M})
    table = {n: {"regret": r.metrics["final_regret_mean"], "stderr": r.metrics["final_regret_stderr"],
                 "parameters": r.num_parameters, "ms_per_step": 1e3 * r.median_seconds_per_step}
             for n, r in runs.items()}
    result.numbers["settings"] = {**env_opts, "steps": cfg.steps, "seeds": cfg.seeds, **common}
    result.numbers["table"] = table

    epp, eplus, greedy = table["Ensemble++ M=8"], table["Ensemble+ M=8"], table["Greedy"]
    result.check("regret Ensemble++ M=8 vs Greedy", [round(epp["regret"], 1), round(greedy["regret"], 1)],
                 "Ensemble++ < Greedy", epp["regret"] < greedy["regret"])
    result.check("Ensemble++ M=8 vs Ensemble+ M=8: [regret, parameters]",
                 {"Ensemble++": [round(epp["regret"], 1), epp["parameters"]],
                  "Ensemble+": [round(eplus["regret"], 1), eplus["parameters"]]},
                 f"Ensemble++ regret <= {cfg.eplus_tolerance:g} x Ensemble+ regret, with fewer parameters",
                 epp["regret"] <= cfg.eplus_tolerance * eplus["regret"] and epp["parameters"] < eplus["parameters"])
    front_p = _pareto({n: (v["parameters"], v["regret"]) for n, v in table.items()})
    front_s = _pareto({n: (v["ms_per_step"], v["regret"]) for n, v in table.items()})
    result.numbers["pareto_parameters"] = sorted(front_p)
    result.numbers["pareto_seconds"] = sorted(front_s)
    result.check("regret-vs-parameters Pareto frontier", sorted(front_p), "contains Ensemble++ M=8",
                 "Ensemble++ M=8" in front_p)
    result.check("regret-vs-seconds Pareto frontier", sorted(front_s), "contains Ensemble++ M=8",
                 "Ensemble++ M=8" in front_s)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"Ensemble++": "C0", "Ensemble+": "C1", "EpiNet": "C2", "Greedy": "C3"}
    for name, r in runs.items():
        cum = r.cumulative
        mean, se = cum.mean(0), cum.std(0) / math.sqrt(max(cum.shape[0], 1))
        style = "-" if "M=8" in name or name == "Greedy" else ":"
        axes[0].plot(mean, style, color=colors[name.split(" ")[0]], label=name)
        axes[0].fill_between(range(len(mean)), mean - se, mean + se, alpha=0.15, color=colors[name.split(" ")[0]])
    axes[0].set_xlabel("round t")
    axes[0].set_ylabel("cumulative regret")
    axes[0].set_title(f"quadratic bandit d={cfg.d}, {cfg.seeds} seeds")
    axes[0].legend(fontsize=7)
    for ax, key, label in ((axes[1], "parameters", "parameters (trainable + prior)"),
                           (axes[2], "ms_per_step", "agent ms per round")):
        for name, v in table.items():
            ax.errorbar(v[key], v["regret"], yerr=v["stderr"], fmt="o", color=colors[name.split(" ")[0]])
            ax.annotate(name, (v[key], v["regret"]), fontsize=7, textcoords="offset points", xytext=(4, 4))
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel(f"regret at T={cfg.steps}")
        ax.set_title("regret vs compute")
    save_figure(fig, out_dir / "ensemble_neural.png", dpi=120)
    result.figures.append("ensemble_neural.png")
    result.notes = "; ".join(f"{n}: regret {v['regret']:.1f} ± {v['stderr']:.1f}, {v['parameters']} params, "
                             f"{v['ms_per_step']:.2f} ms/round" for n, v in table.items())
    return result
