"""The one micro-step (covrl.train.step.micro_step), the one AdamW builder and the one way to build a run's
components: micro-steps add up to the full batch's step, an idle or non-finite micro-batch adds no gradient, the
Trainer and covrl.api's TrainingClient both run `micro_step`, and every entry point builds the same model."""

from __future__ import annotations

import pytest
import torch
from train_helpers import synthetic_batch, tiny_cfg

from covrl.math import CorrectionConfig
from covrl.models import tiny_llama
from covrl.rollout import SamplerConfig
from covrl.train.step.micro import fold_micro_metrics, micro_batch_share, trim_columns
from covrl.train.step.micro_step import (
    LossTerms,
    Prepared,
    collect,
    forward_batch,
    micro_step,
    truncation_replay,
)
from covrl.train.step.optimizer import build_adamw

torch.set_num_threads(1)


SHAPE = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "max_positions": 32}


def make_model():
    return tiny_llama(40, seed=0, **SHAPE)


def token_mean(token_loss, mask):
    return (token_loss * mask).sum() / mask.sum()


def run_micro_steps(model, batch, plan, *, idle=(), poison=()):
    """micro_step over `plan` (lists of rows) with a REINFORCE-style loss on fixed advantages; returns the
    records and the accumulated gradient."""
    mask = batch.train_mask.float()
    advantages = torch.linspace(-1.0, 1.0, len(batch))[:, None].expand_as(mask).contiguous()
    model.zero_grad(set_to_none=True)

    def loss(mb, idx, fwd, prep):
        value = micro_batch_share(-fwd.logprobs * prep.advantages, idx, mask, token_mean)
        if int(idx[0]) in poison:
            value = value * float("nan")
        return LossTerms(value, {"loss/policy": float(value.detach()), "lp_max": float(fwd.logprobs.detach().max())},
                         token_loss=-fwd.logprobs * prep.advantages)

    records = []
    for k, rows in enumerate(plan):
        idx = torch.as_tensor(rows)
        mb = trim_columns(batch.select(idx))
        t = mb.response_ids.shape[1]
        prepared = Prepared(advantages[idx][:, :t], None, mb.train_mask.float())
        records.append(micro_step(mb, idx, forward=lambda b: forward_batch(model, b, 1.0), prepare=prepared,
                                  loss=loss, tokens=mb.train_mask, full_mask=mask, idle=k in idle))
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return records, grads


def test_micro_steps_add_up_to_the_full_batch():
    model = make_model()
    batch = synthetic_batch(model, groups=3, group_size=4)
    rows, width = batch.response_ids.shape
    full_recs, full_grads = run_micro_steps(model, batch, [list(range(rows))])
    split_recs, split_grads = run_micro_steps(model, batch, [[0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11]])
    for a, b in zip(full_grads, split_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    full = collect(full_recs, rows, width, batch.response_ids.device, token_loss=True)
    split = collect(split_recs, rows, width, batch.response_ids.device, token_loss=True)
    assert full.loss == pytest.approx(split.loss, rel=1e-5)
    mask = batch.train_mask.float()   # padding columns: computed by the full-width pass, zeros when trimmed
    torch.testing.assert_close(full.logprobs * mask, split.logprobs * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(full.token_loss * mask, split.token_loss * mask, rtol=1e-5, atol=1e-6)
    # the loss parts add up, extremes take the extreme, the shares are the token counts over the batch's
    assert split.metrics["loss/policy"] == pytest.approx(split.loss)
    assert split.metrics["lp_max"] == max(r.metrics["lp_max"] for r in split_recs)
    assert [r.share for r in split_recs] == [float(mask[r.rows].sum()) / float(mask.sum()) for r in split_recs]
    assert sum(r.share for r in split_recs) == pytest.approx(1.0)


def test_collect_folds_the_records_as_fold_micro_metrics_does():
    model = make_model()
    batch = synthetic_batch(model, groups=2, group_size=4)
    recs, _ = run_micro_steps(model, batch, [[0, 1, 2, 3], [4, 5, 6, 7]])
    by_hand: dict[str, float] = {}
    for r in recs:
        fold_micro_metrics(by_hand, r.metrics, r.share, r.share == 0.0)
    step = collect(recs, *batch.response_ids.shape, batch.response_ids.device)
    assert step.metrics == by_hand and step.loss == recs[0].loss + recs[1].loss
    assert step.prepared is None and step.truncation is None and step.token_loss is None


def test_an_idle_micro_batch_adds_no_gradient_and_records_only_its_keys():
    model = make_model()
    batch = synthetic_batch(model, groups=2, group_size=4)
    _, alone = run_micro_steps(model, batch, [[0, 1, 2, 3]])
    recs, with_idle = run_micro_steps(model, batch, [[0, 1, 2, 3], [0]], idle={1})
    for a, b in zip(alone, with_idle):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert recs[1].idle and recs[1].loss == 0.0 and recs[1].share == 0.0
    step = collect(recs, *batch.response_ids.shape, batch.response_ids.device)
    assert step.metrics["lp_max"] == recs[0].metrics["lp_max"]   # no extremes from an idle micro-batch
    assert bool((step.logprobs[4:] == 0).all())                    # rows no record covers stay zero


def test_a_non_finite_loss_is_recorded_and_not_backwarded():
    model = make_model()
    batch = synthetic_batch(model, groups=2, group_size=4)
    _, first = run_micro_steps(model, batch, [[0, 1, 2, 3]])
    recs, grads = run_micro_steps(model, batch, [[0, 1, 2, 3], [4, 5, 6, 7]], poison={4})
    assert recs[0].bad is None and recs[1].bad.startswith("non-finite loss (nan) in a micro-batch of 4 rows")
    for a, b in zip(first, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    step = collect(recs, *batch.response_ids.shape, batch.response_ids.device)
    assert step.bad == recs[1].bad


def test_the_truncation_replay_rule():
    assert truncation_replay(SamplerConfig(), "auto") == (None, False)
    rule, replay = truncation_replay(SamplerConfig(top_k=8), "auto")
    assert rule is not None and rule.active and replay
    assert truncation_replay(SamplerConfig(top_k=8), "replay")[1]
    assert truncation_replay(SamplerConfig(top_k=8), "full") == (rule, False)


def test_build_adamw_picks_the_kernel_and_keeps_torch_defaults():
    params = [torch.nn.Parameter(torch.randn(3))]
    fused = build_adamw(params)
    assert fused.param_groups[0]["fused"] is True
    plain = build_adamw(params, lr=0.1, fused=False)
    assert not plain.param_groups[0]["fused"]
    reference = torch.optim.AdamW(params, lr=0.1)
    for key in ("betas", "eps", "weight_decay", "lr"):
        assert plain.param_groups[0][key] == reference.param_groups[0][key], key


def test_the_trainer_and_the_client_run_the_same_micro_step(monkeypatch, tmp_path):
    from covrl.api import TrainBatch, TrainingClient
    from covrl.api import client as client_module
    from covrl.train.step import trainer as trainer_module
    from covrl.train.step.trainer import Trainer

    calls = []

    def counting(where):
        def wrapped(mb, rows, **kwargs):
            calls.append((where, len(rows)))
            return micro_step(mb, rows, **kwargs)
        return wrapped

    monkeypatch.setattr(trainer_module, "micro_step", counting("trainer"))
    monkeypatch.setattr(client_module, "micro_step", counting("client"))
    model = make_model()
    batch = synthetic_batch(model, groups=3, group_size=4)
    Trainer(model, tiny_cfg(**{"optim.micro_batch_size": 4})).step(batch)
    assert calls == [("trainer", 4)] * 3
    calls.clear()
    client = TrainingClient(make_model(), None, micro_batch_size=5, correction=CorrectionConfig(is_level="token"),
                            state_dir=tmp_path)
    fb = client.forward_backward(TrainBatch.from_rollouts(batch, torch.ones(len(batch))), loss_fn="covariance")
    assert calls == [("client", 5), ("client", 5), ("client", 2)]
    assert fb.token_loss.shape == batch.response_ids.shape and "loss/policy" in fb.metrics


def test_every_entry_point_builds_the_same_starting_weights(tmp_path):
    from covrl.api import TrainingClient
    from covrl.train.run.components import build_components, rebuild_initial_model

    cfg = tiny_cfg(tmp_path, **{"sft_warmup.steps": 2, "run.num_threads": 1})
    a, b = build_components(cfg), build_components(cfg)
    assert [a.stream.take(5)[1] for _ in range(2)] == [b.stream.take(5)[1] for _ in range(2)]
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    rebuilt, _ = rebuild_initial_model(cfg)
    client = TrainingClient.from_config(cfg, state_dir=tmp_path / "api")
    assert client.sft_metrics["sft/steps"] == 2.0
    for p, q in zip(rebuilt.parameters(), client.model.parameters()):
        assert torch.equal(p, q)
