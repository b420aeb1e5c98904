"""Gap study on SmolLM2-135M: engine floors and a small correction study.

Runs ``covrl train`` as subprocesses (sequentially; the machine has 2 shared cores), reads each run's
``metrics.jsonl`` and writes ``runs/gap-study/summary.json`` and ``studies/gap_study/gap-study.png``.

Part 1 (floors): 3-step runs per sampler setting; the step-1 ``mismatch/k3`` / ``kl_seq`` is the engine floor
at staleness 0 (sampler and trainer hold the same weights, only the engine differs).
Part 2 (study): bf16 sampler, fp32 trainer, same seed, arms none | token IS | seq_mean_k3 rejection |
score centring; reward, kl_seq, bound and masked fraction vs step in one figure.

    .venv/bin/python -m studies gap-study            # everything (~12 min on 2 idle cores)
    .venv/bin/python -m studies gap-study --skip-floors --study-steps 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from studies.common import TYPED_DEFAULT_OVERRIDES, pyplot, save_figure

ROOT = Path(__file__).resolve().parents[2]   # the repository
OUT = ROOT / "runs" / "gap-study"
FIG = ROOT / "studies" / "gap_study" / "gap-study.png"
COVRL = ROOT / ".venv" / "bin" / "covrl"

COMMON = [
    "eval.before=false",
    "eval.after=false",
    "checkpoint.at_end=false",
    "run.num_threads=1",
    "logging.curves=false",
    "logging.progress_bar=false",
    f"run.output_dir={OUT}",
]

# name -> (overrides, steps); staleness needs > sync_every steps so that stale steps exist.
FLOORS = {
    "floor-fp32": ([], 3),
    "floor-bf16": (["sampler.dtype=bfloat16"], 3),
    "floor-fp16": (["sampler.dtype=float16"], 3),
    "floor-topk20": (["sampler.top_k=20"], 3),
    "floor-topp0.9": (["sampler.top_p=0.9"], 3),
    "floor-stale4": (["sampler.sync_every=4"], 5),
}

STUDY_BASE = ["sampler.dtype=bfloat16"]
ARMS = {
    "none": [],
    "token_is": ["correction.is_level=token", "correction.is_threshold=2.0"],
    "rs_seq_mean_k3": ["correction.rs=[seq_mean_k3]", "correction.rs_threshold=[RS_T]"],
    "score_centering": ["algorithm.score_centering=true", "sampler.return_topk=8"],
}


def run_train(name: str, overrides: list[str], steps: int) -> dict:
    """Run one ``covrl train`` and return {rc, seconds, rows (metrics.jsonl records), error tail}."""
    cmd = [
        str(COVRL),
        "train",
        "--config",
        str(ROOT / "configs/default.yaml"),
        "--name",
        name,
        *TYPED_DEFAULT_OVERRIDES,
        *COMMON,
        f"loop.steps={steps}",
        *overrides,
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.time() - t0
    metrics_path = OUT / name / "metrics.jsonl"
    rows = []
    if metrics_path.exists():
        rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "reward/mean" in r]
    print(f"{name}: rc={proc.returncode} {seconds:.0f}s {len(rows)} steps", flush=True)
    return {
        "rc": proc.returncode,
        "seconds": seconds,
        "overrides": overrides,
        "rows": rows,
        "error": (proc.stderr or proc.stdout)[-1500:] if proc.returncode else None,
    }


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def series(rows: list[dict], key: str) -> list[float | None]:
    return [r.get(key) for r in rows]


def run_header(res: dict) -> dict:
    """What every run summary starts with: exit code, time, overrides, steps, error."""
    return {"rc": res["rc"], "seconds": round(res["seconds"], 1), "overrides": res["overrides"],
            "steps": len(res["rows"]), "error": res["error"]}


def floor_summary(res: dict) -> dict:
    rows = res["rows"]
    out = run_header(res)
    if rows:
        for key in ("mismatch/k3", "mismatch/k1", "kl_seq"):
            vals = series(rows, key)
            out[f"{key}/step1"] = vals[0]
            out[f"{key}/mean"] = mean(vals)
            out[f"{key}/per_step"] = vals
    return out


def study_summary(res: dict) -> dict:
    rows = res["rows"]
    out = run_header(res)
    if rows:
        out["reward_last3"] = mean(series(rows, "reward/mean")[-3:])
        for key in ("kl_seq", "bound", "mismatch/k3", "correction/masked_frac", "correction/ess_frac"):
            out[f"{key}/mean"] = mean(series(rows, key))
        for key in ("reward/mean", "kl_seq", "bound", "correction/masked_frac"):
            out[f"{key}/per_step"] = series(rows, key)
    return out


def plot(study: dict) -> None:
    plt = pyplot()

    panels = [
        ("reward/mean", "reward (mean)"),
        ("kl_seq", "kl_seq (sampler vs trainer)"),
        ("bound", "bound"),
        ("correction/masked_frac", "masked fraction"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for ax, (key, title) in zip(axes, panels):
        for arm, s in study.items():
            ys = s.get(f"{key}/per_step") or []
            pts = [(i + 1, y) for i, y in enumerate(ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=arm)
        ax.set_title(title)
        ax.set_xlabel("step")
        if key in ("kl_seq", "bound"):
            ax.set_yscale("symlog", linthresh=1e-6)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M, bf16 sampler / fp32 trainer, seed 0 (gap study)")
    save_figure(fig, FIG, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-floors", action="store_true")
    parser.add_argument("--skip-study", action="store_true")
    parser.add_argument("--study-steps", type=int, default=8)
    parser.add_argument(
        "--rs-threshold",
        type=float,
        default=1e-3,
        help="upper bound on the sequence-mean k3 for the rejection arm",
    )
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    summary_path = OUT / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}

    if not args.skip_floors:
        summary["floors"] = {}
        for name, (overrides, steps) in FLOORS.items():
            summary["floors"][name] = floor_summary(run_train(name, overrides, steps))
            summary_path.write_text(json.dumps(summary, indent=1))

    if not args.skip_study:
        summary["study"] = {"steps": args.study_steps, "rs_threshold": args.rs_threshold, "arms": {}}
        for arm, overrides in ARMS.items():
            overrides = [o.replace("RS_T", repr(args.rs_threshold)) for o in overrides]
            res = run_train(f"study-{arm}", STUDY_BASE + overrides, args.study_steps)
            summary["study"]["arms"][arm] = study_summary(res)
            summary_path.write_text(json.dumps(summary, indent=1))
    if "study" in summary:
        plot(summary["study"]["arms"])
    summary_path.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
