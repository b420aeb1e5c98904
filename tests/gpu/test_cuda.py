"""The GPU path (marked `cuda`; skipped without a CUDA device; scripts/gpu_check.sh runs them): the trainer's
step on CUDA equals the CPU step to fp32 rounding, bf16 autocast steps are finite and close, AdamW is the fused
kernel, the hf sampler's eager and compiled (static-cache) decode run on the device with the eager loop's
tokens, and a short run with run.device=auto trains on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

from covrl.models import ModelConfig, load_model  # noqa: E402
from covrl.rollout import SamplerConfig, build_sampler  # noqa: E402
from covrl.train import Trainer  # noqa: E402

SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128, "max_positions": 64}
PROMPTS = [[5, 76, 12, 84], [13, 9, 84], [20, 21, 22, 23, 24, 25, 84]]


def _tiny():
    return load_model(ModelConfig(source="tiny", tiny=SHAPE), seed=3)


def _cfg(**over):
    from covrl.config import load_config

    base = {"optim.micro_batch_size": 8, "loop.prompts_per_step": 3, "loop.group_size": 4, "optim.lr": 1e-3}
    return load_config(None, [f"{k}={v}" for k, v in {**base, **over}.items()])


def _batch(model, tok):
    sampler = build_sampler(SamplerConfig(max_new_tokens=8, share_weights="never"), model, tok)
    batch = sampler.generate(PROMPTS, 4, generator=torch.Generator().manual_seed(0))
    return batch.scored(torch.arange(len(batch)).remainder(2).float())


def test_a_step_on_cuda_equals_the_cpu_step():
    model, tok = _tiny()
    batch = _batch(model, tok)
    gpu_model = copy.deepcopy(model).cuda()
    cpu = Trainer(model, _cfg()).step(batch)
    gpu_trainer = Trainer(gpu_model, _cfg())
    gpu = gpu_trainer.step(batch)
    assert getattr(gpu_trainer.optimizer, "defaults", {}).get("fused") is True
    assert cpu.metrics["loss"] == pytest.approx(gpu.metrics["loss"], rel=1e-4, abs=1e-6)
    for p, q in zip(model.parameters(), gpu_model.parameters()):
        assert torch.allclose(p, q.cpu(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["bf16", "bf16_fp32_head"])
def test_bf16_autocast_steps_are_finite_and_close(mode):
    model, tok = _tiny()
    batch = _batch(model, tok)
    full = Trainer(copy.deepcopy(model).cuda(), _cfg()).step(batch)
    mixed = Trainer(copy.deepcopy(model).cuda(), _cfg(**{"trainer.autocast": mode})).step(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in mixed.metrics.values() if isinstance(v, float))
    assert mixed.metrics["loss"] == pytest.approx(full.metrics["loss"], abs=2e-2)


@pytest.mark.parametrize("compile", [False, True])
def test_the_hf_sampler_decodes_on_the_device(compile):
    model, tok = _tiny()
    model = model.cuda()
    cfg = SamplerConfig(max_new_tokens=8, share_weights="never", compile=compile, compile_backend="eager")
    batch = build_sampler(cfg, model, tok).generate(PROMPTS, 2, generator=torch.Generator("cuda").manual_seed(0))
    eager = build_sampler(SamplerConfig(max_new_tokens=8, share_weights="never"), model, tok).generate(
        PROMPTS, 2, generator=torch.Generator("cuda").manual_seed(0))
    assert batch.response_ids.shape[0] == 6 and torch.equal(batch.response_ids, eager.response_ids)


def test_a_short_run_trains_on_the_gpu(tmp_path):
    from covrl.config import load_preset
    from covrl.train.run.driver import train_sync
    from covrl.train.run.folder import prepare_run

    cfg = load_preset("tiny", {"run.output_dir": str(tmp_path), "run.device": "auto", "loop.steps": 3,
                               "sft_warmup.steps": 5, "task.n_eval": 8, "logging.console": False,
                               "logging.curves": False})
    run = prepare_run(cfg, console=False)
    try:
        assert next(run.model.parameters()).device.type == "cuda"
        summary = train_sync(run)
    finally:
        run.close()
    assert summary["status"] == "completed"
