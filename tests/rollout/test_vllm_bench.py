"""`covrl bench rollout`'s vLLM side on the tiny model (vLLM suite; skipped where vllm is not importable).

Here and not in tests/bench/ because it starts an in-process engine, after which `torch.set_num_threads` is a
no-op for the whole process: it sorts after tests/rollout/test_vllm.py, whose first test checks thread counts."""

from __future__ import annotations

import argparse
import json

import pytest

from covrl.rollout.vllm import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (the vllm extra)")


def test_rollout_bench_times_the_vllm_side_on_the_same_rows(tmp_path):
    from covrl.bench import rollout_bench

    parser = argparse.ArgumentParser()
    rollout_bench.configure(parser)
    args = parser.parse_args(["--quick", "--batch-sizes", "8", "--vllm-engine", "in-process", "--out",
                              str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")])
    assert rollout_bench.run(args) == 0
    path = next((tmp_path / "out").glob("rollout-tiny-quick/*.json"))
    res = json.loads(path.read_text())["results"]
    assert res["vllm"]["skipped"] is None and res["vllm"]["engine"] == "in-process"
    (row,) = res["rows"]
    assert row["batch"] == 8 and row["rows_per_prompt"] == 8
    for r in row["runs"]["vllm"]:   # 8 rows of at most 8 new tokens, each at least one token (EOS included)
        assert 8 <= r["tokens"] <= 8 * 8 and 1 <= r["decode_steps"] <= 8
    assert row["vllm_tok_s"] > 0
    assert row["vllm_over_generate"] == pytest.approx(row["vllm_tok_s"] / row["generate_tok_s"])
    assert "vllm tok/s" in path.with_suffix(".md").read_text()
