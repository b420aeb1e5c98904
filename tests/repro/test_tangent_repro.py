"""`covrl repro tangent --fast`: every criterion of the reproduction must hold (RESEARCH.md §5)."""

from __future__ import annotations

import json

import torch

from covrl.repro.common import write_result

torch.set_num_threads(1)


def test_fast_tangent_reproduction_meets_its_criteria(tmp_path):
    from covrl.repro import tangent

    result = tangent.run(tmp_path, fast=True, seed=0)
    failed = [(c.name, c.measured) for c in result.criteria if not c.passed]
    assert not failed, failed
    assert len(result.criteria) >= 7
    assert (tmp_path / result.figures[0]).stat().st_size > 10_000
    numbers = result.numbers
    assert numbers["per_V_T"]["V3_T8"]["pairs"] >= 100
    assert numbers["classical_bound_violations"] == 0  # the classical bounds themselves hold
    assert max(numbers["monotone"]["penalised_surrogate_end"]) > 0
    write_result(result, tmp_path)
    payload = json.loads((tmp_path / "result.json").read_text())
    assert payload["passed"] is True


def test_mm_rounds_with_zero_step_keeps_the_policy():
    from covrl.repro.tangent import _positionwise_problem, mm_rounds

    theta0, token_logprobs, rewards = _positionwise_problem(horizon=4, target=2)
    out = mm_rounds(theta0, token_logprobs, rewards, penalty=True, rounds=2, inner_steps=2, lr=0.0)
    assert out["J"] == [out["J"][0]] * 3
    assert out["penalised_surrogate_end"] == [0.0, 0.0]
