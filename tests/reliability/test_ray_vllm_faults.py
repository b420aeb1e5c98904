"""Measured fault trials for the Ray backend and the vLLM engine in its own process (docs/reliability.md,
guarantees 7 and 8). Each slow loop (`-m slow`) runs >= 20 seeded trials with the fault at a random moment and
counts, per trial, the steps lost and repeated, the rollouts lost or trained twice (the data clock) and whether
the finished run equals an uninterrupted run of the same seed: metrics of every step and final weights bit for
bit (the Ray runs at staleness 0, whose schedule is deterministic; the vLLM engine draws one seed per row from
the run's generator). The tally of each loop goes to $COVRL_FAULTS_REPORT_DIR/<loop>.json when set.

(a) a Ray sampler actor killed (`ray.kill` or SIGKILL of its process) at a random time of a `loop.mode=ray` run
    (trainer side in this process): a new actor, the dead one's chunk generated again with the same tickets,
    every step trained once; at staleness 1 (not deterministic even without a fault) the data clock is checked;
(b) the local Ray cluster killed (its head, gcs_server + raylet, or every process of the session) under a
    `covrl train` subprocess at a random time: the run stops, never hangs, its complete checkpoints load, and
    `--resume` completes and equals the uninterrupted run. With the trainer side in its actor (the default)
    `covrl train` says so and exits 6; in the driver layout Ray's core worker ends the process itself;
(c), (d) the vLLM engine's own process (`sampler.vllm.engine_process=true`: its engine core or its worker)
    SIGKILLed mid-generation / mid-weight-push: exit 5 with a message naming the engine, checkpoints complete,
    `--resume` (a new engine) completes and equals the uninterrupted run. Needs vllm (`.venv-vllm`; skipped
    where vllm is not importable, as tests/rollout/test_vllm.py). The engine of each trial's resume is reused by
    the next trial's victim run (one engine start per trial; a sampler pushes its own weights into a reused
    engine, and the comparison with the reference checks that this changes nothing).

Default suite: the pieces that need no Ray cluster and no engine start (a lost trainer actor's exit, a dead
engine's exit code, the engine watcher waking a blocked call)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from _reliability_tiny import TINY, final_weights, logs, metrics, popen_logged, tiny_overrides

from covrl.config import load_config
from covrl.rollout.vllm import vllm_available
from covrl.train.run import checkpoint as ckpt

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")

ROWS, PROMPTS = 16, 4
SEED = int(os.environ.get("COVRL_FAULT_SEED", "20261203"))
TRIALS = int(os.environ.get("COVRL_FAULT_TRIALS", "20"))


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ------------------------------------------------------------------------------------------------ audit

def comparable(record: dict) -> dict:
    """Per-step values that depend only on the data and the weights: not wall time, and not the async loop's
    own counters (idle fractions, restarts; the staleness is checked on its own)."""
    return {k: v for k, v in record.items()
            if not (k.startswith(("time/", "async/")) or k.endswith("per_s") or k == "skip_reason")}


def audit(run_dir: Path, steps: int) -> dict:
    """The data clock of a finished run folder: steps logged once each, rollouts trained, the async queue's
    counters (consumed = trained, nothing dropped, accepted + running - consumed = what the queue holds), no
    half-written checkpoint left."""
    records = metrics(run_dir)
    logged = [r["step"] for r in records]
    latest = ckpt.latest_checkpoint(run_dir)
    state = ckpt.load_state(latest) if latest is not None else None
    manager = (state or {}).get("async", {}).get("manager") if state else None
    trained = sum(int(r["batch_rows"]) for r in records)
    want = steps * ROWS
    checkpoints = run_dir / "checkpoints"
    summary = json.loads((run_dir / "summary.json").read_text())
    out = {
        "steps_repeated": len(logged) - len(set(logged)),
        "steps_lost": len(set(range(1, steps + 1)) - set(logged)),
        "rollouts_lost": max(0, want - trained), "rollouts_twice": max(0, trained - want),
        "rollouts_clock": None if state is None else int(state["trainer"]["rollouts"]),
        "clock_monotone": [r["rollouts"] for r in records] == [float(ROWS * (i + 1)) for i in range(len(records))],
        "leftover_partials": len([p for p in checkpoints.iterdir() if p.name.startswith(".")])
        if checkpoints.is_dir() else 0,
        "status": summary["status"],
        "staleness_max": max((r.get("async/staleness_max", 0.0) for r in records), default=0.0),
    }
    if manager is not None:
        held = sum(c["size"] for c in manager["chunks"])
        out.update(queue_consumed=int(manager["consumed"]), queue_dropped=int(manager["dropped"]),
                   queue_balanced=manager["accepted"] + manager["running"] - manager["consumed"] == held)
    return out


def clean(a: dict, steps: int) -> bool:
    return (a["status"] == "completed" and a["steps_repeated"] == 0 and a["steps_lost"] == 0
            and a["rollouts_lost"] == 0 and a["rollouts_twice"] == 0 and a["rollouts_clock"] == steps * ROWS
            and a["clock_monotone"] and a["leftover_partials"] == 0
            and a.get("queue_consumed", steps * ROWS) == steps * ROWS and a.get("queue_dropped", 0) == 0
            and a.get("queue_balanced", True))


def same_run(run_dir: Path, ref_dir: Path) -> tuple[bool, bool]:
    """(every step's metrics equal, final weights bit-identical) against the uninterrupted run."""
    if ckpt.latest_checkpoint(run_dir) is None:
        return False, False
    same_metrics = [comparable(r) for r in metrics(run_dir)] == [comparable(r) for r in metrics(ref_dir)]
    got, want = final_weights(run_dir), final_weights(ref_dir)
    same_weights = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    return same_metrics, same_weights


def report(name: str, data: dict) -> None:
    folder = os.environ.get("COVRL_FAULTS_REPORT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


@contextmanager
def local_ray(root: Path):
    """A local 2-CPU Ray instance in this process (session folder short: Ray's socket paths)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = Path(tempfile.mkdtemp(prefix="covrl-rf-"))
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ (a) Ray actor

RAY_STEPS = 6


def ray_overrides(out: Path, name: str, staleness: int, *extra: str) -> list[str]:
    return tiny_overrides(out, name, "logging.console=false", "sft_warmup.steps=0", "loop.mode=ray",
                          "async_loop.chunk_prompts=2", "async_loop.trainer_actor=false",
                          "async_loop.sampler_cpus=1", f"async_loop.max_staleness_steps={staleness}", *extra,
                          steps=RAY_STEPS)


class ActorWatch:
    """Instruments one in-process Ray run: the sampler actors when they are up (and the pid of the first), the
    pool (chunks in flight), the steps trained."""

    def __init__(self, monkeypatch):
        from covrl.train.asyncrl import ray_pool
        from covrl.train.step import trainer as trainer_module

        self.up = threading.Event()
        self.actors: list = []
        self.pid = None
        self.pools: list = []
        self.steps = 0
        self.t_up = None
        real_start, real_init, real_step = (ray_pool.start_sampler_actors, ray_pool.RayPool.__init__,
                                            trainer_module.Trainer.step)
        watch = self

        def start(cfg):
            actors = real_start(cfg)
            watch.actors[:] = actors
            watch.pid = ray_pool.ray_module().get(actors[0].ready.remote())
            watch.t_up = time.perf_counter()
            watch.up.set()
            return actors

        def init(pool, state, actors, ray):
            real_init(pool, state, actors, ray)
            watch.pools.append(pool)

        def step(trainer, batch):
            out = real_step(trainer, batch)
            watch.steps += 1
            return out

        monkeypatch.setattr(ray_pool, "start_sampler_actors", start)
        monkeypatch.setattr(ray_pool.RayPool, "__init__", init)
        monkeypatch.setattr(trainer_module.Trainer, "step", step)


def ray_run(out: Path, name: str, staleness: int, resume: bool = False) -> int:
    from covrl.train.launch.modes import train_from_config

    torch.set_num_threads(1)
    return train_from_config(load_config(TINY, ray_overrides(out, name, staleness)), resume=resume)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.skipif(not _has("ray"), reason="needs the ray extra")
@pytest.mark.parametrize("staleness", [0, 1])
def test_ray_sampler_actor_killed_at_random_times(tmp_path, monkeypatch, staleness):
    """(a) `ray.kill` or SIGKILL of the sampler actor's process at U(0, T) after the actors are up (T: the
    reference run's time from then to its end): the run completes with a restarted actor, every step once, no
    rollout lost or trained twice; at staleness 0 it equals the uninterrupted run bit for bit."""
    import ray as ray_lib

    rng = random.Random(SEED + staleness)
    rows = []
    t_loop = time.perf_counter()
    with local_ray(tmp_path):
        refs = []
        for r in range(1 if staleness == 0 else 2):   # staleness 1: is the fault-free run itself repeatable?
            watch = ActorWatch(monkeypatch)
            t0 = time.perf_counter()
            assert ray_run(tmp_path, f"ref{r}", staleness) == 0
            refs.append({"wall_s": time.perf_counter() - t0, "after_up_s": time.perf_counter() - watch.t_up})
            monkeypatch.undo()
        window = refs[0]["after_up_s"]
        ref_dir = tmp_path / "ref0"
        refs_equal = None if staleness == 0 else all(same_run(tmp_path / "ref1", ref_dir))
        for trial in range(TRIALS):
            name = f"trial{trial}"
            how = rng.choice(["ray.kill", "SIGKILL"])
            delay = rng.uniform(0.0, window)
            row = {"trial": trial, "how": how, "delay_s": round(delay, 3), "landed": False}
            watch = ActorWatch(monkeypatch)
            finished = threading.Event()

            def killer(watch=watch, row=row, how=how, delay=delay, finished=finished):
                if not watch.up.wait(600) or finished.wait(delay):
                    return
                pool = watch.pools[-1] if watch.pools else None
                row["in_flight"] = bool(pool is not None and pool.inflight)
                row["steps_done_at_kill"] = watch.steps
                if how == "ray.kill":
                    ray_lib.kill(watch.actors[0], no_restart=True)
                else:
                    os.kill(watch.pid, signal.SIGKILL)
                row["landed"] = True

            thread = threading.Thread(target=killer, daemon=True)
            thread.start()
            t0 = time.perf_counter()
            rc = ray_run(tmp_path, name, staleness)
            finished.set()
            thread.join(timeout=60)
            monkeypatch.undo()
            row.update(rc=rc, wall_s=round(time.perf_counter() - t0, 1))
            run_dir = tmp_path / name
            if rc != 0:   # stopped (past the restart budget, say): resume must finish it
                row["resume_rc"] = ray_run(tmp_path, name, staleness, resume=True)
            records = metrics(run_dir)
            row["restarts"] = records[-1].get("async/worker_restarts") if records else None
            row.update(audit(run_dir, RAY_STEPS))
            if staleness == 0:
                row["same_metrics"], row["same_weights"] = same_run(run_dir, ref_dir)
            rows.append(row)
    report(f"ray_actor_kill_staleness{staleness}",
           {"seed": SEED + staleness, "trials": rows, "references": refs, "window_s": window,
            "fault_free_runs_equal": refs_equal, "loop_wall_s": time.perf_counter() - t_loop})
    bad = [r for r in rows if not (clean(r, RAY_STEPS) and r["staleness_max"] <= staleness
                                   and r.get("resume_rc", 0) == 0
                                   and (staleness or (r["same_metrics"] and r["same_weights"])))]
    assert not bad, json.dumps(bad, indent=1, default=str)
    landed = [r for r in rows if r["landed"]]
    assert landed, "no kill landed before the runs ended"
    assert all(r["restarts"] in (0.0, 1.0) for r in landed), rows   # one death, at most one restart logged


# ------------------------------------------------------------------------------------------------ (b) Ray head

def _ray_processes(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def start_covrl(out: Path, name: str, layout: str, temp: Path, resume: bool = False,
                steps: int = RAY_STEPS, every: int = ROWS) -> subprocess.Popen:
    extra = (f"async_loop.trainer_actor={'true' if layout == 'actor' else 'false'}", "async_loop.trainer_cpus=1",
             f"async_loop.ray_temp_dir={temp}")
    overrides = tiny_overrides(out, name, "logging.console=false", "sft_warmup.steps=0", "loop.mode=ray",
                               "async_loop.chunk_prompts=2", "async_loop.sampler_cpus=1",
                               "async_loop.max_staleness_steps=0", *extra, steps=steps, every=every)
    args = [sys.executable, "-m", "covrl", "train", "--config", str(TINY), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_AUTH_MODE": "disabled"}
    return popen_logged(args, env, out, name, resume)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int | None, str, str]:
    """Exit code (None: still running after `timeout` s, a hang: then it and its Ray processes are killed)."""
    try:
        proc.wait(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        for p in _ray_processes(proc.pid):
            p.kill()
        proc.kill()
        proc.wait()
        rc = None
    return rc, *logs(proc)


def wait_for(proc: subprocess.Popen, run_dir: Path, what: str, n: int = 1, timeout: float = 300) -> float:
    """Until the run folder is written (`folder`) or `n` steps are logged (`step`), or the process ended."""
    def seen() -> bool:
        return (run_dir / "config.yaml").is_file() if what == "folder" else len(metrics(run_dir)) >= n

    deadline = time.perf_counter() + timeout
    while not seen() and proc.poll() is None and time.perf_counter() < deadline:
        time.sleep(0.02)
    return time.perf_counter()


def ray_session_leftovers(temp: Path) -> list:
    """Processes of a killed Ray session still running (Ray's agents orphaned by their raylet; they exit on
    their own within ~1-2 min): those whose command line or open files name the session folder."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            if p.pid == os.getpid():
                continue
            text = " ".join(p.info["cmdline"] or [])
            if str(temp) in text or ((p.info["name"] or "").startswith("ray::") and any(
                    str(temp) in f.path for f in p.open_files())):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.skipif(not (_has("ray") and _has("psutil")), reason="needs the ray extra and psutil")
def test_ray_cluster_killed_mid_run_stops_cleanly_and_resume_equals(tmp_path):
    """(b) SIGKILL the local Ray instance that `covrl train` started: its head (gcs_server + raylet) or every
    process of the session, in either layout (trainer side in a Ray actor, or in the driver), at a random
    moment: a third of the trials in the setup (U(0, the reference's setup) after the run folder appears: the
    actors start), the others during the steps (once k of the 6 steps are logged, k uniform in 1..5, then
    U(0, the reference's median step time)). The run must stop within 300 s (no hang), with a message, exit 6 and a final
    summary, except when Ray's core worker ends the driver first (driver layout: exit 1, summary "running", as
    after a kill -9); its complete checkpoints load; the resumed run equals the uninterrupted one bit for bit
    (staleness 0)."""
    rng = random.Random(SEED + 10)
    temps: list[Path] = []

    def temp() -> Path:
        temps.append(Path(tempfile.mkdtemp(prefix="covrl-rh-")))
        return temps[-1]

    t_loop = time.perf_counter()
    refs = {}
    rows = []
    try:
        for layout in ("actor", "driver"):
            proc = start_covrl(tmp_path, f"ref-{layout}", layout, temp())
            run_dir = tmp_path / f"ref-{layout}"
            t0 = time.perf_counter()
            t_folder = wait_for(proc, run_dir, "folder")
            t_steps = [wait_for(proc, run_dir, "step", n) for n in range(1, RAY_STEPS + 1)]
            rc, _, err = finish(proc)
            assert rc == 0, err
            gaps = sorted(b - a for a, b in zip(t_steps, t_steps[1:]))
            refs[layout] = {"wall_s": time.perf_counter() - t0, "setup_s": t_steps[0] - t_folder,
                            "step_s": gaps[len(gaps) // 2]}
        for trial in range(TRIALS):
            layout = rng.choice(["actor", "driver"])
            what = rng.choice(["head", "all"])
            phase = rng.choice(["setup", "steps", "steps"])   # the setup: most of a tiny run's wall time
            after = rng.randint(1, RAY_STEPS - 1) if phase == "steps" else 0
            delay = rng.uniform(0.0, refs[layout]["setup_s" if phase == "setup" else "step_s"])
            name = f"trial{trial}"
            run_dir = tmp_path / name
            row = {"trial": trial, "layout": layout, "killed": what, "phase": phase, "after_steps": after,
                   "delay_s": round(delay, 3)}
            session = temp()
            t0 = time.perf_counter()
            proc = start_covrl(tmp_path, name, layout, session)
            wait_for(proc, run_dir, "folder")
            if after:
                wait_for(proc, run_dir, "step", after)
            time.sleep(delay)
            row["landed"] = proc.poll() is None
            row["steps_logged_at_kill"] = len(metrics(run_dir))
            row["checkpoints_at_kill"] = len(ckpt.list_checkpoints(run_dir)) if run_dir.is_dir() else 0
            victims = [p for p in _ray_processes(proc.pid)
                       if what == "all" or p.name() in ("gcs_server", "raylet")]
            for p in victims:
                try:
                    p.kill()
                except Exception:  # noqa: BLE001 - already gone
                    pass
            t_kill = time.perf_counter()
            rc, _, err = finish(proc)
            row.update(rc=rc, exit_after_kill_s=round(time.perf_counter() - t_kill, 1),
                       message=[line for line in err.splitlines() if line.startswith("covrl train:")][-1:],
                       traceback="Traceback (most recent call last)" in err)
            time.sleep(1.0)
            left = ray_session_leftovers(session)
            row["orphans_left"] = sorted({p.name() for p in left if p.is_running()})
            for p in left:   # ours: this trial's Ray session
                try:
                    p.kill()
                except Exception:  # noqa: BLE001
                    pass
            summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() \
                else {}
            row["summary_after_kill"] = [summary.get("status"), summary.get("exit_code")]
            loads = []
            for c in ckpt.list_checkpoints(run_dir) if run_dir.is_dir() else []:
                try:
                    ckpt.load_state(c)
                    final_weights(run_dir)
                    loads.append(True)
                except Exception:  # noqa: BLE001
                    loads.append(False)
            row["checkpoints_after_kill"], row["checkpoints_load"] = len(loads), all(loads)
            row["steps_logged_after_kill"] = len(metrics(run_dir))
            if rc != 0:
                rrc, out, rerr = finish(start_covrl(tmp_path, name, layout, temp(), resume=True))
                row["resume_rc"] = rrc
                row["resumed_from"] = [line.split("resumed from ")[-1].rstrip(")").split("/")[-1]
                                       for line in out.splitlines() if "resumed from" in line]
                row["started_fresh"] = "started from scratch" in out
                if rrc != 0:
                    row["resume_err"] = rerr[-2000:]
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            if (run_dir / "summary.json").is_file() and row.get("resume_rc", 0) == 0:
                row.update(audit(run_dir, RAY_STEPS))
                row["same_metrics"], row["same_weights"] = same_run(run_dir, tmp_path / f"ref-{layout}")
            rows.append(row)
    finally:
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)
    report("ray_cluster_kill", {"seed": SEED + 10, "trials": rows, "references": refs,
                                "loop_wall_s": time.perf_counter() - t_loop})

    def good(r: dict) -> bool:
        if r["rc"] is None or r.get("resume_rc", 0) != 0 or not r["checkpoints_load"]:
            return False   # a hang, or a resume that failed
        if r["rc"] not in ((0, 6) if r["layout"] == "actor" else (0, 1, 6)):   # 1: Ray ended the driver itself
            return False
        if r["rc"] == 6 and not (r["message"] and ("Ray trainer actor died" in r["message"][0]
                                                   or "Ray instance's head is gone" in r["message"][0])
                                 and r["summary_after_kill"] == ["failed", 6]):
            return False
        return clean(r, RAY_STEPS) and r["same_metrics"] and r["same_weights"]

    bad = [r for r in rows if not good(r)]
    assert not bad, json.dumps(bad, indent=1, default=str)
    assert any(r["rc"] != 0 for r in rows), "no kill stopped a run"


def _sigterm_run(tmp_path: Path, layout: str) -> dict:
    """SIGTERM to a `covrl train` driver of loop.mode=ray once 6 of 1000 steps are logged (a checkpoint every 4
    steps), then `--resume` with loop.steps = the steps logged + 3 (to keep the test short)."""
    temps = [Path(tempfile.mkdtemp(prefix="covrl-rt-")) for _ in range(2)]
    name, every = f"term-{layout}", 4 * ROWS
    run_dir = tmp_path / name
    try:
        proc = start_covrl(tmp_path, name, layout, temps[0], steps=1000, every=every)
        wait_for(proc, run_dir, "step", 6)
        assert proc.poll() is None, finish(proc)[2][-3000:]
        logged = len(metrics(run_dir))
        proc.send_signal(signal.SIGTERM)
        t0 = time.perf_counter()
        rc, _, err = finish(proc, timeout=240)
        out = {"rc": rc, "stop_s": time.perf_counter() - t0, "err": err, "logged_at_signal": logged,
               "summary": json.loads((run_dir / "summary.json").read_text()),
               "checkpoints": [int(ckpt.load_state(c)["trainer"]["rollouts"]) for c in ckpt.list_checkpoints(run_dir)],
               "logged_at_exit": len(metrics(run_dir))}
        steps = out["logged_at_exit"] + 3
        rrc, _, rerr = finish(start_covrl(tmp_path, name, layout, temps[1], resume=True, steps=steps, every=every))
        out.update(resume_rc=rrc, resume_err=rerr[-3000:], audit=audit(run_dir, steps), steps=steps)
        return out
    finally:
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)


def _check_sigterm_run(r: dict) -> None:
    assert r["rc"] == 143, r["err"][-3000:]
    assert "Traceback" not in r["err"], r["err"][-3000:]
    assert r["summary"]["status"] == "interrupted" and r["summary"]["exit_code"] == 143, r["summary"]
    assert r["logged_at_exit"] < 1000, "the run ended before the signal: no stop was tested"
    assert r["checkpoints"] and r["checkpoints"][-1] >= 4 * ROWS, r
    assert r["resume_rc"] == 0, r["resume_err"]
    a = r["audit"]
    assert a["status"] == "completed" and a["steps_lost"] == 0 and a["steps_repeated"] == 0, a
    assert a["rollouts_lost"] == 0 and a["rollouts_twice"] == 0 and a["clock_monotone"], a


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.skipif(not (_has("ray") and _has("psutil")), reason="needs the ray extra and psutil")
def test_sigterm_to_a_ray_driver_stops_the_trainer_actor_and_resume_completes(tmp_path):
    """`ray.init` replaces the driver's SIGTERM handler with `sys.exit(15)`: the driver then died with SIGABRT,
    its summary left "running". Now the driver keeps covrl's handler and passes the signal to the trainer
    actor's process, which stops as a local run does: exit 143, summary "interrupted"; `--resume` trains
    every step once."""
    _check_sigterm_run(_sigterm_run(tmp_path, "actor"))


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.skipif(not (_has("ray") and _has("psutil")), reason="needs the ray extra and psutil")
def test_sigterm_to_a_ray_driver_that_trains_itself_stops_and_resume_completes(tmp_path):
    """The same with the trainer side in the driver (async_loop.trainer_actor=false)."""
    _check_sigterm_run(_sigterm_run(tmp_path, "driver"))


# ------------------------------------------------------------------------------------------------ (c), (d) vLLM

VLLM_STEPS = 4
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (the vllm extra)")


def vllm_cfg(out: Path, name: str, cache: Path):
    return load_config(TINY, tiny_overrides(
        out, name, "logging.console=false", "sft_warmup.steps=0", "model.tiny.num_heads=2",
        "sampler.backend=vllm", "sampler.vllm.engine_process=true", f"sampler.vllm.model_cache={cache}",
        steps=VLLM_STEPS))


class EngineCalls:
    """Counts and times the engine calls of a run (`VLLMSampler._submit`: a generate; `load_weights`: a weight
    push) and, when armed, SIGKILLs the engine core or its worker at U(0, d) s into the n-th call of a kind."""

    def __init__(self, monkeypatch, kind: str | None = None, n: int = 0, delay: float = 0.0,
                 target: str = "engine core"):
        from covrl.rollout import vllm as vllm_module

        self.counts = {"generate": 0, "push": 0}
        self.seconds = {"generate": [], "push": []}
        self.kind, self.n, self.delay, self.target = kind, n, delay, target
        self.kill: dict = {}
        watch = self

        def wrap(kind, real):
            def call(sampler, *args, **kwargs):
                watch.counts[kind] += 1
                armed = kind == watch.kind and watch.counts[kind] == watch.n
                done = threading.Event()
                if armed:
                    threading.Thread(target=watch._kill, args=(sampler, done), daemon=True).start()
                t0 = time.perf_counter()
                try:
                    return real(sampler, *args, **kwargs)
                finally:
                    watch.seconds[kind].append(time.perf_counter() - t0)
                    done.set()
            return call

        monkeypatch.setattr(vllm_module.VLLMSampler, "_submit", wrap("generate", vllm_module.VLLMSampler._submit))
        monkeypatch.setattr(vllm_module.VLLMSampler, "load_weights",
                            wrap("push", vllm_module.VLLMSampler.load_weights))

    def _kill(self, sampler, done: threading.Event) -> None:
        import psutil

        from covrl.rollout.vllm import _engine_procs

        finished_first = done.wait(self.delay)
        core = _engine_procs(sampler.llm)[0].pid
        pid = core
        if self.target == "worker":
            workers = psutil.Process(core).children(recursive=True)
            pid = workers[0].pid if workers else core
        os.kill(pid, signal.SIGKILL)
        self.kill = {"pid": pid, "in_flight": not finished_first and not done.is_set()}


def vllm_train(cfg, resume: bool = False) -> int:
    import faulthandler

    from covrl.train.launch.modes import train_from_config

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(900, exit=True)   # a hang ends the test with every thread's stack
    try:
        return train_from_config(cfg, resume=resume)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def vllm_reference(tmp_path_factory):
    """The uninterrupted run (its engine is reused by the first trial) and how many engine calls of each kind a
    run makes, and how long they take."""
    root = tmp_path_factory.mktemp("vllm-faults")
    cache = root / "models"
    mp = pytest.MonkeyPatch()
    calls = EngineCalls(mp)
    t0 = time.perf_counter()
    try:
        assert vllm_train(vllm_cfg(root, "ref", cache)) == 0
    finally:
        mp.undo()
    yield {"root": root, "cache": cache, "counts": dict(calls.counts), "wall_s": time.perf_counter() - t0,
           "median_s": {k: sorted(v)[len(v) // 2] for k, v in calls.seconds.items() if v},
           "seconds": {k: [round(x, 4) for x in v] for k, v in calls.seconds.items()}}
    from covrl.rollout.vllm import shutdown_engines

    shutdown_engines()   # the last trial's engine (not at interpreter exit, after pytest closed its streams)


def vllm_trials(reference: dict, kind: str, seed: int) -> list[dict]:
    root, cache = reference["root"], reference["cache"]
    rng = random.Random(seed)
    rows = []
    for trial in range(TRIALS):
        name = f"{kind}-{trial}"
        n = rng.randint(1, reference["counts"][kind])
        delay = rng.uniform(0.0, 1.5 * reference["median_s"][kind])
        target = rng.choice(["engine core", "worker"])
        row = {"trial": trial, "call": f"{kind} {n} of {reference['counts'][kind]}", "target": target,
               "delay_s": round(delay, 4)}
        mp = pytest.MonkeyPatch()
        calls = EngineCalls(mp, kind, n, delay, target)
        cfg = vllm_cfg(root, name, cache)
        t0 = time.perf_counter()
        try:
            rc = vllm_train(cfg)
        finally:
            mp.undo()
        run_dir = root / name
        summary = json.loads((run_dir / "summary.json").read_text())
        row.update(rc=rc, victim_wall_s=round(time.perf_counter() - t0, 1), in_flight=calls.kill.get("in_flight"),
                   reason=summary.get("reason"), summary=[summary["status"], summary.get("exit_code")],
                   steps_logged_at_stop=len(metrics(run_dir)),
                   checkpoints_at_stop=[c.name for c in ckpt.list_checkpoints(run_dir)])
        loads = []
        for c in ckpt.list_checkpoints(run_dir):
            try:
                ckpt.load_state(c)
                loads.append(True)
            except Exception:  # noqa: BLE001
                loads.append(False)
        row["checkpoints_load"] = all(loads)
        if rc != 0:
            t1 = time.perf_counter()
            row["resume_rc"] = vllm_train(cfg, resume=True)
            row["resume_wall_s"] = round(time.perf_counter() - t1, 1)
        row.update(audit(run_dir, VLLM_STEPS))
        row["same_metrics"], row["same_weights"] = same_run(run_dir, root / "ref")
        rows.append(row)
    return rows


def check_vllm_rows(rows: list[dict]) -> None:
    def good(r: dict) -> bool:
        if r["rc"] not in (0, 5) or r.get("resume_rc", 0) != 0 or not r["checkpoints_load"]:
            return False
        if r["rc"] == 5 and not (r["summary"] == ["failed", 5] and "vLLM engine process died" in (r["reason"] or "")):
            return False
        return clean(r, VLLM_STEPS) and r["same_metrics"] and r["same_weights"]

    bad = [r for r in rows if not good(r)]
    assert not bad, json.dumps(bad, indent=1, default=str)
    assert any(r["rc"] == 5 for r in rows), "no kill stopped a run"


@pytest.mark.slow
@needs_vllm
@pytest.mark.skipif(not _has("psutil"), reason="needs psutil")
def test_vllm_engine_process_killed_mid_generation(vllm_reference):
    """(c) SIGKILL the engine core (or its worker) at U(0, 1.5 d) s into a random generate call (d: the median
    generate call of the reference; a kill after the call ended hits the engine between two calls)."""
    t0 = time.perf_counter()
    rows = vllm_trials(vllm_reference, "generate", SEED + 20)
    report("vllm_kill_generate", {"seed": SEED + 20, "trials": rows, "loop_wall_s": time.perf_counter() - t0,
                                  "reference": {k: v for k, v in vllm_reference.items() if k not in ("root", "cache")}})
    check_vllm_rows(rows)


@pytest.mark.slow
@needs_vllm
@pytest.mark.skipif(not _has("psutil"), reason="needs psutil")
def test_vllm_engine_process_killed_mid_weight_push(vllm_reference):
    """(d) the same at U(0, 1.5 d) s into a random weight push (`load_weights`: the safetensors file written to
    /dev/shm, the engine's reload, the prefix-cache reset), the first one (at the sampler's start) included."""
    t0 = time.perf_counter()
    rows = vllm_trials(vllm_reference, "push", SEED + 30)
    report("vllm_kill_push", {"seed": SEED + 30, "trials": rows, "loop_wall_s": time.perf_counter() - t0,
                              "reference": {k: v for k, v in vllm_reference.items() if k not in ("root", "cache")}})
    check_vllm_rows(rows)


# ------------------------------------------------------------------------------------------------ default suite

@pytest.mark.skipif(not _has("ray"), reason="needs the ray extra")
def test_a_lost_trainer_actor_ends_covrl_train_with_exit_6_and_a_final_summary(tmp_path, monkeypatch, capsys):
    """What (b) found: with the trainer side in its Ray actor, a lost Ray head made `covrl train` end with
    ray's ActorUnavailableError traceback (exit 1) and a summary left "running". The driver now says what
    happened (exit 6, the resume command) and marks the summary the dead actor could not finish."""
    from types import SimpleNamespace

    import ray

    from covrl.train.launch import ray as launch_ray

    cfg = load_config(TINY, ray_overrides(tmp_path, "lost", 0, "async_loop.trainer_actor=true",
                                          "async_loop.trainer_cpus=1"))
    run_dir = tmp_path / "lost"

    def train_remote():   # the trainer actor starts: its setup writes a "running" summary, then it dies
        run_dir.mkdir()
        (run_dir / "summary.json").write_text(json.dumps({"status": "running"}))
        return "ref"

    def get(ref):
        if ref == "place":   # where the actor runs, asked before it trains
            return "node", 1
        raise ray.exceptions.ActorUnavailableError("RpcError: RPC error: Socket closed", b"\0" * 16)

    actor = SimpleNamespace(train=SimpleNamespace(remote=train_remote), process=SimpleNamespace(remote=lambda: "place"))
    actor_cls = SimpleNamespace(options=lambda **kw: SimpleNamespace(remote=lambda *args: actor))
    fake = SimpleNamespace(exceptions=ray.exceptions, cluster_resources=lambda: {"CPU": 2.0},
                           remote=lambda cls: actor_cls, get=get)
    monkeypatch.setattr(launch_ray, "ray_module", lambda: fake)
    monkeypatch.setattr(launch_ray, "ensure_ray", lambda acfg, engine_logs="quiet": False)
    assert launch_ray.train_from_config_ray(cfg) == 6
    err = capsys.readouterr().err
    assert "the Ray trainer actor died (ActorUnavailableError" in err
    assert "resume with: covrl train --resume --name lost" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 6 and "trainer actor died" in summary["reason"]


def test_a_dead_vllm_engine_process_is_exit_5_with_the_resume_command():
    from covrl.rollout.vllm import VLLMEngineDiedError
    from covrl.train.launch.exits import _outcome

    code, status, text = _outcome(VLLMEngineDiedError("the vLLM engine process died while generating 16 rows"),
                                  "r", setup=False)
    assert (code, status) == (5, "failed") and "resume with: covrl train --resume --name r" in text


def test_the_engine_watcher_wakes_a_blocked_call_and_drops_the_dead_engine():
    """What (c) and (d) found: vLLM's client notices a dead engine process but leaves the call in flight (a
    generate waiting on its outputs queue, a utility future: the weight push's collective_rpc) waiting for
    ever, so the run hung. The watcher wakes it, and the sampler's engine calls raise VLLMEngineDiedError.
    Here with stand-ins for vLLM's client objects around a real process."""
    import multiprocessing
    import queue
    from concurrent.futures import Future
    from types import SimpleNamespace

    from covrl.rollout import vllm as vllm_module

    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(300,), daemon=True)
    proc.start()
    future, outputs = Future(), queue.Queue()
    core = SimpleNamespace(resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=[proc]),
                                                     engine_dead=False),
                           utility_results={1: future}, outputs_queue=outputs)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core))
    entry = {"llm": llm, "process": True}
    key = ("fake-engine",)
    vllm_module._ENGINES[key] = entry
    try:
        vllm_module._watch_engine(key, entry)
        sampler = object.__new__(vllm_module.VLLMSampler)
        sampler._entry, sampler.llm, sampler.folder, sampler.dtype = entry, llm, Path("/m"), "float32"
        woken: list = []

        def blocked_call():   # a weight push waiting on its utility future
            try:
                with sampler._engine_call("loading the weights of policy version 3"):
                    future.result(timeout=60)
            except BaseException as err:  # noqa: BLE001
                woken.append(err)

        waiter = threading.Thread(target=blocked_call)
        waiter.start()
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        waiter.join(timeout=30)
        assert woken and isinstance(woken[0], vllm_module.VLLMEngineDiedError), woken
        assert "while loading the weights of policy version 3" in str(woken[0])
        assert f"engine core process {proc.pid} killed by signal {int(signal.SIGKILL)}" in str(woken[0])
        assert key not in vllm_module._ENGINES          # a later sampler starts a new engine
        assert isinstance(outputs.get(timeout=5), RuntimeError)   # a generate waiting on its outputs is woken too
        with pytest.raises(vllm_module.VLLMEngineDiedError, match="while generating"):
            with sampler._engine_call("generating 16 rows"):   # refused before it reaches the dead engine
                pass
    finally:
        entry["closed"] = True
        vllm_module._ENGINES.pop(key, None)
        if proc.is_alive():
            proc.kill()


def test_the_ray_head_watcher_names_the_loss_and_exits_6(tmp_path, monkeypatch, capsys):
    """What (b) found in the driver layout: with the local Ray head gone, Ray ends `covrl train` itself without
    a word (exit 1 at once, or after its 60 s GCS reconnect timeout) and the summary stays "running". The
    watcher polls the head this process started; here a stand-in head process (a real one) is killed: the
    message, the final summary and exit 6; a watcher stopped first (ray.shutdown ends the head on purpose) is
    silent."""
    from types import SimpleNamespace

    from covrl.train.launch import ray as launch_ray

    run_dir = tmp_path / "head"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "running"}))
    exits: list = []

    monkeypatch.setattr(launch_ray.os, "_exit", exits.append)   # the watcher thread then returns

    def fake_ray(proc):
        node = SimpleNamespace(all_processes={"gcs_server": [SimpleNamespace(process=proc)]})
        return SimpleNamespace(_private=SimpleNamespace(worker=SimpleNamespace(_global_node=node)))

    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    stop = launch_ray._watch_local_head(fake_ray(quiet), run_dir)
    stop.set()
    quiet.kill()
    quiet.wait()
    time.sleep(3 * launch_ray.HEAD_POLL_S)
    assert exits == []

    head = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        assert launch_ray._watch_local_head(fake_ray(head), run_dir) is not None
        head.kill()
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        head.kill()
        head.wait()
    assert exits == [6]
    err = capsys.readouterr().err
    assert "the local Ray instance's head is gone (gcs_server" in err and "--resume --name head" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 6


def test_a_call_failed_by_a_dying_engine_drops_it_from_the_cache(monkeypatch):
    """What the first run of (c) found: a killed worker makes the engine core cancel the call in flight ("Call to
    collective_rpc method failed: cancelled") and report itself dead before its process exits; the engine
    stayed cached, and the in-process --resume reused it and died at its first weight push. Now the failed call
    is a VLLMEngineDiedError and the engine leaves the cache at once."""
    from types import SimpleNamespace

    from covrl.rollout import vllm as vllm_module

    alive = SimpleNamespace(exitcode=None, pid=1, sentinel=None)
    resources = SimpleNamespace(engine_manager=SimpleNamespace(processes=[alive]), engine_dead=False)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(resources=resources)))
    entry = {"llm": llm, "process": True}
    key = ("dying-engine",)
    vllm_module._ENGINES[key] = entry
    monkeypatch.setattr(vllm_module, "ENGINE_DEATH_GRACE_S", 0.2)   # how long a failed call waits for a verdict
    sampler = object.__new__(vllm_module.VLLMSampler)
    sampler._entry, sampler.llm, sampler.folder, sampler.dtype = entry, llm, Path("/m"), "float32"
    try:
        with pytest.raises(ValueError):   # an engine that is fine: the error is the caller's, as it was
            with sampler._engine_call("generating 16 rows"):
                raise ValueError("a bad request")
        assert key in vllm_module._ENGINES
        with pytest.raises(vllm_module.VLLMEngineDiedError, match="while loading the weights of policy version 2"):
            with sampler._engine_call("loading the weights of policy version 2"):
                resources.engine_dead = True   # vLLM's client got the engine core's "dead" message
                raise Exception("Call to collective_rpc method failed: cancelled")
        assert key not in vllm_module._ENGINES and entry["dead"]
    finally:
        vllm_module._ENGINES.pop(key, None)
