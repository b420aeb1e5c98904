"""Gradient-noise diagnostics (docs/theory.md §7 variance proxies; McCandlish et al. 2018 noise scale) against
brute-force per-sample gradients."""

from __future__ import annotations

import pytest
import torch

from covrl.diagnostics.noise import GradientNoiseMonitor, gradient_noise_scale, micro_batch_noise_scale
from covrl.math import variance_proxies

torch.set_num_threads(1)


def flat_grad(params) -> torch.Tensor:
    return torch.cat([p.grad.detach().double().flatten() for p in params])


def test_hand_computed_split():
    # b_small = 1 with mean ‖g_i‖² = 4, b_big = 4 with ‖ḡ‖² = 1: trΣ = 3/(1 − 1/4) = 4, |G|² = (4 − 4)/3 = 0
    est = gradient_noise_scale(4.0, 1.0, 1, 4)
    assert est.trace_sigma == pytest.approx(4.0) and est.grad_sq == pytest.approx(0.0, abs=1e-12)
    # §7 split: signal = ‖ḡ‖², power = |G|² + trΣ = mean_b ‖g_b‖², noise = trΣ/N = (P − S)/(N − 1)
    assert est.signal == 1.0 and est.power == pytest.approx(4.0) and est.noise == pytest.approx(1.0)
    assert est.noise == pytest.approx((est.power - est.signal) / 3)
    assert gradient_noise_scale(1.0, 2.0, 1, 4).noise == 0.0   # a negative trΣ estimate is clipped at 0


def test_forward_only_power_is_exact_for_per_position_logits():
    """Parameters = the logits of each position (context-free), A constant along a row: then
    ‖g_b‖² = Â_b²·Ŵ_b exactly, so the forward-only power adv/var_power is the brute-force mean_b ‖g_b‖²."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 6, 5, 7
    logits = torch.randn(T, V, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([5, 3, 4, 1, 5, 2])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64) * mask

    def token_logp():
        return torch.log_softmax(logits, -1)[torch.arange(T)[None, :].expand(B, T), tokens]

    per_sample = []
    for b in range(B):
        logits.grad = None
        (token_logp()[b] * adv[b] * mask[b]).sum().backward()
        per_sample.append(logits.grad.detach().clone().flatten())
    per_sample = torch.stack(per_sample)
    with torch.no_grad():
        pi = torch.softmax(logits, -1)
        w = 1 - 2 * pi[torch.arange(T)[None, :].expand(B, T), tokens] + pi.square().sum(-1)[None, :]
    out = variance_proxies(adv, mask, w)
    assert out["adv/var_power"] == pytest.approx(float(per_sample.square().sum(1).mean()), rel=1e-6)


def tiny_model():
    from covrl.models import tiny_llama

    # float64: the estimators subtract nearby norms, so fp32 round-off would blur the exact identities
    return tiny_llama(16, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0).double()


def per_row_losses(model, tokens, adv):
    logits = model(input_ids=tokens).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return -(logp * adv[:, None]).mean(1)


def test_noise_scale_matches_brute_force_on_tiny_llama():
    """Micro-batches of one row: the two-batch estimator is exactly the unbiased trace of the per-sample
    covariance and the unbiased |G|²; gradient accumulation with scaled micro losses gives the same numbers."""
    model = tiny_model()
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    n = 6
    # rows share all but their last token, so per-sample gradients share a direction and |G|² > 0
    tokens = torch.randint(3, 16, (1, 6), generator=g).repeat(n, 1)
    tokens[:, -1] = torch.randint(3, 16, (n,), generator=g)
    adv = 1.0 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)   # a shared direction so that |G|² > 0

    per_sample = []
    for i in range(n):
        model.zero_grad()
        per_row_losses(model, tokens[i:i + 1], adv[i:i + 1]).sum().backward()
        per_sample.append(flat_grad(params))
    per_sample = torch.stack(per_sample)
    mean_grad = per_sample.mean(0)
    trace_cov = float((per_sample - mean_grad).square().sum() / (n - 1))
    grad_sq = float(mean_grad.square().sum()) - trace_cov / n

    assert grad_sq > 0
    est = micro_batch_noise_scale(per_sample.square().sum(1).tolist(), 1, float(mean_grad.square().sum()))
    assert est.trace_sigma == pytest.approx(trace_cov, rel=1e-6)
    assert est.grad_sq == pytest.approx(grad_sq, rel=1e-6)
    assert est.b_simple == pytest.approx(trace_cov / grad_sq, rel=1e-5)

    # gradient accumulation over micro-batches of 2, 1, 3 rows, each loss scaled by b_i / n
    sizes, contrib_norms, own_norms, start = [2, 1, 3], [], [], 0
    model.zero_grad()
    before = torch.zeros_like(mean_grad)
    for b in sizes:
        (per_row_losses(model, tokens[start:start + b], adv[start:start + b]).mean() * b / n).backward()
        after = flat_grad(params)
        contrib_norms.append(float((after - before).square().sum()))
        own_norms.append(float(per_sample[start:start + b].mean(0).square().sum()))
        before, start = after, start + b
    assert torch.allclose(before, mean_grad, rtol=1e-5, atol=1e-8)
    full = float(before.square().sum())
    scaled = micro_batch_noise_scale(contrib_norms, sizes, full, micro_scaled=True)
    direct = micro_batch_noise_scale(own_norms, sizes, full)
    assert scaled.trace_sigma == pytest.approx(direct.trace_sigma, rel=1e-5)
    assert scaled.grad_sq == pytest.approx(direct.grad_sq, rel=1e-5)
    harmonic = 3 / (1 / 2 + 1 / 1 + 1 / 3)
    manual = gradient_noise_scale(sum(own_norms) / 3, full, harmonic, 6)
    assert direct.trace_sigma == pytest.approx(manual.trace_sigma) and direct.grad_sq == pytest.approx(manual.grad_sq)


def test_noise_scale_is_unbiased_on_synthetic_gradients():
    """Per-sample gradients ~ N(G, Σ): averaged over many batches the estimates approach |G|² and tr Σ."""
    g = torch.Generator().manual_seed(2)
    dim, draws, batch, micro = 20, 4000, 16, 4
    G = torch.randn(dim, generator=g, dtype=torch.float64) * 0.3
    std = torch.linspace(0.2, 1.5, dim, dtype=torch.float64)
    samples = G + std * torch.randn(draws, batch, dim, generator=g, dtype=torch.float64)
    big = samples.mean(1).square().sum(-1)
    small = samples.view(draws, batch // micro, micro, dim).mean(2).square().sum(-1).mean(1)
    ests = [gradient_noise_scale(float(s), float(b), micro, batch) for s, b in zip(small, big)]
    mean_g = sum(e.grad_sq for e in ests) / draws
    mean_s = sum(e.trace_sigma for e in ests) / draws
    assert mean_g == pytest.approx(float(G.square().sum()), rel=0.05)
    assert mean_s == pytest.approx(float(std.square().sum()), rel=0.03)


def test_monitor_emas_and_state():
    mon = GradientNoiseMonitor(ema_alpha=0.5)
    m1 = mon.update(grad_norm_sq=0.375, micro_grad_norms_sq=[3.0, 5.0], micro_batch_sizes=1)
    # small = 4 at b=1, big = 0.375 at b=2: trΣ = 3.625/(1 − 1/2) = 7.25, |G|² = (0.75 − 4)/1 = −3.25
    assert m1["noise/trace_sigma"] == pytest.approx(7.25) and m1["noise/grad_sq"] == pytest.approx(-3.25)
    assert m1["noise/noise"] == pytest.approx(3.625) and m1["noise/noise_ema"] == pytest.approx(3.625)
    assert m1["noise/power"] == pytest.approx(4.0) and m1["noise/signal"] == pytest.approx(0.375)
    assert "noise/b_simple" not in m1 and "noise/b_simple_ema" not in m1   # |G|² <= 0: undefined
    state = mon.state_dict()
    m2 = mon.update(grad_norm_sq=3.0, micro_grad_norms_sq=[4.0, 6.0], micro_batch_sizes=[1, 1])
    # trΣ = 2·(5 − 3) = 4, |G|² = 2·3 − 5 = 1; EMAs with α = 0.5
    assert m2["noise/b_simple"] == pytest.approx(4.0)
    assert m2["noise/trace_sigma_ema"] == pytest.approx(5.625) and m2["noise/grad_sq_ema"] == pytest.approx(-1.125)
    assert "noise/b_simple_ema" not in m2
    resumed = GradientNoiseMonitor()
    resumed.load_state_dict(state)
    assert resumed.update(grad_norm_sq=3.0, micro_grad_norms_sq=[4.0, 6.0], micro_batch_sizes=[1, 1]) == m2
    single = mon.update(grad_norm_sq=1.0, micro_grad_norms_sq=[1.0], micro_batch_sizes=4)
    assert "noise/trace_sigma" not in single and single["noise/signal"] == 1.0


def test_a_micro_batch_without_loss_tokens_is_no_sample_of_the_small_batch():
    """A micro-batch of only failed agent episodes has size 0: it is left out, as if it had not been there
    (the union's gradient is the same), and with fewer than two micro-batches left only the signal is logged."""
    with_empty = GradientNoiseMonitor().update(grad_norm_sq=2.0, micro_grad_norms_sq=[3.0, 0.0, 5.0],
                                               micro_batch_sizes=[16.0, 0.0, 8.0])
    without = GradientNoiseMonitor().update(grad_norm_sq=2.0, micro_grad_norms_sq=[3.0, 5.0],
                                            micro_batch_sizes=[16.0, 8.0])
    assert with_empty == without and "noise/trace_sigma" in without
    alone = GradientNoiseMonitor().update(grad_norm_sq=2.0, micro_grad_norms_sq=[3.0, 0.0],
                                          micro_batch_sizes=[16.0, 0.0])
    assert "noise/signal" in alone and "noise/trace_sigma" not in alone and "noise/noise" not in alone


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="small_batch"):
        gradient_noise_scale(1.0, 1.0, 4, 4)
    with pytest.raises(ValueError, match="micro_sizes"):
        micro_batch_noise_scale([1.0, 2.0], [1, 2, 3], 1.0)
    with pytest.raises(ValueError, match="micro_batch_sizes"):
        GradientNoiseMonitor().update(grad_norm_sq=1.0, micro_grad_norms_sq=[1.0, 2.0])
    with pytest.raises(ValueError, match="grad_norm_sq"):
        GradientNoiseMonitor().update(grad_norm_sq=float("nan"))
