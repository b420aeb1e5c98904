"""Sequence packing (trainer.packing): a packed step equals the padded one — loss, gradients and every metric to
1e-5 in fp32 — on mixed lengths, for every loss and aggregation mode, with shared or per-row prompts, LoRA, a
token budget that splits the batch, and under DDP (docs/training.md, "Sequence packing")."""

from __future__ import annotations

import pytest
import torch
from train_helpers import TIME_KEYS, TIME_PREFIXES, synthetic_batch, tiny_cfg

from covrl.math import AGGREGATIONS, LOSS_SPECS
from covrl.models import tiny_llama
from covrl.train.step.micro import plan_packed
from covrl.train.step.trainer import Trainer

torch.set_num_threads(1)


def _model(seed=0, lora=False):
    model = tiny_llama(40, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=48,
                       seed=seed)
    if lora:
        from covrl.models.loading import LoraConfig, apply_lora

        torch.manual_seed(seed)
        model = apply_lora(model, LoraConfig(rank=4, alpha=8))
    return model


def _step(cfg, batch, lora=False):
    model = _model(lora=lora)
    trainer = Trainer(model, cfg)
    captured = []
    trainer.optimizer.step = lambda *a, **k: captured.append([p.grad.detach().clone() for p in trainer.params])
    result = trainer.step(batch)
    return captured[0], result.metrics


def _same(padded, packed, tol=1e-5):
    (ga, ma), (gb, mb) = padded, packed
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, atol=tol, rtol=1e-4), float((a - b).abs().max())
    keys = [k for k in ma if not k.startswith(TIME_PREFIXES) and k not in TIME_KEYS]
    assert set(keys) <= set(mb)
    for k in keys:
        assert ma[k] == pytest.approx(mb[k], rel=1e-4, abs=tol), (k, ma[k], mb[k])


BASE = {"logging.noise_scale": False, "optim.micro_batch_size": 64}


@pytest.mark.parametrize("loss", sorted(LOSS_SPECS))
def test_every_loss_packed_equals_padded(loss):
    cfg = tiny_cfg(**{**BASE, "algorithm.loss": loss, "algorithm.advantage": "grpo"})
    batch = synthetic_batch(_model(), groups=3, group_size=4, prompt_len=6, max_len=9)
    packed = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"packing": True})})
    _same(_step(cfg, batch), _step(packed, batch))


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("share", [True, False])
def test_every_aggregation_packed_equals_padded_with_or_without_shared_prompts(agg, share):
    cfg = tiny_cfg(**{**BASE, "algorithm.agg_mode": agg, "optim.share_prompts": share})
    batch = synthetic_batch(_model(), groups=3, group_size=4, prompt_len=6, max_len=9, shared_prompts=share)
    packed = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"packing": True})})
    _same(_step(cfg, batch), _step(packed, batch))


def test_a_token_budget_splits_into_whole_groups_and_lora_packs_too():
    cfg = tiny_cfg(**{**BASE, "model.lora": {"rank": 4, "alpha": 8}})
    batch = synthetic_batch(_model(), groups=4, group_size=3, prompt_len=5, max_len=8)
    tokens = (batch.prompt_mask.sum(1) + batch.response_mask.sum(1)).long()
    plan = plan_packed(batch.group_ids, tokens, budget=int(tokens[:6].sum()))
    assert len(plan) >= 2 and all(len(mb) % 3 == 0 for mb in plan)   # whole groups of 3
    packed = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(
        update={"packing": True, "packing_tokens": int(tokens[:6].sum())})})
    _same(_step(cfg, batch, lora=True), _step(packed, batch, lora=True))


def test_packing_and_compile_are_refused_together():
    from covrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="trainer.packing"):
        load_config(None, ["trainer.packing=true", "trainer.compile=true"])
