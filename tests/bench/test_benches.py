"""Smoke tests of `covrl bench`: each benchmark's --quick mode runs on the tiny model and writes its JSON and
table. Timings are never asserted; the TRL comparison's loss/gradient agreement is, in test_trl_parity.py (it is
math, not speed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("trl")

from covrl.bench import BENCHES  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-cache")


def run_bench(name: str, out: Path, cache: Path, *extra: str) -> dict:
    import importlib

    module = importlib.import_module(BENCHES[name])
    parser = argparse.ArgumentParser()
    module.configure(parser)
    args = parser.parse_args(["--quick", "--out", str(out), "--cache-dir", str(cache), *extra])
    assert module.run(args) == 0
    files = sorted(out.glob("*/*.json"))   # <benchmark>/<cpu>.json, the CPU model's baseline
    assert len(files) == 1, files
    payload = json.loads(files[0].read_text())
    assert payload["machine"]["cpu_count"] >= 1 and payload["headline"]
    assert files[0].with_suffix(".md").is_file(), "the table was not written"
    assert payload["headline"] in (out / "README.md").read_text(), "the summary does not list the baseline"
    return payload["results"]


# slow (~12-20 s): TRL's side also runs in tests/bench/test_trl_parity.py
@pytest.mark.slow
def test_trl_quick_runs_both_sides(tmp_path, cache_dir):
    res = run_bench("trl", tmp_path, cache_dir)
    for side in ("covrl", "trl"):
        s = res["summary"][side]
        assert s["steps"] == 2 and s["median_step_s"] > 0 and s["gen_tokens_per_step"] > 0
        assert s["peak_rss_mb"] > 0
    assert res["ratios"]["throughput_covrl_over_trl"] > 0
    assert res["ready"]["trl"]["prompt_roundtrip_ok"]  # TRL conditions on the very same prompt ids


@pytest.mark.slow
def test_trl_vllm_row_reports_why_a_side_did_not_run(tmp_path, cache_dir):
    """`--vllm` where vLLM is not installed (this venv): neither side can sample with it, and the bench writes
    its table with each side's reason instead of crashing (exit 1: no side ran). Where both vLLM and TRL are
    installed the TRL side fails on vLLM's CPU backend instead (docs/performance.md)."""
    import importlib

    from covrl.rollout.vllm import vllm_available

    if vllm_available():
        pytest.skip("vllm is installed: the --vllm row runs for real here (docs/performance.md)")
    module = importlib.import_module(BENCHES["trl"])
    parser = argparse.ArgumentParser()
    module.configure(parser)
    args = parser.parse_args(["--quick", "--vllm", "--out", str(tmp_path), "--cache-dir", str(cache_dir)])
    assert module.run(args) == 1
    res = json.loads(next(tmp_path.glob("trl-tiny-vllm-quick/*.json")).read_text())["results"]
    assert set(res["failed"]) == {"covrl", "trl"} and res["summary"] == {} and res["ratios"] == {}
    assert "needs vLLM" in res["failed"]["covrl"] and "vLLM is not available" in res["failed"]["trl"]
    table = next(tmp_path.glob("trl-tiny-vllm-quick/*.md")).read_text()
    assert "| covrl | failed: " in table and "| trl | failed: " in table and "sample with vLLM" in table


def test_step_quick_covers_every_variant(tmp_path, cache_dir):
    from covrl.bench.step_bench import VARIANTS

    res = run_bench("step", tmp_path, cache_dir)
    assert [v["variant"] for v in res["variants"]] == list(VARIANTS)
    assert all(v["step_s"] > 0 and v["forward_backward_s"] > 0 for v in res["variants"])
    assert res["grid"] and all(g["tokens_per_s"] > 0 for g in res["grid"])
    # the share of the matmul bound: the counted work of one pass over its time and the measured roof
    for g in res["grid"]:
        assert g["matmul_flops"] > 0
        assert abs(g["share_of_matmul_bound"] - g["matmul_flops"] / g["fwd_bwd_s"] / g["matmul_roof_flop_s"]) < 1e-9
    # prompt sharing in the Trainer's forward changes neither the log-probs nor the gradient
    assert res["prompt_sharing"]["logprob_max_diff"] < 1e-4
    assert res["prompt_sharing"]["grad_rel_diff"] < 1e-4
    assert res["prompt_sharing"]["speedup"] > 0


def test_step_quick_times_autocast_modes_side_by_side(tmp_path, cache_dir):
    res = run_bench("step", tmp_path, cache_dir, "--autocast", "none,bf16", "--variants", "plain (grpo + covariance)")
    assert [g["autocast"] for g in res["grid"]] == ["none", "bf16"]
    assert res["grid"][0]["speedup_vs_first_mode"] == 1.0 and res["grid"][1]["speedup_vs_first_mode"] > 0
    gap = res["grid"][1]["mismatch_vs_first_mode"]
    assert 0 < gap["logprob_max_abs_diff"] < 0.1 and gap["mismatch/k3"] > 0 and gap["kl_seq"] > 0
    assert [v["variant"] for v in res["variants"]] == ["plain (grpo + covariance)", "plain (grpo + covariance) [bf16]"]


@pytest.mark.slow
def test_step_quick_compile_compares_eager_and_compiled(tmp_path, cache_dir):
    # aot_eager: the capture and AOTAutograd's joint graph without inductor's code generation (the inductor
    # numerics are tests/train/test_compile.py's slow test)
    res = run_bench("step", tmp_path, cache_dir, "--compile", "only", "--compile-backend", "aot_eager")
    (row,) = res["compile"]
    assert row["compile_s"] > 0 and row["compiled_s"] > 0 and row["eager_s"] > 0 and row["eager_rows_s"] > 0
    assert row["logprob_max_diff"] < 1e-4 and row["grad_rel_diff"] < 1e-4


def test_rollout_quick_reports_bounds(tmp_path, cache_dir):
    res = run_bench("rollout", tmp_path, cache_dir)
    assert res["bandwidth_GB_s"] > 0 and res["weight_bytes"] > 0
    for row in res["rows"]:
        assert row["covrl_tok_s"] > 0 and row["generate_tok_s"] > 0
        assert row["roofline_tok_s"] == min(row["bandwidth_bound_tok_s"], row["compute_bound_tok_s"])
        assert row["matmul_floor_tok_s"] == row["batch"] / row["matmul_floor_step_s"]
        assert row["covrl_fraction_of_matmul_floor"] > 0


def test_rollout_without_vllm_skips_that_side(tmp_path, cache_dir, monkeypatch):
    import covrl.rollout.vllm as vllm_mod

    monkeypatch.setattr(vllm_mod, "vllm_available", lambda: False)   # as in an install without the extra
    res = run_bench("rollout", tmp_path, cache_dir, "--batch-sizes", "1")
    assert res["vllm"]["skipped"].startswith("skipped: vllm is not importable")
    assert [sorted(r["runs"]) for r in res["rows"]] == [["covrl", "generate"]]
    assert "vLLM side skipped: vllm is not importable" in (next(tmp_path.glob("rollout-tiny-quick/*.md"))).read_text()


@pytest.mark.slow
def test_distributed_quick_times_every_setup(tmp_path, cache_dir):
    res = run_bench("distributed", tmp_path, cache_dir)
    assert [r["setup"] for r in res["setups"]] == ["1x1", "2x1 ddp", "2x1 ddp-no-sync", "2x1 fsdp2"]
    assert all(r["step_s"] > 0 and r["speedup_vs_1x"] > 0 for r in res["setups"])
    assert res["communication"]["grad_numel"] > 0 and res["communication"]["allreduce_grad_s"] > 0


def test_rollout_quick_compile_alternates_eager_and_compiled(tmp_path, cache_dir):
    # the eager backend: dynamo's capture of the static-cache decode step without inductor's code generation
    res = run_bench("rollout", tmp_path, cache_dir, "--compile", "only", "--compile-backend", "eager",
                    "--batch-sizes", "3")
    (row,) = res["rows"]
    assert sorted(row["runs"]) == ["compiled", "covrl"]
    c = row["compile"]
    assert c["compile_s"] > 0 and c["graphs"] == 1 and c["timed_compile_s"] == 0.0
    assert c["padded_rows"] == 4 and c["cache_len"] % 64 == 0
    assert c["rows_identical"] == c["rows"] == 3 and c["logprob_max_diff"] < 1e-5
    assert c["decode_speedup"] > 0 and res["compile"]["graphs"] == 1


def test_step_quick_packing_compares_padded_and_packed(tmp_path, cache_dir):
    res = run_bench("step", tmp_path, cache_dir, "--packing", "--spread", "2,12", "--rows", "8")["packing"]
    assert res["response_tokens"] < res["padded_tokens"] and res["logprob_max_diff"] < 1e-5
    assert res["padded_s"] > 0 and res["packed_s"] > 0 and len(res["runs"]["packed"]) == len(res["runs"]["padded"])


def _die_killed(conn):
    import os
    import signal
    conn.send({"ready": True})
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_between_messages_is_named_with_its_exit_code():
    """A side's worker killed after a message (the out-of-memory killer) fails the bench with the side and the
    exit code, not a bare EOFError from the pipe."""
    import multiprocessing as mp

    from covrl.bench.alternate import _recv

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_die_killed, args=(child,))
    proc.start()
    child.close()
    assert _recv(parent, "covrl", 60, proc) == {"ready": True}
    with pytest.raises(RuntimeError, match=r"covrl worker exited \(code -9\) \(killed: SIGKILL"):
        _recv(parent, "covrl", 60, proc)
    proc.join()


def _send_malloc_env(conn):
    import os

    conn.send({k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")})


def test_workers_start_with_glibc_keeping_freed_memory_and_a_user_value_is_kept(monkeypatch):
    """The benchmarks' workers inherit the glibc settings that keep freed memory in the process (their steps were
    up to 2.5x slower on a VM that hands freed memory to its host); a value the user set wins."""
    from covrl.bench.alternate import KEEP_FREED_MEMORY, worker_context

    for key in KEEP_FREED_MEMORY:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MALLOC_TOP_PAD_", "12345")
    ctx = worker_context()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_send_malloc_env, args=(child,))
    proc.start()
    seen = parent.recv()
    proc.join()
    assert seen == {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
                    "MALLOC_TOP_PAD_": "12345"}
