"""Length-surge LR decay (docs/theory.md §8): trigger logic on synthetic signal streams."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from covrl.train.step.lr_surge import TRIGGER_METRICS, LengthSurgeConfig, LengthSurgeSchedule

B = 8  # rollouts per step in these streams


def run_stream(schedule: LengthSurgeSchedule, signals, start_step: int = 0):
    """Feed one value per step; the data clock after step s is (s + 1) * B. Returns the list of metric dicts."""
    return [schedule.update(x, (start_step + i + 1) * B) for i, x in enumerate(signals)]


def triggered_steps(outs, start_step: int = 0):
    return [start_step + i for i, o in enumerate(outs) if o["lr_surge/triggered"] == 1.0]


def make(**kw) -> LengthSurgeSchedule:
    return LengthSurgeSchedule(LengthSurgeConfig(enabled=True, **kw), rollouts_per_step=B)


def test_fires_at_the_surge_and_only_there():
    signals = [10.0] * 50 + [13.0] * 5 + [10.0] * 20   # +30% at step 50
    outs = run_stream(make(warmup_steps=20, cooldown_steps=100), signals)
    assert triggered_steps(outs) == [50]
    assert outs[49]["lr_surge/scale"] == 1.0 and outs[50]["lr_surge/scale"] == 0.5 and outs[-1]["lr_surge/scale"] == 0.5
    assert outs[50]["lr_surge/ratio"] == pytest.approx(1.3)


def test_below_ratio_does_not_fire():
    signals = [10.0] * 50 + [11.9] * 3   # ratio 1.19 < 1.2 (the EMA barely moves in 3 steps)
    outs = run_stream(make(warmup_steps=20), signals)
    assert triggered_steps(outs) == []
    assert all(o["lr_surge/scale"] == 1.0 for o in outs)


def test_ema_is_updated_after_the_test():
    s = make(ema_alpha=0.5, warmup=0, cooldown=0)
    first = s.update(10.0, B)
    assert first["lr_surge/ratio"] == 1.0 and first["lr_surge/ema"] == 10.0 and first["lr_surge/triggered"] == 0.0
    second = s.update(20.0, 2 * B)
    # the surge is compared with the EMA before it absorbs the surge: 20/10, then EMA = 0.5*10 + 0.5*20
    assert second["lr_surge/ratio"] == 2.0 and second["lr_surge/ema"] == 15.0 and second["lr_surge/triggered"] == 1.0
    third = s.update(15.0, 3 * B)
    assert third["lr_surge/ratio"] == 1.0 and third["lr_surge/ema"] == 15.0


def test_warmup_blocks_early_surges():
    signals = [10.0] * 5 + [20.0] + [10.0] * 30 + [20.0]   # surges at steps 5 and 36; warm-up = 20 steps
    outs = run_stream(make(warmup_steps=20, cooldown_steps=0), signals)
    assert triggered_steps(outs) == [36]
    assert outs[5]["lr_surge/ratio"] == pytest.approx(2.0)  # it was seen, just not acted on


def test_cooldown_counts_rollouts():
    # surges every 10 steps; cooldown 25 steps = 200 rollouts -> decays at steps 30, 60 (40 and 50 too early)
    signals = [10.0] * 100
    for s in (30, 40, 50, 60):
        signals[s] = 30.0
    outs = run_stream(make(warmup_steps=20, cooldown_steps=25, max_decays=10, floor=0.01), signals)
    assert triggered_steps(outs) == [30, 60]
    # the same cooldown given directly in rollouts
    outs2 = run_stream(make(warmup_steps=20, cooldown=25 * B, max_decays=10, floor=0.01), signals)
    assert triggered_steps(outs2) == [30, 60]


def test_floor_clamps_and_stops_decays():
    signals = [10.0] * 100
    for s in (30, 40, 50, 60):
        signals[s] = 30.0
    outs = run_stream(make(warmup_steps=20, cooldown_steps=0, factor=0.5, floor=0.3, max_decays=10), signals)
    # 1 -> 0.5 -> 0.3 (clamped at the floor) -> no further decay: the scale is already at the floor
    assert triggered_steps(outs) == [30, 40]
    assert outs[30]["lr_surge/scale"] == 0.5 and outs[40]["lr_surge/scale"] == 0.3 and outs[-1]["lr_surge/scale"] == 0.3


def test_max_decays():
    signals = [10.0] * 100
    for s in (30, 40, 50, 60, 70):
        signals[s] = 30.0
    outs = run_stream(make(warmup_steps=20, cooldown_steps=0, max_decays=3), signals)
    assert triggered_steps(outs) == [30, 40, 50]
    assert outs[-1]["lr_surge/scale"] == 0.125 and outs[-1]["lr_surge/decays"] == 3.0


def test_disabled_logs_but_never_decays():
    signals = [10.0] * 50 + [20.0]
    s = LengthSurgeSchedule(LengthSurgeConfig(enabled=False), rollouts_per_step=B)
    outs = run_stream(s, signals)
    assert outs[-1]["lr_surge/ratio"] == pytest.approx(2.0)
    assert all(o["lr_surge/triggered"] == 0.0 and o["lr_surge/scale"] == 1.0 for o in outs) and s.scale == 1.0


def test_state_dict_round_trip_mid_stream_is_identical():
    signals = [10.0 + (i % 7) * 0.3 for i in range(200)]
    for s in (40, 55, 90, 150):
        signals[s] = 25.0
    kw = dict(warmup_steps=20, cooldown_steps=12, max_decays=3)
    reference = run_stream(make(**kw), signals)
    first = make(**kw)
    run_stream(first, signals[:60])
    state = json.loads(json.dumps(first.state_dict()))   # survives serialisation
    resumed = make(**kw)
    resumed.load_state_dict(state)
    assert run_stream(resumed, signals[60:], start_step=60) == reference[60:]
    assert triggered_steps(reference) == [40, 55, 90]


def test_state_keeps_the_clock_it_started_with():
    s = make(warmup_steps=3, cooldown_steps=4)
    state = s.state_dict()
    other = LengthSurgeSchedule(LengthSurgeConfig(enabled=True, warmup_steps=3, cooldown_steps=4), rollouts_per_step=64)
    other.load_state_dict(state)
    assert (other.warmup, other.cooldown) == (3 * B, 4 * B)


def test_steps_need_rollouts_per_step():
    with pytest.raises(ValueError, match="rollouts_per_step"):
        LengthSurgeSchedule(LengthSurgeConfig(enabled=True))
    s = LengthSurgeSchedule(LengthSurgeConfig(warmup=7, cooldown=11))   # both in rollouts: no conversion needed
    assert (s.warmup, s.cooldown) == (7, 11)
    assert LengthSurgeConfig(cooldown_steps=5, warmup_steps=2).in_rollouts(16) == (32, 80)


def test_config_validation():
    with pytest.raises(ValidationError, match="extra"):
        LengthSurgeConfig(decay=0.5)
    with pytest.raises(ValidationError, match="ratio"):
        LengthSurgeConfig(ratio=1.0)
    with pytest.raises(ValidationError, match="trigger"):
        LengthSurgeConfig(trigger="loss")
    with pytest.raises(ValidationError, match="factor"):
        LengthSurgeConfig(factor=1.0)


def test_bad_updates_raise():
    s = make(warmup=0, cooldown=0)
    s.update(1.0, 16)
    with pytest.raises(ValueError, match="must not decrease"):
        s.update(1.0, 8)
    with pytest.raises(ValueError, match="signal"):
        s.update(float("nan"), 24)
    with pytest.raises(ValueError, match="signal"):
        s.update(-1.0, 24)


def test_update_from_metrics_reads_the_trigger_signal():
    s = LengthSurgeSchedule(LengthSurgeConfig(enabled=True, trigger="noise", warmup=0, cooldown=0))
    assert s.cfg.metric_key == TRIGGER_METRICS["noise"]
    s.update_from_metrics({TRIGGER_METRICS["noise"]: 1.0, "other": 5.0}, 8)
    out = s.update_from_metrics({TRIGGER_METRICS["noise"]: 2.0}, 16)
    assert out["lr_surge/triggered"] == 1.0 and s.scale == 0.5
    custom = LengthSurgeSchedule(LengthSurgeConfig(trigger="mismatch", signal_metric="corr/k3", warmup=0, cooldown=0))
    with pytest.raises(KeyError, match="corr/k3"):
        custom.update_from_metrics({"mismatch/k3": 1.0}, 8)


@settings(max_examples=60, deadline=None)
@given(signals=st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=80),
       warmup=st.integers(0, 10), cooldown=st.integers(0, 10), max_decays=st.integers(0, 4),
       floor=st.sampled_from([0.05, 0.125, 0.5]), ratio=st.floats(1.01, 2.0))
def test_invariants_on_random_streams(signals, warmup, cooldown, max_decays, floor, ratio):
    s = make(warmup_steps=warmup, cooldown_steps=cooldown, max_decays=max_decays, floor=floor, ratio=ratio)
    outs = run_stream(s, signals)
    steps = triggered_steps(outs)
    assert len(steps) <= max_decays
    assert all((t + 1) * B >= warmup * B for t in steps)
    assert all((b - a) >= cooldown for a, b in zip(steps, steps[1:]))
    assert all(outs[t]["lr_surge/ratio"] >= ratio for t in steps)
    expected_scale = 1.0
    for t, o in enumerate(outs):
        if t in steps:
            expected_scale = max(floor, expected_scale * 0.5)
        assert o["lr_surge/scale"] == expected_scale >= floor
    assert s.scale == expected_scale
