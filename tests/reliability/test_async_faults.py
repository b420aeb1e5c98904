"""Faults in the asynchronous loop (covrl.train.asyncrl.source): the rollout queue and the chunks in flight are
saved with every checkpoint, so a dead process or a dead sampler worker loses nothing.

- the trainer process dies mid-run (emulated async schedule, staleness 1: the queue holds rollouts of an older
  policy at the checkpoint): the resumed run equals the uninterrupted one bit for bit;
- the sampler thread dies: the run stops (no restart), the checkpoints stay complete, and `--resume`
  finishes with every step trained once;
- a sampler process is killed: it is restarted and its chunk generated again (up to
  `async_loop.max_worker_restarts`; past that the run stops like the thread case);
- Ray (slow, `-m "slow and ray"`): a sampler actor is killed mid-run; it is restarted like a process."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from _reliability_tiny import TINY, comparable, final_weights, metrics, tiny_overrides

from covrl.config import load_config
from covrl.train.run import checkpoint as ckpt


class ProcessDied(BaseException):
    """Stands in for SIGKILL in-process: nothing is written after it (no summary, no checkpoint)."""


def overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return tiny_overrides(tmp_path, name, "logging.console=false", "sft_warmup.steps=0", "loop.mode=async",
                          "async_loop.chunk_prompts=2", *extra)


def run(tmp_path: Path, name: str, *extra: str, resume: bool = False) -> int:
    from covrl.train.launch.modes import train_from_config

    torch.set_num_threads(1)
    return train_from_config(load_config(TINY, overrides(tmp_path, name, *extra)), resume=resume)


def assert_clock(run_dir: Path, steps: int = 4, rows: int = 16) -> None:
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["rollouts"] for r in records] == [float(rows * (i + 1)) for i in range(steps)]
    state = ckpt.load_state(ckpt.latest_checkpoint(run_dir))
    assert state["trainer"]["rollouts"] == steps * rows
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_process_death_with_a_full_queue_resumes_bit_exactly(tmp_path, monkeypatch):
    from covrl.train.step import trainer as trainer_module

    assert run(tmp_path, "ref", "async_loop.emulate=true") == 0
    real_step = trainer_module.Trainer.step
    calls = {"n": 0}

    def dying_step(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:  # after checkpoint 32; the queue holds step-3 rollouts of policy version 1
            raise ProcessDied
        return real_step(self, batch)

    monkeypatch.setattr(trainer_module.Trainer, "step", dying_step)
    with pytest.raises(ProcessDied):
        run(tmp_path, "victim", "async_loop.emulate=true")
    monkeypatch.undo()
    saved = ckpt.load_state(ckpt.latest_checkpoint(tmp_path / "victim"))
    queue = saved["async"]["manager"]["chunks"] if "async" in saved else None
    assert queue, f"the checkpoint holds no rollout queue (keys: {sorted(saved)})"
    assert run(tmp_path, "victim", "async_loop.emulate=true", resume=True) == 0
    assert_clock(tmp_path / "victim")
    assert [comparable(r) for r in metrics(tmp_path / "victim")] == [comparable(r) for r in metrics(tmp_path / "ref")]
    got, want = final_weights(tmp_path / "victim"), final_weights(tmp_path / "ref")
    assert all(torch.equal(got[k], want[k]) for k in want)


def _kill_sampler_thread_at_call(monkeypatch, n: int) -> None:
    from covrl.rollout import hf as sampler_module

    real = sampler_module.HFSampler.generate
    calls = {"n": 0}

    def generate(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError("sampler worker died (injected)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sampler_module.HFSampler, "generate", generate)


def test_sampler_thread_death_stops_the_run_and_the_queue_survives(tmp_path, monkeypatch):
    _kill_sampler_thread_at_call(monkeypatch, 3)
    assert run(tmp_path, "dead-sampler") == 5   # stopped cleanly (exit 5), not a traceback
    monkeypatch.undo()
    run_dir = tmp_path / "dead-sampler"
    assert ckpt.list_checkpoints(run_dir), "no complete checkpoint survived"
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert run(tmp_path, "dead-sampler", resume=True) == 0
    assert_clock(run_dir)


def test_sampler_thread_death_ends_covrl_train_cleanly(tmp_path, monkeypatch, capsys):
    _kill_sampler_thread_at_call(monkeypatch, 3)
    rc = run(tmp_path, "dead-sampler-cli")           # must return an exit code, not raise
    assert rc != 0 and "sampler" in capsys.readouterr().err
    status = json.loads((tmp_path / "dead-sampler-cli" / "summary.json").read_text())["status"]
    assert status != "running"


# slow (~12-25 s): the default suite keeps the restart budget's test of the same pool
@pytest.mark.slow
def test_killed_sampler_process_is_restarted_and_its_chunk_generated_again(tmp_path, monkeypatch):
    """SIGKILL the sampler process while the trainer works: the pool notices, requeues the chunk it was
    generating (same tickets and randomness) and starts a new process; the run finishes with every step
    trained once, the restart is logged, and the queue's counters balance (a chunk completed twice raises)."""
    import os
    import signal

    from covrl.train.asyncrl import process_pool
    from covrl.train.step import trainer as trainer_module

    pools: list = []
    real_init, real_step = process_pool.ProcessPool.__init__, trainer_module.Trainer.step

    def init(self, state):
        real_init(self, state)
        pools.append(self)

    calls = {"n": 0}

    def step(self, batch):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(pools[0].procs[0].pid, signal.SIGKILL)
            # the pool notices on its next dispatch or poll; on a fast trainer the last steps could otherwise be
            # logged before it does (the restart itself is what this test checks, not its timing)
            deadline = time.monotonic() + 120
            while pools[0].restarts == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        return real_step(self, batch)

    monkeypatch.setattr(process_pool.ProcessPool, "__init__", init)
    monkeypatch.setattr(trainer_module.Trainer, "step", step)
    assert run(tmp_path, "killed-worker", "async_loop.local_backend=process", "async_loop.max_staleness_steps=2") == 0
    run_dir = tmp_path / "killed-worker"
    assert_clock(run_dir)
    assert metrics(run_dir)[-1]["async/worker_restarts"] == 1.0
    manager = ckpt.load_state(ckpt.latest_checkpoint(run_dir))["async"]["manager"]
    assert manager["consumed"] == 4 * 16 and manager["dropped"] == 0
    assert manager["accepted"] + manager["running"] - manager["consumed"] == sum(c["size"] for c in manager["chunks"])


def test_sampler_process_deaths_beyond_the_restart_budget_stop_the_run(tmp_path, monkeypatch):
    import os
    import signal

    from covrl.train.asyncrl import process_pool
    from covrl.train.step import trainer as trainer_module

    pools: list = []
    real_init, real_step = process_pool.ProcessPool.__init__, trainer_module.Trainer.step

    def init(self, state):
        real_init(self, state)
        pools.append(self)

    def step(self, batch):
        os.kill(pools[0].procs[0].pid, signal.SIGKILL)
        return real_step(self, batch)

    monkeypatch.setattr(process_pool.ProcessPool, "__init__", init)
    monkeypatch.setattr(trainer_module.Trainer, "step", step)
    assert run(tmp_path, "dying", "async_loop.local_backend=process", "async_loop.max_worker_restarts=0") == 5
    assert ckpt.list_checkpoints(tmp_path / "dying"), "no complete checkpoint survived"


@pytest.mark.slow
@pytest.mark.ray
def test_ray_sampler_actor_killed_mid_run_then_resume(tmp_path, monkeypatch):
    """The sampler actor is killed right after the first checkpoint: the pool starts a new actor, the chunk the
    dead one held is generated again, and the run trains every step once."""
    ray = pytest.importorskip("ray")
    import shutil
    import tempfile

    from covrl.train.asyncrl import ray_pool
    from covrl.train.run.folder import Run

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    temp = Path(tempfile.mkdtemp(prefix="covrl-ray-"))
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False)
    try:
        extra = ("loop.mode=ray", "async_loop.trainer_actor=false", "async_loop.sampler_cpus=1", "loop.steps=6")
        real_start, real_save = ray_pool.start_sampler_actors, Run.save_checkpoint
        actors: list = []
        killed: list = []

        def start(cfg):
            actors[:] = real_start(cfg)
            return actors

        def save_then_kill(self):
            path = real_save(self)
            if not killed and actors:
                ray.kill(actors[0], no_restart=True)
                killed.append(path.name)
            return path

        monkeypatch.setattr(ray_pool, "start_sampler_actors", start)
        monkeypatch.setattr(Run, "save_checkpoint", save_then_kill)
        assert run(tmp_path, "ray", *extra) == 0   # the pool starts a new actor and regenerates its chunk
        monkeypatch.undo()
        run_dir = tmp_path / "ray"
        assert killed, "the run ended before its first checkpoint"
        assert_clock(run_dir, steps=6)
        assert metrics(run_dir)[-1]["async/worker_restarts"] == 1.0
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_reward_error_met_by_an_async_sampler_is_a_bad_input_exit(tmp_path, backend):
    """The reward runs in the sampler worker: its error must end `covrl train` as in the sync loop (exit 2,
    'failed', the function named), not as a dead worker (exit 5)."""
    from _reliability_tiny import REWARDS

    name = f"bad-reward-{backend}"
    rc = run(tmp_path, name, f"async_loop.local_backend={backend}", f"task.reward={REWARDS}:crash",
             "task.reward_errors=raise")
    assert rc == 2
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 2 and "crash" in summary["reason"], summary
