"""One optimisation step on a scored `RolloutBatch`; the algorithm (registry names in the config) is bound once
per Trainer (`covrl.train.algorithm.bind_algorithm`).

Per step (RESEARCH §5–§8):
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
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from covrl.diagnostics.noise import LOSS_UNITS, GradientNoiseMonitor
from covrl.diagnostics.tangent import tangent_remainder
from covrl.math import aggregate, kl_estimate
from covrl.models.forward import ResponseForward
from covrl.models.forward import forward_response as forward_response_tokens
from covrl.rollout.types import RolloutBatch, ScoredBatch
from covrl.train.algorithm import Algorithm, bind_algorithm
from covrl.train.batch_scaling import scaled_lr
from covrl.train.config import TrainConfig
from covrl.train.faults import fault_point
from covrl.train.lr_surge import LengthSurgeSchedule
from covrl.train.results import StepResult
from covrl.train.schedule import lr_factor


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
                     topk_ids: torch.Tensor | None = None, share_prompts: bool = True) -> ResponseForward:
    """Trainer log-probs (and detached entropy / Σπ², optional top-k log-probs) of the response tokens of
    `batch` in one forward pass: covrl.models.forward.forward_response on the batch's tensors."""
    return forward_response_tokens(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                   batch.response_mask, temperature, with_stats=with_stats, topk_ids=topk_ids,
                                   share_prompts=share_prompts)


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
        self.temperature = float(cfg.sampler.temperature)
        self.rollouts = 0
        self.version = 0
        self.optimizer_steps = 0
        self.bad_steps = 0
        self.last_skip_reason: str | None = None

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
        batch_scaling.scale_lr (AdamW: square root; covrl.train.batch_scaling)."""
        o = self.cfg.optim
        b = self.cfg.loop.rollouts_per_step if batch_rollouts is None else batch_rollouts
        f = lr_factor(rollouts, b, warmup=o.warmup_rollouts, total=self.cfg.total_rollouts,
                      schedule=o.schedule, min_ratio=o.min_lr_ratio)
        return scaled_lr(o.lr, self.cfg.loop.rollouts_per_step, self.cfg.batch_scaling) * f * self.surge.scale

    # --------------------------------------------------------------------------------------------- step
    def step(self, batch: ScoredBatch) -> StepResult:
        """One optimizer step on a scored batch. The result's metrics are flat floats; `skipped` = 1 when
        the update was not applied (reason in `skip_reason`, also `last_skip_reason`)."""
        if not isinstance(batch, ScoredBatch):
            raise ValueError("Trainer.step needs a ScoredBatch (batch.rewards is None): score the rollouts "
                             "(task.score) before Trainer.step")
        metrics = self._step(batch)
        return StepResult(metrics, skip_reason=self.last_skip_reason, version=self.version, rollouts=self.rollouts)

    def _step(self, batch: ScoredBatch) -> dict[str, float]:
        t_start = time.perf_counter()
        cfg = self.cfg
        device = self.params[0].device
        batch = _to_device(batch, device)
        rows, width = batch.response_ids.shape
        mask = batch.response_mask.float()
        lr = self.lr_at(self.rollouts, rows)
        metrics = batch_metrics(batch)
        self.rollouts += rows
        metrics["lr"] = lr
        self.last_skip_reason = None
        self.model.train()
        if rows == 0 or float(mask.sum()) == 0:
            return self._skip(metrics, "empty generations: the batch holds no response tokens", t_start)

        rewards = batch.rewards.float()
        ref_lp = self._reference_logprobs(batch) if self.ref_model is not None and cfg.kl.coef > 0 else None
        if ref_lp is not None:
            ref_kl = kl_estimate(batch.sampler_logprobs.float(), ref_lp, cfg.kl.kind) * mask
            metrics["kl_ref/seq_mean"] = float(ref_kl.sum(1).mean())
            metrics["kl_ref/token_mean"] = masked_mean(ref_kl, mask)
            if cfg.kl.mode == "reward":
                penalty = cfg.kl.coef * ref_kl.sum(1)
                rewards = rewards - (penalty if rewards.dim() == 1 else cfg.kl.coef * ref_kl)
                metrics["kl_ref/reward_penalty"] = float(penalty.mean())

        alg = self.algorithm
        plan, aligned = self._plan(batch)
        prepass = None
        if not aligned or alg.needs_batch_statistics:
            prepass = self._prepass(batch, rewards)

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
        micro = _MicroNorms(self.params, alg.agg_mode) if self.noise is not None else None
        t_fb = time.perf_counter()
        for index in plan:
            idx = torch.as_tensor(index, dtype=torch.long, device=device)
            mb = _trim(batch.select(idx))
            fwd = forward_response(self.model, mb, self.temperature, share_prompts=self.cfg.optim.share_prompts,
                                   topk_ids=mb.sampler_topk_ids if need_topk else None)
            t = mb.response_ids.shape[1]
            full_lp[idx] = _pad_cols(fwd.logprobs.detach(), width)
            full_ent[idx] = _pad_cols(fwd.entropy, width)
            full_sps[idx] = _pad_cols(fwd.sum_pi_sq, width)
            mb_rewards = rewards[idx] if rewards.dim() == 1 else rewards[idx][:, :t]
            if prepass is None:
                prep = self._prepare(mb, fwd, mb_rewards)
                pieces.advantages[idx] = _pad_cols(prep.advantages, width)
                pieces.keep[idx] = _pad_cols(prep.keep, width)
                if prep.weights is not None:
                    pieces.weights[idx] = _pad_cols(prep.weights, width)
            else:
                prep = prepass.prepared.rows(idx, t)
            mb_ref = None if ref_lp is None else ref_lp[idx][:, :t]
            loss, mb_metrics = self._micro_loss(mb, fwd, prep, mb_ref, idx, mask)
            if not torch.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                return self._skip(metrics, f"non-finite loss ({float(loss.detach())}) in a micro-batch of {len(index)} rows",
                                  t_start)
            if micro is not None:
                micro.before_backward()
            loss.backward()
            if micro is not None:
                micro.after_backward(mb.response_mask)
            fault_point("backward")  # reliability tests: COVRL_FAULT (no-op otherwise)
            loss_total += float(loss.detach())
            share = float(mb.response_mask.sum()) / float(mask.sum())
            for k, v in mb_metrics.items():
                loss_metrics[k] = loss_metrics.get(k, 0.0) + share * v
        t_opt = time.perf_counter()
        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return self._skip(metrics, f"non-finite gradient norm ({grad_norm})", t_start)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self.version += 1
        self.bad_steps = 0
        t_end = time.perf_counter()

        metrics.update(loss_metrics)
        metrics.update(self._batch_diagnostics(batch, rewards, full_lp, full_ent, full_sps, pieces, prepass))
        if self.noise is not None:
            metrics.update(self.noise.update(grad_norm_sq=grad_norm ** 2, micro_grad_norms_sq=micro.norms_sq,
                                             micro_batch_sizes=micro.sizes, micro_scaled=True))
        metrics.update({
            "loss": loss_total, "grad_norm": grad_norm, "skipped": 0.0,
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

    def _plan(self, batch: RolloutBatch) -> tuple[list[list[int]], bool]:
        """Micro-batches of at most `optim.micro_batch_size` rows made of whole groups (aligned=True), or
        plain chunks when a group is larger than a micro-batch (aligned=False)."""
        size = self.cfg.optim.micro_batch_size
        groups: dict[int, list[int]] = {}
        for row, gid in enumerate(batch.group_ids.tolist()):
            groups.setdefault(int(gid), []).append(row)
        if any(len(g) > size for g in groups.values()):
            rows = len(batch)
            return [list(range(s, min(s + size, rows))) for s in range(0, rows, size)], False
        plan: list[list[int]] = []
        current: list[int] = []
        for g in groups.values():
            if current and len(current) + len(g) > size:
                plan.append(current)
                current = []
            current = current + g
        if current:
            plan.append(current)
        if self.noise is not None and len(plan) == 1 and len(groups) >= 2:
            plan = _halves(list(groups.values()))   # two batch sizes for the noise estimate, same total gradient
        return plan, True

    def _prepare(self, mb: RolloutBatch, fwd: ResponseForward, rewards: torch.Tensor) -> _Prepared:
        """Correction and advantages of a micro-batch that holds whole groups (their metrics come later, once,
        on the full batch)."""
        alg = self.algorithm
        mask = mb.response_mask.float()
        lp = fwd.logprobs.detach()
        corr = alg.correct(lp, mb.sampler_logprobs.float(), mask, with_metrics=False)
        weights = alg.is_weights(corr)
        adv = alg.advantages(rewards=rewards, mask=mask, group_ids=mb.group_ids, logprobs=lp,
                             sum_pi_sq=fwd.sum_pi_sq, is_weights=weights, with_metrics=False)
        return _Prepared(adv.advantages, weights, corr.keep)

    @torch.no_grad()
    def _prepass(self, batch: RolloutBatch, rewards: torch.Tensor) -> _Prepass:
        """No-grad forward over the whole batch for batch-level statistics (groups split over micro-batches or
        batch-normalised IS weights)."""
        alg = self.algorithm
        rows, width = batch.response_ids.shape
        device = batch.response_ids.device
        lp = torch.zeros((rows, width), dtype=torch.float32, device=device)
        sps = torch.zeros_like(lp)
        size = self.cfg.optim.micro_batch_size
        for s in range(0, rows, size):
            idx = torch.arange(s, min(s + size, rows), device=device)
            mb = _trim(batch.select(idx))
            fwd = forward_response(self.model, mb, self.temperature, share_prompts=self.cfg.optim.share_prompts)
            lp[idx] = _pad_cols(fwd.logprobs.float(), width)
            sps[idx] = _pad_cols(fwd.sum_pi_sq, width)
        mask = batch.response_mask.float()
        corr = alg.correct(lp, batch.sampler_logprobs.float(), mask)
        weights = alg.is_weights(corr)
        adv = alg.advantages(rewards=rewards, mask=mask, group_ids=batch.group_ids, logprobs=lp, sum_pi_sq=sps,
                             is_weights=weights)
        return _Prepass(lp, sps, _Prepared(adv.advantages, weights, corr.keep), {**corr.metrics, **adv.metrics})

    @torch.no_grad()
    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        rows, width = batch.response_ids.shape
        out = torch.zeros((rows, width), dtype=torch.float32, device=batch.response_ids.device)
        size = self.cfg.optim.micro_batch_size
        for s in range(0, rows, size):
            idx = torch.arange(s, min(s + size, rows), device=out.device)
            mb = _trim(batch.select(idx))
            fwd = forward_response(self.ref_model, mb, self.temperature, with_stats=False,
                                   share_prompts=self.cfg.optim.share_prompts)
            out[idx] = _pad_cols(fwd.logprobs.float(), width)
        return out

    def _global(self, token_loss: torch.Tensor, idx: torch.Tensor, full_mask: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the full-batch aggregate: its token losses placed in a [B, T] zero tensor
        and aggregated with the full batch's mask, so the micro-batch losses sum to the full-batch loss."""
        padded = _pad_cols(token_loss.float(), full_mask.shape[1])
        full = torch.zeros(full_mask.shape, dtype=torch.float32, device=padded.device).index_copy(0, idx, padded)
        return aggregate(full, full_mask, self.algorithm.agg_mode)

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
            mask = mb.response_mask.float()
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
        mask = batch.response_mask.float()
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
        return {"optimizer": self.optimizer.state_dict(), "surge": self.surge.state_dict(),
                "noise": None if self.noise is None else self.noise.state_dict(),
                "rollouts": self.rollouts, "version": self.version, "optimizer_steps": self.optimizer_steps,
                "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.surge.load_state_dict(state["surge"])
        if self.noise is not None and state.get("noise") is not None:
            self.noise.load_state_dict(state["noise"])
        self.rollouts = int(state["rollouts"])
        self.version = int(state["version"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.bad_steps = int(state["bad_steps"])


def batch_metrics(batch: ScoredBatch) -> dict[str, float]:
    """Reward, accuracy, pass@n, response length and zero-variance-group statistics of a scored batch.
    Accuracy and pass@n need `batch.correct` (per row, from `task.score`)."""
    mask = batch.response_mask.float()
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
        gmax = torch.full((n_groups,), -math.inf, device=seq_rewards.device).scatter_reduce(
            0, inverse, seq_rewards, "amax")
        gmin = torch.full((n_groups,), math.inf, device=seq_rewards.device).scatter_reduce(
            0, inverse, seq_rewards, "amin")
        m["zero_variance_groups"] = float((gmax == gmin).float().mean())
    correct = batch.correct
    if correct is not None and len(correct) == len(batch) and len(batch):
        c = torch.tensor([float(bool(x)) for x in correct], device=seq_rewards.device)
        m["accuracy"] = float(c.mean())
        gbest = torch.zeros(n_groups, device=c.device).scatter_reduce(0, inverse, c, "amax")
        m["pass@n"] = float(gbest.mean())
    return m


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

    def before_backward(self) -> None:
        if self.norms_sq:  # the first micro-batch starts from zero gradients: no snapshot needed
            self._before = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    @torch.no_grad()
    def after_backward(self, response_mask: torch.Tensor) -> None:
        grads, prev = [], []
        for i, p in enumerate(self.params):
            if p.grad is not None:
                grads.append(p.grad)
                prev.append(None if self._before is None else self._before[i])
        if any(b is not None for b in prev):
            grads = [g if b is None else g - b for g, b in zip(grads, prev)]
        # fused per-tensor norms (fp32 accumulation is ample for a noise estimate), summed in float64
        total = sum(float(n) ** 2 for n in torch._foreach_norm(grads)) if grads else 0.0
        self._before = None
        self.norms_sq.append(total)
        rows_with_tokens = (response_mask.sum(1) > 0).sum()
        self.sizes.append(float(response_mask.sum() if self.count_tokens else rows_with_tokens))


_TANGENT_KEYS = ("tangent", "remainder", "gain", "kl_seq", "bound", "bound_ratio")


def _tangent_metrics(lp, q, rewards, mask, group_ids) -> dict[str, float]:
    try:
        tr = tangent_remainder(lp, q, rewards, mask, group_ids=group_ids)
    except ValueError:  # a -inf log-prob of a sampled token (ppo_clip still steps): a diagnostic must not end the run
        return {}
    return {k: float(tr.metrics[k]) for k in _TANGENT_KEYS if k in tr.metrics}
