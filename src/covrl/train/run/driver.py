"""The one loop driver, for every mode: rollout source → Trainer.step → weights to the sampler → record →
evaluation and checkpoints on the data clock → end of run.

    while step < loop.steps:
        batch = source.next_batch(version)        # sync: generate now; async: the queue (covrl.train.run.sources)
        result = trainer.step(batch)              # one optimizer step (covrl.train.step.trainer)
        source.publish(model) every sync_every    # the sampler's weights
        run.log(record); eval / checkpoint when the data clock crosses their period

Everything else lives elsewhere: `Run` (run folder, sinks, eval, checkpoints; covrl.train.run.folder), the sources
(covrl.train.run.sources: `SyncSource`; covrl.train.asyncrl.source: the staleness-managed pools), `Trainer`."""

from __future__ import annotations

import time
from typing import Any

from covrl.rollout.types import ScoredBatch
from covrl.train.run.folder import Run
from covrl.train.run.sources import RolloutSource, SourceBatch, build_sync_source, score_rollouts
from covrl.train.run.watchdog import ProgressWatchdog
from covrl.train.step.results import StepResult
from covrl.train.step.trainer import TrainingDivergedError

__all__ = ["run_loop", "score_rollouts", "step_record", "train_sync"]


def step_record(run: Run, batch: ScoredBatch, result: StepResult, *, step_s: float, sync_s: float) -> dict[str, Any]:
    """The per-step line of metrics.jsonl: the trainer's metrics, the task's, timings and the data clock."""
    trainer = run.trainer
    generate_s = batch.timing.generate_s
    tokens = float(batch.num_response_tokens)
    record: dict[str, Any] = {"step": run.step, **result.metrics, **batch.task_metrics}
    record.update({
        "time/generate": generate_s, "time/score": batch.timing.score_s, "time/sync": sync_s, "time/step": step_s,
        "tokens_per_s": tokens / max(step_s, 1e-9),
        "generate_tokens_per_s": tokens / max(generate_s, 1e-9),
        "epoch": run.stream.epoch, "policy_version": float(trainer.version),
        "staleness": float(trainer.version - 1 - batch.policy_version.float().mean())
        if result.metrics.get("skipped") == 0.0 else 0.0,
    })
    if run.cfg.sampler.compile:   # the torch.compile seconds inside time/generate (0 once its shapes are compiled)
        record["time/sampler_compile_s"] = batch.timing.compile_s
    if batch.loss_mask is None and len(batch):   # single turns: responses the token budget cut
        lengths = batch.response_mask.sum(1)
        record["response/at_max_frac"] = float((lengths >= run.cfg.sampler.max_new_tokens).float().mean())
    return record


AT_MAX_WARNING = 0.5   # warn once when this fraction of a step's responses ends at sampler.max_new_tokens


def _warn_cut_answers(run: Run, record: dict[str, Any]) -> None:
    frac = record.get("response/at_max_frac", 0.0)
    if run.sizing_adapter is not None and run.sizing_adapter.tokens:
        return   # a sized budget cuts on purpose; the adapter grows it when the cut steps lack contrast
    if frac >= AT_MAX_WARNING and not run.warned_cut and run.step >= 2:
        run.warned_cut = True
        run.message(f"step {run.step}: {frac:.0%} of the responses end at sampler.max_new_tokens="
                    f"{run.cfg.sampler.max_new_tokens}: answers are likely cut before they finish; raise "
                    "sampler.max_new_tokens (response/at_max_frac in metrics.jsonl)", warning=True)


def run_loop(run: Run, source: RolloutSource, *, stop_after: int | None = None) -> dict[str, Any]:
    """Train until `loop.steps` steps are done (or `stop_after` more steps: an interruption point for tests),
    with rollouts from `source`. Evaluates before (fresh runs) and after; checkpoints every
    `checkpoint.every_rollouts` and at the end (a completed run's weights only with checkpoint.final=weights).
    Returns the summary."""
    cfg, trainer = run.cfg, run.trainer
    lcfg = cfg.loop
    watchdog = ProgressWatchdog(cfg.run.stall_warning_s, lambda text: run.message(text, warning=True),
                                getattr(source, "waiting_for", None))
    watchdog.beat("evaluating before training", run.step)
    if run.step == 0 and not run.evals and cfg.eval.before:
        source.evaluate("before")
    done_now = 0
    try:
        source.start()
        while run.step < lcfg.steps and (stop_after is None or done_now < stop_after):
            t_step = time.perf_counter()
            watchdog.beat("waiting for the step's rollouts", run.step, ask_source=True)
            sb: SourceBatch = source.next_batch(trainer.version)
            watchdog.beat("training step")
            result = trainer.step(sb.batch)
            source.step_done(result)
            run.step += 1
            done_now += 1
            t0 = time.perf_counter()
            if run.step % cfg.sampler.sync_every == 0 or run.step == lcfg.steps:
                watchdog.beat("pushing weights to the sampler")
                source.publish(run.model, trainer.version)
            sync_s = time.perf_counter() - t0
            record = step_record(run, sb.batch, result, step_s=time.perf_counter() - t_step, sync_s=sync_s)
            if run.sync_alarm is not None:
                alarm, warning = run.sync_alarm.check(result.metrics, run.step)
                record.update(alarm)
                if warning:
                    run.message(warning, warning=True)
            record.update(sb.metrics)
            record.update(source.step_metrics(result))
            _warn_cut_answers(run, record)
            if run.sizing_adapter is not None:   # sizing.adapt: the next step's sizes from this step's evidence
                run.sizing_adapter.observe(record, sb.batch)
            if result.skip_reason:
                record["skip_reason"] = result.skip_reason
                run.message(f"step {run.step}: skipped ({result.skip_reason})")
            run.log(record)
            every = cfg.eval.every_rollouts
            if every and trainer.rollouts // every > run.last_eval_rollouts // every:
                watchdog.beat("evaluating")
                source.evaluate(f"rollouts-{trainer.rollouts}")
            run.last_eval_rollouts = trainer.rollouts
            watchdog.beat("writing a checkpoint")
            run.maybe_checkpoint()
    except TrainingDivergedError as err:
        watchdog.stop()
        source.stop()
        # the step that raised consumed its rollouts and was skipped like the ones before it: log it too
        run.step += 1
        run.log({"step": run.step, **err.metrics, "skip_reason": err.skip_reason})
        run.status = "diverged"
        run.message(f"training stopped: {err}")
        run.finish()
        raise
    except KeyboardInterrupt:
        watchdog.stop()
        source.stop()
        run.status = "interrupted"
        run.finish()
        raise
    except BaseException:
        watchdog.stop()
        source.stop()
        if source.failure() is not None:    # a dead background producer: record it in summary.json
            _record_failure(run, source.failure())
        raise
    source.stop()
    if (failure := source.failure()) is not None:
        watchdog.stop()
        _record_failure(run, failure)
        raise failure
    if run.step >= lcfg.steps:
        if cfg.eval.after:
            watchdog.beat("evaluating after training")
            source.evaluate("after")
        run.status = "completed"
    else:
        run.status = "stopped"
    if cfg.checkpoint.at_end and run.status == "completed" and cfg.checkpoint.final == "weights":
        watchdog.beat("writing the final weights")   # and deleting the full checkpoints: nothing to resume
        run.save_final_weights()
    elif cfg.checkpoint.at_end and trainer.rollouts != run.last_ckpt_rollouts:
        watchdog.beat("writing the final checkpoint")
        run.save_checkpoint()
    watchdog.stop()
    summary = run.finish()
    summary.update(source.summary())
    return summary


def _record_failure(run: Run, failure: BaseException) -> None:
    run.status = "failed"
    run.message(f"training stopped: {failure}")
    run.finish()


def train_sync(run: Run, *, stop_after: int | None = None) -> dict[str, Any]:
    """The synchronous loop: generate with the run's sampler, then train on it (`run_loop` + `SyncSource`, or
    `DynamicSamplingSource` with `loop.dynamic_sampling`; episodes for a task with an environment; an agent
    program's episodes with `task.agent.fn` / `.command`: `AgentSource`)."""
    if run.cfg.task.agent.enabled:
        from covrl.train.run.agent_source import AgentSource

        return run_loop(run, AgentSource(run), stop_after=stop_after)
    return run_loop(run, build_sync_source(run), stop_after=stop_after)
