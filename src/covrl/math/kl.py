"""Sample-based KL estimators on drawn tokens (docs/theory.md §0, §5, §6).

With the token drawn from the *sample* distribution s and the other distribution o,
`log r = log o(y) − log s(y)` (clamped to ±20):

    k1  = −log r                 unbiased for KL(s‖o), can be negative
    k2  = ½ (log r)²             ≥ 0, biased (2nd-order accurate)
    k3  = r − 1 − log r          ≥ 0, unbiased for KL(s‖o)
    abs = |log r|

Straight-through (`straight_through=True`): the forward value is the chosen estimator, the gradient is the
gradient of k2: `out = k2 − sg(k2) + sg(k_kind)`. Use it for a penalty on the trained policy's *own* samples
(logp_sample carries the gradient, logp_other is a frozen reference): on-policy `E_p[∇ k2] = ∇ KL(p‖ref)`
exactly, while the gradients of k1 and k3 taken this way are not the gradient of the KL. When the trained
policy is `logp_other` and the tokens come from a fixed sampler (docs/theory.md §5), the plain k1 and k3 gradients
are already unbiased for ∇ KL(sampler‖trainer) and no straight-through is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from covrl.math._util import check_same_shape, choose, clamped_log_ratio


def _k1(log_r: torch.Tensor) -> torch.Tensor:
    return -log_r


def _k2(log_r: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_r.square()


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    # expm1 keeps r − 1 accurate for tiny log r
    return torch.expm1(log_r) - log_r


def _abs(log_r: torch.Tensor) -> torch.Tensor:
    return log_r.abs()


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "abs": _abs,
}


def kl_estimate(logp_sample: torch.Tensor, logp_other: torch.Tensor, kind: str = "k3",
                straight_through: bool = False) -> torch.Tensor:
    """Per-token KL estimate, fp32, same shape as the inputs (see the module docstring for the formulas).

    logp_sample: log-prob of each drawn token under the distribution it was drawn from;
    logp_other: log-prob of the same token under the other distribution. kind: k1 | k2 | k3 | abs.
    Padding is not masked here: multiply by your mask.
    """
    fn = choose(kind, "KL estimator kind", KL_ESTIMATORS)
    check_same_shape(logp_sample=logp_sample, logp_other=logp_other)
    log_r = clamped_log_ratio(logp_other, logp_sample)
    value = fn(log_r)
    if not straight_through:
        return value
    k2 = _k2(log_r)
    return k2 - k2.detach() + value.detach()
