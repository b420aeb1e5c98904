"""One optimisation step on a scored `RolloutBatch`; the algorithm (registry names in the config) is bound once
per Trainer (`covrl.train.step.algorithm.bind_algorithm`).

`Trainer.step` runs named stages in order, each a method a reader can take one at a time (docs/theory.md §5–§8):

  1. reference  (KL to a reference) its log-probs, no grad; in `reward` mode R_b ← R_b − coef·Σ_t KL_t; the
                distillation teacher's log-probs (distill.teacher=self: the model's own, on each row's privileged
                prompt; covrl.train.step.self_teacher).
  2. plan       micro-batches of whole groups (covrl.train.step.micro), and whether a pre-pass is needed (a
                group larger than `optim.micro_batch_size`, or `correction.is_batch_normalize`).
  3. prepass    (when needed) a no-grad forward over the whole batch: log-probs and Σπ².
  4. prepare    `rollout_correction` (IS weights, rejection keep-mask) and `compute_advantages` once, on the
                pre-pass's full batch; without a pre-pass each micro-step prepares its own whole groups from its
                own forward (OTB receives the trainer log-probs, Σπ² and, when enabled, the IS weights).
  5. micro-step `covrl.train.step.micro_step.micro_step` per micro-batch: ONE forward pass gives log p(y_t|c_t)
                at the sampler's temperature (with grad) and, detached from the same logits, the entropy and Σπ²
                (OTB's logit-gradient proxy); `policy_loss` (+ `score_centering_term` with the sampler's top-k)
                (+ KL in the loss) as the micro-batch's share of the FULL batch's aggregate (rejected tokens
                count in the normaliser: TRM's "full count"), backward, and a detached record. Pairing rule
                (declared with each registered loss, `LossSpec.takes_is_weights`): a loss whose ratio is taken
                against the sampler (ppo_clip) gets no IS weights; covariance and reinforce get the detached
                correction weights.
  6. apply      global-norm clipping; the zero-gradient rule; AdamW with lr = peak · schedule(data clock) ·
                length-surge scale.
  7. metrics    on the full batch, once, from the records and the advantages and correction the step already
                computed (assembled from the micro-steps, or the pre-pass's); the estimator or the correction
                runs again on the full batch only where those pieces would not reproduce the full-batch values
                bit for bit (`_batch_diagnostics`).

The trainer does not know whether it runs in a sync or async loop: it only reads the batch.

With `trainer.parallel` = ddp / fsdp2 every rank calls `step` with the same full batch and runs only its shard
of whole groups (`covrl.train.parallel.wrappers.shard_rows`); each micro-batch's loss is its share of the FULL
batch's aggregate (times the world size, which DDP's / FSDP2's gradient averaging divides out), so the
normaliser is global whatever the split; the detached per-token pieces are summed over ranks, so metrics are
the full batch's; clipping sees the reduced (global) gradient. The rank mechanics (idle micro-batches, the
reductions, the world-size factor of each backward, DDP's comm hook) are `Parallel`'s (covrl.train.parallel),
wrapped around the micro-step from here. docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from covrl.diagnostics.noise import GradientNoiseMonitor
from covrl.diagnostics.tangent import tangent_remainder
from covrl.math import KL_ESTIMATORS, clamped_log_ratio, constant_groups, kl_estimate
from covrl.models.compiled import compile_module, compile_seconds
from covrl.models.forward import ResponseForward
from covrl.models.precision import check_autocast
from covrl.rollout.types import RolloutBatch, ScoredBatch
from covrl.train.faults import fault_point
from covrl.train.parallel.shards import ShardIOError
from covrl.train.parallel.wrappers import (
    DCP_DIR,
    DCP_KEY,
    Parallel,
    apply_optimizer_state,
    carry_optimizer_state,
    full_model_state,
    load_sharded,
    save_sharded,
    shard_rows,
)
from covrl.train.step.algorithm import Algorithm, bind_algorithm
from covrl.train.step.batch_scaling import LagContext, scaled_lr
from covrl.train.step.lr_surge import LengthSurgeSchedule
from covrl.train.step.micro import (
    MicroNorms,
    groups_of,
    halves,
    mean_over,
    micro_batch_share,
    pad_cols,
    plan_micro_batches,
    plan_packed,
    trim_columns,
)
from covrl.train.step.micro_step import (
    LossTerms,
    Prepared,
    StepPieces,
    collect,
    forward_batch,
    micro_step,
    truncation_replay,
)
from covrl.train.step.optimizer import build_adamw
from covrl.train.step.results import StepResult
from covrl.train.step.schedule import lr_factor
from covrl.train.step.self_teacher import SelfTeacher, needs_initial_weights

if TYPE_CHECKING:   # the run's config composes this room's sections: imported for types only
    from covrl.train.config import TrainConfig


class TrainingDivergedError(RuntimeError):
    """Raised after `optim.max_bad_steps` skipped (non-finite) steps in a row; `metrics` and `skip_reason` are the
    last skipped step's (so the loop can still log it)."""

    def __init__(self, message: str, metrics: dict[str, float] | None = None, skip_reason: str | None = None):
        super().__init__(message)
        self.metrics = dict(metrics or {})
        self.skip_reason = skip_reason


@dataclass
class _Plan:
    """The micro-batches (row lists; None = an idle micro-batch of a rank with fewer), whether a no-grad pre-pass
    over the whole batch must come first (a group larger than a micro-batch, or a batch-level statistic), and
    whether this step measures the gradient-noise split."""

    micro_batches: list[list[int] | None]
    needs_prepass: bool
    measure_noise: bool


@dataclass
class _Prepass:
    """The pre-pass over the whole batch: its log-probs and Σπ², then (`Trainer._prepare_batch`) the correction
    and advantages on them, once, and their metrics (correction, then advantages)."""

    logprobs: torch.Tensor
    sum_pi_sq: torch.Tensor
    prepared: Prepared | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Accumulated:
    """The micro-steps' output: the gradients are in .grad; their records assembled over the full batch (per-token
    pieces, loss, loss metrics, why the step must be skipped), the micro-batch gradient norms (noise split)."""

    pieces: StepPieces
    norms: MicroNorms | None = None
    started: float = 0.0          # perf_counter() when the first micro-batch began (time/forward_backward)
    compile_s: float = 0.0        # of which torch.compile (trainer.compile)


class Trainer:
    """`Trainer(model, cfg, ref_model=None)`; `step(batch) -> StepResult` (see the module docstring).

    State on the data clock: `rollouts` (consumed, including skipped steps) and `version` (optimizer updates
    applied = policy version). `state_dict()` / `load_state_dict()` cover the optimizer, the length-surge
    schedule, the noise monitor and these counters.
    """

    def __init__(self, model, cfg: TrainConfig, ref_model=None, teacher=None):
        self.model = model
        self.cfg = cfg
        self.algorithm: Algorithm = bind_algorithm(cfg)
        self.ref_model = ref_model
        self.teacher = teacher   # on-policy distillation (distill.teacher): frozen, scores the drawn tokens
        if cfg.distill.teacher is not None and teacher is None:
            raise ValueError("distill.teacher is set: pass the loaded teacher (Trainer(..., teacher=...))")
        if isinstance(teacher, SelfTeacher):
            _check_self_teacher(cfg, ref_model)
        if cfg.kl.coef > 0 and ref_model is None:
            raise ValueError("kl.coef > 0 needs a reference model (Trainer(model, cfg, ref_model=frozen_copy(model)))")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (requires_grad=False everywhere)")
        self.optimizer = self._build_optimizer()
        self.surge = LengthSurgeSchedule(cfg.lr_surge, rollouts_per_step=cfg.loop.rollouts_per_step)
        self.noise = GradientNoiseMonitor() if cfg.noise_scale_on else None
        if self.noise is not None and cfg.trainer.parallel == "fsdp2":   # a config changed after validation
            raise ValueError("logging.noise_scale=true is refused under trainer.parallel=fsdp2 (TrainConfig)")
        self.parallel: Parallel | None = None   # wrapped at the first step (a collective: all ranks step)
        self.leader = None    # rank 0 of a run: a Channel that sends each batch to the other ranks
        self._pending_shards: str | None = None   # fsdp2 resume: a dcp/ folder, loaded once the model is sharded
        self.temperature = float(cfg.sampler.temperature)
        # the sampler's kept sets: measured, and replayed unless trainer.truncation=full
        self.truncation, self.replay = truncation_replay(cfg.sampler, cfg.trainer.truncation)
        if self.truncation is not None and not self.replay:
            warnings.warn(f"sampler {self.truncation} truncates and trainer.truncation=full: every ratio pi/q "
                          "carries the kept mass S_t (E_q[pi/q] = S_t < 1), so IS weights, rejection and the mismatch metrics "
                          "are biased; trainer.truncation=replay makes them exact (docs/theory.md §12)", stacklevel=2)
        check_autocast(cfg.trainer.autocast, self.params[0].device)   # warns where bf16 would be emulated
        self.rollouts = 0
        self.version = 0
        self.no_signal_steps = 0   # zero-gradient steps left out under optim.skip_zero_gradient
        self.bad_steps = 0
        self._version_at_start = 0
        self._compiled: tuple[str, torch.nn.Module] | None = None   # (backend, torch.compile wrapper of the model)

    # ------------------------------------------------------------------------------------------ schedule
    def lr_at(self, rollouts: int, batch_rollouts: int | None = None) -> float:
        """Peak lr · schedule(data clock) · length-surge scale; the peak is optim.lr, scaled from
        batch_scaling.base_batch_rollouts to the rollouts per step by the optimizer's rule when
        batch_scaling.scale_lr (AdamW: square root; covrl.train.step.batch_scaling)."""
        o = self.cfg.optim
        b = self.cfg.loop.rollouts_per_step if batch_rollouts is None else batch_rollouts
        f = lr_factor(rollouts, b, warmup=o.warmup_rollouts, total=self.cfg.total_rollouts,
                      schedule=o.schedule, min_ratio=o.min_lr_ratio)
        lag = LagContext(beta1=o.betas[0], queue_rollouts=self.cfg.async_loop.queue_rollouts(
            self.cfg.loop.rollouts_per_step)) if self.cfg.batch_scaling.rule == "sqrt_momentum" else None
        return scaled_lr(o.lr, self.cfg.loop.rollouts_per_step, self.cfg.batch_scaling, lag=lag) * f * self.surge.scale

    # --------------------------------------------------------------------------------------------- step
    def step(self, batch: ScoredBatch) -> StepResult:
        """One optimizer step on a scored batch. The result's metrics are flat floats; `skipped` = 1 when
        the update was not applied (the reason in `skip_reason`)."""
        if not isinstance(batch, ScoredBatch):
            raise ValueError("Trainer.step needs a ScoredBatch (batch.rewards is None): score the rollouts "
                             "(task.score) before Trainer.step")
        if self.leader is None:
            return self._step(batch)
        self.leader.send(("step", batch))
        try:
            result = self._step(batch)
        except TrainingDivergedError:   # every rank met the same skipped steps: the step's collectives are over
            self.leader.close()
            raise
        self.leader.close()   # (a SIGTERM that came during the step is raised here: covrl.train.launch.ranks)
        return result

    def _step(self, batch: ScoredBatch) -> StepResult:
        if self.cfg.trainer.parallel != "none" and self.parallel is None:
            self._distribute()
        t_start = time.perf_counter()
        self._version_at_start = self.version
        batch = _to_device(batch, self.params[0].device)
        rows = len(batch)
        mask = batch.train_mask.float()   # model tokens only: the normaliser, corrections and metrics
        lr = self.lr_at(self.rollouts, rows)
        metrics = batch_metrics(batch)
        self.rollouts += rows
        metrics["lr"] = lr
        self.model.train()
        if rows == 0 or float(mask.sum()) == 0:
            return self._skip(metrics, "empty generations: the batch holds no response tokens", t_start)
        own = None if self.parallel is None else shard_rows(batch.group_ids, self.parallel.world, self.parallel.rank)
        rewards, ref_lp = self._reference(batch, own, metrics)
        t_teacher = time.perf_counter()
        teacher_lp = None if self.teacher is None else self._teacher_logprobs(batch, own)
        t_teacher = time.perf_counter() - t_teacher
        plan = self._plan(batch, own)
        prepass = self._prepass(batch, own) if plan.needs_prepass else None
        if prepass is not None:   # else each micro-step prepares its own whole groups
            self._prepare_batch(batch, rewards, prepass)
        acc = self._micro_steps(batch, rewards, ref_lp, teacher_lp, plan, prepass)
        if acc.pieces.bad is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return self._skip(metrics, acc.pieces.bad, t_start)
        t_opt = time.perf_counter()
        grad_norm, no_signal = self._apply(lr)
        if grad_norm is None:
            return self._skip(metrics, f"non-finite gradient norm ({no_signal})", t_start)
        t_end = time.perf_counter()
        if self.cfg.trainer.compile:   # included in time/forward_backward; apart so that later steps read honestly
            metrics["time/compile_s"] = acc.compile_s
        self._metrics(metrics, batch, rewards, acc, prepass, grad_norm, no_signal)
        if teacher_lp is not None:
            metrics.update(_distill_metrics(acc.pieces.logprobs, teacher_lp, batch.train_mask.float()))
            metrics["time/teacher"] = t_teacher
        metrics.update({"time/forward_backward": t_opt - acc.started, "time/optimizer": t_end - t_opt,
                        "time/trainer_step": t_end - t_start,
                        "train_tokens_per_s": float(mask.sum()) / max(t_end - t_start, 1e-9)})
        signal_key = self.cfg.lr_surge.metric_key
        if signal_key in metrics:
            metrics.update(self.surge.update(max(0.0, metrics[signal_key]), self.rollouts))
        return StepResult(metrics, version=self.version, rollouts=self.rollouts)

    # -------------------------------------------------------------------------------- stage 1: reference
    def _reference(self, batch: RolloutBatch, own: list[int] | None, metrics: dict[str, float]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rewards the step learns from (with the KL penalty in `reward` mode) and the reference's
        log-probs of the batch (None without a KL term); the KL metrics go into `metrics`."""
        rewards = batch.rewards.float()
        kl = self.cfg.kl
        if self.ref_model is None or kl.coef <= 0:
            return rewards, None
        mask = batch.train_mask.float()
        ref_lp = self._reference_logprobs(batch, own)
        ref_kl = kl_estimate(batch.sampler_logprobs.float(), ref_lp, kl.kind) * mask
        metrics["kl_ref/seq_mean"] = float(ref_kl.sum(1).mean())
        metrics["kl_ref/token_mean"] = mean_over(ref_kl, mask)
        if kl.mode == "reward":
            penalty = kl.coef * ref_kl.sum(1)
            rewards = rewards - (penalty if rewards.dim() == 1 else kl.coef * ref_kl)
            metrics["kl_ref/reward_penalty"] = float(penalty.mean())
        return rewards, ref_lp

    @torch.no_grad()
    def _teacher_logprobs(self, batch: RolloutBatch, own: list[int] | None) -> torch.Tensor:
        """The distillation teacher's log-probs of the drawn tokens: a frozen module in this process, an engine
        of its own (distill.engine=vllm) that scores the batch, or the model itself given each row's privileged
        prompt (distill.teacher=self: the trainer's current weights or the frozen initial ones), no grad."""
        if isinstance(self.teacher, SelfTeacher):
            model = self.ref_model if self.teacher.frozen else self.model
            return self._reference_logprobs(self.teacher.privileged(batch), own, model)
        if isinstance(self.teacher, torch.nn.Module):
            return self._reference_logprobs(batch, own, self.teacher)
        return self.teacher.score(batch).float() * batch.train_mask.float()

    def _reference_logprobs(self, batch: RolloutBatch, own: list[int] | None = None, model=None) -> torch.Tensor:
        """The log-probs of the full batch under a frozen model: the KL reference (default) or the distillation
        teacher. Distributed (`own`: this rank's rows): each rank forwards its shard through its replica and one
        all-reduce SUM assembles the full batch's (the other rows are zeros: exact), which the reward-mode
        penalty and the metrics need."""
        model = self.ref_model if model is None else model
        rows, width = batch.response_ids.shape
        out = torch.zeros((rows, width), dtype=torch.float32, device=batch.response_ids.device)
        mine = torch.arange(rows, device=out.device) if own is None else torch.as_tensor(own, dtype=torch.long,
                                                                                           device=out.device)
        size = self.cfg.optim.micro_batch_size
        for s in range(0, len(mine), size):
            idx = mine[s:s + size]
            mb = trim_columns(batch.select(idx))
            # the reference in the trainer's precision: at the start (policy = reference) their KL is exactly 0
            fwd = forward_batch(model, mb, self.temperature, with_stats=False,
                               share_prompts=self.cfg.optim.share_prompts, autocast=self.cfg.trainer.autocast,
                               truncation=self.truncation if self.replay else None, replay=self.replay,
                               packing=self.cfg.trainer.packing)
            out[idx] = pad_cols(fwd.logprobs.float(), width)
        return out if own is None else self.parallel.all_reduce(out)

    # ------------------------------------------------------------------------------------- stage 2: plan
    def _plan(self, batch: RolloutBatch, own: list[int] | None) -> _Plan:
        """The micro-batches (of this rank's rows `own` when distributed) and whether a pre-pass must come first."""
        alg = self.algorithm
        measure_noise = self._measures_noise()
        if self.cfg.trainer.packing:   # by tokens, not rows: whole groups always (a large group goes alone)
            tokens = (batch.prompt_mask.sum(1) + batch.response_mask.sum(1)).long()
            rows, aligned = plan_packed(batch.group_ids, tokens, self.cfg.trainer.packing_tokens, own), True
        else:
            rows, aligned = plan_micro_batches(batch.group_ids, self.cfg.optim.micro_batch_size, own)
        if measure_noise and aligned and own is None and len(rows) == 1 and len(groups_of(batch.group_ids)) >= 2:
            # The noise split needs gradient norms at two batch sizes and one micro-batch gives one: the step
            # then runs as two halves of whole groups. Each row is still forwarded once and the gradient is the
            # same sum of micro-batch shares (up to float rounding, which is why the split is on every k-th step
            # only with logging.noise_scale_every; docs/configuration.md).
            rows = halves(groups_of(batch.group_ids))
        micro_batches: list[list[int] | None] = list(rows)
        if self.parallel is not None:
            micro_batches = self.parallel.pad_plan(micro_batches)
        if alg.score_centering and (batch.sampler_topk_ids is None or batch.sampler_topk_logprobs is None):
            raise ValueError("algorithm.score_centering needs the sampler's top-k (batch.sampler_topk_ids/"
                             "sampler_topk_logprobs); set sampler.return_topk > 0")
        return _Plan(micro_batches, not aligned or alg.needs_batch_statistics, measure_noise)

    # ---------------------------------------------------------------------------------- stage 3: prepass
    @torch.no_grad()
    def _prepass(self, batch: RolloutBatch, own: list[int] | None = None) -> _Prepass:
        """No-grad forward over the whole batch for batch-level statistics (groups split over micro-batches or
        batch-normalised IS weights). Distributed: each rank forwards its rows `own` and the log-probs and Σπ²
        are summed over ranks."""
        par = self.parallel
        rows, width = batch.response_ids.shape
        device = batch.response_ids.device
        lp = torch.zeros((rows, width), dtype=torch.float32, device=device)
        sps = torch.zeros_like(lp)
        size = self.cfg.optim.micro_batch_size
        mine = list(range(rows)) if own is None else own
        chunks: list[list[int] | None] = [mine[s:s + size] for s in range(0, len(mine), size)]
        if par is not None and par.mode == "fsdp2":   # every forward of a sharded model is a collective
            chunks = par.pad_plan(chunks)
        for chunk in chunks:
            idx = torch.as_tensor([0] if chunk is None else chunk, dtype=torch.long, device=device)
            mb = trim_columns(batch.select(idx))
            fwd = forward_batch(self.model, mb, self.temperature, share_prompts=self._share_prompts(),
                                autocast=self.cfg.trainer.autocast, truncation=self.truncation if self.replay
                                else None, replay=self.replay, packing=self.cfg.trainer.packing)
            if chunk is not None:
                lp[idx] = pad_cols(fwd.logprobs.float(), width)
                sps[idx] = pad_cols(fwd.sum_pi_sq, width)
        if par is not None:
            both = par.all_reduce(torch.stack([lp, sps]))
            lp, sps = both[0], both[1]
        return _Prepass(lp, sps)

    # ---------------------------------------------------------------------------------- stage 4: prepare
    def _prepare_batch(self, batch: RolloutBatch, rewards: torch.Tensor, prepass: _Prepass) -> None:
        """Correction and advantages once, on the full batch's pre-pass log-probs (every rank alike), with their
        metrics, into `prepass`."""
        alg = self.algorithm
        mask = batch.train_mask.float()
        corr = alg.correct(prepass.logprobs, batch.sampler_logprobs.float(), mask)
        weights = alg.is_weights(corr)
        adv = alg.advantages(rewards=rewards, mask=mask, group_ids=batch.group_ids, logprobs=prepass.logprobs,
                             sum_pi_sq=prepass.sum_pi_sq, is_weights=weights, **alg.term_inputs(batch))
        prepass.prepared = Prepared(adv.advantages, weights, corr.keep,
                                    self._grad_keep(adv.advantages, batch, corr.keep))
        prepass.metrics = {**corr.metrics, **adv.metrics}

    def _prepare(self, mb: RolloutBatch, fwd: ResponseForward, rewards: torch.Tensor) -> Prepared:
        """Correction and advantages of a micro-batch that holds whole groups, on its own forward's log-probs
        (their metrics come later, once, on the full batch)."""
        alg = self.algorithm
        mask = mb.train_mask.float()
        lp = fwd.logprobs.detach()
        corr = alg.correct(lp, mb.sampler_logprobs.float(), mask, with_metrics=False)
        weights = alg.is_weights(corr)
        adv = alg.advantages(rewards=rewards, mask=mask, group_ids=mb.group_ids, logprobs=lp,
                             sum_pi_sq=fwd.sum_pi_sq, is_weights=weights, with_metrics=False, **alg.term_inputs(mb))
        return Prepared(adv.advantages, weights, corr.keep, self._grad_keep(adv.advantages, mb, corr.keep))

    def _grad_keep(self, advantages: torch.Tensor, batch: RolloutBatch, keep: torch.Tensor) -> torch.Tensor | None:
        """The tokens whose gradient the step keeps, where Clip-Cov drops some of the kept ones (None: `keep`).
        Its selection is per group, so whole-group micro-batches and the full batch agree (docs/theory.md §16)."""
        if self.algorithm.clip_cov <= 0:
            return None
        return self.algorithm.clip_cov_keep(advantages, batch.sampler_logprobs.float(), keep,
                                            batch.group_ids).keep.to(keep.dtype)

    # ------------------------------------------------------------------------------- stage 5: micro-steps
    def _micro_steps(self, batch: RolloutBatch, rewards: torch.Tensor, ref_lp: torch.Tensor | None,
                    teacher_lp: torch.Tensor | None, plan: _Plan, prepass: _Prepass | None) -> _Accumulated:
        """`micro_step` on every micro-batch: the gradient of the full-batch loss accumulates in .grad; the
        records are assembled over the full batch (and summed over ranks)."""
        cfg, alg, par = self.cfg, self.algorithm, self.parallel
        rows, width = batch.response_ids.shape
        device = batch.response_ids.device
        mask = batch.train_mask.float()
        self.optimizer.zero_grad(set_to_none=True)
        norms = MicroNorms(self.params, alg.agg_mode) if plan.measure_noise else None
        fmodel = self.model if par is None else par.module
        share_prompts = self._share_prompts()
        compiling = cfg.trainer.compile
        if compiling:   # the shared-prompt pass re-compiles at every shape: the per-row pass, one graph
            fmodel, share_prompts = self._compiled_model(), False
        compile_before = compile_seconds() if compiling else 0.0
        forward = functools.partial(self._forward, fmodel, share_prompts=share_prompts)
        loss = functools.partial(self._micro_loss, ref_lp=ref_lp, teacher_lp=teacher_lp, full_mask=mask)
        started = time.perf_counter()
        records = []
        last = len(plan.micro_batches) - 1
        for k, index in enumerate(plan.micro_batches):
            # idle: a rank with fewer micro-batches than the others backwards a zero loss on row 0, so that
            # DDP / FSDP2 see the same sequence of (synced) backward passes on every rank
            idle = index is None
            idx = torch.as_tensor([0] if idle else index, dtype=torch.long, device=device)
            mb = trim_columns(batch.select(idx))
            t = mb.response_ids.shape[1]
            if prepass is not None:
                prepare = prepass.prepared.rows(idx, t)
            else:
                prepare = functools.partial(self._prepare, rewards=rewards[idx] if rewards.dim() == 1
                                            else rewards[idx][:, :t])
            with contextlib.nullcontext() if par is None else par.gradient_sync(k == last):
                # distributed: a non-finite loss is still backwarded (the other ranks wait in this step's
                # collectives) and the ranks skip the step together
                rec = micro_step(mb, idx, forward=forward, prepare=prepare, loss=loss, tokens=mb.train_mask,
                                 full_mask=mask, backward=self._backward(norms, mb, idle, synced=k == last),
                                 idle=idle, backward_bad=par is not None)
            records.append(rec)
            if rec.bad is not None and par is None:
                break
            fault_point("backward")  # reliability tests: COVRL_FAULT (no-op otherwise)
        acc = _Accumulated(collect(records, rows, width, device, prepared=prepass is None,
                                   weights=alg.uses_is_weights, truncation=self.truncation is not None),
                           norms=norms, started=started)
        if par is not None:
            self._reduce_over_ranks(acc)
        if compiling:
            acc.compile_s = compile_seconds() - compile_before
        return acc

    def _forward(self, model, mb: RolloutBatch, *, share_prompts: bool) -> ResponseForward:
        """The micro-step's forward: log-probs with grad at the sampler's temperature, the kept sets measured
        (replayed unless trainer.truncation=full), the sampler's top-k with score centring."""
        cfg = self.cfg
        return forward_batch(model, mb, self.temperature, share_prompts=share_prompts,
                             topk_ids=mb.sampler_topk_ids if self.algorithm.score_centering else None,
                             autocast=cfg.trainer.autocast, truncation=self.truncation, replay=self.replay,
                             packing=cfg.trainer.packing)

    def _backward(self, norms: MicroNorms | None, mb: RolloutBatch, idle: bool, *, synced: bool):
        """The micro-step's backward: one process's plain backward, or the ranks' (`Parallel.backward`); with the
        noise split, the micro-batch's gradient contribution measured around it (under DDP the synced
        micro-batch's own is read in the comm hook, before the all-reduce)."""
        par = self.parallel
        measured = norms is not None and not idle
        hooked = norms is not None and par is not None and synced

        def backward(loss: torch.Tensor) -> None:
            if measured:
                norms.before_backward()
            if par is None:
                loss.backward()
            else:
                par.backward(loss, local_gradients=norms if measured and hooked else None)
            if measured:
                norms.after_backward(mb.train_mask, hooked=hooked)

        return backward

    def _distilled(self, prep: Prepared, fwd: ResponseForward, teacher_lp: torch.Tensor, mask: torch.Tensor
                   ) -> Prepared:
        """A_t = coef·(log p_teacher(y_t) − log π(y_t)) + reward_weight·A_task_t: minus the per-token reverse KL
        to the teacher (no reward-to-go: each token answers for its own divergence), detached."""
        d = self.cfg.distill
        signal = d.coef * (teacher_lp - fwd.logprobs.detach()) * mask
        return replace(prep, advantages=d.reward_weight * prep.advantages + signal)

    def _micro_loss(self, mb: RolloutBatch, idx: torch.Tensor, fwd: ResponseForward, prep: Prepared, *,
                    ref_lp: torch.Tensor | None, teacher_lp: torch.Tensor | None, full_mask: torch.Tensor
                    ) -> LossTerms:
        """This micro-batch's share of the full batch's loss (policy + score centring + KL) and its metrics."""
        alg = self.algorithm
        t = mb.response_ids.shape[1]
        if teacher_lp is not None:   # the learning signal of on-policy distillation, per token
            prep = self._distilled(prep, fwd, teacher_lp[idx][:, :t], mb.train_mask.float())
        keep = prep.keep if prep.grad_keep is None else prep.grad_keep
        out = alg.policy_loss(logprobs=fwd.logprobs, sampler_logprobs=mb.sampler_logprobs.float(),
                              advantages=prep.advantages, mask=keep, is_weights=prep.weights)
        loss = micro_batch_share(out.token_loss, idx, full_mask, alg.aggregate)
        metrics = dict(out.metrics)
        metrics.pop("loss/value", None)
        metrics["loss/policy"] = float(loss.detach())
        if alg.score_centering:
            sc = alg.score_centering_term(fwd.topk_logprobs, mb.sampler_topk_logprobs.float(), prep.advantages,
                                          keep)
            sc_loss = micro_batch_share(sc.token_loss, idx, full_mask, alg.aggregate)
            loss = loss + sc_loss
            metrics.update({k: v for k, v in sc.metrics.items() if k != "score_center/value"})
            metrics["loss/score_centering"] = float(sc_loss.detach())
        kl = self.cfg.kl
        if ref_lp is not None and kl.mode == "loss":
            mask = mb.train_mask.float()
            k = kl_estimate(fwd.logprobs, ref_lp[idx][:, :t], kl.kind, straight_through=kl.straight_through) * mask
            kl_loss = kl.coef * micro_batch_share(k, idx, full_mask, alg.aggregate)
            loss = loss + kl_loss
            metrics["loss/kl"] = float(kl_loss.detach())
        return LossTerms(loss, metrics)

    def _reduce_over_ranks(self, acc: _Accumulated) -> None:
        """The full batch's pieces, loss and metrics from every rank's share; the noise split's norms of every
        rank's micro-batches."""
        p = acc.pieces
        p.loss, p.bad, p.metrics = self.parallel.reduce_step_pieces(p.tensors(), p.loss, p.bad, p.metrics)
        if acc.norms is not None:   # every rank's micro-batches are the small batches of the noise estimate
            acc.norms.rescale_gathered(self.parallel.gather_objects((acc.norms.norms_sq, acc.norms.sizes)),
                                       self.parallel.world)

    # ------------------------------------------------------------------------------------ stage 6: apply
    def _apply(self, lr: float) -> tuple[float | None, Any]:
        """Clip to the global gradient norm and step AdamW at `lr` (the new policy version), unless the
        gradient is exactly zero under `optim.skip_zero_gradient`. Returns (grad norm, no_signal), or
        (None, the norm) when the norm is not finite (gradients dropped, nothing applied)."""
        cfg = self.cfg
        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf
        grad_norm = _clip_grad_norm(self.params, max_norm)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return None, grad_norm
        # a zero gradient carries no signal; AdamW would still move the weights along its momentum (and decay
        # them), i.e. repeat the last informative batch's direction without new evidence
        no_signal = grad_norm == 0.0 and cfg.optim.skip_zero_gradient
        if no_signal:
            self.no_signal_steps += 1
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.bad_steps = 0
        return grad_norm, no_signal

    # ---------------------------------------------------------------------------------- stage 7: metrics
    def _metrics(self, metrics: dict[str, float], batch: RolloutBatch, rewards: torch.Tensor, acc: _Accumulated,
                 prepass: _Prepass | None, grad_norm: float, no_signal: bool) -> None:
        """The step's metrics on the full batch, into `metrics`, from the micro-steps' records (and the pre-pass)."""
        p = acc.pieces
        metrics.update(p.metrics)
        metrics.update(self._batch_diagnostics(batch, rewards, p.logprobs, p.entropy, p.sum_pi_sq, p.prepared,
                                               prepass))
        if p.truncation is not None:
            metrics.update(self._truncation_metrics(batch, p.truncation))
        if self.noise is not None:
            norms = acc.norms
            metrics.update(self.noise.update(grad_norm_sq=grad_norm ** 2,
                                             micro_grad_norms_sq=None if norms is None else norms.norms_sq,
                                             micro_batch_sizes=None if norms is None else norms.sizes,
                                             micro_scaled=True))
        metrics.update({
            "loss": p.loss, "grad_norm": grad_norm, "skipped": 0.0, "no_signal_step": float(no_signal),
            "no_signal_steps": float(self.no_signal_steps), "policy_version": float(self.version),
            "rollouts": float(self.rollouts),
        })

    def _batch_diagnostics(self, batch: RolloutBatch, rewards: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor,
                           sps: torch.Tensor, pieces: Prepared | None, prepass: _Prepass | None) -> dict[str, float]:
        """Full-batch metrics from the detached per-token quantities of the step (no extra forward) and the
        correction / advantages it computed: `pieces` assembled from whole-group micro-batches, or the pre-pass.

        The metrics equal those of rollout_correction and compute_advantages run on the full batch with the
        step's log-probs. The pieces reproduce those values bit for bit only when every quantity of a row is
        made of that row's own tokens one by one: a row sum (sequence-level IS weights, seq_* rejection
        criteria, scores of per-token rewards) over a micro-batch's trimmed width can round differently from the
        sum over the full width, and the pre-pass (other chunks, no grad) can differ from the step's forward by
        rounding. In those cases the correction / estimator runs once more on the full batch."""
        alg = self.algorithm
        mask = batch.train_mask.float()
        q = batch.sampler_logprobs.float()
        m: dict[str, float] = {"entropy": mean_over(ent, mask)}
        if prepass is not None and torch.equal(prepass.logprobs, lp) and torch.equal(prepass.sum_pi_sq, sps):
            m.update(prepass.metrics)          # the pre-pass saw the step's log-probs: its values are the step's
        else:
            if pieces is not None and alg.token_local_correction:
                weights = pieces.weights
                m.update(alg.correction_metrics(lp, q, mask, mask if weights is None else weights, pieces.keep))
            else:
                corr = alg.correct(lp, q, mask)
                weights = alg.is_weights(corr)
                m.update(corr.metrics)
            exact_advantages = pieces is not None and rewards.dim() == 1 and (
                alg.token_local_weights or not alg.estimator_takes_is_weights)
            if exact_advantages:
                m.update(alg.advantage_metrics(rewards=rewards, mask=mask, group_ids=batch.group_ids,
                                               advantages=pieces.advantages, logprobs=lp, sum_pi_sq=sps,
                                               is_weights=weights))
            else:
                m.update(alg.advantages(rewards=rewards, mask=mask, group_ids=batch.group_ids, logprobs=lp,
                                        sum_pi_sq=sps, is_weights=weights, **alg.term_inputs(batch)).metrics)
        given = pieces if prepass is None else prepass.prepared   # the step's advantages and keep-mask
        if alg.clip_cov > 0 and given is not None:   # what Clip-Cov took from the full batch
            m.update(alg.clip_cov_keep(given.advantages, q, given.keep, batch.group_ids).metrics)
        if self.cfg.logging.diagnostics:
            m.update(_tangent_metrics(lp, q, rewards, mask, batch.group_ids))
        m.update(self._fresh_mismatch(batch, lp, q, mask))
        return m

    def _fresh_mismatch(self, batch: RolloutBatch, lp: torch.Tensor, q: torch.Tensor, mask: torch.Tensor
                        ) -> dict[str, float]:
        """Token k3 between the sampler and the trainer on the rows generated at the trainer's own version (the
        weight-sync alarm's signal: at equal weights it is the engine floor)."""
        fresh = (batch.policy_version.to(mask.device) == self._version_at_start).float()[:, None] * mask
        k3 = KL_ESTIMATORS["k3"](clamped_log_ratio(lp, q))
        return {"mismatch/fresh_k3": mean_over(k3, fresh), "mismatch/fresh_rows": float((fresh.sum(1) > 0).sum())}

    def _truncation_metrics(self, batch: RolloutBatch, pieces: dict[str, torch.Tensor]) -> dict[str, float]:
        """The kept sets of a truncating sampler, measured on the trainer's logits (docs/theory.md §12)."""
        mask = batch.train_mask.float()
        log_mass = pieces["log_kept_mass"] * mask
        m = {"truncation/kept_mass_mean": mean_over(log_mass.exp(), mask),
             "truncation/kl_term": float((-log_mass).sum(1).mean()),   # E_q[−Σ_t log S_t] of KL_seq(q‖π)
             "truncation/sampled_outside_frac": mean_over(pieces["sampled_outside"], mask),
             "truncation/replay": float(self.replay)}
        if batch.sampler_kept is not None:
            m["truncation/count_mismatch_frac"] = mean_over(pieces["count_mismatch"], mask)
        return m

    # ------------------------------------------------------------------------------------------ helpers
    def _skip(self, metrics: dict[str, float], reason: str, t_start: float) -> StepResult:
        self.bad_steps += 1
        metrics.update({"skipped": 1.0, "bad_steps_in_row": float(self.bad_steps),
                        "policy_version": float(self.version), "rollouts": float(self.rollouts),
                        "time/trainer_step": time.perf_counter() - t_start})
        if self.bad_steps >= self.cfg.optim.max_bad_steps:
            raise TrainingDivergedError(
                f"{self.bad_steps} steps in a row skipped (optim.max_bad_steps={self.cfg.optim.max_bad_steps}); "
                f"last reason: {reason}. Lower optim.lr, enable optim.max_grad_norm or check the rewards.",
                metrics, reason)
        return StepResult(metrics, skip_reason=reason, version=self.version, rollouts=self.rollouts)

    def _share_prompts(self) -> bool:
        """optim.share_prompts, except under FSDP2 (one forward per micro-batch: each is a collective)."""
        return self.cfg.optim.share_prompts and (self.parallel is None or self.parallel.mode != "fsdp2")

    def _measures_noise(self) -> bool:
        """Whether this step measures the noise split: every `logging.noise_scale_every`-th optimizer step, by
        the policy version (checkpointed, and equal on every rank, whose collectives must agree)."""
        return self.noise is not None and self.version % self.cfg.logging.noise_scale_every == 0

    def _compiled_model(self) -> torch.nn.Module:
        """The torch.compile wrapper of the model (trainer.compile), made once per backend; it shares the
        model's parameters, so the optimizer, checkpoints and the sampler see the same tensors."""
        backend = self.cfg.trainer.compile_backend
        if self._compiled is None or self._compiled[0] != backend:
            self._compiled = (backend, compile_module(self.model, backend))
        return self._compiled[1]

    def _distribute(self) -> None:
        """Wrap the model for trainer.parallel (every rank at its first step; rank 0's weights win)."""
        fsdp2 = self.cfg.trainer.parallel == "fsdp2"
        # a resume from a one-process / DDP checkpoint (1 -> N): the plain optimizer's state, by parameter name
        carried = carry_optimizer_state(self.model, self.optimizer) if fsdp2 and self.optimizer.state else None
        self.parallel = Parallel.wrap(self.model, self.cfg.trainer.parallel)
        if self.ref_model is not None:   # replicated, not sharded: frozen, no gradients or optimizer state to split
            self.parallel.broadcast_module(self.ref_model)   # rank 0's reference (its warm-up or checkpoint)
        if self.parallel.mode == "ddp" and self.noise is not None:
            self.parallel.watch_local_gradients()
        if fsdp2:   # fully_shard replaced the parameters (DTensor shards): the for-each kernel
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = self._build_optimizer(fused=False)
            if self._pending_shards is not None:   # each rank reads its own shards of weights and moments
                load_sharded(self.model, self.optimizer, self._pending_shards, alone=False)
                self._pending_shards = None
            elif carried is not None:
                apply_optimizer_state(self.model, self.optimizer, carried)

    def _build_optimizer(self, fused: bool | None = None) -> torch.optim.AdamW:
        o = self.cfg.optim
        return build_adamw(self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=fused)

    @property
    def sharded(self) -> bool:
        """The model is fully_shard-ed: checkpoints go through `save_sharded` (torch.distributed.checkpoint)."""
        return self.parallel is not None and self.parallel.mode == "fsdp2"

    def full_weights(self) -> dict[str, torch.Tensor]:
        """fsdp2: the full weights gathered from the shards onto rank 0's CPU (the others get {}), for the sampler.
        A collective: rank 0 (the leader) tells the others to join."""
        if self.leader is None:
            return full_model_state(self.model)
        self.leader.send(("gather", None))
        weights = full_model_state(self.model)
        self.leader.close()
        return weights

    def save_sharded(self, folder) -> dict[str, torch.Tensor]:
        """fsdp2: write this rank's shards of weights and optimizer state into `folder`/dcp and return the full
        weights (rank 0; the others get {}). A collective: rank 0 (the leader) tells the others to join."""
        if self.leader is not None:
            self.leader.send(("checkpoint", str(folder)))
        weights = full_model_state(self.model)
        try:
            save_sharded(self.model, self.optimizer, Path(folder) / DCP_DIR)
        except ShardIOError:   # raised on every rank alike (DCP gathers the failures): the collectives are over
            if self.leader is not None:
                self.leader.close()
            raise
        if self.leader is not None:
            self.leader.close()
        return weights

    # --------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        if self.sharded:    # the optimizer state is in the shards (save_sharded), by its folder's name
            optimizer: dict[str, Any] = {DCP_KEY: DCP_DIR}
        elif self._pending_shards is not None:   # not loaded yet (the followers' "start"): where it is
            optimizer = {DCP_KEY: self._pending_shards}
        else:
            optimizer = self.optimizer.state_dict()
        return {"optimizer": optimizer, "surge": self.surge.state_dict(),
                "noise": None if self.noise is None else self.noise.state_dict(),
                "rollouts": self.rollouts, "version": self.version,
                "bad_steps": self.bad_steps, "no_signal_steps": self.no_signal_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optimizer = state["optimizer"]
        if DCP_KEY not in optimizer:
            self.optimizer.load_state_dict(optimizer)
        elif self.cfg.trainer.parallel == "fsdp2" and not self.sharded:
            self._pending_shards = str(optimizer[DCP_KEY])    # after the first step's fully_shard
        else:   # one process or DDP: this process reads the full tensors from the shards (any saving world size)
            load_sharded(self.model, self.optimizer, optimizer[DCP_KEY], alone=True)
        self.surge.load_state_dict(state["surge"])
        if self.noise is not None and state.get("noise") is not None:
            self.noise.load_state_dict(state["noise"])
        self.rollouts = int(state["rollouts"])
        self.version = int(state["version"])
        self.bad_steps = int(state["bad_steps"])
        self.no_signal_steps = int(state.get("no_signal_steps", 0))   # checkpoints from before the option



def batch_metrics(batch: ScoredBatch) -> dict[str, float]:
    """Reward, accuracy, pass@n, response length and zero-variance-group statistics of a scored batch.
    Accuracy and pass@n need `batch.correct` (per row, from `task.score`)."""
    mask = batch.train_mask.float()   # model tokens (an episode's tool results are not the model's length)
    lengths = mask.sum(1)
    seq_rewards = batch.sequence_rewards
    m = {
        "reward/mean": float(seq_rewards.mean()) if len(batch) else 0.0,
        "reward/std": float(seq_rewards.std(unbiased=False)) if len(batch) else 0.0,
        "response/length_mean": float(lengths.mean()) if len(batch) else 0.0,
        "response/length_max": float(lengths.max()) if len(batch) else 0.0,
        "response/empty_frac": float((lengths == 0).float().mean()) if len(batch) else 0.0,
        "response_tokens": float(lengths.sum()),
        "batch_rows": float(len(batch)),
    }
    _, inverse = torch.unique(batch.group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if len(batch) else 0
    if n_groups:
        m["zero_variance_groups"] = float(constant_groups(seq_rewards, inverse, n_groups).float().mean())
    correct = batch.correct
    if correct is not None and len(correct) == len(batch) and len(batch):
        c = torch.tensor([float(bool(x)) for x in correct], device=seq_rewards.device)
        m["accuracy"] = float(c.mean())
        gbest = torch.zeros(n_groups, device=c.device).scatter_reduce(0, inverse, c, "amax")
        m["pass@n"] = float(gbest.mean())
    return m


def _clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip to the global gradient norm and return it; sharded (DTensor) gradients reduce their norm over
    the ranks that hold them."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):   # a DTensor: the shards' partial norms
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


def _to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    """Batch tensors on `device`; tensors made under inference_mode (by a sampler) become normal tensors so
    autograd may save them."""
    fields = batch.tensor_fields()
    if all(v.device == device and not v.is_inference() for v in fields.values()):
        return batch
    return replace(batch, **{k: (v.clone() if v.is_inference() else v).to(device) for k, v in fields.items()})


def _check_self_teacher(cfg: TrainConfig, ref_model) -> None:
    """distill.teacher=self scores with this process's model: one trainer process, and the frozen initial weights
    passed as the reference model where they teach."""
    if cfg.trainer.parallel != "none":
        raise ValueError(f"distill.teacher=self runs with trainer.parallel=none (got {cfg.trainer.parallel}): the "
                         "self-teacher scores with the trainer's own model in one process")
    if needs_initial_weights(cfg) and ref_model is None:
        raise ValueError("distill.self_teacher.weights=initial scores with the frozen initial weights: pass them "
                         "(Trainer(model, cfg, ref_model=frozen_copy(model), teacher=...))")


def _distill_metrics(lp: torch.Tensor, teacher_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The student's reverse KL to the teacher on its own samples: per sequence (Σ_t log π − log p_T) and per token."""
    d = (lp - teacher_lp) * mask
    return {"distill/reverse_kl": float(d.sum(1).mean()), "distill/token_kl": mean_over(lp - teacher_lp, mask),
            "distill/teacher_logprob": mean_over(teacher_lp, mask)}

_TANGENT_KEYS = ("tangent", "remainder", "gain", "kl_seq", "bound", "bound_ratio")


def _tangent_metrics(lp, q, rewards, mask, group_ids) -> dict[str, float]:
    try:
        tr = tangent_remainder(lp, q, rewards, mask, group_ids=group_ids)
    except ValueError:  # a -inf log-prob of a sampled token (ppo_clip still steps): a diagnostic must not end the run
        return {}
    return {k: float(tr.metrics[k]) for k in _TANGENT_KEYS if k in tr.metrics}
