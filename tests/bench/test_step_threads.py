"""`covrl bench step --threads 1,2,auto --load N`: the option's parsing and the artificial load's lifetime
(timings are never asserted)."""

from __future__ import annotations

import pytest

from covrl.bench.step_bench import BusyLoad, parse_threads


def test_threads_option_takes_counts_and_auto():
    assert parse_threads("1,2,auto") == [1, 2, "auto"]
    assert parse_threads(" 4 ") == [4]
    for bad in ("0", "fast", "1,1", "1,", "-2"):
        with pytest.raises(SystemExit, match="--threads"):
            parse_threads(bad)


def test_busy_load_runs_only_inside_the_block():
    with BusyLoad(2, warmup_s=0) as load:
        assert len(load.procs) == 2 and all(p.poll() is None for p in load.procs)
    assert all(p.poll() is not None for p in load.procs)
