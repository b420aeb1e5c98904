"""Reproductions `lr-surge` and `otb`: the fast variants end to end (files, finite numbers, criteria, the schedule
firing at a forced surge) and hand-checked cases of the analysis helpers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from studies.__main__ import run_one
from studies.lr_surge import lr_surge
from studies.otb import otb


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _records(rewards, lengths, k3, trace=None, ratio=None, triggered=None):
    out = []
    for i, (r, length, k) in enumerate(zip(rewards, lengths, k3)):
        rec = {"step": i + 1, "reward/mean": r, "response/length_mean": length, "mismatch/k3": k,
               "kl_seq": k * length, "grad_norm": 1.0, "lr_surge/ratio": 1.0 if ratio is None else ratio[i],
               "lr_surge/triggered": 0.0 if triggered is None else triggered[i], "lr_surge/scale": 1.0}
        if trace is not None:
            rec["noise/trace_sigma"] = trace[i]
        out.append(rec)
    return out


def test_analyse_run_hand_case():
    s = lr_surge.Settings(seeds=1, steps=10, lr=1e-3, sft_steps=0, prompts_per_step=2, group_size=2,
                          max_new_tokens=4, surge_warmup_steps=3, surge_cooldown_steps=1, force_surge_step=None,
                          eval_prompts=1, collapse_head=2, collapse_tail=2)
    rewards = [0.6, 0.4, 0.5, 0.5, 0.4, 0.2, 0.1, 0.1, 0.1, 0.1]
    lengths = [2.0] * 10
    k3 = [1.0, 1.0, 1.0, 1.0, 1.0, 13.0, 13.0, 1.0, 1.0, 1.0]
    trace = [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 40.0, 1.0, 1.0]
    # ratio crosses 1.2 at step 2 (before warm-up, ignored) and at step 5
    ratio = [1.0, 1.5, 1.0, 1.1, 1.3, 1.0, 1.0, 1.0, 1.0, 1.0]
    # start score 0.5, end score 0.2 < 0.5 x 0.5 -> collapsed
    a = lr_surge.analyse_run(_records(rewards, lengths, k3, trace, ratio), s, surge_ratio=1.2,
                             score_before=0.5, score_after=0.2)
    assert a["collapsed"] is True
    assert a["reward_head"] == pytest.approx(0.5) and a["reward_tail"] == pytest.approx(0.1)
    assert a["onset_surge"] == 5
    # trailing 3-step mean of k3: step 6 -> (1+1+13)/3 = 5 = 5 x head mean 1
    assert a["onset_mismatch_rise"] == 6
    # trailing mean of trace: step 8 -> (2+2+40)/3 = 14.7 >= 10
    assert a["onset_noise_rise"] == 8
    # 2-step moving average of the training reward first < 0.5 x start score = 0.25 at step 7: (0.2+0.1)/2
    assert a["onset_reward_fall"] == 7
    steady = lr_surge.analyse_run(_records([0.5] * 10, lengths, [1.0] * 10, [1.0] * 10), s, surge_ratio=1.2,
                                  score_before=0.5, score_after=0.3)
    assert steady["collapsed"] is False
    assert steady["onset_surge"] is None and steady["onset_mismatch_rise"] is None


def test_grad_norm_stability_and_tokens_to_target_hand_cases():
    st = otb.grad_norm_stability([1.0, 1.0, 0.0, 1.0, 4.0, 1.0, 2.9])
    assert st["spikes"] == 1.0          # 4 > 3 x median(1, 1, 1); 2.9 < 3 x median(1, 1, 4, 1) = 3
    assert st["zero_grad_steps"] == 1.0
    assert st["grad_norm_max"] == 4.0
    curve = [(0, 0.2), (100, 0.4), (200, 0.7), (300, 0.6)]
    assert otb.tokens_to_target(curve, 0.6) == 200
    assert otb.tokens_to_target(curve, 0.2) == 0
    assert otb.tokens_to_target(curve, 0.9) is None
    assert otb._saving(200, 800) == pytest.approx(0.75)
    assert otb._saving(None, 800) is None and otb._saving(200, 0) is None


def _finite_numbers(x) -> bool:
    if isinstance(x, dict):
        return all(_finite_numbers(v) for v in x.values())
    if isinstance(x, list):
        return all(_finite_numbers(v) for v in x)
    if isinstance(x, float):
        return not math.isinf(x)
    return True


def test_lr_surge_fast_forced_surge_fires_the_schedule(tmp_path: Path):
    res = run_one("lr-surge", tmp_path, fast=True, seed=0)
    out = tmp_path / "lr-surge"
    assert (out / "result.json").is_file() and (out / "report.md").is_file()
    assert res.figures and all((out / f).is_file() and (out / f).stat().st_size > 0 for f in res.figures)
    assert res.passed, [(c.name, c.measured) for c in res.criteria if not c.passed]
    names = " ".join(c.name for c in res.criteria)
    assert "forced surge" in names and "finite" in names
    surge = res.numbers["per_arm"]["surge"]["per_seed"][0]
    constant = res.numbers["per_arm"]["constant"]["per_seed"][0]
    forced = lr_surge.FAST.force_surge_step
    assert surge["decay_steps"][0] == forced and surge["final_lr_scale"] < 1.0
    assert constant["decay_steps"] == [] and constant["final_lr_scale"] == 1.0
    # the forced EOS suppression makes the surge visible in the logged lengths
    assert constant["length_max_of_batch_means"] >= lr_surge.FAST.max_new_tokens - 1
    data = json.loads((out / "result.json").read_text())
    assert _finite_numbers(data["numbers"])


def test_otb_fast_runs_every_arm_on_the_same_budget(tmp_path: Path):
    res = run_one("otb", tmp_path, fast=True, seed=0)
    out = tmp_path / "otb"
    assert (out / "result.json").is_file() and (out / "report.md").is_file()
    assert res.figures and all((out / f).is_file() for f in res.figures)
    assert res.passed, [(c.name, c.measured) for c in res.criteria if not c.passed]
    per_arm = res.numbers["per_arm"]
    assert set(per_arm) == set(otb.ARMS)
    for entry in per_arm.values():
        for row in entry["per_seed"]:
            assert row["tokens"] >= otb.FAST.token_budget
            assert math.isfinite(row["grad_norm_std"]) and math.isfinite(row["var_power_mean"])
            assert len(row["eval_curve"]) == otb.FAST.checkpoints + 1
    # the trainer's noise split is measured (exactly 0 only on steps with no reward contrast)
    assert max(row["trace_sigma_median"] for e in per_arm.values() for row in e["per_seed"]) > 0
    # N = 32 makes 8x the rollouts per step, so it needs fewer steps for the same token budget
    assert per_arm["grpo_n32"]["steps"][0] < per_arm["grpo_n4"]["steps"][0]
    cost = res.numbers["step_cost_otb_vs_grpo"]
    assert cost["cpu_otb"] > 0 and cost["cpu_grpo"] > 0


def test_lr_surge_long_fast_arms_and_forced_surge(tmp_path: Path):
    """The long-response design's fast variant: the length arm decays at the forced surge, the constant arm
    never, the step-decay arm runs at peak × floor from its decay step on."""
    from studies.lr_surge import lr_surge_long

    res = run_one("lr-surge-long", tmp_path, fast=True, seed=0)
    assert res.passed, [(c.name, c.measured) for c in res.criteria if not c.passed]
    per_arm = res.numbers["per_arm"]
    assert set(per_arm) == set(lr_surge_long.FAST.arms)
    assert per_arm["length"]["decay_steps"][0][0] == lr_surge_long.FAST.force_surge_step
    # the forced EOS suppression makes the responses run to the budget
    assert per_arm["constant"]["length_max_of_batch_means"][0] >= lr_surge_long.FAST.max_new_tokens - 1
    assert _finite_numbers(json.loads((tmp_path / "lr-surge-long" / "result.json").read_text())["numbers"])


# slow (~10 s): the lr-surge study's fast run keeps the long-run harness in the default suite
@pytest.mark.slow
def test_otb_long_fast_runs_every_arm_on_the_same_budget(tmp_path: Path):
    from studies.otb import otb_long

    res = run_one("otb-long", tmp_path, fast=True, seed=0)
    assert res.passed, [(c.name, c.measured) for c in res.criteria if not c.passed]
    per_arm = res.numbers["per_arm"]
    assert set(per_arm) == set(otb.ARMS)
    for entry in per_arm.values():
        for row in entry["per_seed"]:
            assert row["tokens"] >= otb_long.FAST.token_budget
            assert len(row["eval_curve"]) == otb_long.FAST.checkpoints + 1
    assert per_arm["grpo_n32"]["steps"][0] < per_arm["grpo_n4"]["steps"][0]
