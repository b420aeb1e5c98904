"""`python -m studies async-momentum --fast` (design B of studies/async_gap/README.md §4): the machinery of the β1 = 0.9
study — both arms run at their rule's lr, every rollout in the window lags exactly Q/B steps, the toy and tiny
ratios are finite and the figure is written. The fast variant's ratios are not a verdict (2 seeds, short runs)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from studies.async_gap import async_momentum
from studies.common import write_result


@pytest.mark.slow
def test_async_momentum_fast_machinery(tmp_path):
    torch.set_num_threads(1)
    result = async_momentum.run(tmp_path, fast=True, seed=0)
    by_name = {c.name: c for c in result.criteria}
    assert by_name["tiny transformer: each arm ran at its rule's lr"].passed
    assert by_name["tiny transformer: every rollout in the window lags exactly ⌈Q/B⌉ steps"].passed
    for arm in async_momentum.ARMS:
        assert any(arm in n and "keeps the gap" in n for n in by_name)
    write_result(result, tmp_path)
    saved = json.loads((tmp_path / "result.json").read_text())
    tiny = saved["numbers"]["tiny"]
    for arm in async_momentum.ARMS:
        ratios = tiny["ratio_to_base"][arm]
        assert ratios[0] == 1.0 and all(math.isfinite(r) and r > 0 for r in ratios)
        assert len(tiny["gap"][arm]["8"]["gap_per_seed"]) == async_momentum.TINY_MOMENTUM_FAST.seeds
    # the corrected arm runs a larger lr at 4x B (r(Q/B) < r(Q/B0) inside the momentum time)
    assert tiny["gap"]["adam_sqrt_momentum"]["32"]["lr"] > tiny["gap"]["adam_sqrt"]["32"]["lr"]
    assert tiny["predicted_ratio"]["adam_sqrt_momentum"] == [1.0, 1.0]
    assert (tmp_path / result.figures[0]).stat().st_size > 10_000
