"""The fault-injection hooks themselves (covrl.train.faults): spec parsing, hit counting, the trace file, the
ENOSPC and EROFS actions, SIGTERM at a point, and a real SIGKILL of a child process at the n-th hit."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest

from covrl.train import faults


@pytest.fixture
def fault_env(monkeypatch):
    def set_env(spec: str | None = None, trace: str | None = None):
        for name, value in ((faults.ENV, spec), (faults.TRACE_ENV, trace)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        faults.reset()

    yield set_env
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.delenv(faults.TRACE_ENV, raising=False)
    faults.reset()


def test_parse_spec_reads_points_counts_and_actions():
    assert faults.parse_spec("") == {}
    assert faults.parse_spec("backward:3, checkpoint-write:1:enospc") == {
        "backward": (3, "kill"), "checkpoint-write": (1, "enospc")}


@pytest.mark.parametrize("bad, needle", [
    ("backward", "<point>:<n>"), ("nowhere:1", "unknown point 'nowhere'"), ("generate:x", "not an integer"),
    ("generate:0", ">= 1"), ("generate:1:explode", "unknown action 'explode'"), ("a:1:2:3", "<point>:<n>"),
])
def test_parse_spec_rejects_malformed_values_by_name(bad, needle):
    with pytest.raises(faults.FaultSpecError, match=needle.replace("(", r"\(")):
        faults.parse_spec(bad)


def test_inert_without_environment(fault_env):
    fault_env(None)
    for _ in range(5):
        faults.fault_point("generate")  # nothing happens, nothing counted
    assert faults._hits == {}


def test_trace_counts_hits_per_point(fault_env, tmp_path):
    trace = tmp_path / "trace"
    fault_env(None, str(trace))
    for point in ("generate", "backward", "generate"):
        faults.fault_point(point)
    lines = [line.split()[1:] for line in trace.read_text().splitlines()]
    assert lines == [["generate", "1"], ["backward", "1"], ["generate", "2"]]
    with pytest.raises(faults.FaultSpecError, match="unknown point"):
        faults.fault_point("typo")


def test_enospc_fires_at_the_nth_hit_only(fault_env):
    fault_env("checkpoint-write:2:enospc")
    faults.fault_point("checkpoint-write")
    with pytest.raises(OSError) as info:
        faults.fault_point("checkpoint-write")
    assert info.value.errno == errno.ENOSPC
    faults.fault_point("checkpoint-write")  # hit 3: past the target


def test_erofs_fires_a_read_only_error_at_the_shard_point(fault_env):
    fault_env("checkpoint-shards:1:erofs")
    with pytest.raises(OSError) as info:
        faults.fault_point("checkpoint-shards")
    assert info.value.errno == errno.EROFS and "Read-only file system" in str(info.value)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_kill_action_sigkills_the_process_at_the_nth_hit(tmp_path):
    trace = tmp_path / "trace"
    code = ("from covrl.train.faults import fault_point\n"
            "for i in range(5):\n    fault_point('backward')\n    print(i, flush=True)\n")
    env = {**os.environ, faults.ENV: "backward:3", faults.TRACE_ENV: str(trace)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["0", "1"]
    assert [line.split()[2] for line in trace.read_text().splitlines()] == ["1", "2", "3"]


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_term_action_sends_sigterm_to_the_process_and_carries_on():
    code = ("import signal\nfrom covrl.train.faults import fault_point\n"
            "signal.signal(signal.SIGTERM, lambda *a: print('handler', flush=True))\n"
            "for i in range(3):\n    fault_point('generate')\n    print(i, flush=True)\n")
    env = {**os.environ, faults.ENV: "generate:2:term"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "handler", "1", "2"]
