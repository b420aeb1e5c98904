#!/usr/bin/env python
"""Soak test: run `covrl train` for a long time and sample the memory, open files and threads of every process of
the run, to find leaks (a growing RSS, fd count or process count).

    python scripts/soak.py --out /tmp/soak/run --duration 7200 --interval 60 --warmup 900 -- \\
        --config configs/tiny.yaml loop.mode=ray loop.steps=100000000 async_loop.ray_temp_dir=/tmp/soak/ray

Everything after `--` goes to `covrl train`. The run's processes are the driver and all its descendants (a local
Ray instance's gcs_server, raylet, agents and workers are descendants of the driver) plus any process whose command
line contains a `--match` string (default: the `async_loop.ray_temp_dir` of the overrides, if given). Each process
gets a role from its command line (driver, gcs_server, raylet, ray::TrainerActor, ray::SamplerActor, ...).

Every `--interval` seconds one row per process goes to OUT/samples.csv (t_s, pid, ppid, role, rss_mb, fds, threads,
and the run's step/rollouts from `--run-dir`'s metrics.jsonl when given). After `--duration` seconds (or when the
run ends, or on Ctrl-C / SIGTERM) the driver gets SIGTERM (covrl's clean stop, exit 143); then OUT/summary.json
and OUT/summary.md give per role, from the samples at t >= `--warmup`: process count, RSS (MB), fds and threads at
start and end, and the least-squares slope of each per hour (summed over the role's processes). A slope is flagged
`suspect` when the growth it predicts over the fitted span exceeds both 3x the fit's residual std and a floor
(2% of the mean RSS, 2 fds, 1 thread). The processes still alive `--settle` s after the driver exits are listed as
`leftover`. OUT/soak.png plots RSS and fds per role when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

FIELDS = ["t_s", "pid", "ppid", "role", "rss_mb", "fds", "threads", "step", "rollouts"]
METRICS = (("rss_mb", 0.02, 0.0), ("fds", 0.0, 2.0), ("threads", 0.0, 1.0))  # (key, floor as share of mean, abs floor)


def role_of(proc: psutil.Process, driver: int) -> str:
    if proc.pid == driver:
        return "driver"
    cmd = proc.cmdline()
    if cmd and cmd[0].startswith("ray::"):   # ray::SamplerActor.generate -> ray::SamplerActor (the title follows the call)
        return cmd[0].split()[0].split(".")[0]
    for arg in cmd[:3]:   # python -m x / python path/to/x.py / a binary
        name = os.path.basename(arg)
        if name and not name.startswith("python") and not arg.startswith("-"):
            return name.removesuffix(".py")
    return proc.name()


def run_processes(driver: psutil.Process, match: list[str]) -> list[psutil.Process]:
    procs = {driver.pid: driver}
    try:
        procs.update({p.pid: p for p in driver.children(recursive=True)})
    except psutil.Error:
        pass
    if match:
        for p in psutil.process_iter(["cmdline"]):
            if p.pid != os.getpid() and any(m in " ".join(p.info["cmdline"] or ()) for m in match):
                procs.setdefault(p.pid, p)
    return list(procs.values())


def last_metrics(run_dir: Path | None) -> tuple[int | None, int | None]:
    """(step, rollouts) of the last line of RUN_DIR/metrics.jsonl (read from the end of the file)."""
    path = run_dir / "metrics.jsonl" if run_dir else None
    if path is None or not path.is_file():
        return None, None
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, 2) - 65536))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            row = json.loads(line)
            return row.get("step"), int(row["rollouts"]) if "rollouts" in row else None
        except (ValueError, KeyError):
            continue
    return None, None


def sample(driver: psutil.Process, match: list[str], t: float, run_dir: Path | None) -> list[tuple[dict, psutil.Process]]:
    step, rollouts = last_metrics(run_dir)
    rows = []
    for p in run_processes(driver, match):
        try:
            with p.oneshot():
                rows.append(({"t_s": round(t, 1), "pid": p.pid, "ppid": p.ppid(), "role": role_of(p, driver.pid),
                             "rss_mb": round(p.memory_info().rss / 2**20, 2), "fds": p.num_fds(),
                             "threads": p.num_threads(), "step": step, "rollouts": rollouts}, p))
        except psutil.Error:   # exited between listing and reading, or a zombie
            continue
    return rows


def fit(ts: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope (per hour) and residual std of ys over ts (seconds)."""
    n = len(ts)
    if n < 2:
        return 0.0, 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0
    resid = [y - my - slope * (t - mt) for t, y in zip(ts, ys)]
    return slope * 3600.0, (sum(r * r for r in resid) / max(1, n - 2)) ** 0.5


def summarize(rows: list[dict], warmup: float) -> dict:
    by_role: dict[str, dict[float, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_role[r["role"]][r["t_s"]].append(r)
        by_role["TOTAL"][r["t_s"]].append(r)
    times = sorted({r["t_s"] for r in rows})
    fitted = [t for t in times if t >= warmup] or times
    out = {"samples": len(times), "first_t_s": times[0] if times else None, "last_t_s": times[-1] if times else None,
           "warmup_s": warmup, "fit_from_t_s": fitted[0] if fitted else None, "roles": {}}
    for role, at in sorted(by_role.items()):
        series = {t: {"procs": len(at.get(t, [])), **{k: sum(r[k] for r in at.get(t, [])) for k, _, _ in METRICS}}
                  for t in fitted}
        ts = list(series)
        info = {"pids_seen": len({r["pid"] for rs in at.values() for r in rs})}
        for key in ("procs",) + tuple(k for k, _, _ in METRICS):
            ys = [series[t][key] for t in ts]
            slope, noise = fit(ts, ys)
            info[key] = {"start": ys[0], "end": ys[-1], "min": min(ys), "max": max(ys),
                         "slope_per_h": round(slope, 3), "resid_std": round(noise, 3)}
        for key, rel, floor in METRICS:
            m = info[key]
            growth = m["slope_per_h"] * (ts[-1] - ts[0]) / 3600.0
            mean = sum(series[t][key] for t in ts) / len(ts)
            m["suspect"] = bool(growth > max(3 * m["resid_std"], rel * mean, floor))
        info["procs"]["suspect"] = info["procs"]["end"] > info["procs"]["start"]
        out["roles"][role] = info
    out["leak_suspected"] = any(v[k].get("suspect") for v in out["roles"].values() for k in v if k != "pids_seen")
    return out


def markdown(summary: dict) -> str:
    lines = [f"samples: {summary['samples']}, t = {summary['first_t_s']}..{summary['last_t_s']} s, fit from "
             f"t = {summary['fit_from_t_s']} s (warm-up {summary['warmup_s']} s); exit code {summary.get('exit_code')}",
             "", "| role | procs start/end | pids seen | RSS MB start/end | RSS MB/h | fds start/end | fds/h "
             "| threads start/end | threads/h |", "|---|---|---|---|---|---|---|---|---|"]
    for role, v in summary["roles"].items():
        cells = [f"{v[k]['start']:g} / {v[k]['end']:g}" for k in ("procs", "rss_mb", "fds", "threads")]
        slopes = [f"{v[k]['slope_per_h']:+.2f} (±{v[k]['resid_std']:.2f}){' **suspect**' * v[k]['suspect']}"
                  for k in ("rss_mb", "fds", "threads")]
        lines.append(f"| {role} | {cells[0]} | {v['pids_seen']} | {cells[1]} | {slopes[0]} | {cells[2]} | {slopes[1]} "
                     f"| {cells[3]} | {slopes[2]} |")
    lines += ["", f"leak suspected: {summary['leak_suspected']}; leftover processes after exit: "
              f"{summary.get('leftover') or 'none'}"]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    agg: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for r in rows:
        agg[r["role"]][r["t_s"]][0] += r["rss_mb"]
        agg[r["role"]][r["t_s"]][1] += r["fds"]
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for role, at in sorted(agg.items()):
        ts = sorted(at)
        for i, ax in enumerate(axes):
            ax.plot([t / 60 for t in ts], [at[t][i] for t in ts], label=role)
    axes[0].set_ylabel("RSS (MB, sum per role)")
    axes[1].set_ylabel("open fds (sum per role)")
    axes[1].set_xlabel("minutes")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for samples.csv, summary.*, train.log")
    parser.add_argument("--duration", type=float, default=7200, help="seconds before the run is stopped (SIGTERM)")
    parser.add_argument("--interval", type=float, default=60, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=600, help="seconds of samples left out of the slope fits")
    parser.add_argument("--match", action="append", default=None,
                        help="also sample processes whose command line contains this (repeatable; default: the "
                             "async_loop.ray_temp_dir override, if any)")
    parser.add_argument("--run-dir", type=Path, help="the run folder, to log step/rollouts with each sample")
    parser.add_argument("--stop-grace", type=float, default=180, help="seconds to wait for a clean stop, then kill")
    parser.add_argument("--settle", type=float, default=10, help="seconds after the driver exits before the "
                        "processes still alive are listed as leftover")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the arguments of `covrl train`")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    match = args.match if args.match is not None else [
        a.split("=", 1)[1] for a in train_args if a.startswith("async_loop.ray_temp_dir=")]
    args.out.mkdir(parents=True, exist_ok=True)

    stop = {"now": False}
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    cmd = [sys.executable, "-m", "covrl", "train", *train_args]
    with (args.out / "train.log").open("wb") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    driver = psutil.Process(child.pid)
    t0 = time.monotonic()
    rows: list[dict] = []
    seen: dict[int, psutil.Process] = {}
    with (args.out / "samples.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        try:
            while not stop["now"] and child.poll() is None and time.monotonic() - t0 < args.duration:
                new = sample(driver, match, time.monotonic() - t0, args.run_dir)
                seen.update({r["pid"]: p for r, p in new})
                new = [r for r, _ in new]
                writer.writerows(new)
                f.flush()
                rows += new
                next_t = t0 + args.interval * (int((time.monotonic() - t0) / args.interval) + 1)
                while not stop["now"] and child.poll() is None and time.monotonic() < next_t:
                    time.sleep(min(1.0, max(0.0, next_t - time.monotonic())))
        except KeyboardInterrupt:
            pass
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)   # the driver only: covrl stops the run and shuts Ray down itself
        try:
            child.wait(args.stop_grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    stopped_s = time.monotonic() - t0
    time.sleep(args.settle)
    leftover = []
    for pid, p in seen.items():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                leftover.append(f"{pid} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            pass
    signal.signal(signal.SIGTERM, previous)

    summary = summarize(rows, args.warmup) if rows else {"samples": 0, "roles": {}, "leak_suspected": None}
    summary.update(command=cmd, driver_pid=child.pid, exit_code=child.returncode, stopped_at_s=round(stopped_s, 1),
                   leftover=leftover, final_step=last_metrics(args.run_dir)[0],
                   final_rollouts=last_metrics(args.run_dir)[1])
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "summary.md").write_text(markdown(summary) if rows else "no samples\n")
    if rows:
        plot(rows, args.out / "soak.png")
    print((args.out / "summary.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
