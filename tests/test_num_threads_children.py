"""run.num_threads reaches the processes a run starts: the environment that sizes a child's thread pools
(`thread_env`), put in place by `apply_num_threads` for every child started afterwards (a vLLM engine process,
an environment server or harness), a sampler process's budget, and the Ray sampler actors' runtime environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
from train_helpers import tiny_cfg  # noqa: E402

from covrl.train.run.threads import THREAD_ENV_VARS, apply_num_threads, sampler_thread_count, thread_env  # noqa: E402

CHILD = ("import json, os, torch; print(json.dumps({'threads': torch.get_num_threads(), "
         "'env': {k: os.environ.get(k) for k in %r}}))")


@pytest.fixture(autouse=True)
def _restore_process(monkeypatch):
    """The test changes this process's environment and torch's count: both are put back afterwards."""
    for key in (*THREAD_ENV_VARS, "TOKENIZERS_PARALLELISM"):
        monkeypatch.delenv(key, raising=False)   # registers the original value for restore
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_thread_env_caps_every_pool():
    one = thread_env(1)
    assert {k: one[k] for k in THREAD_ENV_VARS} == {k: "1" for k in THREAD_ENV_VARS}
    assert one["TOKENIZERS_PARALLELISM"] == "false"
    assert {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"} <= set(THREAD_ENV_VARS)
    three = thread_env(3)
    assert three["OMP_NUM_THREADS"] == "3" and "TOKENIZERS_PARALLELISM" not in three


def test_apply_num_threads_puts_the_limits_in_the_environment(tmp_path):
    apply_num_threads(tiny_cfg(tmp_path, **{"run.num_threads": 1}))
    assert torch.get_num_threads() == 1
    assert {k: os.environ[k] for k in THREAD_ENV_VARS} == {k: "1" for k in THREAD_ENV_VARS}
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_num_threads_null_leaves_the_environment_alone(tmp_path):
    apply_num_threads(tiny_cfg(tmp_path, **{"run.num_threads": None}))
    assert not any(k in os.environ for k in THREAD_ENV_VARS)


def test_a_child_started_after_apply_computes_with_one_thread(tmp_path):
    """What a vLLM engine process, an OpenEnv server or a verifiers harness gets: it inherits the environment."""
    keys = (*THREAD_ENV_VARS, "TOKENIZERS_PARALLELISM")
    probe = [sys.executable, "-c", CHILD % (keys,)]
    if (os.cpu_count() or 1) > 1:   # the check can fail: without the limits the child takes one thread per core
        clean = {k: v for k, v in os.environ.items() if k not in keys}
        free = json.loads(subprocess.run(probe, env=clean, capture_output=True, text=True, check=True).stdout)
        assert free["threads"] > 1
    apply_num_threads(tiny_cfg(tmp_path, **{"run.num_threads": 1}))
    child = json.loads(subprocess.run(probe, capture_output=True, text=True, check=True).stdout)
    assert child["threads"] == 1
    assert child["env"]["OMP_NUM_THREADS"] == "1" and child["env"]["TOKENIZERS_PARALLELISM"] == "false"


def test_sampler_processes_get_their_own_budget(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"run.num_threads": 1, "async_loop.sampler_threads": 2})
    assert sampler_thread_count(cfg.async_loop) == 2
    cfg = tiny_cfg(tmp_path, **{"async_loop.sampler_cpus": 3.0})
    assert sampler_thread_count(cfg.async_loop) == 3


def test_process_pool_spawns_with_the_sampler_budget(tmp_path, monkeypatch):
    """ProcessPool._spawn starts each worker under thread_env(sampler threads) and puts this process's back."""
    from covrl.train.asyncrl import process_pool

    seen = {}

    class FakeProcess:
        def __init__(self, **kwargs):
            pass

        def start(self):
            seen.update({k: os.environ.get(k) for k in (*THREAD_ENV_VARS, "TOKENIZERS_PARALLELISM")})

    class FakeCtx:
        Process = FakeProcess

    pool = process_pool.ProcessPool.__new__(process_pool.ProcessPool)
    pool.ctx, pool.cfg, pool.inboxes, pool.outbox = FakeCtx(), None, [None], None
    pool.env = thread_env(sampler_thread_count(tiny_cfg(tmp_path, **{"async_loop.sampler_threads": 1}).async_loop))
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    pool._spawn(0)
    assert seen["OMP_NUM_THREADS"] == "1" and seen["RAYON_NUM_THREADS"] == "1"
    assert seen["TOKENIZERS_PARALLELISM"] == "false"
    assert os.environ["OMP_NUM_THREADS"] == "7" and "RAYON_NUM_THREADS" not in os.environ


def test_ray_sampler_actors_start_with_the_limits(tmp_path, monkeypatch):
    """A Ray actor sizes its pools when its process starts: the limits travel in its runtime environment."""
    from covrl.train.asyncrl import ray_pool

    options = {}

    class FakeActor:
        def options(self, **kwargs):
            options.update(kwargs)
            return self

        def remote(self, *args):
            return "actor"

    class FakeRay:
        def remote(self, cls):
            return FakeActor()

    monkeypatch.setattr(ray_pool, "ray_module", lambda: FakeRay())
    cfg = tiny_cfg(tmp_path, **{"async_loop.sampler_threads": 1, "logging.engine_logs": "quiet"})
    assert ray_pool.new_sampler_actor(cfg, 0) == "actor"
    env = options["runtime_env"]["env_vars"]
    assert {k: env[k] for k in THREAD_ENV_VARS} == {k: "1" for k in THREAD_ENV_VARS}
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["VLLM_LOGGING_LEVEL"] == "ERROR" and env["TQDM_DISABLE"] == "1"   # quiet, no bars in an actor


def test_vllm_engine_process_binds_at_most_the_run_threads(monkeypatch):
    from covrl.rollout import vllm as vllm_mod

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert vllm_mod._cpu_list() == "0,1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert vllm_mod._cpu_list() == "0,1,2,3"
