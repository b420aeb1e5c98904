"""`covrl repro async-gap --fast`: the toy's exact gap keeps fixed with the optimizer's lr rule and a queue sized
in rollouts, grows otherwise; the tiny transformer's gap at staleness 0 equals the probed bf16 engine floor and
grows with the queue."""

from __future__ import annotations

import json

import torch

from covrl.repro import async_gap
from covrl.repro.common import write_result


def test_async_gap_fast(tmp_path):
    torch.set_num_threads(1)
    result = async_gap.run(tmp_path, fast=True, seed=0)
    failed = [(c.name, c.measured) for c in result.criteria if not c.passed]
    assert not failed, failed
    names = " ".join(c.name for c in result.criteria)
    for rule in async_gap.TOY_RULES:
        assert rule in names
    assert (tmp_path / result.figures[0]).stat().st_size > 10_000
    write_result(result, tmp_path)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["passed"] and saved["numbers"]["toy"]["ratio_to_base"]["adam_sqrt"][0] == 1.0


def test_toy_gap_is_zero_without_lag_and_grows_with_it():
    """Lag 0: the sampler is the trainer, the exact gap is 0; doubling the lag (Q) increases it."""
    s = async_gap.ToySettings(base_batch=8, batches=(8,), queue=0, fixed_lag_steps=0, rollouts=512, seeds=4)
    assert async_gap.toy_gap("adam", "sqrt", 8, s)["gap"] == 0.0
    gaps = [async_gap.toy_gap("adam", "sqrt", 8, async_gap.ToySettings(
        base_batch=8, batches=(8,), queue=q, fixed_lag_steps=0, rollouts=1024, seeds=4))["gap"] for q in (64, 256)]
    assert 0 < gaps[0] < gaps[1]
