"""One optimisation step on a scored `RolloutBatch`; the algorithm (registry names in the config) is bound once
per Trainer (`covrl.train.step.algorithm.bind_algorithm`).

Per step (docs/theory.md §5–§8):
  1. (KL to a reference) reference log-probs, no grad; in `reward` mode R_b ← R_b − coef·Σ_t KL_t.
  2. Per micro-batch, ONE forward pass of the trainer gives log p(y_t|c_t) at the sampler's temperature (with
     grad), and, detached from the same logits, the entropy and Σπ² (OTB's logit-gradient proxy).
  3. `rollout_correction` (IS weights, rejection keep-mask, mismatch metrics), then `compute_advantages`
     (OTB receives the trainer log-probs, Σπ² and, when enabled, the IS weights).
  4. `policy_loss` (+ `score_centering_term` with the sampler's top-k from the batch) (+ KL in the loss).
     Pairing rule (declared with each registered loss, `LossSpec.takes_is_weights`): a loss whose ratio is
     taken against the sampler (ppo_clip) gets no IS weights; covariance and reinforce get the detached
     correction weights. Token losses of kept tokens are aggregated with the
     FULL batch's response mask, so rejected tokens count in the normaliser (TRM's "full count").
  5. backward per micro-batch (gradient accumulation), global-norm clipping, AdamW step with
     lr = peak · schedule(data clock) · length-surge scale.

Micro-batches hold whole groups when the group size allows: then every group statistic (advantage baselines)
is computed inside the micro-batch and the step needs one forward per row. Otherwise (a group larger than
`optim.micro_batch_size`, or `correction.is_batch_normalize`) a no-grad pre-pass computes the batch-level
statistics first. Metrics are always computed on the full batch, from the advantages and correction the step
already computed (per micro-batch, assembled, or the pre-pass's); the estimator or the correction runs again
on the full batch only where those pieces would not reproduce the full-batch values bit for bit (see
`_batch_diagnostics`).

The trainer does not know whether it runs in a sync or async loop: it only reads the batch.

With `trainer.parallel` = ddp / fsdp2 every rank calls `step` with the same full batch and runs only its shard
of whole groups (`covrl.train.parallel.wrappers.shard_rows`); each micro-batch's loss is its share of the FULL
batch's aggregate (times the world size, which DDP's / FSDP2's gradient averaging divides out), so the
normaliser is global whatever the split; the detached per-token pieces are summed over ranks, so metrics are
the full batch's; clipping sees the reduced (global) gradient. docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from covrl.diagnostics.noise import LOSS_UNITS, GradientNoiseMonitor
from covrl.diagnostics.tangent import tangent_remainder
from covrl.math import constant_groups, kl_estimate
from covrl.models.compiled import compile_module, compile_seconds
from covrl.models.forward import ResponseForward
from covrl.models.forward import forward_response as forward_response_tokens
from covrl.models.precision import check_autocast
from covrl.rollout.types import RolloutBatch, ScoredBatch
from covrl.train.faults import fault_point
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
from covrl.train.step.results import StepResult
from covrl.train.step.schedule import lr_factor

if TYPE_CHECKING:   # the run's config composes this room's sections: imported for types only
    from covrl.train.config import TrainConfig


class TrainingDivergedError(RuntimeError):
    """Raised after `optim.max_bad_steps` skipped (non-finite) steps in a row; `metrics` are the last skipped
    step's (so the loop can still log it)."""

    def __init__(self, message: str, metrics: dict[str, float] | None = None):
        super().__init__(message)
        self.metrics = dict(metrics or {})


@dataclass
class _Prepared:
    """Detached advantages, IS weights (None without is_level) and keep-mask of some rows: one micro-batch
    (from the pre-pass or computed in place) or the whole batch."""

    advantages: torch.Tensor
    weights: torch.Tensor | None
    keep: torch.Tensor

    def rows(self, idx: torch.Tensor, width: int) -> _Prepared:
        return _Prepared(self.advantages[idx][:, :width],
                         None if self.weights is None else self.weights[idx][:, :width], self.keep[idx][:, :width])


@dataclass
class _Prepass:
    """The pre-pass over the whole batch: its log-probs and Σπ², the batch-level quantities, and their metrics
    (correction, then advantages) on those log-probs."""

    logprobs: torch.Tensor
    sum_pi_sq: torch.Tensor
    prepared: _Prepared
    metrics: dict[str, float]


def _trim(mb: RolloutBatch) -> RolloutBatch:
    """Drop all-padding columns: leading prompt columns and trailing response columns (faster forward)."""
    prompt_cols = (mb.prompt_mask > 0).any(0).nonzero()
    p0 = int(prompt_cols[0]) if prompt_cols.numel() else mb.prompt_mask.shape[1]
    resp_cols = (mb.response_mask > 0).any(0).nonzero()
    t = int(resp_cols[-1]) + 1 if resp_cols.numel() else 1
    t = max(t, 1)
    upd: dict[str, Any] = {"prompt_ids": mb.prompt_ids[:, p0:], "prompt_mask": mb.prompt_mask[:, p0:],
                           "response_ids": mb.response_ids[:, :t], "response_mask": mb.response_mask[:, :t],
                           "sampler_logprobs": mb.sampler_logprobs[:, :t]}
    if mb.rewards is not None and mb.rewards.dim() == 2:
        upd["rewards"] = mb.rewards[:, :t]
    if mb.sampler_topk_ids is not None:
        upd["sampler_topk_ids"] = mb.sampler_topk_ids[:, :t]
    if mb.sampler_topk_logprobs is not None:
        upd["sampler_topk_logprobs"] = mb.sampler_topk_logprobs[:, :t]
    if mb.loss_mask is not None:
        upd["loss_mask"] = mb.loss_mask[:, :t]
    return replace(mb, **upd)


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    pad = torch.zeros((x.shape[0], width - x.shape[1], *x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    den = float(mask.sum())
    return float((x * mask).sum()) / den if den > 0 else 0.0


def forward_response(model, batch: RolloutBatch, temperature: float, *, with_stats: bool = True,
                     topk_ids: torch.Tensor | None = None, share_prompts: bool = True,
                     autocast: str = "none") -> ResponseForward:
    """Trainer log-probs (and detached entropy / Σπ², optional top-k log-probs) of the response tokens of
    `batch` in one forward pass: covrl.models.forward.forward_response on the batch's tensors (`autocast`:
    trainer.autocast; the log-probs are fp32 either way)."""
    return forward_response_tokens(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                   batch.response_mask, temperature, with_stats=with_stats, topk_ids=topk_ids,
                                   share_prompts=share_prompts, autocast=autocast)


class Trainer:
    """`Trainer(model, cfg, ref_model=None)`; `step(batch) -> dict[str, float]` (see the module docstring).

    State on the data clock: `rollouts` (consumed, including skipped steps), `version` (optimizer updates
    applied = policy version), `optimizer_steps`. `state_dict()` / `load_state_dict()` cover the optimizer,
    the length-surge schedule, the noise monitor and these counters.
    """

    def __init__(self, model, cfg: TrainConfig, ref_model=None):
        self.model = model
        self.cfg = cfg   # binds self.algorithm
        self.ref_model = ref_model
        if cfg.kl.coef > 0 and ref_model is None:
            raise ValueError("kl.coef > 0 needs a reference model (Trainer(model, cfg, ref_model=frozen_copy(model)))")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (requires_grad=False everywhere)")
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, **_fused_if_supported(self.params))
        self.surge = LengthSurgeSchedule(cfg.lr_surge, rollouts_per_step=cfg.loop.rollouts_per_step)
        self.noise = GradientNoiseMonitor() if cfg.logging.noise_scale else None
        if self.noise is not None and cfg.trainer.parallel == "fsdp2":   # a config changed after validation
            raise ValueError("logging.noise_scale=true is refused under trainer.parallel=fsdp2 (TrainConfig)")
        self.parallel: Parallel | None = None   # wrapped at the first step (a collective: all ranks step)
        self.leader = None    # rank 0 of a run: a Channel that sends each batch to the other ranks
        self._pending_shards: str | None = None   # fsdp2 resume: a dcp/ folder, loaded once the model is sharded
        self._hooked: _MicroNorms | None = None   # ddp: read by the comm hook during the synced backward
        self.temperature = float(cfg.sampler.temperature)
        check_autocast(cfg.trainer.autocast, self.params[0].device)   # warns where bf16 would be emulated
        self.rollouts = 0
        self.version = 0
        self.optimizer_steps = 0
        self.no_signal_steps = 0   # zero-gradient steps left out under optim.skip_zero_gradient
        self.bad_steps = 0
        self.last_skip_reason: str | None = None
        self._compiled: tuple[str, torch.nn.Module] | None = None   # (backend, torch.compile wrapper of the model)

    @property
    def cfg(self) -> TrainConfig:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: TrainConfig) -> None:
        # the algorithm is bound once per config; assigning another config (bench variants) rebinds it
        self._cfg = cfg
        self.algorithm: Algorithm = bind_algorithm(cfg)

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
        the update was not applied (reason in `skip_reason`, also `last_skip_reason`)."""
        if not isinstance(batch, ScoredBatch):
            raise ValueError("Trainer.step needs a ScoredBatch (batch.rewards is None): score the rollouts "
                             "(task.score) before Trainer.step")
        if self.leader is not None:
            self.leader.send(("step", batch))
        if self.cfg.trainer.parallel != "none" and self.parallel is None:
            self._distribute()
        metrics = self._step(batch)
        return StepResult(metrics, skip_reason=self.last_skip_reason, version=self.version, rollouts=self.rollouts)

    def _step(self, batch: ScoredBatch) -> dict[str, float]:
        t_start = time.perf_counter()
        cfg = self.cfg
        device = self.params[0].device
        batch = _to_device(batch, device)
        rows, width = batch.response_ids.shape
        mask = batch.train_mask.float()   # model tokens only: the normaliser, corrections and metrics
        lr = self.lr_at(self.rollouts, rows)
        metrics = batch_metrics(batch)
        self.rollouts += rows
        metrics["lr"] = lr
        self.last_skip_reason = None
        self.model.train()
        if rows == 0 or float(mask.sum()) == 0:
            return self._skip(metrics, "empty generations: the batch holds no response tokens", t_start)

        rewards = batch.rewards.float()
        par = self.parallel
        own = None if par is None else shard_rows(batch.group_ids, par.world, par.rank)
        ref_lp = self._reference_logprobs(batch, own) if self.ref_model is not None and cfg.kl.coef > 0 else None
        if ref_lp is not None:
            ref_kl = kl_estimate(batch.sampler_logprobs.float(), ref_lp, cfg.kl.kind) * mask
            metrics["kl_ref/seq_mean"] = float(ref_kl.sum(1).mean())
            metrics["kl_ref/token_mean"] = masked_mean(ref_kl, mask)
            if cfg.kl.mode == "reward":
                penalty = cfg.kl.coef * ref_kl.sum(1)
                rewards = rewards - (penalty if rewards.dim() == 1 else cfg.kl.coef * ref_kl)
                metrics["kl_ref/reward_penalty"] = float(penalty.mean())

        alg = self.algorithm
        plan, aligned = self._plan(batch, own)
        if par is not None:   # every rank runs as many micro-batches (the last one reduces the gradients)
            plan = plan + [None] * (par.max_count(len(plan)) - len(plan))
        prepass = None
        if not aligned or alg.needs_batch_statistics:
            prepass = self._prepass(batch, rewards, own)

        need_topk = alg.score_centering
        if need_topk and (batch.sampler_topk_ids is None or batch.sampler_topk_logprobs is None):
            raise ValueError("algorithm.score_centering needs the sampler's top-k (batch.sampler_topk_ids/"
                             "sampler_topk_logprobs); set sampler.return_topk > 0")

        self.optimizer.zero_grad(set_to_none=True)
        full_lp = torch.zeros((rows, width), dtype=torch.float32, device=device)
        full_ent = torch.zeros_like(full_lp)
        full_sps = torch.zeros_like(full_lp)
        # the per-micro-batch advantages / IS weights / keep-mask, assembled for the step's metrics
        pieces = None if prepass is not None else _Prepared(
            torch.zeros_like(full_lp), torch.zeros_like(full_lp) if alg.uses_is_weights else None,
            torch.zeros_like(full_lp))
        loss_total = 0.0
        loss_metrics: dict[str, float] = {}
        micro = _MicroNorms(self.params, alg.agg_mode) if self._measures_noise() else None
        fmodel = self.model if par is None else par.module
        share_prompts = self.cfg.optim.share_prompts and (par is None or par.mode != "fsdp2")  # fsdp2: 1 fwd each
        compiling = cfg.trainer.compile
        if compiling:   # the shared-prompt pass re-compiles at every shape: the per-row pass, one graph
            fmodel, share_prompts = self._compiled_model(), False
        bad: str | None = None
        t_fb = time.perf_counter()
        compile_before = compile_seconds() if compiling else 0.0
        for k, index in enumerate(plan):
            # idle: a rank with fewer micro-batches than the others backwards a zero loss on row 0, so that
            # DDP / FSDP2 see the same sequence of (synced) backward passes on every rank
            idle = index is None
            idx = torch.as_tensor([0] if idle else index, dtype=torch.long, device=device)
            mb = _trim(batch.select(idx))
            with contextlib.nullcontext() if par is None else par.gradient_sync(k == len(plan) - 1):
                fwd = forward_response(fmodel, mb, self.temperature, share_prompts=share_prompts,
                                       topk_ids=mb.sampler_topk_ids if need_topk else None,
                                       autocast=cfg.trainer.autocast)
                t = mb.response_ids.shape[1]
                mb_rewards = rewards[idx] if rewards.dim() == 1 else rewards[idx][:, :t]
                if prepass is None:
                    prep = self._prepare(mb, fwd, mb_rewards)
                    if not idle:
                        pieces.advantages[idx] = _pad_cols(prep.advantages, width)
                        pieces.keep[idx] = _pad_cols(prep.keep, width)
                        if prep.weights is not None:
                            pieces.weights[idx] = _pad_cols(prep.weights, width)
                else:
                    prep = prepass.prepared.rows(idx, t)
                if not idle:
                    full_lp[idx] = _pad_cols(fwd.logprobs.detach(), width)
                    full_ent[idx] = _pad_cols(fwd.entropy, width)
                    full_sps[idx] = _pad_cols(fwd.sum_pi_sq, width)
                mb_ref = None if ref_lp is None else ref_lp[idx][:, :t]
                loss, mb_metrics = self._micro_loss(mb, fwd, prep, mb_ref, idx, mask)
                if idle:
                    loss = loss * 0.0
                elif not torch.isfinite(loss):
                    reason = f"non-finite loss ({float(loss.detach())}) in a micro-batch of {len(index)} rows"
                    if par is None:
                        self.optimizer.zero_grad(set_to_none=True)
                        return self._skip(metrics, reason, t_start)
                    bad = bad or reason   # the other ranks wait in this step's collectives: skip together
                # ddp's synced micro-batch: its contribution is read in the comm hook, before the all-reduce
                hooked = micro is not None and par is not None and k == len(plan) - 1
                if micro is not None and not idle:
                    micro.before_backward()
                    self._hooked = micro if hooked else None
                # world size x: DDP / FSDP2 average the ranks' gradients, the loss shares must add up
                (loss if par is None else loss * par.world).backward()
                self._hooked = None
            if micro is not None and not idle:
                micro.after_backward(mb.train_mask, hooked=hooked)
            fault_point("backward")  # reliability tests: COVRL_FAULT (no-op otherwise)
            loss_total += 0.0 if idle else float(loss.detach())
            share = 0.0 if idle else float(mb.train_mask.sum()) / float(mask.sum())   # idle: keys, no weight
            fold_micro_metrics(loss_metrics, mb_metrics, share, idle or share == 0.0)   # no tokens: no extremes
        if par is not None:
            loss_total, bad, loss_metrics = self._reduce_pieces(par, [full_lp, full_ent, full_sps], pieces,
                                                                loss_total, bad, loss_metrics)
            if micro is not None:   # every rank's micro-batches are the small batches of the noise estimate
                micro.gather(par)
            if bad is not None:
                self.optimizer.zero_grad(set_to_none=True)
                return self._skip(metrics, bad, t_start)
        t_opt = time.perf_counter()
        if compiling:   # included in time/forward_backward; reported apart so that later steps read honestly
            metrics["time/compile_s"] = compile_seconds() - compile_before
        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf
        grad_norm = _clip_grad_norm(self.params, max_norm)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return self._skip(metrics, f"non-finite gradient norm ({grad_norm})", t_start)
        # a zero gradient carries no signal; AdamW would still move the weights along its momentum (and decay
        # them), i.e. repeat the last informative batch's direction without new evidence
        no_signal = grad_norm == 0.0 and cfg.optim.skip_zero_gradient
        if no_signal:
            self.no_signal_steps += 1
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.optimizer_steps += 1
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.bad_steps = 0
        t_end = time.perf_counter()

        metrics.update(loss_metrics)
        metrics.update(self._batch_diagnostics(batch, rewards, full_lp, full_ent, full_sps, pieces, prepass))
        if self.noise is not None:
            metrics.update(self.noise.update(grad_norm_sq=grad_norm ** 2,
                                             micro_grad_norms_sq=None if micro is None else micro.norms_sq,
                                             micro_batch_sizes=None if micro is None else micro.sizes,
                                             micro_scaled=True))
        metrics.update({
            "loss": loss_total, "grad_norm": grad_norm, "skipped": 0.0, "no_signal_step": float(no_signal),
            "no_signal_steps": float(self.no_signal_steps),
            "time/forward_backward": t_opt - t_fb, "time/optimizer": t_end - t_opt,
            "time/trainer_step": t_end - t_start, "policy_version": float(self.version),
            "rollouts": float(self.rollouts), "optimizer_steps": float(self.optimizer_steps),
            "train_tokens_per_s": float(mask.sum()) / max(t_end - t_start, 1e-9),
        })
        signal_key = self.cfg.lr_surge.metric_key
        if signal_key in metrics:
            metrics.update(self.surge.update(max(0.0, metrics[signal_key]), self.rollouts))
        return metrics

    # ------------------------------------------------------------------------------------------ helpers
    def _skip(self, metrics: dict[str, float], reason: str, t_start: float) -> dict[str, float]:
        self.bad_steps += 1
        self.last_skip_reason = reason
        metrics.update({"skipped": 1.0, "bad_steps_in_row": float(self.bad_steps),
                        "policy_version": float(self.version), "rollouts": float(self.rollouts),
                        "optimizer_steps": float(self.optimizer_steps),
                        "time/trainer_step": time.perf_counter() - t_start})
        if self.bad_steps >= self.cfg.optim.max_bad_steps:
            raise TrainingDivergedError(
                f"{self.bad_steps} steps in a row skipped (optim.max_bad_steps={self.cfg.optim.max_bad_steps}); "
                f"last reason: {reason}. Lower optim.lr, enable optim.max_grad_norm or check the rewards.",
                metrics)
        return metrics

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
            self.parallel.module.register_comm_hook(self, _local_norm_hook)
        if fsdp2:   # fully_shard replaced the parameters (DTensor shards)
            o = self.cfg.optim
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                               weight_decay=o.weight_decay)
            if self._pending_shards is not None:   # each rank reads its own shards of weights and moments
                load_sharded(self.model, self.optimizer, self._pending_shards, alone=False)
                self._pending_shards = None
            elif carried is not None:
                apply_optimizer_state(self.model, self.optimizer, carried)

    @property
    def sharded(self) -> bool:
        """The model is fully_shard-ed: checkpoints go through `save_sharded` (torch.distributed.checkpoint)."""
        return self.parallel is not None and self.parallel.mode == "fsdp2"

    def full_weights(self) -> dict[str, torch.Tensor]:
        """fsdp2: the full weights gathered from the shards onto rank 0's CPU (the others get {}), for the sampler.
        A collective: rank 0 (the leader) tells the others to join."""
        if self.leader is not None:
            self.leader.send(("gather", None))
        return full_model_state(self.model)

    def save_sharded(self, folder) -> dict[str, torch.Tensor]:
        """fsdp2: write this rank's shards of weights and optimizer state into `folder`/dcp and return the full
        weights (rank 0; the others get {}). A collective: rank 0 (the leader) tells the others to join."""
        if self.leader is not None:
            self.leader.send(("checkpoint", str(folder)))
        weights = full_model_state(self.model)
        save_sharded(self.model, self.optimizer, Path(folder) / DCP_DIR)
        return weights

    @staticmethod
    def _reduce_pieces(par: Parallel, tensors: list[torch.Tensor], pieces: _Prepared | None, loss_total: float,
                       bad: str | None, loss_metrics: dict[str, float]):
        """Sum over ranks (in place) the per-row pieces that each rank filled for its rows only (zeros
        elsewhere, so the sum is exact), the loss and its share-weighted metrics, and whether any rank met a
        non-finite loss."""
        if pieces is not None:
            tensors = tensors + [pieces.advantages, pieces.keep] + ([] if pieces.weights is None else [pieces.weights])
        stacked = par.all_reduce(torch.stack(tensors))
        for t, total in zip(tensors, stacked):
            t.copy_(total)
        keys = sorted(k for k in loss_metrics if not k.endswith(("_max", "_min")))   # the same on every rank:
        extreme = sorted(k for k in loss_metrics if k.endswith(("_max", "_min")))   # idle ranks compute them too
        sums = par.all_reduce(torch.tensor([loss_total, float(bad is not None)] + [loss_metrics[k] for k in keys],
                                           dtype=torch.float64))
        sign = [1.0 if k.endswith("_max") else -1.0 for k in extreme]   # a min is minus the max of minus
        maxes = par.all_reduce(torch.tensor([s * loss_metrics[k] for s, k in zip(sign, extreme)] or [0.0],
                                            dtype=torch.float64), dist.ReduceOp.MAX)
        if sums[1] > 0 and bad is None:
            bad = "non-finite loss in a micro-batch of another rank"
        out = dict(zip(keys, sums[2:].tolist()))
        out.update({k: s * float(v) for s, k, v in zip(sign, extreme, maxes)})
        return float(sums[0]), bad, out

    def _measures_noise(self) -> bool:
        """Whether this step measures the noise split: every `logging.noise_scale_every`-th optimizer step, by
        the policy version (checkpointed, and equal on every rank, whose collectives must agree)."""
        return self.noise is not None and self.version % self.cfg.logging.noise_scale_every == 0

    def _plan(self, batch: RolloutBatch, own: list[int] | None = None) -> tuple[list[list[int]], bool]:
        """Micro-batches of at most `optim.micro_batch_size` rows made of whole groups (aligned=True), or
        plain chunks when a group is larger than a micro-batch (aligned=False); of the rows `own` (a rank's
        shard of whole groups) when given."""
        size = self.cfg.optim.micro_batch_size
        groups: dict[int, list[int]] = {}
        for row, gid in enumerate(batch.group_ids.tolist()):
            groups.setdefault(int(gid), []).append(row)
        rows = list(range(len(batch))) if own is None else own
        if any(len(g) > size for g in groups.values()):   # the full batch's groups: every rank takes one path
            return [rows[s:s + size] for s in range(0, len(rows), size)], False
        mine = set(rows)
        plan: list[list[int]] = []
        current: list[int] = []
        for g in (g for g in groups.values() if g[0] in mine):
            if current and len(current) + len(g) > size:
                plan.append(current)
                current = []
            current = current + g
        if current:
            plan.append(current)
        if self._measures_noise() and own is None and len(plan) == 1 and len(groups) >= 2:
            plan = _halves(list(groups.values()))   # two batch sizes for the noise estimate, same total gradient
        return plan, True

    def _prepare(self, mb: RolloutBatch, fwd: ResponseForward, rewards: torch.Tensor) -> _Prepared:
        """Correction and advantages of a micro-batch that holds whole groups (their metrics come later, once,
        on the full batch)."""
        alg = self.algorithm
        mask = mb.train_mask.float()
        lp = fwd.logprobs.detach()
        corr = alg.correct(lp, mb.sampler_logprobs.float(), mask, with_metrics=False)
        weights = alg.is_weights(corr)
        adv = alg.advantages(rewards=rewards, mask=mask, group_ids=mb.group_ids, logprobs=lp,
                             sum_pi_sq=fwd.sum_pi_sq, is_weights=weights, with_metrics=False)
        return _Prepared(adv.advantages, weights, corr.keep)

    @torch.no_grad()
    def _prepass(self, batch: RolloutBatch, rewards: torch.Tensor, own: list[int] | None = None) -> _Prepass:
        """No-grad forward over the whole batch for batch-level statistics (groups split over micro-batches or
        batch-normalised IS weights). Distributed: each rank forwards its rows `own`, the log-probs and Σπ² are
        summed over ranks, and every rank computes the statistics on the full batch."""
        alg = self.algorithm
        par = self.parallel
        rows, width = batch.response_ids.shape
        device = batch.response_ids.device
        lp = torch.zeros((rows, width), dtype=torch.float32, device=device)
        sps = torch.zeros_like(lp)
        size = self.cfg.optim.micro_batch_size
        mine = list(range(rows)) if own is None else own
        chunks: list[list[int] | None] = [mine[s:s + size] for s in range(0, len(mine), size)]
        if par is not None and par.mode == "fsdp2":   # every forward of a sharded model is a collective
            chunks += [None] * (par.max_count(len(chunks)) - len(chunks))
        share_prompts = self.cfg.optim.share_prompts and (par is None or par.mode != "fsdp2")
        for chunk in chunks:
            idx = torch.as_tensor([0] if chunk is None else chunk, dtype=torch.long, device=device)
            mb = _trim(batch.select(idx))
            fwd = forward_response(self.model, mb, self.temperature, share_prompts=share_prompts,
                                   autocast=self.cfg.trainer.autocast)
            if chunk is not None:
                lp[idx] = _pad_cols(fwd.logprobs.float(), width)
                sps[idx] = _pad_cols(fwd.sum_pi_sq, width)
        if par is not None:
            both = par.all_reduce(torch.stack([lp, sps]))
            lp, sps = both[0], both[1]
        mask = batch.train_mask.float()
        corr = alg.correct(lp, batch.sampler_logprobs.float(), mask)
        weights = alg.is_weights(corr)
        adv = alg.advantages(rewards=rewards, mask=mask, group_ids=batch.group_ids, logprobs=lp, sum_pi_sq=sps,
                             is_weights=weights)
        return _Prepass(lp, sps, _Prepared(adv.advantages, weights, corr.keep), {**corr.metrics, **adv.metrics})

    @torch.no_grad()
    def _reference_logprobs(self, batch: RolloutBatch, own: list[int] | None = None) -> torch.Tensor:
        """The frozen reference's log-probs of the full batch. Distributed (`own`: this rank's rows): each rank
        forwards its shard through its replica of the reference and one all-reduce SUM assembles the full
        batch's (the other rows are zeros: exact), which the reward-mode penalty and the metrics need."""
        rows, width = batch.response_ids.shape
        out = torch.zeros((rows, width), dtype=torch.float32, device=batch.response_ids.device)
        mine = torch.arange(rows, device=out.device) if own is None else torch.as_tensor(own, dtype=torch.long,
                                                                                           device=out.device)
        size = self.cfg.optim.micro_batch_size
        for s in range(0, len(mine), size):
            idx = mine[s:s + size]
            mb = _trim(batch.select(idx))
            # the reference in the trainer's precision: at the start (policy = reference) their KL is exactly 0
            fwd = forward_response(self.ref_model, mb, self.temperature, with_stats=False,
                                   share_prompts=self.cfg.optim.share_prompts, autocast=self.cfg.trainer.autocast)
            out[idx] = _pad_cols(fwd.logprobs.float(), width)
        return out if own is None else self.parallel.all_reduce(out)

    def _global(self, token_loss: torch.Tensor, idx: torch.Tensor, full_mask: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the full-batch aggregate: its token losses placed in a [B, T] zero tensor
        and aggregated with the full batch's mask, so the micro-batch losses sum to the full-batch loss."""
        padded = _pad_cols(token_loss.float(), full_mask.shape[1])
        full = torch.zeros(full_mask.shape, dtype=torch.float32, device=padded.device).index_copy(0, idx, padded)
        return self.algorithm.aggregate(full, full_mask)

    def _micro_loss(self, mb: RolloutBatch, fwd: ResponseForward, prep: _Prepared, ref_lp: torch.Tensor | None,
                    idx: torch.Tensor, full_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        alg = self.algorithm
        out = alg.policy_loss(logprobs=fwd.logprobs, sampler_logprobs=mb.sampler_logprobs.float(),
                              advantages=prep.advantages, mask=prep.keep, is_weights=prep.weights)
        loss = self._global(out.token_loss, idx, full_mask)
        metrics = dict(out.metrics)
        metrics.pop("loss/value", None)
        metrics["loss/policy"] = float(loss.detach())
        if alg.score_centering:
            sc = alg.score_centering_term(fwd.topk_logprobs, mb.sampler_topk_logprobs.float(), prep.advantages,
                                          prep.keep)
            sc_loss = self._global(sc.token_loss, idx, full_mask)
            loss = loss + sc_loss
            metrics.update({k: v for k, v in sc.metrics.items() if k != "score_center/value"})
            metrics["loss/score_centering"] = float(sc_loss.detach())
        kl = self.cfg.kl
        if ref_lp is not None and kl.mode == "loss":
            mask = mb.train_mask.float()
            k = kl_estimate(fwd.logprobs, ref_lp, kl.kind, straight_through=kl.straight_through) * mask
            kl_loss = kl.coef * self._global(k, idx, full_mask)
            loss = loss + kl_loss
            metrics["loss/kl"] = float(kl_loss.detach())
        return loss, metrics

    def _batch_diagnostics(self, batch: RolloutBatch, rewards: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor,
                           sps: torch.Tensor, pieces: _Prepared | None, prepass: _Prepass | None) -> dict[str, float]:
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
        m: dict[str, float] = {"entropy": masked_mean(ent, mask)}
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
                                        sum_pi_sq=sps, is_weights=weights).metrics)
        if self.cfg.logging.diagnostics:
            m.update(_tangent_metrics(lp, q, rewards, mask, batch.group_ids))
        return m

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
                "rollouts": self.rollouts, "version": self.version, "optimizer_steps": self.optimizer_steps,
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
        self.optimizer_steps = int(state["optimizer_steps"])
        self.bad_steps = int(state["bad_steps"])
        self.no_signal_steps = int(state.get("no_signal_steps", 0))   # checkpoints from before the option


def batch_metrics(batch: ScoredBatch) -> dict[str, float]:
    """Reward, accuracy, pass@n, response length and zero-variance-group statistics of a scored batch.
    Accuracy and pass@n need `batch.correct` (per row, from `task.score`)."""
    mask = batch.train_mask.float()   # model tokens (an episode's tool results are not the model's length)
    lengths = mask.sum(1)
    rewards = batch.rewards.float()
    seq_rewards = rewards if rewards.dim() == 1 else (rewards * mask).sum(1)
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


_LOSS_PARTS = ("loss/policy", "loss/score_centering", "loss/kl")


def fold_micro_metrics(total: dict[str, float], mb_metrics: dict[str, float], share: float, idle: bool) -> None:
    """Fold a micro-batch's loss metrics into the step's: the loss parts (already this micro-batch's share of
    the full-batch loss) add up, *_max / *_min take the extreme, the other means weigh by the token share. An
    idle micro-batch adds its keys only."""
    for key, v in mb_metrics.items():
        if key.endswith("_max"):
            total[key] = max(total.get(key, -math.inf), -math.inf if idle else v)
        elif key.endswith("_min"):
            total[key] = min(total.get(key, math.inf), math.inf if idle else v)
        else:
            total[key] = total.get(key, 0.0) + (0.0 if idle else v if key in _LOSS_PARTS else share * v)


def _clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip to the global gradient norm and return it; sharded (DTensor) gradients reduce their norm over
    the ranks that hold them."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):   # a DTensor: the shards' partial norms
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


def _fused_if_supported(params) -> dict[str, bool]:
    """The fused AdamW kernel (one pass over each tensor) when every parameter is a float tensor on CPU/CUDA."""
    ok = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return {"fused": True} if ok else {}


def _to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    """Batch tensors on `device`; tensors made under inference_mode (by a sampler) become normal tensors so
    autograd may save them."""
    fields = batch.tensor_fields()
    if all(v.device == device and not v.is_inference() for v in fields.values()):
        return batch
    return replace(batch, **{k: (v.clone() if v.is_inference() else v).to(device) for k, v in fields.items()})


def _halves(groups: list[list[int]]) -> list[list[int]]:
    """Two micro-batches of whole groups with row counts as equal as the groups allow."""
    total = sum(len(g) for g in groups)
    first: list[int] = []
    k = 0
    while k < len(groups) - 1 and abs(2 * (len(first) + len(groups[k])) - total) <= abs(2 * len(first) - total):
        first += groups[k]
        k += 1
    if not first:
        first, k = list(groups[0]), 1
    return [first, [row for g in groups[k:] for row in g]]


class _MicroNorms:
    """Squared norm and size (in the loss's averaging unit) of each micro-batch's contribution to the accumulated
    gradient: ‖.grad after − .grad before‖², with one snapshot of .grad kept between backward passes."""

    def __init__(self, params: list[torch.Tensor], agg_mode: str):
        self.params = params
        self.count_tokens = LOSS_UNITS.get(agg_mode, "rows") == "tokens"
        self.norms_sq: list[float] = []
        self.sizes: list[float] = []
        self._before: list[torch.Tensor | None] | None = None
        self._index = {id(p): i for i, p in enumerate(params)}
        self._hooked_sq = 0.0

    def before_backward(self) -> None:
        if self.norms_sq:  # the first micro-batch starts from zero gradients: no snapshot needed
            self._before = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    @torch.no_grad()
    def _contribution_sq(self, params, grads) -> float:
        prev = [None if self._before is None else self._before[self._index[id(p)]] for p in params]
        if any(b is not None for b in prev):
            grads = [g if b is None else g - b for g, b in zip(grads, prev)]
        # fused per-tensor norms (fp32 accumulation is ample for a noise estimate), summed in float64
        return sum(float(n) ** 2 for n in torch._foreach_norm(grads)) if grads else 0.0

    def from_bucket(self, bucket) -> None:
        """DDP's comm hook, before the all-reduce: this rank's accumulated gradient of a bucket's parameters."""
        self._hooked_sq += self._contribution_sq(bucket.parameters(), bucket.gradients())

    def gather(self, par: Parallel) -> None:
        """Every rank's micro-batch norms and sizes, in rank order; the norms back in the loss's own scale (each
        rank backwarded its loss times the world size)."""
        parts: list[Any] = [None] * par.world
        dist.all_gather_object(parts, (self.norms_sq, self.sizes))
        self.norms_sq = [v / par.world ** 2 for norms, _ in parts for v in norms]
        self.sizes = [v for _, sizes in parts for v in sizes]

    @torch.no_grad()
    def after_backward(self, response_mask: torch.Tensor, hooked: bool = False) -> None:
        if hooked:   # the synced backward: .grad holds the ranks' average now, the hook saw this rank's own
            total, self._hooked_sq = self._hooked_sq, 0.0
        else:
            params = [p for p in self.params if p.grad is not None]
            total = self._contribution_sq(params, [p.grad for p in params])
        self._before = None
        self.norms_sq.append(total)
        rows_with_tokens = (response_mask.sum(1) > 0).sum()
        self.sizes.append(float(response_mask.sum() if self.count_tokens else rows_with_tokens))


def _local_norm_hook(trainer: Trainer, bucket):
    """DDP comm hook (with logging.noise_scale): the bucket's local gradients feed the micro-batch noise split
    (no extra backward), then DDP's own averaging all-reduce."""
    if trainer._hooked is not None:
        trainer._hooked.from_bucket(bucket)
    return allreduce_hook(None, bucket)


_TANGENT_KEYS = ("tangent", "remainder", "gain", "kl_seq", "bound", "bound_ratio")


def _tangent_metrics(lp, q, rewards, mask, group_ids) -> dict[str, float]:
    try:
        tr = tangent_remainder(lp, q, rewards, mask, group_ids=group_ids)
    except ValueError:  # a -inf log-prob of a sampled token (ppo_clip still steps): a diagnostic must not end the run
        return {}
    return {k: float(tr.metrics[k]) for k in _TANGENT_KEYS if k in tr.metrics}
