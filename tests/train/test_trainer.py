"""Trainer.step on a tiny model with synthetic batches: micro-batching equals the full batch, the loss is the
registry's loss, every estimator/loss/correction option runs, the pairing rule, KL, bad steps."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
import torch
from train_helpers import synthetic_batch, tiny_cfg

from covrl.math import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    REJECTION_CRITERIA,
    compute_advantages,
    policy_loss,
)
from covrl.models import frozen_copy, tiny_llama
from covrl.rollout.types import RolloutBatch
from covrl.train.step.schedule import lr_factor
from covrl.train.step.trainer import Trainer, TrainingDivergedError, forward_batch

torch.set_num_threads(1)


def make_model(seed=0):
    return tiny_llama(40, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=32,
                      seed=seed)


def grads_of_step(cfg, batch, model=None, ref=None):
    """The accumulated gradient of one Trainer.step (captured instead of applying the update)."""
    model = model or make_model()
    trainer = Trainer(model, cfg, ref_model=ref)
    captured = []
    trainer.optimizer.step = lambda *a, **k: captured.append([p.grad.detach().clone() for p in trainer.params])
    metrics = trainer.step(batch)
    assert captured, f"optimizer step not reached: {metrics.skip_reason}"
    return captured[0], metrics


def assert_grads_close(a, b, rtol=1e-4, atol=1e-7):
    for ga, gb in zip(a, b):
        torch.testing.assert_close(ga, gb, rtol=rtol, atol=atol)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])
def test_micro_batches_sum_to_the_full_batch_gradient(agg_mode):
    model = make_model()
    batch = synthetic_batch(model, groups=3, group_size=4)
    base = {"algorithm.agg_mode": agg_mode, "optim.max_grad_norm": None, "correction.is_level": "token"}
    unshared, _ = grads_of_step(tiny_cfg(**base, **{"optim.share_prompts": False}), batch)
    full, _ = grads_of_step(tiny_cfg(**base, **{"optim.micro_batch_size": 12}), batch)
    aligned, _ = grads_of_step(tiny_cfg(**base, **{"optim.micro_batch_size": 4}), batch)   # whole groups
    split, _ = grads_of_step(tiny_cfg(**base, **{"optim.micro_batch_size": 3}), batch)     # pre-pass path
    assert_grads_close(full, aligned)
    assert_grads_close(full, split)
    assert_grads_close(full, unshared)


def test_step_loss_is_the_registry_loss_of_the_batch():
    model = make_model()
    cfg = tiny_cfg(**{"optim.micro_batch_size": 64})
    batch = synthetic_batch(model)
    with torch.no_grad():
        fwd = forward_batch(model, batch, 1.0)
        mask = batch.response_mask
        adv = compute_advantages("otb", rewards=batch.rewards, mask=mask, group_ids=batch.group_ids,
                                 logprobs=fwd.logprobs, sum_pi_sq=fwd.sum_pi_sq).advantages
        expected = policy_loss("covariance", logprobs=fwd.logprobs, sampler_logprobs=batch.sampler_logprobs,
                               advantages=adv, mask=mask).loss
    metrics = Trainer(model, cfg).step(batch)
    assert metrics["loss"] == pytest.approx(float(expected), rel=1e-5, abs=1e-7)


def test_covariance_gradient_equals_hand_formula():
    """covariance + dr_grpo, token-mean: grad = -sum_t A_b grad log p(y_bt) / N_tokens."""
    model = make_model()
    batch = synthetic_batch(model)
    cfg = tiny_cfg(**{"algorithm.advantage": "dr_grpo", "optim.max_grad_norm": None})
    got, _ = grads_of_step(cfg, batch, model=make_model())
    ref_model = make_model()
    fwd = forward_batch(ref_model, batch, 1.0)
    r = batch.rewards
    mean = r.view(3, 4).mean(1).repeat_interleave(4)
    loss = -((r - mean)[:, None] * fwd.logprobs * batch.response_mask).sum() / batch.response_mask.sum()
    loss.backward()
    assert_grads_close(got, [p.grad for p in ref_model.parameters() if p.requires_grad])


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("advantage", sorted(ADVANTAGE_ESTIMATORS))
def test_every_advantage_and_loss_takes_a_finite_step(advantage, loss):
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    metrics = Trainer(model, tiny_cfg(**{"algorithm.advantage": advantage, "algorithm.loss": loss})).step(
        synthetic_batch(model))
    assert metrics["skipped"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for key in ("reward/mean", "reward/std", "response/length_mean", "response/length_max", "entropy",
                "grad_norm", "lr", "zero_variance_groups", "mismatch/k3", "adv/var_power", "tangent",
                "remainder", "kl_seq", "bound", "policy_version", "rollouts"):
        assert key in metrics, key


CORRECTIONS = [
    {"correction.is_level": "token"},
    {"correction.is_level": "sequence"},
    {"correction.is_level": "token", "correction.is_threshold": "[0.5,1.5]"},
    {"correction.is_level": "sequence", "correction.is_batch_normalize": True},
    {"correction.is_level": "token", "correction.is_batch_normalize": True},
] + [{"correction.rs": f"[{name}]", "correction.rs_threshold": "[1.01]" if name.endswith("k1") else "[1.0e-4]"}
     for name in REJECTION_CRITERIA]


@pytest.mark.parametrize("options", CORRECTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_every_correction_option_takes_a_finite_step(options):
    model = make_model()
    metrics = Trainer(model, tiny_cfg(**options)).step(synthetic_batch(model, noise=0.2))
    assert metrics["skipped"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    if "correction.rs" in options:  # thresholds this tight reject something at noise 0.2
        assert metrics["correction/masked_frac"] > 0


def test_pairing_rule_ppo_clip_takes_no_is_weights_but_covariance_does():
    model = make_model()
    batch = synthetic_batch(model, noise=0.3)
    plain, _ = grads_of_step(tiny_cfg(**{"algorithm.loss": "ppo_clip"}), batch)
    with_is, _ = grads_of_step(tiny_cfg(**{"algorithm.loss": "ppo_clip", "correction.is_level": "token",
                                           "algorithm.is_weights_in_advantage": False}), batch)
    assert_grads_close(plain, with_is)
    cov_plain, _ = grads_of_step(tiny_cfg(), batch)
    cov_is, _ = grads_of_step(tiny_cfg(**{"correction.is_level": "token",
                                          "algorithm.is_weights_in_advantage": False}), batch)
    assert any(not torch.allclose(a, b) for a, b in zip(cov_plain, cov_is))


def test_score_centering_vanishes_when_sampler_equals_trainer():
    model = make_model()
    batch = synthetic_batch(model, topk=3, noise=0.0)
    with_sc, metrics = grads_of_step(tiny_cfg(**{"algorithm.score_centering": True, "sampler.return_topk": 3}),
                                     batch)
    without, _ = grads_of_step(tiny_cfg(), batch)
    assert "loss/score_centering" in metrics
    assert_grads_close(with_sc, without, atol=1e-6)
    noisy = synthetic_batch(model, topk=3, noise=0.3)
    with_sc, metrics = grads_of_step(tiny_cfg(**{"algorithm.score_centering": True, "sampler.return_topk": 3}),
                                     noisy)
    assert abs(metrics["loss/score_centering"]) > 0


@pytest.mark.parametrize("mode", ["loss", "reward"])
def test_kl_penalty_to_reference(mode):
    model = make_model()
    ref = frozen_copy(model)
    trainer = Trainer(model, tiny_cfg(**{"kl.coef": 0.5, "kl.mode": mode}), ref_model=ref)
    m1 = trainer.step(synthetic_batch(model, seed=1))
    m2 = trainer.step(synthetic_batch(model, seed=2))
    assert m1["skipped"] == m2["skipped"] == 0.0
    if mode == "loss":
        assert m1["loss/kl"] == pytest.approx(0.0, abs=1e-7)   # identical weights at step 1
        assert m2["loss/kl"] > 0
    else:
        assert m2["kl_ref/reward_penalty"] >= 0
    with pytest.raises(ValueError, match="reference model"):
        Trainer(make_model(), tiny_cfg(**{"kl.coef": 0.5}))


def test_non_finite_loss_skips_the_step_and_stops_after_max_bad_steps():
    model = make_model()
    trainer = Trainer(model, tiny_cfg(**{"optim.max_bad_steps": 2}))
    before = [p.detach().clone() for p in model.parameters()]
    bad = synthetic_batch(model)
    bad.rewards[0] = float("nan")
    m = trainer.step(bad)
    assert m["skipped"] == 1.0 and "non-finite" in m.skip_reason
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert trainer.version == 0 and trainer.rollouts == len(bad)
    good = trainer.step(synthetic_batch(model))        # a good step resets the counter
    assert good["skipped"] == 0.0 and trainer.bad_steps == 0
    trainer.step(bad)
    with pytest.raises(TrainingDivergedError, match="max_bad_steps"):
        trainer.step(bad)


def test_empty_generations_are_skipped_with_a_reason():
    model = make_model()
    trainer = Trainer(model, tiny_cfg())
    batch = synthetic_batch(model)
    batch = replace(batch, response_mask=torch.zeros_like(batch.response_mask))
    m = trainer.step(batch)
    assert m["skipped"] == 1.0 and "empty" in m.skip_reason


def test_unscored_batch_is_rejected():
    model = make_model()
    batch = synthetic_batch(model)
    unscored = RolloutBatch(**{f.name: getattr(batch, f.name) for f in fields(RolloutBatch)})
    with pytest.raises(ValueError, match="rewards"):
        Trainer(model, tiny_cfg()).step(unscored)
    with pytest.raises(ValueError, match="rewards"):
        replace(batch, rewards=None)


def test_lr_schedule_on_the_data_clock():
    assert lr_factor(0, 8, warmup=32, total=320, schedule="constant") == pytest.approx(0.25)
    assert lr_factor(24, 8, warmup=32, total=320, schedule="constant") == 1.0
    assert lr_factor(32, 8, warmup=32, total=320, schedule="cosine") == pytest.approx(1.0)
    assert lr_factor(176, 8, warmup=32, total=320, schedule="cosine") == pytest.approx(0.5)
    assert lr_factor(320, 8, warmup=32, total=320, schedule="cosine", min_ratio=0.1) == pytest.approx(0.1)
    model = make_model()
    trainer = Trainer(model, tiny_cfg(**{"optim.lr": 1e-3, "optim.warmup_rollouts": 32}))
    m = trainer.step(synthetic_batch(model))   # 12 rollouts
    assert m["lr"] == pytest.approx(1e-3 * 12 / 32)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(m["lr"])


def test_shared_prompt_pass_matches_the_full_forward():
    """Rows of a group share one prompt pass through a KV cache: same log-probs and gradients."""
    model = make_model()
    batch = synthetic_batch(model, groups=3, group_size=4)   # identical prompts within each group
    results = []
    for share in (False, True):
        model.zero_grad()
        fwd = forward_batch(model, batch, 0.7, share_prompts=share)
        (fwd.logprobs * batch.response_mask * batch.rewards[:, None]).sum().backward()
        results.append((fwd.logprobs.detach() * batch.response_mask, [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    assert_grads_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-6)


def _constant_rewards(batch):
    return replace(batch, rewards=torch.zeros_like(batch.rewards))


@pytest.mark.parametrize("skip", [False, True])
def test_a_zero_gradient_step_moves_the_weights_only_without_skip_zero_gradient(skip):
    # an informative step fills AdamW's momentum; a batch whose every group has a constant reward then has a
    # zero gradient, and AdamW would still move the weights along that momentum
    model = make_model()
    trainer = Trainer(model, tiny_cfg(**{"optim.skip_zero_gradient": skip}))
    assert trainer.step(synthetic_batch(model))["grad_norm"] > 0
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for k, v in trainer.optimizer.state[trainer.params[0]].items()}
    m = trainer.step(_constant_rewards(synthetic_batch(model, seed=1)))
    assert m["grad_norm"] == 0.0 and m["skipped"] == 0.0
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert unchanged is skip
    assert m["no_signal_step"] == float(skip) and m["no_signal_steps"] == float(skip)
    assert trainer.version == (1 if skip else 2) and m["policy_version"] == trainer.version
    assert trainer.rollouts == 2 * len(synthetic_batch(model))   # the data clock counts the batch either way
    if skip:   # the optimizer's state is untouched too: the next informative step is as if the batch never came
        state_after = trainer.optimizer.state[trainer.params[0]]
        assert all(torch.equal(state_before[k], state_after[k]) for k in state_before)


def test_skip_zero_gradient_keeps_informative_steps_and_survives_a_checkpoint():
    model = make_model()
    trainer = Trainer(model, tiny_cfg(**{"optim.skip_zero_gradient": True}))
    trainer.step(_constant_rewards(synthetic_batch(model)))
    m = trainer.step(synthetic_batch(model, seed=1))
    assert m["grad_norm"] > 0 and m["no_signal_step"] == 0.0 and trainer.version == 1
    again = Trainer(make_model(), tiny_cfg(**{"optim.skip_zero_gradient": True}))
    again.load_state_dict(trainer.state_dict())
    assert again.no_signal_steps == 1 and again.version == 1


@pytest.mark.parametrize("zero_constant", [False, True])
def test_an_all_correct_step_is_left_out_only_with_zero_constant_groups(zero_constant):
    # every group's reward is 1: OTB's formula still gives the uniquely longest row's tail A = G (and A = G at
    # zero-energy tokens), so only with zero_constant_groups is the gradient exactly zero and the step skipped
    model = make_model()
    cfg = tiny_cfg(**{"optim.skip_zero_gradient": True, "algorithm.advantage": "otb",
                      "algorithm.advantage_options.zero_constant_groups": zero_constant})
    trainer = Trainer(model, cfg)
    trainer.step(synthetic_batch(model))
    before = [p.detach().clone() for p in model.parameters()]
    batch = synthetic_batch(model, seed=1)
    m = trainer.step(replace(batch, rewards=torch.ones_like(batch.rewards)))
    assert (m["grad_norm"] == 0.0) is zero_constant
    assert m["no_signal_step"] == float(zero_constant)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) is zero_constant


def test_clip_cov_drops_its_tokens_gradient_alike_at_every_micro_batching():
    """algorithm.clip_cov: the gradient is the covariance loss over the tokens Clip-Cov keeps, divided by every
    token (hand formula), and the full batch, whole-group micro-batches and the pre-pass path agree."""
    from covrl.math import clip_cov_keep

    model = make_model()
    batch = synthetic_batch(model, groups=3, group_size=4)
    base = {"algorithm.advantage": "dr_grpo", "algorithm.clip_cov": 0.25, "optim.max_grad_norm": None}
    full, metrics = grads_of_step(tiny_cfg(**base, **{"optim.micro_batch_size": 12}), batch)
    aligned, _ = grads_of_step(tiny_cfg(**base, **{"optim.micro_batch_size": 4}), batch)
    split, _ = grads_of_step(tiny_cfg(**base, **{"optim.micro_batch_size": 3}), batch)
    assert_grads_close(full, aligned)
    assert_grads_close(full, split)
    ref_model = make_model()
    fwd = forward_batch(ref_model, batch, 1.0)
    mask = batch.response_mask.float()
    r = batch.rewards
    adv = ((r - r.view(3, 4).mean(1).repeat_interleave(4))[:, None] * mask)
    keep = clip_cov_keep(adv, batch.sampler_logprobs.float(), mask, batch.group_ids, 0.25)
    assert 0 < keep.metrics["clip_cov/clipped_frac"] < 0.3
    assert metrics["clip_cov/clipped_frac"] == pytest.approx(keep.metrics["clip_cov/clipped_frac"])
    loss = -(adv * fwd.logprobs * keep.keep).sum() / mask.sum()
    loss.backward()
    assert_grads_close(full, [p.grad for p in ref_model.parameters() if p.requires_grad])
    unclipped, _ = grads_of_step(tiny_cfg(**{**base, "algorithm.clip_cov": 0.0}), batch)
    assert max(float((a - b).abs().max()) for a, b in zip(full, unclipped)) > 1e-6
