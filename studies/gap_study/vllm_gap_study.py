"""The gap study of studies/gap_study/README.md re-run with vLLM as the engine.

Runs `covrl train` on configs/default.yaml (SmolLM2-135M, 30 steps) with `sampler.backend=vllm`, the engine in
its own process (`sampler.vllm.engine_process=true`) so that `run.num_threads=1` holds in the trainer, one arm
after the other (the machine has 2 shared cores). The trainer is fp32 in every arm; the arms (pre-registered in
studies/gap_study/README.md, section 3):

  fp32            fp32 engine, no correction (the reference: engine floor ~1e-11)
  bf16_none       bf16 engine, no correction
  bf16_token_is   bf16 engine, token-level truncated IS (C = 2)
  bf16_rs         bf16 engine, sequence-level rejection on the sequence-mean k3 (threshold --rs-threshold)

Writes runs/vllm-gap-study/<arm>/ (the run folders), studies/gap_study/vllm-gap-study.json (per-step k3 / kl_seq /
chi2 / reward / masked fraction, held-out accuracy before / after, wall time, load) and
studies/gap_study/vllm-gap-study.png.

    .venv/bin/python -m studies vllm-gap-study                       # all arms, 30 steps
    .venv/bin/python -m studies vllm-gap-study --arms fp32,bf16_none --steps 30
    .venv/bin/python -m studies vllm-gap-study --plot-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from studies.common import TYPED_DEFAULT_OVERRIDES, pyplot, save_figure

ROOT = Path(__file__).resolve().parents[2]   # the repository
OUT = ROOT / "runs" / "vllm-gap-study"
RESULTS = ROOT / "studies" / "gap_study" / "vllm-gap-study.json"
FIG = ROOT / "studies" / "gap_study" / "vllm-gap-study.png"
VLLM_PYTHON = Path(os.environ.get("COVRL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

COMMON = [
    "sampler.backend=vllm",
    "sampler.vllm.engine_process=true",
    "run.num_threads=1",
    "eval.sampled=false",
    "checkpoint.at_end=false",
    "logging.curves=false",
    "logging.progress_bar=false",
    f"run.output_dir={OUT}",
]

BF16 = ["sampler.dtype=bfloat16"]
ARMS = {
    "fp32": [],
    "bf16_none": BF16,
    "bf16_token_is": BF16 + ["correction.is_level=token", "correction.is_threshold=2.0"],
    "bf16_rs": BF16 + ["correction.rs=[seq_mean_k3]", "correction.rs_threshold=[RS_T]"],
}

PER_STEP = ("reward/mean", "mismatch/k3", "kl_seq", "mismatch/chi2_token", "mismatch/chi2_seq", "bound",
            "correction/masked_frac", "correction/ess_frac", "time/step", "time/generate", "time/sync")


def run_arm(arm: str, overrides: list[str], steps: int, eval_before: bool = True) -> dict:
    """One `covrl train` in the vLLM venv; returns the arm's summary (per-step series, evals, wall, load)."""
    cmd = [str(VLLM_PYTHON), "-m", "covrl", "train", "--config", str(ROOT / "configs/default.yaml"),
           "--name", arm, "--no-progress", *TYPED_DEFAULT_OVERRIDES, *COMMON, f"loop.steps={steps}",
           *([] if eval_before else ["eval.before=false"]), *overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    load0 = os.getloadavg()
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.time() - t0
    run_dir = OUT / arm
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "reward/mean" in r]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    out = {
        "command": " ".join(cmd[1:]), "overrides": overrides, "rc": proc.returncode, "seconds": round(seconds, 1),
        "load_average_start": [round(x, 2) for x in load0],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "loop_steps": steps, "steps": len(rows), "status": summary.get("status"),
        "eval_before": (summary.get("eval_before") or {}).get("greedy"),
        "eval_after": (summary.get("eval_after") or {}).get("greedy"),
        "git": summary.get("git"), "torch_threads": summary.get("torch_threads"),
        "error": (proc.stderr or proc.stdout)[-2000:] if proc.returncode else None,
        "per_step": {k: [r.get(k) for r in rows] for k in PER_STEP},
    }
    print(f"{arm}: rc={proc.returncode} {seconds:.0f}s {len(rows)} steps, greedy "
          f"{out['eval_before']} -> {out['eval_after']}, load {out['load_average_end'][0]}", flush=True)
    return out


def plot(arms: dict) -> None:
    plt = pyplot()
    panels = [("reward/mean", "reward (mean)", False), ("mismatch/k3", "mismatch/k3 (per token)", True),
              ("kl_seq", "kl_seq", True), ("mismatch/chi2_token", "chi2 per token", True),
              ("correction/masked_frac", "masked fraction", False)]
    fig, axes = plt.subplots(1, len(panels), figsize=(21, 3.8))
    for ax, (key, title, log) in zip(axes, panels):
        for arm, s in arms.items():
            pts = [(i + 1, y) for i, y in enumerate(s["per_step"].get(key, [])) if isinstance(y, (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=arm)
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("symlog", linthresh=1e-12)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M, vLLM engine (own process) / fp32 trainer, seed 0")
    save_figure(fig, FIG, dpi=110)


def _fmt(x) -> str:
    return "—" if x is None else f"{x:.2g}" if abs(x) < 0.01 and x != 0 else f"{x:.3g}"


def _nums(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float))]


def table(results: dict) -> str:
    """Markdown summary per arm and the pre-registered pass rule (studies/gap_study/README.md, section 3)."""
    arms = results["arms"]
    # the fp32 arm's accuracy after training; else a reference given on the command line (recorded in the JSON)
    ref_after = (arms.get("fp32") or {}).get("eval_after") or results.get("reference_after")
    lines = ["| arm | steps | greedy before -> after | k3 step 1 | k3 max of steps 3.. | k3 last 10 (median) "
             "| kl_seq step 1 / mean | chi2_token step 1 / mean | masked frac (mean) | ESS frac (mean) "
             "| reward last 5 | wall s | load (start/end) | pass (a,b,c,d) |", "|---" * 14 + "|"]
    for arm, a in arms.items():
        ps = a["per_step"]
        k3, kl, chi = _nums(ps["mismatch/k3"]), _nums(ps["kl_seq"]), _nums(ps["mismatch/chi2_token"])
        masked, ess = _nums(ps["correction/masked_frac"]), _nums(ps["correction/ess_frac"])
        last10 = sorted(k3[-10:])
        med = last10[len(last10) // 2] if last10 else None
        reward = _nums(ps["reward/mean"])[-5:]
        checks = None
        if arm != "fp32" and k3:
            planned = a.get("loop_steps", results.get("steps", 30))
            checks = [a["steps"] == planned and a["rc"] == 0,
                      ref_after is not None and a["eval_after"] is not None and a["eval_after"] >= ref_after - 0.10,
                      max(k3[-10:]) <= 10 * k3[0],
                      arm != "bf16_rs" or (bool(masked) and sum(masked) / len(masked) < 0.5)]
        lines.append(
            f"| {arm} | {a['steps']} | {_fmt(a['eval_before'])} -> {_fmt(a['eval_after'])} | {_fmt(k3[0] if k3 else None)} "
            f"| {_fmt(max(k3[2:]) if len(k3) > 2 else None)} | {_fmt(med)} "
            f"| {_fmt(kl[0] if kl else None)} / {_fmt(sum(kl) / len(kl) if kl else None)} "
            f"| {_fmt(chi[0] if chi else None)} / {_fmt(sum(chi) / len(chi) if chi else None)} "
            f"| {_fmt(sum(masked) / len(masked) if masked else None)} | {_fmt(sum(ess) / len(ess) if ess else None)} "
            f"| {_fmt(sum(reward) / len(reward) if reward else None)} | {a['seconds']:.0f} "
            f"| {a['load_average_start'][0]:.1f}/{a['load_average_end'][0]:.1f} "
            f"| {'—' if checks is None else ','.join('y' if c else 'n' for c in checks)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rs-threshold", type=float, default=0.01,
                        help="upper bound on the sequence-mean k3 for the rejection arm")
    parser.add_argument("--no-eval-before", action="store_true", help="skip the held-out eval before training "
                        "(it is the same for every arm with the same engine dtype: same weights, greedy, same seed)")
    parser.add_argument("--reference-after", type=float, default=None, help="fp32 reference accuracy after "
                        "training for rule (b) when this study's fp32 arm has none (recorded in the JSON)")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"arms": {}}
    if not args.plot_only:
        if not VLLM_PYTHON.exists():
            print(f"no vLLM venv at {VLLM_PYTHON} (scripts/setup_vllm_env.sh, or set COVRL_VLLM_PYTHON)")
            return 2
        OUT.mkdir(parents=True, exist_ok=True)
        results.update(rs_threshold=args.rs_threshold)
        for arm in args.arms.split(","):
            overrides = [o.replace("RS_T", repr(args.rs_threshold)) for o in ARMS[arm]]
            results["arms"][arm] = run_arm(arm, overrides, args.steps, not args.no_eval_before)
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=1))
    if args.reference_after is not None:
        results["reference_after"] = args.reference_after
        RESULTS.write_text(json.dumps(results, indent=1))
    if results["arms"]:
        plot(results["arms"])
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
