"""KL estimators: exact expectations over enumerated categoricals, straight-through gradients."""

import pytest
import torch

from covrl.math import kl_estimate

torch.set_num_threads(1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k1_k3_expectations_equal_exact_kl(seed):
    g = torch.Generator().manual_seed(seed)
    logq = torch.log_softmax(2 * torch.randn(6, generator=g, dtype=torch.float64), 0)
    logp = torch.log_softmax(2 * torch.randn(6, generator=g, dtype=torch.float64), 0)
    q = logq.exp()
    exact = (q * (logq - logp)).sum()  # KL(q‖p), tokens drawn from q
    for kind in ("k1", "k3"):
        est = (q * kl_estimate(logq[None], logp[None], kind)[0].double()).sum()
        assert est.item() == pytest.approx(exact.item(), rel=1e-5)
    k2 = kl_estimate(logq[None], logp[None], "k2")
    assert (k2 >= 0).all() and (kl_estimate(logq[None], logp[None], "k3") >= 0).all()
    torch.testing.assert_close(kl_estimate(logq[None], logp[None], "abs")[0].double(), (logp - logq).abs(),
                               atol=1e-6, rtol=1e-6)


def test_hand_values():
    lr = torch.tensor([[0.5, -1.0]])
    z = torch.zeros(1, 2)
    torch.testing.assert_close(kl_estimate(z, lr, "k1"), -lr)
    torch.testing.assert_close(kl_estimate(z, lr, "k2"), 0.5 * lr**2)
    torch.testing.assert_close(kl_estimate(z, lr, "k3"), lr.exp() - 1 - lr)


def test_straight_through_value_of_kind_gradient_of_k2():
    logp = torch.tensor([[-0.3, -2.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-0.5, -1.0, -1.0]])
    st = kl_estimate(logp, ref, "k3", straight_through=True)
    torch.testing.assert_close(st, kl_estimate(logp, ref, "k3"))
    (g_st,) = torch.autograd.grad(st.sum(), logp)
    (g_k2,) = torch.autograd.grad(kl_estimate(logp, ref, "k2").sum(), logp)
    torch.testing.assert_close(g_st, g_k2)
    torch.testing.assert_close(g_k2, (logp - ref).detach())  # ∂½(log p − log ref)²/∂log p


def test_on_policy_k2_gradient_is_exact_reverse_kl_gradient():
    """E_{y∼p}[∇ k2(y)] = ∇ KL(p‖ref) for tokens sampled from the trained policy p (enumerated)."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5, generator=g, dtype=torch.float64).requires_grad_(True)
    logref = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), 0)
    logp = torch.log_softmax(z, 0)
    p = logp.exp().detach()
    est = (p * kl_estimate(logp[None], logref[None], "k3", straight_through=True)[0].double()).sum()
    (g_est,) = torch.autograd.grad(est, z)
    logp = torch.log_softmax(z, 0)
    exact = (logp.exp() * (logp - logref)).sum()
    (g_exact,) = torch.autograd.grad(exact, z)
    torch.testing.assert_close(g_est, g_exact, atol=1e-6, rtol=1e-5)


def test_errors():
    with pytest.raises(ValueError, match=r"valid choices: \['abs', 'k1', 'k2', 'k3'\]"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 2), "k4")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(2, 1), "k1")
    assert torch.isfinite(kl_estimate(torch.tensor([[-1e4]]), torch.tensor([[0.0]]), "k3")).all()
