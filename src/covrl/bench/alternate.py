"""Alternating workers of the covrl-vs-TRL benchmarks: covrl and TRL each run in their own child process (so
peak RSS is per side). The parent tells one worker at a time to do one optimisation step and waits for its
record, alternating sides (and flipping the order every step), so background load on a shared machine hits both
sides alike. `summarize` turns a side's step records into its throughput numbers."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

from covrl.bench.common import load1
from covrl.bench.covrl_side import covrl_worker
from covrl.bench.models import model_dir, quiet_transformers
from covrl.bench.settings import StepSettings
from covrl.bench.trl_side import trl_worker

WORKERS = {"trl": trl_worker, "covrl": covrl_worker}

# glibc settings that keep a worker's freed memory in the process instead of handing it back to the kernel. On a
# VM whose balloon reports free pages to the host, memory handed back is faulted in again at the next step, and
# that made both sides' steps up to 2.5 times slower, by an amount that drifted over hours. They change no number
# a step computes. A value already in the environment is kept.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
                     "MALLOC_TOP_PAD_": str(512 << 20)}


def worker_context():
    """The multiprocessing context the benchmarks start their workers from: spawn, with KEEP_FREED_MEMORY in the
    environment the workers inherit (glibc reads it when a process starts, so it is set before any worker)."""
    for key, value in KEEP_FREED_MEMORY.items():
        os.environ.setdefault(key, value)
    return mp.get_context("spawn")


def _entry(side: str, conn, settings: StepSettings) -> None:
    try:
        quiet_transformers()
        WORKERS[side](conn, settings)
    except BaseException as err:  # report to the parent instead of leaving it waiting
        import traceback

        conn.send({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        raise


def run_alternating(settings: StepSettings | dict[str, StepSettings], sides: tuple[str, ...] = ("covrl", "trl"),
                    timeout_s: float = 3600.0, progress=None, tolerate: tuple[str, ...] = ()) -> dict[str, Any]:
    """Start one worker per side (`settings` shared, or one per side), then step them alternately (order
    flipped every round) until each reports `finished`. Returns each side's ready message, step records
    (warm-up steps dropped), summaries and the load average seen each round. `progress(text)`, when given,
    receives one line per step. A side in `tolerate` whose worker fails (while starting or in a step) leaves the
    run: its error goes to `failed[side]` and the other sides go on; any other side's failure raises."""
    per_side = settings if isinstance(settings, dict) else {side: settings for side in sides}
    for s in per_side.values():  # write the model folders once, before the workers race for them
        model_dir(s.model, s.cache_dir)
    ctx = worker_context()
    procs, conns = {}, {}
    for side in sides:
        parent_conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=_entry, args=(side, child_conn, per_side[side]), daemon=True)
        proc.start()
        procs[side], conns[side] = proc, parent_conn
    records: dict[str, list[dict]] = {side: [] for side in sides}
    all_records: dict[str, list[dict]] = {side: [] for side in sides}
    loads = []
    failed: dict[str, str] = {}

    def recv(side: str) -> dict | None:
        try:
            return _recv(conns[side], side, timeout_s, procs[side])
        except RuntimeError as err:   # the worker reported an error or died
            if side not in tolerate:
                raise
            failed[side] = " ".join(getattr(err, "reason", str(err)).split())   # one line for the table
            if progress is not None:
                progress(failed[side])
            return None

    try:
        ready = {side: recv(side) for side in sides}
        active = [side for side in sides if side not in failed]
        step = 0
        while active:
            for side in (list(active) if step % 2 == 0 else list(reversed(active))):   # sides may leave
                conns[side].send("go")
                rec = recv(side)
                if rec is None:
                    active.remove(side)
                    continue
                rec["load1"] = load1()
                rec["step"] = step
                all_records[side].append(rec)
                if progress is not None:
                    acc = f", accuracy {rec['accuracy']:.0%}" if "accuracy" in rec else ""
                    progress(f"{side} step {step + 1}: {rec['step_time']:.2f} s (generation {rec['gen_time']:.2f} s)"
                             f"{acc}, load {rec['load1']:.1f}")
                if step >= per_side[side].warmup_steps:
                    records[side].append(rec)
                if rec.get("finished"):
                    _recv(conns[side], side, timeout_s, procs[side])  # "done"
                    active.remove(side)
            loads.append(load1())
            step += 1
    finally:
        join_workers(procs)
    return {"ready": ready, "records": records, "all_records": all_records, "failed": failed,
            "summary": {s: summarize(r, per_side[s].batch_size) for s, r in records.items() if s not in failed},
            "load1": loads}


def join_workers(procs: dict) -> None:
    """Wait for the worker processes to exit (30 s each), terminating any that hang."""
    for proc in procs.values():
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()


def _exited(side: str, proc) -> str:
    code = getattr(proc, "exitcode", None)
    why = " (killed: SIGKILL, often the kernel's out-of-memory killer; see dmesg)" if code == -9 else ""
    return f"{side} worker exited (code {code}){why} without a result"


def _recv(conn, side: str, timeout_s: float, proc=None) -> dict:
    """Next message of a worker; raises if it reports an error, dies silently, or says nothing in time."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(1.0):
        if proc is not None and not proc.is_alive() and not conn.poll(0):
            raise RuntimeError(_exited(side, proc))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{side} worker sent nothing for {timeout_s:.0f} s")
    try:
        msg = conn.recv()
    except EOFError:   # the pipe closed: the worker died between two messages (poll reports a closed pipe as ready)
        if proc is not None:
            proc.join(timeout=5)
        raise RuntimeError(_exited(side, proc)) from None
    if "error" in msg:
        err = RuntimeError(f"{side} worker failed: {msg['error']}\n{msg.get('traceback', '')}")
        err.reason = f"{side} worker failed: {msg['error']}"   # without the traceback
        raise err
    return msg


def summarize(records: list[dict], rollouts_per_step: int | None = None) -> dict[str, float]:
    """Median step time and rollouts/s; tokens/s as total tokens over total time (robust to uneven steps):
    generated tokens over generation time, trained tokens over the rest of the step (reward, forward,
    backward, optimizer, weight sync), and generated tokens over the whole step (end to end)."""
    if not records:
        return {}
    total_time = sum(r["step_time"] for r in records)
    gen_time = sum(r.get("gen_time", 0.0) for r in records)
    gen_tokens = sum(r["gen_tokens"] for r in records)
    trained = sum(r["trained_tokens"] for r in records)
    median_step = statistics.median(r["step_time"] for r in records)
    return {
        "steps": len(records),
        "median_step_s": median_step,
        "median_gen_s": statistics.median(r.get("gen_time", 0.0) for r in records),
        "rollouts_per_s": (rollouts_per_step / median_step) if rollouts_per_step else float("nan"),
        "gen_tokens_per_step": gen_tokens / len(records),
        "gen_tokens_per_s": gen_tokens / gen_time if gen_time > 0 else float("nan"),
        "trained_tokens_per_s": trained / (total_time - gen_time) if total_time > gen_time else float("nan"),
        "step_tokens_per_s": gen_tokens / total_time,
        "peak_rss_mb": max(r["rss_peak_mb"] for r in records),
        "reward_mean": statistics.fmean(r.get("reward_mean", float("nan")) for r in records),
        # the fraction of groups whose rewards were all equal (covrl's side logs it per step)
        "constant_groups_frac": statistics.fmean(r.get("constant_groups", float("nan")) for r in records),
        "mean_load1": statistics.fmean(r["load1"] for r in records),
    }
