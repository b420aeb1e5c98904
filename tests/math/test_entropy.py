"""Clip-Cov and the entropy a policy-gradient step takes away (docs/theory.md §16): the first-order entropy change
against autograd, the token covariance by hand, the selection by hand and by brute force, group locality."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from covrl.math import clip_cov_keep, token_covariance


def test_first_order_entropy_change_is_minus_the_covariance_of_log_pi_and_the_logit_move():
    """ΔH = −Cov_π(log π, Δz) to first order: the formula Clip-Cov rests on, against autograd."""
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        z = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
        dz = torch.randn(7, generator=g, dtype=torch.float64)
        pi = torch.softmax(z, 0)
        entropy = -(pi * torch.log(pi)).sum()
        (grad,) = torch.autograd.grad(entropy, z)
        p, logp = pi.detach(), torch.log(pi.detach())
        cov = (p * logp * dz).sum() - (p * logp).sum() * (p * dz).sum()
        assert float(grad @ dz) == pytest.approx(float(-cov), rel=1e-12, abs=1e-12)


def test_token_covariance_by_hand():
    # one group of two rows; masked mean of A = (1+1+(-1))/3 = 1/3, of log p = (-1-2-3)/3 = -2
    adv = torch.tensor([[1.0, 1.0], [-1.0, 5.0]])
    lp = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    cov = token_covariance(adv, lp, mask, torch.tensor([7, 7]))
    expected = torch.tensor([[(2 / 3) * 1.0, (2 / 3) * 0.0], [(-4 / 3) * (-1.0), 0.0]])
    torch.testing.assert_close(cov, expected)


def test_clip_cov_drops_the_largest_positive_covariance_of_each_group():
    # group 0: covariances by token (A − 0)(lp − mean) with A = ±1 per row
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [2.0, 2.0, 0.0], [-2.0, -2.0, 0.0]])
    lp = torch.tensor([[-0.1, -2.0, -0.5], [-3.0, -0.2, -1.0], [-0.1, -0.3, 0.0], [-5.0, -0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    groups = torch.tensor([0, 0, 1, 1])
    cov = token_covariance(adv, lp, mask, groups)
    out = clip_cov_keep(adv, lp, mask, groups, fraction=1 / 3)   # group 0: 2 of 6 tokens; group 1: 1 of 4
    dropped = (mask - out.keep).nonzero().tolist()
    top0 = sorted(range(6), key=lambda i: -float(cov[:2].reshape(-1)[i]))[:2]
    top1 = max(((r, c) for r in (2, 3) for c in (0, 1)), key=lambda rc: float(cov[rc]))
    assert sorted(dropped) == sorted([[i // 3, i % 3] for i in top0] + [list(top1)])
    assert all(float(cov[r, c]) > 0 for r, c in dropped)
    assert out.metrics["clip_cov/clipped_frac"] == pytest.approx(3 / 10)
    positive = float(cov.clamp_min(0).sum())
    assert out.metrics["clip_cov/clipped_cov_share"] == pytest.approx(
        sum(float(cov[r, c]) for r, c in dropped) / positive)


def test_only_positive_covariance_is_clipped_and_zero_fraction_keeps_everything():
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])   # no spread in log p: every covariance is 0
    mask = torch.ones(2, 2)
    out = clip_cov_keep(adv, lp, mask, torch.tensor([0, 0]), fraction=0.9)
    torch.testing.assert_close(out.keep, mask)
    assert out.metrics["clip_cov/clipped_frac"] == 0.0
    lp = torch.randn(2, 2)
    torch.testing.assert_close(clip_cov_keep(adv, lp, mask, torch.tensor([0, 0]), 0.0).keep, mask)


def _brute_force_keep(adv, lp, mask, groups, fraction):
    cov = token_covariance(adv, lp, mask, groups)
    keep = mask.clone()
    for g in groups.unique().tolist():
        cells = [(r, c) for r in (groups == g).nonzero().flatten().tolist() for c in range(mask.shape[1])
                 if mask[r, c] > 0]
        quota = int(len(cells) * fraction + 0.5)
        # stable: by covariance descending, then row-major position
        ranked = sorted((cell for cell in cells if cov[cell] > 0), key=lambda cell: (-float(cov[cell]), cell))
        for cell in ranked[:quota]:
            keep[cell] = 0.0
    return keep


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 6), width=st.integers(1, 5),
       fraction=st.sampled_from([0.05, 0.2, 0.5, 0.99]))
def test_clip_cov_matches_brute_force_and_is_local_to_groups(seed, rows, width, fraction):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(rows, width, generator=g).round(decimals=1)
    lp = -torch.rand(rows, width, generator=g).round(decimals=1)
    mask = (torch.rand(rows, width, generator=g) > 0.3).float()
    groups = torch.randint(0, 3, (rows,), generator=g)
    out = clip_cov_keep(adv, lp, mask, groups, fraction)
    torch.testing.assert_close(out.keep, _brute_force_keep(adv, lp, mask, groups, fraction))
    for gid in groups.unique():   # each group alone selects what it selected inside the batch
        rows_g = (groups == gid).nonzero().flatten()
        alone = clip_cov_keep(adv[rows_g], lp[rows_g], mask[rows_g], groups[rows_g], fraction).keep
        torch.testing.assert_close(alone, out.keep[rows_g])


def test_the_mean_token_covariance_of_samples_estimates_the_natural_gradient_entropy_change():
    """Tokens sampled from π with an advantage per token: the mean token covariance estimates Cov_π(log π, A),
    and a natural-gradient logit move Δz = η·A lowers the entropy by η times that (to first order)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(6, generator=g, dtype=torch.float64)
    pi = torch.softmax(z, 0)
    a = torch.randn(6, generator=g, dtype=torch.float64)
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    cov = token_covariance(a[tokens][None], torch.log(pi)[tokens][None], torch.ones(1, tokens.numel()),
                           torch.tensor([0]))
    logp = torch.log(pi)
    exact = float((pi * logp * a).sum() - (pi * logp).sum() * (pi * a).sum())
    assert float(cov.mean()) == pytest.approx(exact, abs=0.02 * max(abs(exact), 0.1))
    eta = 1e-6
    pi_after = torch.softmax(z + eta * a, 0)
    change = float(-(pi_after * torch.log(pi_after)).sum() + (pi * logp).sum())
    assert change == pytest.approx(-eta * exact, rel=1e-3)


def test_clip_cov_names_bad_arguments():
    adv = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="fraction"):
        clip_cov_keep(adv, adv, torch.ones(2, 3), torch.tensor([0, 0]), 1.0)
    with pytest.raises(ValueError, match="group_ids"):
        clip_cov_keep(adv, adv, torch.ones(2, 3), torch.tensor([0, 0, 1]), 0.1)
    with pytest.raises(ValueError, match="shape mismatch"):
        token_covariance(adv, torch.zeros(2, 2), torch.ones(2, 3), torch.tensor([0, 0]))
