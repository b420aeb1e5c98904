"""token_logprobs / entropy / Σπ² / logit-gradient proxy against direct autograd computations."""

import pytest
import torch

import covrl.math.logprobs as lpmod
from covrl.math import entropy_from_logits, logit_grad_proxy, sum_pi_squared, token_logprobs

torch.set_num_threads(1)


def _data(B=3, T=4, V=13, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    z = (scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)).float()
    y = torch.randint(0, V, (B, T), generator=g)
    return z, y


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk", [None, 13 * 3, 13 * 8])  # forced small blocks: pieces of rows, groups of rows
def test_token_logprobs_matches_log_softmax_values_and_grads(temperature, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(lpmod, "CHUNK_ELEMENTS", chunk)
    z, y = _data()
    z1 = z.clone().requires_grad_(True)
    z2 = z.clone().requires_grad_(True)
    got = token_logprobs(z1, y, temperature)
    ref = torch.log_softmax(z2 / temperature, -1).gather(-1, y[..., None])[..., 0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    (g1,) = torch.autograd.grad((got * upstream).sum(), z1)
    (g2,) = torch.autograd.grad((ref * upstream).sum(), z2)
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [13 * 3, 13 * 8])
def test_chunked_paths_on_a_sliced_view_match_full_computation(chunk, monkeypatch):
    """The trainer passes logits[:, -(T+1):-1] (a non-contiguous view); every block layout must agree."""
    z, _ = _data(B=3, T=6)
    y = torch.randint(0, 13, (3, 4), generator=torch.Generator().manual_seed(2))
    view = z[:, 1:5]
    assert not view.is_contiguous()
    ref_lp = torch.log_softmax(view / 0.8, -1).gather(-1, y[..., None])[..., 0]
    ref_sps = (torch.softmax(view / 0.8, -1) ** 2).sum(-1)
    ref_ent = -(torch.softmax(view / 0.8, -1) * torch.log_softmax(view / 0.8, -1)).sum(-1)
    monkeypatch.setattr(lpmod, "CHUNK_ELEMENTS", chunk)
    leaf = z.clone().requires_grad_(True)
    lp = token_logprobs(leaf[:, 1:5], y, 0.8)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sum_pi_squared(view, 0.8), ref_sps, atol=1e-6, rtol=1e-5)
    ent = entropy_from_logits(leaf[:, 1:5], 0.8)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    (g,) = torch.autograd.grad(lp.sum() + ent.sum(), leaf)
    ref_leaf = z.clone().requires_grad_(True)
    u = ref_leaf[:, 1:5] / 0.8
    ref_total = torch.log_softmax(u, -1).gather(-1, y[..., None]).sum() - (
        torch.softmax(u, -1) * torch.log_softmax(u, -1)).sum()
    (g_ref,) = torch.autograd.grad(ref_total, ref_leaf)
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


def test_backward_leaves_logits_untouched():
    z, y = _data()
    z1 = z.clone().requires_grad_(True)
    token_logprobs(z1, y).sum().backward()
    torch.testing.assert_close(z1.detach(), z, atol=0, rtol=0)


def test_token_logprobs_topk_layout_and_bf16():
    z, y = _data(V=17)
    ids = torch.stack([y, (y + 1) % 17, (y + 5) % 17], -1)
    zb = z.to(torch.bfloat16).requires_grad_(True)
    got = token_logprobs(zb, ids, 0.8)
    assert got.dtype == torch.float32 and got.shape == ids.shape
    ref = torch.log_softmax(zb.detach().float() / 0.8, -1).gather(-1, ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    got.sum().backward()
    assert zb.grad.dtype == torch.bfloat16
    # gradient of Σ_k log π_k wrt z: (Σ_k e_k − K·π)/τ
    pi = torch.softmax(zb.detach().float() / 0.8, -1)
    onehots = torch.zeros_like(pi).scatter_add_(-1, ids, torch.ones(ids.shape))
    torch.testing.assert_close(zb.grad.float(), (onehots - 3 * pi) / 0.8, atol=2e-2, rtol=2e-2)


def test_entropy_matches_definition():
    z, _ = _data()
    for t in (1.0, 0.5):
        p = torch.softmax(z.double() / t, -1)
        ref = -(p * p.log()).sum(-1)
        torch.testing.assert_close(entropy_from_logits(z, t).double(), ref, atol=1e-5, rtol=1e-5)


def test_sum_pi_squared_matches_softmax_and_survives_huge_logits():
    z, _ = _data()
    for t in (1.0, 0.7):
        ref = (torch.softmax(z.double() / t, -1) ** 2).sum(-1)
        torch.testing.assert_close(sum_pi_squared(z, t).double(), ref, atol=1e-6, rtol=1e-5)
    big = torch.tensor([[[1e4, 1e4, -1e4, 0.0], [-1e4, -1e4, -1e4, -1e4], [1e4, -1e4, -1e4, -1e4]]])
    s = sum_pi_squared(big)
    torch.testing.assert_close(s, torch.tensor([[0.5, 0.25, 1.0]]))
    assert sum_pi_squared(big.to(torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logit_grad_proxy_is_squared_norm_of_autograd_gradient(temperature):
    """‖∂ log π_y / ∂u‖² = 1 − 2π_y + Σπ² with u = z/τ the scaled logits, computed position by position."""
    z, y = _data(B=2, T=3, V=9, seed=3)
    lp = token_logprobs(z, y, temperature)
    proxy = logit_grad_proxy(lp, sum_pi_squared(z, temperature))
    for b in range(2):
        for t in range(3):
            u = (z[b, t].double() / temperature).requires_grad_(True)
            (g,) = torch.autograd.grad(torch.log_softmax(u, -1)[y[b, t]], u)
            assert proxy[b, t].item() == pytest.approx(g.square().sum().item(), abs=1e-5)


def test_logit_grad_proxy_limits():
    # one-hot π on the drawn token: no gradient; uniform over V: 1 − 2/V + 1/V
    assert logit_grad_proxy(torch.zeros(1, 1), torch.ones(1, 1)).item() == 0.0
    V = 8
    lp = torch.full((1, 1), -torch.log(torch.tensor(float(V))).item())
    assert logit_grad_proxy(lp, torch.full((1, 1), 1 / V)).item() == pytest.approx(1 - 1 / V, abs=1e-6)


def test_errors_name_shapes_and_ranges():
    z, y = _data()
    with pytest.raises(ValueError, match=r"tokens must have shape \[3, 4\]"):
        token_logprobs(z, y[:, :2])
    with pytest.raises(ValueError, match=r"\[0, 13\)"):
        token_logprobs(z, y + 13)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(z, y, 0.0)
    with pytest.raises(ValueError, match="integer"):
        token_logprobs(z, y.float())
    with pytest.raises(ValueError, match="shape mismatch"):
        logit_grad_proxy(torch.zeros(2, 3), torch.zeros(3, 2))


def test_precision_at_logits_of_1e4():
    z = torch.tensor([[[1e4, 1e4 - 1.0, -1e4, 1e4 - 3.0]]], requires_grad=True)
    ref_z = z.detach().double().requires_grad_(True)
    y = torch.tensor([[1]])
    got = token_logprobs(z, y)
    ref = torch.log_softmax(ref_z, -1)[..., 1]
    assert got.item() == pytest.approx(ref.item(), abs=1e-6)
    got.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(z.grad.double(), ref_z.grad, atol=1e-6, rtol=1e-6)
    s = sum_pi_squared(z.detach())
    assert s.item() == pytest.approx((torch.softmax(ref_z.detach(), -1) ** 2).sum().item(), abs=1e-6)


def test_sum_pi_squared_and_entropy_gradients_match_direct_formulas():
    z, _ = _data(B=2, T=3, V=7, seed=5)
    a = z.clone().requires_grad_(True)
    b = z.clone().requires_grad_(True)
    (ga,) = torch.autograd.grad((sum_pi_squared(a, 0.9) + entropy_from_logits(a, 0.9)).sum(), a)
    p = torch.softmax(b / 0.9, -1)
    (gb,) = torch.autograd.grad(((p**2).sum(-1) - (p * torch.log_softmax(b / 0.9, -1)).sum(-1)).sum(), b)
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the in-place path gives the same values
        torch.testing.assert_close(sum_pi_squared(a, 0.9), sum_pi_squared(z, 0.9))
