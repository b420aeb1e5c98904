"""What `auto` sizing would choose on each task of the suite, and what its probe costs: for each task of
studies/tta/tasks.py, configs/default.yaml + the task's overrides with `sampler.max_new_tokens`,
`loop.group_size` and `loop.prompts_per_step` set to `auto`, the sampler probe and the rule of
covrl.train.run.sizing (`probe_record`), nothing trained. Per task: the chosen sizes, the evidence (lengths to
EOS, cut rate at the probe's cap, pass rates, predicted constant fraction per G), the warnings and the probe's wall
and process-CPU seconds. `add1` is the default run's own task (one-digit addition), for the probe's cost next to a
default 30-step run. Tasks that `auto` refuses (multi-turn, verifiers) are recorded with the refusal.

    nice -n 10 python -m studies.tta.sizing_probe --out studies/tta/sizing_probe.json
    python -m studies.tta.sizing_probe --tasks add1,mul1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

from studies.tta.tasks import TTA_TASKS

AUTO_SIZES = {"sampler.max_new_tokens": "auto", "loop.group_size": "auto", "loop.prompts_per_step": "auto"}
DEFAULT_TASK = "add1"   # configs/default.yaml's own task, no overrides


def suite_task(name: str):
    """The task of studies/tta/tasks.py, else of `covrl bench tta`'s suite (covrl.bench.tta_suite: the tasks
    added for design E)."""
    from covrl.bench.tta_suite import TASKS

    return TTA_TASKS[name] if name in TTA_TASKS else TASKS[name]


def sizing_config(name: str, extra: dict | None = None):
    """configs/default.yaml + the task's overrides (not its fixed budget) + auto for the three sized fields."""
    from covrl.config import load_preset

    overrides = {} if name == DEFAULT_TASK else dict(suite_task(name).overrides)
    return load_preset("default", {**overrides, **AUTO_SIZES, "run.num_threads": 1, "logging.console": False,
                                   **(extra or {})})


def probe_one(name: str, extra: dict | None = None) -> dict:
    from covrl.rollout import build_sampler
    from covrl.train.run.components import build_components
    from covrl.train.run.sizing import AUTO_FIELDS, probe_record, resolve_config

    try:
        cfg = sizing_config(name, extra)
    except ValueError as err:   # auto refused (multi-turn, verifiers): recorded, not probed
        return {"refused": str(err).splitlines()[-1] if str(err) else repr(err)}
    c = build_components(cfg)
    c.warm_up()
    try:
        record, _ = probe_record(cfg, c, build_sampler)
    finally:
        c.task.close()
    resolved = resolve_config(cfg, record["resolved"])
    record["config"] = {f"{s}.{f}": getattr(getattr(resolved, s), f) for s, f in AUTO_FIELDS}
    # the budget the suite fixes for the task (16: configs/default.yaml's, for add1)
    record["suite_budget"] = 16 if name == DEFAULT_TASK else suite_task(name).max_new_tokens
    record["former_rule"] = former_rule(record["samples"]["rewards"], cfg.sizing)
    record["prompts_with_a_correct_sample"] = 1 - record["evidence"]["prompts_all_wrong"] / record["evidence"][
        "prompts"]
    return record


def former_rule(rewards: list[list[float]], scfg) -> dict:
    """The group size of the rule before the pooled prior (commit f4d1d6e): each prompt under `sizing.prior` itself, the
    smallest G whose prediction meets the target, else the minimiser; the same samples."""
    from covrl.train.run.sizing import prompt_constant_probability, rewards_are_binary

    binary = rewards_are_binary(rewards)
    allowed = [g for g in scfg.group_sizes if g <= scfg.rollouts_per_step]
    predicted = {g: sum(prompt_constant_probability(r, g, tuple(scfg.prior), binary) for r in rewards) / len(rewards)
                 for g in allowed}
    group = next((g for g in allowed if predicted[g] <= scfg.constant_target),
                 min(allowed, key=lambda g: (predicted[g], -g)))
    return {"loop.group_size": group, "loop.prompts_per_step": max(1, scfg.rollouts_per_step // group),
            "predicted_constant": {str(g): p for g, p in predicted.items()}}


def redecide(name: str, record: dict) -> dict:
    """The current rule applied again to the samples `record` holds (no sampling: the probe is seeded, so this is
    what probing again would give): sizes, predictions and warnings replaced, the probe's times kept."""
    from covrl.train.run.sizing import AUTO_FIELDS, ProbeEvidence, decide, resolve_config

    cfg = sizing_config(name)
    samples = record["samples"]
    at = {int(b): v for b, v in samples.get("rewards_at", {}).items()}
    correct_at = {int(b): v for b, v in samples.get("correct_at", {}).items()}
    evidence = ProbeEvidence(lengths=samples["lengths"], cap=record["evidence"]["cap"], rewards=samples["rewards"],
                             correct=samples["correct"], rewards_at=at, correct_at=correct_at)
    decision = decide(evidence, cfg)
    resolved = resolve_config(cfg, decision.resolved)
    return {**record, "resolved": decision.resolved, "warnings": decision.warnings,
            "predicted_failing": {str(g): p for g, p in decision.predicted_failing.items()},
            "config": {f"{s}.{f}": getattr(getattr(resolved, s), f) for s, f in AUTO_FIELDS}}


def load_avg() -> float:
    return os.getloadavg()[0]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join([DEFAULT_TASK, *TTA_TASKS]))
    parser.add_argument("--out", default=None, help="JSON file; tasks already in it are kept, others replaced")
    parser.add_argument("--redecide", action="store_true", help="apply the current rule to the samples already in "
                        "--out (no sampling) and rewrite it")
    args = parser.parse_args(argv)
    path = Path(args.out) if args.out else None
    results = json.loads(path.read_text()) if path and path.exists() else {}
    if args.redecide:
        if path is None:
            parser.error("--redecide needs --out")
        for name, record in results.items():
            if "samples" in record:
                results[name] = redecide(name, record)
        path.write_text(json.dumps(results, indent=2) + "\n")
        return 0
    results.setdefault("_meta", {})
    results["_meta"].update(cpu=cpu_model(), date=datetime.date.today().isoformat(), command="nice -n 10 python -m studies.tta.sizing_probe --out "
                            "studies/tta/sizing_probe.json", model="smollm2 (configs/default.yaml)", threads=1)
    for name in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        before = load_avg()
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        try:
            r = probe_one(name)
        except Exception as err:   # one task failing to build is recorded, the others still run
            r = {"error": f"{type(err).__name__}: {err}"}
        r.update(started_utc=started, load_1min=[round(before, 2), round(load_avg(), 2)])
        results[name] = r
        if "refused" in r or "error" in r:
            print(f"{name}: {r.get('refused') or r.get('error')}", flush=True)
        else:
            ev, cfg = r["evidence"], r["config"]
            print(f"{name}: max_new_tokens {cfg['sampler.max_new_tokens']}, G {cfg['loop.group_size']}, prompts "
                  f"{cfg['loop.prompts_per_step']}; cut {ev['cut_frac']:.0%} at {ev['cap']}, pass "
                  f"{ev['pass_rate_mean']:.0%}, failing {r['predicted_failing']}; {r['time/probe_s']:.0f} s wall, "
                  f"{r['time/probe_cpu_s']:.0f} s CPU; warnings {len(r['warnings'])}", flush=True)
        if path:
            path.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
