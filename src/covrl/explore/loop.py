"""The agent loop: play an agent on an environment for T rounds and S seeds, recording per-round regret,
agent time per round and parameter count (and, optionally, the particles' covariance band over time).

Registry `AGENTS`: name -> factory(env, S, seed, **options) -> agent. Batched (linear) agents play all S seeds
at once on one S-seed environment; one-seed (neural) agents play seed s on the one-seed environment with
seed `seed + s`, which is the same instance (see `covrl.explore.envs`)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from covrl.explore.envs import BanditEnv, make_env
from covrl.explore.linear import EnsembleSampling, LinearEnsemblePP, LinearGreedy, LinearTS
from covrl.explore.neural import EnsemblePlus, EpiNet, Greedy, NeuralConfig, NeuralEnsemblePP
from covrl.explore.tracking import BandTracker

AGENT_SEED_OFFSET = 10_007  # agents draw from a stream distinct from the environment's


def _linear_kwargs(env: BanditEnv, options: dict) -> dict:
    kw = {"prior_var": env.prior_var, "noise_var": env.agent_noise_std ** 2}
    kw.update(options)
    return kw


AGENTS: dict[str, Callable[..., Any]] = {
    "ensemble++": lambda env, S, seed, **o: LinearEnsemblePP(env.d, seed=seed, batch=S, **_linear_kwargs(env, o)),
    "lints": lambda env, S, seed, **o: LinearTS(env.d, seed=seed, batch=S, **_linear_kwargs(env, o)),
    "ensemble-sampling": lambda env, S, seed, **o: EnsembleSampling(env.d, seed=seed, batch=S,
                                                                    **_linear_kwargs(env, o)),
    "linear-greedy": lambda env, S, seed, **o: LinearGreedy(env.d, seed=seed, batch=S, **_linear_kwargs(env, o)),
    "neural-ensemble++": lambda env, S, seed, **o: NeuralEnsemblePP(env.d, seed=seed, batch=1, **o),
    "ensemble+": lambda env, S, seed, **o: EnsemblePlus(env.d, seed=seed, batch=1, **o),
    "epinet": lambda env, S, seed, **o: EpiNet(env.d, seed=seed, batch=1, **o),
    "greedy": lambda env, S, seed, **o: Greedy(env.d, seed=seed, batch=1, **o),
}
BATCHED_AGENTS = {"ensemble++", "lints", "ensemble-sampling", "linear-greedy"}


@dataclass
class BanditResult:
    """regret [S, T] per round; seconds_per_step = agent time (act + update) per round per seed."""

    env: str
    agent: str
    regret: torch.Tensor
    seconds_total: float
    seconds_per_step: float
    num_parameters: int
    options: dict[str, Any] = field(default_factory=dict)
    band_steps: list[int] = field(default_factory=list)
    band_low: torch.Tensor | None = None  # [n_observed, S]
    band_high: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    agent_object: Any = None  # the (last) agent played, for save_agent; not serialised
    step_seconds: torch.Tensor | None = None  # agent time of each round [T] (summed over one-seed runs)

    @property
    def median_seconds_per_step(self) -> float:
        """Median over rounds of the agent time per round per seed (robust to a busy machine)."""
        if self.step_seconds is None:
            return self.seconds_per_step
        return float(self.step_seconds.median()) / self.regret.shape[0]

    @property
    def cumulative(self) -> torch.Tensor:
        """Cumulative regret [S, T]."""
        return self.regret.cumsum(dim=1)

    def to_json(self) -> dict[str, Any]:
        cum = self.cumulative
        out = {"env": self.env, "agent": self.agent, "options": self.options, "metrics": self.metrics,
               "seconds_per_step": self.seconds_per_step, "num_parameters": self.num_parameters,
               "cumulative_regret_mean": cum.mean(0).tolist(), "final_cumulative_regret": cum[:, -1].tolist()}
        if self.band_low is not None:
            out["band"] = {"steps": self.band_steps, "low_min": self.band_low.min(0).values.tolist(),
                           "high_max": self.band_high.max(0).values.tolist()}
        return out


def make_agent(name: str, env: BanditEnv, S: int, seed: int, **options) -> Any:
    """Build agent `name` for `env` (d, prior and noise taken from the environment unless overridden)."""
    if name not in AGENTS:
        raise ValueError(f"agent={name!r} is not known; allowed: {', '.join(AGENTS)}")
    return AGENTS[name](env, S, seed, **options)


def play(agent, env: BanditEnv, steps: int, *, tracker: BandTracker | None = None, track_every: int = 1,
         on_step: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `steps` rounds; returns (regret [S, steps], agent seconds per round [steps]). The tracker observes
    the particles' band at t = 0 and every `track_every` rounds (and at the last one)."""
    regret = torch.zeros(env.S, steps, dtype=torch.float64)
    step_seconds = torch.zeros(steps, dtype=torch.float64)
    if tracker is not None:
        tracker.observe(agent)
    for t in range(steps):
        arms = env.arms()
        t0 = time.perf_counter()
        index = agent.act(arms if getattr(agent, "batch", None) is not None else arms[0])
        seconds = time.perf_counter() - t0
        outcome = env.step(index)
        x, y = outcome.x, outcome.reward
        if getattr(agent, "batch", None) is None:
            x, y = x[0], y[0]
        t0 = time.perf_counter()
        agent.update(x, y)
        step_seconds[t] = seconds + time.perf_counter() - t0
        regret[:, t] = outcome.regret
        if tracker is not None and ((t + 1) % track_every == 0 or t + 1 == steps):
            tracker.observe(agent)
        if on_step is not None:
            on_step()
    return regret, step_seconds


def run_bandit(env: str, agent: str, *, steps: int, seeds: int, seed: int = 0,
               env_options: dict | None = None, agent_options: dict | None = None, track_band_every: int = 0,
               on_step: Callable[[], None] | None = None) -> BanditResult:
    """Play `agent` on `env` for `steps` rounds and `seeds` seeds (seed s uses environment seed `seed + s`).
    `on_step` is called once per round per seed-batch (a batched agent plays all seeds in one round)."""
    if steps < 1 or seeds < 1:
        raise ValueError(f"steps and seeds must be >= 1, got steps={steps}, seeds={seeds}")
    env_options, agent_options = dict(env_options or {}), dict(agent_options or {})
    track = track_band_every > 0
    if agent in BATCHED_AGENTS:
        e = make_env(env, S=seeds, seed=seed, **env_options)
        a = make_agent(agent, e, seeds, seed + AGENT_SEED_OFFSET, **agent_options)
        tracker = BandTracker() if track else None
        regret, step_seconds = play(a, e, steps, tracker=tracker, track_every=max(track_band_every, 1),
                                    on_step=on_step)
        seconds = float(step_seconds.sum())
        n_params = a.num_parameters()
        band = (tracker.steps, tracker.low, tracker.high) if tracker else ([], None, None)
        per_step = seconds / steps / seeds
    else:
        if track:
            raise ValueError(f"track_band_every needs a linear agent with particles, not {agent!r}")
        rows, step_seconds = [], torch.zeros(steps, dtype=torch.float64)
        for s in range(seeds):
            e = make_env(env, S=1, seed=seed + s, **env_options)
            a = make_agent(agent, e, 1, seed + s + AGENT_SEED_OFFSET, **agent_options)
            r, sec = play(a, e, steps, on_step=on_step)
            rows.append(r)
            step_seconds += sec
        seconds = float(step_seconds.sum())
        regret = torch.cat(rows)
        n_params = a.num_parameters()
        band = ([], None, None)
        per_step = seconds / steps / seeds
    cum = regret.cumsum(1)[:, -1]
    metrics = {"final_regret_mean": float(cum.mean()),
               "final_regret_stderr": float(cum.std() / math.sqrt(seeds)) if seeds > 1 else 0.0,
               "seconds_per_step": per_step, "num_parameters": float(n_params)}
    return BanditResult(env, agent, regret, seconds, per_step, n_params,
                        {"env": env_options, "agent": agent_options, "steps": steps, "seeds": seeds, "seed": seed},
                        band[0], band[1], band[2], metrics, a, step_seconds)


def agent_options_accepted(name: str) -> set[str]:
    """Option names agent `name` accepts (so a CLI can route --M etc. only where they apply)."""
    import inspect

    if name not in AGENTS:
        raise ValueError(f"agent={name!r} is not known; allowed: {', '.join(AGENTS)}")
    if name not in BATCHED_AGENTS:
        return set(NeuralConfig.model_fields)
    cls = {"ensemble++": LinearEnsemblePP, "lints": LinearTS, "ensemble-sampling": EnsembleSampling,
           "linear-greedy": LinearGreedy}[name]
    return {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "d", "seed", "batch")}


def write_results(results: list[BanditResult], out_dir: Path, title: str = "") -> tuple[Path, Path]:
    """Write `results.json` and `regret.png` (mean cumulative regret ± 1 standard error) into out_dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps([r.to_json() for r in results], indent=2))
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        cum = r.cumulative
        mean = cum.mean(0)
        se = cum.std(0) / math.sqrt(cum.shape[0]) if cum.shape[0] > 1 else torch.zeros_like(mean)
        label = r.agent + "".join(f" {k}={v}" for k, v in r.options.get("agent", {}).items())
        ts = torch.arange(1, cum.shape[1] + 1)
        ax.plot(ts, mean, label=label)
        ax.fill_between(ts, mean - se, mean + se, alpha=0.2)
    ax.set_xlabel("round t")
    ax.set_ylabel("cumulative regret")
    ax.set_title(title or (results[0].env if results else ""))
    ax.legend(fontsize=7)
    fig.tight_layout()
    png_path = out_dir / "regret.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path
