"""update_spectrum against hand-computed singular values and random low-rank matrices."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from covrl.diagnostics import update_spectrum


def test_hand_computed_diagonal():
    delta = torch.diag(torch.tensor([3.0, 4.0, 0.0]))
    spec = update_spectrum(delta, 1)
    assert spec.singular_values.tolist() == pytest.approx([4.0, 3.0, 0.0])
    m = spec.metrics
    assert m["energy_top_k"] == pytest.approx(16 / 25)
    assert m["numerical_rank"] == 2
    assert m["rank_ratio"] == pytest.approx(2 / 3)
    assert m["stable_rank"] == pytest.approx(25 / 16)
    p = torch.tensor([4 / 7, 3 / 7])
    assert m["effective_rank"] == pytest.approx(math.exp(float(-(p * p.log()).sum())))
    assert update_spectrum(delta, 2).metrics["energy_top_k"] == pytest.approx(1.0)


def test_zero_update_and_vector():
    m = update_spectrum(torch.zeros(4, 3), 2).metrics
    assert m["energy_top_k"] == 1.0 and m["numerical_rank"] == 0 and m["stable_rank"] == 0.0
    v = update_spectrum(torch.tensor([3.0, 4.0]), 1)
    assert v.singular_values.tolist() == pytest.approx([5.0])


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 5), st.integers(6, 12), st.integers(6, 12), st.integers(0, 10_000))
def test_low_rank_products(rank, m, n, seed):
    gen = torch.Generator().manual_seed(seed)
    delta = torch.randn(m, rank, generator=gen, dtype=torch.float64) @ torch.randn(rank, n, generator=gen,
                                                                                    dtype=torch.float64)
    spec = update_spectrum(delta, rank)
    assert spec.metrics["numerical_rank"] == rank
    assert spec.metrics["energy_top_k"] == pytest.approx(1.0, abs=1e-12)
    assert spec.metrics["stable_rank"] <= rank + 1e-9
    energies = [update_spectrum(delta, k).metrics["energy_top_k"] for k in range(1, rank + 1)]
    assert all(b >= a - 1e-15 for a, b in zip(energies, energies[1:]))
    # squared singular values sum to the Frobenius norm
    assert float((spec.singular_values ** 2).sum()) == pytest.approx(float(delta.pow(2).sum()))


def test_rtol_follows_dtype():
    # an fp32 matrix with a 1e-9 relative component: below fp32's numerical-rank cut-off, above fp64's
    a = torch.zeros(6, 6, dtype=torch.float64)
    a[0, 0], a[1, 1] = 1.0, 1e-9
    assert update_spectrum(a, 1).metrics["numerical_rank"] == 2
    assert update_spectrum(a.float(), 1).metrics["numerical_rank"] == 1


@pytest.mark.parametrize("bad, k, msg", [(torch.zeros(2, 2, 2), 1, "matrix"), (torch.zeros(2, 2), 0, "k must"),
                                         (torch.zeros(2, 2, dtype=torch.long), 1, "floating")])
def test_errors(bad, k, msg):
    with pytest.raises(ValueError, match=msg):
        update_spectrum(bad, k)


def test_gram_path_matches_svd():
    # a 40×30 fp32 matrix has rtol = 40·eps32 ≈ 4.8e-6 ≥ 1e-6: the Gram path; compare with an explicit SVD
    gen = torch.Generator().manual_seed(3)
    delta = (torch.randn(40, 3, generator=gen) @ torch.randn(3, 30, generator=gen)
             + 1e-3 * torch.randn(40, 30, generator=gen))
    spec = update_spectrum(delta, 3)
    ref = torch.linalg.svdvals(delta.double())
    assert torch.allclose(spec.singular_values, ref, rtol=1e-7)  # Gram: δσ ≈ eps·σ_max²/σ
    e = ref ** 2
    assert spec.metrics["energy_top_k"] == pytest.approx(float(e[:3].sum() / e.sum()), rel=1e-12)
    assert spec.metrics["numerical_rank"] == 30
    assert update_spectrum(delta, 3, rtol=1e-2).metrics["numerical_rank"] == 3
