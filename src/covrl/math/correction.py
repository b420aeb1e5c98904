"""Rollout correction (docs/theory.md §6): importance weights, rejection (masking) and mismatch metrics.

r_t = p_train(y_t|c_t)/q_sampler(y_t|c_t) on every drawn token, lr_t = log r_t clamped to ±20.

Importance sampling (`is_level`):
- None: weights = 1 on valid tokens.
- "token": w_t = min(ρ_t, C); with a band (lo, hi): w_t = ρ_t if lo ≤ ρ_t ≤ hi else 0 (IcePop).
- "sequence": ρ = exp(clamp(Σ_t lr_t m_t, ±20)); w = min(ρ, C) or band as above, broadcast over the row.
- `is_batch_normalize`: divide by the mean weight over kept tokens (token) or kept rows (sequence).
Weights are detached and 0 on padding.

Rejection (`rs` with `rs_threshold`, all criteria must pass; a rejected token or row gets keep = 0), with
k1 = −lr, k2 = ½ lr², k3 = r − 1 − lr and bkl = max(KL_B(p‖q), KL_B(q‖p)) per valid token, KL_B the KL
between the Bernoulli distributions (p_t, 1 − p_t) and (q_t, 1 − q_t) of the drawn token (KPop):
- token_k1 | token_k2 | token_k3 | token_bkl: per token.
- seq_sum_*: Σ_t over valid tokens; seq_mean_*: mean over valid tokens; seq_max_k2 | seq_max_k3 | seq_max_bkl.
- k2/k3/bkl thresholds are upper bounds δ (keep if statistic ≤ δ). k1 thresholds are bands on the ratio:
  (lo, hi) keeps token_k1 if lo ≤ ρ_t ≤ hi, seq_sum_k1 if lo ≤ exp(Σ lr) ≤ hi, seq_mean_k1 if
  lo ≤ exp(mean lr) ≤ hi (the geometric, length-invariant ratio); a single number t > 1 means (1/t, t).
Bands may also be written as verl's strings "lo_hi" (e.g. "0.999_1.001").
IcePop is token_k1 with a band (and the band as is_threshold), KPop token_bkl: `CorrectionConfig.icepop` and
`CorrectionConfig.kpop` build them.
`keep` is already multiplied by `mask`. To "normalise by the full count" (TRM) aggregate the loss of the kept
tokens with the original mask: aggregate(token_loss * keep, mask, mode).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal, Self

import torch
from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, field_validator, model_validator

from covrl.math._util import (
    LOG_RATIO_CLAMP,
    check_2d,
    check_same_shape,
    clamped_log_ratio,
    item,
    masked_max,
    masked_mean,
)
from covrl.math.kl import KL_ESTIMATORS

Band = tuple[float, float]


# ------------------------------------------------------------------------------------------ rejection stats

BINARY_KL_EPS = 1e-8   # probabilities clamped to [eps, 1 − eps] for the binary KL (AReaL's eps)


def binary_kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(Bern(a) ‖ Bern(b)) = a·log(a/b) + (1 − a)·log((1 − a)/(1 − b)) from log-probabilities, with a and b
    clamped to [BINARY_KL_EPS, 1 − BINARY_KL_EPS]. The complements come from expm1 in log space, so a token of
    probability 1 in fp32 (1 − 1e-8 rounds to 1 there) stays finite: KL ≥ 0 everywhere."""
    lo, hi = math.log(BINARY_KL_EPS), math.log1p(-BINARY_KL_EPS)
    la, lb = log_a.float().clamp(lo, hi), log_b.float().clamp(lo, hi)
    l1a, l1b = torch.log(-torch.expm1(la)), torch.log(-torch.expm1(lb))
    return (torch.exp(la) * (la - lb) + -torch.expm1(la) * (l1a - l1b)).clamp_min(0.0)


def bidirectional_binary_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KPop's statistic per drawn token: max(KL_B(p‖q), KL_B(q‖p)) of the trainer's and the sampler's probability
    of that token (each Bernoulli: this token or any other)."""
    return torch.maximum(binary_kl(logp, logq), binary_kl(logq, logp))


# per-token statistics of a drawn token from (lr, log p, log q); k* estimate KL(q‖p) from the log-ratio alone
_K = {k: KL_ESTIMATORS[k] for k in ("k1", "k2", "k3")}
_TOKEN_STATS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": lambda lr, lp, lq: _K["k1"](lr), "k2": lambda lr, lp, lq: _K["k2"](lr),
    "k3": lambda lr, lp, lq: _K["k3"](lr),
    "bkl": lambda lr, lp, lq: bidirectional_binary_kl(lp, lq),
}


def _token(s):
    def stat(lr, mask, lp, lq):
        return _TOKEN_STATS[s](lr, lp, lq)
    return stat


def _seq_sum(s):
    def stat(lr, mask, lp, lq):
        return (torch.where(mask > 0, _TOKEN_STATS[s](lr, lp, lq), torch.zeros_like(lr))).sum(1, keepdim=True)
    return stat


def _seq_mean(s):
    def stat(lr, mask, lp, lq):
        return masked_mean(_TOKEN_STATS[s](lr, lp, lq), mask, dim=1)[:, None]
    return stat


def _seq_max(s):
    def stat(lr, mask, lp, lq):
        return masked_max(_TOKEN_STATS[s](lr, lp, lq), mask, dim=1)[:, None]
    return stat


# name -> statistic(lr, mask, trainer log-probs, sampler log-probs, all [B,T]) -> [B,T] (token) or [B,1]
# (sequence); k1 statistics are −log ratio (a max of −log ratio is not a criterion: use token_k1)
REJECTION_CRITERIA: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token_k1": _token("k1"), "token_k2": _token("k2"), "token_k3": _token("k3"),
    "seq_sum_k1": _seq_sum("k1"), "seq_sum_k2": _seq_sum("k2"), "seq_sum_k3": _seq_sum("k3"),
    "seq_mean_k1": _seq_mean("k1"), "seq_mean_k2": _seq_mean("k2"), "seq_mean_k3": _seq_mean("k3"),
    "seq_max_k2": _seq_max("k2"), "seq_max_k3": _seq_max("k3"),
    "token_bkl": _token("bkl"), "seq_sum_bkl": _seq_sum("bkl"), "seq_mean_bkl": _seq_mean("bkl"),
    "seq_max_bkl": _seq_max("bkl"),
}


def _parse_threshold(v, field: str = "threshold"):
    """verl writes bands as strings "lo_hi" (e.g. "0.999_1.001"); accept them and plain numeric strings. A
    boolean is refused: pydantic would read `is_threshold: true` as 1.0, which caps every IS weight at 1."""
    if isinstance(v, bool) or (isinstance(v, (list, tuple)) and any(isinstance(x, bool) for x in v)):
        raise ValueError(f"{field} must be a number or a (lo, hi) band, not a boolean; got {v!r}")
    if isinstance(v, str):
        parts = v.split("_")
        try:
            nums = [float(x) for x in parts]
        except ValueError:
            raise ValueError(f"threshold string must be a number or 'lo_hi'; got {v!r}") from None
        if len(nums) == 1:
            return nums[0]
        if len(nums) == 2:
            return (nums[0], nums[1])
        raise ValueError(f"threshold string must be a number or 'lo_hi'; got {v!r}")
    return v


# An IS threshold of inf is a setting (no truncation); nan is refused by `_check_is_threshold`.
_Threshold = Annotated[float, AllowInfNan(True)]


class CorrectionConfig(BaseModel):
    """Rollout-correction options (docs/theory.md §6; meanings compatible with verl's rollout_is / rollout_rs)."""

    # = covrl.settings.SECTION_POLICY, spelt out because covrl.math imports nothing from covrl (tests compare)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    is_level: Literal["token", "sequence"] | None = Field(
        None, description="importance-sampling level: None (no IS weights), 'token' or 'sequence'")
    is_threshold: _Threshold | tuple[_Threshold, _Threshold] = Field(
        2.0, description="truncation C of the IS weight (min(ρ, C)), or a (lo, hi) band: weights outside -> 0")
    is_batch_normalize: bool = Field(False, description="rescale the IS weights to mean 1 over the kept batch")
    rs: list[str] = Field(default_factory=list, description=(
        f"rejection criteria, all must pass; allowed: {', '.join(REJECTION_CRITERIA)}"))
    rs_threshold: list[float | tuple[float, float]] = Field(default_factory=list, description=(
        "one threshold per rs criterion: upper bound for k2/k3/bkl, ratio band (lo, hi) or t>1 meaning (1/t, t) "
        "for k1 (token_k1 with a band is IcePop, token_bkl KPop)"))

    @field_validator("is_threshold", mode="before")
    @classmethod
    def _parse_is_threshold(cls, v):
        return _parse_threshold(v, "is_threshold")

    @field_validator("rs_threshold", mode="before")
    @classmethod
    def _parse_rs_threshold(cls, v):
        if isinstance(v, bool):
            raise ValueError(f"rs_threshold must be a list of thresholds, not a boolean; got {v!r}")
        return [_parse_threshold(t, f"rs_threshold[{i}]") for i, t in enumerate(v)] if isinstance(v, (list, tuple)) \
            else v

    @field_validator("is_threshold")
    @classmethod
    def _check_is_threshold(cls, v):
        if isinstance(v, tuple):
            lo, hi = v
            if not (0 <= lo < hi):
                raise ValueError(f"is_threshold band (lo, hi) needs 0 <= lo < hi; got {v}")
        elif not v > 0 or math.isnan(v):
            raise ValueError(f"is_threshold must be > 0 or a (lo, hi) band; got {v}")
        return v

    @field_validator("rs")
    @classmethod
    def _check_rs(cls, v):
        bad = [name for name in v if name not in REJECTION_CRITERIA]
        if bad:
            raise ValueError(f"rs: unknown criteria {bad}; allowed: {list(REJECTION_CRITERIA)}")
        return v

    @model_validator(mode="after")
    def _check_thresholds(self):
        if len(self.rs) != len(self.rs_threshold):
            raise ValueError(f"rs_threshold must give one threshold per rs criterion: rs has {len(self.rs)} "
                             f"({self.rs}), rs_threshold has {len(self.rs_threshold)} ({self.rs_threshold})")
        for name, t in zip(self.rs, self.rs_threshold):
            if name.endswith("k1"):
                if isinstance(t, tuple):
                    if not (0 <= t[0] < t[1]):
                        raise ValueError(f"rs_threshold for {name}: ratio band (lo, hi) needs 0 <= lo < hi; got {t}")
                elif not t > 1:
                    raise ValueError(f"rs_threshold for {name}: a single k1 threshold t means the ratio band "
                                     f"(1/t, t) and must be > 1; got {t}")
            else:
                if isinstance(t, tuple):
                    raise ValueError(f"rs_threshold for {name}: k2/k3/bkl thresholds are upper bounds (a number "
                                     f"> 0), not a band; got {t}")
                if not t > 0:
                    raise ValueError(f"rs_threshold for {name} must be > 0; got {t}")
        return self

    def k1_band(self, threshold) -> Band:
        """(lo, hi) ratio band of a k1 threshold."""
        return tuple(threshold) if isinstance(threshold, tuple) else (1.0 / threshold, float(threshold))

    @classmethod
    def icepop(cls, low: float = 0.5, high: float = 5.0, level: Literal["token", "sequence"] = "token") -> Self:
        """IcePop (Ring-1T; verl's `decoupled_token_icepop`, AReaL's ratio mask, TRL's token_mask / sequence_mask):
        tokens (level token) or rows (level sequence, on exp(Σ lr)) whose ratio p/q leaves [low, high] are masked
        (keep 0, `token_k1` / `seq_sum_k1` with the band) and the others carry the IS weight ρ (the band as
        `is_threshold`: 0 outside). Under the pairing rule a loss whose ratio is against the sampler (ppo_clip)
        takes the mask and not the weights, so IcePop means the same thing for every loss."""
        band = (float(low), float(high))
        return cls(is_level=level, is_threshold=band, rs=["token_k1" if level == "token" else "seq_sum_k1"],
                   rs_threshold=[band])

    @classmethod
    def kpop(cls, phi: float = 0.1, criterion: str = "token_bkl") -> Self:
        """KPop (Ant Group 2026; AReaL's `binary_kl` metric): tokens whose bidirectional binary KL between the
        trainer's and the sampler's probability of the drawn token exceeds `phi` are masked (`criterion` one of
        the *_bkl criteria: per token, or a row's sum / mean / max), the others carry the untruncated token IS
        weight ρ (is_threshold inf), as AReaL multiplies its loss by the behaviour ratio."""
        if not criterion.endswith("_bkl"):
            raise ValueError(f"kpop criterion must be one of the *_bkl criteria; got {criterion!r}")
        return cls(is_level="token", is_threshold=math.inf, rs=[criterion], rs_threshold=[float(phi)])


@dataclass
class CorrectionOutput:
    """weights [B, T] detached fp32 (0 on padding), keep [B, T] fp32 0/1 (already × mask), metrics."""

    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def _in_band_log(log_ratio: torch.Tensor, band: Band) -> torch.Tensor:
    lo, hi = band
    lo_log = math.log(lo) if lo > 0 else -math.inf
    return (log_ratio >= lo_log) & (log_ratio <= math.log(hi))


def _unit_log_weights(lr: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig):
    """(log IS weight per unit, unit mask): units are tokens [B, T] or rows [B, 1] (`is_level`)."""
    if cfg.is_level == "token":
        return lr, mask
    log_w = (torch.where(mask > 0, lr, torch.zeros_like(lr)).sum(1, keepdim=True)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_w, (mask.sum(1, keepdim=True) > 0).float()


def _changed(log_w: torch.Tensor, cfg: CorrectionConfig) -> torch.Tensor:
    """1 on units whose weight is truncated (above C) or zeroed (outside the band)."""
    if isinstance(cfg.is_threshold, tuple):
        return (~_in_band_log(log_w, cfg.is_threshold)).float()
    return (torch.exp(log_w) > float(cfg.is_threshold)).float()


def _is_weights(lr: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor, cfg: CorrectionConfig) -> torch.Tensor:
    if cfg.is_level is None:
        return mask.clone()
    log_w, _ = _unit_log_weights(lr, mask, cfg)
    unit_keep = keep if cfg.is_level == "token" else (keep.sum(1, keepdim=True) > 0).float()
    raw = torch.exp(log_w)
    if isinstance(cfg.is_threshold, tuple):
        w = torch.where(_in_band_log(log_w, cfg.is_threshold), raw, torch.zeros_like(raw))
    else:
        w = raw.clamp(max=float(cfg.is_threshold))
    if cfg.is_batch_normalize:
        mean_w = masked_mean(w, unit_keep)
        w = torch.where(mean_w > 0, w / mean_w.clamp_min(1e-12), w)
    w = w.expand_as(lr) if cfg.is_level == "sequence" else w
    return w * mask


def _log_ratio(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, valid: torch.Tensor):
    lr = clamped_log_ratio(trainer_logprobs, sampler_logprobs)
    return torch.where(valid, lr, torch.zeros_like(lr))


def _passes(lr: torch.Tensor, maskf: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor,
            config: CorrectionConfig) -> list[tuple[str, torch.Tensor]]:
    """(criterion, passed [B, T] bool) for every rejection criterion of `config`."""
    out = []
    for name, threshold in zip(config.rs, config.rs_threshold):
        stat = REJECTION_CRITERIA[name](lr, maskf, logp, logq)
        if name.endswith("k1"):
            # k1 = −log ratio: the band is on exp(−k1)
            passed = _in_band_log(-stat, config.k1_band(threshold))
        else:
            passed = stat <= float(threshold)
        out.append((name, passed.expand_as(lr)))
    return out


def _as_config(config: CorrectionConfig | dict | None) -> CorrectionConfig:
    if config is None:
        return CorrectionConfig()
    return CorrectionConfig(**config) if isinstance(config, dict) else config


def rollout_correction(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                       config: CorrectionConfig | dict | None = None, *,
                       with_metrics: bool = True) -> CorrectionOutput:
    """IS weights, rejection keep-mask and mismatch metrics (formulas in the module docstring).

    trainer_logprobs, sampler_logprobs, mask: [B, T]; inputs are detached. `config` may be a CorrectionConfig,
    a dict of its fields, or None (defaults: no IS, no rejection; metrics only). `with_metrics=False` returns
    no metrics (compute them later on assembled pieces with `correction_metrics`).
    Metrics: mismatch/k1, mismatch/k3, mismatch/bkl (mean over valid tokens, masked ones included),
    mismatch/log_ppl_abs_diff (mean_b |mean_t log q − mean_t log p|), mismatch/chi2_token (mean ρ_t² − 1),
    mismatch/chi2_seq (mean_b ρ_b² − 1, ρ_b clamped at e^20), mismatch/max_abs_lr, mismatch/k3_kept and
    mismatch/k3_dropped (mean token k3 over the kept / dropped valid tokens: dropped = keep 0, or weight 0 by an IS
    band), correction/dropped_frac, correction/zero_weight_frac (valid tokens with IS weight 0),
    correction/ess and correction/ess_frac
    ((Σw)²/Σw² over kept units, and divided by their count), correction/masked_frac (valid tokens with keep 0),
    correction/seq_masked_frac (rows with valid tokens and none kept), correction/rejected_frac/<criterion>,
    correction/is_changed_frac (units truncated or zeroed), correction/weight_mean, correction/weight_max.
    """
    config = _as_config(config)
    check_same_shape(trainer_logprobs=trainer_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    check_2d("trainer_logprobs", trainer_logprobs)
    with torch.no_grad():
        maskf = mask.float()
        valid = maskf > 0
        lr = _log_ratio(trainer_logprobs, sampler_logprobs, valid)
        passes = _passes(lr, maskf, trainer_logprobs, sampler_logprobs, config)
        keep = valid.clone()
        for _, passed in passes:
            keep &= passed
        keep_f = keep.float()
        weights = _is_weights(lr, maskf, keep_f, config)
        metrics = (_correction_metrics(trainer_logprobs, sampler_logprobs, lr, maskf, weights, keep_f, passes, config)
                   if with_metrics else {})
    return CorrectionOutput(weights=weights.detach(), keep=keep_f, metrics=metrics)


def correction_metrics(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                       weights: torch.Tensor, keep: torch.Tensor,
                       config: CorrectionConfig | dict | None = None) -> dict[str, float]:
    """The metrics of `rollout_correction` from its `weights` and `keep` [B, T] (e.g. assembled from
    micro-batches), computed on the whole batch: equal to rollout_correction(...).metrics on these inputs."""
    config = _as_config(config)
    check_same_shape(trainer_logprobs=trainer_logprobs, sampler_logprobs=sampler_logprobs, mask=mask,
                     weights=weights, keep=keep)
    with torch.no_grad():
        maskf = mask.float()
        lr = _log_ratio(trainer_logprobs, sampler_logprobs, maskf > 0)
        return _correction_metrics(trainer_logprobs, sampler_logprobs, lr, maskf, weights.float(), keep.float(),
                                   _passes(lr, maskf, trainer_logprobs, sampler_logprobs, config), config)


def _correction_metrics(trainer_logprobs, sampler_logprobs, lr, maskf, weights, keep_f, passes,
                        config: CorrectionConfig) -> dict[str, float]:
    metrics = {f"correction/rejected_frac/{name}": item(masked_mean((~passed).float(), maskf))
               for name, passed in passes}
    metrics.update(_mismatch_metrics(trainer_logprobs, sampler_logprobs, lr, maskf))
    metrics.update(_weight_metrics(weights, keep_f, maskf, config))
    # the mismatch above is over every valid token, masked or not (masking must not hide a widening gap); split:
    # dropped = rejected, or weight 0 by an IS band (a loss that takes the weights learns nothing there)
    dropped = (keep_f == 0) | ((weights == 0) if config.is_level is not None else torch.zeros_like(keep_f, dtype=bool))
    dropped_f = dropped.float() * maskf
    k3 = _K["k3"](lr)
    metrics["correction/zero_weight_frac"] = (item(masked_mean((weights == 0).float(), maskf))
                                              if config.is_level is not None else 0.0)
    metrics["correction/dropped_frac"] = item(masked_mean(dropped_f, maskf))
    metrics["mismatch/k3_dropped"] = item(masked_mean(k3, dropped_f))
    metrics["mismatch/k3_kept"] = item(masked_mean(k3, maskf - dropped_f))
    if config.is_level is None:
        metrics["correction/is_changed_frac"] = 0.0
    else:
        log_w, unit_mask = _unit_log_weights(lr, maskf, config)
        metrics["correction/is_changed_frac"] = item(masked_mean(_changed(log_w, config), unit_mask))
    return metrics


def _mismatch_metrics(trainer_logprobs, sampler_logprobs, lr, maskf) -> dict[str, float]:
    valid_rows = (maskf.sum(1) > 0).float()
    ratio = torch.exp(lr)
    mean_logp = masked_mean(trainer_logprobs.float(), maskf, dim=1)
    mean_logq = masked_mean(sampler_logprobs.float(), maskf, dim=1)
    seq_lr = (lr * maskf).sum(1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "mismatch/k1": item(masked_mean(-lr, maskf)),
        "mismatch/k3": item(masked_mean(_K["k3"](lr), maskf)),
        "mismatch/log_ppl_abs_diff": item(masked_mean((mean_logq - mean_logp).abs(), valid_rows)),
        "mismatch/chi2_token": item(masked_mean(ratio.square(), maskf) - 1.0) if maskf.sum() > 0 else 0.0,
        "mismatch/chi2_seq": item(masked_mean(torch.exp(2.0 * seq_lr), valid_rows) - 1.0)
        if valid_rows.sum() > 0 else 0.0,
        "mismatch/max_abs_lr": item(masked_max(lr.abs(), maskf)),
        "mismatch/bkl": item(masked_mean(bidirectional_binary_kl(trainer_logprobs, sampler_logprobs), maskf)),
    }


def _weight_metrics(weights, keep_f, maskf, cfg) -> dict[str, float]:
    if cfg.is_level == "sequence":
        w = weights.amax(1)
        units = (keep_f.sum(1) > 0).float()
    else:
        w = weights
        units = keep_f
    total = (w * units).sum()
    total_sq = (w.square() * units).sum()
    count = units.sum()
    ess = item(total.square() / total_sq) if item(total_sq) > 0 else 0.0
    valid_rows = maskf.sum(1) > 0
    rows_dropped = valid_rows & (keep_f.sum(1) == 0)
    return {
        "correction/ess": ess,
        "correction/ess_frac": ess / item(count) if item(count) > 0 else 0.0,
        "correction/masked_frac": item(masked_mean((1.0 - keep_f), maskf)),
        "correction/seq_masked_frac": item(rows_dropped.float().sum() / valid_rows.float().sum().clamp_min(1)),
        "correction/weight_mean": item(masked_mean(w, units)),
        "correction/weight_max": item(masked_max(w, units)),
    }
