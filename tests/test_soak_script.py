"""scripts/soak.py on a short sync run of the tiny preset: it samples the run's processes into samples.csv, stops
the run with SIGTERM after 45 s (covrl's clean stop, exit 143) and writes the per-role summary."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_soak_samples_the_run_and_summarizes(tmp_path):
    out = tmp_path / "soak"
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--out", str(out), "--duration", "45", "--interval",
           "2", "--warmup", "4", "--settle", "1", "--run-dir", str(tmp_path / "runs" / "soak"), "--",
           "--config", str(ROOT / "configs" / "tiny.yaml"), "run.num_threads=1", "loop.steps=100000",
           "sft_warmup.steps=0", "eval.before=false", "eval.after=false", "logging.progress_bar=false",
           "logging.curves=false", "checkpoint.every_rollouts=2000",
           f"run.output_dir={tmp_path / 'runs'}", "run.name=soak"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader((out / "samples.csv").open()))
    summary = json.loads((out / "summary.json").read_text())
    driver = [r for r in rows if r["role"] == "driver"]
    assert summary["samples"] >= 3 and len({r["t_s"] for r in driver}) >= 3
    assert {r["pid"] for r in driver} == {str(summary["driver_pid"])}
    assert all(float(r["rss_mb"]) > 0 and int(r["fds"]) > 0 and int(r["threads"]) >= 1 for r in rows)
    assert summary["exit_code"] == 143 and summary["leftover"] == []
    assert summary["final_step"] and summary["final_step"] > 0
    roles = summary["roles"]
    assert roles["driver"]["procs"]["end"] == 1 and roles["driver"]["rss_mb"]["end"] > 50
    assert "| driver |" in (out / "summary.md").read_text()
