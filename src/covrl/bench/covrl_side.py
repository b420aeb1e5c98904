"""The covrl side of the covrl-vs-TRL benchmarks: a prepared covrl run stepped by the experiment harness
(`covrl.experiment.harness`), one step per 'go' from the parent (`covrl.bench.alternate`)."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from covrl.bench.clock import Clock, make_evaluator
from covrl.bench.common import rss_peak_mb
from covrl.bench.models import model_dir
from covrl.bench.settings import StepSettings, bench_train_config
from covrl.config import load_config
from covrl.experiment import Arm, ArmRunner
from covrl.train import DataStream
from covrl.train.run.sizing import groups_of, solved_fraction


def covrl_run_config(settings: StepSettings):
    """The run of the covrl side. With `covrl_config`: that YAML exactly as `covrl train` builds it (model loader,
    SFT warm-up, sampler, trainer), its evaluations and checkpoints off. Otherwise the GRPO step of `settings`
    on the cached model folder (the very weights TRL loads)."""
    if settings.covrl_config:
        cfg = load_config(settings.covrl_config)
        return cfg.model_copy(update={
            "eval": cfg.eval.model_copy(update={"before": False, "after": False, "every_rollouts": 0}),
            "checkpoint": cfg.checkpoint.model_copy(update={"at_end": False, "every_rollouts": 0})})
    return bench_train_config(
        settings, model={"source": "hf", "path": str(model_dir(settings.model, settings.cache_dir)),
                         "dtype": settings.dtype},
        eval={"before": False, "after": False}, checkpoint={"at_end": False},
        logging={"console": False, "curves": False})


def make_covrl_stepper(runner: ArmRunner):
    """A function () -> step record: one step of the arm (next scored batch, Trainer.step, weight sync), timed."""

    def step() -> dict:
        budget = int(runner.run.cfg.sampler.max_new_tokens)   # the step samples at this; an adapter may change it
        s = runner.step()
        tokens = float(s.batch.num_response_tokens)
        groups = groups_of(s.batch)
        return {"step_time": s.wall_s, "gen_time": s.wall_generate_s, "gen_tokens": tokens,
                "trained_tokens": tokens, "reward_mean": float(s.batch.rewards.mean()),
                "constant_groups": s.metrics.get("zero_variance_groups", float("nan")),
                # the constant groups whose answers were all right: solved prompts, not failing ones
                "solved_groups": solved_fraction(groups),
                "prompts": len(groups), "group_size": max((len(g) for g in groups), default=0),
                "max_new_tokens": budget,
                # the policy's sharpening (mean token entropy under the sampler) and whether the update moved
                "entropy": s.metrics.get("entropy", float("nan")), "grad_norm": s.metrics.get("grad_norm", float("nan")),
                "no_signal_step": s.metrics.get("no_signal_step", float("nan")),
                "clip_cov_clipped": s.metrics.get("clip_cov/clipped_frac", float("nan")),   # algorithm.clip_cov
                "trainer_time": s.metrics.get("time/trainer_step", float("nan")),
                "forward_backward_time": s.metrics.get("time/forward_backward", float("nan"))}

    return step


def serve_steps(conn, stepper, clock: Clock, max_steps: int | None = None) -> None:
    """Answer the parent's 'go's with one step record each (memory, threads and the clock's evaluations added)
    until the clock says finished or `max_steps` ran."""
    for _ in itertools.count() if max_steps is None else range(max_steps):
        if conn.recv() != "go":
            raise RuntimeError("covrl worker expected 'go'")
        record = stepper()
        record.update(rss_peak_mb=rss_peak_mb(), threads=torch.get_num_threads())
        record.update(clock.after_step(record["step_time"]))
        conn.send(record)
        if record["finished"]:
            break


def covrl_worker(conn, settings: StepSettings) -> None:
    """Child process: covrl's sampler + Trainer, one step per 'go' from the parent."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    total = settings.warmup_steps + settings.steps
    cfg = covrl_run_config(settings)
    runner = ArmRunner(Arm(cfg, Path(tempfile.mkdtemp(prefix="covrl-bench-run-"))))
    run = runner.run
    torch.set_num_threads(settings.threads)  # the config may set its own thread count
    ready: dict = {"ready": True}
    sft_s = 0.0
    if settings.covrl_config:
        sft_s = float(run.sft_metrics.get("sft/seconds", 0.0))
        ready.update(sft_s=sft_s, config=cfg.model_dump(mode="json"))
    else:  # TRL's prompt order: the training prompts in order, cycling
        run.stream = DataStream(run.task.train, seed=cfg.run.seed, shuffle=False)
    stepper = make_covrl_stepper(runner)
    clock = Clock(settings, make_evaluator(settings, run.model, run.tokenizer, run.task), total)
    clock.train_s = sft_s  # a supervised warm-up is part of covrl's time to accuracy
    if settings.eval_interval_s > 0:
        ready["accuracy_before"] = clock.evaluate()["accuracy"]
    ready["rss_peak_mb"] = rss_peak_mb()
    conn.send(ready)
    try:
        serve_steps(conn, stepper, clock, total)
    finally:
        runner.close()
        shutil.rmtree(run.run_dir, ignore_errors=True)
    conn.send({"done": True})
