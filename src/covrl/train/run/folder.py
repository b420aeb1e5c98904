"""Everything around the loop that sync and async loops share: the run folder, the sampler and trainer over the
run's components (`covrl.train.run.components`), the resume point (`covrl.train.run.resume`), evaluation
records, checkpoints on the data clock, metric sinks and the end-of-run summary.

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
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from covrl.models import frozen_copy, load_model
from covrl.rollout import build_sampler
from covrl.settings import dump_config
from covrl.train.parallel.wrappers import DCP_DIR
from covrl.train.run import checkpoint as ckpt
from covrl.train.run.alarm import SyncAlarm
from covrl.train.run.components import Components, build_components, build_teacher
from covrl.train.run.evaluate import evaluate
from covrl.train.run.plots import plot_curves
from covrl.train.run.provenance import git_state, versions
from covrl.train.run.resume import (
    check_resume_target,
    find_resume_point,
    recorded_initial_weights,
    refuse_fresh_start_over,
)
from covrl.train.run.selection import PromptSelector
from covrl.train.run.sinks import (
    ConsoleSink,
    JsonlSink,
    TensorBoardSink,
    WandbSink,
    read_jsonl,
    truncate_jsonl,
)
from covrl.train.run.sizing import attach_adapter, size_run
from covrl.train.run.stream import DataStream
from covrl.train.run.threads import ThreadChoice
from covrl.train.step.self_teacher import needs_initial_weights
from covrl.train.step.trainer import Trainer

if TYPE_CHECKING:   # the run's config composes this room's sections: imported for types only
    from covrl.train.config import TrainConfig

STATE_FORMAT = 1


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


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
    sizing: dict[str, Any] | None = None   # what the probe chose for the auto fields (sizing.json; None: no auto)
    sizing_adapter: Any = None   # sizing.adapt: changes the auto sizes while the run goes
    agent: Any = None   # task.agent: the AgentPlayer that plays episodes and evaluations (covrl.train.run.agent_source)

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
        budget = self.sizing_adapter.evaluation_budget() if self.sizing_adapter is not None else nullcontext()
        with budget:   # a sized run evaluates at the budget its probe chose, whatever the training budget is now
            result = evaluate(self.sampler, self.task, self.tokenizer, examples, seed=self.cfg.run.seed + 17,
                              greedy=ecfg.greedy, sampled=ecfg.sampled, pass_k=ecfg.pass_at_k,
                              pass_samples=ecfg.pass_at_k_samples,
                              agent=self.agent.evaluate_episodes if self.agent is not None else None)
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
            # the auto fields as the probe sized them (sizing.json), its seconds, and each adapted budget
            "sizing": None if self.sizing is None else {
                **self.sizing,
                "max_new_tokens_changes": self.sizing_adapter.changes if self.sizing_adapter is not None else [],
                "group_size_changes": self.sizing_adapter.group_changes if self.sizing_adapter is not None else []},
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


def _starting_weights(c: Components, run_dir: Path, weights: dict | None, console: bool
                      ) -> tuple[dict[str, float], Any]:
    """The weights RL starts from and the frozen copy of them for a KL reference or an initial-weights
    self-teacher (or None): a fresh run runs the SFT warm-up and saves checkpoints/initial/ when needed; a resumed
    run loads the checkpoint's weights and the reference from checkpoints/initial/. Returns (SFT metrics,
    reference model)."""
    cfg, model, tokenizer = c.cfg, c.model, c.tokenizer
    initial_dir = run_dir / "checkpoints" / "initial"
    if weights is None:
        sft_metrics = c.warm_up(log=print if console and cfg.logging.console else None)
        if cfg.run.save_initial or needs_initial_weights(cfg):
            ckpt.save_checkpoint(run_dir, "initial", model=model, tokenizer=tokenizer, state={}, with_state=False)
        return sft_metrics, (frozen_copy(model) if needs_initial_weights(cfg) else None)
    ckpt.apply_model_weights(model, weights)
    if not needs_initial_weights(cfg):
        return {}, None
    if not (initial_dir / ckpt.MODEL_DIR).is_dir():
        raise FileNotFoundError(f"{initial_dir}: the initial weights (KL reference / self-teacher) are missing; "
                                "cannot resume")
    ref_model, _ = load_model(cfg.model, seed=cfg.run.seed)
    ckpt.load_model_weights(ref_model, initial_dir / ckpt.MODEL_DIR)
    return {}, frozen_copy(ref_model.to(c.device))


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
        check_resume_target(cfg, run_dir)
        ckpt.clean_temporary(run_dir)
        if not ckpt.list_checkpoints(run_dir):
            refuse_fresh_start_over(run_dir)
    elif console and (note := taken_name_note(cfg, run_dir, config_path=config_path)):
        print(note, flush=True)
    # data and model first: bad input fails before a run folder is created
    c = build_components(cfg)
    if (repeats := c.task.repeats_warning()) is not None:   # every task source: counted once, in Task
        print(f"warning: {repeats}", file=sys.stderr, flush=True)
    model, tokenizer, task, stream = c.model, c.tokenizer, c.task, c.stream
    generator = torch.Generator().manual_seed(cfg.run.seed)
    latest, state, weights, skipped = find_resume_point(run_dir, model, resume)
    initial = recorded_initial_weights(run_dir) if latest is not None else None
    _claim_run_folder(cfg, run_dir, latest, resume)
    sft_metrics, ref_model = _starting_weights(c, run_dir, weights, console)
    # auto sizes: a probe of the weights RL starts from (fresh), or the run folder's numbers (resumed)
    cfg, sizing, probe_s = size_run(cfg, c, run_dir, resumed=latest is not None,
                                    build_sampler_fn=build_sampler_fn or build_sampler, console=console)
    if weights is None:   # fresh: RL starts here
        initial = {"fingerprint": ckpt.weights_fingerprint(model),
                   "saved": (run_dir / "checkpoints" / "initial" / ckpt.MODEL_DIR).is_dir()}
    del weights

    trainer = Trainer(model, cfg, ref_model=ref_model, teacher=build_teacher(cfg, tokenizer, c.device, task, stream))
    sampler = (build_sampler_fn or build_sampler)(cfg.sampler, model, tokenizer)
    run = Run(cfg=cfg, run_dir=run_dir, model=model, tokenizer=tokenizer, task=task, sampler=sampler,
              trainer=trainer, stream=stream, generator=generator, ref_model=ref_model, sft_metrics=sft_metrics,
              threads=c.threads, initial_weights=initial)
    run.started, run.started_cpu = t_setup, cpu_setup   # wall time counts model load and warm-up too
    run.add_time("model_load", c.load_s)
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
    if sizing is not None:
        run.sizing = {"config": sizing["config"], "auto": sizing["auto"], "time/probe_s": sizing["time/probe_s"],
                      "warnings": sizing["warnings"], "file": "sizing.json"}
        run.add_time("probe", probe_s)
        run.sizing_adapter = attach_adapter(run, sizing)
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
