"""run.num_threads (covrl.train.run.threads): the auto rule on hand cases, the config's errors, the run record, and
that every entry point that builds a run sets its thread count through apply_num_threads."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
from train_helpers import tiny_cfg

from covrl.config import ConfigError, build_config, load_config
from covrl.train.config import RunConfig
from covrl.train.run import threads as threads_mod
from covrl.train.run.threads import ThreadChoice, auto_threads, reserved_cores, resolve_num_threads


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def machine(monkeypatch, *, cores: int, cpu_count: int, load1: float, local: str | None = None) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cpu_count)
    monkeypatch.setattr(os, "getloadavg", lambda: (load1, load1, load1))
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)


@pytest.mark.parametrize(("cores", "cpu_count", "load1", "reserved", "local", "expected"), [
    (2, 2, 0.3, 0, 1, 2),     # idle 2-core box: both cores
    (2, 2, 0.6, 0, 1, 1),     # one core busy (rounded)
    (2, 2, 4.7, 0, 1, 1),     # overloaded: never below one thread
    (16, 16, 3.2, 0, 4, 3),   # (16 - 3) free cores among 4 torchrun ranks
    (4, 16, 8.0, 0, 1, 2),    # 4 of 16 CPUs: our share of the machine's load is 8 * 4/16 = 2
    (8, 8, 0.0, 2, 2, 3),     # two cores kept for this run's sampler processes, the rest for 2 ranks
    (2, 2, None, 0, 1, 2),    # no load average (Windows): all usable cores
])
def test_auto_rule_hand_cases(cores, cpu_count, load1, reserved, local, expected):
    assert auto_threads(cores, cpu_count, load1, reserved, local) == expected


def test_resolve_auto_reads_affinity_load_and_local_world_size(monkeypatch):
    machine(monkeypatch, cores=12, cpu_count=12, load1=1.8, local="2")
    choice = resolve_num_threads("auto", reserved=2)
    assert choice == ThreadChoice(threads=4, setting="auto", auto=True, cores=12, cpu_count=12, load1=1.8,
                                  reserved=2, local_processes=2)   # (12 - 2 - 2) // 2
    machine(monkeypatch, cores=12, cpu_count=12, load1=1.8, local="not-a-number")
    assert resolve_num_threads("auto").threads == 10


def test_resolve_pinned_and_default(monkeypatch):
    machine(monkeypatch, cores=2, cpu_count=2, load1=9.0)   # ignored unless auto
    assert resolve_num_threads(3) == ThreadChoice(threads=3, setting=3, auto=False)
    torch.set_num_threads(2)
    assert resolve_num_threads(None) == ThreadChoice(threads=2, setting=None, auto=False)
    with pytest.raises(ValueError, match="run.num_threads"):
        resolve_num_threads("fast")


def test_auto_is_the_default_and_shipped_configs_pin_one():
    assert RunConfig().num_threads == "auto"
    configs = Path(__file__).resolve().parents[2] / "configs"
    for name in ("tiny", "default", "calculator"):   # their measured numbers were taken on one thread
        assert load_config(configs / f"{name}.yaml").run.num_threads == 1, name


@pytest.mark.parametrize("bad", [0, -2, "fast", True, 2.5, 4096])
def test_bad_values_name_the_field(bad):
    with pytest.raises(ConfigError, match=r"run\.num_threads.*'auto'") as err:
        build_config({"run": {"num_threads": bad}})
    assert repr(bad) in str(err.value)


@pytest.mark.parametrize(("over", "expected"), [
    ({"loop.mode": "async", "async_loop.local_backend": "process", "async_loop.num_samplers": 2}, 2),
    ({"loop.mode": "async", "async_loop.local_backend": "process", "async_loop.num_samplers": 2,
      "async_loop.sampler_threads": 3}, 6),
    ({"loop.mode": "async", "async_loop.local_backend": "thread", "async_loop.num_samplers": 2}, 0),
    ({"loop.mode": "ray", "async_loop.num_samplers": 3}, 3),
    ({"loop.mode": "ray", "async_loop.num_samplers": 3, "async_loop.ray_address": "auto"}, 0),
    ({"loop.mode": "sync"}, 0),
])
def test_reserved_cores_of_own_sampler_processes(over, expected):
    assert reserved_cores(tiny_cfg(None, **over)) == expected


def _summary(run) -> dict:
    return json.loads((run.run_dir / "summary.json").read_text())


def test_run_records_the_resolved_count(tmp_path, monkeypatch):
    from covrl.train.run.folder import prepare_run

    machine(monkeypatch, cores=3, cpu_count=3, load1=1.2)   # auto: 3 - 1 = 2 threads
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "auto", "run.num_threads": "auto", "sft_warmup.steps": 0}), console=False)
    try:
        assert torch.get_num_threads() == 2
        summary = _summary(run)
    finally:
        run.close()
    assert summary["torch_threads"] == 2
    assert summary["num_threads"] == {"threads": 2, "setting": "auto", "auto": True, "cores": 3, "cpu_count": 3,
                                      "load1": 1.2, "reserved": 0, "local_processes": 1}
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "one", "run.num_threads": 1, "sft_warmup.steps": 0}), console=False)
    try:
        assert torch.get_num_threads() == 1
        summary = _summary(run)
    finally:
        run.close()
    assert summary["torch_threads"] == 1
    assert summary["num_threads"]["threads"] == 1 and summary["num_threads"]["auto"] is False


class _Applied(Exception):
    """Raised by the spy: the entry point reached apply_num_threads (nothing after it needs to run)."""


def _entry_points(tmp_path):
    """Each entry point that builds a run, called with a tiny config of run.num_threads=1."""
    from covrl.api import TrainingClient
    from covrl.train.launch import cli_eval
    from covrl.train.launch.ranks import follow
    from covrl.train.launch.ray import TrainerActor
    from covrl.train.run.folder import prepare_run

    cfg = tiny_cfg(tmp_path, **{"run.num_threads": 1})
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    eval_args = argparse.Namespace(run=None, checkpoint=str(hf), config=None, task=None, no_sampled=True, out=None,
                                   overrides=["model.source=tiny", "run.num_threads=1"])
    return {
        "prepare_run": lambda: prepare_run(cfg, console=False),
        "TrainingClient.from_config": lambda: TrainingClient.from_config(cfg, state_dir=tmp_path / "api"),
        "covrl eval": lambda: cli_eval.run(eval_args),
        "distributed follower": lambda: follow(cfg, channel=None),
        "Ray trainer actor": lambda: TrainerActor(cfg.model_dump(mode="json"), None, False).train(),
    }


def test_every_entry_point_goes_through_apply_num_threads(tmp_path, monkeypatch):
    seen = []

    def spy(setting, *, reserved=0):
        seen.append(setting)
        raise _Applied

    monkeypatch.setattr(threads_mod, "resolve_num_threads", spy)
    for name, call in _entry_points(tmp_path).items():
        before = len(seen)
        with pytest.raises(_Applied):
            call()
        assert len(seen) == before + 1 and seen[-1] == 1, name
