"""The weight-sync alarm under injected faults (docs/training.md, "The weight-sync alarm"): an engine whose push
is skipped once, a LoRA adapter sync that does nothing, and two healthy engines that must stay quiet — the
trainer's own fp32 copy over 30 steps and a bf16 engine against the fp32 trainer (its floor is its own)."""

from __future__ import annotations

import pytest
import torch
from train_helpers import tiny_cfg

from covrl.train import prepare_run, read_jsonl, train_sync
from covrl.train.run.alarm import SyncAlarm, SyncAlarmConfig, SyncAlarmError

torch.set_num_threads(1)
OWN_COPY = {"sampler.share_weights": "never", "eval.before": False, "eval.after": False, "sync_alarm.mode": "raise"}


def _prepared(tmp_path, name, **extra):
    return prepare_run(tiny_cfg(tmp_path, **{"run.name": name, **OWN_COPY, **extra}), console=False)


def _skip_pushes(run, calls):
    """The sampler claims each new version but keeps its weights on the calls numbered in `calls` (1-based;
    call k is the push after step k)."""
    real = run.sampler.load_weights
    seen = {"n": 0}

    def load_weights(model_or_state, version):
        seen["n"] += 1
        if seen["n"] in calls:
            run.sampler.version = int(version)   # the engine says it has them: the silent failure
            return
        real(model_or_state, version)

    run.sampler.load_weights = load_weights


def test_a_skipped_push_fires_within_one_step(tmp_path):
    run = _prepared(tmp_path, "skip", **{"loop.steps": 12})
    _skip_pushes(run, calls={6})     # the push after step 6
    with pytest.raises(SyncAlarmError, match="weights did not reach the engine") as err:
        train_sync(run)
    run.close()
    assert "at step 7:" in str(err.value)          # the batch of step 7 came from the un-updated engine
    records = read_jsonl(tmp_path / "skip" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r.get("sync_alarm/fired", 0.0) == 0.0 for r in records)


def test_a_lora_adapter_sync_that_does_nothing_fires(tmp_path):
    run = _prepared(tmp_path, "lora", **{"loop.steps": 10, "model.lora": {"rank": 4, "alpha": 8}})
    _skip_pushes(run, calls=set(range(3, 100)))    # from the push after step 3 on, nothing is delivered
    with pytest.raises(SyncAlarmError):
        train_sync(run)
    run.close()
    steps = [r["step"] for r in read_jsonl(tmp_path / "lora" / "metrics.jsonl")]
    assert steps == [1, 2, 3]   # calibrated on steps 1-3; step 4 is the first from a stale adapter


def test_a_healthy_30_step_run_does_not_fire(tmp_path):
    run = _prepared(tmp_path, "healthy", **{"loop.steps": 30})
    train_sync(run)
    run.close()
    records = read_jsonl(tmp_path / "healthy" / "metrics.jsonl")
    assert len(records) == 30 and all(r.get("sync_alarm/fired", 0.0) == 0.0 for r in records)
    assert max(r["sync_alarm/ratio"] for r in records[3:]) < 100


def test_a_bf16_engine_is_its_own_floor(tmp_path):
    run = _prepared(tmp_path, "bf16", **{"loop.steps": 12, "sampler.dtype": "bfloat16"})
    train_sync(run)
    run.close()
    records = read_jsonl(tmp_path / "bf16" / "metrics.jsonl")
    fp32 = _prepared(tmp_path, "fp32", **{"loop.steps": 4})
    train_sync(fp32)
    fp32.close()
    own_floor = read_jsonl(tmp_path / "fp32" / "metrics.jsonl")[-1]["sync_alarm/floor"]
    assert records[-1]["sync_alarm/floor"] > 10 * own_floor   # bf16 rounding, calibrated: not a bug
    assert all(r.get("sync_alarm/fired", 0.0) == 0.0 for r in records)


def test_warn_mode_warns_once_per_stretch_and_the_calibration_is_checkpointed():
    alarm = SyncAlarm(SyncAlarmConfig(mode="warn", factor=10, calibration_steps=2, floor_min=1e-8))
    ok = {"mismatch/fresh_k3": 1e-7, "mismatch/fresh_rows": 4.0}
    bad = {"mismatch/fresh_k3": 1e-4, "mismatch/fresh_rows": 4.0}
    assert alarm.check(ok, 1)[1] is None and alarm.check(ok, 2)[1] is None   # calibration: floor 1e-7
    metrics, warning = alarm.check(bad, 3)
    assert metrics["sync_alarm/fired"] == 1.0 and "step 3" in warning and "1e+03 x the engine floor" in warning
    assert alarm.check(bad, 4)[1] is None and alarm.check(ok, 5)[1] is None and alarm.check(bad, 6)[1]
    copy = SyncAlarm(alarm.cfg)
    copy.load_state_dict(alarm.state_dict())
    assert copy.floor == alarm.floor == 1e-7 and copy.fired == 3
    assert alarm.check({"mismatch/fresh_k3": 1.0, "mismatch/fresh_rows": 0.0}, 7) == ({}, None)   # no fresh rows
