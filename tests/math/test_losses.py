"""Policy losses, aggregation modes and score centring: autograd brute force, hand cases, exact enumeration."""

import math
import re

import pytest
import torch

from covrl.math import (
    LOSS_SPECS,
    aggregate,
    compute_advantages,
    policy_loss,
    score_centering_term,
    token_logprobs,
)

torch.set_num_threads(1)


def _linear_policy(B=5, T=4, d=3, V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, d, generator=g, dtype=torch.float64).float()
    W = torch.randn(d, V, generator=g, dtype=torch.float64).float().requires_grad_(True)
    y = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([4, 2, 3, 4, 1])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return h, W, y, mask


def test_covariance_loss_gradient_is_centred_reward_times_score():
    """∇L_cov = −mean_b (R_b − r̄)·∇ log p(y_b) with L_cov in seq-mean-token-sum aggregation (docs/theory.md §5)."""
    h, W, y, mask = _linear_policy()
    R = torch.tensor([1.0, 0.0, 2.0, 0.5, -1.0])
    gids = torch.zeros(5, dtype=torch.long)
    adv = compute_advantages("dr_grpo", rewards=R, mask=mask, group_ids=gids).advantages
    lp = token_logprobs(h @ W, y)
    out = policy_loss("covariance", logprobs=lp, sampler_logprobs=lp.detach() - 0.3, advantages=adv, mask=mask,
                      agg_mode="seq-mean-token-sum")
    (got,) = torch.autograd.grad(out.loss, W)
    expected = torch.zeros_like(W)
    r_bar = R.mean()
    for b in range(5):  # per-sequence autograd, no covrl code
        logp_seq = (torch.log_softmax(h[b] @ W, -1).gather(-1, y[b][:, None])[:, 0] * mask[b]).sum()
        (g_b,) = torch.autograd.grad(logp_seq, W)
        expected -= (R[b] - r_bar) * g_b / 5
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_reinforce_uses_truncated_token_ratio_and_equals_covariance_on_policy():
    h, W, y, mask = _linear_policy(seed=1)
    g = torch.Generator().manual_seed(7)
    adv = torch.randn(mask.shape, generator=g)
    lp = token_logprobs(h @ W, y)
    on_r = policy_loss("reinforce", logprobs=lp, sampler_logprobs=lp.detach(), advantages=adv, mask=mask)
    on_c = policy_loss("covariance", logprobs=lp, sampler_logprobs=lp.detach(), advantages=adv, mask=mask)
    torch.testing.assert_close(on_r.loss, on_c.loss)
    shift = torch.tensor([[-2.0, 0.3, 0.0, 1.0]]).expand_as(lp)  # ρ = e^{2} (capped at 2), e^{−0.3}, 1, e^{−1}
    off = policy_loss("reinforce", logprobs=lp, sampler_logprobs=lp.detach() + shift, advantages=adv, mask=mask,
                      agg_mode="seq-mean-token-sum", is_cap=2.0)
    w = torch.exp(-shift).clamp(max=2.0)
    torch.testing.assert_close(off.token_loss, -adv * w * lp.detach() * mask, atol=1e-6, rtol=1e-6)
    (g_got,) = torch.autograd.grad(off.loss, lp)
    torch.testing.assert_close(g_got, -adv * w * mask / 5, atol=1e-6, rtol=1e-6)
    # given IS weights replace the loss's own ratio
    given = torch.full(lp.shape, 0.5)
    ext = policy_loss("reinforce", logprobs=lp, sampler_logprobs=lp.detach() + shift, advantages=adv, mask=mask,
                      is_weights=given)
    cov = policy_loss("covariance", logprobs=lp, sampler_logprobs=lp.detach() + shift, advantages=adv, mask=mask,
                      is_weights=given)
    torch.testing.assert_close(ext.loss, cov.loss)


def test_ppo_clip_hand_cases_values_and_gradients():
    # ratios and advantages per token; clip_low 0.2, clip_high 0.28, dual clip 3
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5, 5.0, 1.1]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0, 1.0]])
    # A>0,ρ=1.5: clipped at 1.28 -> −1.28 (no grad); A>0,ρ=0.5: −0.5; A<0,ρ=0.5: clipped at 0.8 -> 0.8 (no grad);
    # A<0,ρ=1.5: 1.5; A<0,ρ=5: dual clip min(10, 6) = 6 (no grad); A>0,ρ=1.1 inside: −1.1
    expected = torch.tensor([[-1.28, -0.5, 0.8, 1.5, 6.0, -1.1]])
    expected_grad = torch.tensor([[0.0, -0.5, 0.0, 1.5, 0.0, -1.1]])  # ∂ℓ/∂log p = −A·ρ where unclipped
    lp = torch.zeros(1, 6, requires_grad=True)
    out = policy_loss("ppo_clip", logprobs=lp, sampler_logprobs=-ratio.log(), advantages=adv, mask=torch.ones(1, 6),
                      agg_mode="seq-mean-token-sum")
    torch.testing.assert_close(out.token_loss, expected, atol=1e-6, rtol=1e-6)
    (grad,) = torch.autograd.grad(out.loss, lp)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-6)
    assert out.metrics["loss/clip_frac_high"] == pytest.approx(1 / 6)
    assert out.metrics["loss/clip_frac_low"] == pytest.approx(1 / 6)
    assert out.metrics["loss/dual_clip_frac"] == pytest.approx(1 / 6)
    assert out.metrics["loss/ratio_max"] == pytest.approx(5.0, rel=1e-5)
    no_dual = policy_loss("ppo_clip", logprobs=lp, sampler_logprobs=-ratio.log(), advantages=adv,
                          mask=torch.ones(1, 6), dual_clip=None)
    assert no_dual.token_loss[0, 4].item() == pytest.approx(10.0, rel=1e-5)
    sym = policy_loss("ppo_clip", logprobs=lp, sampler_logprobs=-ratio.log(), advantages=adv, mask=torch.ones(1, 6),
                      clip_low=0.1, clip_high=0.1)
    assert sym.token_loss[0, 0].item() == pytest.approx(-1.1, rel=1e-6)
    assert sym.token_loss[0, 2].item() == pytest.approx(0.9, rel=1e-6)


def test_aggregation_modes_hand_cases():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, float("nan")], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4 + 0) / 3)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)  # empty row skipped
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (3 * 3))
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_constant=5).item() == pytest.approx(10 / 15)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert aggregate(loss, torch.zeros(3, 3), mode).item() == 0.0
    with pytest.raises(ValueError, match="valid choices"):
        aggregate(loss, mask, "sum")
    with pytest.raises(ValueError, match=r"token_loss \[3, 3\], mask \[3, 2\]"):
        aggregate(loss, mask[:, :2], "token-mean")


def test_policy_loss_errors():
    z = torch.zeros(2, 3)
    names = re.escape(str(sorted(LOSS_SPECS)))   # every registered loss, listed sorted
    with pytest.raises(ValueError, match=r"valid choices: " + names):
        policy_loss("grpo", logprobs=z, sampler_logprobs=z, advantages=z, mask=z)
    with pytest.raises(ValueError, match=r"advantages \[2, 2\]"):
        policy_loss("ppo_clip", logprobs=z, sampler_logprobs=z, advantages=z[:, :2], mask=z)
    with pytest.raises(TypeError, match="unknown options"):
        policy_loss("covariance", logprobs=z, sampler_logprobs=z, advantages=z, mask=z, clip_low=0.2)


def test_score_centering_hand_example_and_p_equals_q():
    q = torch.tensor([[[0.5, 0.3]]])
    p = torch.tensor([[[0.4, 0.4]]])
    logp = p.log().requires_grad_(True)
    A = torch.tensor([[2.0]])
    out = score_centering_term(logp, q.log(), A, torch.ones(1, 1))
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grad, A[..., None] * torch.tensor([[[0.1, -0.1]]]), atol=1e-6, rtol=1e-6)
    # truncation C = 1: α = min(1, 1·ρ_tail) = 1, c = min(p, q) − p = [0, −0.1]
    out_c = score_centering_term(logp, q.log(), A, torch.ones(1, 1), truncation=1.0)
    (grad_c,) = torch.autograd.grad(out_c.loss, logp)
    torch.testing.assert_close(grad_c, A[..., None] * torch.tensor([[[0.0, -0.1]]]), atol=1e-6, rtol=1e-6)
    same = score_centering_term(logp, logp.detach(), A, torch.ones(1, 1))
    (grad_same,) = torch.autograd.grad(same.loss, logp)
    assert same.loss.item() == 0.0 and grad_same.abs().max().item() < 1e-7


@pytest.mark.parametrize("truncation", [None, 1.5])
def test_score_centering_removes_the_drift_exactly_when_tails_are_proportional(truncation):
    """E_{y∼q}[w(y) s_y] − Σ_H c_v s_v = 0 (enumerated) for s_v = ∇_z log p_v and q ∝ p on the tail."""
    V, K = 7, 3
    g = torch.Generator().manual_seed(0)
    z = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_(True)
    p = torch.softmax(z, 0).detach()
    q = p.clone()
    q[:K] = torch.tensor([0.3, 0.25, 0.05], dtype=torch.float64)  # sampler's top-k H = first K ids
    q[K:] = p[K:] / p[K:].sum() * (1 - q[:K].sum())
    scores = torch.stack([torch.autograd.grad(torch.log_softmax(z, 0)[v], z)[0] for v in range(V)])
    w = torch.ones(V, dtype=torch.float64) if truncation is None else (p / q).clamp(max=truncation)
    drift = (q[:, None] * w[:, None] * scores).sum(0)
    # coefficients from the loss: ∂(term)/∂ log p_v = A·c_v with A = 1 (mean over one token)
    logp_h = torch.log(p[:K]).float()[None, None].requires_grad_(True)
    out = score_centering_term(logp_h, torch.log(q[:K]).float()[None, None], torch.ones(1, 1), torch.ones(1, 1),
                               truncation=truncation)
    (c,) = torch.autograd.grad(out.loss, logp_h)
    correction = (c[0, 0].double()[:, None] * scores[:K]).sum(0)
    assert drift.abs().max() > 1e-3  # there is a drift to remove
    torch.testing.assert_close(drift, correction, atol=1e-6, rtol=1e-5)


def test_score_centering_ignores_padded_topk_entries():
    logp = torch.log(torch.tensor([[[0.4, 0.4, 0.1]]]))
    logq = torch.tensor([[[math.log(0.5), math.log(0.3), float("-inf")]]])
    a = score_centering_term(logp, logq, torch.ones(1, 1), torch.ones(1, 1))
    b = score_centering_term(logp[..., :2], logq[..., :2], torch.ones(1, 1), torch.ones(1, 1))
    torch.testing.assert_close(a.loss, b.loss)
    assert math.isfinite(a.loss.item())
