"""examples/api_rl_loop.py (a loop on covrl.api) and the reproductions' harness (covrl.experiment.harness, a client of
covrl.api) against `covrl train` (prepare_run + train_sync) on the tiny preset, same seed: the same sampled
tokens, and every per-step metric both report is identical."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from covrl.api import resolve_config
from covrl.experiment import Arm, ArmRunner
from covrl.train.run.driver import train_sync
from covrl.train.run.folder import prepare_run
from covrl.train.run.sinks import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
# short: 40 warm-up steps, 3 RL steps of 4 prompts x 8 answers; everything else is the preset except the
# gradient-noise monitor, which makes the trainer split a one-micro-batch step into two halves (a trainer-only
# diagnostic: the same gradient summed in another order, so metrics would differ by float rounding)
SHORT = {"loop.steps": STEPS, "loop.prompts_per_step": 4, "sft_warmup.steps": 40, "logging.noise_scale": False}
TIMING = ("time/", "tokens_per_s", "train_tokens_per_s", "generate_tokens_per_s")


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def library_config(tmp_path, overrides, name="library"):
    return resolve_config("tiny", {**overrides, "run.output_dir": str(tmp_path), "run.name": name,
                                   "logging.console": False, "logging.curves": False, "checkpoint.at_end": False,
                                   "eval.sampled": False, "logging.diagnostics": False})


def library_run(tmp_path, overrides):
    run = prepare_run(library_config(tmp_path, overrides), console=False)
    batches, generate = [], run.sampler.generate

    def recording_generate(*args, **kwargs):
        batch = generate(*args, **kwargs)
        if not kwargs.get("greedy"):
            batches.append(batch)
        return batch

    run.sampler.generate = recording_generate
    train_sync(run)
    run.close()
    return read_jsonl(run.run_dir / "metrics.jsonl"), batches, run


@pytest.mark.parametrize("extra", [{}, {"algorithm.loss": "ppo_clip", "algorithm.advantage": "grpo",
                                        "loop.prompts_per_step": 16}],
                         ids=["preset-otb-covariance", "grpo-ppo_clip-2-microbatches"])
def test_api_loop_equals_covrl_train(tmp_path, extra):
    overrides = {**SHORT, **extra}
    lib, batches, run = library_run(tmp_path, overrides)
    example = load_example("api_rl_loop")
    ex = example.train("tiny", {**overrides, "run.output_dir": str(tmp_path)}, log=lambda *_: None)
    mine = ex["history"]
    assert len(lib) == len(mine) == STEPS
    compared, worst = set(), 0.0
    for step, (a, b, batch) in enumerate(zip(mine, lib, batches), start=1):
        assert a["response_ids"].equal(batch.response_ids), f"step {step}: sampled tokens differ"
        shared = [k for k in a if k in b and isinstance(b[k], (int, float)) and not k.startswith(TIMING)
                  and k not in ("step",)]
        for k in shared:
            if not (math.isnan(a[k]) and math.isnan(b[k])):
                assert a[k] == b[k], f"step {step}: {k}: api {a[k]!r} vs covrl train {b[k]!r}"
        compared.update(shared)
    for must in ("loss", "grad_norm", "reward/mean", "accuracy", "entropy", "mismatch/k3", "adv/std", "lr",
                 "loss/ratio_mean"):
        assert must in compared, f"{must} was not compared"
    lib_sd, mine_sd = run.model.state_dict(), ex["client"].model.state_dict()
    worst = max(float((lib_sd[k] - mine_sd[k]).abs().max()) for k in lib_sd)
    print(f"{len(compared)} metrics identical over {STEPS} steps; final weights max |diff| {worst}")
    assert worst == 0.0


SELECTED = {**SHORT, "selection.strategy": "thompson", "selection.group_sizes": "adaptive", "task.n_train": 12}


@pytest.mark.parametrize("overrides", [SHORT, SELECTED], ids=["default", "selection"])
def test_repro_harness_equals_covrl_train(tmp_path, overrides):
    """ArmRunner (SamplingClient.sample + score_rollouts + TrainingClient.train_step + weight push) takes the
    steps `covrl train` takes: same tokens, every metric identical, same final weights — also with prompt
    selection and adaptive group sizes (the harness chooses prompts through the run's selector)."""
    lib, batches, run = library_run(tmp_path, overrides)
    with ArmRunner(Arm(library_config(tmp_path, overrides, "harness"), tmp_path / "harness")) as runner:
        steps = []
        runner.drive(STEPS, log=False, after_step=lambda step, rec: steps.append(step))
        assert runner.client.version == STEPS
        mine_sd = {k: v.clone() for k, v in runner.run.model.state_dict().items()}
    assert len(steps) == len(lib) == STEPS
    for step, lib_rec, batch in zip(steps, lib, batches):
        assert step.batch.response_ids.equal(batch.response_ids), f"step {step.index}: sampled tokens differ"
        for k, v in step.metrics.items():
            if k in lib_rec and isinstance(v, (int, float)) and not k.startswith(TIMING) and not math.isnan(v):
                assert v == lib_rec[k], f"step {step.index}: {k}: harness {v!r} vs covrl train {lib_rec[k]!r}"
    assert all(torch.equal(v, mine_sd[k]) for k, v in run.model.state_dict().items())
    if overrides is SELECTED:   # the selector did choose: group sizes varied in some step
        assert any(len(set(torch.bincount(s.batch.group_ids).tolist())) > 1 for s in steps)
