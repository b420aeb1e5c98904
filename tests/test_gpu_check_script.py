"""scripts/gpu_check.sh, the GPU path's one-run check, exercised on the CPU (--cpu --quick): every step runs and
the script exits 0; the trainer throughput benchmark writes its baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_runs_on_a_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for section in ("== environment", "== tests marked cuda", "== the tiny preset trained on cpu",
                    "== trainer throughput", "status 0"):
        assert section in proc.stdout, section
    bench = json.loads(next((tmp_path / "benchmarks").glob("throughput-qwen3-mini-cpu/*.json")).read_text())
    rows = bench["results"]["rows"]
    assert [r["seq_len"] for r in rows] == [64, 128] and all(r["tokens_per_s"] > 0 for r in rows)
    assert json.loads((tmp_path / "runs" / "tiny-cpu" / "summary.json").read_text())["status"] == "completed"
