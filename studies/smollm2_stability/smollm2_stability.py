"""SmolLM2-135M stability check: OTB vs GRPO, and one length-surge run, at small scale on CPU.

Part 1 (OTB vs GRPO): `configs/default.yaml` (SmolLM2-135M-Instruct, one-digit addition, covariance loss, lr 2e-5,
4 prompts x 4 completions, 16 new tokens), two arms that differ only in `algorithm.advantage` (otb, grpo). Same
seed, so the prompt stream, the sampler's generator and the step-1 batch are identical; the arms part once their
weights differ. Per step: training reward, grad norm, the trainer's adv/* proxies and its noise/* monitor (signal,
power, tr Sigma, |G|^2, B_simple in parameter units, from the two half-batch micro-batches of every step), and the
process CPU seconds of generation and of `Trainer.step`. Held-out greedy accuracy (50 problems
never trained on) before and after. OTB's cost over GRPO is also timed on one batch from the same weights,
alternating the two estimators (as `python -m studies otb` does).

Part 2 (length surge): the same config made aggressive: lr x `surge_lr_mult`, bfloat16 sampler vs fp32 trainer,
`max_new_tokens` 48, with `lr_surge` enabled (warm-up and cooldown scaled to the run), and the same run with the
schedule only logging (`enabled: false`) on the same seed. Per step: length, reward, token k3, KL_seq, lr and the
schedule's scale/ratio/decays; onsets and collapse by `studies.lr_surge.lr_surge.analyse_run` (score = held-out sampled
accuracy, one sample per prompt).

Everything is driven step by step through covrl's own `prepare_run`, `sampler.generate`, `score_rollouts`,
`Trainer.step` and `sampler.load_weights`; each run folder gets its metrics.jsonl under runs/smollm2-stability/.

    .venv/bin/python -m studies smollm2-stability                # full: ~17 min on one core
    .venv/bin/python -m studies smollm2-stability --from-json studies/smollm2_stability/smollm2-stability.json  # re-summarise
    .venv/bin/python -m studies smollm2-stability --fast --out /tmp/x   # the slow test's cut-down variant
    # more part-1 seeds, and a part-2 pair at another lr, each into a JSON of its own; then one merged summary
    .venv/bin/python -m studies smollm2-stability --seeds 1 2 --skip-part2 --name smollm2-stability-seeds12
    .venv/bin/python -m studies smollm2-stability --skip-part1 --surge-lr-mult 5 --surge-steps 40 \
        --name smollm2-stability-surge-lr5x
    .venv/bin/python -m studies smollm2-stability --from-json studies/smollm2_stability/smollm2-stability.json \
        studies/smollm2_stability/smollm2-stability-seeds12.json studies/smollm2_stability/smollm2-stability-surge-lr5x.json \
        --name smollm2-stability-merged
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from studies.common import TYPED_DEFAULT_OVERRIDES, jsonable, pyplot, save_figure
from studies.lr_surge.lr_surge import eos_suppressing_sampler_builder

from covrl.experiment import Arm, ArmRunner, Step, numeric
from covrl.train import evaluate
from studies import stats

ROOT = Path(__file__).resolve().parents[2]   # the repository
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
RUNS = ROOT / "runs" / "smollm2-stability"
RESULTS = Path(__file__).resolve().parent   # the study's recorded runs

# per-step keys kept in the JSON (metrics.jsonl in the run folders has all of them)
KEEP = ("reward/mean", "response/length_mean", "response/length_max", "grad_norm", "entropy", "lr", "skipped",
        "mismatch/k3", "kl_seq", "adv/var_power", "adv/var_proxy_mean", "adv/frac_zero_std_groups",
        "noise/power", "noise/signal", "noise/noise", "noise/noise_ema", "noise/trace_sigma", "noise/grad_sq",
        "noise/b_simple", "noise/b_simple_ema", "lr_surge/scale", "lr_surge/ratio",
        "lr_surge/ema", "lr_surge/triggered", "lr_surge/decays", "policy_version", "time/trainer_step",
        "cpu/generate", "cpu/trainer_step", "cpu/step",
        "wall/step", "response_tokens", "rollouts")


@dataclass(frozen=True)
class Settings:
    seeds: tuple[int, ...]
    steps: int                     # OTB vs GRPO steps per arm
    eval_prompts: int              # held-out prompts for before/after accuracy
    timing_repeats: int            # same-batch alternated Trainer.step timings (OTB vs GRPO)
    surge_steps: int
    surge_lr_mult: float           # x the default lr
    surge_max_new_tokens: int
    surge_warmup_steps: int
    surge_cooldown_steps: int
    surge_logging_arm: bool        # also run the schedule in log-only mode on the same seed
    surge_schedule_arm: bool = True  # run the schedule-enabled arm (off: a log-only control at some lr alone)
    force_surge_step: int | None = None  # test only: suppress EOS in the sampler from this step on
    prompts_per_step: int | None = None  # None = the default config's
    max_new_tokens: int | None = None    # part 1; None = the default config's


FULL = Settings(seeds=(0,), steps=30, eval_prompts=50, timing_repeats=5, surge_steps=20,
                surge_lr_mult=10.0, surge_max_new_tokens=48, surge_warmup_steps=3, surge_cooldown_steps=3,
                surge_logging_arm=True)
FAST = Settings(seeds=(0,), steps=3, eval_prompts=6, timing_repeats=1, surge_steps=4,
                surge_lr_mult=10.0, surge_max_new_tokens=24, surge_warmup_steps=1, surge_cooldown_steps=1,
                surge_logging_arm=True, force_surge_step=3, max_new_tokens=8)


def build_cfg(name: str, overrides: list[str], *, run_root: Path):
    """configs/default.yaml + overrides (covrl.config.load_config); evaluation, checkpoints and console output are
    done by this script, so they are off in the config; one torch thread."""
    from covrl.config import load_config

    common = [f"run.name={name}", f"run.output_dir={run_root}", "run.num_threads=1", "eval.before=false",
              "eval.after=false", "checkpoint.at_end=false", "logging.console=false", "logging.curves=false"]
    return load_config(DEFAULT_CONFIG, [*TYPED_DEFAULT_OVERRIDES, *common, *overrides])


def _cpu() -> float:
    return time.process_time()


def drive(cfg, *, run_dir: Path, s: Settings, eval_prompts: int,
          sampled_eval: bool, timing_repeats: int = 0) -> dict[str, Any]:
    """One run step by step (covrl.experiment.harness). Returns per-step records, held-out evals before/after, and
    (timing_repeats > 0) the same-batch OTB/GRPO Trainer.step timing at the end."""
    t0, c0 = time.perf_counter(), _cpu()
    force = {"force": False}
    builder = eos_suppressing_sampler_builder(force) if s.force_surge_step is not None else None
    with ArmRunner(Arm(cfg, run_dir, build_sampler_fn=builder)) as runner:
        run = runner.run
        setup = {"wall_s": time.perf_counter() - t0, "cpu_s": _cpu() - c0}
        examples_eval = run.task.eval[:eval_prompts]

        def held_out() -> dict[str, Any]:
            t, c = time.perf_counter(), _cpu()
            e = evaluate(run.sampler, run.task, run.tokenizer, examples_eval, seed=cfg.run.seed + 17,
                         greedy=True, sampled=sampled_eval)
            out = {m: {"accuracy": e[m]["accuracy"], "length_mean": e[m]["length_mean"]}
                   for m in ("greedy", "sampled") if m in e}
            return out | {"wall_s": time.perf_counter() - t, "cpu_s": _cpu() - c, "n": len(examples_eval),
                          "examples": e["greedy"]["examples"][:3]}

        def force_from_step(step: int) -> None:
            force["force"] = s.force_surge_step is not None and step >= s.force_surge_step

        def record(step: Step) -> dict:
            return {"step": step.index, **numeric(step.metrics), "forced": float(force["force"]),
                    "response_tokens": float(step.batch.response_mask.sum()), "cpu/generate": step.cpu_generate_s,
                    "cpu/trainer_step": step.cpu_update_s, "cpu/step": step.cpu_s, "wall/step": step.wall_s}

        def report(step: Step, rec: dict) -> None:
            print(f"  {run_dir.name} step {step.index}: reward {rec['reward/mean']:.3f} len "
                  f"{rec['response/length_mean']:.1f} gn {rec.get('grad_norm', float('nan')):.3g} "
                  f"k3 {rec.get('mismatch/k3', float('nan')):.2e} lr {rec.get('lr', 0):.2e} "
                  f"cpu {rec['cpu/step']:.1f}s", flush=True)

        before = held_out()
        t_loop, c_loop = time.perf_counter(), _cpu()
        records = runner.drive(cfg.loop.steps, before_step=force_from_step, record=record, after_step=report)
        loop = {"wall_s": time.perf_counter() - t_loop, "cpu_s": _cpu() - c_loop}
        force["force"] = False
        after = held_out()
        timing = step_cost(run, cfg, timing_repeats) if timing_repeats > 0 else None
    return {"records": records, "before": before, "after": after, "setup": setup, "loop": loop,
            "timing": timing, "wall_s": time.perf_counter() - t0, "cpu_s": _cpu() - c0}


def step_cost(run, cfg, repeats: int) -> dict[str, float]:
    """Median process-CPU and wall time of Trainer.step with OTB and with GRPO on the same batch from the same
    weights (run.model's current ones, restored before every step), alternating; the first round is a warm-up.
    The batch comes from a generator of its own, so the run's sample path is untouched."""
    import torch

    from covrl.train import Trainer, score_rollouts

    n = cfg.loop.group_size
    examples, positions = run.stream.take(cfg.loop.prompts_per_step)
    prompts = [run.task.encode(run.tokenizer, ex) for ex in examples]
    gen = torch.Generator().manual_seed(cfg.run.seed + 101)
    batch = run.sampler.generate(prompts, n, generator=gen)
    batch = score_rollouts(run.task, run.tokenizer, batch, examples, n, positions)
    batch = replace(batch, **{k: v.clone() for k, v in batch.tensor_fields().items()})   # inference -> autograd
    state = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    trainers = {}
    for name in ("otb", "grpo"):
        c = cfg.model_copy(deep=True)
        c.algorithm.advantage = name
        c.lr_surge.enabled = False
        trainers[name] = Trainer(run.model, c)
    wall: dict[str, list[float]] = {k: [] for k in trainers}
    cpu: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(repeats + 1):
        for name, trainer in trainers.items():
            run.model.load_state_dict(state)
            t, c = time.perf_counter(), _cpu()
            trainer.step(batch)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(_cpu() - c)
    run.model.load_state_dict(state)
    med = {f"{k}_{name}": statistics.median(v[1:]) for k, d in (("wall", wall), ("cpu", cpu)) for name, v in d.items()}
    return {**med, "rows": float(len(batch)), "tokens": float(batch.response_mask.sum()), "repeats": float(repeats),
            "cpu_ratio_otb_over_grpo": med["cpu_otb"] / med["cpu_grpo"],
            "wall_ratio_otb_over_grpo": med["wall_otb"] / med["wall_grpo"]}


# ------------------------------------------------------------------------------------------------ part 1
def part1(s: Settings, run_root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for seed in s.seeds:
        for arm in ("otb", "grpo"):
            overrides = [f"run.seed={seed}", f"algorithm.advantage={arm}", f"loop.steps={s.steps}"]
            if s.prompts_per_step:
                overrides.append(f"loop.prompts_per_step={s.prompts_per_step}")
            if s.max_new_tokens:
                overrides.append(f"sampler.max_new_tokens={s.max_new_tokens}")
            name = f"{arm}-seed{seed}"
            cfg = build_cfg(name, overrides, run_root=run_root)
            print(f"part 1: {name}", flush=True)
            res = drive(cfg, run_dir=run_root / name, s=replace(s, force_surge_step=None),
                        eval_prompts=s.eval_prompts, sampled_eval=False,
                        timing_repeats=s.timing_repeats if arm == "otb" and seed == s.seeds[0] else 0)
            out[name] = res
    return out


def part1_summary(res: dict) -> dict[str, Any]:
    """Numbers of one OTB/GRPO run from its per-step records. Grad-norm stability (studies.otb.otb's
    grad_norm_stability: mean, std, cv, max, spikes) is computed twice: over all steps, and over the steps with
    reward contrast only. On a step where every group has one reward (adv/frac_zero_std_groups = 1) GRPO's
    gradient is exactly 0, while OTB's is not: its `handle_zero_tail` rule gives the tail of a group's uniquely
    longest row the advantage G (baseline 0), and the 1e-8 in its baseline's denominator leaves round-off. Those
    norms range from ~1e-5 to O(1), and the tiny ones enter the spike rule's median and make the next ordinary
    step a "spike"; the contrast-only view compares the steps where both estimators have a reward signal."""
    from studies.otb.otb import grad_norm_stability

    recs = res["per_step"]
    contrast = [r for r in recs if r.get("adv/frac_zero_std_groups", 0.0) < 1.0]
    return {
        **grad_norm_stability([r.get("grad_norm", 0.0) for r in recs]),
        "contrast_steps": len(contrast),
        "with_contrast": grad_norm_stability([r.get("grad_norm", 0.0) for r in contrast]),
        "held_out_greedy_before": res["before"]["greedy"]["accuracy"],
        "held_out_greedy_after": res["after"]["greedy"]["accuracy"],
        "held_out_greedy_length_after": res["after"]["greedy"]["length_mean"],
        "reward_first5": stats.mean(r["reward/mean"] for r in recs[:5]),
        "reward_last5": stats.mean(r["reward/mean"] for r in recs[-5:]),
        "reward_last10": stats.mean(r["reward/mean"] for r in recs[-10:]),
        "reward_mean": stats.mean(r["reward/mean"] for r in recs),
        "first_step_reward_ge_0.9": next((r["step"] for r in recs if r["reward/mean"] >= 0.9), None),
        "length_first5": stats.mean(r["response/length_mean"] for r in recs[:5]),
        "length_last5": stats.mean(r["response/length_mean"] for r in recs[-5:]),
        "entropy_last5": stats.mean(r.get("entropy") for r in recs[-5:]),
        "skipped_steps": sum(1 for r in recs if r.get("skipped")),
        "zero_contrast_groups_mean": stats.mean(r.get("adv/frac_zero_std_groups") for r in recs),
        "var_power_median": stats.median(r.get("adv/var_power") for r in contrast),
        "var_proxy_mean": stats.mean(r.get("adv/var_proxy_mean") for r in recs),
        # the trainer's noise monitor (parameter units, two half-batch micro-batches of whole groups)
        "noise_signal_median": stats.median(r.get("noise/signal") for r in contrast),
        "noise_power_median": stats.median(r.get("noise/power") for r in contrast),
        "noise_noise_median": stats.median(r.get("noise/noise") for r in contrast),
        "noise_nonzero_steps": sum(1 for r in recs if _num(r.get("noise/noise")) > 0),
        "trace_sigma_median": stats.median(r.get("noise/trace_sigma") for r in contrast),
        "grad_sq_median": stats.median(r.get("noise/grad_sq") for r in contrast),
        "grad_sq_nonpositive_steps": sum(1 for r in contrast if _num(r.get("noise/grad_sq")) <= 0),
        "b_simple_median": stats.median(r.get("noise/b_simple") for r in contrast),
        "b_simple_ema_final": _num(recs[-1].get("noise/b_simple_ema")),
        "cpu_step_mean": stats.mean(r["cpu/step"] for r in recs),
        "cpu_generate_mean": stats.mean(r["cpu/generate"] for r in recs),
        "cpu_trainer_step_mean": stats.mean(r["cpu/trainer_step"] for r in recs),
        "cpu_trainer_step_per_token_ms": 1e3 * sum(r["cpu/trainer_step"] for r in recs)
        / max(1.0, sum(r["response_tokens"] for r in recs)),
        "wall_step_mean": stats.mean(r["wall/step"] for r in recs),
        "response_tokens_total": sum(r["response_tokens"] for r in recs),
    }


# ------------------------------------------------------------------------------------------------ part 2
def part2(s: Settings, run_root: Path, seed: int) -> dict[str, Any]:
    from covrl.config import load_config

    lr = load_config(DEFAULT_CONFIG).optim.lr * s.surge_lr_mult
    arms = {**({"surge": True} if s.surge_schedule_arm else {}),
            **({"log_only": False} if s.surge_logging_arm else {})}
    if not arms:
        raise ValueError("part 2 with neither arm")
    out: dict[str, Any] = {}
    for arm, enabled in arms.items():
        name = part2_name(arm, seed, s.surge_lr_mult)
        overrides = [f"run.seed={seed}", f"optim.lr={lr!r}", "sampler.dtype=bfloat16",
                     f"sampler.max_new_tokens={s.surge_max_new_tokens}", f"loop.steps={s.surge_steps}",
                     f"lr_surge.enabled={str(enabled).lower()}", "lr_surge.trigger=length",
                     f"lr_surge.warmup_steps={s.surge_warmup_steps}",
                     f"lr_surge.cooldown_steps={s.surge_cooldown_steps}"]
        if s.prompts_per_step:
            overrides.append(f"loop.prompts_per_step={s.prompts_per_step}")
        cfg = build_cfg(name, overrides, run_root=run_root)
        print(f"part 2: {name} (lr {lr:g})", flush=True)
        res = drive(cfg, run_dir=run_root / name, s=s, eval_prompts=s.eval_prompts,
                    sampled_eval=True)
        res["schedule"] = {"lr_surge": cfg.lr_surge.model_dump(), "base_lr": lr,
                           "rollouts_per_step": cfg.loop.rollouts_per_step, "group_size": cfg.loop.group_size}
        out[name] = res
    return out


def part2_name(arm: str, seed: int, lr_mult: float) -> str:
    """Run name of a part-2 run: `{arm}-seed{seed}` at the first pass's lr (10x), else the lr multiple is in the
    name, so a pair at another lr does not overwrite the first pair's run folders or JSON entries."""
    if lr_mult == 10.0:
        return f"{arm}-seed{seed}"
    return f"{arm}-lr{lr_mult:g}x-seed{seed}"


def part2_analysis(res: dict, s: Settings) -> dict[str, Any]:
    """Onsets, collapse and mismatch of one length-surge run (studies.lr_surge.lr_surge.analyse_run; score = held-out
    sampled accuracy, one sample per prompt; its reward-fall and rise baselines use the first `head` steps), plus
    the schedule's self-consistency."""
    from studies.lr_surge.lr_surge import Settings as SurgeSettings
    from studies.lr_surge.lr_surge import analyse_run

    from covrl.train.step.lr_surge import LengthSurgeConfig

    recs, sch = res["per_step"], res["schedule"]
    sched = LengthSurgeConfig(**sch["lr_surge"])
    head = min(5, max(1, len(recs) // 4))
    ss = SurgeSettings(seeds=1, steps=len(recs), lr=sch["base_lr"], sft_steps=0,
                       prompts_per_step=sch["rollouts_per_step"] // sch["group_size"], group_size=sch["group_size"],
                       max_new_tokens=s.surge_max_new_tokens, surge_warmup_steps=sched.warmup_steps,
                       surge_cooldown_steps=sched.cooldown_steps,
                       force_surge_step=s.force_surge_step, eval_prompts=s.eval_prompts,
                       collapse_head=head, collapse_tail=head)
    out = analyse_run(recs, ss, surge_ratio=sched.ratio, score_before=res["before"]["sampled"]["accuracy"],
                      score_after=res["after"]["sampled"]["accuracy"])
    first_len = recs[0]["response/length_mean"]
    out.update({
        "collapse_head_steps": head,
        "final_lr": recs[-1].get("lr"),
        "min_lr_scale": min(r.get("lr_surge/scale", 1.0) for r in recs),
        "length_first3": stats.mean(r["response/length_mean"] for r in recs[:3]),
        "length_last3": stats.mean(r["response/length_mean"] for r in recs[-3:]),
        "first_step_length_ge_1.2x_step1": next((r["step"] for r in recs
                                                 if r["response/length_mean"] >= 1.2 * first_len), None),
        "first_ratio_ge_threshold_any_step": next((r["step"] for r in recs[1:]
                                                   if r["lr_surge/ratio"] >= sched.ratio), None),
        "reward_first3": stats.mean(r["reward/mean"] for r in recs[:3]),
        "reward_last3": stats.mean(r["reward/mean"] for r in recs[-3:]),
        "k3_first3": stats.mean(r.get("mismatch/k3") for r in recs[:3]),
        "k3_last3": stats.mean(r.get("mismatch/k3") for r in recs[-3:]),
        "k3_mean": stats.mean(r.get("mismatch/k3") for r in recs),
        "kl_seq_mean": stats.mean(r.get("kl_seq") for r in recs),
        "entropy_first3": stats.mean(r.get("entropy") for r in recs[:3]),
        "entropy_last3": stats.mean(r.get("entropy") for r in recs[-3:]),
        "held_out_greedy_before": res["before"]["greedy"]["accuracy"],
        "held_out_greedy_after": res["after"]["greedy"]["accuracy"],
        "held_out_sampled_before": res["before"]["sampled"]["accuracy"],
        "held_out_sampled_after": res["after"]["sampled"]["accuracy"],
        "held_out_greedy_length_before": res["before"]["greedy"]["length_mean"],
        "held_out_greedy_length_after": res["after"]["greedy"]["length_mean"],
        "cpu_step_mean": stats.mean(r["cpu/step"] for r in recs),
        "schedule_consistent": schedule_consistent(recs, sched, sch["base_lr"], sch["rollouts_per_step"]),
    })
    return out


def schedule_consistent(records: list[dict], sched, base_lr: float, rollouts_per_step: int) -> dict[str, Any]:
    """The logged schedule agrees with its own rule (covrl.train.step.lr_surge.LengthSurgeSchedule): a step decays
    exactly when it is enabled, not the first step, past warm-up and cooldown (data clock), below max_decays and
    above the floor, and the logged ratio >= sched.ratio; at every step scale = max(floor, factor^decays) and
    decays counts the triggered steps; the lr applied at step k+1 is base_lr x the scale logged at step k."""
    warmup, cooldown = sched.in_rollouts(rollouts_per_step)
    problems = []
    decays, prev_scale, last_decay = 0, 1.0, None
    for i, r in enumerate(records):
        if not math.isclose(r["lr"], base_lr * prev_scale, rel_tol=1e-9):
            problems.append(f"step {r['step']}: lr {r['lr']} != {base_lr} x {prev_scale}")
        rollouts = int(r["rollouts"])
        expected_trigger = (sched.enabled and i > 0 and rollouts >= warmup
                            and (last_decay is None or rollouts - last_decay >= cooldown)
                            and decays < sched.max_decays and prev_scale > sched.floor
                            and r["lr_surge/ratio"] >= sched.ratio)
        triggered = r.get("lr_surge/triggered", 0.0) > 0
        if triggered != expected_trigger:
            problems.append(f"step {r['step']}: triggered {triggered}, the rule says {expected_trigger}")
        if triggered:
            decays += 1
            last_decay = rollouts
        expected = max(sched.floor, sched.factor ** decays)
        if r.get("lr_surge/decays") != decays or not math.isclose(r["lr_surge/scale"], expected, rel_tol=1e-12):
            problems.append(f"step {r['step']}: scale {r['lr_surge/scale']} decays {r.get('lr_surge/decays')}, "
                            f"expected {expected} after {decays} decays")
        prev_scale = r["lr_surge/scale"]
    return {"ok": not problems, "problems": problems[:5], "decays": decays}


# ------------------------------------------------------------------------------------------------ output
def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) else float("nan")


def _floats(x):
    """Inverse of studies.common.jsonable for the non-finite floats it writes as strings."""
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    if isinstance(x, dict):
        return {k: _floats(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_floats(v) for v in x]
    return x


def slim(res: dict) -> dict:
    """A run's result for the JSON: per-step records cut to KEEP."""
    out = {k: v for k, v in res.items() if k != "records"}
    out["per_step"] = [{"step": r["step"], **{k: r[k] for k in KEEP if k in r}} for r in res["records"]]
    return out


def figure(path: Path, p1: dict, p2: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 4, figsize=(19, 8))
    lrs = list(dict.fromkeys(res["schedule"]["base_lr"] for res in p2.values()))   # in order of appearance
    styles = {lr: ("-o", "--s", ":^", "-.v")[min(i, 3)] for i, lr in enumerate(lrs)}   # one style per lr
    seeds = sorted({name.split("seed")[-1] for name in p1})
    shade = {sd: 1.0 - 0.3 * i for i, sd in enumerate(seeds)}   # one shade per seed
    shade2 = {sd: 1.0 - 0.45 * i for i, sd in enumerate(sorted({name.split("seed")[-1] for name in p2}))}
    colors = {"otb": "tab:blue", "grpo": "tab:orange", "surge": "tab:blue", "log_only": "tab:red"}

    def series(res, key):
        recs = res["per_step"]
        return [r["step"] for r in recs], [r.get(key, float("nan")) for r in recs]

    top = [("reward/mean", "training reward (batch mean)", False), ("grad_norm", "grad norm (pre-clipping)", False),
           ("noise/trace_sigma", "gradient noise tr Σ per token (trainer's monitor; steps with reward contrast)",
            True),
           ("cpu/trainer_step", "process CPU s of Trainer.step", False)]
    for ax, (key, title, log) in zip(axes[0], top):
        for name, res in p1.items():
            arm = name.split("-")[0]
            xs, ys = series(res, key)
            if log:  # steps without reward contrast have no policy gradient: their tr Σ is round-off, not shown
                ys = [y if y > 0 and r.get("adv/frac_zero_std_groups", 0.0) < 1.0 else float("nan")
                      for y, r in zip(ys, res["per_step"])]
            s = res["summary"]
            label = (f"{name}: greedy {s['held_out_greedy_before']:.0%} → {s['held_out_greedy_after']:.0%}"
                     if key == "reward/mean" else name)
            ax.plot(xs, ys, "-o", ms=2.5, color=colors[arm], alpha=shade[name.split("seed")[-1]], label=label)
        if log:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    bottom = [("response/length_mean", "mean response length (tokens)", False),
              ("reward/mean", "training reward (batch mean)", False),
              ("mismatch/k3", "token k3, bf16 sampler vs fp32 trainer", True),
              ("lr", "lr applied at the step", True)]
    for ax, (key, title, log) in zip(axes[1], bottom):
        for name, res in p2.items():
            arm = name.split("-")[0]
            xs, ys = series(res, key)
            ax.plot(xs, ys, styles[res["schedule"]["base_lr"]], ms=2.5, color=colors.get(arm, "k"),
                    alpha=shade2[name.split("seed")[-1]],
                    label=f"{name} (lr {res['schedule']['base_lr']:g})")
            for d in res["analysis"]["decay_steps"]:
                ax.axvline(d, color=colors.get(arm, "k"), alpha=0.3, ls="--", lw=1)
        if log:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step (dashed: decays)")
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, one-digit addition. Top: OTB vs GRPO (default config; lighter = later "
                 "seed). Bottom: length-surge runs (bf16 sampler, aggressive lr, 48 new tokens; lighter = later seed)",
                 fontsize=10)
    save_figure(fig, path, dpi=95)


def summarise(result: dict, s: Settings) -> dict:
    """Add part 1 summaries and part 2 analyses (from the stored per-step records) to `result`, and the
    across-seed view of part 1."""
    for res in result["part1"].values():
        res["summary"] = part1_summary(res)
    for res in result["part2"].values():
        res["analysis"] = part2_analysis(res, s)
    result["part1_across_seeds"] = across_seeds(result["part1"])
    return result


ACROSS = ("held_out_greedy_before", "held_out_greedy_after", "reward_last10", "reward_mean", "entropy_last5",
          "contrast_steps", "cpu_trainer_step_mean", "cpu_step_mean")


def across_seeds(p1: dict) -> dict[str, Any]:
    """Part 1 over the seeds that have both arms: per key the per-seed values of each arm, their means, and the
    per-seed OTB - GRPO differences with their mean and sample std (0 with one seed); the grad-norm cv and spikes
    over the steps with reward contrast; and the same-batch OTB/GRPO cost ratios of the runs that timed them."""
    seeds = sorted(int(k.split("seed")[-1]) for k in p1 if k.startswith("otb-") and f"grpo-{k[4:]}" in p1)
    if not seeds:
        return {}
    def val(arm, seed, key):
        s = p1[f"{arm}-seed{seed}"]["summary"]
        if key in ("cv", "spikes"):
            return s["with_contrast"]["grad_norm_cv" if key == "cv" else key]
        return s[key]

    out: dict[str, Any] = {"seeds": seeds}
    for key in (*ACROSS, "cv", "spikes"):
        per = {arm: [val(arm, sd, key) for sd in seeds] for arm in ("otb", "grpo")}
        diff = [a - b for a, b in zip(per["otb"], per["grpo"])]
        name = f"contrast_{key}" if key in ("cv", "spikes") else key
        out[name] = {"otb": per["otb"], "grpo": per["grpo"], "otb_mean": stats.mean(per["otb"]),
                     "grpo_mean": stats.mean(per["grpo"]), "diff": diff, "diff_mean": stats.mean(diff),
                     "diff_std": statistics.stdev(diff) if len(diff) > 1 else 0.0}
    timed = {k: v["timing"] for k, v in p1.items() if v.get("timing")}
    out["same_batch_cost"] = {k: {"cpu_ratio": v["cpu_ratio_otb_over_grpo"], "wall_ratio": v["wall_ratio_otb_over_grpo"],
                                  "cpu_otb": v["cpu_otb"], "cpu_grpo": v["cpu_grpo"], "tokens": v["tokens"]}
                              for k, v in timed.items()}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fast", action="store_true", help="cut-down variant (a few steps per arm; the slow test)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the figure and the JSON")
    p.add_argument("--runs", type=Path, default=RUNS, help="folder for the run folders")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds of part 1 (default: 0)")
    p.add_argument("--skip-part1", action="store_true")
    p.add_argument("--skip-part2", action="store_true")
    p.add_argument("--no-log-only-arm", action="store_true", help="part 2 without the logging-only run")
    p.add_argument("--no-surge-arm", action="store_true",
                   help="part 2 without the schedule-enabled run (e.g. a constant-lr log-only control)")
    p.add_argument("--surge-lr-mult", type=float, default=None, help="part 2 lr as a multiple of the default (10)")
    p.add_argument("--surge-steps", type=int, default=None, help="part 2 steps per run (20)")
    p.add_argument("--surge-seed", type=int, default=None, help="part 2 seed (default: the first of --seeds)")
    p.add_argument("--name", default="smollm2-stability", help="file stem of the JSON and the figure under --out")
    p.add_argument("--from-json", type=Path, nargs="+", default=None,
                   help="no training: recompute summaries and the figure from this script's JSON(s); several "
                        "JSONs (each summarised with its own settings) are merged into one, run names must differ")
    args = p.parse_args(argv)
    if args.from_json is not None:
        merged: dict[str, Any] = {}
        for path in args.from_json:
            result = _resummarise(_floats(json.loads(path.read_text())), args.runs)
            if not merged:
                merged = result | {"sources": {}}
            else:
                for part in ("part1", "part2"):
                    clash = set(merged[part]) & set(result[part])
                    if clash:
                        raise SystemExit(f"{path}: run names {sorted(clash)} are already in {args.from_json[0]}")
                    merged[part] = {**merged[part], **result[part]}
                merged["part1_across_seeds"] = across_seeds(merged["part1"])
            merged["sources"][str(path)] = {k: result.get(k) for k in ("settings", "seconds", "git", "git_at_start",
                                                                       "load_average_end")}
        if len(args.from_json) == 1:
            merged.pop("sources")
        return _write(merged, args.out, args.name)
    import torch

    torch.set_num_threads(1)
    s = FAST if args.fast else FULL
    if args.seeds:
        s = replace(s, seeds=tuple(args.seeds))
    if args.no_log_only_arm:
        s = replace(s, surge_logging_arm=False)
    if args.no_surge_arm:
        s = replace(s, surge_schedule_arm=False)
    if args.surge_lr_mult is not None:
        s = replace(s, surge_lr_mult=args.surge_lr_mult)
    if args.surge_steps is not None:
        s = replace(s, surge_steps=args.surge_steps)
    from covrl.train.run.folder import git_state

    git = git_state()  # at the start: the code the runs import
    t0, c0 = time.perf_counter(), _cpu()
    args.runs.mkdir(parents=True, exist_ok=True)
    p1 = {} if args.skip_part1 else part1(s, args.runs)
    t1, c1 = time.perf_counter(), _cpu()
    p2 = {} if args.skip_part2 else part2(s, args.runs, s.seeds[0] if args.surge_seed is None else args.surge_seed)

    result = {
        "settings": asdict(s), "fast": args.fast,
        "config": str(DEFAULT_CONFIG.relative_to(ROOT)),
        "part1": {k: slim(v) for k, v in p1.items()},
        "part2": {k: slim(v) for k, v in p2.items()},
        "seconds": {"part1_wall": t1 - t0, "part1_cpu": c1 - c0, "part2_wall": time.perf_counter() - t1,
                    "part2_cpu": _cpu() - c1, "wall": time.perf_counter() - t0, "cpu": _cpu() - c0},
        "load_average_end": list(os.getloadavg()),
        "git_at_start": git,
    }
    return _write(summarise(result, s), args.out, args.name)


def _resummarise(result: dict, runs: Path) -> dict:
    """One of this script's JSONs with its summaries and analyses recomputed from the stored per-step records."""
    for name, res in [*result["part1"].items(), *result["part2"].items()]:
        res["per_step"] = _with_run_folder(res["per_step"], runs / name / "metrics.jsonl")
    for name, res in result["part2"].items():
        if "schedule" not in res:  # JSON of an earlier version of this script: the run folder has the config
            from covrl.config import load_config

            cfg = load_config(runs / name / "config.yaml")
            res["schedule"] = {"lr_surge": cfg.lr_surge.model_dump(), "base_lr": cfg.optim.lr,
                               "rollouts_per_step": cfg.loop.rollouts_per_step,
                               "group_size": cfg.loop.group_size}
    s = Settings(**{k: tuple(v) if k == "seeds" else v for k, v in result["settings"].items()
                    if k in Settings.__dataclass_fields__})   # older JSONs may hold removed settings
    return summarise(result, s)


def _with_run_folder(per_step: list[dict], path: Path) -> list[dict]:
    """Per-step records with KEEP keys that the JSON lacks (written by an earlier KEEP) taken from the run folder's
    metrics.jsonl, when it holds the same steps."""
    if not path.exists():
        return per_step
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if [r["step"] for r in lines] != [r["step"] for r in per_step]:
        return per_step
    return [{**{k: full[k] for k in KEEP if k in full}, **r} for r, full in zip(per_step, lines)]


def _write(result: dict, out: Path, name: str = "smollm2-stability") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(jsonable(result), indent=1))
    if result["part1"] or result["part2"]:
        figure(out / f"{name}.png", result["part1"], result["part2"])
    print(json.dumps(jsonable({"seconds": result["seconds"], "part1_across_seeds": result["part1_across_seeds"],
                                "part1": {k: v["summary"] | {"timing": v.get("timing")}
                                          for k, v in result["part1"].items()},
                                "part2": {k: v["analysis"] for k, v in result["part2"].items()}}), indent=1))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
