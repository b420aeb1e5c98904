"""`loop.mode=ray trainer.parallel=ddp|fsdp2 trainer.world_size=2`: two Ray trainer actors join one gloo group and run
covrl.train.launch.ranks (rank 0 the leader: run folder, sampler actors, logging, checkpoints; rank 1 a
follower), the code torchrun's ranks run. At staleness 0 the Ray loop trains on the sync loop's batches, so a
2-step group run resumed to 3 steps (on one process's async loop; by a new group: the slow test) has the weights and Adam
moments of a straight one-process sync run on the same global batches (the distributed tests' tolerance, 5e-6 /
1e-6) and its grad norms step for step."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import local_ray, tiny_cfg

from covrl.train.launch.modes import train_from_config
from covrl.train.parallel.wrappers import DCP_DIR
from covrl.train.run import checkpoint as ckpt
from covrl.train.run.sinks import read_jsonl

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

torch.set_num_threads(1)

# a warm-up long enough that every step has rewards to learn from (a non-zero gradient), staleness 0 (the Ray
# loop then equals the sync loop), and 2 trainer actors + 1 sampler actor inside a 2-CPU Ray instance
COMMON = {"sft_warmup.steps": 60, "sft_warmup.lr": 3e-3, "eval.before": False, "eval.after": False,
          "checkpoint.at_end": True}
GROUP = {"loop.mode": "ray", "trainer.parallel": "ddp", "trainer.world_size": 2,
         "async_loop.max_staleness_steps": 0, "async_loop.trainer_cpus": 0.5, "async_loop.sampler_cpus": 0.5}


def _final(run_dir):
    path = ckpt.latest_checkpoint(run_dir)
    state = ckpt.load_state(path)["trainer"]
    return load_file(str(path / "model" / "model.safetensors")), state["optimizer"]["state"], state["rollouts"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A straight 3-step one-process sync run: its final weights, Adam state and data clock, and grad norms."""
    tmp_path = tmp_path_factory.mktemp("straight")
    assert train_from_config(tiny_cfg(tmp_path, **COMMON, **{"run.name": "one"})) == 0
    grad_norms = [r["grad_norm"] for r in read_jsonl(tmp_path / "one" / "metrics.jsonl")]
    assert all(g > 0 for g in grad_norms), grad_norms   # every step moves the weights: the comparison bites
    return _final(tmp_path / "one"), grad_norms


def _group_then_resume(tmp_path, straight, resume: dict, mode: str = "ddp") -> None:
    with local_ray(tmp_path):
        assert train_from_config(tiny_cfg(tmp_path, **COMMON, **{**GROUP, "run.name": "group", "loop.steps": 2,
                                                                 "trainer.parallel": mode})) == 0
        summary = json.loads((tmp_path / "group" / "summary.json").read_text())
        assert summary["trainer"] == {"parallel": mode, "world_size": 2} and summary["steps"] == 2
        assert (ckpt.latest_checkpoint(tmp_path / "group") / DCP_DIR).is_dir() == (mode == "fsdp2")
        assert train_from_config(tiny_cfg(tmp_path, **COMMON, **resume, **{"run.name": "group"}), resume=True) == 0
    summary = json.loads((tmp_path / "group" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["resumed_from"]
    assert [p.name for p in tmp_path.iterdir() if (p / "summary.json").exists()] == ["group"]   # rank 0's only
    (want, want_opt, want_rollouts), grad_norms = straight
    records = read_jsonl(tmp_path / "group" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["grad_norm"] for r in records] == pytest.approx(grad_norms, rel=1e-4, abs=1e-6)
    got, got_opt, got_rollouts = _final(tmp_path / "group")
    assert got_rollouts == want_rollouts == 48
    weight_diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    moment_diff = max(float((got_opt[i][s] - want_opt[i][s]).abs().max()) for i in want_opt
                      for s in ("exp_avg", "exp_avg_sq"))
    print(f"ray group (2 {mode} actors, 2 steps) resumed to 3 by {resume} vs one process: "
          f"weights {weight_diff:.2g}, Adam moments {moment_diff:.2g}")
    assert weight_diff <= 5e-6 and moment_diff <= 1e-6, (weight_diff, moment_diff)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_ray_trainer_group_equals_one_process(tmp_path, straight, mode):
    """2 steps on the group, then --resume on one process (2 -> 1) to step 3: the local async loop, which
    restores the queue and the sampler's RNG position from the group's checkpoint as the Ray loop does (fsdp2:
    from the torch.distributed.checkpoint shards)."""
    _group_then_resume(tmp_path, straight, {"loop.mode": "async", "async_loop.max_staleness_steps": 0}, mode)


@pytest.mark.slow
def test_ray_trainer_group_resumes_on_a_new_group(tmp_path, straight):
    """2 steps on the group, then a new group (new actors, a new rendezvous) resumes to step 3 (2 -> 2)."""
    _group_then_resume(tmp_path, straight, GROUP)


@pytest.mark.slow
def test_ray_trainer_group_killed_rank_exits_6(tmp_path, monkeypatch):
    """Rank 1's actor SIGKILLs itself in step 2's backward (covrl.train.faults; the env reaches the actors through
    the local Ray instance): rank 0's collective breaks, it records exit code 6 in summary.json and the driver
    returns it, well inside trainer.timeout_s."""
    monkeypatch.setenv("COVRL_FAULT", "backward:2")
    monkeypatch.setenv("COVRL_FAULT_RANK", "1")
    with local_ray(tmp_path):
        code = train_from_config(tiny_cfg(tmp_path, **COMMON, **GROUP, **{"run.name": "killed", "loop.steps": 3,
                                                                           "trainer.timeout_s": 60}))
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert code == 6 and summary["status"] == "failed" and summary["exit_code"] == 6, summary
    assert "another rank died" in summary["reason"]
