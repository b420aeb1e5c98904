"""The synchronous loop: prompts -> sampler.generate -> task.score -> trainer.step -> weight sync, with
evaluation and checkpoints on the data clock.

Everything except the orchestration lives elsewhere and is shared with other loops: `Run` (run folder,
sinks, eval, checkpoints; covrl.train.run), `Trainer` (covrl.train.trainer), `DataStream`
(covrl.train.data), `score_rollouts` (below)."""

from __future__ import annotations

import time
from typing import Any

import torch

from covrl.rollout.types import RolloutBatch
from covrl.train.evaluate import decode_responses
from covrl.train.faults import fault_point
from covrl.train.run import Run
from covrl.train.trainer import TrainingDivergedError


def score_rollouts(task, tokenizer, batch: RolloutBatch, examples: list, n: int,
                   positions: list[int] | None = None) -> dict[str, float]:
    """Decode, score and attach rewards to `batch` in place: rewards [B], info['correct'], info['texts'],
    prompt_index (stream positions, when given). `examples` are the prompts of the call (n rows each)."""
    texts = decode_responses(tokenizer, batch)
    row_examples = [ex for ex in examples for _ in range(n)]
    scored = task.score(texts, row_examples)
    batch.rewards = torch.tensor(scored.rewards, dtype=torch.float32)
    batch.info["correct"] = list(scored.correct)
    batch.info["texts"] = texts
    if positions is not None:
        batch.prompt_index = torch.tensor(positions, dtype=torch.long).repeat_interleave(n)
    return {f"task/{k.split('/', 1)[-1]}": float(v) for k, v in scored.metrics.items()
            if k not in ("reward/mean", "reward/accuracy")}


def train_sync(run: Run, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run the sync loop until `loop.steps` steps are done (or `stop_after` more steps: an interruption
    point for tests). Evaluates before (fresh runs) and after; checkpoints every `checkpoint.every_rollouts`
    and at the end. Returns the summary."""
    cfg = run.cfg
    lcfg = cfg.loop
    trainer, sampler = run.trainer, run.sampler
    if run.step == 0 and not run.evals and cfg.eval.before:
        run.run_eval("before")
    done_now = 0
    try:
        while run.step < lcfg.steps and (stop_after is None or done_now < stop_after):
            t_step = time.perf_counter()
            examples, positions = run.stream.take(lcfg.prompts_per_step)
            prompts = [run.task.encode(run.tokenizer, ex) for ex in examples]
            t0 = time.perf_counter()
            batch = sampler.generate(prompts, lcfg.group_size, generator=run.generator,
                                     policy_version=trainer.version)
            fault_point("generate")  # reliability tests: COVRL_FAULT (no-op otherwise)
            t_gen = time.perf_counter() - t0
            t0 = time.perf_counter()
            task_metrics = score_rollouts(run.task, run.tokenizer, batch, examples, lcfg.group_size, positions)
            t_score = time.perf_counter() - t0
            metrics = trainer.step(batch)
            run.step += 1
            done_now += 1
            t0 = time.perf_counter()
            if run.step % cfg.sampler.sync_every == 0 or run.step == lcfg.steps:
                sampler.load_weights(run.model, trainer.version)
            t_sync = time.perf_counter() - t0
            step_s = time.perf_counter() - t_step
            record: dict[str, Any] = {"step": run.step, **metrics, **task_metrics}
            record.update({
                "time/generate": t_gen, "time/score": t_score, "time/sync": t_sync, "time/step": step_s,
                "tokens_per_s": float(batch.num_response_tokens) / max(step_s, 1e-9),
                "generate_tokens_per_s": float(batch.num_response_tokens) / max(t_gen, 1e-9),
                "epoch": run.stream.epoch, "policy_version": float(trainer.version),
                "staleness": float(trainer.version - 1 - batch.policy_version.float().mean()) if metrics.get(
                    "skipped") == 0.0 else 0.0,
            })
            if trainer.last_skip_reason:
                record["skip_reason"] = trainer.last_skip_reason
                run.message(f"step {run.step}: skipped ({trainer.last_skip_reason})")
            run.log(record)
            run.maybe_evaluate()
            run.maybe_checkpoint()
    except TrainingDivergedError as err:
        # the step that raised consumed its rollouts and was skipped like the ones before it: log it too
        run.step += 1
        run.log({"step": run.step, **err.metrics, "skip_reason": trainer.last_skip_reason})
        run.status = "diverged"
        run.message(f"training stopped: {err}")
        run.finish()
        raise
    except KeyboardInterrupt:
        run.status = "interrupted"
        run.finish()
        raise
    finished = run.step >= lcfg.steps
    if finished:
        if cfg.eval.after:
            run.run_eval("after")
        run.status = "completed"
    else:
        run.status = "stopped"
    if cfg.checkpoint.at_end and run.trainer.rollouts != run.last_ckpt_rollouts:
        run.save_checkpoint()
    return run.finish()
