"""fisher_cap / covariance_split / concentration against per-sample autograd, enumeration and hand cases."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from covrl.diagnostics import covariance_split, fisher_cap
from covrl.diagnostics.fisher import concentration, fisher_diagonal
from covrl.diagnostics.reach import as_sequences, per_sample_scores, select_params

torch.set_num_threads(1)


def _model(seed=0, tie=False):
    from covrl.models import tiny_llama

    return tiny_llama(12, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=16,
                      tie_embeddings=tie, seed=seed).double()


MODEL = _model()


def _batch(seed, B=6, P=3, R=3, V=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P + R), generator=gen)
    ids[:, 0] = 1
    sm = torch.zeros(B, P + R, dtype=torch.bool)
    sm[:, P:] = True
    return {"input_ids": ids, "score_mask": sm}, torch.rand(B, generator=gen, dtype=torch.float64)


def _stacked_scores(model, batch, params=None):
    chosen = select_params(model, params)
    rows = [torch.cat([g.flatten() for g in s]) for _, _, s in per_sample_scores(model, as_sequences(batch), chosen)]
    return torch.stack(rows), chosen


def test_covariance_split_hand_case():
    # two samples, scores ±1, A = (1, 0): g = 0.5, drift = 0.5·0, signal = 0.5, F = 1, std(A) = 0.5 → tight cap
    cs = covariance_split(torch.tensor([[1.0], [-1.0]]), torch.tensor([1.0, 0.0]))
    assert cs.grad.item() == pytest.approx(0.5) and cs.drift.item() == pytest.approx(0.0)
    assert cs.signal.item() == pytest.approx(0.5) and cs.fisher.item() == pytest.approx(1.0)
    assert cs.cap.item() == pytest.approx(0.5) and cs.corr.item() == pytest.approx(1.0)
    # a constant score: all drift, zero Fisher, over the cap when uncentred
    cs = covariance_split(torch.tensor([[2.0], [2.0]]), torch.tensor([1.0, 3.0]))
    assert cs.drift.item() == pytest.approx(4.0) and cs.signal.item() == pytest.approx(0.0)
    assert cs.metrics["grad_over_cap_frac"] == 1.0 and cs.metrics["signal_over_cap_frac"] == 0.0


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 12), st.integers(1, 6), st.integers(0, 10_000), st.booleans())
def test_covariance_split_identity_and_cap(B, P, seed, weighted):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(B, P, generator=gen, dtype=torch.float64) + torch.randn(P, generator=gen, dtype=torch.float64)
    a = torch.randn(B, generator=gen, dtype=torch.float64) + 2.0
    w = torch.rand(B, generator=gen, dtype=torch.float64) if weighted else None
    cs = covariance_split(s, a, w)
    assert torch.allclose(cs.grad, cs.drift + cs.signal, atol=1e-12)
    assert cs.metrics["signal_over_cap_frac"] == 0.0
    assert bool((cs.signal.abs() <= cs.cap * (1 + 1e-10) + 1e-14).all())
    assert float(cs.corr.abs().max()) <= 1 + 1e-10


@pytest.mark.parametrize("center", ["score", "advantage", "none"])
def test_fisher_cap_matches_per_sample_autograd(center):
    batch, adv = _batch(1)
    fc = fisher_cap(MODEL, batch, adv, center=center)
    S, chosen = _stacked_scores(MODEL, batch)
    cs = covariance_split(S, adv)
    grad = torch.cat([fc.tensors[n].grad.flatten() for n, _ in chosen])
    fisher = torch.cat([fc.tensors[n].fisher.flatten() for n, _ in chosen])
    shift = torch.cat([fc.tensors[n].mean_shift.flatten() for n, _ in chosen])
    want = cs.grad if center == "none" else cs.signal
    assert torch.allclose(grad, want, atol=1e-10, rtol=1e-8)
    assert torch.allclose(fisher, cs.fisher, atol=1e-10, rtol=1e-8)
    assert torch.allclose(shift, cs.drift, atol=1e-10, rtol=1e-8)
    assert fc.method == "per-sample"


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 10_000))
def test_centred_fisher_cap_holds_exactly_on_the_batch(seed):
    batch, adv = _batch(seed, B=5)
    fc = fisher_cap(MODEL, batch, adv + 1.0, center="score")
    assert fc.metrics["over_cap_frac"] == 0.0
    assert fc.metrics["max_cap_ratio"] <= 1 + 1e-9
    for t in fc.tensors.values():
        assert bool((t.grad.abs() <= t.cap * (1 + 1e-9) + 1e-12).all())


def test_lm_head_fast_path_is_exact():
    batch, adv = _batch(2)
    fast = fisher_cap(MODEL, batch, adv, center="none", params="lm_head")
    slow = fisher_cap(MODEL, batch, adv, center="none", params="lm_head", lm_head_fast=False)
    assert fast.method == "lm_head-exact" and slow.method == "per-sample"
    for name in ("grad", "fisher", "mean_shift"):
        assert torch.allclose(getattr(fast.tensors["lm_head.weight"], name),
                              getattr(slow.tensors["lm_head.weight"], name), atol=1e-12)
    assert torch.allclose(fast.logprobs, slow.logprobs, atol=1e-10)


def test_tied_lm_head_has_no_fast_path():
    model = _model(tie=True)
    batch, adv = _batch(3)
    name = [n for n, _ in model.named_parameters() if "embed" in n][0]
    fc = fisher_cap(model, batch, adv, params=[name])
    assert fc.method == "per-sample"


def test_weights_give_exact_expectations_by_enumeration():
    from torch import nn

    class Tab(nn.Module):
        def __init__(self):
            super().__init__()
            self.theta = nn.Parameter(torch.tensor([0.5, -0.2, 1.0], dtype=torch.float64))

        def forward(self, input_ids, attention_mask=None):
            return self.theta.expand(*input_ids.shape, -1)

    model = Tab()
    batch = {"input_ids": torch.tensor([[0, 0], [0, 1], [0, 2]]),
             "score_mask": torch.tensor([[False, True]] * 3)}
    pi = torch.softmax(model.theta.detach(), 0)
    reward = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    fc = fisher_cap(model, batch, reward, center="none", weights=pi)
    t = fc.tensors["theta"]
    # on-policy: E[s] = 0 (no mean shift); g = π ⊙ (r − π·r); F = diag(π) − π² on the diagonal
    assert torch.allclose(t.mean_shift, torch.zeros(3, dtype=torch.float64), atol=1e-15)
    assert torch.allclose(t.grad, pi * (reward - pi @ reward), atol=1e-15)
    assert torch.allclose(t.fisher, pi * (1 - pi), atol=1e-15)


def test_sampler_logprobs_report_mismatch_and_fisher_diagonal():
    batch, adv = _batch(4)
    fc = fisher_cap(MODEL, batch, adv, sampler_logprobs=torch.zeros(6), keep_tensors=False)
    assert fc.metrics["mismatch_log_ratio_mean"] == pytest.approx(float(fc.logprobs.mean()))
    assert all(t.grad is None for t in fc.tensors.values())
    fd = fisher_diagonal(MODEL, batch)
    S, chosen = _stacked_scores(MODEL, batch)
    assert torch.allclose(torch.cat([fd[n].flatten() for n, _ in chosen]), S.var(0, unbiased=False), atol=1e-10)


def test_concentration_hand_cases():
    f = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    v = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0])
    assert concentration(f, v, 0.2) == pytest.approx(0.5)
    assert concentration(f, torch.ones(5), 0.4) == pytest.approx(0.4)
    # ties at the threshold are shared in proportion
    assert concentration(torch.ones(4), torch.tensor([4.0, 0.0, 0.0, 0.0]), 0.5) == pytest.approx(0.5)
    assert concentration({"a": f}, {"a": v}, 0.2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="frac"):
        concentration(f, v, 0.0)


def test_errors():
    batch, adv = _batch(5)
    with pytest.raises(ValueError, match="center"):
        fisher_cap(MODEL, batch, adv, center="mean")
    with pytest.raises(ValueError, match="no parameter"):
        fisher_cap(MODEL, batch, adv, params="does-not-exist")
    with pytest.raises(ValueError, match="weights"):
        fisher_cap(MODEL, batch, adv, weights=torch.ones(2))
    with pytest.raises(ValueError, match="advantages"):
        covariance_split(torch.zeros(3, 2), torch.zeros(2))
