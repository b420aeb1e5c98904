"""Reproduction `python -m studies async-momentum` (seed ¶7 at AdamW's default β1 = 0.9; studies/async_gap/README.md §4).

Design B of the async-gap study, pre-registered before its runs: does a step size that follows the optimizer keep
the sampler–trainer gap fixed as the batch B grows (queue Q fixed in rollouts) when Adam has momentum? Two arms:

- `adam_sqrt`: the plain square-root rule, lr ∝ √B (the claim's rule; established at β1 = 0 in design A);
- `adam_sqrt_momentum`: the rule derived for noise-driven drift with momentum,
  lr ∝ √B · sqrt(r(Q/B0) / r(Q/B)) (`covrl.train.step.batch_scaling`, `momentum_drift_factor`).

Sections: §1's toy with an exact gap (β1 = 0.9, Q = 512 and 4096) and §2's tiny transformer (same warm-up,
burn-in, Q = 256, B = 8/32/128, 16 paired seeds) with AdamW β1 = 0.9. Pass rule per arm: both ratios
gap(4B)/gap(B), gap(16B)/gap(B) within 1 ± 0.25. The `--fast` variant is a smoke test of the same machinery
(2 seeds, 4× B only, short runs): its ratios are not a verdict.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from studies.async_gap.async_gap import (
    TINY_FAST,
    TINY_FULL,
    TOY_FAST,
    TOY_FULL,
    ToySettings,
    ratio_checks,
    tiny_base,
    tiny_burn_in,
    tiny_scaling_section,
    toy_gap,
)
from studies.common import pyplot, save_figure, start_repro

from covrl.train import LagContext, lr_for_batch, momentum_drift_factor

CLAIM = ("With Adam's default momentum β1 = 0.9, the step-size rule that keeps the sampler–trainer gap fixed as the "
         "batch grows (queue fixed in rollouts) is the square root corrected by the momentum drift factor r(Q/B).")

BETA1 = 0.9
# rule name -> (optimizer, lr rule, queue sized in rollouts?) as async_gap.TOY_RULES
MOMENTUM_RULES: dict[str, tuple[str, str, bool]] = {
    "adam_sqrt": ("adam", "sqrt", True),
    "adam_sqrt_momentum": ("adam", "sqrt_momentum", True),
}
ARMS = tuple(MOMENTUM_RULES)

TOY_QUEUES_FULL = (512, 4096)
TOY_QUEUES_FAST = (512,)
TINY_MOMENTUM_FULL = dataclasses.replace(TINY_FULL, beta1=BETA1, rules=ARMS, seeds=16)
# the smoke test: short burn-in and runs, 2 seeds (~40 s CPU); its ratios are not a verdict
TINY_MOMENTUM_FAST = dataclasses.replace(TINY_FAST, beta1=BETA1, rules=ARMS, seeds=2, burn_in_rollouts=2048,
                                         rollouts=2048)


def predicted_ratios(beta1: float, queue: int, base_batch: int, batches: tuple[int, ...]) -> dict[str, list[float]]:
    """The noise model's gap(B)/gap(B0) per arm: the plain √ rule gives r(Q/B)/r(Q/B0); the corrected rule 1."""
    r0 = momentum_drift_factor(beta1, queue // base_batch)
    return {"adam_sqrt": [momentum_drift_factor(beta1, queue // b) / r0 for b in batches],
            "adam_sqrt_momentum": [1.0 for _ in batches]}


def toy_momentum_section(base: ToySettings, queue: int, seed: int) -> dict[str, dict[int, dict[str, float]]]:
    """Toy (exact gap), Adam β1 = 0.9, both arms at queue Q."""
    s = dataclasses.replace(base, queue=queue)
    out: dict[str, dict[int, dict[str, float]]] = {}
    for name, (opt, rule, _) in MOMENTUM_RULES.items():
        out[name] = {b: toy_gap(opt, rule, b, s, seed=seed, beta1=BETA1) for b in s.batches}
    return out


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):
    out_dir = Path(out_dir)
    result = start_repro("async-momentum", CLAIM, out_dir)
    toy_s = TOY_FAST if fast else TOY_FULL
    tiny_s = TINY_MOMENTUM_FAST if fast else TINY_MOMENTUM_FULL
    t0, cpu0 = time.perf_counter(), time.process_time()

    toy: dict[int, Any] = {}
    for q in (TOY_QUEUES_FAST if fast else TOY_QUEUES_FULL):
        per_rule = toy_momentum_section(toy_s, q, seed)
        ratios = ratio_checks(result, f"toy β1=0.9 Q={q}", per_rule, toy_s.base_batch, keeps_gap=ARMS)
        toy[q] = {"gap": {n: {str(b): v for b, v in per.items()} for n, per in per_rule.items()},
                  "ratio_to_base": ratios,
                  "predicted_ratio": predicted_ratios(BETA1, q, toy_s.base_batch, toy_s.batches)}
    result.numbers["toy"] = {"settings": toy_s.__dict__, "queues": toy, "seconds": time.perf_counter() - t0}

    t1 = time.perf_counter()
    base = tiny_base(out_dir, tiny_s, seed)
    burned, burn_info = tiny_burn_in(base, tiny_s, seed)
    tiny = tiny_scaling_section(burned, tiny_s, seed, rules=MOMENTUM_RULES, keeps_gap=ARMS)
    B0 = tiny_s.base_prompts * tiny_s.group_size
    batches = tuple(B0 * k for k in tiny_s.scales)
    tiny_ratios = ratio_checks(result, "tiny transformer β1=0.9", tiny, B0, keeps_gap=ARMS)
    result.check("tiny transformer: every rollout in the window lags exactly ⌈Q/B⌉ steps",
                 {f"{n}/B{b}": v["lag_in_window"] for n, per in tiny.items() for b, v in per.items()},
                 "min = max = ⌈Q/B⌉ in every run",
                 all(v["lag_in_window"] == [v["lag_steps"], v["lag_steps"]]
                     for per in tiny.values() for v in per.values()))
    lrs = {n: {str(b): v["lr"] for b, v in per.items()} for n, per in tiny.items()}
    expected = {n: {str(b): lr_for_batch(tiny_s.base_lr, B0, b, "adamw", rule=MOMENTUM_RULES[n][1],
                                         lag=LagContext(BETA1, tiny_s.queue)) for b in batches} for n in ARMS}
    result.check("tiny transformer: each arm ran at its rule's lr", lrs, "lr = lr_for_batch(rule)", lrs == expected)
    prediction = predicted_ratios(BETA1, tiny_s.queue, B0, batches)
    result.numbers["tiny"] = {
        "settings": tiny_s.__dict__, "seconds": time.perf_counter() - t1, "burn_in": burn_info,
        "gap": {n: {str(b): v for b, v in per.items()} for n, per in tiny.items()}, "ratio_to_base": tiny_ratios,
        "predicted_ratio": prediction,
        "prediction_inside_ci": {n: [bool(per[b]["ratio_ci95"][0] <= p <= per[b]["ratio_ci95"][1])
                                     for b, p in zip(batches, prediction[n]) if b != B0 and "ratio_ci95" in per[b]]
                                 for n, per in tiny.items()}}

    fig = out_dir / "async_momentum.png"
    _figure(fig, toy, tiny, toy_s, tiny_s)
    result.figures.append(fig.name)
    result.numbers["wall_seconds"] = time.perf_counter() - t0
    result.numbers["cpu_seconds"] = time.process_time() - cpu0
    result.notes = ("Design B of studies/async_gap/README.md §4 (pre-registered). "
                    + ("--fast: a smoke test of the machinery (2 seeds, 4x B, short runs); not a verdict."
                       if fast else "Full design: 16 paired seeds; verdict per arm on the point estimates."))
    return result


def _figure(path: Path, toy: dict, tiny: dict, toy_s: ToySettings, tiny_s) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(toy) + 1, figsize=(4.2 * (len(toy) + 1), 3.6))
    colors = {"adam_sqrt": "tab:orange", "adam_sqrt_momentum": "tab:purple"}
    for ax, (q, sec) in zip(axes, toy.items()):
        for name, ratios in sec["ratio_to_base"].items():
            ax.plot(toy_s.batches, ratios, "o-", color=colors[name], label=name)
            ax.plot(toy_s.batches, sec["predicted_ratio"][name], ":", color=colors[name])
        ax.set_title(f"toy, Adam β1=0.9, Q={q}")
    ax = axes[-1]
    B0 = tiny_s.base_prompts * tiny_s.group_size
    for name, per in tiny.items():
        bs = sorted(per)
        ratios = [per[b]["gap"] / per[B0]["gap"] for b in bs]
        lo = [r - per[b].get("ratio_ci95", (r, r))[0] for b, r in zip(bs, ratios)]
        hi = [per[b].get("ratio_ci95", (r, r))[1] - r for b, r in zip(bs, ratios)]
        ax.errorbar(bs, ratios, yerr=[lo, hi], fmt="o-", color=colors[name], capsize=3, label=name)
    ax.set_title(f"tiny transformer, AdamW β1=0.9, Q={tiny_s.queue}")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.axhspan(0.75, 1.25, color="0.9", zorder=0)
        ax.axhline(1.0, color="0.5", lw=0.8)
        ax.set_xlabel("B (rollouts per step)")
        ax.set_ylabel("gap(B) / gap(B0)")
        ax.legend(fontsize=7)
    save_figure(fig, path, dpi=120)
