"""Tangent + remainder (docs/theory.md §5): batch estimators vs hand computation and exact enumeration."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from covrl.diagnostics import tangent_remainder
from covrl.diagnostics.tangent import (
    all_sequences,
    exact_from_tables,
    exact_tangent_remainder,
    perturb_tables,
    random_tables,
    tables_from_next_token_fn,
    token_logprobs_from_tables,
    trust_region_bounds,
)

torch.set_num_threads(1)


def _k3(x: float) -> float:
    return math.exp(x) - 1.0 - x


def _pair(vocab, horizon, eps, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = random_tables(vocab, horizon, scale=scale, generator=g)
    p = perturb_tables(q, eps, generator=g)
    rewards = torch.rand(vocab**horizon, generator=g, dtype=torch.float64)
    return p, q, rewards


def _enumerated_batch(p, q):
    seqs = all_sequences(q[0].shape[-1], len(q))
    lp, lq = token_logprobs_from_tables(p, seqs), token_logprobs_from_tables(q, seqs)
    return lp, lq, torch.ones_like(lp), lq.sum(1).exp()


# ---------------------------------------------------------------- batch estimators, by hand


def test_hand_computed_batch():
    sampler = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
    trainer = sampler + torch.tensor([[0.1, 0.2], [-0.1, 5.0]])  # row 1 token 1 is padding
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = tangent_remainder(trainer, sampler, torch.tensor([1.0, 0.0]), mask)
    m = out.metrics
    # r̄ = 0.5, centred = [0.5, -0.5], log ρ = [0.3, -0.1]
    assert m["tangent"] == pytest.approx((0.5 * 0.3 + 0.5 * 0.1) / 2, abs=1e-7)
    assert m["remainder"] == pytest.approx((_k3(0.3) * 0.5 - _k3(-0.1) * 0.5) / 2, abs=1e-7)
    assert m["kl_seq"] == pytest.approx((_k3(0.1) + _k3(0.2) + _k3(-0.1)) / 2, abs=1e-7)
    assert m["kl_seq_ratio"] == pytest.approx((_k3(0.3) + _k3(-0.1)) / 2, abs=1e-7)
    assert m["r_max"] == pytest.approx(0.5)
    assert m["bound"] == pytest.approx(0.5 * m["kl_seq"])
    assert m["gain"] == pytest.approx(((math.exp(0.3) - 1) * 0.5 - (math.exp(-0.1) - 1) * 0.5) / 2, abs=1e-7)
    assert out.seq_log_ratio.tolist() == pytest.approx([0.3, -0.1], abs=1e-6)
    assert m["log_ratio_abs_max"] == pytest.approx(0.2, abs=1e-6)  # padding ignored


def test_group_baseline_and_explicit_r_max():
    lq = torch.full((4, 3), -1.0)
    lp = lq + 0.1
    out = tangent_remainder(lp, lq, torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.ones(4, 3),
                            r_max=2.0, group_ids=torch.tensor([7, 7, 2, 2]))
    assert out.centred_rewards.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    # every row has the same log ρ = 0.3, so the tangent is 0.3·mean(centred) = 0
    assert out.metrics["tangent"] == pytest.approx(0.0, abs=1e-7)
    assert out.metrics["r_max"] == 2.0
    assert out.metrics["bound"] == pytest.approx(2.0 * 3 * _k3(0.1), rel=1e-6)


def test_per_token_rewards_are_summed_over_the_mask():
    lq = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    lp = lq + 0.05 * torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    token_rewards = torch.rand(3, 4, generator=torch.Generator().manual_seed(3))
    a = tangent_remainder(lp, lq, token_rewards, mask).metrics
    b = tangent_remainder(lp, lq, (token_rewards * mask).sum(1), mask).metrics
    assert a == pytest.approx(b)


def test_clamping_keeps_values_finite_and_reports_it():
    lq = torch.tensor([[-1.0, -1.0]])
    lp = torch.tensor([[-1.0 + 50.0, -1.0]])
    out = tangent_remainder(torch.cat([lp, lq]), torch.cat([lq, lq]), torch.tensor([1.0, 0.0]), torch.ones(2, 2))
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert out.metrics["clamped_fraction"] > 0
    assert out.seq_log_ratio[0].item() == pytest.approx(20.0)


def test_padding_may_hold_minus_inf():
    lq = torch.tensor([[-1.0, float("-inf")]])
    lp = torch.tensor([[-0.9, float("-inf")]])
    out = tangent_remainder(lp, lq, torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]))
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_no_grad_and_detached():
    lp = torch.randn(4, 3, requires_grad=True)
    out = tangent_remainder(lp, lp.detach() + 0.1, torch.rand(4), torch.ones(4, 3))
    assert not out.seq_log_ratio.requires_grad


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"trainer_logprobs": torch.zeros(2, 3)}, "trainer_logprobs has shape"),
        ({"rewards": torch.zeros(3)}, "rewards must have shape"),
        ({"rewards": torch.tensor([0.0, float("nan")])}, "rewards must be finite"),
        ({"mask": torch.full((2, 4), 0.5)}, "mask must contain only 0 and 1"),
        ({"group_ids": torch.zeros(3, dtype=torch.long)}, "group_ids must be"),
        ({"group_ids": torch.zeros(2)}, "integer tensor"),
        ({"weights": -torch.ones(2)}, "weights must be finite"),
        ({"r_max": -1.0}, "r_max"),
        ({"sampler_logprobs": torch.tensor([[0.0, float("nan"), 0, 0], [0, 0, 0, 0]])}, "row 0, token 1"),
    ],
)
def test_bad_input_names_the_field(kwargs, match):
    args = {"trainer_logprobs": torch.zeros(2, 4), "sampler_logprobs": torch.zeros(2, 4),
            "rewards": torch.zeros(2), "mask": torch.ones(2, 4)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        tangent_remainder(**args)


# ---------------------------------------------------------------- exact enumeration


@pytest.mark.parametrize("vocab, horizon", [(3, 4), (4, 3), (2, 6)])
def test_batch_estimators_equal_exact_values_on_the_weighted_enumeration(vocab, horizon):
    p, q, rewards = _pair(vocab, horizon, 0.4, seed=vocab * 10 + horizon)
    exact = exact_from_tables(p, q, rewards).metrics
    lp, lq, mask, weights = _enumerated_batch(p, q)
    batch = tangent_remainder(lp, lq, rewards, mask, weights=weights).metrics
    for key in ("tangent", "remainder", "gain", "kl_seq", "r_max", "bound"):
        assert batch[key] == pytest.approx(exact[key], rel=1e-5, abs=1e-9), key
    # both KL estimators are exact in expectation: Σ_t E_q[ρ_t − 1] = 0 when supp p ⊆ supp q
    assert batch["kl_seq_ratio"] == pytest.approx(exact["kl_seq"], rel=1e-5)
    # J(p) − J(q) directly from Σ p R − Σ q R
    j_p = float((lp.double().sum(1).exp() * rewards).sum())
    j_q = float((weights.double() * rewards).sum())
    assert batch["gain"] == pytest.approx(j_p - j_q, rel=1e-5, abs=1e-9)


@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(2, 4), horizon=st.integers(1, 5), log_eps=st.floats(-4.0, 0.7),
       scale=st.floats(0.1, 3.0), seed=st.integers(0, 10_000))
def test_gain_identity_to_machine_precision_and_remainder_bound(vocab, horizon, log_eps, scale, seed):
    p, q, rewards = _pair(vocab, horizon, 10**log_eps, seed, scale=scale)
    ex = exact_from_tables(p, q, rewards)
    m = ex.metrics
    assert abs(m["identity_error"]) <= 1e-13 * max(1.0, abs(m["j_trainer"]))
    assert abs(m["remainder"]) <= m["r_max"] * m["kl_seq"] * (1 + 1e-9) + 1e-15
    # classical bounds hold on the classical surrogate, and the performance-difference lemma is exact
    tr = trust_region_bounds(p, q, rewards).metrics
    assert tr["gain_pdl"] == pytest.approx(m["gain"], abs=1e-12)
    assert tr["kl_seq_from_tables"] == pytest.approx(m["kl_seq"], rel=1e-9, abs=1e-15)
    err = abs(tr["surrogate_error"])
    assert err <= tr["bound_trpo_tv"] * (1 + 1e-9) + 1e-15
    assert err <= tr["bound_trpo_kl"] * (1 + 1e-9) + 1e-15
    assert err <= tr["bound_cpo_tv"] * (1 + 1e-9) + 1e-15


def test_remainder_is_second_order():
    g = torch.Generator().manual_seed(5)
    q = random_tables(3, 5, generator=g)
    direction = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in q]
    rewards = torch.rand(3**5, generator=g, dtype=torch.float64)
    eps = [1e-2 * 2.0**-k for k in range(4)]
    rem = [exact_from_tables(perturb_tables(q, e, direction=direction), q, rewards).metrics for e in eps]
    for a, b in zip(rem, rem[1:]):
        assert a["remainder"] / b["remainder"] == pytest.approx(4.0, rel=0.05)  # ε → ε/2: remainder / 4
        assert a["kl_seq"] / b["kl_seq"] == pytest.approx(4.0, rel=0.05)
        assert a["tangent"] / b["tangent"] == pytest.approx(2.0, rel=0.05)  # first order


def test_equal_policies_give_zero_everywhere():
    g = torch.Generator().manual_seed(3)
    q = random_tables(3, 4, generator=g)
    rewards = torch.rand(81, generator=g, dtype=torch.float64)
    m = exact_from_tables(q, q, rewards).metrics
    for key in ("gain", "tangent", "remainder", "kl_seq", "bound"):
        assert m[key] == 0.0, key
    tr = trust_region_bounds(q, q, rewards).metrics
    for key in ("surrogate", "surrogate_error", "bound_trpo_tv", "bound_trpo_kl", "bound_cpo_tv"):
        assert abs(tr[key]) < 1e-15, key
    lq = token_logprobs_from_tables(q)
    batch = tangent_remainder(lq, lq, rewards, torch.ones_like(lq)).metrics
    for key in ("gain", "tangent", "remainder", "kl_seq", "bound", "bound_ratio"):
        assert batch[key] == 0.0, key


def test_sampled_batch_estimates_approach_exact_values():
    p, q, rewards = _pair(3, 4, 0.5, seed=11)
    exact = exact_from_tables(p, q, rewards).metrics
    lp, lq, mask, weights = _enumerated_batch(p, q)
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(weights, 40_000, replacement=True, generator=g)
    out = tangent_remainder(lp[idx], lq[idx], rewards[idx], mask[idx])
    n = idx.numel()
    se_t = float((out.centred_rewards.double() * out.seq_log_ratio.double()).std()) / math.sqrt(n)
    se_kl = float(out.seq_kl.double().std()) / math.sqrt(n)
    assert abs(out.metrics["tangent"] - exact["tangent"]) < 5 * se_t + 1e-4
    assert abs(out.metrics["kl_seq"] - exact["kl_seq"]) < 5 * se_kl


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 12), t=st.integers(1, 6), spread=st.floats(0.0, 3.0), seed=st.integers(0, 10_000))
def test_bound_ratio_bounds_the_batch_remainder_on_every_batch(b, t, spread, seed):
    g = torch.Generator().manual_seed(seed)
    lq = -torch.rand(b, t, generator=g) * 3
    lp = lq + spread * torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.8).float()
    out = tangent_remainder(lp, lq, torch.randn(b, generator=g), mask).metrics
    assert abs(out["remainder"]) <= out["bound_ratio"] * (1 + 1e-9) + 1e-12
    assert out["gain"] == pytest.approx(out["tangent"] + out["remainder"], abs=1e-9)


def test_tables_from_a_tiny_parametric_model():
    torch.manual_seed(0)
    vocab, horizon = 3, 4
    emb = torch.nn.Embedding(vocab + 1, 8)
    head = torch.nn.Linear(8, vocab)

    def next_token_logits(prefixes):  # mean of token embeddings (plus a start token) -> logits
        start = torch.full((prefixes.shape[0], 1), vocab, dtype=torch.long)
        return head(emb(torch.cat([start, prefixes], 1)).mean(1)).double()

    tables = tables_from_next_token_fn(next_token_logits, vocab, horizon)
    seqs = all_sequences(vocab, horizon)
    lp = token_logprobs_from_tables(tables, seqs)
    assert float(lp.detach().sum(1).exp().sum()) == pytest.approx(1.0, abs=1e-12)
    direct = torch.stack([torch.log_softmax(next_token_logits(seqs[:, :t]), -1)[torch.arange(len(seqs)), seqs[:, t]]
                          for t in range(horizon)], 1)
    assert torch.allclose(lp, direct, atol=1e-12)
    # differentiable: the exact tangent's gradient is the exact policy gradient at p = q
    rewards = (seqs == 0).double().sum(1)
    q_logp = lp.detach()
    ex = exact_tangent_remainder(lp, q_logp, rewards)
    (g_tangent,) = torch.autograd.grad(ex.tangent, head.bias, retain_graph=True)
    (g_j,) = torch.autograd.grad(ex.j_trainer, head.bias)
    assert torch.allclose(g_tangent, g_j, atol=1e-10)


def test_exact_rejects_an_incomplete_enumeration():
    p, q, rewards = _pair(3, 3, 0.1, seed=0)
    lp, lq, _, _ = _enumerated_batch(p, q)
    with pytest.raises(ValueError, match="enumerate every sequence"):
        exact_tangent_remainder(lp[:-1], lq[:-1], rewards[:-1])
    with pytest.raises(ValueError, match=r"tables\[1\] must have shape"):
        token_logprobs_from_tables([torch.zeros(1, 3), torch.zeros(2, 3)])
