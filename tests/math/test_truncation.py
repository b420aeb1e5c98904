"""Truncated sampling, exactly (docs/theory.md §12): kept sets by hand and by brute force, the ratio's mean under
the full softmax (S) and under replay (1), the replayed importance-sampling gradient against the exact gradient
of the truncated objective, and the split of the sequence KL into the truncated gap plus the truncation term —
all by enumeration on a tiny vocabulary and a short horizon."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from covrl.math import token_logprobs
from covrl.math.truncation import TruncationRule, kept_log_mass, kept_mask, truncate_logits

F64 = torch.float64   # exact enumeration: double precision throughout


def brute_kept(u: list[float], rule: TruncationRule) -> set[int]:
    """The definition, token by token: top-k (ties kept), then the shortest sorted prefix of the top-k
    distribution with mass >= top_p (ties at its last value kept), then pi_v >= min_p * max pi."""
    order = sorted(range(len(u)), key=lambda v: -u[v])
    keep = set(range(len(u)))
    if 0 < rule.top_k < len(u):
        kth = u[order[rule.top_k - 1]]
        keep = {v for v in keep if u[v] >= kth}
    if rule.top_p < 1.0:
        z = sum(math.exp(u[v]) for v in keep)
        mass, last = 0.0, None
        for v in (v for v in order if v in keep):
            if mass >= rule.top_p:
                break
            mass += math.exp(u[v]) / z
            last = u[v]
        keep = {v for v in keep if u[v] >= last}
    if rule.min_p > 0.0:
        top = max(u)
        keep = {v for v in keep if math.exp(u[v] - top) >= rule.min_p}
    return keep


def test_hand_cases_top_k_ties_top_p_boundary_min_p_and_a_kept_set_of_one():
    u = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125) - 1e-3]], dtype=F64)
    kept = lambda **r: set(kept_mask(u, 1.0, TruncationRule(**r))[0].nonzero().flatten().tolist())
    assert kept(top_k=2) == {0, 1}
    assert kept(top_p=0.75) == {0, 1}           # 0.5 + 0.25 reaches 0.75 exactly: the prefix stops there
    assert kept(top_p=0.76) == {0, 1, 2}
    assert kept(min_p=0.5) == {0, 1}            # 0.25 >= 0.5 * 0.5, 0.125 is not
    assert kept(top_k=1) == {0} and kept(top_p=1e-9) == {0}   # a kept set of one token
    tie = torch.tensor([[0.0, 0.0, -1.0]], dtype=F64)
    assert kept_mask(tie, 1.0, TruncationRule(top_k=1))[0].tolist() == [True, True, False]   # ties at the k-th
    assert kept_mask(u, 1.0, None).all() and kept_mask(u, 1.0, TruncationRule()).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-4, 4), min_size=2, max_size=7), st.integers(0, 7), st.floats(0.05, 1.0),
       st.floats(0.0, 0.9), st.floats(0.3, 2.5))
def test_kept_mask_is_the_definition(values, top_k, top_p, min_p, temperature):
    rule = TruncationRule(top_k=top_k, top_p=top_p, min_p=min_p)
    z = torch.tensor([values], dtype=F64)
    got = set(kept_mask(z, temperature, rule)[0].nonzero().flatten().tolist())
    assert got == brute_kept([v / temperature for v in values], rule)
    counts = kept_mask(z, temperature, rule).sum(-1)
    assert torch.equal(kept_mask(z, temperature, counts=counts), kept_mask(z, temperature, rule))   # replay


def test_included_tokens_are_always_kept():
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]], dtype=F64)
    m = kept_mask(z, 1.0, TruncationRule(top_k=1), include=torch.tensor([2]))
    assert m[0].tolist() == [True, False, True, False]


def test_ratio_mean_is_the_kept_mass_under_the_full_softmax_and_one_under_replay():
    gen = torch.Generator().manual_seed(0)
    z_sampler = torch.randn(5, 6, generator=gen, dtype=F64) * 2
    z_trainer = z_sampler + 0.05 * torch.randn(5, 6, generator=gen, dtype=F64)   # a slightly different engine
    for rule in (TruncationRule(top_k=3), TruncationRule(top_p=0.8), TruncationRule(min_p=0.2),
                 TruncationRule(top_k=4, top_p=0.9, min_p=0.05)):
        for tau in (1.0, 0.7):
            kept_s = kept_mask(z_sampler, tau, rule)
            logq = torch.log_softmax(truncate_logits(z_sampler, kept_s) / tau, -1)
            logp = torch.log_softmax(z_trainer / tau, -1)
            kept_t = kept_mask(z_trainer, tau, counts=kept_s.sum(-1))
            logp_k = torch.log_softmax(truncate_logits(z_trainer, kept_t) / tau, -1)
            q = logq.exp()
            mean_full = (q * (logp - logq).exp().nan_to_num()).sum(-1)
            assert torch.allclose(mean_full, kept_log_mass(z_trainer, tau, kept_s).exp(), atol=1e-12)
            assert (mean_full < 1 - 1e-6).any()        # biased: the factor S < 1 on every truncated position
            same_support = torch.equal(kept_t, kept_s)
            mean_replay = (q * (logp_k - logq).exp().nan_to_num()).sum(-1)
            assert same_support and torch.allclose(mean_replay, torch.ones(5, dtype=F64), atol=1e-12)


def test_token_logprobs_of_truncated_logits_and_their_gradient():
    """log pi_K(y) = z_y/tau - logsumexp_K(z/tau), and its gradient (e_y - pi_K)/tau on K, 0 outside."""
    z = torch.tensor([[1.0, 0.5, -0.3, -2.0]], dtype=F64, requires_grad=True)
    tau = 0.8
    kept = kept_mask(z.detach(), tau, TruncationRule(top_k=3))
    lp = token_logprobs(truncate_logits(z, kept), torch.tensor([1]), tau)
    ref = z[0, 1] / tau - torch.logsumexp(z[0, :3] / tau, 0)
    assert torch.allclose(lp[0].double(), ref, atol=1e-6)   # token_logprobs is fp32
    lp.sum().backward()
    pik = torch.softmax(z.detach()[0, :3] / tau, 0)
    expect = torch.zeros(4, dtype=F64)
    expect[:3] = -pik / tau
    expect[1] += 1 / tau
    assert torch.allclose(z.grad[0], expect, atol=1e-6)


# ------------------------------------------------------------------ sequences: a tiny autoregressive policy

V, T = 3, 3
RULE = TruncationRule(top_k=2)


def _logits(theta: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
    """Logits of the next token after `prefix`: one row of parameters per prefix (tabular policy)."""
    index = sum(t * V ** i for i, t in enumerate(prefix)) + sum(V ** i for i in range(len(prefix)))
    return theta[index]


def _kept(theta, prefix) -> torch.Tensor:
    return kept_mask(_logits(theta, prefix)[None].detach(), 1.0, RULE)


def _seq_logprob(theta, seq, *, truncated: bool, kept_from=None):
    """log p(seq) under the full softmax, or restricted to kept sets: those of the policy `kept_from` (the
    sampler's, replayed on theta's logits), else the rule on theta's own logits."""
    total = torch.zeros((), dtype=F64)
    for t in range(len(seq)):
        z = _logits(theta, seq[:t])[None]
        if truncated:
            z = truncate_logits(z, _kept(theta if kept_from is None else kept_from, seq[:t]))
        total = total + torch.log_softmax(z, -1)[0, seq[t]]
    return total


def _policy(seed: int, scale: float = 1.5) -> torch.Tensor:
    rows = sum(V ** i for i in range(T))
    return (scale * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed), dtype=F64)).requires_grad_(True)


SEQS = list(itertools.product(range(V), repeat=T))
REWARD = {s: float(sum(s) % 2) + 0.1 * s[0] for s in SEQS}


def test_the_replayed_is_gradient_is_the_exact_gradient_of_the_truncated_objective():
    sampler, trainer = _policy(1), _policy(2, 1.0)
    with torch.no_grad():
        trainer.copy_(sampler + 0.2 * torch.randn(sampler.shape, generator=torch.Generator().manual_seed(3), dtype=F64))
    logq = {s: _seq_logprob(sampler, s, truncated=True).detach() for s in SEQS}
    # exact objective of the truncated trainer policy and its gradient
    j = sum(_seq_logprob(trainer, s, truncated=True, kept_from=sampler).exp() * REWARD[s] for s in SEQS)
    exact = torch.autograd.grad(j, trainer)[0]
    # E_q[rho_K * grad log p_K * R] by enumeration over the sampler's support
    est = torch.zeros_like(trainer)
    for s in SEQS:
        if not torch.isfinite(logq[s]):
            continue
        lp = _seq_logprob(trainer, s, truncated=True, kept_from=sampler)
        g = torch.autograd.grad(lp, trainer)[0]
        est += logq[s].exp() * (lp.detach() - logq[s]).exp() * REWARD[s] * g
    assert torch.allclose(est, exact, atol=1e-10)
    # the full-softmax ratio and score estimate the gradient of another objective: off by more than rounding
    full = torch.zeros_like(trainer)
    for s in SEQS:
        if not torch.isfinite(logq[s]):
            continue
        lp = _seq_logprob(trainer, s, truncated=False)
        g = torch.autograd.grad(lp, trainer)[0]
        full += logq[s].exp() * (lp.detach() - logq[s]).exp() * REWARD[s] * g
    assert (full - exact).abs().max() > 1e-3


def test_sequence_kl_splits_into_the_truncated_gap_and_the_truncation_term():
    """KL_seq(q||p) = KL_seq(q||p_K) + E_q[-sum_t log S_t], S_t = p(K_t | prefix); and the gain identity
    J(p_K) - J(q) = Cov_q(R, log rho) + E_q[(rho - 1 - log rho)(R - rbar)] holds exactly with rho = p_K/q, with
    the remainder bounded by max|R - rbar| * KL_seq(q||p_K)."""
    sampler = _policy(4)
    trainer = _policy(5, 1.0)
    with torch.no_grad():
        trainer.copy_(sampler + 0.3 * torch.randn(sampler.shape, generator=torch.Generator().manual_seed(6), dtype=F64))
    kl_full = kl_trunc = term = 0.0
    logq, logpk = {}, {}
    for s in SEQS:
        lq = float(_seq_logprob(sampler, s, truncated=True).detach())
        if lq == -math.inf:
            continue
        q = math.exp(lq)
        lp = float(_seq_logprob(trainer, s, truncated=False).detach())
        lpk = float(_seq_logprob(trainer, s, truncated=True, kept_from=sampler).detach())
        log_s = sum(float(kept_log_mass(_logits(trainer, s[:t])[None].detach(), 1.0, _kept(sampler, s[:t])))
                    for t in range(T))
        kl_full += q * (lq - lp)
        kl_trunc += q * (lq - lpk)
        term += q * (-log_s)
        logq[s], logpk[s] = lq, lpk
    assert kl_full == pytest.approx(kl_trunc + term, abs=1e-12) and term > 0
    qs = {s: math.exp(v) for s, v in logq.items()}
    rbar = sum(qs[s] * REWARD[s] for s in qs)
    rho = {s: math.exp(logpk[s] - logq[s]) for s in qs}
    gain = sum(math.exp(logpk[s]) * REWARD[s] for s in qs) - rbar
    tangent = sum(qs[s] * (REWARD[s] - rbar) * math.log(rho[s]) for s in qs)
    remainder = sum(qs[s] * (rho[s] - 1 - math.log(rho[s])) * (REWARD[s] - rbar) for s in qs)
    assert gain == pytest.approx(tangent + remainder, abs=1e-12)
    assert abs(remainder) <= max(abs(REWARD[s] - rbar) for s in qs) * kl_trunc + 1e-15
    assert sum(math.exp(logpk[s]) for s in qs) == pytest.approx(1.0, abs=1e-12)   # p_K lives on q's support
