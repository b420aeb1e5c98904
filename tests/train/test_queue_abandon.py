"""A multiprocessing queue whose reader is gone must not keep the interpreter from exiting (the process pool
abandons the inbox of a killed sampler process this way)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import multiprocessing, time
    from covrl.train.asyncrl.process_pool import _abandon
    q = multiprocessing.get_context("spawn").Queue()
    q.put(b"x" * 10_000_000)   # larger than a pipe's buffer, and nobody reads it: the feeder thread blocks
    time.sleep(0.5)
    if {abandon}:
        _abandon(q)
""")


def _exits_within(abandon: bool, seconds: float) -> bool:
    try:
        subprocess.run([sys.executable, "-c", SCRIPT.format(abandon=abandon)], timeout=seconds, check=True)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_an_abandoned_queue_lets_the_interpreter_exit():
    assert _exits_within(True, 60)


def test_without_abandoning_the_exit_hangs_on_the_feeder_thread():
    # the failure the fix is for: the queue's exit hook joins a feeder blocked on a pipe nobody reads
    assert not _exits_within(False, 5)


def test_process_pool_stop_ends_its_workers_and_abandons_its_queues(monkeypatch):
    """`ProcessPool.stop` stops the dispatcher, then ends the worker processes and abandons every queue
    (`_terminate`). It had been nested inside `_abandon` by mistake (dead code): stop was the dispatcher's
    alone, so worker processes lived until the interpreter exited and the queues were never abandoned."""
    from covrl.train.asyncrl.process_pool import DispatchPool, ProcessPool

    calls = []
    monkeypatch.setattr(DispatchPool, "stop", lambda self: calls.append("dispatcher"))
    monkeypatch.setattr(ProcessPool, "_terminate", lambda self: calls.append("workers"))
    ProcessPool.stop(object.__new__(ProcessPool))
    assert calls == ["dispatcher", "workers"]
