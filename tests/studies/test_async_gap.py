"""`python -m studies async-gap --fast`: the toy's exact gap keeps fixed with the optimizer's lr rule and a queue sized
in rollouts, grows otherwise; so does the tiny transformer's (4x B, burned-in weights, several seeds); the
emulated queue gives every rollout the lag Q/B; the gap at staleness 0 equals the probed bf16 engine floor and
grows with the queue."""

from __future__ import annotations

import json
import random
import statistics

import pytest
import torch
from studies.async_gap import async_gap
from studies.common import write_result

from studies import stats


@pytest.mark.slow
def test_async_gap_fast(tmp_path):
    torch.set_num_threads(1)
    result = async_gap.run(tmp_path, fast=True, seed=0)
    failed = [(c.name, c.measured) for c in result.criteria if not c.passed]
    assert not failed, failed
    names = " ".join(c.name for c in result.criteria)
    for rule in async_gap.TOY_RULES:
        assert rule in names
    assert "tiny transformer: adam_sqrt keeps the gap" in names
    assert (tmp_path / result.figures[0]).stat().st_size > 10_000
    write_result(result, tmp_path)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["passed"] and saved["numbers"]["toy"]["ratio_to_base"]["adam_sqrt"][0] == 1.0
    tiny = saved["numbers"]["tiny"]["gap"]["adam_sqrt"]
    t = async_gap.TINY_FAST
    assert len(tiny["8"]["gap_per_seed"]) == t.seeds
    assert tiny["8"]["lag_in_window"] == [t.queue // 8] * 2 and tiny["32"]["lag_in_window"] == [t.queue // 32] * 2
    # the window starts after the queue has filled and the largest batch has taken transient_steps steps
    assert tiny["8"]["window_rollouts"] == [t.queue + t.transient_steps * 32, t.rollouts]


def test_toy_gap_is_zero_without_lag_and_grows_with_it():
    """Lag 0: the sampler is the trainer, the exact gap is 0; doubling the lag (Q) increases it."""
    s = async_gap.ToySettings(base_batch=8, batches=(8,), queue=0, fixed_lag_steps=0, rollouts=512, seeds=4)
    assert async_gap.toy_gap("adam", "sqrt", 8, s)["gap"] == 0.0
    gaps = [async_gap.toy_gap("adam", "sqrt", 8, async_gap.ToySettings(
        base_batch=8, batches=(8,), queue=q, fixed_lag_steps=0, rollouts=1024, seeds=4))["gap"] for q in (64, 256)]
    assert 0 < gaps[0] < gaps[1]


def test_momentum_drift_factor_matches_simulation():
    """r(L) = Var(sum of L consecutive EMA values of white noise) / L, checked by brute force; r = 1 without
    momentum, r < 1 inside the momentum time and → 1 far beyond it."""
    assert async_gap.momentum_drift_factor(0.0, 1) == 1.0 == async_gap.momentum_drift_factor(0.0, 7)
    gen = torch.Generator().manual_seed(0)
    beta, lag, chains, burn = 0.9, 12, 20000, 200
    g = torch.randn(chains, burn + lag, generator=gen, dtype=torch.float64)
    m = torch.zeros(chains, dtype=torch.float64)
    total = torch.zeros(chains, dtype=torch.float64)
    for k in range(burn + lag):
        m = beta * m + (1 - beta) * g[:, k]
        if k >= burn:
            total += m
    simulated = float(total.var()) / lag
    exact = async_gap.momentum_drift_factor(beta, lag)
    assert abs(simulated / exact - 1) < 0.04, (simulated, exact)       # ~1% standard error at 20k chains
    assert exact < 0.5 < async_gap.momentum_drift_factor(beta, 100) < 0.92 < async_gap.momentum_drift_factor(beta, 1000)


def test_paired_ratio_ci_is_exact_for_proportional_seeds():
    """If every seed's gap at B is exactly c times its gap at B0 the bootstrap ratio is c in every draw; an
    unpaired noise makes the interval wide and cover the true ratio."""
    base = [1.0, 2.0, 5.0, 0.5]
    ci = stats.paired_ratio_ci({8: base, 32: [3 * x for x in base], 128: list(base)}, 8)
    assert ci[32] == (3.0, 3.0) or all(abs(x - 3.0) < 1e-12 for x in ci[32])
    assert all(abs(x - 1.0) < 1e-12 for x in ci[128])
    rng = random.Random(1)
    noisy = {8: [rng.expovariate(1.0) for _ in range(40)], 32: [rng.expovariate(1.0) for _ in range(40)]}
    lo, hi = stats.paired_ratio_ci(noisy, 8)[32]
    ratio = statistics.fmean(noisy[32]) / statistics.fmean(noisy[8])
    assert lo < ratio < hi and lo < 1.0 < hi


def test_emulated_queue_lags_every_rollout_by_q_over_b(tmp_path):
    """The serial emulation fills the queue (Q + B rollouts at θ_0) before the first step, so step k trains on
    rollouts of version min(k, Q/B): staleness ramps 0, 1, …, Q/B and stays there. At lag 0 the fp32 sampler is
    the trainer and kl_seq is 0 up to rounding; with a lag it is positive once an update has happened (this
    barely trained model often draws groups with equal rewards, which give no gradient)."""
    torch.set_num_threads(1)
    t = async_gap.TinySettings(base_prompts=1, group_size=4, scales=(1,), queue=8, fixed_lag_steps=2, rollouts=32,
                               base_lr=1e-3, floor_queues_steps=(0,), floor_rollouts=0, floor_lr=1e-3,
                               floor_prompts=1, hidden=16, layers=1, sft_steps=3)
    base = async_gap.tiny_base(tmp_path, t, 0)
    records, _, _ = async_gap.tiny_run(base, "lag", prompts=1, queue=8, lr=1e-3, rollouts=32, beta1=0.0)
    assert [r["async/staleness_mean"] for r in records] == [0, 1, 2, 2, 2, 2, 2, 2]
    assert [r["async/staleness_max"] for r in records] == [0, 1, 2, 2, 2, 2, 2, 2]
    assert abs(records[0]["kl_seq"]) < 1e-6 and max(r["kl_seq"] for r in records) > 1e-5
    on_policy, _, _ = async_gap.tiny_run(base, "lag0", prompts=1, queue=0, lr=1e-3, rollouts=32, beta1=0.0)
    assert any(r["reward/std"] > 0 for r in on_policy)          # updates happened
    assert all(r["async/staleness_max"] == 0 and abs(r["kl_seq"]) < 1e-6 for r in on_policy)
