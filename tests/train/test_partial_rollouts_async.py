"""Partial rollouts in the threaded async loop (async_loop.partial_rollouts): equal to sync at staleness 0, a
push that lands mid-generation reaches the chunk in flight (its later tokens carry the new version and the
ledger counts them), resume loses and repeats nothing, and the combinations that cannot work are refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tests.train.test_async_loop import comparable, run_async, run_sync, tiny_cfg

from covrl.train.asyncrl.config import AsyncLoopConfig
from covrl.train.asyncrl.source import prepare_async_run, token_lag_metrics, train_async
from covrl.train.run.sinks import read_jsonl


def test_at_staleness_zero_partial_rollouts_equal_sync(tmp_path):
    torch.set_num_threads(1)
    cfg = tiny_cfg(tmp_path, **{"sampler.share_weights": "never"})
    sync_run, sync_summary = run_sync(cfg, "sync")
    run, summary = run_async(cfg, "partial0", AsyncLoopConfig(max_staleness_steps=0, partial_rollouts=True))
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    assert comparable(records) == comparable(read_jsonl(sync_run.run_dir / "metrics.jsonl"))
    assert all(r["async/token_lag_max"] == 0 and r["async/mixed_rows_frac"] == 0 for r in records)
    assert summary["eval_after"] == sync_summary["eval_after"]


def test_a_push_mid_generation_reaches_the_chunk_in_flight(tmp_path):
    """The chunk admitted at version 0 for step 2 is held after its second decode step until the trainer
    publishes version 1; from then on its live rows are drawn by version 1."""
    torch.set_num_threads(1)
    cfg = tiny_cfg(tmp_path, steps=3, **{"sampler.max_new_tokens": 8, "run.name": "push"})
    acfg = AsyncLoopConfig(max_staleness_steps=1, partial_rollouts=True)
    run = prepare_async_run(cfg, console=False)
    generate = run.sampler.generate
    calls, held = [], threading.Event()

    def generate_with_a_late_push(*args, refresh=None, **kwargs):
        calls.append(1)
        if len(calls) != 2 or refresh is None:
            return generate(*args, refresh=refresh, **kwargs)
        steps = {"n": 0}

        def late_refresh():
            steps["n"] += 1
            if steps["n"] != 2:
                return refresh()
            for _ in range(1200):    # after the second token: wait for step 1's weights
                newer = refresh()
                if newer is not None:
                    held.set()
                    return newer
                time.sleep(0.05)
            return None
        return generate(*args, refresh=late_refresh, **kwargs)

    run.sampler.generate = generate_with_a_late_push
    batches = []
    step = run.trainer.step
    run.trainer.step = lambda b: (batches.append(b), step(b))[1]
    summary = train_async(run, acfg=acfg)
    run.close()
    assert held.is_set() and summary["async"]["rollouts_consumed"] == 48
    second = batches[1]
    versions, mask = second.token_versions, second.train_mask > 0
    assert versions is not None and (second.policy_version == 0).all()
    position = torch.arange(versions.shape[1])[None, :].expand_as(versions)
    assert (versions[mask & (position < 2)] == 0).all() and (versions[mask & (position >= 2)] == 1).all()
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    assert records[1]["async/mixed_rows_frac"] > 0
    assert records[1]["async/token_lag_mean"] < records[1]["async/staleness_mean"]
    m = token_lag_metrics(second, 1)
    assert m["async/token_lag_max"] == 1 and m["async/token_lag_mean"] == records[1]["async/token_lag_mean"]


@pytest.mark.parametrize("over, match", [
    ({"async_loop.local_backend": "process"}, "local_backend=thread"),
    ({"sampler.compile": True}, "eager decode loop"),
    ({"task.env.name": "single_turn"}, "multi-turn"),
])
def test_what_cannot_take_weights_mid_generation_is_refused(tmp_path, over, match):
    cfg = tiny_cfg(tmp_path, **{"async_loop.partial_rollouts": True, **over})
    run = prepare_async_run(cfg, console=False)
    try:
        with pytest.raises(ValueError, match=match):
            train_async(run)
    finally:
        run.close()
