"""Shared helpers of the reliability tests: a very short tiny run (in-process or as a `covrl train`
subprocess) and readers for its run folder."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from covrl.config import preset_path

REPO = Path(__file__).resolve().parents[2]
TINY = preset_path("tiny")
REWARDS = Path(__file__).resolve().parent / "_hostile_rewards.py"


def popen_logged(args: list[str], env: dict, out: Path, name: str, resume: bool = False) -> subprocess.Popen:
    """Start `args` (+ --resume) in the checkout with its output in files under `out`, not pipes: a process
    nobody reads from yet must never block on a full pipe. `logs(proc)` reads them."""
    logs = Path(out) / f".{name}-{time.perf_counter_ns()}"
    proc = subprocess.Popen(args + (["--resume"] if resume else []), env=env, cwd=str(REPO),
                            stdout=open(f"{logs}.out", "w"), stderr=open(f"{logs}.err", "w"))
    proc.logs = logs
    return proc


def logs(proc: subprocess.Popen) -> tuple[str, str]:
    """(stdout, stderr) of a process started by `popen_logged`."""
    return Path(f"{proc.logs}.out").read_text(), Path(f"{proc.logs}.err").read_text()


def tiny_overrides(out: Path, name: str, *extra: str, steps: int = 4, every: int = 16) -> list[str]:
    """A tiny run: 4 prompts x 4 samples = 16 rollouts per step, a checkpoint every `every` rollouts, a dense
    user reward (digit fraction) so every step has non-zero advantages, a 2-step SFT warm-up."""
    return [f"run.output_dir={out}", f"run.name={name}", f"loop.steps={steps}", "loop.prompts_per_step=4",
            "loop.group_size=4", "sft_warmup.steps=2", "eval.before=false", "eval.after=false",
            "logging.curves=false", "logging.progress_bar=false", "task.n_train=64", "task.n_eval=8",
            f"checkpoint.every_rollouts={every}", "checkpoint.keep_last=2", "optim.micro_batch_size=8",
            f"task.reward={REWARDS}:digit_fraction", *extra]


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    from covrl.train.run import checkpoint as ckpt

    latest = ckpt.latest_checkpoint(Path(run_dir))
    assert latest is not None, f"{run_dir} has no complete checkpoint"
    return load_file(str(latest / "model" / "model.safetensors"))


# per-step keys that depend only on the data and the weights (not on wall time)
def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if not (k.startswith("time/") or k.endswith("per_s") or k in ("skip_reason",))}
