"""update_sparsity against hand-computed bf16 casts and brute-force counts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from covrl.diagnostics import update_sparsity


def test_hand_computed_absorption():
    # bf16 keeps 8 significant bits: near 1.0 the spacing is 2^-7, near 1e-3 it is 2^-17 ≈ 7.6e-6
    theta0 = {"w": torch.tensor([1.0, 1.0, 1e-3, 0.5], dtype=torch.float32)}
    theta1 = {"w": theta0["w"] + torch.tensor([1e-6, 1e-3, 2e-5, 0.0])}
    rep = update_sparsity(theta0, theta1, atol=1e-5, dtype=torch.bfloat16)
    m = rep.tensors["w"]
    # |Δ| ≤ 1e-5 in fp32: coordinates 0 and 3; after bf16: 0, 1 (1.001 rounds to 1.0) and 3; 2 survives
    assert m["sparsity_full"] == pytest.approx(2 / 4)
    assert m["sparsity"] == pytest.approx(3 / 4)
    assert m["absorbed"] == pytest.approx(1 / 4)
    assert m["absorbed_share"] == pytest.approx(1 / 3)
    assert m["unchanged_exact"] == pytest.approx(1 / 4)
    assert m["sparsity_relative"] == pytest.approx(2 / 4)  # |Δ| ≤ 1e-3·max|Δ| = 1e-6: coords 0 and 3
    assert rep.metrics["precision_separable"] == 1.0


def test_rounding_flip_is_counted_as_amplified():
    # a value just below a bf16 rounding boundary: a 1e-7 change flips the rounding (one ulp = 2^-7 at 1.0)
    x = torch.tensor([1.0 + 2 ** -8 - 1e-7], dtype=torch.float64)
    rep = update_sparsity({"w": x}, {"w": x + 2e-7}, atol=1e-5)
    m = rep.tensors["w"]
    assert m["sparsity_full"] == 1.0 and m["sparsity"] == 0.0 and m["amplified"] == 1.0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([torch.bfloat16, torch.float16]))
def test_identity_and_brute_force_counts(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(7, 5, generator=gen)
    step = torch.randn(7, 5, generator=gen) * 10 ** torch.empty(7, 5).uniform_(-8, -2, generator=gen)
    b = a + step
    rep = update_sparsity({"w": a}, {"w": b}, atol=1e-5, dtype=dtype)
    m = rep.tensors["w"]
    assert m["sparsity"] == pytest.approx(m["sparsity_full"] + m["absorbed"] - m["amplified"], abs=1e-12)
    flat_a, flat_b = a.flatten().tolist(), b.flatten().tolist()
    cast = [abs(float(torch.tensor(y).to(dtype)) - float(torch.tensor(x).to(dtype))) <= 1e-5
            for x, y in zip(flat_a, flat_b)]
    full = [abs(y - x) <= 1e-5 for x, y in zip(a.double().flatten().tolist(), b.double().flatten().tolist())]
    assert m["sparsity"] == pytest.approx(sum(cast) / len(cast))
    assert m["sparsity_full"] == pytest.approx(sum(full) / len(full))


def test_rank_ratio_and_modules():
    gen = torch.Generator().manual_seed(0)
    lin0 = torch.nn.Linear(6, 8)
    lin1 = torch.nn.Linear(6, 8)
    lin1.load_state_dict(lin0.state_dict())
    with torch.no_grad():
        lin1.weight += torch.randn(8, 2, generator=gen) @ torch.randn(2, 6, generator=gen)
    rep = update_sparsity(lin0, lin1)
    assert rep.tensors["weight"]["numerical_rank"] == 2
    assert rep.tensors["weight"]["rank_ratio"] == pytest.approx(2 / 6)
    assert rep.tensors["bias"]["sparsity_full"] == 1.0
    assert rep.metrics["numel"] == 8 * 6 + 8


def test_stored_in_bf16_is_not_separable_and_errors():
    a = {"w": torch.zeros(3, dtype=torch.bfloat16)}
    assert update_sparsity(a, {"w": torch.ones(3, dtype=torch.bfloat16)}).metrics["precision_separable"] == 0.0
    with pytest.raises(ValueError, match="shape"):
        update_sparsity({"w": torch.zeros(3)}, {"w": torch.zeros(4)})
    with pytest.raises(ValueError, match="lacks"):
        update_sparsity({"w": torch.zeros(3)}, {"v": torch.zeros(3)})
    with pytest.raises(ValueError, match="atol"):
        update_sparsity({"w": torch.zeros(3)}, {"w": torch.zeros(3)}, atol=-1.0)
