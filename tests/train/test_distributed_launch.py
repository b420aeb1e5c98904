"""`torchrun --nproc-per-node 2 -m covrl train ... trainer.parallel=ddp|fsdp2` end to end on the tiny model: the
run completes, rank 0 owns the folder, and a checkpoint of the 2-rank run (DDP: the single-file path; FSDP2:
torch.distributed.checkpoint shards in dcp/) resumes on one process (2 -> 1) to the same weights and optimizer
state as a straight one-process run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from covrl.train.parallel.wrappers import DCP_DIR
from covrl.train.run import checkpoint as ckpt

torch.set_num_threads(1)

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
# a warm-up long enough that each of the 3 steps has rewards to learn from (a non-zero gradient, asserted in
# `straight`): a comparison of runs that never move their weights would prove nothing
OVERRIDES = [
    "run.num_threads=1", "model.source=tiny", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
    "model.tiny.num_heads=2", "model.tiny.intermediate_size=64", "model.tiny.max_positions=48",
    "task.name=arithmetic", "task.arithmetic.num_terms=2", "task.chat_template=false", "task.n_train=64",
    "task.n_eval=8", "sampler.max_new_tokens=4", "sft_warmup.steps=60", "sft_warmup.lr=3e-3",
    "sft_warmup.batch_size=16", "optim.lr=3e-3",
    "loop.prompts_per_step=4", "loop.group_size=4", "eval.max_prompts=4", "logging.curves=false",
    "logging.progress_bar=false", "logging.noise_scale=false",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _covrl(args, *, ranks: int | None, cwd: Path, env: dict | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    head = [sys.executable, "-m", "covrl"] if ranks is None else [
        TORCHRUN, "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1", "--master-port", str(_port()),
        "-m", "covrl"]
    return subprocess.run([*head, "train", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _final(run_dir: Path):
    path = ckpt.latest_checkpoint(run_dir)
    state = ckpt.load_state(path)["trainer"]
    return load_file(str(path / "model" / "model.safetensors")), state["optimizer"]["state"], state["rollouts"]


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """A straight one-process run of 3 steps: its final weights, Adam state and data clock."""
    tmp_path = tmp_path_factory.mktemp("straight")
    run = _covrl(["--config", str(CONFIG), *OVERRIDES, f"run.output_dir={tmp_path}", "loop.steps=3", "--name",
                  "one"], ranks=None, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    grad_norms = [json.loads(line)["grad_norm"] for line in (tmp_path / "one" / "metrics.jsonl").open()]
    assert all(g > 0 for g in grad_norms), grad_norms
    return _final(tmp_path / "one")


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found")
# fsdp2 under torchrun with a one-process resume is also what the async test below runs (in the default suite);
# this variant is slow-only to keep the default suite near 10 minutes
# slow (~25-35 s with its one-process run): torchrun end to end; resuming on another world size stays in the
# default suite (tests/train/test_distributed_checkpoint.py)
@pytest.mark.parametrize("mode", [pytest.param("ddp", marks=pytest.mark.slow), pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_torchrun_run_resumes_on_one_process(tmp_path, straight, mode):
    base = ["--config", str(CONFIG), *OVERRIDES, f"run.output_dir={tmp_path}"]
    two = _covrl([*base, "loop.steps=2", f"trainer.parallel={mode}", "--name", "two"], ranks=2, cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("run folder:") == 1    # only rank 0 speaks
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert (ckpt.latest_checkpoint(tmp_path / "two") / DCP_DIR).is_dir() == (mode == "fsdp2")
    resumed = _covrl(["--resume", "--name", str(tmp_path / "two"), "loop.steps=3", "trainer.parallel=none"],
                     ranks=None, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    w2, opt2, r2 = _final(tmp_path / "two")
    w1, opt1, r1 = straight
    assert r1 == r2 == 48
    weight_diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    moment_diff = max(float((opt1[i][s] - opt2[i][s]).abs().max()) for i in opt1 for s in ("exp_avg", "exp_avg_sq"))
    assert weight_diff <= 5e-6 and moment_diff <= 1e-6, (weight_diff, moment_diff)


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found")
def test_killed_rank_stops_the_run_and_resume_loses_nothing(tmp_path, straight):
    """Rank 1 SIGKILLs itself mid-step 3 (in its backward; COVRL_FAULT_RANK=1), after the checkpoint of step 2:
    the 2-rank run ends on its own well inside the timeout, torchrun's report names the killed rank, rank 0
    records exit code 6 (another rank died) in summary.json, and `--resume` on one process redoes step 3 from
    that checkpoint to the straight one-process run's weights and Adam state."""
    base = ["--config", str(CONFIG), *OVERRIDES, f"run.output_dir={tmp_path}", "loop.steps=3"]
    t0 = time.perf_counter()
    run = _covrl([*base, "checkpoint.every_rollouts=32", "trainer.parallel=ddp", "trainer.timeout_s=60", "--name",
                  "killed"], ranks=2, cwd=tmp_path, env={"COVRL_FAULT": "backward:3", "COVRL_FAULT_RANK": "1"},
                 timeout=90)   # a hang would raise TimeoutExpired
    elapsed = time.perf_counter() - t0
    assert run.returncode == 1, (run.returncode, run.stderr[-3000:])   # torchrun: a child failed
    assert "rank      : 1" in run.stderr and "(SIGKILL)" in run.stderr      # its report: the root cause
    assert "another rank died (exit code 6)" in run.stderr
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 6, summary
    latest = ckpt.latest_checkpoint(tmp_path / "killed")
    assert latest.name == ckpt.checkpoint_name(32)
    resumed = _covrl(["--resume", "--name", str(tmp_path / "killed"), "trainer.parallel=none"], ranks=None,
                     cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]   # step 3 once: the killed attempt's partial step left nothing behind
    w2, opt2, r2 = _final(tmp_path / "killed")
    w1, opt1, r1 = straight
    assert r1 == r2 == 48
    weight_diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    moment_diff = max(float((opt1[i][s] - opt2[i][s]).abs().max()) for i in opt1 for s in ("exp_avg", "exp_avg_sq"))
    print(f"killed run stopped after {elapsed:.1f} s; resumed vs straight: {weight_diff:.2g} / {moment_diff:.2g}")
    assert weight_diff <= 5e-6 and moment_diff <= 1e-6, (weight_diff, moment_diff)


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found")
def test_a_native_abort_in_a_rank_prints_its_python_stack(tmp_path):
    """A rank that dies of SIGABRT (as a C++ std::terminate in torch or gloo does: one line, "terminate called
    ...") leaves its Python stack in the run's stderr: faulthandler is on in every rank of a distributed run."""
    run = _covrl(["--config", str(CONFIG), *OVERRIDES, f"run.output_dir={tmp_path}", "loop.steps=2",
                  "trainer.parallel=ddp", "trainer.timeout_s=60", "--name", "aborted"], ranks=2, cwd=tmp_path,
                 env={"COVRL_FAULT": "backward:1:abort", "COVRL_FAULT_RANK": "1"}, timeout=120)
    assert run.returncode == 1, (run.returncode, run.stderr[-3000:])
    assert "Fatal Python error: Aborted" in run.stderr, run.stderr[-3000:]
    assert 'trainer.py", line' in run.stderr and "in step" in run.stderr, run.stderr[-3000:]   # where it died


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found")
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_torchrun_async_loop_equals_sync_and_resumes(tmp_path, straight, mode):
    """loop.mode=async (the thread pool of samplers on rank 0, unchanged) with a 2-rank trainer at staleness 0
    (fsdp2: the full weights gathered at each publish, in the loop's thread): 2 steps, then `--resume` on one process's async loop to step 3 = the straight one-process sync run; the
    staleness accounting is the async loop's (async/* metrics, staleness 0)."""
    base = ["--config", str(CONFIG), *OVERRIDES, f"run.output_dir={tmp_path}", "loop.mode=async",
            "async_loop.max_staleness_steps=0"]
    two = _covrl([*base, "loop.steps=2", f"trainer.parallel={mode}", "--name", "async"], ranks=2, cwd=tmp_path)
    assert two.returncode == 0, (two.stdout[-2000:], two.stderr[-6000:])   # faulthandler's stacks on an abort
    summary = json.loads((tmp_path / "async" / "summary.json").read_text())
    assert summary["trainer"] == {"parallel": mode, "world_size": 2}
    resumed = _covrl(["--resume", "--name", str(tmp_path / "async"), "loop.steps=3", "trainer.parallel=none"],
                     ranks=None, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["async/staleness_max"] == 0 and r["staleness"] == 0 and r["async/queue_rollouts"] == 0
               for r in records)
    w2, opt2, r2 = _final(tmp_path / "async")
    w1, opt1, r1 = straight
    assert r1 == r2 == 48
    weight_diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    moment_diff = max(float((opt1[i][s] - opt2[i][s]).abs().max()) for i in opt1 for s in ("exp_avg", "exp_avg_sq"))
    print(f"async 2-rank {mode} (2 steps) + 1 resumed step vs straight sync: {weight_diff:.2g} / {moment_diff:.2g}; "
          f"grad norms {[round(r['grad_norm'], 4) for r in records]}")
    assert weight_diff <= 5e-6 and moment_diff <= 1e-6, (weight_diff, moment_diff)
