"""Reproduction `python -m studies lr-surge` (docs/theory.md §8; Zhang, Li et al. 2026, arXiv 2602.01826): a surge of the
mean response length warns of RL collapse, and decaying the learning rate when it surges keeps the sampler–trainer
mismatch bounded.

Setting (covrl's own Trainer, run folder plumbing and HF sampler; nothing re-implemented):
  the tiny 2-layer Llama + char tokenizer on one-digit addition ("7+5=" -> "12"), a short SFT warm-up, then RL
  with GRPO advantages and the covariance loss at an aggressive AdamW lr. The sampler runs in bfloat16 while the
  trainer is fp32 (a real engine mismatch), and `max_new_tokens` leaves room for responses to grow far beyond
  the 2–3 tokens of a correct answer + EOS.
Arms, on the same seeds and the same SFT'd start (the SFT weights are computed once per seed and loaded into both
arms, and the prompt stream and sampler generator are seeded identically, so the arms see the same batches
until the schedule first fires):
  constant  the lr stays at its peak (the schedule only logs its EMA and ratio);
  surge     LengthSurgeSchedule enabled (docs/theory.md §8 defaults except warm-up/cooldown, which are scaled to the
            run's length in steps);
  constant_floor  a reference: the lr held at peak × the schedule's floor (0.125) from the start, to tell
            "decay when length surges" apart from "a smaller lr all along".
Per step we log training reward, mean response length, the mismatch (token k3 = E_q[r − 1 − log r] between the
bf16 sampler and the fp32 trainer, and the sequence-level KL_seq = Σ_t k3_t), and the gradient noise the trainer logs
(covrl.diagnostics.noise: the batch's two halves of whole groups and the full batch give tr Σ, the per-token
gradient covariance, and |G|², in parameter units).

Collapse is defined before looking at results, against a start score that all arms of a seed share: the
sampled accuracy (temperature 1, `SCORE_SAMPLES` samples per prompt) on the distinct RL prompts with the SFT'd
weights. A run collapses when the same score after RL is below `COLLAPSE_FRACTION` × the start score.
Event onsets (no-schedule arm): surge = first step after the schedule's warm-up with length / EMA(length) ≥ the
schedule's ratio; mismatch rise = first step whose trailing `SMOOTH`-step mean of k3 is ≥ `RISE_FACTOR` × the
mean over the first `COLLAPSE_HEAD` steps; noise rise = the same rule on tr Σ; reward fall = first step whose `COLLAPSE_HEAD`-step
moving average of the training reward is below `COLLAPSE_FRACTION` × the start score.

The fast variant (test suite) runs a few steps of each arm and forces a surge: from `force_surge_step` on, the
sampler's EOS logit is pushed down by a forward hook, so responses run to `max_new_tokens`; the schedule must then
fire at that step in the surge arm and never in the constant arm.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studies.common import pyplot, save_figure, start_repro

from covrl.config import load_preset
from covrl.experiment import DRIVEN, ONE_DIGIT_ADDITION, Arm, ArmRunner, Step, pick
from covrl.rollout import build_sampler
from covrl.train import evaluate
from studies import stats

CLAIM = (
    "A surge in mean response length is an early warning of RL collapse: gradient noise and the sampler–trainer "
    "mismatch rise with it and reward falls; decaying the lr when length surges keeps the mismatch bounded and "
    "prevents the collapse."
)

COLLAPSE_HEAD = 5       # first RL steps: baselines of the rise rules, window of the reward moving average
COLLAPSE_TAIL = 10      # last steps whose mean training reward is reported next to the start score
COLLAPSE_FRACTION = 0.5  # collapse: end score < this × start score
SCORE_SAMPLES = 4       # samples per distinct RL prompt for the start/end score
RISE_FACTOR = 5.0       # "mismatch/noise rises": value >= this × its head median
FLOOR = 0.125  # the schedule's default floor (LengthSurgeConfig.floor); lr factor of the constant_floor arm
FORCED_EOS_LOGIT_SHIFT = -30.0  # fast variant: EOS logit shift in the sampler once the surge is forced

ARMS = ("constant", "surge", "constant_floor")
SMOOTH = 3  # steps of the trailing moving mean used by the rise rules (k3 and tr Σ are noisy per step)


@dataclass(frozen=True)
class Settings:
    seeds: int
    steps: int
    lr: float
    sft_steps: int
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    surge_warmup_steps: int
    surge_cooldown_steps: int
    force_surge_step: int | None  # None: no forcing (the full variant); else the step (1-based) it starts
    eval_prompts: int
    collapse_head: int = COLLAPSE_HEAD
    collapse_tail: int = COLLAPSE_TAIL
    arms: tuple[str, ...] = ARMS


FAST = Settings(seeds=1, steps=6, lr=3e-3, sft_steps=10, prompts_per_step=4, group_size=4, max_new_tokens=12,
                surge_warmup_steps=4, surge_cooldown_steps=2, force_surge_step=4,
                eval_prompts=8, collapse_head=2, collapse_tail=2, arms=("constant", "surge"))
FULL = Settings(seeds=5, steps=40, lr=3e-3, sft_steps=60, prompts_per_step=8, group_size=8, max_new_tokens=24,
                surge_warmup_steps=5, surge_cooldown_steps=3, force_surge_step=None,
                eval_prompts=50)


def surge_config(arm: str, *, seed: int, s: Settings, sft_steps: int | None = None):
    """TrainConfig of one arm: the tiny preset on one-digit addition, bf16 sampler (own weight copy) vs fp32
    trainer, GRPO + covariance loss, constant peak lr; `surge` enables the length-surge schedule."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    return load_preset("tiny", {
        **ONE_DIGIT_ADDITION, **DRIVEN, "run.name": f"{arm}-seed{seed}", "run.seed": seed,
        "sampler.max_new_tokens": s.max_new_tokens, "sampler.dtype": "bfloat16", "sampler.share_weights": "never",
        "sft_warmup.steps": s.sft_steps if sft_steps is None else sft_steps, "algorithm.advantage": "grpo",
        "optim.lr": s.lr * (FLOOR if arm == "constant_floor" else 1.0),
        "loop.steps": s.steps, "loop.prompts_per_step": s.prompts_per_step, "loop.group_size": s.group_size,
        "lr_surge.enabled": arm == "surge", "lr_surge.trigger": "length",
        "lr_surge.warmup_steps": s.surge_warmup_steps, "lr_surge.cooldown_steps": s.surge_cooldown_steps,
    })


def eos_suppressing_sampler_builder(state: dict):
    """A `build_sampler_fn` for `prepare_run`: the configured sampler whose output logits get
    `FORCED_EOS_LOGIT_SHIFT` on the EOS token while `state["force"]` is true (a forward hook on its own weight
    copy), so every response runs to max_new_tokens: a forced length surge."""

    def build(cfg, model, tokenizer):
        sampler = build_sampler(cfg, model, tokenizer)
        if getattr(sampler, "shares_weights", False):
            raise ValueError("forcing a surge needs a sampler with its own weight copy (share_weights='never')")
        eos = int(tokenizer.eos_token_id)

        def hook(module, inputs, output):
            if not state.get("force"):
                return output
            shifted = output.clone()
            shifted[..., eos] += FORCED_EOS_LOGIT_SHIFT
            return shifted

        sampler.module.get_output_embeddings().register_forward_hook(hook)
        return sampler

    return build


_KEYS = ("reward/mean", "accuracy", "response/length_mean", "response/length_max", "mismatch/k3",
         "mismatch/max_abs_lr", "kl_seq", "grad_norm", "entropy", "lr", "lr_surge/scale", "lr_surge/ratio",
         "lr_surge/ema", "lr_surge/triggered", "noise/signal", "noise/power", "noise/noise", "noise/trace_sigma",
         "noise/grad_sq", "noise/b_simple", "skipped", "time/trainer_step")


def _run_arm(arm: str, *, seed: int, s: Settings, init_state: dict | None, run_root: Path, cfg=None,
             before_step=None, keys=None) -> dict[str, Any]:
    """One arm, driven step by step (covrl.experiment.harness). `init_state` (the SFT'd weights of this seed) is
    loaded instead of repeating the warm-up. Returns per-step records, evals and the SFT'd weights.
    `cfg` replaces `surge_config(arm, ...)` (another preset or task: studies.long_horizon), `before_step(step,
    runner)` runs before each step's batch (e.g. a step decay of the lr), `keys` replaces the recorded metric
    keys."""
    if cfg is None:
        cfg = surge_config(arm, seed=seed, s=s, sft_steps=0 if init_state is not None else None)
    force = {"force": False}
    arm_spec = Arm(cfg, run_root / f"{arm}-seed{seed}", build_sampler_fn=eos_suppressing_sampler_builder(force),
                   init_state=init_state)
    with ArmRunner(arm_spec) as runner:
        run = runner.run
        start_state = runner.weights()
        eval_examples = run.task.eval[: s.eval_prompts]
        eval_before = evaluate(run.sampler, run.task, run.tokenizer, eval_examples, seed=seed + 17, sampled=False)
        rl_prompts = distinct_prompts(run.task.train, s.eval_prompts)
        score_before = sampled_accuracy(run, rl_prompts, SCORE_SAMPLES, seed=seed + 29)

        def force_from_step(step: int) -> None:
            force["force"] = s.force_surge_step is not None and step >= s.force_surge_step
            if before_step is not None:
                before_step(step, runner)

        def record(step: Step) -> dict:
            return {"step": step.index, "forced": float(force["force"]), **pick(step.metrics, keys or _KEYS)}

        records = runner.drive(s.steps, before_step=force_from_step, record=record)
        force["force"] = False
        eval_after = evaluate(run.sampler, run.task, run.tokenizer, eval_examples, seed=seed + 17, sampled=False)
        score_after = sampled_accuracy(run, rl_prompts, SCORE_SAMPLES, seed=seed + 29)
    return {"records": records, "eval_before": eval_before["greedy"]["accuracy"],
            "eval_after": eval_after["greedy"]["accuracy"],
            "eval_after_length": eval_after["greedy"]["length_mean"], "start_state": start_state,
            "score_before": score_before, "score_after": score_after}


def distinct_prompts(examples: list, limit: int) -> list:
    """The first `limit` examples with distinct prompts, in order."""
    return list({ex.prompt: ex for ex in examples}.values())[:limit]


def sampled_accuracy(run, examples: list, samples: int, *, seed: int) -> float:
    """Accuracy of `samples` samples per example at the sampler's temperature (covrl.train.run.evaluate with its own
    generator seeded with `seed`, so the training RNG does not move): an estimate of the expected reward of the
    policy on these prompts."""
    repeated = [ex for ex in examples for _ in range(samples)]
    return float(evaluate(run.sampler, run.task, run.tokenizer, repeated, seed=seed, greedy=False,
                          sampled=True)["sampled"]["accuracy"])


def _first(steps_values, rule) -> int | None:
    for step, v in steps_values:
        if v is not None and math.isfinite(v) and rule(step, v):
            return step
    return None


def analyse_run(records: list[dict], s: Settings, *, surge_ratio: float, score_before: float,
                score_after: float) -> dict[str, Any]:
    """Collapse flag and event onsets of one run (rules in the module docstring)."""
    rewards = [r["reward/mean"] for r in records]
    head = stats.mean(rewards[: s.collapse_head])
    tail = stats.mean(rewards[-s.collapse_tail:])
    collapsed = score_after < COLLAPSE_FRACTION * score_before
    k3 = [r["mismatch/k3"] for r in records]
    trace = [r.get("noise/trace_sigma", float("nan")) for r in records]
    k3_base = stats.mean(k3[: s.collapse_head])
    noise_base = stats.mean(trace[: s.collapse_head])
    steps = [r["step"] for r in records]
    warm = s.surge_warmup_steps
    surge = _first(((r["step"], r["lr_surge/ratio"]) for r in records),
                   lambda step, v: step >= warm and v >= surge_ratio)
    mismatch = _first(zip(steps, stats.trailing_mean(k3, SMOOTH)),
                      lambda step, v: k3_base > 0 and v >= RISE_FACTOR * k3_base)
    noise = _first(zip(steps, stats.trailing_mean(trace, SMOOTH)),
                   lambda step, v: noise_base > 0 and v >= RISE_FACTOR * noise_base)
    w = s.collapse_head
    moving = [(records[i]["step"], stats.mean(rewards[max(0, i - w + 1): i + 1])) for i in range(w - 1, len(records))]
    fall = _first(moving, lambda step, v: v < COLLAPSE_FRACTION * score_before)
    decays = [r["step"] for r in records if r.get("lr_surge/triggered", 0.0) > 0]
    half = len(records) // 2
    return {
        "collapsed": collapsed, "score_before": score_before, "score_after": score_after,
        "reward_head": head, "reward_tail": tail,
        "onset_surge": surge, "onset_mismatch_rise": mismatch, "onset_noise_rise": noise, "onset_reward_fall": fall,
        "decay_steps": decays, "final_lr_scale": records[-1].get("lr_surge/scale", 1.0),
        "length_max_of_batch_means": max(r["response/length_mean"] for r in records),
        "k3_head_mean": k3_base, "k3_max": max(r["mismatch/k3"] for r in records),
        "k3_mean_second_half": stats.mean(r["mismatch/k3"] for r in records[half:]),
        "kl_seq_max": max(r.get("kl_seq", float("nan")) for r in records),
        "kl_seq_mean_second_half": stats.mean(r.get("kl_seq") for r in records[half:]),
        "trace_sigma_head_mean": noise_base,
        "k3_smoothed_max": max(stats.trailing_mean(k3, SMOOTH)),
        "trace_sigma_max": max((r.get("noise/trace_sigma", float("nan")) for r in records), default=float("nan")),
        "grad_norm_max": max(r.get("grad_norm", 0.0) for r in records),
        "noise_median": stats.median(r.get("noise/noise") for r in records),
    }


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):
    s = FAST if fast else FULL
    result = start_repro("lr-surge", CLAIM, out_dir)
    t0, c0 = time.perf_counter(), time.process_time()
    runs: dict[str, list[dict]] = {arm: [] for arm in s.arms}
    surge_ratio = surge_config("surge", seed=seed, s=s).lr_surge.ratio
    with tempfile.TemporaryDirectory(prefix="covrl-lr-surge-") as tmp:
        for k in range(s.seeds):
            run_seed = seed + k
            init_state = None
            for arm in s.arms:
                out = _run_arm(arm, seed=run_seed, s=s, init_state=init_state, run_root=Path(tmp))
                init_state = out.pop("start_state")
                out["analysis"] = analyse_run(out["records"], s, surge_ratio=surge_ratio,
                                              score_before=out["score_before"], score_after=out["score_after"])
                out["seed"] = run_seed
                runs[arm].append(out)
    result.numbers["seconds_wall"] = time.perf_counter() - t0
    result.numbers["seconds_cpu"] = time.process_time() - c0
    _summarise(result, runs, s, surge_ratio)
    result.figures.append(_figure(out_dir, runs, s))
    result.notes = _notes(s)
    return result


def _summarise(result, runs: dict[str, list[dict]], s: Settings, surge_ratio: float) -> None:
    per_arm = {}
    for arm in runs:
        an = [r["analysis"] for r in runs[arm]]
        per_arm[arm] = {
            "collapsed": sum(a["collapsed"] for a in an), "runs": len(an),
            "collapse_fraction": sum(a["collapsed"] for a in an) / len(an),
            "score_before": [a["score_before"] for a in an],
            "score_after": [a["score_after"] for a in an],
            "reward_head_mean": stats.mean(a["reward_head"] for a in an),
            "reward_tail_mean": stats.mean(a["reward_tail"] for a in an),
            "eval_greedy_before": [r["eval_before"] for r in runs[arm]],
            "eval_greedy_after": [r["eval_after"] for r in runs[arm]],
            "k3_max_mean": stats.mean(a["k3_max"] for a in an),
            "k3_smoothed_max_mean": stats.mean(a["k3_smoothed_max"] for a in an),
            "onsets": {k: [a[f"onset_{k}"] for a in an] for k in ("surge", "mismatch_rise", "noise_rise", "reward_fall")},
            "decay_steps": [a["decay_steps"] for a in an],
            "k3_mean_second_half": stats.mean(a["k3_mean_second_half"] for a in an),
            "kl_seq_mean_second_half": stats.mean(a["kl_seq_mean_second_half"] for a in an),
            "length_max_of_batch_means": [a["length_max_of_batch_means"] for a in an],
            "per_seed": [{k: v for k, v in a.items()} | {"seed": r["seed"]} for a, r in zip(an, runs[arm])],
        }
    result.numbers["per_arm"] = per_arm
    result.numbers["settings"] = {**s.__dict__, "surge_ratio": surge_ratio, "collapse_rule":
                                  f"sampled accuracy ({SCORE_SAMPLES} samples per distinct RL prompt) after RL < "
                                  f"{COLLAPSE_FRACTION} x the same before RL (SFT weights, shared by the arms)",
                                  "rise_factor": RISE_FACTOR, "smooth_steps": SMOOTH}
    finite = all(math.isfinite(v) for arm in runs for r in runs[arm] for rec in r["records"]
                 for k, v in rec.items() if k in ("reward/mean", "mismatch/k3", "grad_norm", "response/length_mean"))
    result.check("every logged reward, length, k3 and grad norm is finite", finite, "true", finite)
    if s.force_surge_step is not None:
        forced = s.force_surge_step
        fired = [r["analysis"]["decay_steps"] for r in runs["surge"]]
        fired_const = [r["analysis"]["decay_steps"] for r in runs["constant"]]
        ok = all(d and d[0] == forced for d in fired)
        result.check("forced surge: the schedule's first decay is at the forced step (surge arm; decay steps per seed)",
                     fired, f"first decay at step {forced}", ok)
        result.check("constant arm: the schedule never changes the lr (decay steps per seed)", fired_const, "none",
                     all(not d for d in fired_const))
        return
    const, surge = per_arm["constant"], per_arm["surge"]
    result.check("collapse fraction without the schedule vs with it", {"constant": const["collapse_fraction"],
                 "surge": surge["collapse_fraction"]}, "constant > surge",
                 const["collapse_fraction"] > surge["collapse_fraction"])
    order = []
    for r in runs["constant"]:
        a = r["analysis"]
        if a["collapsed"] and a["onset_surge"] is not None and a["onset_reward_fall"] is not None:
            order.append(a["onset_surge"] <= a["onset_reward_fall"])
    result.check("collapsed constant-lr runs: the length surge comes no later than the reward fall "
                 "(runs where it does / collapsed runs with both onsets)", f"{sum(order)}/{len(order)}",
                 "all, at least one collapsed run", bool(order) and all(order))
    rise = []
    for r in runs["constant"]:
        a = r["analysis"]
        if a["collapsed"]:
            rise.append(a["onset_mismatch_rise"] is not None)
    result.check(f"collapsed constant-lr runs in which k3 rises ≥ {RISE_FACTOR:g}× its start",
                 f"{sum(rise)}/{len(rise)}", "all, at least one collapsed run", bool(rise) and all(rise))
    ratios = {"k3_second_half": surge["k3_mean_second_half"] / max(const["k3_mean_second_half"], 1e-30),
              "kl_seq_second_half": surge["kl_seq_mean_second_half"] / max(const["kl_seq_mean_second_half"], 1e-30),
              "k3_smoothed_max": surge["k3_smoothed_max_mean"] / max(const["k3_smoothed_max_mean"], 1e-30)}
    result.check("mismatch bounded with the schedule: surge / constant for the second-half mean of token k3 and of "
                 f"KL_seq, and for the max of the {SMOOTH}-step mean of k3 (means over seeds)", ratios, "all ≤ 1",
                 all(v <= 1 for v in ratios.values()))
    first_decays = [r["analysis"]["decay_steps"][:1] for r in runs["surge"]]
    surges = [r["analysis"]["onset_surge"] for r in runs["surge"]]
    at_surge = all((not d and s_ is None) or (d and s_ is not None and d[0] == s_) for d, s_ in zip(first_decays, surges))
    result.check("the schedule's first decay is at the first surge (surge arm; per seed)",
                 {"first_decay": first_decays, "first_surge": surges}, "equal", at_surge)


def _figure(out_dir: Path, runs: dict[str, list[dict]], s: Settings) -> str:
    """Six panels over RL steps; thin lines = seeds, thick = mean over seeds. The noisy panels (k3, KL_seq, tr Σ)
    show trailing SMOOTH-step means; tr Σ estimates ≤ 0 (no reward contrast, or a noisy estimate) count as 0."""
    plt = pyplot()
    panels = [("reward/mean", "training reward (dotted: start score, mean over seeds)", False, False),
              ("response/length_mean", "mean response length", False, False),
              ("mismatch/k3", f"mismatch token k3, bf16 sampler vs fp32 trainer ({SMOOTH}-step mean)", True, True),
              ("kl_seq", f"sequence KL_seq = Σ_t k3_t ({SMOOTH}-step mean)", True, True),
              ("noise/trace_sigma", f"gradient noise tr Σ ({SMOOTH}-step mean)", True, True),
              ("lr", "learning rate", True, False)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    colors = {"constant": "tab:red", "surge": "tab:blue", "constant_floor": "tab:gray"}
    for ax, (key, label, log, smooth) in zip(axes.flat, panels):
        for arm in runs:
            curves = []
            for r in runs[arm]:
                ys = [max(rec.get(key, float("nan")), 0.0) for rec in r["records"]]
                ys = stats.trailing_mean(ys, SMOOTH) if smooth else ys
                curves.append(ys)
                ax.plot(range(1, len(ys) + 1), [y if (y > 0 or not log) else float("nan") for y in ys],
                        color=colors.get(arm, "k"), alpha=0.25, lw=0.8)
            steps = min(len(c) for c in curves)
            mean = [stats.mean(c[i] for c in curves) for i in range(steps)]
            collapsed = sum(r["analysis"]["collapsed"] for r in runs[arm])
            ax.plot(range(1, steps + 1), [y if (y > 0 or not log) else float("nan") for y in mean],
                    color=colors.get(arm, "k"), lw=2.2, label=f"{arm} ({collapsed}/{len(curves)} collapsed)")
            if key == "reward/mean":
                ax.axhline(stats.mean(r["score_before"] for r in runs[arm]), color="k", ls=":", lw=1)
            if arm == "surge":
                for r in runs[arm]:
                    for d in r["analysis"]["decay_steps"]:
                        ax.axvline(d, color=colors[arm], alpha=0.12, lw=1)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("RL step")
        ax.set_title(label, fontsize=9)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Length-surge lr decay: tiny Llama on one-digit addition, peak lr {s.lr:g}, {s.seeds} seed(s) per "
                 "arm; faint vertical lines = decays of the surge arm", fontsize=11)
    return save_figure(fig, out_dir / "lr_surge.png", dpi=100)


def _notes(s: Settings) -> str:
    return (f"{s.seeds} seed(s) × {len(s.arms)} arms ({', '.join(s.arms)}), {s.steps} RL steps of {s.prompts_per_step}×{s.group_size} "
            f"rollouts, max_new_tokens {s.max_new_tokens}, peak lr {s.lr:g} (AdamW, clip 1.0), GRPO + covariance "
            f"loss, bf16 sampler / fp32 trainer, SFT warm-up {s.sft_steps} steps shared by the arms of a seed; "
            f"reference arm constant_floor at lr {s.lr * FLOOR:g}. "
            f"Schedule: ratio 1.2, factor 0.5, floor 0.125, ≤ 3 decays, EMA α 0.05, warm-up {s.surge_warmup_steps} "
            f"steps, cooldown {s.surge_cooldown_steps} steps. Collapse: sampled accuracy on the RL prompts after RL "
            f"< {COLLAPSE_FRACTION} × before RL ({SCORE_SAMPLES} samples per prompt).")
