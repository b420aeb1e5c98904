"""`python -m studies time-to-accuracy --quick`: both sides train two short steps on the tiny model, each
evaluated on the same held-out prompts. Timings are never asserted."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("trl")

from studies.time_to_accuracy import time_to_accuracy  # noqa: E402


@pytest.mark.slow
def test_time_to_accuracy_quick_evaluates_both_sides(tmp_path):
    parser = argparse.ArgumentParser()
    time_to_accuracy.configure(parser)
    args = parser.parse_args(["--quick", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")])
    assert time_to_accuracy.run(args) == 0
    (path,) = tmp_path.glob("time-to-accuracy-quick/*.json")
    res = json.loads(path.read_text())["results"]
    for side in ("covrl", "trl"):
        info = res["sides"][side]
        assert info["steps"] == 2
        assert len(info["evals"]) == 2 and all(0.0 <= e["accuracy"] <= 1.0 for e in info["evals"])
        assert info["accuracy_before"] is not None
