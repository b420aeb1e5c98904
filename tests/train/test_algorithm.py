"""The bound algorithm (covrl.train.step.algorithm): equal to the covrl.math registry calls, options checked once with
messages that name the field and the allowed options, the pairing rule as a property of the registered loss,
and the step's metrics equal to the full-batch formulas although the step reuses its own pieces."""

from __future__ import annotations

import pytest
import torch
from train_helpers import synthetic_batch, tiny_cfg

from covrl.config import ConfigError, load_config
from covrl.math import (
    ADVANTAGE_ESTIMATORS,
    LOSS_SPECS,
    POLICY_LOSSES,
    compute_advantages,
    policy_loss,
    rollout_correction,
)
from covrl.models import tiny_llama
from covrl.train.step.algorithm import bind_algorithm
from covrl.train.step.trainer import Trainer, forward_batch

torch.set_num_threads(1)


def make_model(seed=0):
    return tiny_llama(40, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=32,
                      seed=seed)


def step_inputs(noise=0.2):
    model = make_model()
    batch = synthetic_batch(model, noise=noise)
    with torch.no_grad():
        fwd = forward_batch(model, batch, 1.0)
    return batch, fwd


@pytest.mark.parametrize("advantage", sorted(ADVANTAGE_ESTIMATORS))
def test_bound_advantages_equal_compute_advantages(advantage):
    batch, fwd = step_inputs()
    options = {"eps": 1e-4} if advantage == "grpo" else {"handle_zero_tail": False} if "otb" in advantage else {}
    cfg = tiny_cfg(**{"algorithm.advantage": advantage, "correction.is_level": "token",
                      **{f"algorithm.advantage_options.{k}": v for k, v in options.items()}})
    alg = bind_algorithm(cfg)
    mask = batch.response_mask
    corr = alg.correct(fwd.logprobs, batch.sampler_logprobs, mask)
    got = alg.advantages(rewards=batch.rewards, mask=mask, group_ids=batch.group_ids, logprobs=fwd.logprobs,
                         sum_pi_sq=fwd.sum_pi_sq, is_weights=alg.is_weights(corr))
    want = compute_advantages(advantage, rewards=batch.rewards, mask=mask, group_ids=batch.group_ids,
                              logprobs=fwd.logprobs, sum_pi_sq=fwd.sum_pi_sq, is_weights=corr.weights, **options)
    assert torch.equal(got.advantages, want.advantages)
    assert got.metrics == want.metrics
    assert corr.metrics == rollout_correction(fwd.logprobs, batch.sampler_logprobs, mask, cfg.correction).metrics


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_bound_loss_equals_policy_loss_with_the_pairing_rule(loss):
    batch, fwd = step_inputs()
    options = {"clip_low": 0.1, "dual_clip": None} if loss == "ppo_clip" else {"is_cap": 3.0} if loss == "reinforce" \
        else {}
    cfg = tiny_cfg(**{"algorithm.loss": loss, "algorithm.agg_mode": "seq-mean-token-mean",
                      **{f"algorithm.loss_options.{k}": v for k, v in options.items()}})
    alg = bind_algorithm(cfg)
    mask = batch.response_mask
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) + 0.5
    got = alg.policy_loss(logprobs=fwd.logprobs, sampler_logprobs=batch.sampler_logprobs, advantages=adv, mask=mask,
                          is_weights=weights)
    passed = weights if LOSS_SPECS[loss].takes_is_weights else None
    want = policy_loss(loss, logprobs=fwd.logprobs, sampler_logprobs=batch.sampler_logprobs, advantages=adv,
                       mask=mask, is_weights=passed, agg_mode="seq-mean-token-mean", **options)
    assert torch.equal(got.loss, want.loss) and torch.equal(got.token_loss, want.token_loss)
    assert got.metrics == want.metrics


def test_pairing_rule_is_a_property_of_the_registered_loss():
    assert not LOSS_SPECS["ppo_clip"].takes_is_weights
    assert LOSS_SPECS["covariance"].takes_is_weights and LOSS_SPECS["reinforce"].takes_is_weights
    assert not bind_algorithm(tiny_cfg(**{"algorithm.loss": "ppo_clip"})).loss_takes_is_weights
    assert bind_algorithm(tiny_cfg(**{"algorithm.loss": "reinforce"})).loss_takes_is_weights


def test_options_are_checked_and_bound_once():
    alg = bind_algorithm(tiny_cfg(**{"algorithm.loss": "ppo_clip", "algorithm.loss_options.clip_low": 0,
                                     "algorithm.advantage": "grpo", "algorithm.advantage_options.eps": 1}))
    assert dict(alg.loss_options) == {"clip_low": 0.0} and isinstance(alg.loss_options["clip_low"], float)
    assert dict(alg.advantage_options) == {"eps": 1.0}
    with pytest.raises(TypeError):
        alg.loss_options["clip_low"] = 0.3   # bound options are read-only


@pytest.mark.parametrize("overrides, pattern", [
    (["algorithm.loss=ppo_clip", "algorithm.loss_options.clip=0.2"],
     r"algorithm\.loss_options\.clip is not an option of ppo_clip; allowed: clip_high \(float = 0\.28\), "
     r"clip_low \(float = 0\.2\), dual_clip \(float \| None = 3\.0\)"),
    (["algorithm.loss=ppo_clip", "algorithm.loss_options.clip_low=abc"],
     r"algorithm\.loss_options\.clip_low: Input should be a valid number.*got 'abc'.*options of ppo_clip: "
     r"clip_high"),
    (["algorithm.advantage=grpo", "algorithm.advantage_options.handle_zero_tail=false"],
     r"algorithm\.advantage_options\.handle_zero_tail is not an option of grpo; allowed: eps \(float = 1e-06\)"),
    (["algorithm.advantage=rloo", "algorithm.advantage_options.eps=0.1"],
     r"algorithm\.advantage_options\.eps is not an option of rloo; allowed: zero_constant_groups \(bool = False\)"),
    (["algorithm.advantage=otb", "algorithm.advantage_options.handle_zero_tail=[1]"],
     r"algorithm\.advantage_options\.handle_zero_tail: Input should be a valid boolean.*options of otb"),
    (["algorithm.advantage=otb", "algorithm.advantage_options.logprobs=1"],   # supplied by the trainer
     r"algorithm\.advantage_options\.logprobs is not an option of otb"),
])
def test_option_errors_name_the_field_and_the_allowed_options(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        load_config(None, overrides)
    assert f"override {overrides[-1]!r}" in str(err.value)   # points at the offending override


def test_the_advantage_name_shorthand_still_works():
    cfg = load_config(None, ["algorithm.advantage=otb"])
    assert cfg.algorithm.advantage == "otb" and bind_algorithm(cfg).estimator.name == "otb"


def test_the_algorithm_is_bound_from_the_config_once():
    model = make_model()
    assert Trainer(model, tiny_cfg()).algorithm.loss.name == "covariance"
    assert Trainer(model, tiny_cfg(**{"algorithm.loss": "ppo_clip"})).algorithm.loss.name == "ppo_clip"


# ------------------------------------------------------------------ step metrics = the full-batch formulas

CORRECTIONS = [
    {},
    {"correction.is_level": "token"},
    {"correction.is_level": "sequence"},
    {"correction.is_level": "token", "correction.is_threshold": "[0.5,1.5]"},
    {"correction.is_level": "sequence", "correction.is_batch_normalize": True},
    {"correction.is_level": "token", "correction.rs": "[token_k3]", "correction.rs_threshold": "[1.0e-3]"},
    {"correction.rs": "[seq_mean_k3]", "correction.rs_threshold": "[1.0e-3]"},
]


@pytest.mark.parametrize("micro_batch_size", [4, 3, 64], ids=["whole-groups", "pre-pass", "one-micro-batch"])
@pytest.mark.parametrize("correction", CORRECTIONS, ids=lambda o: "-".join(str(v) for v in o.values()) or "none")
@pytest.mark.parametrize("advantage", sorted(ADVANTAGE_ESTIMATORS))
def test_step_metrics_equal_the_full_batch_formulas(advantage, correction, micro_batch_size, monkeypatch):
    """The step assembles its per-micro-batch advantages and correction (or reuses the pre-pass) for the metrics;
    they must equal rollout_correction + compute_advantages run on the full batch with the step's log-probs,
    exactly as the trainer computed them before it reused the pieces."""
    model = make_model()
    batch = synthetic_batch(model, noise=0.2)
    cfg = tiny_cfg(**{"algorithm.advantage": advantage, "optim.micro_batch_size": micro_batch_size,
                      "logging.diagnostics": False, **correction})
    trainer = Trainer(model, cfg)
    seen = {}
    original = Trainer._batch_diagnostics

    def spy(self, batch, rewards, lp, ent, sps, *rest):
        seen.update(batch=batch, rewards=rewards, lp=lp.clone(), sps=sps.clone())
        return original(self, batch, rewards, lp, ent, sps, *rest)

    monkeypatch.setattr(Trainer, "_batch_diagnostics", spy)
    metrics = trainer.step(batch)
    b, lp, sps, mask = seen["batch"], seen["lp"], seen["sps"], seen["batch"].response_mask.float()
    corr = rollout_correction(lp, b.sampler_logprobs.float(), mask, cfg.correction)
    inputs = {"logprobs": lp, "sum_pi_sq": sps}
    if cfg.correction.is_level is not None:
        inputs["is_weights"] = corr.weights
    adv = compute_advantages(advantage, rewards=seen["rewards"], mask=mask, group_ids=b.group_ids, **inputs)
    expected = {**corr.metrics, **adv.metrics}
    assert {k: metrics[k] for k in expected} == expected


# ------------------------------------------------------------------ algorithm.norm_constant (Dr. GRPO's N)

@pytest.mark.parametrize("score_centering", [False, True], ids=["policy", "with-score-centring"])
def test_norm_constant_scales_the_step_loss_and_gradient_by_exactly_width_over_n(score_centering):
    """seq-mean-token-sum-norm divides by B·N: N = the step's padded width T by default, the configured constant
    otherwise, so the loss (policy + score-centring term) and the gradient norm change by exactly T/N."""
    extra = {"sampler.return_topk": 4, "algorithm.score_centering": True} if score_centering else {}
    base = {"algorithm.advantage": "dr_grpo", "algorithm.agg_mode": "seq-mean-token-sum-norm", "optim.lr": 1e-30,
            "optim.max_grad_norm": None, "logging.diagnostics": False, "logging.noise_scale": False, **extra}
    batch = synthetic_batch(make_model(), noise=0.2, topk=4 if score_centering else 0)
    width = batch.response_mask.shape[1]
    results = [Trainer(make_model(), tiny_cfg(**base, **({} if n is None else {"algorithm.norm_constant": n})))
               .step(batch) for n in (None, 64.0)]
    factor = width / 64.0
    assert results[0]["loss/policy"] != 0.0 and results[0].get("loss/score_centering", 1.0) != 0.0
    parts = ["loss/policy", "loss", "grad_norm"] + (["loss/score_centering"] if score_centering else [])
    for key in parts:
        assert results[1][key] == pytest.approx(results[0][key] * factor, rel=1e-5, abs=1e-12), key


@pytest.mark.parametrize("overrides, pattern", [
    (["algorithm.agg_mode=seq-mean-token-sum-norm", "algorithm.norm_constant=true"],
     r"algorithm\.norm_constant: expected a number, got the boolean True"),
    (["algorithm.agg_mode=seq-mean-token-sum-norm", "algorithm.norm_constant=0"],
     r"algorithm\.norm_constant: Input should be greater than 0"),
    (["algorithm.norm_constant=512"],
     r"algorithm\.norm_constant is read by agg_mode=seq-mean-token-sum-norm only \(agg_mode is token-mean\)"),
])
def test_norm_constant_is_validated(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)
    ok = load_config(None, ["algorithm.agg_mode=seq-mean-token-sum-norm", "algorithm.norm_constant=512"])
    assert bind_algorithm(ok).norm_constant == 512.0
