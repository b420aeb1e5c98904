"""The losses `TrainingClient.forward_backward(..., loss_fn=NAME)` accepts: every covrl.math policy loss by its
registry name (options type-checked by its registry entry) plus Tinker's built-in names.

Two reductions, because the two families define their scale differently:

- covrl.math losses (`covariance`, `reinforce`, `ppo_clip`, `gspo`, `gspo_token`, `gmpo`, `cispo`, `sapo`, `dppo`,
  `dro`, `vespo`, `luspo`) are `LossSpec.compute` on the sampled tokens, aggregated with the call's `agg_mode`
  (default token-mean) over the full sampled-token mask, so rejected tokens count in the normaliser as in
  `covrl.train.step.trainer` (TRM).
- Tinker's names (`cross_entropy`, `importance_sampling`, `ppo`, `tinker_cispo` = Tinker's `cispo`,
  `tinker_gspo` = Tinker's `gspo`, `tinker_dro` = Tinker's `dro`) are per-token SUMS over every scored position
  (Tinker's convention), with Tinker's option names (`clip_low_threshold`, `clip_high_threshold` on the ratio,
  `beta` for dro). `ppo`, `tinker_cispo`, `tinker_gspo` and `tinker_dro` are the covrl.math functions (`ppo_clip`
  without dual clip, `cispo`, `gspo_token`, `dro`) with the thresholds translated (clip_low = 1 - low threshold,
  clip_high = high threshold - 1). `tinker_cispo`'s defaults are Tinker's one-sided clip (0.0, 4.0): no lower
  bound, the weight capped at 4 (tinker-cookbook tutorials/202_loss_functions.py).

The Tinker facade maps Tinker's `cispo` / `gspo` / `dro` onto `tinker_cispo` / `tinker_gspo` / `tinker_dro` (same
name, Tinker's meaning); through covrl.api the bare names keep covrl.math's meaning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from covrl.math import LOSS_SPECS, LossOutput, LossSpec, clamped_log_ratio
from covrl.math.losses import dro_loss


@dataclass(frozen=True)
class LossInputs:
    """What a loss sees, all [B, T]: `logprobs` with gradient; `sampled` the tokens the sampler drew (0/1, the
    mask of covrl.math losses and of the mismatch metrics); `weights` the per-position weights of Tinker's
    sums (cross_entropy's weights; otherwise the positions a Datum scores); `keep` the rejection keep-mask and
    `is_weights` the correction's IS weights (None without `correction.is_level`)."""

    logprobs: torch.Tensor
    sampler_logprobs: torch.Tensor | None
    advantages: torch.Tensor | None
    sampled: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    is_weights: torch.Tensor | None


@dataclass(frozen=True)
class ApiLoss:
    """A loss by name: `requires` names the inputs that must be present; `options` its option names and
    defaults; `fn(inputs, options)` -> LossOutput whose [B, T] token loss the client reduces: covrl.math
    losses with `agg_mode` over the full batch's sampled mask, Tinker's by a sum."""

    name: str
    requires: frozenset[str]
    options: Mapping[str, Any]
    fn: Callable[[LossInputs, dict[str, Any]], LossOutput]
    family: str                       # "covrl.math" or "tinker"
    doc: str = ""

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        unknown = [k for k in options if k not in self.options]
        if unknown:
            raise TypeError(f"loss_fn {self.name!r} got unknown options {unknown}; accepted: {sorted(self.options)}")
        out = {**self.options, **options}
        missing = [k for k, v in out.items() if v is None and k in _REQUIRED_OPTIONS.get(self.name, ())]
        if missing:
            raise TypeError(f"loss_fn {self.name!r} needs the option(s) {missing}")
        return out


def _math_loss(spec: LossSpec) -> ApiLoss:
    def fn(x: LossInputs, options: dict[str, Any]) -> LossOutput:
        options = {k: v for k, v in options.items() if k != "norm_constant"}
        sampler_lp = x.sampler_logprobs if x.sampler_logprobs is not None else x.logprobs.detach()
        out = spec.compute(logprobs=x.logprobs, sampler_logprobs=sampler_lp.float(), advantages=x.advantages,
                           mask=x.keep, is_weights=x.is_weights if spec.takes_is_weights else None,
                           options=spec.validate_options(options))
        return LossOutput(loss=out.loss, token_loss=out.token_loss,
                          metrics={k: v for k, v in out.metrics.items() if k != "loss/value"})

    requires = frozenset({"advantages"} | ({"sampler_logprobs"} if spec.name != "covariance" else set()))
    options = {n: (None if p.default is p.empty else p.default) for n, p in spec.options.items()}
    return ApiLoss(spec.name, requires, {**options, "norm_constant": None}, fn, "covrl.math",
                   (spec.fn.__doc__ or "").strip().splitlines()[0])


def _sum(token_loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (token_loss * weights).sum()


def _ratio(x: LossInputs) -> torch.Tensor:
    return torch.exp(clamped_log_ratio(x.logprobs, x.sampler_logprobs))


def _cross_entropy(x: LossInputs, options: dict[str, Any]) -> LossOutput:
    token_loss = -x.logprobs.float() * x.weights
    return LossOutput(loss=token_loss.sum(), token_loss=token_loss)


def _importance_sampling(x: LossInputs, options: dict[str, Any]) -> LossOutput:
    token_loss = -_ratio(x) * x.advantages.float() * x.weights
    return LossOutput(loss=token_loss.sum(), token_loss=token_loss)


def _dro(x: LossInputs, options: dict[str, Any]) -> LossOutput:
    """Tinker's `dro`: covrl.math's `dro` token loss (the same formula), summed over the weighted positions."""
    token_loss = dro_loss(logprobs=x.logprobs, sampler_logprobs=x.sampler_logprobs.float(), advantages=x.advantages,
                          mask=(x.weights != 0).float(), is_weights=None, beta=float(options["beta"])) * x.weights
    return LossOutput(loss=token_loss.sum(), token_loss=token_loss)


def _translated(math_name: str, extra: Mapping[str, Any]) -> Callable[[LossInputs, dict[str, Any]], LossOutput]:
    """A Tinker clipped loss as the covrl.math function `math_name` with the ratio thresholds translated, summed
    over the weighted positions."""
    spec = LOSS_SPECS[math_name]

    def fn(x: LossInputs, options: dict[str, Any]) -> LossOutput:
        low, high = float(options["clip_low_threshold"]), float(options["clip_high_threshold"])
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(f"loss_fn_config needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold; "
                             f"got {low}, {high}")
        checked = spec.validate_options({"clip_low": 1.0 - low, "clip_high": high - 1.0, **extra})
        token_loss = spec.fn(logprobs=x.logprobs, sampler_logprobs=x.sampler_logprobs.float(),
                             advantages=x.advantages, mask=x.sampled, is_weights=None, **checked) * x.weights
        return LossOutput(loss=token_loss.sum(), token_loss=token_loss)

    return fn


_THRESHOLDS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
# Tinker's cispo default: one-sided (no lower bound, weight capped at 4), tinker-cookbook commit eb2dc4e
_CISPO_THRESHOLDS = {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
_REQUIRED_OPTIONS = {"tinker_dro": ("beta",)}
_RL = frozenset({"advantages", "sampler_logprobs"})

TINKER_LOSSES: dict[str, ApiLoss] = {loss.name: loss for loss in (
    ApiLoss("cross_entropy", frozenset(), {}, _cross_entropy, "tinker", "-Σ w·log p (weights: 'weights')"),
    ApiLoss("importance_sampling", _RL, {}, _importance_sampling, "tinker", "-Σ exp(log p - log q)·A"),
    ApiLoss("ppo", _RL, dict(_THRESHOLDS), _translated("ppo_clip", {"dual_clip": None}), "tinker",
            "-Σ min(ρA, clip(ρ, low, high)·A)"),
    ApiLoss("tinker_cispo", _RL, dict(_CISPO_THRESHOLDS), _translated("cispo", {}), "tinker",
            "-Σ sg(clip(ρ, low, high))·A·log p"),
    ApiLoss("tinker_gspo", _RL, dict(_THRESHOLDS), _translated("gspo_token", {}), "tinker",
            "GSPO-token: every token carries the sequence ratio's value, its own gradient"),
    ApiLoss("tinker_dro", _RL, {"beta": None}, _dro, "tinker", "-Σ (A·log p - β/2·(log p - log q)²)"),
)}
MATH_LOSSES: dict[str, ApiLoss] = {name: _math_loss(spec) for name, spec in LOSS_SPECS.items()}
API_LOSSES: dict[str, ApiLoss] = {**MATH_LOSSES, **TINKER_LOSSES}


def get_loss(name: str) -> ApiLoss:
    if not isinstance(name, str) or name not in API_LOSSES:
        raise ValueError(f"loss_fn: unknown loss {name!r}; allowed: {', '.join(sorted(API_LOSSES))}")
    return API_LOSSES[name]
