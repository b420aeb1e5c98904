"""Same seed, same thread count: bit-identical metrics whatever else the machine is doing. The load
is two busy processes started beside the second run; only wall-time metrics may differ."""

from __future__ import annotations

import multiprocessing
import time

from train_helpers import comparable, tiny_cfg

from covrl.train.run.driver import train_sync
from covrl.train.run.folder import prepare_run
from covrl.train.run.sinks import read_jsonl


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def _run(tmp_path, name: str):
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": name, "run.num_threads": 1, "loop.steps": 4}),
                      console=False)
    try:
        summary = train_sync(run)
    finally:
        run.close()
    return comparable(read_jsonl(run.run_dir / "metrics.jsonl")), summary


def test_same_seed_same_threads_is_bit_identical_under_load(tmp_path):
    quiet, quiet_summary = _run(tmp_path, "quiet")
    ctx = multiprocessing.get_context("spawn")
    burners = [ctx.Process(target=_burn, args=(60.0,), daemon=True) for _ in range(2)]
    for p in burners:
        p.start()
    try:
        loaded, loaded_summary = _run(tmp_path, "loaded")
    finally:
        for p in burners:
            p.terminate()
            p.join(timeout=10)
    assert len(quiet) == len(loaded) == 4
    for step, (a, b) in enumerate(zip(quiet, loaded), start=1):
        assert a == b, f"step {step}: " + ", ".join(f"{k}: {a.get(k)} vs {b.get(k)}" for k in sorted(set(a) | set(b))
                                                     if a.get(k) != b.get(k))
    assert quiet_summary["eval_after"]["greedy"] == loaded_summary["eval_after"]["greedy"]
    assert quiet_summary["torch_threads"] == loaded_summary["torch_threads"] == 1
