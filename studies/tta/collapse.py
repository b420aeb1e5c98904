"""Why a default run loses accuracy late (design C, studies/tta/README.md §6): one covrl arm of `covrl bench tta`
replayed step by step, with every trainer metric kept and greedy accuracy evaluated every few steps.

The run is the bench's covrl arm (configs/default.yaml + the suite's task, the three sizes `auto`, its probe and
adaptation) plus a variant's overrides. Steps are counted, not timed: on one thread a run is deterministic by
step (evaluations included, which draw from the sampler's generator), so a variant departs from `default` only
where its overrides act.

    python -m studies.tta.collapse --task add2 --seed 1 --variant default --steps 14 --eval-every 2
    python -m studies.tta.collapse --report          # the table of every finished run

One JSON per run, `studies/tta/runs/collapse/<task>-s<seed>-<variant>.json`: the probe's sizes, per step the
sizes it sampled with, reward, groups without contrast, cut rate, gradient norm, skip, loss and wall seconds,
and the greedy accuracy at each evaluation (the task's first 50 held-out prompts, the probe's budget)."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

# each variant: dotted overrides on top of the bench's covrl arm
VARIANTS: dict[str, dict] = {
    "default": {},
    "groups_le8": {"sizing.group_sizes": [4, 8]},          # at least 2 prompts a step
    "rollouts32": {"sizing.rollouts_per_step": 32},        # 2 x 16 where default takes 1 x 16
    "lr1e-5": {"optim.lr": 1e-5},
    "no_adapt": {"sizing.adapt": False},
    "shape2x8": {"loop.prompts_per_step": 2, "loop.group_size": 8},   # typed: the budget alone is probed
}
OUT = Path("studies/tta/runs/collapse")


def batch_stats(batch, budget: int) -> dict:
    from covrl.train.run.sizing import cut_fraction, failing_fraction, groups_of

    lengths = batch.response_mask.sum(1).long().tolist()
    groups = groups_of(batch)
    return {"reward": float(batch.rewards.mean()), "cut": cut_fraction(lengths, budget),
            "failing_groups": failing_fraction(groups),
            "constant_groups": sum(len(set(g)) == 1 for g in groups) / len(groups),
            "length_mean": sum(lengths) / len(lengths), "prompts": len(groups), "group": len(groups[0])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="print the table of the finished runs and stop")
    parser.add_argument("--task")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--variant", choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-prompts", type=int, default=50)
    args = parser.parse_args(argv)
    if args.report:
        print(report(sorted(OUT.glob("*.json"))))
        return 0
    if args.task is None or args.seed is None or args.variant is None:
        parser.error("--task, --seed and --variant are required (or --report)")

    import torch

    from covrl.bench.clock import make_evaluator
    from covrl.bench.models import DEFAULT_CACHE
    from covrl.bench.settings import StepSettings
    from covrl.bench.tta_bench import arm_config
    from covrl.bench.tta_suite import TASKS, materialise
    from covrl.experiment import Arm, ArmRunner

    torch.set_num_threads(1)
    data_dir = Path(tempfile.mkdtemp(prefix="covrl-collapse-data-"))
    run_dir = Path(tempfile.mkdtemp(prefix="covrl-collapse-run-"))
    overrides = materialise(args.task, data_dir)
    cfg = arm_config("smollm2", str(DEFAULT_CACHE), overrides, TASKS[args.task].max_new_tokens, args.seed, 1,
                     auto=True, extra=VARIANTS[args.variant])
    t0 = time.perf_counter()
    runner = ArmRunner(Arm(cfg, run_dir))
    run = runner.run
    torch.set_num_threads(1)
    probe_s = float((run.sizing or {}).get("time/probe_s", 0.0))
    eval_tokens = int(run.cfg.sampler.max_new_tokens)
    settings = StepSettings(model="smollm2", cache_dir=str(DEFAULT_CACHE), threads=1, seed=args.seed,
                            max_new_tokens=eval_tokens, eval_prompts=args.eval_prompts,
                            task=run.cfg.task.model_dump(mode="json"))
    evaluate = make_evaluator(settings, run.model, run.tokenizer, run.task)
    result = {"task": args.task, "seed": args.seed, "variant": args.variant, "overrides": VARIANTS[args.variant],
              "probe_s": probe_s, "eval_max_new_tokens": eval_tokens,
              "sizes": {"max_new_tokens": eval_tokens, "group_size": run.cfg.loop.group_size,
                        "prompts_per_step": run.cfg.loop.prompts_per_step},
              "evals": [{"step": 0, "accuracy": evaluate()}], "steps": []}
    print(f"{args.task} s{args.seed} {args.variant}: probe {probe_s:.0f} s, {result['sizes']}, "
          f"greedy {result['evals'][0]['accuracy']:.0%}", flush=True)
    clock = probe_s
    try:
        for k in range(1, args.steps + 1):
            budget = int(run.cfg.sampler.max_new_tokens)
            step = runner.step()
            clock += step.wall_s
            rec = {"step": k, "clock_s": clock, "wall_s": step.wall_s, "max_new_tokens": budget,
                   **batch_stats(step.batch, budget),
                   **{m: float(v) for m, v in step.metrics.items() if isinstance(v, (int, float))}}
            result["steps"].append(rec)
            line = (f"step {k}: {rec['prompts']} x {rec['group']} @ {budget}, reward {rec['reward']:.2f}, "
                    f"failing {rec['failing_groups']:.0%}, grad {rec.get('grad_norm', float('nan')):.2f}, "
                    f"clock {clock:.0f} s")
            if k % args.eval_every == 0 or k == args.steps:
                with run.sizing_adapter.evaluation_budget() if run.sizing_adapter else contextlib.nullcontext():
                    acc = evaluate()
                result["evals"].append({"step": k, "clock_s": clock, "accuracy": acc})
                line += f", greedy {acc:.0%}"
            print(line, flush=True)
    finally:
        runner.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{args.task}-s{args.seed}-{args.variant}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def report(paths) -> str:
    """One row per run: the shapes it sampled with, greedy accuracy at each evaluation and their mean after step 0
    (the area under the curve, in evaluation steps), and the policy's entropy at steps 1, 5, 9 and 13."""
    rows = ["| task | seed | variant | shapes (steps) | greedy by step | mean after 0 | entropy at 1 / 5 / 9 / 13 |",
            "|---|---|---|---|---|---|---|"]
    for path in paths:
        r = json.loads(Path(path).read_text())
        shapes, last = [], None
        for st in r["steps"]:
            shape = f"{st['prompts']}x{st['group']}@{st['max_new_tokens']}"
            if shape != last:
                shapes.append(f"{shape} ({st['step']})")
                last = shape
        evals = r["evals"]
        curve = " ".join(f"{e['step']}: {100 * e['accuracy']:.0f}" for e in evals)
        mean = sum(e["accuracy"] for e in evals[1:]) / max(len(evals) - 1, 1)
        ent = " / ".join(f"{r['steps'][k - 1]['entropy']:.2f}" for k in (1, 5, 9, 13) if k <= len(r["steps"]))
        rows.append(f"| {r['task']} | {r['seed']} | {r['variant']} | {', '.join(shapes)} | {curve} | "
                    f"**{100 * mean:.0f}%** | {ent} |")
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
