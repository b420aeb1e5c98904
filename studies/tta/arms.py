"""The arms of the time-to-accuracy diagnosis (studies/tta/DESIGN.md) and one run of an arm.

Every covrl arm is configs/default.yaml + the task's overrides (studies/tta/tasks.py, its token budget included)
+ the arm's overrides (one factor each); the `trl` arm is TRL's GRPOTrainer as the suite runs it (2 prompts x 8,
lr 1e-5, token-mean clipped loss), on the same task section, budget, evaluator and clock.

    python -m studies.tta.arms --task rg_gcd --arm default --seed 0 --budget-s 150 --eval-interval-s 50

One JSON per run, `<out>/<task>/<arm>-seed<k>.json`: the settings, accuracy before and at each evaluation (greedy,
the task's first 50 held-out prompts, covrl's HF sampler and grader on both sides, clock paused), and per step the
wall and process-CPU seconds, reward mean, the fraction of groups without contrast, the within-group reward
variance, the cut rate (responses that used the whole budget without an end token), the gradient norm and whether
the update was skipped (covrl arms)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from studies.common import TYPED_DEFAULT_SIZES
from studies.tta.tasks import TTA_TASKS, task_overrides

# one factor each against `default`; every value is a dotted override of configs/default.yaml
ARMS: dict[str, dict] = {
    "default": {},
    "grpo_clip": {"algorithm.advantage": "grpo", "algorithm.loss": "ppo_clip"},        # TRL's objective
    "lr1e-5": {"optim.lr": 1e-5},
    "lr5e-5": {"optim.lr": 5e-5},
    "cosine": {"optim.schedule": "cosine", "optim.warmup_rollouts": 32},               # over loop.steps = 30
    "no_skip": {"optim.skip_zero_gradient": False, "algorithm.advantage_options": {}},  # the default before design E
    "cut_penalty": {"task.overlong_reward.buffer": -1},   # set per task: half the budget (see arm_overrides)
    "shape2x8": {"loop.prompts_per_step": 2, "loop.group_size": 8},                    # TRL's group shape
    "trl": {},
}
TRL = {"n_prompts": 2, "group_size": 8, "learning_rate": 1e-5}


def arm_overrides(task: str, arm: str) -> dict:
    """The arm's overrides for `task`: the cut penalty's stretch is half the task's budget (DAPO's soft overlong
    punishment: a cut answer scores -1 below a finished wrong one, a long unfinished one in between)."""
    out = dict(ARMS[arm])
    if "task.overlong_reward.buffer" in out:
        out["task.overlong_reward.buffer"] = TTA_TASKS[task].max_new_tokens // 2
    return out


def run_config(task: str, arm: str, seed: int):
    from covrl.config import load_preset

    return load_preset("default", {**TYPED_DEFAULT_SIZES, **task_overrides(task), **arm_overrides(task, arm), "run.seed": seed,
                                   "run.num_threads": 1, "eval.before": False, "eval.after": False,
                                   "checkpoint.at_end": False, "logging.console": False})


def settings_for(task: str, seed: int, cfg, args):
    from covrl.bench.models import DEFAULT_CACHE
    from covrl.bench.settings import StepSettings

    return StepSettings(model="smollm2", cache_dir=str(DEFAULT_CACHE), threads=1, seed=seed,
                        max_new_tokens=TTA_TASKS[task].max_new_tokens, warmup_steps=0, steps=10_000,
                        eval_interval_s=args.eval_interval_s, eval_prompts=args.eval_prompts, target_accuracy=1.01,
                        budget_s=args.budget_s, stop_at_target=False, task=cfg.task.model_dump(mode="json"),
                        **TRL)


def batch_stats(batch, eos_id, budget: int) -> dict:
    """Cut rate, constant-group fraction and within-group reward variance of a scored batch."""
    lengths = batch.response_mask.sum(1).long().tolist()
    cut = [n >= budget and int(batch.response_ids[i, n - 1]) != eos_id for i, n in enumerate(lengths)]
    groups: dict[int, list[float]] = {}
    for g, r in zip(batch.group_ids.tolist(), batch.rewards.tolist()):
        groups.setdefault(g, []).append(float(r))
    return {"cut_rate": sum(cut) / len(cut), "length_mean": statistics.fmean(lengths),
            "constant_groups": sum(len(set(v)) == 1 for v in groups.values()) / len(groups),
            "reward_var_within": statistics.fmean(statistics.pvariance(v) for v in groups.values())}


def run_covrl(task: str, arm: str, seed: int, args) -> dict:
    import torch

    from covrl.bench.clock import Clock, make_evaluator
    from covrl.experiment import Arm, ArmRunner

    torch.set_num_threads(1)
    cfg = run_config(task, arm, seed)
    settings = settings_for(task, seed, cfg, args)
    run_dir = Path(tempfile.mkdtemp(prefix="covrl-tta-"))
    runner = ArmRunner(Arm(cfg, run_dir))
    torch.set_num_threads(1)
    try:
        run = runner.run
        clock = Clock(settings, make_evaluator(settings, run.model, run.tokenizer, run.task), 10_000)
        before = clock.evaluate()
        steps, evals = [], [{"steps": 0, **before}]
        eos = run.tokenizer.eos_token_id
        while True:
            s = runner.step()
            rec = {"step": s.index, "wall_s": s.wall_s, "cpu_s": s.cpu_s, "gen_s": s.wall_generate_s,
                   "reward_mean": float(s.batch.rewards.mean()),
                   **batch_stats(s.batch, eos, cfg.sampler.max_new_tokens),
                   **{k: float(s.metrics[k]) for k in ("grad_norm", "skipped", "no_signal_step", "lr",
                                                        "zero_variance_groups", "loss") if k in s.metrics}}
            out = clock.after_step(s.cpu_s)   # the clock: process CPU seconds (see run_trl)
            rec["train_clock_s"] = out["train_clock_s"]
            steps.append(rec)
            if "accuracy" in out:
                evals.append({"steps": s.index, "accuracy": out["accuracy"], "eval_s": out["eval_s"],
                              "train_clock_s": out["train_clock_s"]})
            if out["finished"]:
                break
    finally:
        runner.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"accuracy_before": before["accuracy"], "evals": evals, "steps": steps,
            "config": cfg.model_dump(mode="json")}


def _trl_cpu_worker(conn, settings) -> None:
    """covrl's TRL worker with its step timer on process CPU seconds (as the covrl arms' clock): a shared,
    loaded machine then slows both clocks alike instead of charging the load to whichever side met it."""
    import types

    from covrl.bench import trl_side
    from covrl.bench.models import quiet_transformers

    quiet_transformers()
    trl_side.time = types.SimpleNamespace(perf_counter=time.process_time)
    # the batch measures of the covrl arms, from the rewards TRL asks for (its groups are consecutive rows);
    # the cut rate counts completions whose re-tokenised text fills the budget
    last: dict = {}
    build_task = trl_side.build_bench_task

    def build(s, tokenizer):
        task, prompt_ids = build_task(s, tokenizer)
        score = task.score

        def scored(completions, examples, lengths=None):
            out = score(completions, examples, lengths=lengths)
            r, g = list(map(float, out.rewards)), s.group_size
            groups = [r[i:i + g] for i in range(0, len(r), g)]
            n_tok = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions]
            last.update(constant_groups=sum(len(set(x)) == 1 for x in groups) / len(groups),
                        reward_var_within=statistics.fmean(statistics.pvariance(x) for x in groups),
                        cut_rate=sum(n >= s.max_new_tokens for n in n_tok) / len(n_tok))
            return out

        task.score = scored
        return task, prompt_ids

    class StatClock(trl_side.Clock):
        def after_step(self, seconds):
            stats = dict(last)   # the step's batch (the evaluation below scores through the same task)
            return {**super().after_step(seconds), **stats}

    trl_side.build_bench_task, trl_side.Clock = build, StatClock
    try:
        trl_side.trl_worker(conn, settings)
    except BaseException as err:   # report to the parent instead of leaving it waiting
        import traceback

        conn.send({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        raise


def run_trl(task: str, seed: int, args) -> dict:
    import multiprocessing as mp

    from covrl.bench.models import model_dir

    cfg = run_config(task, "default", seed)
    settings = settings_for(task, seed, cfg, args)
    model_dir(settings.model, settings.cache_dir)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_trl_cpu_worker, args=(child, settings), daemon=True)
    proc.start()

    def recv() -> dict:
        while not parent.poll(5.0):
            if not proc.is_alive():
                raise RuntimeError(f"TRL worker exited (code {proc.exitcode})")
        msg = parent.recv()
        if "error" in msg:
            raise RuntimeError(f"TRL worker failed: {msg['error']}\n{msg.get('traceback', '')}")
        return msg

    try:
        ready = recv()
        recs = []
        while True:
            parent.send("go")
            rec = recv()
            recs.append(rec)
            if rec.get("finished"):
                recv()   # "done"
                break
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    steps = [{"step": i + 1, "cpu_s": r["step_time"], "gen_cpu_s": r.get("gen_time"),
              "reward_mean": r["reward_mean"], "length_mean": r["gen_tokens"] / settings.batch_size,
              "train_clock_s": r["train_clock_s"],
              **{k: r[k] for k in ("constant_groups", "reward_var_within", "cut_rate") if k in r}}
             for i, r in enumerate(recs)]
    evals = [{"steps": 0, "accuracy": ready.get("accuracy_before"), "train_clock_s": 0.0}]
    evals += [{"steps": i + 1, "accuracy": r["accuracy"], "train_clock_s": r["train_clock_s"]}
              for i, r in enumerate(recs) if "accuracy" in r]
    return {"accuracy_before": evals[0]["accuracy"], "evals": evals, "steps": steps,
            "settings": {k: v for k, v in vars(settings).items() if k != "task"}}


def summarize(result: dict) -> dict:
    steps = result["steps"]

    def mean(key):
        vals = [s[key] for s in steps if s.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    return {"final_accuracy": result["evals"][-1]["accuracy"], "steps": len(steps),
            "train_clock_s": steps[-1]["train_clock_s"] if steps else 0.0, "mean_step_cpu_s": mean("cpu_s"),
            "reward_mean": mean("reward_mean"), "constant_groups": mean("constant_groups"),
            "cut_rate": mean("cut_rate"), "length_mean": mean("length_mean"), "grad_norm": mean("grad_norm"),
            "skipped_steps": sum(int(s.get("skipped", 0) or s.get("no_signal_step", 0)) for s in steps),
            "reward_var_within": mean("reward_var_within")}


def main(argv: list[str] | None = None) -> int:
    from covrl.bench.common import machine_description
    from covrl.train import git_state

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, choices=list(TTA_TASKS))
    parser.add_argument("--arm", required=True, choices=list(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=150.0, help="training time: the sum of the steps' process "
                        "CPU seconds (one thread), evaluations excluded")
    parser.add_argument("--eval-interval-s", type=float, default=50.0)
    parser.add_argument("--eval-prompts", type=int, default=50)
    parser.add_argument("--out", default="studies/tta/runs")
    args = parser.parse_args(argv)
    path = Path(args.out) / args.task / f"{args.arm}-seed{args.seed}.json"
    if path.exists():
        print(f"{path} exists, skipped", file=sys.stderr)
        return 0
    t0, load_before = time.time(), os.getloadavg()
    result = run_trl(args.task, args.seed, args) if args.arm == "trl" else run_covrl(args.task, args.arm,
                                                                                      args.seed, args)
    payload = {"name": "tta", "task": args.task, "arm": args.arm, "seed": args.seed,
               "arm_overrides": arm_overrides(args.task, args.arm), "task_overrides": task_overrides(args.task),
               "budget_s": args.budget_s, "eval_interval_s": args.eval_interval_s, "eval_prompts": args.eval_prompts,
               "summary": summarize(result), **result, "wall_s": time.time() - t0, "load_before": load_before,
               "load_after": os.getloadavg(), "source": git_state(), "machine": machine_description()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)
    s = payload["summary"]
    print(f"{args.task} {args.arm} seed {args.seed}: {result['accuracy_before']:.0%} -> {s['final_accuracy']:.0%} "
          f"in {s['steps']} steps, {s['train_clock_s']:.0f} s train clock, constant groups {s['constant_groups']}, "
          f"cut {s['cut_rate']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
