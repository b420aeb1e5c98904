"""Property tests: finite values and gradients at extreme logits/log-probs, all-masked rows, groups of one."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import covrl.math as cm

torch.set_num_threads(1)

SETTINGS = dict(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 5))
    V = draw(st.integers(2, 7))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1.0, 30.0, 1e4]))
    logits = scale * torch.randn(B, T, V, generator=g)
    if draw(st.booleans()):  # exact ±1e4 extremes
        logits = torch.where(torch.rand(B, T, V, generator=g) < 0.5, torch.full_like(logits, -1e4),
                             torch.full_like(logits, 1e4))
    tokens = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)  # 0 = all-masked row
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    groups = torch.randint(0, max(1, B // 2 + draw(st.integers(0, 2))), (B,), generator=g)  # singletons likely
    rewards = torch.randn(B, generator=g)
    sampler_lp = torch.where(torch.rand(B, T, generator=g) < 0.3, torch.full((B, T), -1e4),
                             -5 * torch.rand(B, T, generator=g))
    temperature = draw(st.sampled_from([1.0, 0.6, 1.5]))
    return logits, tokens, mask, groups, rewards, sampler_lp, temperature


def _finite(x):
    return bool(torch.isfinite(x).all())


@settings(**SETTINGS)
@given(batches())
def test_logprob_quantities_finite_with_finite_gradients(batch):
    logits, tokens, *_, temperature = batch
    z = logits.clone().requires_grad_(True)
    lp = cm.token_logprobs(z, tokens, temperature)
    ent = cm.entropy_from_logits(z, temperature)
    sps = cm.sum_pi_squared(logits, temperature)
    proxy = cm.logit_grad_proxy(lp.detach(), sps)
    assert _finite(lp) and (lp <= 0).all() and _finite(ent) and _finite(proxy)
    V = logits.shape[-1]
    assert (sps >= 1 / V - 1e-5).all() and (sps <= 1 + 1e-6).all()
    assert (proxy >= 0).all() and (proxy <= 2 + 1e-5).all()
    (g,) = torch.autograd.grad(lp.sum() + ent.sum(), z)
    assert _finite(g)


@settings(**SETTINGS)
@given(batches(), st.sampled_from(sorted(cm.ADVANTAGE_ESTIMATORS)))
def test_advantages_finite_zero_on_padding(batch, name):
    logits, tokens, mask, groups, rewards, _, temperature = batch
    lp = cm.token_logprobs(logits, tokens, temperature)
    sps = cm.sum_pi_squared(logits, temperature)
    out = cm.compute_advantages(name, rewards=rewards, mask=mask, group_ids=groups, logprobs=lp, sum_pi_sq=sps,
                                is_weights=torch.ones_like(mask))
    assert _finite(out.advantages) and _finite(out.returns)
    assert (out.advantages[mask == 0] == 0).all()
    assert all(math.isfinite(v) for v in out.metrics.values())


@settings(**SETTINGS)
@given(batches(), st.sampled_from(sorted(cm.POLICY_LOSSES)), st.sampled_from(sorted(cm.AGGREGATIONS)))
def test_losses_finite_values_and_gradients(batch, name, agg_mode):
    logits, tokens, mask, groups, rewards, sampler_lp, temperature = batch
    z = logits.clone().requires_grad_(True)
    lp = cm.token_logprobs(z, tokens, temperature)
    adv = cm.compute_advantages("grpo", rewards=rewards, mask=mask, group_ids=groups).advantages
    corr = cm.rollout_correction(lp.detach(), sampler_lp, mask,
                                 cm.CorrectionConfig(is_level="token", rs=["seq_mean_k3"], rs_threshold=[10.0]))
    is_w = corr.weights if cm.LOSS_SPECS[name].takes_is_weights else None
    out = cm.policy_loss(name, logprobs=lp, sampler_logprobs=sampler_lp, advantages=adv, mask=corr.keep,
                         is_weights=is_w, agg_mode=agg_mode)
    ids = tokens[..., None].expand(*tokens.shape, 2).clone()
    topk_lp = cm.token_logprobs(z, ids, temperature)
    sc = cm.score_centering_term(topk_lp, sampler_lp[..., None].expand_as(topk_lp).clone() - 1.0, adv, mask,
                                 truncation=2.0, agg_mode=agg_mode)
    kl = cm.aggregate(cm.kl_estimate(sampler_lp, lp, "k3"), mask, agg_mode)
    total = out.loss + sc.loss + kl
    assert _finite(total)
    (g,) = torch.autograd.grad(total, z)
    assert _finite(g)
    for m in (out.metrics, sc.metrics, corr.metrics):
        assert all(math.isfinite(v) for v in m.values()), m


@settings(**SETTINGS)
@given(batches(), st.sampled_from([None, "token", "sequence"]), st.booleans())
def test_correction_finite_and_bounded(batch, level, band):
    logits, tokens, mask, _, _, sampler_lp, temperature = batch
    lp = cm.token_logprobs(logits, tokens, temperature)
    cfg = cm.CorrectionConfig(is_level=level, is_threshold=(0.5, 2.0) if band else 2.0, is_batch_normalize=False,
                              rs=["token_k1", "seq_max_k2"], rs_threshold=[(1e-3, 1e3), 50.0])
    out = cm.rollout_correction(lp, sampler_lp, mask, cfg)
    assert _finite(out.weights) and (out.weights >= 0).all() and (out.weights <= 2.0 + 1e-6).all()
    assert ((out.keep == 0) | (out.keep == 1)).all() and (out.keep <= mask).all()
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics
