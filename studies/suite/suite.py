"""`python -m studies suite`: covrl's default run vs TRL's GRPO on tasks the defaults were not chosen on
(`studies.suite.suite_tasks`), several seeds per side, equal training time, one evaluator.

For each task x seed the time-to-accuracy machinery (`studies.time_to_accuracy.time_to_accuracy`) runs the missing sides
alternately: covrl on configs/default.yaml with only the task section overridden (and `run.seed`), TRL on the
same task section at its `--trl-*` settings. Each side trains for the whole `--budget-s` of training time (it
does not stop at the target, so final accuracies are at equal training time) and is evaluated greedily on the
same held-out prompts every `--eval-interval-s`. Held-out prompts are the task's, fixed across seeds (`task.seed`
stays 0); the seed varies the training (sampling, TRL's init of its RNG).

One JSON per (task, seed, side), `<out>/<task>-seed<k>-<side>.json`, is written as soon as that pair finishes;
one already there is skipped, so a killed run resumes and partial results count. `<out>/suite.md` is the
summary table, rewritten after every pair from the JSONs present."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

from studies.common import TYPED_DEFAULT_SIZES
from studies.suite.suite_tasks import DEFAULT_TASKS, SUITE_TASKS
from studies.time_to_accuracy.time_to_accuracy import (
    add_side_options,
    quick_config,
    set_quick,
    side_result,
    side_settings,
)

from covrl.bench.alternate import run_alternating
from covrl.bench.common import machine_description
from covrl.bench.models import DEFAULT_CACHE, model_dir
from covrl.config import dump_config, load_config, load_preset
from covrl.train import git_state

SIDES = ("covrl", "trl")
QUICK_TASKS = "mul1,count_letters"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="suite tasks, comma-separated (default "
                        "the default suite); known: " + ", ".join(SUITE_TASKS))
    parser.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated (run.seed of both sides)")
    parser.add_argument("--sides", default="covrl,trl")
    add_side_options(parser)
    parser.add_argument("--budget-s", type=float, default=180.0, help="training time per side and run")
    parser.add_argument("--eval-interval-s", type=float, default=20.0, help="training time between evaluations")
    parser.add_argument("--stop-at-target", action="store_true", help="stop a side at the target instead of "
                        "training to the budget (faster; final accuracy is then the one at the target)")
    parser.add_argument("--out", default="runs/studies/suite", help="folder for the per-run JSONs + suite.md")
    parser.add_argument("--covrl-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override the covrl side's config after the task (repeatable): a candidate default, "
                        "e.g. loop.dynamic_sampling=true; stored in each run's key and named in suite.md")
    parser.add_argument("--quick", action="store_true", help=f"tiny model, configs/tiny.yaml, two steps per side, "
                        f"tasks {QUICK_TASKS} unless --tasks is given (tests)")


def _list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def result_path(out: Path, task: str, seed: int, side: str) -> Path:
    return out / f"{task}-seed{seed}-{side}.json"


def covrl_set_overrides(items: list[str]) -> dict[str, str]:
    """--covrl-set's `key=value` strings as load_config overrides (values parsed there, as on the command line)."""
    bad = [item for item in items if "=" not in item or not item.split("=", 1)[0].strip()]
    if bad:
        raise ValueError(f"--covrl-set {bad[0]!r}: expected SECTION.KEY=VALUE")
    return dict(item.split("=", 1) for item in items)


def task_config(task: str, seed: int, quick: bool, cache: str, covrl_set: tuple[str, ...] = ()):
    """The covrl side's run: configs/default.yaml (--quick: the tiny quick config) with the task's overrides,
    run.seed = seed and `covrl_set` (--covrl-set); nothing else changed."""
    overrides = {**SUITE_TASKS[task].overrides, "run.seed": seed, **covrl_set_overrides(list(covrl_set))}
    if quick:
        return quick_config(str(model_dir("tiny", cache)), overrides)
    return load_preset("default", {**TYPED_DEFAULT_SIZES, **overrides})


def run_key(args: argparse.Namespace, task: str, side: str) -> dict:
    """What makes a stored run comparable with this invocation's: a resumed suite with other settings would mix
    incomparable runs in one table, so it is refused instead."""
    keys = ("quick", "target", "budget_s", "eval_interval_s", "stop_at_target", "eval_prompts", "max_new_tokens",
            "threads", "trl_prompts", "trl_group_size", "trl_lr")
    key = {"task_overrides": SUITE_TASKS[task].overrides, **{k: getattr(args, k) for k in keys}}
    if args.covrl_set and side == "covrl":   # absent when empty: runs stored before the option stay comparable
        key["covrl_set"] = list(args.covrl_set)
    return portable_key(key)


_STUDY_PATH = re.compile(r"^.*/studies/(?=suite/)")


def portable_key(key: dict) -> dict:
    """`key` with paths into the studies folder written as `<studies>/...`: the same file in another checkout
    (another clone, a pinned worktree) is the same run setting."""
    def fix(value):
        if isinstance(value, str):
            return _STUDY_PATH.sub("<studies>/", value)
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value
    return fix(key)


def _write_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")   # renamed when complete: a killed write is not skipped later
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    os.replace(tmp, path)


def run_pair(args: argparse.Namespace, task: str, seed: int, sides: list[str], out: Path) -> list[Path]:
    """Run `sides` of (task, seed) alternately and write one JSON per side."""
    cache = str(args.cache_dir or DEFAULT_CACHE)
    cfg = task_config(task, seed, args.quick, cache, tuple(args.covrl_set))
    config_path = out / "configs" / f"{task}-seed{seed}.yaml"   # kept: the record of what covrl ran
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(dump_config(cfg))
    cfg = load_config(config_path)
    per_side = side_settings(args, cfg, str(config_path), stop_at_target=args.stop_at_target)
    load_before = os.getloadavg()
    timing = run_alternating({s: per_side[s] for s in sides}, tuple(sides), timeout_s=7200.0,
                             progress=lambda text: print(f"[{task} seed {seed}] {text}", file=sys.stderr, flush=True))
    paths = []
    for side in sides:
        payload = {"name": "suite", "task": task, "seed": seed, "side": side, "run_key": run_key(args, task, side),
                   "task_overrides": SUITE_TASKS[task].overrides, "quick": args.quick,
                   "target": args.target, "budget_s": args.budget_s, "eval_interval_s": args.eval_interval_s,
                   "stop_at_target": args.stop_at_target, "settings": vars(per_side[side]),
                   "covrl_config": cfg.model_dump(mode="json") if side == "covrl" else None,
                   "result": side_result(timing, side, per_side[side], cfg),
                   "load_before": load_before, "load_after": os.getloadavg(),
                   "source": git_state(), "machine": machine_description()}
        path = result_path(out, task, seed, side)
        _write_json(path, payload)
        paths.append(path)
    return paths


# ---------------------------------------------------------------- summary (pure: from the JSON payloads)


def median_time(times: list[float | None]) -> float | None:
    """Median time to target with not-reached runs (None) censored above every reached one; None when the
    median falls on a censored run (the median side did not reach the target)."""
    if not times:
        return None
    keyed = sorted(times, key=lambda t: (t is None, t or 0.0))
    mid = len(keyed) // 2
    middle = keyed[mid - 1: mid + 1] if len(keyed) % 2 == 0 else [keyed[mid]]
    return None if any(t is None for t in middle) else statistics.fmean(middle)


def side_summary(payloads: list[dict]) -> dict:
    """One side of one task over its seeds."""
    res = [p["result"] for p in payloads]
    finals = [r["final_accuracy"] for r in res if r["final_accuracy"] is not None]
    befores = [r["accuracy_before"] for r in res if r["accuracy_before"] is not None]
    times = [r["time_to_target_s"] if r["reached"] else None for r in res]
    return {
        "seeds": sorted(p["seed"] for p in payloads), "runs": len(res),
        "accuracy_before": statistics.median(befores) if befores else None,
        "final_min": min(finals) if finals else None, "final_median": statistics.median(finals) if finals else None,
        "final_max": max(finals) if finals else None, "reached": sum(t is not None for t in times),
        "median_time_to_target_s": median_time(times),
        "train_clock_s": max((r["train_clock_s"] for r in res), default=0.0),
    }


def task_summary(payloads: list[dict]) -> dict:
    """Each side's summary and the covrl/TRL ratios: of median time to target where both medians reached it,
    and of median final accuracies."""
    sides = {side: side_summary([p for p in payloads if p["side"] == side])
             for side in SIDES if any(p["side"] == side for p in payloads)}
    out: dict = {"sides": sides}
    if "covrl" in sides and "trl" in sides:
        c, t = sides["covrl"], sides["trl"]
        tc, tt = c["median_time_to_target_s"], t["median_time_to_target_s"]
        out["time_ratio"] = tc / tt if tc is not None and tt is not None and tt > 0 else None
        # TRL's median censored, covrl's reached: covrl/TRL is below covrl's time over TRL's training time
        out["time_ratio_upper_bound"] = (tc / t["train_clock_s"] if tc is not None and tt is None
                                         and t["train_clock_s"] > 0 else None)
        fc, ft = c["final_median"], t["final_median"]
        out["final_ratio"] = fc / ft if fc is not None and ft else None
        out["covrl_final_ge_trl"] = fc is not None and ft is not None and fc >= ft
    return out


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def summary_table(payloads: list[dict], target: float, budget_s: float) -> tuple[dict, str]:
    tasks = list(dict.fromkeys(p["task"] for p in payloads))
    summaries, lines = {}, []
    for task in tasks:
        s = summaries[task] = task_summary([p for p in payloads if p["task"] == task])
        lines += [f"### {task}", "", SUITE_TASKS[task].description if task in SUITE_TASKS else "", "",
                  f"| side | seeds | accuracy before | final min / median / max | reached {target:.0%} | "
                  f"median time to {target:.0%} s | longest training s |", "|---|---|---|---|---|---|---|"]
        for side, v in s["sides"].items():
            when = (f"{v['median_time_to_target_s']:.0f}" if v["median_time_to_target_s"] is not None
                    else f"> {budget_s:g}")
            lines.append(f"| {side} | {','.join(map(str, v['seeds']))} | {_pct(v['accuracy_before'])} | "
                         f"{_pct(v['final_min'])} / {_pct(v['final_median'])} / {_pct(v['final_max'])} | "
                         f"{v['reached']}/{v['runs']} | {when} | {v['train_clock_s']:.0f} |")
        if "time_ratio" in s:
            ratio = (f"{s['time_ratio']:.2f}" if s["time_ratio"] is not None else
                     f"< {s['time_ratio_upper_bound']:.2f}" if s["time_ratio_upper_bound"] is not None else "n/a")
            final = f"{s['final_ratio']:.2f}" if s["final_ratio"] is not None else "n/a"
            lines += ["", f"covrl/TRL median time to {target:.0%}: **{ratio}** (goal <= 0.15); median final "
                      f"accuracy covrl/TRL: **{final}** (goal >= 1)."]
        lines.append("")
    return summaries, "\n".join(lines)


def load_payloads(out: Path, tasks: list[str], seeds: list[int], sides: list[str]) -> list[dict]:
    return [json.loads(p.read_text()) for task in tasks for seed in seeds for side in sides
            if (p := result_path(out, task, seed, side)).exists()]


def run(args: argparse.Namespace) -> int:
    if args.quick:
        if args.tasks == ",".join(DEFAULT_TASKS):
            args.tasks = QUICK_TASKS
        set_quick(args)
    tasks, seeds, sides = _list(args.tasks), [int(s) for s in _list(args.seeds)], _list(args.sides)
    unknown = [t for t in tasks if t not in SUITE_TASKS] + [s for s in sides if s not in SIDES]
    if unknown:
        print(f"unknown task/side {unknown}; tasks: {', '.join(SUITE_TASKS)}; sides: {', '.join(SIDES)}",
              file=sys.stderr)
        return 2
    if args.covrl_set and tasks:   # a bad override stops here, before any model loads, naming the key
        try:
            task_config(tasks[0], 0, args.quick, str(args.cache_dir or DEFAULT_CACHE), tuple(args.covrl_set))
        except ValueError as err:   # covrl's ConfigError is one
            print(f"python -m studies suite: {err}", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:   # every stored run must have been made with these settings (before any new run)
        for path, side in ((result_path(out, task, seed, side), side) for seed in seeds for side in sides):
            stored = portable_key(json.loads(path.read_text())["run_key"]) if path.exists() \
                else run_key(args, task, side)
            if stored != (key := run_key(args, task, side)):
                diff = {k: (stored.get(k), v) for k, v in key.items() if stored.get(k) != v}
                print(f"{path} was made with other settings {diff} (stored, now); use another --out",
                      file=sys.stderr)
                return 2
    for task in tasks:
        for seed in seeds:
            missing = [s for s in sides if not result_path(out, task, seed, s).exists()]
            if not missing:
                print(f"[{task} seed {seed}] done already, skipped", file=sys.stderr, flush=True)
                continue
            run_pair(args, task, seed, missing, out)
            write_summary(out, tasks, seeds, sides, args, echo=False)
    write_summary(out, tasks, seeds, sides, args)
    return 0


def write_summary(out: Path, tasks: list[str], seeds: list[int], sides: list[str], args, echo: bool = True) -> Path:
    payloads = load_payloads(out, tasks, seeds, sides)
    summaries, table = summary_table(payloads, args.target, args.budget_s)
    head = (f"# suite{' (quick)' if args.quick else ''}\n\nTarget {args.target:.0%} greedy accuracy on "
            f"{args.eval_prompts} held-out prompts, evaluated every {args.eval_interval_s:g} s of training "
            f"time, budget {args.budget_s:g} s per side and run, {args.threads} thread(s) each; TRL "
            f"{args.trl_prompts} x {args.trl_group_size}, lr {args.trl_lr:g}; covrl configs/default.yaml + "
            f"the task{' + ' + ', '.join(args.covrl_set) if args.covrl_set else ''}. {len(payloads)} runs "
            f"present.\n\n")
    (out / "suite.md").write_text(head + table)
    (out / "suite-summary.json").write_text(json.dumps(summaries, indent=2))
    if echo:
        print(table)
    return out / "suite.md"

