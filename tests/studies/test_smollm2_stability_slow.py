"""`python -m studies smollm2-stability`: the cut-down variant end to end on SmolLM2-135M (slow: ~3 min on one
core), and the schedule-consistency check on hand-made records (fast)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from covrl.train.step.lr_surge import LengthSurgeConfig

ROOT = Path(__file__).resolve().parents[2]


def _script():
    from studies.smollm2_stability import smollm2_stability

    return smollm2_stability


def _records(ratios, scales, triggered, decays, lrs, b=4):
    return [{"step": i + 1, "rollouts": (i + 1) * b, "lr_surge/ratio": r, "lr_surge/scale": s,
             "lr_surge/triggered": t, "lr_surge/decays": d, "lr": lr}
            for i, (r, s, t, d, lr) in enumerate(zip(ratios, scales, triggered, decays, lrs))]


def test_schedule_consistent_hand_case():
    m = _script()
    sched = LengthSurgeConfig(enabled=True, warmup_steps=2, cooldown_steps=2, factor=0.5, floor=0.25, max_decays=3)
    # ratio >= 1.2 at steps 1 (first step: never), 2 (warm-up reached: decay), 3 (cooldown: no), 4 (decay to the
    # floor 0.25), 6 (at the floor: no)
    ratios = [1.5, 1.3, 1.3, 1.25, 1.0, 2.0]
    good = _records(ratios, [1, 0.5, 0.5, 0.25, 0.25, 0.25], [0, 1, 0, 1, 0, 0], [0, 1, 1, 2, 2, 2],
                    [1.0, 1.0, 0.5, 0.5, 0.25, 0.25])
    out = m.schedule_consistent(good, sched, 1.0, 4)
    assert out == {"ok": True, "problems": [], "decays": 2}
    # a decay the rule forbids (cooldown), a missed decay, a wrong scale, and an lr that ignores the scale
    bad_cooldown = _records(ratios, [1, 0.5, 0.25, 0.25, 0.25, 0.25], [0, 1, 1, 0, 0, 0], [0, 1, 2, 2, 2, 2],
                            [1.0, 1.0, 0.5, 0.25, 0.25, 0.25])
    assert not m.schedule_consistent(bad_cooldown, sched, 1.0, 4)["ok"]
    missed = [dict(r) for r in good]
    missed[3].update({"lr_surge/triggered": 0, "lr_surge/decays": 1, "lr_surge/scale": 0.5})
    assert not m.schedule_consistent(missed, sched, 1.0, 4)["ok"]
    wrong_lr = [dict(r) for r in good]
    wrong_lr[2]["lr"] = 1.0
    assert any("lr" in p for p in m.schedule_consistent(wrong_lr, sched, 1.0, 4)["problems"])
    off = LengthSurgeConfig(enabled=False, warmup_steps=2, cooldown_steps=2)
    logged = _records(ratios, [1] * 6, [0] * 6, [0] * 6, [1.0] * 6)
    assert m.schedule_consistent(logged, off, 1.0, 4)["ok"]


def _summary(after, last10, cv, spikes, cpu):
    return {"held_out_greedy_before": 0.3, "held_out_greedy_after": after, "reward_last10": last10,
            "reward_mean": last10 / 2, "entropy_last5": 0.2, "contrast_steps": 20, "cpu_trainer_step_mean": cpu,
            "cpu_step_mean": cpu + 1, "with_contrast": {"grad_norm_cv": cv, "spikes": spikes}}


def test_across_seeds_hand_case():
    m = _script()
    p1 = {"otb-seed0": {"summary": _summary(0.9, 0.94, 0.6, 1.0, 3.7),
                        "timing": {"cpu_ratio_otb_over_grpo": 0.98, "wall_ratio_otb_over_grpo": 0.97,
                                   "cpu_otb": 3.4, "cpu_grpo": 3.5, "tokens": 148.0}},
          "grpo-seed0": {"summary": _summary(0.92, 0.84, 0.3, 0.0, 3.8)},
          "otb-seed1": {"summary": _summary(0.8, 0.9, 0.5, 0.0, 3.5)},
          "grpo-seed1": {"summary": _summary(0.86, 0.7, 0.4, 2.0, 3.6)},
          "otb-seed2": {"summary": _summary(0.5, 0.5, 0.5, 0.0, 3.5)}}   # no GRPO arm: left out
    out = m.across_seeds(p1)
    assert out["seeds"] == [0, 1]
    after = out["held_out_greedy_after"]
    assert after["otb"] == [0.9, 0.8] and after["grpo"] == [0.92, 0.86]
    assert math.isclose(after["otb_mean"], 0.85) and math.isclose(after["grpo_mean"], 0.89)
    # differences -0.02 and -0.06: mean -0.04, sample std sqrt(2 * 0.02^2 / 1) = 0.0283
    assert math.isclose(after["diff_mean"], -0.04) and math.isclose(after["diff_std"], 0.02 * math.sqrt(2))
    assert out["contrast_cv"]["diff"] == pytest.approx([0.3, 0.1])
    assert out["contrast_spikes"]["otb_mean"] == 0.5 and out["contrast_spikes"]["grpo_mean"] == 1.0
    assert out["same_batch_cost"] == {"otb-seed0": {"cpu_ratio": 0.98, "wall_ratio": 0.97, "cpu_otb": 3.4,
                                                    "cpu_grpo": 3.5, "tokens": 148.0}}
    assert m.across_seeds({"otb-seed3": p1["otb-seed0"]}) == {}


def test_part2_names_keep_the_first_pass_and_separate_other_lrs():
    m = _script()
    assert m.part2_name("surge", 0, 10.0) == "surge-seed0"
    assert m.part2_name("log_only", 0, 5.0) == "log_only-lr5x-seed0"
    assert m.part2_name("surge", 1, 2.5) == "surge-lr2.5x-seed1"


def test_part2_can_run_the_log_only_arm_alone(tmp_path, monkeypatch):
    """--no-surge-arm: a single constant-lr log-only run (the control for the lr 5x pair), nothing trained here."""
    from dataclasses import replace

    from covrl.config import load_config

    m = _script()
    seen = []

    def fake_drive(cfg, **kw):
        seen.append(cfg)
        return {"records": []}

    monkeypatch.setattr(m, "drive", fake_drive)
    s = replace(m.FULL, surge_lr_mult=2.5, surge_steps=40, surge_schedule_arm=False)
    out = m.part2(s, tmp_path, 0)
    assert list(out) == ["log_only-lr2.5x-seed0"] and len(seen) == 1
    cfg = seen[0]
    assert cfg.lr_surge.enabled is False and cfg.loop.steps == 40 and cfg.run.seed == 0
    assert math.isclose(cfg.optim.lr, 2.5 * load_config(m.DEFAULT_CONFIG).optim.lr)
    assert out["log_only-lr2.5x-seed0"]["schedule"]["base_lr"] == cfg.optim.lr
    # the default still runs both arms, schedule first
    seen.clear()
    assert list(m.part2(replace(s, surge_schedule_arm=True), tmp_path, 0)) == ["surge-lr2.5x-seed0",
                                                                              "log_only-lr2.5x-seed0"]
    with pytest.raises(ValueError, match="neither arm"):
        m.part2(replace(s, surge_logging_arm=False), tmp_path, 0)


def test_from_json_refuses_a_merge_with_clashing_run_names(tmp_path):
    m = _script()
    stored = ROOT / "studies" / "smollm2_stability" / "smollm2-stability.json"
    with pytest.raises(SystemExit, match="already in"):
        m.main(["--from-json", str(stored), str(stored), "--out", str(tmp_path), "--runs", str(tmp_path)])


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_cut_down_run(tmp_path):
    m = _script()
    s = m.FAST
    result = m.main(["--fast", "--out", str(tmp_path), "--runs", str(tmp_path / "runs")])
    assert (tmp_path / "smollm2-stability.png").stat().st_size > 10_000
    on_disk = json.loads((tmp_path / "smollm2-stability.json").read_text())
    assert set(on_disk["part1"]) == {"otb-seed0", "grpo-seed0"}
    assert set(on_disk["part2"]) == {"surge-seed0", "log_only-seed0"}

    # part 1: both arms trained every step with finite metrics, from the same weights on the same first batch
    p1 = result["part1"]
    for name, res in p1.items():
        steps = res["per_step"]
        assert [r["step"] for r in steps] == list(range(1, s.steps + 1)), name
        for r in steps:
            assert r["skipped"] == 0.0 and r["policy_version"] == r["step"], (name, r)
            for key in ("reward/mean", "grad_norm", "entropy", "noise/power", "noise/signal", "adv/var_power",
                        "cpu/trainer_step", "cpu/generate", "noise/grad_sq"):
                assert _finite(r[key]), (name, key, r.get(key))
            assert r["cpu/trainer_step"] > 0 and r["grad_norm"] >= 0
        assert (tmp_path / "runs" / name / "metrics.jsonl").read_text().count("\n") == s.steps
        assert 0.0 <= res["after"]["greedy"]["accuracy"] <= 1.0
    otb, grpo = p1["otb-seed0"]["per_step"], p1["grpo-seed0"]["per_step"]
    assert p1["otb-seed0"]["before"]["greedy"] == p1["grpo-seed0"]["before"]["greedy"]
    for key in ("reward/mean", "response/length_mean", "response_tokens"):
        assert otb[0][key] == grpo[0][key], key
    # the estimators differ, so the updates do (GRPO divides by the group std, OTB weights by the realised energy)
    assert any(not math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-6) for a, b in zip(otb, grpo))
    timing = p1["otb-seed0"]["timing"]
    assert timing["cpu_otb"] > 0 and timing["cpu_grpo"] > 0 and _finite(timing["cpu_ratio_otb_over_grpo"])

    # part 2: the schedule's logged scale, decays and lr follow its rule; the forced surge makes it decay;
    # the log-only run never changes the lr; the two runs agree until the first decay changes the lr
    p2 = result["part2"]
    surge, log_only = p2["surge-seed0"], p2["log_only-seed0"]
    for res in (surge, log_only):
        assert res["analysis"]["schedule_consistent"]["ok"], res["analysis"]["schedule_consistent"]
        for r in res["per_step"]:
            for key in ("reward/mean", "response/length_mean", "mismatch/k3", "kl_seq", "lr", "lr_surge/scale"):
                assert _finite(r[key]), (key, r.get(key))
            assert r["mismatch/k3"] > 1e-6  # bf16 sampler vs fp32 trainer: a real mismatch (fp32 floor ~5e-11)
        forced = [r for r in res["per_step"] if r["step"] >= s.force_surge_step]
        assert all(r["response/length_mean"] == s.surge_max_new_tokens for r in forced)
    decays = surge["analysis"]["decay_steps"]
    assert decays and decays[0] <= s.force_surge_step
    assert surge["per_step"][-1]["lr"] < surge["per_step"][0]["lr"]
    assert log_only["analysis"]["decay_steps"] == []
    assert {r["lr"] for r in log_only["per_step"]} == {log_only["per_step"][0]["lr"]}
    for a, b in zip(surge["per_step"][: decays[0]], log_only["per_step"][: decays[0]]):
        for key in ("reward/mean", "response/length_mean", "mismatch/k3", "lr"):
            assert a[key] == b[key], (a["step"], key)
