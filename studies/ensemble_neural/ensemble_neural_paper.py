"""Reproduction `python -m studies ensemble-neural-paper` (docs/theory.md ¶6, design B of studies/ensemble_neural/README.md):
neural Ensemble++ against Ensemble+, EpiNet and Greedy at the paper's scale, with the same tuning budget for
every agent.

Setup (the paper's `quadratic` game): f(x) = xᵀΘΘᵀx / d, d = 100, a pool of 1000 unit-vector arms of which 50
are offered per round, noise 0.1; every agent a 2×64 ReLU MLP, Adam lr 1e-4, batch 128, weight decay 0.01, FIFO
buffer 10 000, no update before 128 data, 4 Adam steps per round, σ_p = 0.01, M = 8; T = 500 (the CPU budget).
Tuning: each agent's prior scale is chosen from the same grid on the same tuning instances (lowest mean final
regret); Greedy has no prior. Evaluation: 20 common instances. Statistic: final cumulative regret (mean ± s.e.),
paired differences Δ = regret(Ensemble++) − regret(other) with 95% bootstrap CIs.
Criteria (pre-registered): R1 Ensemble++ on the regret–parameter Pareto frontier; R2/R3 Δ vs EpiNet / Ensemble+
has mean ≤ 0 or a CI containing 0.

Every finished agent-seed run is appended to `jobs.jsonl` in the output folder and skipped when the folder is
reused, so an interrupted run resumes and `analyse` can report a partial one.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from studies.common import ReproResult, pyplot, save_figure
from studies.ensemble_neural.ensemble_neural import LABELS, _pareto

from covrl.explore.loop import run_bandit

CLAIM = ("At the paper's scale (d = 100 quadratic bandit, its networks and optimiser) and with the same tuning "
         "budget for every agent, neural Ensemble++ is on the regret-parameter frontier and has no more regret "
         "than EpiNet and Ensemble+.")

AGENTS = ("neural-ensemble++", "ensemble+", "epinet", "greedy")
REFERENCE = "neural-ensemble++"
# agent-specific options of the paper (`scripts/run_nonlinear.py`, `network/epinet.py`)
AGENT_EXTRA: dict[str, dict[str, Any]] = {"epinet": {"epi_hidden_sizes": (15,), "n_index_samples": 16}}


@dataclass(frozen=True)
class Settings:
    d: int = 100
    n_actions: int = 1000
    n_offered: int = 50
    noise_std: float = 0.1
    steps: int = 500
    hidden: tuple[int, ...] = (64, 64)
    lr: float = 1e-4
    batch_size: int = 128
    weight_decay: float = 0.01
    buffer_size: int = 10_000
    update_start: int = 128
    sgd_steps: int = 4
    noise_scale: float = 0.01
    M: int = 8
    prior_grid: tuple[float, ...] = (1.0, 3.0, 10.0)
    tune_seeds: tuple[int, ...] = (3000, 3001, 3002)
    eval_seeds: tuple[int, ...] = tuple(range(2000, 2020))
    workers: int = 2
    bootstrap: int = 10_000
    curve_every: int = 10


FULL = Settings()
FAST = Settings(d=4, n_actions=100, n_offered=10, steps=60, hidden=(16, 16), batch_size=16, update_start=16,
                sgd_steps=1, prior_grid=(1.0, 3.0), tune_seeds=(3000,), eval_seeds=(2000, 2001), workers=1,
                bootstrap=200)


def label(agent: str) -> str:
    return LABELS[agent] + ("" if agent == "greedy" else " M=8")


def agent_options(cfg: Settings, agent: str, prior_scale: float) -> dict[str, Any]:
    return {"hidden_sizes": cfg.hidden, "lr": cfg.lr, "batch_size": cfg.batch_size,
            "weight_decay": cfg.weight_decay, "buffer_size": cfg.buffer_size, "update_start": cfg.update_start,
            "sgd_steps": cfg.sgd_steps, "noise_scale": cfg.noise_scale, "M": cfg.M, "prior_scale": prior_scale,
            **AGENT_EXTRA.get(agent, {})}


def _key(phase: str, agent: str, prior_scale: float, env_seed: int) -> str:
    return f"{phase}/{agent}/{prior_scale:g}/{env_seed}"


def play_one(cfg: Settings, phase: str, agent: str, prior_scale: float, env_seed: int) -> dict[str, Any]:
    """One agent on one instance; returns the record appended to jobs.jsonl."""
    import torch

    torch.set_num_threads(1)
    t0 = time.process_time()
    r = run_bandit("quadratic", agent, steps=cfg.steps, seeds=1, seed=env_seed,
                   env_options={"d": cfg.d, "n_actions": cfg.n_actions, "n_offered": cfg.n_offered,
                                "noise_std": cfg.noise_std},
                   agent_options=agent_options(cfg, agent, prior_scale))
    cum = r.cumulative[0]
    return {"key": _key(phase, agent, prior_scale, env_seed), "phase": phase, "agent": agent,
            "prior_scale": prior_scale, "env_seed": env_seed, "final_regret": float(cum[-1]),
            "curve": [float(c) for c in cum[cfg.curve_every - 1::cfg.curve_every]],
            "parameters": r.num_parameters, "ms_per_round": 1e3 * r.median_seconds_per_step,
            "cpu_seconds": time.process_time() - t0}


def _load(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    return {rec["key"]: rec for rec in map(json.loads, path.read_text().splitlines()) if rec}


def _execute(cfg: Settings, jobs: list[tuple[str, str, float, int]], path: Path, log=print) -> None:
    """Run the jobs not yet in `path` (on cfg.workers processes), appending each record as it finishes."""
    done = _load(path)
    todo = [j for j in jobs if _key(*j) not in done]
    if not todo:
        return
    with path.open("a") as f:
        def record(rec):
            f.write(json.dumps(rec) + "\n")
            f.flush()
            log(f"{rec['key']}: regret {rec['final_regret']:.1f}, {rec['ms_per_round']:.1f} ms/round, "
                f"{rec['cpu_seconds']:.0f} s CPU")

        if cfg.workers <= 1:
            for job in todo:
                record(play_one(cfg, *job))
            return
        import multiprocessing

        with ProcessPoolExecutor(cfg.workers, mp_context=multiprocessing.get_context("fork")) as pool:
            for fut in as_completed([pool.submit(play_one, cfg, *job) for job in todo]):
                record(fut.result())


def tuning_jobs(cfg: Settings) -> list[tuple[str, str, float, int]]:
    return [("tune", a, p, s) for a in AGENTS if a != "greedy" for p in cfg.prior_grid for s in cfg.tune_seeds]


def tuned_scales(cfg: Settings, records: dict[str, dict[str, Any]]) -> tuple[dict[str, float], dict]:
    """Per agent, the grid value with the lowest mean tuning regret (ties: the smaller); Greedy: 0."""
    best, grid = {"greedy": 0.0}, {}
    for a in AGENTS:
        if a == "greedy":
            continue
        means = {}
        for p in cfg.prior_grid:
            vals = [records[k]["final_regret"] for s in cfg.tune_seeds if (k := _key("tune", a, p, s)) in records]
            if len(vals) == len(cfg.tune_seeds):
                means[p] = sum(vals) / len(vals)
        grid[label(a)] = {f"{p:g}": round(m, 1) for p, m in means.items()}
        if means:
            best[a] = min(sorted(means), key=lambda p: means[p])
    return best, grid


def bootstrap_ci(diffs, n: int, seed: int = 0) -> tuple[float, float]:
    import numpy as np

    d = np.asarray(diffs, dtype=float)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(n, len(d)))].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def analyse(cfg: Settings, out_dir: Path, *, name: str = "ensemble-neural-paper") -> ReproResult:
    """Table, paired differences, criteria and figure from the records in out_dir/jobs.jsonl (those present)."""
    import statistics

    records = _load(out_dir / "jobs.jsonl")
    scales, grid = tuned_scales(cfg, records)
    result = ReproResult(name=name, claim=CLAIM)
    result.numbers["settings"] = {k: v for k, v in asdict(cfg).items() if k != "eval_seeds"} | {
        "eval_seeds": [cfg.eval_seeds[0], cfg.eval_seeds[-1]]}
    result.numbers["tuning_mean_regret"] = grid
    per_agent: dict[str, dict[int, dict[str, Any]]] = {}
    for a in AGENTS:
        if a not in scales:
            continue
        per_agent[a] = {s: records[k] for s in cfg.eval_seeds if (k := _key("eval", a, scales[a], s)) in records}
    table = {}
    for a, recs in per_agent.items():
        if not recs:
            continue
        vals = [r["final_regret"] for r in recs.values()]
        se = statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else 0.0
        table[label(a)] = {"prior_scale": scales[a], "regret": sum(vals) / len(vals), "stderr": se,
                           "seeds": len(vals), "parameters": next(iter(recs.values()))["parameters"],
                           "ms_per_step": statistics.median(r["ms_per_round"] for r in recs.values())}
    result.numbers["table"] = table
    complete = all(v["seeds"] == len(cfg.eval_seeds) for v in table.values()) and len(table) == len(AGENTS)
    result.numbers["complete"] = complete
    paired = {}
    ref = per_agent.get(REFERENCE, {})
    for a in AGENTS:
        if a == REFERENCE or a not in per_agent:
            continue
        common = sorted(set(ref) & set(per_agent[a]))
        if len(common) < 2:
            continue
        diffs = [ref[s]["final_regret"] - per_agent[a][s]["final_regret"] for s in common]
        lo, hi = bootstrap_ci(diffs, cfg.bootstrap)
        paired[label(a)] = {"mean": sum(diffs) / len(diffs), "ci95": [lo, hi], "seeds": len(common)}
    result.numbers["paired_ensemblepp_minus_other"] = paired
    if len(table) < 2:
        result.notes = "no evaluation records yet"
        return result

    epp = label(REFERENCE)
    front_p = _pareto({n: (v["parameters"], v["regret"]) for n, v in table.items()})
    front_s = _pareto({n: (v["ms_per_step"], v["regret"]) for n, v in table.items()})
    result.numbers["pareto_parameters"] = sorted(front_p)
    result.numbers["pareto_seconds"] = sorted(front_s)
    tag = "" if complete else " (PARTIAL)"
    result.check("R1 regret-vs-parameters Pareto frontier" + tag, sorted(front_p), f"contains {epp}",
                 epp in front_p)
    for other, rule in (("EpiNet M=8", "R2"), ("Ensemble+ M=8", "R3")):
        if other in paired:
            d = paired[other]
            ok = d["mean"] <= 0 or d["ci95"][0] <= 0 <= d["ci95"][1]
            result.check(f"{rule} paired regret {epp} - {other}{tag}",
                         {"mean": round(d["mean"], 1), "ci95": [round(c, 1) for c in d["ci95"]], "n": d["seeds"]},
                         "mean <= 0 or 95% CI contains 0", ok)

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"Ensemble++": "C0", "Ensemble+": "C1", "EpiNet": "C2", "Greedy": "C3"}
    for a, recs in per_agent.items():
        if not recs:
            continue
        curves = [r["curve"] for r in recs.values()]
        n = len(curves)
        ts = [cfg.curve_every * (i + 1) for i in range(len(curves[0]))]
        mean = [sum(c[i] for c in curves) / n for i in range(len(ts))]
        se = [statistics.stdev(c[i] for c in curves) / math.sqrt(n) if n > 1 else 0.0 for i in range(len(ts))]
        col = colors[LABELS[a]]
        axes[0].plot(ts, mean, color=col, label=f"{label(a)} (p={scales[a]:g})")
        axes[0].fill_between(ts, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)], alpha=0.15,
                             color=col)
    axes[0].set_xlabel("round t")
    axes[0].set_ylabel("cumulative regret")
    n_seeds = min(v["seeds"] for v in table.values())
    axes[0].set_title(f"quadratic bandit d={cfg.d}, {n_seeds} seeds{tag}")
    axes[0].legend(fontsize=7)
    for ax, key, xlabel, front in ((axes[1], "parameters", "parameters (trainable + prior)", front_p),
                                   (axes[2], "ms_per_step", "agent ms per round (median)", front_s)):
        for n, v in table.items():
            ax.errorbar(v[key], v["regret"], yerr=v["stderr"], fmt="o", color=colors[n.split(" ")[0]])
            ax.annotate(n, (v[key], v["regret"]), fontsize=7, textcoords="offset points", xytext=(4, 4))
        pts = sorted((table[n][key], table[n]["regret"]) for n in front)
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="k", alpha=0.4, lw=1,
                label="Pareto frontier")
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"regret at T={cfg.steps}")
        ax.legend(fontsize=7)
    axes[1].set_title("regret vs parameters")
    axes[2].set_title("regret vs compute")
    save_figure(fig, out_dir / f"{name}.png", dpi=120)
    result.figures.append(f"{name}.png")
    result.notes = "; ".join(f"{n}: p={v['prior_scale']:g}, regret {v['regret']:.1f} ± {v['stderr']:.1f} "
                             f"({v['seeds']} seeds), {v['parameters']} params, {v['ms_per_step']:.2f} ms/round"
                             for n, v in table.items())
    return result


def run(out_dir: Path, *, fast: bool = False, seed: int = 0, log=print) -> ReproResult:
    """Tune (the same grid and instances for every agent), then evaluate; `seed` shifts every instance."""
    cfg = FAST if fast else FULL
    if seed:
        cfg = Settings(**{**asdict(cfg), "tune_seeds": tuple(s + seed for s in cfg.tune_seeds),
                          "eval_seeds": tuple(s + seed for s in cfg.eval_seeds)})
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "jobs.jsonl"
    _execute(cfg, tuning_jobs(cfg), path, log)
    scales, _ = tuned_scales(cfg, _load(path))
    log(f"tuned prior scales: {scales}")
    _execute(cfg, [("eval", a, scales[a], s) for s in cfg.eval_seeds for a in AGENTS], path, log)
    return analyse(cfg, out_dir)
