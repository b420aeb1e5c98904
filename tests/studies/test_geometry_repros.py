"""The geometry reproductions (seed ¶1–¶4): fast variants with every criterion asserted; full ones are slow."""

import json

import pytest
from studies.__main__ import run_one

NAMES = ["output-rank", "reach", "sparsity", "covariance"]


def _check(result, out_dir):
    failed = [(c.name, c.measured, c.target) for c in result.criteria if not c.passed]
    assert not failed, failed
    assert len(result.criteria) >= 4
    for fig in result.figures:
        assert (out_dir / fig).stat().st_size > 10_000
    payload = json.loads((out_dir / "result.json").read_text())
    assert payload["passed"] is True and payload["numbers"]


@pytest.mark.parametrize("name", NAMES)
def test_fast_variant_passes(name, tmp_path):
    result = run_one(name, tmp_path, fast=True, seed=0)
    _check(result, tmp_path / name)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_full_variant_passes(name, tmp_path):
    result = run_one(name, tmp_path, fast=False, seed=0)
    _check(result, tmp_path / name)
