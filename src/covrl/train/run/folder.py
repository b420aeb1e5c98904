"""Everything around the loop that sync and async loops share: the run folder, seeding, building the model /
task / sampler / trainer, resume from the latest complete checkpoint, evaluation records, checkpoints on the
data clock, metric sinks and the end-of-run summary.

Run folder `runs/<name>/`: config.yaml (resolved), metrics.jsonl (one line per step), eval.json,
summary.json (status, timings, evals, versions, git commit, the task's split, the checkpoint left and the
folder's disk use), curves.png, checkpoints/ckpt-<rollouts:09d>/ (the newest `checkpoint.keep_last`),
checkpoints/final/ (checkpoint.final=weights) and checkpoints/initial/ (when run.save_initial or a KL reference
is needed).

summary.json says "running" from the start of the setup until the run ends; every exit of `covrl train`
replaces it with a final status ("completed", "diverged", "failed", "interrupted") and, for a failure, the
reason and the exit code (`Run.end`, `mark_summary`). Only a process killed outright leaves "running"."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from covrl.models import frozen_copy, load_model
from covrl.rollout import SamplerConfig, build_sampler, truncation_rule
from covrl.rollout.vllm import build_vllm_sampler
from covrl.settings import dump_config
from covrl.tasks import build_task
from covrl.train.parallel.wrappers import DCP_DIR
from covrl.train.run import checkpoint as ckpt
from covrl.train.run.alarm import SyncAlarm
from covrl.train.run.evaluate import evaluate
from covrl.train.run.plots import plot_curves
from covrl.train.run.provenance import git_state, versions
from covrl.train.run.selection import PromptSelector
from covrl.train.run.sinks import (
    ConsoleSink,
    JsonlSink,
    TensorBoardSink,
    WandbSink,
    read_jsonl,
    truncate_jsonl,
)
from covrl.train.run.stream import DataStream
from covrl.train.run.threads import ThreadChoice, apply_num_threads
from covrl.train.step.sft import sft_warmup
from covrl.train.step.trainer import Trainer

if TYPE_CHECKING:   # the run's config composes this room's sections: imported for types only
    from covrl.train.config import TrainConfig

STATE_FORMAT = 1


def seed_everything(seed: int) -> None:
    """One seed for python, numpy and torch (the sampler's generator is seeded separately from it)."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("run.device='cuda' but torch sees no CUDA device; use run.device=cpu or auto")
    return torch.device(name)


def _requested_run_dir(cfg: TrainConfig, config_path: str | Path | None) -> Path:
    """runs/<name>: run.name, else the config file's stem."""
    return Path(cfg.run.output_dir) / (cfg.run.name or (Path(config_path).stem if config_path else "run"))


def _used(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def choose_run_dir(cfg: TrainConfig, *, config_path: str | Path | None, resume: bool) -> Path:
    """runs/<name>: run.name, else the config file's stem. A fresh run never writes into a used folder: it
    takes the first free `<name>-2`, `<name>-3`, ... (`prepare_run` says so)."""
    run_dir = requested = _requested_run_dir(cfg, config_path)
    if resume:
        return run_dir
    k = 2
    while run_dir.exists() and any(run_dir.iterdir()):
        run_dir = requested.with_name(f"{requested.name}-{k}")
        k += 1
    return run_dir


def taken_name_note(cfg: TrainConfig, run_dir: Path, *, config_path: str | Path | None = None) -> str | None:
    """The line that announces a fresh run's folder when its name was taken (`choose_run_dir` moved on to
    `<name>-k`), None otherwise."""
    requested = _requested_run_dir(cfg, config_path)
    run_dir = Path(run_dir)
    if run_dir == requested or run_dir.parent != requested.parent or not _used(requested) \
            or not run_dir.name.startswith(f"{requested.name}-"):
        return None
    return (f"{requested} exists; this run writes {run_dir} (use --resume to continue {requested}, or pick "
            "another --name)")


class RunComplete(Exception):
    """`--resume` of a run that already did every step asked of it: nothing to train. `covrl train` prints the
    message (what to do to train further) and exits 0, without loading anything or touching the folder."""


def resume_command(run_dir: Path) -> str:
    """`covrl train --resume --name X` for a run folder (X: the name under runs/, else the folder's path)."""
    run_dir = Path(run_dir)
    return f"covrl train --resume --name {run_dir.name if run_dir.parent == Path('runs') else run_dir}"


def _check_resume_target(cfg: TrainConfig, run_dir: Path) -> None:
    """Before anything is loaded: a completed run whose newest checkpoint holds its last step, and that
    `loop.steps` asks no more of, is complete (RunComplete, exit 0, nothing re-evaluated); a completed run that
    kept only its final weights (checkpoint.final=weights) cannot train on (CheckpointError naming what to do
    instead). A newest checkpoint behind the last step (checkpoint.at_end=false) resumes as before, and a run
    without any checkpoint is left to the fresh-start rule (`_refuse_fresh_start_over`)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(summary, dict) or summary.get("status") != "completed" or not isinstance(summary.get("steps"), int):
        return
    steps, name = summary["steps"], run_dir.name
    full = ckpt.list_checkpoints(run_dir)
    final = ckpt.final_weights(run_dir)
    weights_only = final is not None and not full
    start_new = (f"start a new run from them: covrl train --config FILE model.source=hf "
                 f"model.path={final / ckpt.MODEL_DIR}") if final is not None else ""
    at_end = ckpt.marker(full[-1]).get("step") == steps if full else weights_only
    if steps >= cfg.loop.steps and at_end:
        if weights_only:
            raise RunComplete(f"run {name} is complete ({steps} steps); it kept its final weights only ({final}, "
                              f"checkpoint.final=weights), so it cannot train further; to train on, {start_new}")
        raise RunComplete(f"run {name} is complete ({steps} steps); to train further: {resume_command(run_dir)} "
                          f"loop.steps={2 * steps}")
    if weights_only:
        raise ckpt.CheckpointError(
            f"--resume: run {name} completed {steps} steps and kept its final weights only ({final}, "
            f"checkpoint.final=weights): no optimizer state, so it cannot be resumed for loop.steps="
            f"{cfg.loop.steps}; {start_new}")


@dataclass
class Run:
    """A prepared run: components plus the run folder's bookkeeping. The loop driver calls `log`, `run_eval`,
    `maybe_checkpoint` and reads/advances `step`; stateful parts `register` with its checkpointer."""

    cfg: TrainConfig
    run_dir: Path
    model: Any
    tokenizer: Any
    task: Any
    sampler: Any
    trainer: Trainer
    stream: DataStream
    generator: torch.Generator
    ref_model: Any = None
    sinks: list = field(default_factory=list)
    step: int = 0
    evals: list = field(default_factory=list)
    resumed_from: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    started_cpu: float = field(default_factory=time.process_time)
    sft_metrics: dict[str, float] = field(default_factory=dict)
    status: str = "running"
    metrics_lines: int = 0
    last_eval_rollouts: int = 0
    last_ckpt_rollouts: int = 0
    reason: str | None = None          # why the run ended early (summary.json), with the exit code
    threads: ThreadChoice | None = None   # run.num_threads as resolved at start (summary.json num_threads)
    exit_code: int | None = None
    resume_skipped: list = field(default_factory=list)   # newer checkpoints --resume could not load
    started_fresh: bool = False        # --resume found no complete checkpoint and started from scratch
    # the checkpointer: name -> part with state_dict()/load_state_dict(), saved in registration order
    stateful: dict[str, Any] = field(default_factory=dict)
    pending_state: dict[str, Any] = field(default_factory=dict)   # resumed state no part has claimed yet
    resumed_sampler_version: int | None = None
    # the weights RL started from: their fingerprint and whether checkpoints/initial/ holds them (covrl diagnose)
    initial_weights: dict[str, Any] | None = None
    sync_alarm: SyncAlarm | None = None   # the weight-sync alarm (covrl.train.run.alarm)
    warned_cut: bool = False   # the warning that most responses hit sampler.max_new_tokens was printed
    selector: PromptSelector | None = None   # which prompts of the stream a step trains on (selection)

    # ------------------------------------------------------------------------------- checkpointer
    def register(self, name: str, part: Any) -> None:
        """Save `part` (state_dict/load_state_dict) with every checkpoint under `name`; on a resumed run it is
        restored at once from the checkpoint's entry of that name, when there is one."""
        if name in self.stateful:
            raise ValueError(f"a checkpointed part named {name!r} is already registered")
        self.stateful[name] = part
        if name in self.pending_state:
            part.load_state_dict(self.pending_state.pop(name))

    # ------------------------------------------------------------------------------------ sinks
    def log(self, record: dict[str, Any]) -> None:
        for s in self.sinks:
            s.write(record)
        self.metrics_lines += 1

    def message(self, text: str, *, warning: bool = False) -> None:
        """A line for the console; a `warning` goes to stderr when the run has no console."""
        consoles = [s for s in self.sinks if isinstance(s, ConsoleSink)]
        if consoles:
            consoles[0].message(text)
        elif warning:
            print(f"warning: {text}", file=sys.stderr)

    def add_time(self, key: str, seconds: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + float(seconds)

    # ---------------------------------------------------------------------------------- eval
    def run_eval(self, label: str) -> dict[str, Any]:
        """Evaluate the sampler's current weights (the loop syncs them first) on the held-out prompts."""
        ecfg = self.cfg.eval
        examples = self.task.eval[: ecfg.max_prompts] if ecfg.max_prompts else self.task.eval
        t0 = time.perf_counter()
        result = evaluate(self.sampler, self.task, self.tokenizer, examples, seed=self.cfg.run.seed + 17,
                          greedy=ecfg.greedy, sampled=ecfg.sampled, pass_k=ecfg.pass_at_k,
                          pass_samples=ecfg.pass_at_k_samples)
        self.add_time("eval", time.perf_counter() - t0)
        result.update({"label": label, "step": self.step, "rollouts": self.trainer.rollouts,
                       "policy_version": self.trainer.version})
        self.evals.append(result)
        _write_json(self.run_dir / "eval.json", {"evals": self.evals})
        parts = [f"eval {label} (step {self.step}, {len(examples)} held-out prompts):"]
        for mode in ("greedy", "sampled"):
            if mode in result:
                parts.append(f"{mode} accuracy {result[mode]['accuracy']:.1%}")
        if "pass@k" in result:
            parts.append(f"pass@{result['pass@k']['k']} {result['pass@k']['pass@k']:.1%}")
        self.message("  ".join(parts))
        return result

    # ---------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, **{name: part.state_dict() for name, part in self.stateful.items()}}

    def save_checkpoint(self) -> Path:
        t0 = time.perf_counter()
        path = ckpt.save_checkpoint(self.run_dir, ckpt.checkpoint_name(self.trainer.rollouts), model=self.model,
                                    tokenizer=self.tokenizer, state=self.checkpoint_state(),
                                    sharded=self.trainer.save_sharded if self.trainer.sharded else None,
                                    info={"step": self.step, "rollouts": self.trainer.rollouts,
                                          "policy_version": self.trainer.version})
        ckpt.prune_checkpoints(self.run_dir, self.cfg.checkpoint.keep_last)
        self.last_ckpt_rollouts = self.trainer.rollouts
        self.add_time("checkpoint", time.perf_counter() - t0)
        return path

    def save_final_weights(self) -> Path:
        """checkpoint.final=weights at the end of a completed run: its weights alone in checkpoints/final/ (no
        optimizer state), then every `ckpt-*` deleted. What remains serves eval, diagnose and a new run
        (model.source=hf model.path=.../final/model), not --resume."""
        t0 = time.perf_counter()
        path = ckpt.save_checkpoint(self.run_dir, ckpt.FINAL, model=self.model, tokenizer=self.tokenizer, state={},
                                    with_state=False,
                                    sharded=self.trainer.save_sharded if self.trainer.sharded else None,
                                    info={"step": self.step, "rollouts": self.trainer.rollouts,
                                          "policy_version": self.trainer.version, "weights_only": True})
        shutil.rmtree(path / DCP_DIR, ignore_errors=True)   # a sharded trainer's optimizer shards: not kept
        ckpt.prune_checkpoints(self.run_dir, 0)
        self.last_ckpt_rollouts = self.trainer.rollouts
        self.add_time("checkpoint", time.perf_counter() - t0)
        return path

    def saved_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint this run leaves (the newest `ckpt-*`, else checkpoints/final/): path, size, kind."""
        latest = ckpt.latest_checkpoint(self.run_dir)
        if latest is not None:
            return {"path": str(latest), "bytes": ckpt.folder_bytes(latest), "kind": "full", "resumable": True}
        final = ckpt.final_weights(self.run_dir)
        if final is not None:
            return {"path": str(final), "bytes": ckpt.folder_bytes(final), "kind": "weights", "resumable": False}
        return None

    def maybe_checkpoint(self) -> None:
        every = self.cfg.checkpoint.every_rollouts
        if every and self.trainer.rollouts // every > self.last_ckpt_rollouts // every:
            self.save_checkpoint()

    # ---------------------------------------------------------------------------------- finish
    def summary(self) -> dict[str, Any]:
        records = read_jsonl(self.run_dir / "metrics.jsonl")
        tail = records[-5:]
        keys = ("reward/mean", "accuracy", "pass@n", "response/length_mean", "response/at_max_frac", "entropy",
                "grad_norm", "mismatch/k3", "tangent", "kl_seq", "lr", "task/errors")
        final = {k: sum(r[k] for r in tail if isinstance(r.get(k), (int, float))) /
                 max(1, sum(1 for r in tail if isinstance(r.get(k), (int, float))))
                 for k in keys if any(isinstance(r.get(k), (int, float)) for r in tail)}
        split = {k: sum(r.get(f"time/{k}", 0.0) for r in records if isinstance(r.get(f"time/{k}"), (int, float)))
                 for k in ("generate", "score", "forward_backward", "optimizer", "sync", "step")}
        before = next((e for e in self.evals if e["label"] == "before"), None)
        after = next((e for e in reversed(self.evals) if e["label"] == "after"), None)

        def brief(e):
            if e is None:
                return None
            return {m: e[m]["accuracy"] for m in ("greedy", "sampled") if m in e} | (
                {"pass@k": e["pass@k"]["pass@k"], "k": e["pass@k"]["k"]} if "pass@k" in e else {}) | {
                "step": e["step"], "rollouts": e["rollouts"], "settings": e["settings"]}

        return {
            "status": self.status, "reason": self.reason, "exit_code": self.exit_code,
            "name": self.run_dir.name, "run_dir": str(self.run_dir),
            "steps": self.step, "rollouts": self.trainer.rollouts, "policy_version": self.trainer.version,
            "skipped_steps": sum(1 for r in records if r.get("skipped")),
            "resumed_from": self.resumed_from, "resume_skipped": self.resume_skipped,
            "resume_started_fresh": self.started_fresh,
            "wall_time_s": time.perf_counter() - self.started,
            "process_cpu_s": time.process_time() - self.started_cpu,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "session_time_split_s": dict(self.timings),
            "train_time_split_s": split,
            "eval_before": brief(before), "eval_after": brief(after),
            "final_metrics_last5": final, "sft": self.sft_metrics or None,
            # what a run's rewards and budget did to it, over all its steps
            "reward_error_frac": _mean_of(records, "task/errors", per="batch_rows"),
            "response_at_max_frac": _mean_of(records, "response/at_max_frac"),
            "versions": versions(), "git": git_state(), "seed": self.cfg.run.seed,
            # results depend on the thread count (float summation order): part of what reproduces a run
            "torch_threads": torch.get_num_threads(),
            # how run.num_threads was resolved: the setting, the count, and auto's inputs (covrl.train.run.threads)
            "num_threads": None if self.threads is None else self.threads.record(),
            # the trainer ranks this run stepped on (trainer.parallel; torchrun's or Ray's group)
            "trainer": {"parallel": self.cfg.trainer.parallel,
                        "world_size": dist.get_world_size() if dist.is_initialized() else 1},
            "initial_weights": self.initial_weights,
            # the held-out split in numbers, with the held-out prompts that also occur in training
            "task": self.task.split_info() if hasattr(self.task, "split_info") else None,
            # what the run leaves on disk: its newest checkpoint and the whole folder (checkpoint.keep_last, .final)
            "checkpoint": self.saved_checkpoint(),
            "disk_bytes": ckpt.folder_bytes(self.run_dir),
            "config": "config.yaml",
        }

    def write_summary(self) -> dict[str, Any]:
        s = self.summary()
        _write_json(self.run_dir / "summary.json", s)
        return s

    def finish(self) -> dict[str, Any]:
        """Draw curves.png (when logging.curves) and write summary.json."""
        if self.cfg.logging.curves:
            try:
                plot_curves(read_jsonl(self.run_dir / "metrics.jsonl"), self.run_dir / "curves.png",
                            evals=self.evals, title=f"{self.run_dir.name}: {self.cfg.algorithm.advantage} + "
                                                    f"{self.cfg.algorithm.loss}")
            except Exception as err:  # a plotting failure must not lose the run's results
                self.message(f"curves.png not written: {err}")
        return self.write_summary()

    def end(self, status: str, *, reason: str | None = None, exit_code: int | None = None) -> None:
        """Final summary of a run that stops early (an error, an interrupt): status, reason, exit code. Never
        raises: the caller is already handling the error that ended the run."""
        self.status, self.reason, self.exit_code = status, reason, exit_code
        try:
            self.finish()
        except Exception as err:  # e.g. the disk that failed the checkpoint is still full
            print(f"summary.json not updated ({type(err).__name__}: {err})", file=sys.stderr)

    def close(self) -> None:
        for s in self.sinks:
            try:
                s.close()
            except Exception:  # a sink that fails to close must not hide the run's result
                pass
        self.sinks = []


class _GeneratorState:
    """The checkpointed RNG: python, numpy, torch's global generators and the sampler's generator."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return ckpt.capture_rng(self.generator)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ckpt.restore_rng(state, self.generator)


class _LoopCounters:
    """The run's position: steps done, metrics lines written, the sampler's weights version, last eval."""

    def __init__(self, run: Run):
        self.run = run

    def state_dict(self) -> dict[str, Any]:
        run = self.run
        return {"step": run.step, "metrics_lines": run.metrics_lines,
                "sampler_version": int(getattr(run.sampler, "version", run.trainer.version)),
                "last_eval_rollouts": run.last_eval_rollouts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        run = self.run
        run.step = int(state["step"])
        run.metrics_lines = int(state["metrics_lines"])
        run.last_eval_rollouts = int(state.get("last_eval_rollouts", run.trainer.rollouts))
        run.resumed_sampler_version = int(state.get("sampler_version", run.trainer.version))


def _mean_of(records: list[dict], key: str, per: str | None = None) -> float | None:
    """The mean of `key` over the records that have it (divided by `per` first), or None."""
    values = [r[key] / max(r.get(per, 1.0), 1.0) if per else r[key] for r in records
              if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else None


def mark_summary(run_dir: Path, status: str, *, reason: str | None = None, exit_code: int | None = None) -> None:
    """Set the final status of the summary.json a run's setup wrote before it failed (no `Run` to finish).
    Never raises."""
    path = Path(run_dir) / "summary.json"
    try:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {"name": Path(run_dir).name, "run_dir": str(run_dir)}
        data.update({"status": status, "reason": reason, "exit_code": exit_code})
        _write_json(path, data)
    except Exception as err:  # a full disk: the message on stderr still says what happened
        print(f"summary.json not updated ({type(err).__name__}: {err})", file=sys.stderr)


def storage_lines(summary: dict[str, Any]) -> list[str]:
    """The end-of-run lines on what a run left on disk: its checkpoint (where, how big, resumable or not) and
    the whole run folder."""
    lines = []
    saved = summary.get("checkpoint")
    if saved:
        what = ("weights + optimizer state; --resume continues from it" if saved.get("resumable") else
                "weights only (checkpoint.final=weights): eval, diagnose, or model.path of a new run")
        lines.append(f"  checkpoint: {saved['path']} ({ckpt.format_bytes(saved['bytes'])}, {what})")
    if summary.get("disk_bytes") is not None:
        lines.append(f"  disk: {summary.get('run_dir')} uses {ckpt.format_bytes(summary['disk_bytes'])} "
                     "(checkpoint.keep_last, checkpoint.final=weights keep it smaller)")
    return lines


def _read_resume_point(path: Path, model) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Everything `prepare_run` needs from a checkpoint, read and checked before anything is changed (so an
    unloadable one can be skipped for an older one)."""
    state = ckpt.load_state(path)
    missing = [k for k in ("trainer", "stream", "rng", "loop") if not isinstance(state, dict) or k not in state]
    if missing or not all(k in state["loop"] for k in ("step", "metrics_lines")):
        raise ckpt.CheckpointError(f"{path / ckpt.STATE_FILE}: not a run checkpoint (missing "
                                   f"{missing or ['loop.step/metrics_lines']})")
    return state, ckpt.read_model_weights(model, path / ckpt.MODEL_DIR)


def _refuse_fresh_start_over(run_dir: Path) -> None:
    """`--resume` without a checkpoint starts from scratch, which must never replace a finished run (e.g. one
    run with checkpoints off)."""
    try:
        status = json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return
    if status == "completed":
        raise FileNotFoundError(f"--resume: {run_dir} holds a completed run and no complete checkpoint; nothing "
                                "to resume (start a new run, or delete the folder to redo it)")


def _build_sinks(cfg: TrainConfig, run_dir: Path, start_step: int, console: bool) -> list:
    sinks: list = [JsonlSink(run_dir / "metrics.jsonl")]
    if console and cfg.logging.console:
        sinks.append(ConsoleSink(cfg.loop.steps, start_step=start_step, live=cfg.logging.progress_bar,
                                 every_s=cfg.logging.plain_every_s))
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if cfg.logging.wandb:
        sinks.append(WandbSink(cfg.logging.wandb_project, run_dir.name, cfg.model_dump(mode="json"), run_dir))
    return sinks


def _find_resume_point(run_dir: Path, model, resume: bool) -> tuple[Path | None, dict | None, dict | None, list]:
    """The newest complete checkpoint that loads (path, state, weights) and the newer ones that did not (renamed
    `corrupt-*`, never tried again); (None, None, None, []) for a fresh run or a folder with no checkpoint."""
    if not resume:
        return None, None, None, []
    if not ckpt.list_checkpoints(run_dir):
        incomplete = _set_aside_incomplete(run_dir, "none is complete")
        print(f"warning: --resume: {run_dir}/checkpoints holds no complete checkpoint (killed before the first "
              f"one?); starting the run from scratch in {run_dir}", file=sys.stderr)
        return None, None, None, incomplete
    latest, loaded, skipped = ckpt.newest_loadable(run_dir, lambda p: _read_resume_point(p, model))
    if latest is None:
        raise ckpt.CheckpointError(f"--resume: no checkpoint in {run_dir}/checkpoints loads (nothing was "
                                   "changed):\n" + "\n".join(f"  {p.name}: {why}" for p, why in skipped))
    for p, why in skipped:   # out of the listing: never tried again, never kept by pruning over a good one
        moved = ckpt.set_aside(p)
        print(f"warning: --resume: skipped {p} ({why}); renamed it {moved.name}; resuming from the older "
              f"{latest.name}", file=sys.stderr)
    state, weights = loaded
    return latest, state, weights, skipped + _set_aside_incomplete(run_dir, f"resuming from {latest.name}")


def _set_aside_incomplete(run_dir: Path, then: str) -> list[tuple[Path, str]]:
    """Rename `ckpt-*` folders that lost their COMPLETE marker or trainer_state.pt `corrupt-*`, with a warning (a
    resumed run would otherwise write over one of them, or keep it past pruning)."""
    out = []
    for p in ckpt.incomplete_checkpoints(run_dir):
        why = f"no {ckpt.COMPLETE} marker" if not (p / ckpt.COMPLETE).is_file() else f"no {ckpt.STATE_FILE}"
        moved = ckpt.set_aside(p)
        print(f"warning: --resume: skipped {p} ({why}: not a complete checkpoint); renamed it {moved.name}; {then}",
              file=sys.stderr)
        out.append((p, why))
    return out


def _recorded_initial_weights(run_dir: Path) -> dict[str, Any] | None:
    """The initial-weights record of the attempt a resume continues (its summary.json), before it is rewritten."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("initial_weights")
    except (OSError, ValueError):
        return None


def build_teacher(cfg: TrainConfig, tokenizer, device):
    """The frozen distillation teacher of `distill.teacher` (None without), on `device`. A teacher must use the
    student's tokenizer: the signal compares log-probs of the same token ids."""
    if cfg.distill.teacher is None:
        return None
    teacher, teacher_tok = load_model(cfg.distill.teacher, seed=cfg.run.seed)
    if teacher_tok.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"distill.teacher ({cfg.distill.teacher.source} {cfg.distill.teacher.path or ''}) has "
                         "another tokenizer than the student: on-policy distillation compares the log-probs of the "
                         "same token ids, so teacher and student must share one vocabulary")
    if cfg.distill.engine == "vllm":
        return _vllm_teacher(cfg, teacher, teacher_tok)
    return frozen_copy(teacher.to(device))


def _vllm_teacher(cfg: TrainConfig, teacher, tokenizer):
    """The teacher in its own vLLM engine (distill.engine=vllm): it scores with vLLM's prompt log-probs, the
    model's distribution at temperature 1 over the whole vocabulary, so the settings that would score another
    distribution are refused."""
    if cfg.sampler.temperature != 1.0 or truncation_rule(cfg.sampler).active:
        raise ValueError(f"distill.engine=vllm scores the teacher at temperature 1 over the whole vocabulary; "
                         f"sampler.temperature={cfg.sampler.temperature}, top_k={cfg.sampler.top_k}, "
                         f"top_p={cfg.sampler.top_p}, min_p={cfg.sampler.min_p} need distill.engine=trainer")
    if cfg.trainer.parallel != "none":
        raise ValueError(f"distill.engine=vllm serves one trainer process; under trainer.parallel="
                         f"{cfg.trainer.parallel} use distill.engine=trainer (each rank scores its rows)")
    scfg = SamplerConfig(backend="vllm", vllm=cfg.sampler.vllm, max_new_tokens=1)
    return build_vllm_sampler(scfg, teacher, tokenizer, role="teacher")


def rebuild_initial_model(cfg: TrainConfig):
    """(model, tokenizer) with the weights a fresh run of `cfg` starts RL from, built as prepare_run builds them:
    the run's threads and seed, the model of `model`, the supervised warm-up of `sft_warmup`. Deterministic at
    a fixed thread count on one CPU model; compare `weights_fingerprint` with the run's record before trusting it."""
    apply_num_threads(cfg)
    seed_everything(cfg.run.seed)
    device = resolve_device(cfg.run.device)
    task = build_task(cfg.task)
    model, tokenizer = load_model(cfg.model, seed=cfg.run.seed)
    model.to(device)
    sft_warmup(model, tokenizer, task, cfg.sft_warmup, seed=cfg.run.seed,
               micro_batch_size=cfg.optim.micro_batch_size * 4)
    return model, tokenizer


def _claim_run_folder(cfg: TrainConfig, run_dir: Path, latest: Path | None, resume: bool) -> None:
    """Write config.yaml and a "running" summary.json: from here on the folder is this attempt's (a setup that
    fails later gets a final status). A fresh start drops outputs of an earlier attempt in the same folder."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    _write_json(run_dir / "summary.json", {"status": "running", "phase": "setup", "name": run_dir.name,
                                           "run_dir": str(run_dir),
                                           "resumed_from": None if latest is None else str(latest)})
    if latest is None:
        for stale in ("metrics.jsonl", "eval.json"):
            (run_dir / stale).unlink(missing_ok=True)
        if resume:   # a fresh start in a used folder (nothing to resume): drop the killed attempt's other outputs
            (run_dir / "curves.png").unlink(missing_ok=True)
            for stale_dir in ("tensorboard", "checkpoints/initial", f"checkpoints/{ckpt.FINAL}"):
                shutil.rmtree(run_dir / stale_dir, ignore_errors=True)


def _starting_weights(cfg: TrainConfig, run_dir: Path, model, tokenizer, task, device, weights: dict | None,
                      console: bool) -> tuple[dict[str, float], Any]:
    """The weights RL starts from and the frozen KL reference (or None): a fresh run runs the SFT warm-up and
    saves checkpoints/initial/ when needed; a resumed run loads the checkpoint's weights and the reference from
    checkpoints/initial/. Returns (SFT metrics, reference model)."""
    initial_dir = run_dir / "checkpoints" / "initial"
    if weights is None:
        log = print if console and cfg.logging.console else None
        sft_metrics = sft_warmup(model, tokenizer, task, cfg.sft_warmup, seed=cfg.run.seed,
                                 micro_batch_size=cfg.optim.micro_batch_size * 4, log=log)
        if cfg.run.save_initial or cfg.kl.coef > 0:
            ckpt.save_checkpoint(run_dir, "initial", model=model, tokenizer=tokenizer, state={}, with_state=False)
        return sft_metrics, (frozen_copy(model) if cfg.kl.coef > 0 else None)
    ckpt.apply_model_weights(model, weights)
    if cfg.kl.coef <= 0:
        return {}, None
    if not (initial_dir / ckpt.MODEL_DIR).is_dir():
        raise FileNotFoundError(f"{initial_dir}: the KL reference weights are missing; cannot resume")
    ref_model, _ = load_model(cfg.model, seed=cfg.run.seed)
    ckpt.load_model_weights(ref_model, initial_dir / ckpt.MODEL_DIR)
    return {}, frozen_copy(ref_model.to(device))


def prepare_run(cfg: TrainConfig, *, config_path: str | Path | None = None, resume: bool = False,
                run_dir: Path | None = None, console: bool = True, build_sampler_fn=None) -> Run:
    """Build (or restore) everything a loop needs. Fresh run: seed, load the model, SFT warm-up (if any),
    initial weights, sampler, trainer, stream. `resume=True`: the same, then the newest COMPLETE checkpoint that
    loads gives the weights, optimizer/schedule state, RNG states, data position and data clock; newer ones
    that do not load are renamed `corrupt-ckpt-...` with a warning (none loads: CheckpointError, nothing
    changed). A folder with no complete checkpoint (killed before the first one) starts from scratch in place,
    unless it holds a completed run."""
    t_setup, cpu_setup = time.perf_counter(), time.process_time()
    run_dir = Path(run_dir) if run_dir is not None else choose_run_dir(cfg, config_path=config_path, resume=resume)
    if resume:
        if not run_dir.is_dir():
            raise FileNotFoundError(f"--resume: run folder {run_dir} does not exist")
        _check_resume_target(cfg, run_dir)
        ckpt.clean_temporary(run_dir)
        if not ckpt.list_checkpoints(run_dir):
            _refuse_fresh_start_over(run_dir)
    elif console and (note := taken_name_note(cfg, run_dir, config_path=config_path)):
        print(note, flush=True)
    threads = apply_num_threads(cfg)
    seed_everything(cfg.run.seed)
    device = resolve_device(cfg.run.device)

    # data and model first: bad input fails before a run folder is created
    task = build_task(cfg.task)
    if (repeats := task.repeats_warning()) is not None:   # every task source: counted once, in Task
        print(f"warning: {repeats}", file=sys.stderr, flush=True)
    stream = DataStream(task.train, seed=cfg.run.seed)
    t0 = time.perf_counter()
    model, tokenizer = load_model(cfg.model, seed=cfg.run.seed)
    model.to(device)
    load_s = time.perf_counter() - t0
    generator = torch.Generator().manual_seed(cfg.run.seed)
    latest, state, weights, skipped = _find_resume_point(run_dir, model, resume)
    initial = _recorded_initial_weights(run_dir) if latest is not None else None
    _claim_run_folder(cfg, run_dir, latest, resume)
    sft_metrics, ref_model = _starting_weights(cfg, run_dir, model, tokenizer, task, device, weights, console)
    if weights is None:   # fresh: RL starts here
        initial = {"fingerprint": ckpt.weights_fingerprint(model),
                   "saved": (run_dir / "checkpoints" / "initial" / ckpt.MODEL_DIR).is_dir()}
    del weights

    trainer = Trainer(model, cfg, ref_model=ref_model, teacher=build_teacher(cfg, tokenizer, device))
    sampler = (build_sampler_fn or build_sampler)(cfg.sampler, model, tokenizer)
    run = Run(cfg=cfg, run_dir=run_dir, model=model, tokenizer=tokenizer, task=task, sampler=sampler,
              trainer=trainer, stream=stream, generator=generator, ref_model=ref_model, sft_metrics=sft_metrics,
              threads=threads, initial_weights=initial)
    run.started, run.started_cpu = t_setup, cpu_setup   # wall time counts model load and warm-up too
    run.add_time("model_load", load_s)
    run.resume_skipped = [{"checkpoint": str(p), "reason": why} for p, why in skipped]
    run.started_fresh = resume and latest is None
    if sft_metrics:
        run.add_time("sft", sft_metrics.get("sft/seconds", 0.0))

    if latest is not None:
        run.pending_state = {k: v for k, v in state.items() if k != "format"}
        run.resumed_from = str(latest)
    # the checkpointer's parts (a resumed run restores each from the checkpoint as it registers)
    run.register("trainer", trainer)
    run.register("stream", stream)
    run.register("rng", _GeneratorState(generator))
    run.register("loop", _LoopCounters(run))
    run.selector = PromptSelector(cfg.selection, cfg.run.seed, len(task.train))
    if cfg.selection.strategy != "uniform" or cfg.selection.group_sizes == "adaptive":
        run.register("selection", run.selector)
    run.sync_alarm = SyncAlarm(cfg.sync_alarm, describe_engine=f"sampler.backend={cfg.sampler.backend}, "
                                                               f"dtype {cfg.sampler.dtype or cfg.model.dtype}")
    run.register("sync_alarm", run.sync_alarm)
    if latest is not None:
        run.last_ckpt_rollouts = trainer.rollouts
        truncate_jsonl(run_dir / "metrics.jsonl", run.metrics_lines)
        prior = json.loads((run_dir / "eval.json").read_text()).get("evals", []) \
            if (run_dir / "eval.json").is_file() else []
        run.evals = [e for e in prior if e.get("rollouts", 0) <= trainer.rollouts and e.get("label") != "after"]
    sampler.load_weights(model, trainer.version if run.resumed_sampler_version is None
                         else run.resumed_sampler_version)

    run.sinks = _build_sinks(cfg, run_dir, run.step, console)
    run.add_time("setup", time.perf_counter() - t_setup)
    run.write_summary()
    return run
