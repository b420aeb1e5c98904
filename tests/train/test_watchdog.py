"""A run whose step makes no progress says what it waits for (run.stall_warning_s), once per period, and keeps
going; a healthy run says nothing."""

from __future__ import annotations

import time

import torch
from train_helpers import tiny_cfg

from covrl.train.run.driver import train_sync
from covrl.train.run.folder import prepare_run
from covrl.train.run.watchdog import ProgressWatchdog


def test_a_stalled_phase_is_reported_with_where_the_loop_is():
    reports = []
    dog = ProgressWatchdog(0.2, reports.append, lambda: "the queue holds 0 of 16")
    dog.beat("waiting for the step's rollouts", 4, ask_source=True)
    time.sleep(0.75)
    dog.beat("training step")
    time.sleep(0.1)
    dog.stop()
    assert 2 <= len(reports) <= 4, reports       # the first report, then one per further period
    assert reports[0].startswith("no progress for 0.2 s: waiting for the step's rollouts (step 5); the queue holds")
    assert "test_watchdog.py" in reports[0] or "covrl/" in reports[0]


def test_a_describe_that_fails_does_not_fail_the_report():
    reports = []

    def broken():
        raise RuntimeError("gone")
    dog = ProgressWatchdog(0.1, reports.append, broken)
    dog.beat("waiting for the step's rollouts", ask_source=True)
    time.sleep(0.35)
    dog.stop()
    assert reports and "could not say" in reports[0]


def test_a_slow_sampler_is_reported_and_the_run_completes(tmp_path, capsys):
    torch.set_num_threads(1)
    cfg = tiny_cfg(tmp_path, **{"run.stall_warning_s": 0.3, "loop.steps": 2})
    run = prepare_run(cfg, console=False)
    generate = run.sampler.generate
    run.sampler.generate = lambda *a, **k: (time.sleep(0.8), generate(*a, **k))[1]
    try:
        summary = train_sync(run)
    finally:
        run.close()
    err = capsys.readouterr().err
    assert summary["status"] == "completed"
    assert "no progress for" in err and "waiting for the step's rollouts (step 1)" in err
    assert "the hf sampler generates" in err and "covrl/train/run/sources.py" in err


def test_a_healthy_run_says_nothing(tmp_path, capsys):
    torch.set_num_threads(1)
    cfg = tiny_cfg(tmp_path, **{"run.stall_warning_s": 30, "loop.steps": 2})
    run = prepare_run(cfg, console=False)
    try:
        train_sync(run)
    finally:
        run.close()
    assert "no progress" not in capsys.readouterr().err


def test_ranks_that_never_join_are_named_with_what_to_check(monkeypatch, capsys):
    """A launch of 2 ranks where the second never starts: rank 0 says it is waiting, then gives up after
    trainer.timeout_s with an error naming the ranks, the address and what to check."""
    import pytest
    import torch.distributed as dist

    from covrl.train.parallel.wrappers import RendezvousError, TrainerConfig, free_port, init_process_group

    port = free_port()
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RendezvousError, match=f"rank 0 of 2: the other ranks did not join at 127.0.0.1:{port}"):
        init_process_group(TrainerConfig(parallel="ddp", timeout_s=3.0))
    assert not dist.is_initialized()
    assert "is waiting at 127.0.0.1" in capsys.readouterr().err


def test_a_vllm_engine_that_does_not_start_says_so(monkeypatch, tmp_path, capsys):
    """An engine whose start takes long says so while it waits; one that fails names the folder and options."""
    import types

    import pytest

    from covrl.rollout import vllm as backend

    def failing_llm(**kwargs):
        time.sleep(0.4)
        raise OSError("no space for the KV cache")
    monkeypatch.setattr(backend, "require", lambda *a: types.SimpleNamespace(LLM=failing_llm))
    monkeypatch.setattr(backend, "ENGINE_START_NOTICE_S", 0.1)
    with pytest.raises(RuntimeError, match="the vLLM engine did not start .* OSError: no space for the KV cache"):
        backend._engine(tmp_path, "float32", backend.VLLMEngineConfig(), 20, None)
    assert "has been starting for" in capsys.readouterr().err
