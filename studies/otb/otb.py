"""Reproduction `python -m studies otb` (docs/theory.md §7; Optimal Token Baseline, Li et al. 2026, arXiv 2602.07078).

Claims tested (docs/theory.md ¶10): OTB with N = 4 samples per prompt matches GRPO with N = 32, needs fewer generated tokens
to get there, and keeps gradient norms stable.

Setting (covrl's own Trainer, run plumbing and HF sampler, driven step by step): the tiny 2-layer Llama + char
tokenizer on one-digit addition after a short SFT warm-up (computed once per seed and loaded into every arm, so all
arms of a seed start from the same weights), the covariance loss, AdamW at a fixed lr. Arms:
  otb_n4    OTB advantages, N = 4       grpo_n4   GRPO, N = 4       rloo_n4   RLOO, N = 4
  grpo_n32  GRPO, N = 32 (same prompts per step, so 8× the rollouts per step)
Every arm runs until it has generated the same budget of response tokens (the data clock of docs/theory.md §9 in
tokens); sampled accuracy (temperature 1, `eval_samples` per prompt: the expected reward) on the distinct RL
prompts is evaluated at fixed token checkpoints. One-digit addition has 100 problems: 50 are held out and the tiny
model does not generalise to them from the other 50, so the RL objective's own prompts measure progress; held-out
greedy accuracy is reported at the start and the end.

Target accuracy, fixed before looking at the arms and paired by seed: grpo_n32's final accuracy on that seed
("N = 32 performance"). Tokens to target = generated tokens at the first checkpoint whose accuracy reaches the
seed's target (None if never; grpo_n32 reaches its own target by the end at the latest). Token saving of an arm on a
seed = 1 − its tokens to target / grpo_n32's tokens to target (checkpoints are `token_budget / checkpoints` apart,
so savings are resolved to that grid). Gradient-norm stability per run: std, max and coefficient of variation (std/mean) of the
pre-clipping grad norm over the steps and the number of spikes (grad norm > `SPIKE_FACTOR` × the median of the
previous `SPIKE_WINDOW` non-zero norms). GRPO divides advantages by the group std and OTB/RLOO do not, so absolute
norms and proxies differ in scale between estimators; the coefficient of variation, the spike count and the
noise-to-signal ratio B_simple = tr Σ / |G|² are the scale-free comparisons.
Variance proxies (docs/theory.md §7) from the trainer's metrics: adv/var_power = mean_b Â_b²·max(Ŵ_b, 0) and
adv/var_proxy_mean = mean_b Ŵ_b (forward-only, logit units), plus the gradient noise tr Σ, |G|² and B_simple in
parameter units (covrl.diagnostics.noise, from the step's micro-batches).

Cost of OTB over GRPO per step: `Trainer.step` with each advantage on the same batch from the same weights,
alternated `timing_repeats` times, median wall and CPU (thread) time.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studies.common import pyplot, save_figure, start_repro
from studies.lr_surge.lr_surge import distinct_prompts, sampled_accuracy

from covrl.config import load_preset
from covrl.experiment import DRIVEN, ONE_DIGIT_ADDITION, Arm, ArmRunner, Step, pick
from covrl.train import Trainer, evaluate
from studies import stats

CLAIM = ("OTB with N = 4 matches GRPO with N = 32, reaches that accuracy with fewer generated tokens (the seed "
         "claims 62–66% fewer), and keeps gradient norms stable.")

SPIKE_FACTOR = 3.0
SPIKE_WINDOW = 5

# arm name -> (advantage estimator, group size N)
ARMS: dict[str, tuple[str, int]] = {
    "otb_n4": ("otb", 4),
    "grpo_n4": ("grpo", 4),
    "rloo_n4": ("rloo", 4),
    "grpo_n32": ("grpo", 32),
}
REFERENCE_ARM = "grpo_n32"


@dataclass(frozen=True)
class Settings:
    seeds: int
    token_budget: int         # generated response tokens per run (every arm)
    checkpoints: int          # accuracy evaluations, evenly spaced in tokens (plus one before RL)
    prompts_per_step: int
    lr: float
    sft_steps: int
    max_new_tokens: int
    eval_prompts: int
    eval_samples: int         # samples per distinct RL prompt for the accuracy curve
    timing_repeats: int
    timing_rows: int          # rows of the batch used for the Trainer.step timing


FAST = Settings(seeds=1, token_budget=400, checkpoints=2, prompts_per_step=4, lr=1e-3, sft_steps=10,
                max_new_tokens=6, eval_prompts=8, eval_samples=2, timing_repeats=2, timing_rows=32)
FULL = Settings(seeds=3, token_budget=9_000, checkpoints=6, prompts_per_step=8, lr=3e-4, sft_steps=60,
                max_new_tokens=8, eval_prompts=50, eval_samples=4, timing_repeats=15, timing_rows=256)


def otb_config(arm: str, *, seed: int, s: Settings, sft_steps: int | None = None, steps: int = 1):
    """TrainConfig of one arm: the tiny preset on one-digit addition, covariance loss, the arm's advantage and N;
    the sampler shares the trainer's weights."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {sorted(ARMS)}, got {arm!r}")
    advantage, n = ARMS[arm]
    return load_preset("tiny", {
        **ONE_DIGIT_ADDITION, **DRIVEN, "logging.diagnostics": False,
        "run.name": f"{arm}-seed{seed}", "run.seed": seed,
        "sampler.max_new_tokens": s.max_new_tokens, "sampler.max_batch": 512, "sampler.share_weights": "always",
        "sft_warmup.steps": s.sft_steps if sft_steps is None else sft_steps,
        "algorithm.advantage": advantage, "optim.lr": s.lr, "optim.micro_batch_size": 512,
        "loop.steps": max(1, steps), "loop.prompts_per_step": s.prompts_per_step, "loop.group_size": n,
    })


_KEYS = ("reward/mean", "accuracy", "response/length_mean", "response_tokens", "grad_norm", "entropy",
         "adv/var_power", "adv/var_proxy_mean", "adv/std", "adv/frac_zero_std_groups", "noise/power",
         "noise/signal", "noise/noise", "noise/trace_sigma", "noise/grad_sq", "noise/b_simple", "mismatch/k3",
         "skipped", "time/trainer_step")


def _run_arm(arm: str, *, seed: int, s: Settings, init_state: dict | None, run_root: Path, cfg=None,
             keys=None) -> dict[str, Any]:
    """One arm until `s.token_budget` response tokens are generated; evaluations at evenly spaced token
    checkpoints. Returns per-step records, the eval curve and the starting (SFT'd) weights. `cfg` replaces
    `otb_config(arm, ...)` (another preset or task: studies.otb.otb_long); `keys` the recorded metric keys."""
    if cfg is None:  # loop.steps only bounds the data clock; the budget stops the run
        cfg = otb_config(arm, seed=seed, s=s, sft_steps=0 if init_state is not None else None,
                         steps=s.token_budget)
    with ArmRunner(Arm(cfg, run_root / f"{arm}-seed{seed}", init_state=init_state)) as runner:
        run = runner.run
        start_state = runner.weights()
        # one-digit addition has 100 problems: 50 held out, the other 50 are the RL prompts. The tiny model does
        # not generalise from 50 problems, so progress is measured on the RL prompts themselves (greedy, distinct)
        # and held-out accuracy is reported at the start and the end only.
        distinct = distinct_prompts(run.task.train, s.eval_prompts)
        examples_eval = run.task.eval[: s.eval_prompts]

        def greedy_accuracy(examples) -> float:
            return float(evaluate(run.sampler, run.task, run.tokenizer, examples, seed=seed + 17,
                                  sampled=False)["greedy"]["accuracy"])

        def rl_prompt_accuracy() -> float:
            return sampled_accuracy(run, distinct, s.eval_samples, seed=seed + 29)

        held_out_start = greedy_accuracy(examples_eval)
        marks = [s.token_budget * (i + 1) / s.checkpoints for i in range(s.checkpoints)]
        curve = [(0, rl_prompt_accuracy())]
        tokens = 0

        def record(step: Step) -> dict:
            nonlocal tokens
            tokens += step.response_tokens
            return {"step": step.index, "tokens": tokens, **pick(step.metrics, keys or _KEYS)}

        def evaluate_at_marks(step: Step, rec: dict) -> bool:
            while marks and tokens >= marks[0]:
                marks.pop(0)
                curve.append((tokens, rl_prompt_accuracy()))
            return tokens >= s.token_budget

        records = runner.drive(record=record, after_step=evaluate_at_marks)
        held_out_end = greedy_accuracy(examples_eval)
    return {"records": records, "curve": curve, "start_state": start_state, "held_out": [held_out_start, held_out_end],
            "train_prompts": len(distinct)}


def grad_norm_stability(norms: list[float]) -> dict[str, float]:
    """std, max, mean, coefficient of variation (std/mean, scale-free) of the grad norms and spikes: steps whose norm exceeds SPIKE_FACTOR × the median of the
    previous SPIKE_WINDOW non-zero norms (zero norms = all groups without reward contrast are skipped)."""
    spikes, history = 0, []
    for g in norms:
        if history and g > SPIKE_FACTOR * statistics.median(history[-SPIKE_WINDOW:]):
            spikes += 1
        if g > 0:
            history.append(g)
    finite = [g for g in norms if math.isfinite(g)]
    mean = statistics.fmean(finite) if finite else float("nan")
    std = statistics.pstdev(finite) if len(finite) > 1 else 0.0
    return {"grad_norm_mean": mean, "grad_norm_std": std, "grad_norm_cv": std / mean if mean > 0 else float("nan"),
            "grad_norm_max": max(finite) if finite else float("nan"), "spikes": float(spikes),
            "zero_grad_steps": float(sum(1 for g in norms if g == 0))}


def tokens_to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    """Generated tokens at the first checkpoint whose accuracy is >= target (None if none is)."""
    for tokens, acc in curve:
        if acc >= target - 1e-9:
            return tokens
    return None


def step_cost(s: Settings, *, seed: int, init_state: dict, run_root: Path) -> dict[str, float]:
    """Median wall and CPU time of Trainer.step with OTB and with GRPO on the same batch (s.timing_rows rows,
    N = 4) from the same weights, alternating the two; the weights are restored before every step."""
    n = 4
    cfg = otb_config("otb_n4", seed=seed, s=s, sft_steps=0)
    cfg.loop.prompts_per_step = max(1, s.timing_rows // n)
    assert cfg.loop.group_size == n
    with ArmRunner(Arm(cfg, run_root / "timing", init_state=init_state)) as runner:
        batch, _ = runner.next_batch()
        model = runner.run.model
    state = {k: v.detach().clone() for k, v in init_state.items()}
    trainers = {}
    for name in ("otb", "grpo"):
        c = cfg.model_copy(deep=True)
        c.algorithm.advantage = name
        trainers[name] = Trainer(model, c)
    wall: dict[str, list[float]] = {"otb": [], "grpo": []}
    cpu: dict[str, list[float]] = {"otb": [], "grpo": []}
    for _ in range(s.timing_repeats + 1):  # the first round warms up allocators and caches
        for name, trainer in trainers.items():
            model.load_state_dict(state)
            t0, c0 = time.perf_counter(), time.thread_time()
            trainer.step(batch)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
    med = {f"{k}_{name}": statistics.median(v[1:]) for k, d in (("wall", wall), ("cpu", cpu)) for name, v in d.items()}
    return {**med, "rows": float(len(batch)), "tokens": float(batch.response_mask.sum()),
            "repeats": float(s.timing_repeats),
            "cpu_ratio_otb_over_grpo": med["cpu_otb"] / med["cpu_grpo"],
            "wall_ratio_otb_over_grpo": med["wall_otb"] / med["wall_grpo"]}


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):
    s = FAST if fast else FULL
    result = start_repro("otb", CLAIM, out_dir)
    t0, c0 = time.perf_counter(), time.process_time()
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="covrl-otb-") as tmp:
        first_state = None
        for k in range(s.seeds):
            init_state = None
            for arm in ARMS:
                out = _run_arm(arm, seed=seed + k, s=s, init_state=init_state, run_root=Path(tmp))
                init_state = out.pop("start_state")
                out["seed"] = seed + k
                runs[arm].append(out)
            if first_state is None:
                first_state = init_state
        result.numbers["seconds_wall_training"] = time.perf_counter() - t0
        result.numbers["seconds_cpu_training"] = time.process_time() - c0
        cost = step_cost(s, seed=seed, init_state=first_state, run_root=Path(tmp))
    result.numbers["seconds_wall"] = time.perf_counter() - t0
    result.numbers["seconds_cpu"] = time.process_time() - c0
    _summarise(result, runs, s, cost)
    result.figures.append(_figure(out_dir, runs, s, result.numbers["target_accuracy"]))
    result.notes = _notes(s)
    return result


def _summarise(result, runs: dict[str, list[dict]], s: Settings, cost: dict[str, float]) -> None:
    targets = {r["seed"]: r["curve"][-1][1] for r in runs[REFERENCE_ARM]}
    reference_tokens = {r["seed"]: tokens_to_target(r["curve"], targets[r["seed"]]) for r in runs[REFERENCE_ARM]}
    target = statistics.fmean(targets.values())
    per_arm: dict[str, Any] = {}
    for arm in ARMS:
        rows = []
        for r in runs[arm]:
            recs = r["records"]
            stab = grad_norm_stability([rec.get("grad_norm", 0.0) for rec in recs])
            rows.append({
                "seed": r["seed"], "steps": len(recs), "tokens": recs[-1]["tokens"],
                "rollouts": len(recs) * s.prompts_per_step * ARMS[arm][1],
                "eval_start": r["curve"][0][1], "eval_final": r["curve"][-1][1],
                "eval_best": max(a for _, a in r["curve"]),
                "eval_curve": [list(point) for point in r["curve"]],
                "target": targets[r["seed"]],
                "tokens_to_target": tokens_to_target(r["curve"], targets[r["seed"]]),
                "token_saving_vs_grpo_n32": _saving(tokens_to_target(r["curve"], targets[r["seed"]]),
                                                    reference_tokens[r["seed"]]),
                **stab,
                "var_power_mean": stats.mean(rec.get("adv/var_power") for rec in recs),
                "var_proxy_mean": stats.mean(rec.get("adv/var_proxy_mean") for rec in recs),
                "trace_sigma_mean": stats.mean(rec.get("noise/trace_sigma") for rec in recs),
                "trace_sigma_median": stats.median(rec.get("noise/trace_sigma") for rec in recs),
                "b_simple_median": stats.median(rec.get("noise/b_simple") for rec in recs),
                "held_out_start": r["held_out"][0], "held_out_end": r["held_out"][1],
                "reward_last5": stats.mean(rec["reward/mean"] for rec in recs[-5:]),
                "trainer_step_s_mean": stats.mean(rec.get("time/trainer_step") for rec in recs),
            })
        reached = [x["tokens_to_target"] for x in rows]
        per_arm[arm] = {
            "eval_final_mean": stats.mean(x["eval_final"] for x in rows),
            "eval_final": [x["eval_final"] for x in rows],
            "eval_start": [x["eval_start"] for x in rows],
            "tokens_to_target": reached,
            "reached_target": sum(x is not None for x in reached),
            "tokens_to_target_mean_of_reached": stats.mean(x for x in reached if x is not None),
            "token_saving_vs_grpo_n32": [x["token_saving_vs_grpo_n32"] for x in rows],
            "token_saving_mean": stats.mean(x["token_saving_vs_grpo_n32"] for x in rows),
            "grad_norm_std_mean": stats.mean(x["grad_norm_std"] for x in rows),
            "grad_norm_cv_mean": stats.mean(x["grad_norm_cv"] for x in rows),
            "b_simple_median_mean": stats.mean(x["b_simple_median"] for x in rows),
            "held_out_start": [x["held_out_start"] for x in rows],
            "held_out_end": [x["held_out_end"] for x in rows],
            "reward_last5_mean": stats.mean(x["reward_last5"] for x in rows),
            "grad_norm_max_max": max(x["grad_norm_max"] for x in rows),
            "spikes_total": sum(x["spikes"] for x in rows),
            "var_power_mean": stats.mean(x["var_power_mean"] for x in rows),
            "trace_sigma_median": stats.mean(x["trace_sigma_median"] for x in rows),
            "steps": [x["steps"] for x in rows],
            "per_seed": rows,
        }
    result.numbers["target_accuracy"] = target
    result.numbers["target_accuracy_per_seed"] = {str(k): v for k, v in targets.items()}
    result.numbers["per_arm"] = per_arm
    result.numbers["step_cost_otb_vs_grpo"] = cost
    result.numbers["settings"] = {**s.__dict__, "arms": {k: list(v) for k, v in ARMS.items()},
                                  "spike_rule": f"grad norm > {SPIKE_FACTOR} x median of the previous "
                                                f"{SPIKE_WINDOW} non-zero norms"}
    finite = all(math.isfinite(rec.get(k, 0.0)) for arm in ARMS for r in runs[arm] for rec in r["records"]
                 for k in ("grad_norm", "reward/mean", "adv/var_power"))
    budget_ok = all(r["records"][-1]["tokens"] >= s.token_budget for arm in ARMS for r in runs[arm])
    result.check("every run consumed the token budget; grad norms, rewards and variance proxies finite",
                 {"budget_reached": budget_ok, "finite": finite}, "both true", budget_ok and finite)
    timing_ok = all(math.isfinite(v) and v > 0 for v in cost.values())
    result.check("Trainer.step cost of OTB over GRPO on the same batch (median CPU-time ratio)",
                 cost["cpu_ratio_otb_over_grpo"], "measured (finite, > 0); the seed says 'computationally free'",
                 timing_ok)
    if s is FAST:
        return
    otb, g4, g32 = per_arm["otb_n4"], per_arm["grpo_n4"], per_arm[REFERENCE_ARM]
    result.check("OTB N=4 matches GRPO N=32: mean final sampled accuracy on the RL prompts, otb_n4 − grpo_n32",
                 otb["eval_final_mean"] - g32["eval_final_mean"], "≥ −0.05 (within 5 points or better)",
                 otb["eval_final_mean"] - g32["eval_final_mean"] >= -0.05)
    savings = otb["token_saving_vs_grpo_n32"]
    all_reached = all(x is not None for x in savings)
    result.check("fewer tokens: per seed 1 − tokens_to_target(otb_n4) / tokens_to_target(grpo_n32), target = "
                 "grpo_n32's final accuracy on that seed (per seed; mean)", {"per_seed": savings,
                 "mean": otb["token_saving_mean"]}, "every seed reaches the target and mean > 0 (the seed claims "
                 "0.62–0.66)", all_reached and otb["token_saving_mean"] > 0)
    result.check("stable gradient norms: spikes (all seeds) and mean coefficient of variation std/mean of the grad "
                 "norm (scale-free: GRPO divides by the group std, OTB does not), otb_n4 vs grpo_n4",
                 {"otb_n4": [otb["spikes_total"], otb["grad_norm_cv_mean"]],
                  "grpo_n4": [g4["spikes_total"], g4["grad_norm_cv_mean"]]},
                 "otb spikes ≤ grpo_n4 spikes and otb cv ≤ grpo_n4 cv",
                 otb["spikes_total"] <= g4["spikes_total"] and otb["grad_norm_cv_mean"] <= g4["grad_norm_cv_mean"])


def _saving(tokens: int | None, reference: int | None) -> float | None:
    """1 − tokens / reference (None when either is missing or the reference is 0)."""
    if tokens is None or reference is None or reference <= 0:
        return None
    return 1.0 - tokens / reference


def _figure(out_dir: Path, runs: dict[str, list[dict]], s: Settings, target: float) -> str:
    plt = pyplot()
    colors = {"otb_n4": "tab:blue", "grpo_n4": "tab:orange", "rloo_n4": "tab:green", "grpo_n32": "tab:red"}
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.3))
    for arm in ARMS:
        for i, r in enumerate(runs[arm]):
            label = arm if i == 0 else None
            xs, ys = zip(*r["curve"])
            axes[0].plot(xs, ys, "-o", ms=3, color=colors[arm], alpha=0.7, label=label)
            recs = r["records"]
            axes[1].plot([x["tokens"] for x in recs], [x.get("grad_norm", 0.0) for x in recs], color=colors[arm],
                         alpha=0.6, lw=1, label=label)
            axes[2].plot([x["tokens"] for x in recs], [max(x.get("adv/var_power", 0.0), 1e-12) for x in recs],
                         color=colors[arm], alpha=0.6, lw=1, label=label)
            ts = [(x["tokens"], x["noise/trace_sigma"]) for x in recs if "noise/trace_sigma" in x
                  and math.isfinite(x["noise/trace_sigma"])]
            if ts:
                axes[3].plot([t for t, _ in ts], [max(v, 1e-12) for _, v in ts], color=colors[arm], alpha=0.6,
                             lw=1, label=label)
    axes[0].axhline(target, color="gray", ls=":", label="grpo_n32 final accuracy (mean over seeds)")
    axes[0].set_ylabel("sampled accuracy on the RL prompts")
    axes[1].set_ylabel("grad norm (pre-clipping)")
    axes[2].set_ylabel("variance proxy mean_b Â²·Ŵ")
    axes[2].set_yscale("log")
    axes[3].set_ylabel("gradient noise tr Σ (two half-batches)")
    axes[3].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("generated response tokens")
        ax.legend(fontsize=7)
    fig.suptitle(f"OTB vs GRPO vs RLOO at a budget of {s.token_budget} generated tokens, {s.seeds} seed(s)")
    return save_figure(fig, out_dir / "otb.png", dpi=100)


def _notes(s: Settings) -> str:
    return (f"{s.seeds} seed(s); token budget {s.token_budget} per run; {s.prompts_per_step} prompts per step for "
            f"every arm (N = 32 makes 8x the rollouts per step, so it takes ~1/8 of the steps); lr {s.lr:g} AdamW, "
            f"clip 1.0, covariance loss, token-mean; SFT warm-up {s.sft_steps} steps shared by all arms of a seed; "
            f"sampled accuracy ({s.eval_samples} samples per prompt) on the distinct RL prompts (≤ {s.eval_prompts}) at "
            f"{s.checkpoints} token checkpoints (the tiny model does not generalise to the 50 held-out problems; "
            f"held-out greedy accuracy is reported at the start and end).")
