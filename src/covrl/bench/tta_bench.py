"""`covrl bench tta`: time to accuracy of covrl's default run against TRL's GRPOTrainer, per suite task and seed,
at equal training time.

Per task and seed, first covrl's sampler probe (covrl.train.run.sizing.probe_record, nothing trained): what
`auto` would choose for sampler.max_new_tokens, loop.group_size and loop.prompts_per_step. Then three arms, each
in its own process, stepped alternately (one step each in turn, the order rotated every round, so load on a
shared machine hits every arm alike) until each has spent `--budget-s` seconds of training time:

    covrl      configs/default.yaml + the task: sampler.max_new_tokens, loop.group_size and
               loop.prompts_per_step auto (the default), the run's own probe counted on its clock; `--fixed`: the
               task's budget from covrl.bench.tta_suite and 4 prompts x 4 instead
    trl        TRL's GRPOTrainer as a fixed configuration: 2 prompts x 8 completions, the probe's
               max_new_tokens, lr 1e-5 constant, token-mean clipped loss (clip 0.2 / 0.28), no KL, one update
               per batch (covrl.bench.trl_side.grpo_config)
    trl_sized  the same with covrl's chosen sizes (prompts x group and budget from the probe); where the probe
               chose 2 x 8 this is the `trl` run itself, so it is not run twice (its result says `same_as: trl`)

Training time is the wall seconds of the steps (generation, reward, update, sync), evaluations excluded. One
evaluator for every arm: covrl's HF sampler, greedy, the task's first `--eval-prompts` held-out prompts, at the
probe's max_new_tokens, before training, every `--eval-interval-s` of training time and at the budget.

Results (never tracked files unless --update-baseline): runs/bench/tta-<model>[-fixed][-quick]/<cpu>.json, the
table <cpu>.md and the accuracy curves <cpu>.png."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from covrl.bench.common import add_output_options, load1, output_dir, rss_peak_mb, write_bench
from covrl.bench.models import DEFAULT_CACHE
from covrl.bench.settings import StepSettings, default_task_overrides
from covrl.bench.tta_suite import TASKS, materialise

ARMS = ("covrl", "trl", "trl_sized")
TRL_FIXED = {"n_prompts": 2, "group_size": 8, "learning_rate": 1e-5}   # the `trl` arm, whatever the probe says
AUTO_SIZES = {"sampler.max_new_tokens": "auto", "loop.group_size": "auto", "loop.prompts_per_step": "auto"}
FIXED_SHAPE = {"loop.prompts_per_step": 4, "loop.group_size": 4}   # --fixed: the sizes of the default before auto
# --quick: the tiny model, one task, a small probe and a few seconds per arm (a smoke test, not a measurement)
QUICK_SIZING = {"sizing.probe_prompts": 4, "sizing.probe_samples": 2, "sizing.probe_max_new_tokens": 8}
QUICK_TRL_STEPS = 200
TRL_STEPS = 5000   # an upper bound on TRL's planned steps (its dataset is built for them); the clock stops first


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: " + ", ".join(TASKS))
    parser.add_argument("--seeds", default="0", help="comma-separated run seeds")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    parser.add_argument("--fixed", action="store_true", help="covrl's arm at the task's budget of the suite and "
                        "4 prompts x 4, instead of the default's sizes from its own probe (auto)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="training seconds per arm, task and seed")
    parser.add_argument("--eval-interval-s", type=float, default=None, help="evaluate every this many training "
                        "seconds (default: half the budget)")
    parser.add_argument("--eval-prompts", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per arm")
    parser.add_argument("--cache-dir", default=None, help="model folder cache (default runs/cache)")
    add_output_options(parser)   # --out, --update-baseline (covrl.bench.common)
    parser.add_argument("--set", dest="covrl_set", action="append", default=[], metavar="KEY=VALUE",
                        help="a dotted override of covrl's arm (configs/default.yaml), e.g. "
                             "--set selection.strategy=skip_constant; repeatable. The probe that sizes the TRL arms "
                             "and the evaluations stays the default's")
    parser.add_argument("--quick", action="store_true", help="tiny model, one-digit addition, 2 s per arm (tests)")


# ------------------------------------------------------------------------------------------- configs


def arm_config(model: str, cache_dir: str, task_overrides: dict, budget: int, seed: int, threads: int,
               auto: bool, extra: dict | None = None):
    """covrl's run of the bench: configs/default.yaml + the task with auto sizes (or its budget and 4 x 4) on the
    cached model folder TRL loads too, evaluations, checkpoints and console off."""
    from covrl.bench.models import model_dir
    from covrl.config import load_preset

    overrides = {**task_overrides, "sampler.max_new_tokens": budget,
                 "model.source": "hf", "model.path": str(model_dir(model, cache_dir)),
                 **{f"task.{k}": v for k, v in default_task_overrides(model).items()},
                 "run.seed": seed, "run.num_threads": threads, "eval.before": False, "eval.after": False,
                 "checkpoint.at_end": False, "logging.console": False, "logging.curves": False,
                 **(AUTO_SIZES if auto else FIXED_SHAPE), **(extra or {})}
    return load_preset("default", overrides)


def covrl_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """`--set KEY=VALUE` items as {dotted key: YAML-parsed value} (a malformed item names itself)."""
    from covrl.settings.io import parse_overrides

    return {".".join(path): value for path, value, _ in parse_overrides(getattr(args, "covrl_set", []) or [])}


def probe_sizes(cfg) -> dict[str, Any]:
    """covrl's sampler probe and sizing rule on `cfg` (with the three fields auto): the record of sizing.json
    with the resolved sizes under `config`. Nothing is trained or written."""
    from covrl.rollout import build_sampler
    from covrl.train.run.components import build_components
    from covrl.train.run.sizing import AUTO_FIELDS, probe_record, resolve_config

    c = build_components(cfg)
    try:
        c.warm_up()
        record, decision = probe_record(cfg, c, build_sampler)
    finally:
        c.task.close()
    resolved = resolve_config(cfg, decision.resolved)
    record["config"] = {f"{s}.{f}": getattr(getattr(resolved, s), f) for s, f in AUTO_FIELDS}
    return record


def eval_settings(model: str, cache_dir: str, threads: int, seed: int, eval_tokens: int, args, task: dict,
                  **trl) -> StepSettings:
    """The clock and evaluator every arm shares (and, for a TRL arm, its GRPO step)."""
    return StepSettings(model=model, cache_dir=cache_dir, threads=threads, seed=seed, max_new_tokens=eval_tokens,
                        warmup_steps=0, steps=QUICK_TRL_STEPS if args.quick else TRL_STEPS,
                        eval_interval_s=args.eval_interval_s, eval_prompts=args.eval_prompts,
                        target_accuracy=1.01, budget_s=args.budget_s, stop_at_target=False, task=task, **trl)


# ------------------------------------------------------------------------------------------- workers


def covrl_tta_worker(conn, cfg, settings: StepSettings) -> None:
    """Child process: covrl's run of `cfg`, one step per 'go'; an `auto` run's probe seconds start its clock."""
    import torch

    from covrl.bench.clock import Clock, make_evaluator
    from covrl.bench.covrl_side import make_covrl_stepper, serve_steps
    from covrl.experiment import Arm, ArmRunner

    torch.set_num_threads(settings.threads)
    run_dir = Path(tempfile.mkdtemp(prefix="covrl-bench-tta-"))
    runner = ArmRunner(Arm(cfg, run_dir))
    try:
        run = runner.run
        torch.set_num_threads(settings.threads)
        stepper = make_covrl_stepper(runner)
        clock = Clock(settings, make_evaluator(settings, run.model, run.tokenizer, run.task), settings.steps)
        probe_s = float((run.sizing or {}).get("time/probe_s", 0.0))
        clock.train_s = probe_s + float(run.sft_metrics.get("sft/seconds", 0.0))
        sizes = {"prompts_per_step": run.cfg.loop.prompts_per_step, "group_size": run.cfg.loop.group_size,
                 "max_new_tokens": run.cfg.sampler.max_new_tokens}
        conn.send({"ready": True, "accuracy_before": clock.evaluate()["accuracy"], "probe_s": probe_s,
                   "sizes": sizes, "rss_peak_mb": rss_peak_mb()})
        serve_steps(conn, stepper, clock)
    finally:
        runner.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    conn.send({"done": True})


def trl_tta_worker(conn, settings: StepSettings) -> None:
    from covrl.bench.trl_side import trl_worker

    trl_worker(conn, settings)


def _entry(kind: str, conn, *payload) -> None:
    try:
        from covrl.bench.models import quiet_transformers

        quiet_transformers()
        {"covrl": covrl_tta_worker, "trl": trl_tta_worker}[kind](conn, *payload)
    except BaseException as err:  # report to the parent instead of leaving it waiting
        import traceback

        conn.send({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        raise


def run_arms(specs: dict[str, tuple], timeout_s: float = 3600.0, progress=None) -> dict[str, Any]:
    """Start one worker per arm (`specs`: arm -> (kind, *payload)), each once the one before is ready, and step
    them in turn, the order rotated every round, until each reports `finished`. Returns each arm's ready message and step records."""
    from covrl.bench.alternate import _recv, join_workers, worker_context

    ctx = worker_context()
    procs, conns, ready = {}, {}, {}
    records: dict[str, list[dict]] = {arm: [] for arm in specs}
    try:
        # one arm starts at a time: a covrl arm's probe is on its clock, so it runs beside no other arm's set-up
        for arm, (kind, *payload) in specs.items():
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_entry, args=(kind, child_conn, *payload), daemon=True)
            proc.start()
            procs[arm], conns[arm] = proc, parent_conn
            ready[arm] = _recv(conns[arm], arm, timeout_s, procs[arm])
        active, rnd = list(specs), 0
        while active:
            k = rnd % len(active)
            for arm in active[k:] + active[:k]:
                conns[arm].send("go")
                rec = _recv(conns[arm], arm, timeout_s, procs[arm])
                rec["load1"] = load1()
                records[arm].append(rec)
                if progress is not None:
                    acc = f", accuracy {rec['accuracy']:.0%}" if "accuracy" in rec else ""
                    progress(f"{arm} step {len(records[arm])}: {rec['step_time']:.2f} s, clock "
                             f"{rec['train_clock_s']:.0f} s{acc}")
                if rec.get("finished"):
                    _recv(conns[arm], arm, timeout_s, procs[arm])   # "done"
                    active.remove(arm)
            rnd += 1
    finally:
        join_workers(procs)
    return {"ready": ready, "records": records}


# ------------------------------------------------------------------------------------------- one task


def arm_summary(ready: dict, records: list[dict]) -> dict[str, Any]:
    evals = [{"train_clock_s": 0.0 if "probe_s" not in ready else ready["probe_s"],
              "accuracy": ready.get("accuracy_before")}]
    evals += [{"train_clock_s": r["train_clock_s"], "accuracy": r["accuracy"]} for r in records if "accuracy" in r]
    constant = [r["constant_groups"] for r in records if isinstance(r.get("constant_groups"), float)]
    solved = [r["solved_groups"] for r in records if isinstance(r.get("solved_groups"), float)]
    return {"accuracy_before": ready.get("accuracy_before"), "final_accuracy": evals[-1]["accuracy"],
            "evals": evals, "steps": len(records),
            "train_clock_s": records[-1]["train_clock_s"] if records else 0.0,
            "mean_step_s": sum(r["step_time"] for r in records) / max(len(records), 1),
            "reward_mean": sum(r["reward_mean"] for r in records) / max(len(records), 1),
            "constant_groups": sum(constant) / len(constant) if constant else None,
            "solved_groups": sum(solved) / len(solved) if solved else None,
            "gen_tokens_per_step": sum(r["gen_tokens"] for r in records) / max(len(records), 1),
            "load1_mean": sum(r["load1"] for r in records) / max(len(records), 1)}


def run_task(name: str, seed: int, args, arms: tuple[str, ...], data_dir: Path, progress) -> dict[str, Any]:
    model, cache_dir, threads = args.model, str(args.cache_dir or DEFAULT_CACHE), args.threads
    overrides = materialise(name, data_dir)
    budget = TASKS[name].max_new_tokens
    extra = QUICK_SIZING if args.quick else {}
    if args.quick:
        budget = 4
    probe_cfg = arm_config(model, cache_dir, overrides, budget, seed, threads, auto=True, extra=extra)
    import torch

    torch.set_num_threads(threads)
    probe = probe_sizes(probe_cfg)
    sized = probe["config"]
    tokens, group, prompts = (sized["sampler.max_new_tokens"], sized["loop.group_size"],
                              sized["loop.prompts_per_step"])
    progress(f"{name} seed {seed}: probe {probe['time/probe_s']:.0f} s -> max_new_tokens {tokens}, "
             f"{prompts} x {group}; warnings: {'; '.join(probe['warnings']) or 'none'}")
    task_dump = probe_cfg.task.model_dump(mode="json")
    specs: dict[str, tuple] = {}
    shapes: dict[str, dict] = {}
    if "covrl" in arms:
        cfg = arm_config(model, cache_dir, overrides, budget, seed, threads, auto=not args.fixed,
                         extra={**extra, **covrl_overrides(args)})
        specs["covrl"] = ("covrl", cfg, eval_settings(model, cache_dir, threads, seed, tokens, args, task_dump))
        shapes["covrl"] = ({"prompts": "auto", "group": "auto", "max_new_tokens": "auto"} if not args.fixed else
                           {"prompts": cfg.loop.prompts_per_step, "group": cfg.loop.group_size,
                            "max_new_tokens": budget})
    trl_shapes = {"trl": {**TRL_FIXED}, "trl_sized": {"n_prompts": prompts, "group_size": group,
                                                      "learning_rate": TRL_FIXED["learning_rate"]}}
    # the probe chose TRL's own shape: trl_sized would be the trl run again (the same settings and seed; the
    # two differ only in where the clock stops, a step more or less), so it reports trl's result, marked `same_as`
    same = "trl" in arms and trl_shapes["trl_sized"] == trl_shapes["trl"]
    for arm, trl in trl_shapes.items():
        if arm in arms and not (same and arm == "trl_sized"):
            specs[arm] = ("trl", eval_settings(model, cache_dir, threads, seed, tokens, args, task_dump, **trl))
            shapes[arm] = {"prompts": trl["n_prompts"], "group": trl["group_size"], "max_new_tokens": tokens}
    from covrl.bench.models import model_dir

    model_dir(model, cache_dir)   # written once, before the workers race for it
    out = run_arms(specs, progress=progress)
    result = {"task": name, "seed": seed, "description": TASKS[name].description, "eval_max_new_tokens": tokens,
              "probe": {k: probe[k] for k in ("config", "evidence", "predicted_failing", "warnings",
                                              "time/probe_s", "time/probe_cpu_s")},
              "arms": {}}
    for arm in specs:
        summary = arm_summary(out["ready"][arm], out["records"][arm])
        if arm == "covrl" and not args.fixed:
            sizes = out["ready"][arm]["sizes"]
            shapes[arm] = {"prompts": sizes["prompts_per_step"], "group": sizes["group_size"],
                           "max_new_tokens": sizes["max_new_tokens"], "probe_s": out["ready"][arm]["probe_s"]}
        result["arms"][arm] = {"shape": shapes[arm], **summary, "records": out["records"][arm]}
    if same and "trl_sized" in arms:
        result["arms"]["trl_sized"] = {**result["arms"]["trl"], "same_as": "trl"}
    return result


# ------------------------------------------------------------------------------------------- output


def table(results: list[dict], args) -> str:
    rows = ["| task | seed | probe: tokens, prompts x G (s) | arm | prompts x G, tokens | before | evaluations "
            "(train s: greedy) | final | steps | s / step | constant groups (solved) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        p = r["probe"]["config"]
        probe = (f"{p['sampler.max_new_tokens']}, {p['loop.prompts_per_step']} x {p['loop.group_size']} "
                 f"({r['probe']['time/probe_s']:.0f} s)")
        for arm, a in r["arms"].items():
            s = a["shape"]
            evals = ", ".join(f"{e['train_clock_s']:.0f}: {e['accuracy']:.0%}" for e in a["evals"][1:])
            constant = "-" if a["constant_groups"] is None else f"{a['constant_groups']:.0%}"
            if a.get("solved_groups") is not None:
                constant += f" ({a['solved_groups']:.0%})"
            rows.append(f"| {r['task']} | {r['seed']} | {probe} | {arm} | {s['prompts']} x {s['group']}, "
                        f"{s['max_new_tokens']} | {a['accuracy_before']:.0%} | {evals} | "
                        f"**{a['final_accuracy']:.0%}** | {a['steps']} | {a['mean_step_s']:.1f} | {constant} |")
    covrl = "covrl: configs/default.yaml + the task" + (" at its budget, 4 x 4" if args.fixed
                                                          else " with auto sizes (its probe on its clock)")
    if getattr(args, "covrl_set", None):
        covrl += ", with " + " ".join(args.covrl_set)
    return ("\n".join(rows) + f"\n\n{covrl}; trl: TRL GRPOTrainer 2 x 8, the probe's budget, lr 1e-5; trl_sized: "
            f"TRL with the probe's sizes. Model {args.model}, {args.threads} thread(s) per arm, {args.budget_s:.0f} s "
            f"of training (wall, steps only) per arm; greedy on {args.eval_prompts} held-out prompts at the probe's "
            f"budget, every {args.eval_interval_s:.0f} s. Arms step in turn (the order rotated each round).\n")


def plot(results: list[dict], path: Path) -> Path | None:
    """Greedy held-out accuracy against training seconds, one panel per task, one line per arm and seed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:   # the plot is optional: the table and JSON are the result
        return None
    tasks = list(dict.fromkeys(r["task"] for r in results))
    cols = min(4, len(tasks))
    rows = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    colours = {"covrl": "C0", "trl": "C1", "trl_sized": "C2"}
    for ax, task in zip(axes.flat, tasks):
        for r in (r for r in results if r["task"] == task):
            for arm, a in r["arms"].items():
                xs = [e["train_clock_s"] for e in a["evals"]]
                ys = [100 * e["accuracy"] for e in a["evals"]]
                ax.plot(xs, ys, marker="o", color=colours.get(arm), label=f"{arm} s{r['seed']}")
        ax.set_title(task)
        ax.set_xlabel("training seconds")
        ax.set_ylabel("greedy held-out %")
        ax.set_ylim(-2, 102)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.model, args.tasks, args.seeds, args.budget_s, args.eval_prompts = "tiny", "add1", "0", 2.0, 8
        args.eval_interval_s = args.budget_s   # one evaluation before and one at the budget
    if args.eval_interval_s is None:
        args.eval_interval_s = args.budget_s / 2
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    unknown = sorted(set(tasks) - set(TASKS)) + sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"--tasks / --arms: unknown {unknown}; tasks: {', '.join(TASKS)}; arms: {', '.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    load_before = os.getloadavg()
    data_dir = Path(tempfile.mkdtemp(prefix="covrl-bench-tta-data-"))
    t0 = time.perf_counter()
    try:
        results = [run_task(task, seed, args, arms, data_dir, _progress) for task in tasks for seed in seeds]
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    from covrl.train import git_state

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    payload = {"source": git_state(), "settings": settings, "trl_fixed": TRL_FIXED, "tasks": results,
               "load_before": load_before, "load_after": os.getloadavg(), "wall_s": time.perf_counter() - t0}
    name = f"tta-{args.model}" + ("-fixed" if args.fixed else "") + ("-quick" if args.quick else "")
    finals = {arm: sum(r["arms"][arm]["final_accuracy"] for r in results) / len(results) for arm in arms}
    headline = (f"mean final greedy over {len(results)} task x seed, {args.budget_s:.0f} s each: "
                + ", ".join(f"{arm} {v:.0%}" for arm, v in finals.items()))
    path = write_bench(name, payload, table(results, args), output_dir(args), headline=headline)
    png = plot(results, path.with_suffix(".png"))
    if png is not None:
        print(f"plot: {png}")
    return 0
