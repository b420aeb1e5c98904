"""Policy losses (docs/theory.md §4–§6), one registry with one signature, plus loss aggregation.

Every loss function in POLICY_LOSSES has the signature
    fn(*, logprobs, sampler_logprobs, advantages, mask, is_weights, **options) -> token_loss [B, T]
and `policy_loss(name, ...)` aggregates it and adds shared metrics. The pairing rule of docs/theory.md §6:
ppo_clip, gspo, gspo_token, gmpo, cispo, sapo, dppo, vespo and luspo take their ratio (or divergence) against
`sampler_logprobs` and need no extra IS weights; covariance / reinforce / dro use detached IS weights that multiply
their token loss. The rule is declared where a loss is registered
(`LossSpec.ratio_vs_sampler`, read by `LossSpec.takes_is_weights`), with its user options read once from the
signature (see `covrl.math._registry.Registered`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from covrl.math._registry import Registered
from covrl.math._util import (
    LOG_RATIO_CLAMP,
    check_same_shape,
    choose,
    clamped_log_ratio,
    item,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
)
from covrl.math.kl import KL_ESTIMATORS

TAIL_FLOOR = 1e-6


@dataclass
class LossOutput:
    """loss: scalar to backpropagate; token_loss [B, T] (before aggregation, 0 on padding); metrics."""

    loss: torch.Tensor
    token_loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- aggregation

def _agg_token_mean(token_loss, mask, norm_constant):
    """Σ_{b,t} ℓ m / Σ_{b,t} m (DAPO's global token mean)."""
    return (token_loss * mask).sum() / mask.sum().clamp_min(1e-8)


def _agg_seq_mean_token_sum(token_loss, mask, norm_constant):
    """mean_b Σ_t ℓ_bt m_bt (mean over all B rows)."""
    return (token_loss * mask).sum(1).mean()


def _agg_seq_mean_token_mean(token_loss, mask, norm_constant):
    """mean_b (Σ_t ℓ m / Σ_t m) over rows with at least one valid token (original GRPO)."""
    row_count = mask.sum(1)
    per_row = (token_loss * mask).sum(1) / row_count.clamp_min(1e-8)
    has = (row_count > 0).float()
    return (per_row * has).sum() / has.sum().clamp_min(1.0)


def _agg_seq_mean_token_sum_norm(token_loss, mask, norm_constant):
    """Σ_{b,t} ℓ m / (B · N) with the constant N = norm_constant or T = mask.shape[1] (Dr. GRPO)."""
    n = float(norm_constant) if norm_constant is not None else float(mask.shape[1])
    return (token_loss * mask).sum() / (max(mask.shape[0], 1) * n)


AGGREGATIONS: dict[str, Callable] = {
    "token-mean": _agg_token_mean,
    "seq-mean-token-sum": _agg_seq_mean_token_sum,
    "seq-mean-token-mean": _agg_seq_mean_token_mean,
    "seq-mean-token-sum-norm": _agg_seq_mean_token_sum_norm,
}


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
              norm_constant: float | None = None) -> torch.Tensor:
    """Reduce a [B, T] token loss to a scalar.

    token-mean:              Σ_{b,t} ℓ m / Σ_{b,t} m
    seq-mean-token-sum:      (1/B) Σ_b Σ_t ℓ m
    seq-mean-token-mean:     mean over rows with Σ_t m > 0 of Σ_t ℓ m / Σ_t m
    seq-mean-token-sum-norm: Σ_{b,t} ℓ m / (B·N), N = `norm_constant` (default T = mask.shape[1], the padded
                             response length; Dr. GRPO's constant normaliser)
    Padding entries of token_loss are ignored even when they hold inf/nan. All-masked input gives 0.
    """
    fn = choose(mode, "loss aggregation mode", AGGREGATIONS)
    check_same_shape(token_loss=token_loss, mask=mask)
    if token_loss.dim() != 2:
        raise ValueError(f"token_loss must be [B, T]; got shape {list(token_loss.shape)}")
    mask = mask.to(token_loss.dtype if token_loss.is_floating_point() else torch.float32)
    safe = torch.where(mask > 0, token_loss, torch.zeros((), dtype=token_loss.dtype, device=token_loss.device))
    return fn(safe, mask, norm_constant)


# ------------------------------------------------------------------------------------------------- losses

def _weights(is_weights: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(like) if is_weights is None else is_weights.detach().float()


def covariance_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None) -> torch.Tensor:
    """Tangent (covariance) loss of docs/theory.md §5: ℓ_t = −A_t · w_t · log p(y_t|c_t).

    w_t = sg(is_weights) from `rollout_correction` if given, else 1: no ratio is formed, so the gradient is
    −A·∇log p, which with a centred A (e.g. dr_grpo) is the tangent Cov_q(R, ∇ log ρ) and equals ∇J at p = q.
    """
    return -advantages.detach().float() * _weights(is_weights, logprobs) * logprobs.float()


def reinforce_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None,
                   is_cap: float | None = 2.0) -> torch.Tensor:
    """Off-policy REINFORCE with its own truncated token IS weight: ℓ_t = −A_t · sg(min(ρ_t, C)) · log p(y_t|c_t).

    ρ_t = exp(clamp(log p − log q, ±20)) against `sampler_logprobs`, C = `is_cap` (None = no truncation; the
    untruncated gradient ρ A ∇log p is unbiased per token). If `is_weights` is given (from rollout_correction)
    they replace sg(min(ρ_t, C)) so that nothing is corrected twice.
    """
    if is_weights is not None:
        w = is_weights.detach().float()
    else:
        if is_cap is not None and not is_cap > 0:
            raise ValueError(f"reinforce option is_cap must be > 0 or None; got {is_cap!r}")
        w = torch.exp(clamped_log_ratio(logprobs.detach(), sampler_logprobs))
        if is_cap is not None:
            w = w.clamp(max=float(is_cap))
    return -advantages.detach().float() * w * logprobs.float()


def ppo_clip_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None, clip_low: float = 0.2,
                  clip_high: float = 0.28, dual_clip: float | None = 3.0) -> torch.Tensor:
    """PPO clipped surrogate with asymmetric clip (clip-higher) and dual clip.

    ρ = exp(clamp(log p − log q_sampler, ±20)); ℓ1 = −A ρ; ℓ2 = −A clip(ρ, 1 − clip_low, 1 + clip_high);
    ℓ = max(ℓ1, ℓ2); for A < 0 with dual clip c: ℓ = min(ℓ, −A·c). `is_weights` (normally None by the pairing
    rule) multiply ℓ; pass them only for decoupled PPO where sampler_logprobs are the proximal policy's.
    """
    if not 0 <= clip_low < 1 or not clip_high >= 0:
        raise ValueError(f"ppo_clip needs 0 <= clip_low < 1 and clip_high >= 0; got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"ppo_clip dual_clip must be > 1 or None; got {dual_clip!r}")
    adv = advantages.detach().float()
    ratio = torch.exp(clamped_log_ratio(logprobs, sampler_logprobs.detach()))
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss1, loss2)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    return loss * _weights(is_weights, loss)


# Sequence-level and gated losses (GSPO, GMPO, CISPO, SAPO). Each takes its ratio against `sampler_logprobs`
# (the sampler, or the old/proximal policy), so by the pairing rule they get no extra IS weights.

def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean over the valid tokens of each row, [B]; 0 for an all-masked row."""
    return masked_mean(x, mask, dim=1)


def _check_clip(name: str, clip_low: float | None, clip_high: float, *, low_below_one: bool = True) -> None:
    if clip_low is not None and not (0 <= clip_low < 1 if low_below_one else clip_low >= 0):
        bound = "0 <= clip_low < 1" if low_below_one else "clip_low >= 0"
        raise ValueError(f"{name} needs {bound}; got clip_low={clip_low!r}")
    if not clip_high >= 0:
        raise ValueError(f"{name} needs clip_high >= 0; got clip_high={clip_high!r}")


def gspo_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None, clip_low: float = 3e-4,
              clip_high: float = 4e-4) -> torch.Tensor:
    """GSPO (Zheng et al. 2025), sequence level: one clipped ratio per response.

    s_b = exp(mean_t lr_bt) = (p(y_b)/q(y_b))^{1/|y_b|}, lr = clamp(log p − log q, ±20); A_b = mean_t A_bt (the
    sequence advantage; = A for outcome advantages). ℓ_b = max(−A_b s_b, −A_b clip(s_b, 1 − clip_low,
    1 + clip_high)), broadcast over the row's valid tokens, so `seq-mean-token-mean` aggregation gives GSPO's
    mean_b ℓ_b (verl's GSPO recommends that mode). ∇s_b = s_b·mean_t ∇log p_bt. Defaults: the paper's (3e-4, 4e-4).
    `is_weights` (normally None by the pairing rule) multiply ℓ.
    """
    _check_clip("gspo", clip_low, clip_high)
    return _sequence_clip_loss(logprobs, sampler_logprobs, advantages, mask, is_weights, clip_low, clip_high)


def _sequence_clip_loss(logprobs, sampler_logprobs, advantages, mask, is_weights, clip_low, clip_high):
    """GSPO's clipped sequence loss ℓ_b (see `gspo_loss`), broadcast over the row's tokens; shared with `luspo`."""
    lr = clamped_log_ratio(logprobs, sampler_logprobs.detach())
    seq_ratio = torch.exp(_row_mean(lr, mask))
    adv = _row_mean(advantages.detach().float(), mask)
    loss = torch.maximum(-adv * seq_ratio, -adv * seq_ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    return loss[:, None].expand_as(lr) * _weights(is_weights, lr)


def gspo_token_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None, clip_low: float = 3e-4,
                    clip_high: float = 4e-4) -> torch.Tensor:
    """GSPO-token (Zheng et al. 2025): the sequence ratio's value with a per-token gradient, for token advantages.

    s_bt = sg(s_b) · p(y_bt)/sg(p(y_bt)) (value s_b = exp(mean_t lr_bt), gradient s_b·∇log p_bt);
    ℓ_bt = max(−A_bt s_bt, −A_bt clip(s_bt, 1 − clip_low, 1 + clip_high)). With A constant over a row and
    `seq-mean-token-mean` aggregation it equals `gspo` in value and gradient (tested).
    """
    _check_clip("gspo_token", clip_low, clip_high)
    lp = logprobs.float()
    seq_log_ratio = _row_mean(clamped_log_ratio(lp.detach(), sampler_logprobs.detach()), mask)
    ratio = torch.exp(seq_log_ratio[:, None] + lp - lp.detach())
    adv = advantages.detach().float()
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    return loss * _weights(is_weights, loss)


def gmpo_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None, clip_low: float = 0.4,
              clip_high: float = 0.4) -> torch.Tensor:
    """GMPO (Zhao et al. 2025): the geometric mean of the token ratios, clipped token-wise in log space.

    A_b = mean_t A_bt, σ = sign(A_b); per token l_t = σ·min(σ·lr_t, σ·clamp(lr_t, −clip_low, clip_high)) (PPO's
    pessimistic min, taken on log-ratios); R_b = exp(mean_t l_t) = (Π_t ρ̃_t)^{1/|y_b|}; ℓ_b = −A_b·R_b, broadcast
    over the row (aggregate with `seq-mean-token-mean` for mean_b ℓ_b). The bounds are on log ρ: the defaults
    (0.4, 0.4) are the paper's ratio range (e^−0.4, e^0.4). `is_weights` (normally None) multiply ℓ.
    """
    _check_clip("gmpo", clip_low, clip_high, low_below_one=False)
    lr = clamped_log_ratio(logprobs, sampler_logprobs.detach())
    adv = _row_mean(advantages.detach().float(), mask)
    sign = torch.sign(adv)[:, None]
    clipped = sign * torch.minimum(sign * lr, sign * lr.clamp(-clip_low, clip_high))
    loss = -adv * torch.exp(_row_mean(clipped, mask))
    return loss[:, None].expand_as(lr) * _weights(is_weights, lr)


def cispo_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None, clip_low: float | None = None,
               clip_high: float = 0.28) -> torch.Tensor:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient IS weight; no token loses its gradient.

    ℓ_t = −A_t · sg(clip(ρ_t, 1 − clip_low, 1 + clip_high)) · log p(y_t), ρ against `sampler_logprobs`.
    clip_low=None: no lower bound (the paper sets ε_low large and tunes only ε_high). Unlike `ppo_clip` a token
    with ρ > 1 + clip_high keeps the gradient −(1 + clip_high)·A·∇log p. `is_weights` (normally None) multiply ℓ.
    """
    _check_clip("cispo", clip_low, clip_high, low_below_one=False)
    ratio = torch.exp(clamped_log_ratio(logprobs.detach(), sampler_logprobs.detach()))
    w = ratio.clamp(min=None if clip_low is None else 1.0 - clip_low, max=1.0 + clip_high)
    return -advantages.detach().float() * w * logprobs.float() * _weights(is_weights, ratio)


def sapo_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None, tau_pos: float = 1.0,
              tau_neg: float = 1.05) -> torch.Tensor:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a smooth sigmoid gate in place of the hard clip.

    f_τ(ρ) = (4/τ)·σ(τ(ρ − 1)), τ = tau_pos where A_t > 0 else tau_neg; ℓ_t = −A_t·f_τ(ρ_t), ρ against the sampler.
    Gradient −A·4σ(1−σ)·ρ·∇log p: exactly −A·∇log p at ρ = 1, decaying smoothly as ρ leaves 1 (faster for larger
    τ). The paper aggregates with `seq-mean-token-mean`. Defaults (1.0, 1.05) as verl's. `is_weights` multiply ℓ.
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo needs tau_pos > 0 and tau_neg > 0; got {tau_pos!r}, {tau_neg!r}")
    ratio = torch.exp(clamped_log_ratio(logprobs, sampler_logprobs.detach()))
    adv = advantages.detach().float()
    tau = torch.where(adv > 0, torch.full_like(adv, float(tau_pos)), torch.full_like(adv, float(tau_neg)))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -adv * gate * _weights(is_weights, ratio)


# The 2026 losses: DPPO (a divergence trust region), DRO (a squared log-ratio penalty), VESPO and LUSPO (sequence
# level, after TRL). docs/math.md gives each reference with its commit; docs/theory.md §14 reads them through §4–§6.

def _log_ratio_on(logprobs, sampler_logprobs, mask) -> torch.Tensor:
    """log p − log q in fp32 with the gradient of log p, unclamped on valid tokens and 0 on padding: a penalty on
    (log ρ)² needs the true log-ratio (a clamp would cut its pull back towards q), and padding may hold −inf."""
    valid = mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    q = torch.where(valid, sampler_logprobs.detach().float(), zero)
    return torch.where(valid, logprobs.float() - q, zero)


def _binary_tv(p, q, lp, lq):
    """|π(y) − μ(y)| of the sampled token, as the signed difference (its sign says which way the token moved)."""
    return p - q, (p - q).abs()


def _binary_kl(p, q, lp, lq):
    """KL(Bern(μ(y)) ‖ Bern(π(y))), with the 1e-8 guard of the references' (verl, SkyRL) formula."""
    return p - q, q * (lq - lp) + (1.0 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))


# divergence -> fn(p, q, log p, log q) -> (p − q, divergence) and the default bound δ: TV 0.2 (prime-rl's and
# SkyRL's default), binary KL 0.05 (SkyRL's recommendation, verl's example script)
DPPO_DIVERGENCES: dict[str, tuple[Callable, float]] = {"tv": (_binary_tv, 0.2), "kl": (_binary_kl, 0.05)}


def _dppo_bounds(divergence: str, delta_low: float | None, delta_high: float | None) -> tuple[Callable, float, float]:
    fn, default = choose(divergence, "dppo divergence", DPPO_DIVERGENCES)
    low = default if delta_low is None else delta_low
    high = default if delta_high is None else delta_high
    if not (low >= 0 and high >= 0):
        raise ValueError(f"dppo needs delta_low >= 0 and delta_high >= 0; got delta_low={low!r}, "
                         f"delta_high={high!r}")
    return fn, float(low), float(high)


def _dppo_masked(logprobs, sampler_logprobs, advantages, divergence, delta_low, delta_high):
    """(masked_low, masked_high), bool [B, T]: A < 0 and the token's probability already fell past the bound;
    A > 0 and it already rose past it. A = 0 tokens carry no gradient and are never counted."""
    fn, low, high = _dppo_bounds(divergence, delta_low, delta_high)
    with torch.no_grad():
        lp, lq = logprobs.detach().float(), sampler_logprobs.detach().float()
        diff, div = fn(torch.exp(lp), torch.exp(lq), lp, lq)
        adv = advantages.detach().float()
        return (adv < 0) & (diff < 0) & (div > low), (adv > 0) & (diff > 0) & (div > high)


def dppo_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None,
              divergence: Literal["tv", "kl"] = "tv", delta_low: float | None = None,
              delta_high: float | None = None, is_cap: float | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """DPPO (Qi et al. 2026, arXiv 2602.04879): a trust region on an estimated divergence, not on the ratio.

    ℓ_t = −keep_t · A_t · ρ̃_t + kl_coef · lr_t², ρ̃_t = sg(w_t)·p_t/sg(p_t) (value w_t, gradient w_t·∇log p_t),
    w_t = ρ_t or min(ρ_t, is_cap); lr_t = log p − log q unclamped. keep_t = 0 where the token already moved past the
    bound in the direction A pushes: A > 0 and p − q > 0 with D > delta_high, or A < 0 and p − q < 0 with
    D > delta_low; D = |p − q| (divergence="tv", binary TV of the sampled token) or KL(Bern(q) ‖ Bern(p))
    ("kl"). delta_* = None: 0.2 for tv, 0.05 for kl. Defaults are the paper's DPPO-Binary-TV; prime-rl's default
    loss is kl_coef=1e-3; verl's dppo_tv / dppo_kl use is_cap=20 (its clip_ratio_c). `is_weights` multiply ℓ.
    """
    if is_cap is not None and not is_cap > 0:
        raise ValueError(f"dppo option is_cap must be > 0 or None; got {is_cap!r}")
    if not kl_coef >= 0:
        raise ValueError(f"dppo option kl_coef must be >= 0; got {kl_coef!r}")
    low, high = _dppo_masked(logprobs, sampler_logprobs, advantages, divergence, delta_low, delta_high)
    lp = logprobs.float()
    w = torch.exp(clamped_log_ratio(lp.detach(), sampler_logprobs.detach()))
    if is_cap is not None:
        w = w.clamp(max=float(is_cap))
    keep = (~(low | high)).float()
    loss = -advantages.detach().float() * keep * w * torch.exp(lp - lp.detach())
    if kl_coef:
        loss = loss + kl_coef * _log_ratio_on(logprobs, sampler_logprobs, mask).square()
    return loss * _weights(is_weights, loss)


def dro_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None, beta: float = 0.05) -> torch.Tensor:
    """DRO, direct reward optimisation (Richemond et al. 2024) as in verl's `dro` and Tinker's `dro` loss_fn.

    ℓ_t = −w_t · (A_t · log p(y_t) − β/2 · lr_t²), lr_t = log p − log q unclamped, w_t = sg(is_weights) or 1: a
    squared penalty in place of a clip. Gradient −w·(A − β·lr)·∇log p: at p = q that of `covariance`; the penalty
    is β times the gradient of Σ_t ½lr_t² (k2 of KL(q‖p)). Default β = 0.05 (Tinker's documented example; verl
    has no default and requires β > 0).
    """
    if not beta > 0:
        raise ValueError(f"dro option beta must be > 0; got {beta!r}")
    lr = _log_ratio_on(logprobs, sampler_logprobs, mask)
    return -(advantages.detach().float() * logprobs.float() - 0.5 * beta * lr.square()) * _weights(is_weights, lr)


LOG_W_FLOOR = math.log(1e-8)   # VESPO's floor of the sequence log-ratio (TRL's, matching the paper's code)


def _vespo_phi(logprobs, sampler_logprobs, advantages, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """(φ [B, T], log W [B]), no gradient: W = exp(clamp(Σ_t lr_t, log 1e-8, 20)) the sequence ratio,
    φ = W^k·exp(λ(1 − W)) with (k, λ) by the sign of A_t (A >= 0: the _pos pair)."""
    for name, v in (("k_pos", k_pos), ("lambda_pos", lambda_pos), ("k_neg", k_neg), ("lambda_neg", lambda_neg)):
        if not v >= 0:
            raise ValueError(f"vespo option {name} must be >= 0; got {v!r}")
    with torch.no_grad():
        lr = clamped_log_ratio(logprobs.detach(), sampler_logprobs.detach())
        log_w = masked_sum(lr, mask, dim=1).clamp(LOG_W_FLOOR, LOG_RATIO_CLAMP)
        nonneg = advantages.detach().float() >= 0
        k = torch.where(nonneg, float(k_pos), float(k_neg))
        lam = torch.where(nonneg, float(lambda_pos), float(lambda_neg))
        log_phi = lam + k * log_w[:, None] - lam * torch.exp(log_w)[:, None]
        return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), log_w


def vespo_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None, k_pos: float = 2.0,
               lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0) -> torch.Tensor:
    """VESPO (arXiv 2602.10693) as in TRL's `loss_type="vespo"`: a smooth Gamma-shaped weight of the sequence ratio.

    ℓ_t = −sg(φ(W_b)) · A_t · log p(y_t), W_b = p(y_b)/q(y_b) = exp(Σ_t lr_t) (clamped to [1e-8, e^20]),
    φ(W) = W^k·e^{λ(1−W)} (φ(1) = 1, peak at W = k/λ), (k, λ) = (k_pos, lambda_pos) where A_t >= 0 else
    (k_neg, lambda_neg); defaults are TRL's. k = 1, λ = 0 is sequence-level IS (unbiased, unbounded weight).
    TRL aggregates with the global token mean (covrl's `token-mean`). `is_weights` (normally None) multiply ℓ.
    """
    phi, _ = _vespo_phi(logprobs, sampler_logprobs, advantages, mask, k_pos, lambda_pos, k_neg, lambda_neg)
    return -phi * advantages.detach().float() * logprobs.float() * _weights(is_weights, phi)


def luspo_loss(*, logprobs, sampler_logprobs, advantages, mask, is_weights=None, clip_low: float = 2e-3,
               clip_high: float = 2.5e-3) -> torch.Tensor:
    """LUSPO (arXiv 2602.05261) as in TRL's `loss_type="luspo"`: GSPO with each sequence's loss scaled by its length.

    The token loss is `gspo`'s (ℓ_b broadcast over the row), so the sum over a row is |y_b|·ℓ_b: aggregate with
    `seq-mean-token-sum` for TRL's mean_b |y_b|·ℓ_b exactly (`token-mean` is that times B/Σ|y|, a per-batch constant;
    `seq-mean-token-mean` divides by |y_b| again and gives GSPO back). Defaults: the paper's clip (2e-3, 2.5e-3).
    """
    _check_clip("luspo", clip_low, clip_high)
    return _sequence_clip_loss(logprobs, sampler_logprobs, advantages, mask, is_weights, clip_low, clip_high)


# Inputs a caller supplies to every loss; every other keyword parameter of a loss is a user option.
LOSS_INPUTS = frozenset({"logprobs", "sampler_logprobs", "advantages", "mask", "is_weights"})


@dataclass(frozen=True)
class LossSpec(Registered):
    """A registered loss: `fn(*, logprobs, sampler_logprobs, advantages, mask, is_weights, **options) -> token_loss`
    (see `Registered`). `ratio_vs_sampler`: the loss takes its ratio (or divergence) against the sampler's
    log-probs, so by the pairing rule (docs/theory.md §6) it gets no extra IS weights (they would correct twice).
    `token_clip`: its clip_low / clip_high options bound the token ratio ρ_t at 1 ∓ clip (ppo_clip, cispo), so the
    clip-fraction metrics use them; every other loss reports what PPO's defaults would clip, unless `metrics`
    (fn(*, log_ratio, logprobs, sampler_logprobs, advantages, mask, **options) -> dict, on detached tensors, with
    every option filled in) replaces those counts by what the loss itself clips or masks, or adds its own."""

    ratio_vs_sampler: bool = False
    token_clip: bool = False
    metrics: Callable[..., dict[str, float]] | None = None

    @classmethod
    def of(cls, name: str, fn: Callable[..., torch.Tensor], *, ratio_vs_sampler: bool = False,
           token_clip: bool = False, metrics: Callable[..., dict[str, float]] | None = None) -> LossSpec:
        return cls.build(name, fn, LOSS_INPUTS, ratio_vs_sampler=ratio_vs_sampler, token_clip=token_clip,
                         metrics=metrics)

    @property
    def takes_is_weights(self) -> bool:
        """Whether the pairing rule passes the rollout-correction IS weights to this loss."""
        return not self.ratio_vs_sampler

    @property
    def defaults(self) -> dict[str, Any]:
        """The options' defaults from the signature (options without one are left out)."""
        return {n: p.default for n, p in self.options.items() if p.default is not p.empty}

    def compute(self, *, logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, is_weights: torch.Tensor | None = None, agg_mode: str = "token-mean",
                norm_constant: float | None = None, options: Mapping[str, Any] | None = None) -> LossOutput:
        """This loss with already-checked `options`, aggregated and with its metrics (see `policy_loss`);
        `is_weights` are used as given (the pairing rule is the caller's)."""
        check_same_shape(logprobs=logprobs, sampler_logprobs=sampler_logprobs, advantages=advantages, mask=mask,
                         is_weights=is_weights)
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [B, T]; got shape {list(logprobs.shape)}")
        options = options or {}
        maskf = mask.float()
        token_loss = self.fn(logprobs=logprobs, sampler_logprobs=sampler_logprobs, advantages=advantages,
                             mask=maskf, is_weights=is_weights, **options)
        token_loss = torch.where(maskf > 0, token_loss * maskf, torch.zeros_like(token_loss))
        loss = aggregate(token_loss, maskf, agg_mode, norm_constant=norm_constant)
        filled = {**self.defaults, **options}
        metrics = _ratio_metrics(logprobs, sampler_logprobs, advantages, maskf, filled if self.token_clip else {})
        if self.metrics is not None:
            with torch.no_grad():
                metrics.update(self.metrics(
                    log_ratio=clamped_log_ratio(logprobs.detach(), sampler_logprobs.detach()),
                    logprobs=logprobs.detach(), sampler_logprobs=sampler_logprobs.detach(),
                    advantages=advantages.detach().float(), mask=maskf, **filled))
        metrics["loss/value"] = item(loss.detach())
        return LossOutput(loss=loss, token_loss=token_loss, metrics=metrics)


# Loss-specific metrics (LossSpec.metrics): what the loss itself clips, masks or weighs.

def _fractions(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor, dual: torch.Tensor | None = None
               ) -> dict[str, float]:
    m = {"loss/clip_frac_low": item(masked_mean(low.float(), mask)),
         "loss/clip_frac_high": item(masked_mean(high.float(), mask))}
    m["loss/clip_frac"] = m["loss/clip_frac_low"] + m["loss/clip_frac_high"]
    m["loss/dual_clip_frac"] = 0.0 if dual is None else item(masked_mean(dual.float(), mask))
    return m


def _cispo_metrics(*, log_ratio, advantages, mask, clip_low, clip_high, **_) -> dict[str, float]:
    """The tokens whose IS weight the clip changes, of either advantage sign (CISPO caps the weight of an A < 0
    token too); nothing below when clip_low is None (one-sided)."""
    ratio = torch.exp(log_ratio)
    low = ratio < 1.0 - clip_low if clip_low is not None else torch.zeros_like(mask, dtype=torch.bool)
    return _fractions(low, ratio > 1.0 + clip_high, mask)


def _dppo_metrics(*, log_ratio, logprobs, sampler_logprobs, advantages, mask, divergence, delta_low, delta_high,
                  is_cap, **_) -> dict[str, float]:
    """clip_frac_low / _high: the tokens DPPO masks (A < 0 fallen past the bound / A > 0 risen past it);
    dual_clip_frac: kept tokens whose ratio is_cap truncates; masked_k3 / kept_k3: the mismatch (k3 of KL(q‖p))
    on each side of the mask."""
    low, high = _dppo_masked(logprobs, sampler_logprobs, advantages, divergence, delta_low, delta_high)
    masked = low | high
    truncated = (~masked) & (log_ratio > math.log(is_cap)) if is_cap is not None else None
    k3 = KL_ESTIMATORS["k3"](log_ratio)
    return {**_fractions(low, high, mask, truncated),
            "loss/masked_k3": item(masked_mean(k3, mask * masked.float())),
            "loss/kept_k3": item(masked_mean(k3, mask * (~masked).float()))}


def _dro_metrics(*, logprobs, sampler_logprobs, mask, **_) -> dict[str, float]:
    """loss/k2: mean ½(log p − log q)², the penalty's estimate of KL(q‖p) per token (unclamped)."""
    return {"loss/k2": item(masked_mean(0.5 * _log_ratio_on(logprobs, sampler_logprobs, mask).square(), mask))}


def _vespo_metrics(*, logprobs, sampler_logprobs, advantages, mask, k_pos, lambda_pos, k_neg, lambda_neg,
                   **_) -> dict[str, float]:
    """loss/vespo_phi_mean: token mean of the weight φ(W); loss/seq_log_ratio_mean: mean of log W over the rows
    with a valid token."""
    phi, log_w = _vespo_phi(logprobs, sampler_logprobs, advantages, mask, k_pos, lambda_pos, k_neg, lambda_neg)
    rows = (mask.sum(1) > 0).float()
    return {"loss/vespo_phi_mean": item(masked_mean(phi, mask)),
            "loss/seq_log_ratio_mean": item(masked_mean(log_w, rows))}


def _sequence_clip_metrics(*, log_ratio, advantages, mask, clip_low, clip_high, **_) -> dict[str, float]:
    """The tokens of the rows whose sequence ratio s_b = exp(mean_t lr_t) is clipped (Ā_b < 0 and s_b < 1 −
    clip_low, Ā_b > 0 and s_b > 1 + clip_high), and s_b's mean / max / min over the rows with a valid token."""
    seq_ratio = torch.exp(_row_mean(log_ratio, mask))
    adv = _row_mean(advantages, mask)
    rows = mask.sum(1) > 0
    low = ((adv < 0) & (seq_ratio < 1.0 - clip_low))[:, None].expand_as(mask)
    high = ((adv > 0) & (seq_ratio > 1.0 + clip_high))[:, None].expand_as(mask)
    return {**_fractions(low, high, mask), "loss/seq_ratio_mean": item(masked_mean(seq_ratio, rows.float())),
            "loss/seq_ratio_max": item(masked_max(seq_ratio, rows.float())),
            "loss/seq_ratio_min": item(masked_min(seq_ratio, rows.float()))}


LOSS_SPECS: dict[str, LossSpec] = {spec.name: spec for spec in (
    LossSpec.of("covariance", covariance_loss),
    LossSpec.of("reinforce", reinforce_loss),
    LossSpec.of("ppo_clip", ppo_clip_loss, ratio_vs_sampler=True, token_clip=True),
    LossSpec.of("gspo", gspo_loss, ratio_vs_sampler=True),
    LossSpec.of("gspo_token", gspo_token_loss, ratio_vs_sampler=True),
    LossSpec.of("gmpo", gmpo_loss, ratio_vs_sampler=True),
    LossSpec.of("cispo", cispo_loss, ratio_vs_sampler=True, token_clip=True, metrics=_cispo_metrics),
    LossSpec.of("sapo", sapo_loss, ratio_vs_sampler=True),
    LossSpec.of("dppo", dppo_loss, ratio_vs_sampler=True, metrics=_dppo_metrics),
    LossSpec.of("dro", dro_loss, metrics=_dro_metrics),
    LossSpec.of("vespo", vespo_loss, ratio_vs_sampler=True, metrics=_vespo_metrics),
    LossSpec.of("luspo", luspo_loss, ratio_vs_sampler=True, metrics=_sequence_clip_metrics),
)}
POLICY_LOSSES: dict[str, Callable[..., torch.Tensor]] = {n: spec.fn for n, spec in LOSS_SPECS.items()}


def _ratio_metrics(logprobs, sampler_logprobs, advantages, mask, options) -> dict[str, float]:
    with torch.no_grad():
        log_r = clamped_log_ratio(logprobs.detach(), sampler_logprobs.detach())
        ratio = torch.exp(log_r)
        adv = advantages.detach().float()
        m = {
            "loss/ratio_mean": item(masked_mean(ratio, mask)),
            "loss/ratio_max": item(masked_max(ratio, mask)),
            "loss/ratio_min": item(masked_min(ratio, mask)),
            "loss/approx_kl": item(masked_mean(KL_ESTIMATORS["k3"](log_r), mask)),  # k3 of KL(q‖p)
            "loss/approx_kl_k1": item(masked_mean(-log_r, mask)),
            "loss/log_ratio_clamped_frac": item(masked_mean((log_r.abs() >= LOG_RATIO_CLAMP).float(), mask)),
        }
        clip_low, clip_high = options.get("clip_low", 0.2), options.get("clip_high", 0.28)
        # cispo's clip_low=None: no lower bound, nothing clipped below
        low = (adv < 0) & (ratio < 1.0 - clip_low) if clip_low is not None else torch.zeros_like(adv, dtype=torch.bool)
        high = (adv > 0) & (ratio > 1.0 + clip_high)
        m["loss/clip_frac_low"] = item(masked_mean(low.float(), mask))
        m["loss/clip_frac_high"] = item(masked_mean(high.float(), mask))
        m["loss/clip_frac"] = m["loss/clip_frac_low"] + m["loss/clip_frac_high"]
        dual = options.get("dual_clip", 3.0)
        m["loss/dual_clip_frac"] = (item(masked_mean(((adv < 0) & (ratio > dual)).float(), mask))
                                    if dual is not None else 0.0)
        return m


def policy_loss(name: str, *, logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, is_weights: torch.Tensor | None = None, agg_mode: str = "token-mean",
                **options) -> LossOutput:
    """Policy loss `name` (covariance | reinforce | ppo_clip | gspo | gspo_token | gmpo | cispo | sapo | dppo | dro |
    vespo | luspo), aggregated with `agg_mode` (see `aggregate`).

    logprobs [B, T] trainer log-probs (carry the gradient); sampler_logprobs [B, T] log-probs of the same tokens
    under the sampler (or the old/proximal policy); advantages [B, T] (detached inside); mask [B, T]; is_weights
    [B, T] detached IS weights from rollout_correction or None. options: per loss (ppo_clip: clip_low=0.2,
    clip_high=0.28, dual_clip=3.0|None; reinforce: is_cap=2.0|None; gspo / gspo_token: clip_low=3e-4,
    clip_high=4e-4; gmpo: clip_low=clip_high=0.4 (log space); cispo: clip_low=None, clip_high=0.28; sapo: tau_pos=1.0,
    tau_neg=1.05; dppo: divergence="tv", delta_low=delta_high=None (0.2 tv, 0.05 kl), is_cap=None, kl_coef=0.0;
    dro: beta=0.05; vespo: k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0; luspo: clip_low=2e-3,
    clip_high=2.5e-3) and `norm_constant` for aggregation.
    Metrics (for every loss): loss/ratio_mean|max|min (vs sampler), loss/approx_kl (k3), loss/approx_kl_k1,
    loss/clip_frac, loss/clip_frac_low, loss/clip_frac_high, loss/dual_clip_frac (what PPO clipping would hit,
    with its defaults, unless the loss reports what it clips or masks itself: ppo_clip, cispo, dppo, luspo),
    loss/log_ratio_clamped_frac, loss/value; and the loss's own (`LossSpec.metrics`).
    """
    spec: LossSpec = choose(name, "policy loss", LOSS_SPECS)
    norm_constant = options.pop("norm_constant", None)
    unknown = spec.unknown_options(options)
    if unknown:
        raise TypeError(f"policy loss {name!r} got unknown options {unknown}; accepted: "
                        f"{list(spec.options) + ['norm_constant']}")
    spec.check_no_bool(options)
    if isinstance(norm_constant, bool):
        raise TypeError(f"policy loss option norm_constant expects a number, got the boolean {norm_constant!r}")
    return spec.compute(logprobs=logprobs, sampler_logprobs=sampler_logprobs, advantages=advantages, mask=mask,
                        is_weights=is_weights, agg_mode=agg_mode, norm_constant=norm_constant, options=options)


# -------------------------------------------------------------------------------------------- score centring

def score_centering_term(trainer_topk_logprobs: torch.Tensor, sampler_topk_logprobs: torch.Tensor,
                         advantages: torch.Tensor, mask: torch.Tensor, truncation: float | None = None,
                         agg_mode: str = "token-mean", *, norm_constant: float | None = None) -> LossOutput:
    """Score-centring correction of docs/theory.md §4, to ADD to the policy loss.

    H = the sampler's top-k ids at each position; p_v = trainer prob of v ∈ H (full vocab, gradient flows),
    q_v = sampler prob. Tails floored at 1e-6: ρ_tail = max(1 − Σ_H q, 1e-6) / max(1 − Σ_H p, 1e-6).
    Without truncation: c_v = q_v − ρ_tail·p_v (pair with the covariance loss, w = 1). With truncation C:
    α = min(1, C·ρ_tail), c_v = min(p_v, C·q_v) − α·p_v (pair with IS weights w = min(ρ_y, C)). c is detached.
    Token loss ℓ_t = +A_t · Σ_{v∈H} c_v · log p_v, so that policy loss + this term =
    −A·(w·log p_y − Σ_H c_v log p_v). p == q gives c = 0. Entries whose sampler log-prob is −inf (padding of a
    short top-k) are not in H.
    Example: q_H = [0.5, 0.3], p_H = [0.4, 0.4] -> ρ_tail = 1, c = [0.1, −0.1].
    Metrics: score_center/rho_tail_mean, score_center/abs_c_sum_mean, score_center/tail_q_mean,
    score_center/tail_p_mean, score_center/value.
    """
    check_same_shape(trainer_topk_logprobs=trainer_topk_logprobs, sampler_topk_logprobs=sampler_topk_logprobs)
    if trainer_topk_logprobs.dim() != 3:
        raise ValueError(f"top-k log-probs must be [B, T, K]; got shape {list(trainer_topk_logprobs.shape)}")
    check_same_shape(advantages=advantages, mask=mask, topk_leading=trainer_topk_logprobs[..., 0])
    if truncation is not None and not truncation > 0:
        raise ValueError(f"score_centering_term truncation must be > 0 or None; got {truncation!r}")
    maskf = mask.float()
    logp = trainer_topk_logprobs.float()
    logq = sampler_topk_logprobs.detach().float()
    in_h = torch.isfinite(logq)
    with torch.no_grad():
        p = torch.where(in_h, torch.exp(logp.detach().clamp(max=0.0)), torch.zeros_like(logp))
        q = torch.where(in_h, torch.exp(logq.clamp(max=0.0)), torch.zeros_like(logq))
        tail_q = (1.0 - q.sum(-1)).clamp_min(TAIL_FLOOR)
        tail_p = (1.0 - p.sum(-1)).clamp_min(TAIL_FLOOR)
        rho_tail = tail_q / tail_p
        if truncation is None:
            c = q - rho_tail[..., None] * p
        else:
            alpha = (truncation * rho_tail).clamp(max=1.0)
            c = torch.minimum(p, truncation * q) - alpha[..., None] * p
        c = torch.where(in_h, c, torch.zeros_like(c))
    safe_logp = torch.where(in_h, logp, torch.zeros_like(logp))
    token_loss = advantages.detach().float() * (c * safe_logp).sum(-1)
    token_loss = torch.where(maskf > 0, token_loss * maskf, torch.zeros_like(token_loss))
    loss = aggregate(token_loss, maskf, agg_mode, norm_constant=norm_constant)
    metrics = {
        "score_center/rho_tail_mean": item(masked_mean(rho_tail, maskf)),
        "score_center/abs_c_sum_mean": item(masked_mean(c.abs().sum(-1), maskf)),
        "score_center/tail_q_mean": item(masked_mean(tail_q, maskf)),
        "score_center/tail_p_mean": item(masked_mean(tail_p, maskf)),
        "score_center/value": item(loss.detach()),
    }
    return LossOutput(loss=loss, token_loss=token_loss, metrics=metrics)
