"""output_layer_signal against autograd and brute-force per-position computations."""

import pytest
import torch

from covrl.diagnostics import output_layer_signal


def _setup(seed=0, B=3, T=5, V=40, d=8, scale=3.0, temperature=1.0):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=gen, dtype=torch.float64)
    h = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    z = scale * h @ W.T  # logits = W_U h with W_U = scale·W
    y = torch.multinomial(torch.softmax(z / temperature, -1).reshape(-1, V), 1, generator=gen).reshape(B, T)
    A = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, 3:] = 0
    return scale * W, h, z, y, A, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_signal_and_lm_head_gradient_match_autograd(temperature):
    W_U, h, z, y, A, mask = _setup(temperature=temperature)
    out = output_layer_signal(z, y, A, W_U, mask, 0.05, temperature=temperature, hidden=h)
    hh = h.clone().requires_grad_()
    WW = W_U.clone().requires_grad_()
    logp = torch.log_softmax(hh @ WW.T / temperature, -1).gather(-1, y[..., None]).squeeze(-1)
    gh, gw = torch.autograd.grad((A[:, None] * logp * mask).sum(), [hh, WW])
    assert torch.allclose(out.signal, gh[mask > 0], atol=1e-12)
    assert torch.allclose(out.lm_head_grad, gw, atol=1e-12)
    assert out.positions.tolist() == (mask > 0).nonzero().tolist()


def test_competing_sets_tail_span_and_rows_brute_force():
    eps = 0.05
    W_U, h, z, y, A, mask = _setup(seed=3)
    out = output_layer_signal(z, y, A, W_U, mask, eps, hidden=h)
    pi_all = torch.softmax(z, -1)
    for n, (b, t) in enumerate(out.positions.tolist()):
        pi = pi_all[b, t]
        order = torch.argsort(pi, descending=True).tolist()
        members, mass = [], 0.0
        for v in order:
            if mass >= 1 - eps:
                break
            members.append(v)
            mass += float(pi[v])
        if int(y[b, t]) not in members:
            members.append(int(y[b, t]))
        assert int(out.competing_sizes[n]) == len(members)
        assert float(out.tail_mass[n]) == pytest.approx(1 - float(pi[members].sum()), abs=1e-12)
        g = A[b] * (W_U[y[b, t]] - pi @ W_U)
        D = W_U[members[1:]] - W_U[members[0]]
        if len(members) > 1:
            coef = torch.linalg.lstsq(D.T, g[:, None]).solution
            share = float((D.T @ coef).pow(2).sum() / g.pow(2).sum())
        else:
            share = 0.0
        assert float(out.span_share[n]) == pytest.approx(share, abs=1e-8)
        resid = -pi.clone()
        resid[y[b, t]] += 1
        assert float(out.proxy[n]) == pytest.approx(float(resid.pow(2).sum()), abs=1e-12)
        assert float(out.row_share[n]) == pytest.approx(float(resid[members].pow(2).sum() / resid.pow(2).sum()),
                                                        abs=1e-12)


def test_proxy_matches_math_layer():
    from covrl.math import logit_grad_proxy, sum_pi_squared, token_logprobs

    W_U, h, z, y, A, mask = _setup(seed=5)
    out = output_layer_signal(z, y, A, W_U, mask, 0.01)
    ref = logit_grad_proxy(token_logprobs(z, y), sum_pi_squared(z))[mask > 0]
    assert torch.allclose(out.proxy.float(), ref, atol=1e-5)


def test_signal_vanishes_in_span_when_tail_is_empty():
    # three competing tokens hold all the mass: the signal lies exactly in span{w_u − w_v}, rank ≤ 2
    gen = torch.Generator().manual_seed(1)
    V, d, N = 30, 10, 50
    W_U = torch.randn(V, d, generator=gen, dtype=torch.float64)
    z = torch.full((1, N, V), -200.0, dtype=torch.float64)
    z[0, :, :3] = torch.randn(N, 3, generator=gen, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z[0], -1), 1, generator=gen).T
    A = torch.randn(1, N, generator=gen, dtype=torch.float64)
    out = output_layer_signal(z, y, A, W_U, torch.ones(1, N), 1e-9, k=2)
    assert out.metrics["span_share"] == pytest.approx(1.0, abs=1e-10)
    assert out.metrics["competing_union"] == 3
    assert out.metrics["energy_top_k"] == pytest.approx(1.0, abs=1e-12)
    assert out.metrics["numerical_rank"] == 2


def test_errors_name_the_field():
    W_U, h, z, y, A, mask = _setup()
    with pytest.raises(ValueError, match="tokens"):
        output_layer_signal(z, y[:, :2], A, W_U, mask)
    with pytest.raises(ValueError, match="W_U"):
        output_layer_signal(z, y, A, W_U[:5], mask)
    with pytest.raises(ValueError, match="advantages"):
        output_layer_signal(z, y, A[:1], W_U, mask)
    with pytest.raises(ValueError, match="tail_eps"):
        output_layer_signal(z, y, A, W_U, mask, 1.5)
