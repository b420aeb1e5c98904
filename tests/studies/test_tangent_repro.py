"""`python -m studies tangent --fast`: every criterion of the reproduction must hold (docs/theory.md §5)."""

from __future__ import annotations

import json

import torch
from studies.common import write_result

torch.set_num_threads(1)


def test_fast_tangent_reproduction_meets_its_criteria(tmp_path):
    from studies.tangent import tangent

    result = tangent.run(tmp_path, fast=True, seed=0)
    failed = [(c.name, c.measured) for c in result.criteria if not c.passed]
    assert not failed, failed
    assert len(result.criteria) >= 7
    assert (tmp_path / result.figures[0]).stat().st_size > 10_000
    numbers = result.numbers
    assert numbers["per_V_T"]["V3_T8"]["pairs"] >= 100
    assert numbers["classical_bound_violations"] == 0  # the classical bounds themselves hold
    assert max(numbers["monotone"]["penalised_surrogate_end"]) > 0
    # the drift section's exact q (trainer logits + injected bias) is what the sampler drew from
    assert numbers["drift_vs_is_vs_masking"]["sampler_logprob_check_max_abs"] < 1e-4
    assert len(result.figures) == 2 and all((tmp_path / f).is_file() for f in result.figures)
    write_result(result, tmp_path)
    payload = json.loads((tmp_path / "result.json").read_text())
    assert payload["passed"] is True


def test_mm_rounds_with_zero_step_keeps_the_policy():
    from studies.tangent.tangent import _positionwise_problem, mm_rounds

    theta0, token_logprobs, rewards = _positionwise_problem(horizon=4, target=2)
    out = mm_rounds(theta0, token_logprobs, rewards, penalty=True, rounds=2, inner_steps=2, lr=0.0)
    assert out["J"] == [out["J"][0]] * 3
    assert out["penalised_surrogate_end"] == [0.0, 0.0]


def _expected_logit_grad(z, logq, loss_of_token):
    """Σ_y q_y ∇_z loss(y): the expected logit gradient of a one-token loss when y is drawn from q."""
    total = torch.zeros_like(z)
    for y in range(z.shape[-1]):
        zz = z.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(loss_of_token(zz, y), zz)
        total += logq[y].exp() * grad
    return total


def test_expected_score_shift_matches_the_trainer_losses_by_autograd():
    from studies.tangent.tangent import expected_score_shift

    from covrl.math import policy_loss, score_centering_term

    g = torch.Generator().manual_seed(0)
    vocab = 7
    z = torch.randn(vocab, generator=g, dtype=torch.float64)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64)
    logq = torch.log_softmax(z + bias, -1)
    p, q = torch.softmax(z, -1), logq.exp()
    one = torch.ones(1, 1)

    def covariance(zz, y, weights=None):
        lp = torch.log_softmax(zz, -1)[y].float().view(1, 1)
        return policy_loss("covariance", logprobs=lp, sampler_logprobs=logq[y].float().view(1, 1),
                           advantages=one, mask=one, is_weights=weights).loss

    def tis(zz, y):
        ratio = (torch.log_softmax(zz, -1)[y] - logq[y]).exp().detach().float()
        return covariance(zz, y, weights=torch.clamp(ratio, max=2.0).view(1, 1))

    top = q.topk(3).indices

    def centred(zz, y):
        lp_top = torch.log_softmax(zz, -1)[top].float().view(1, 1, -1)
        term = score_centering_term(lp_top, logq[top].float().view(1, 1, -1), one, one).loss
        return covariance(zz, y) + term

    # the losses are −A·(...) with A = 1, so the expected logit gradient is −u
    for loss, kwargs in ((covariance, {}), (tis, {"tis_threshold": 2.0}), (centred, {"centring_topk": 3})):
        expected = -_expected_logit_grad(z, logq, loss)
        assert torch.allclose(expected, expected_score_shift(p, q, **kwargs), atol=1e-6), loss.__name__
    # on-policy every shift vanishes
    for kwargs in ({}, {"tis_threshold": 2.0}, {"centring_topk": 3}):
        assert expected_score_shift(p, p, **kwargs).abs().max() < 1e-12
