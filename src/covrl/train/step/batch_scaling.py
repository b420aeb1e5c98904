"""Step size that follows the batch size (docs/theory.md §9).

When the batch grows from `base_batch` to `batch` rollouts per step, the learning rate follows the optimizer:

    SGD (and momentum SGD):   lr = base_lr · (batch / base_batch)          (linear rule)
    Adam / AdamW:             lr = base_lr · sqrt(batch / base_batch)      (square-root rule)

Why: on the data clock (rollouts consumed) the parameter drift per rollout is then independent of the batch. For
SGD a step moves lr·ḡ and there are 1/B steps per rollout. Adam divides by sqrt(v) ≈ σ/sqrt(B) when gradient
noise dominates, so its step is ≈ lr·sqrt(B)·ḡ/σ and lr ∝ sqrt(B) makes B·(drift per step)/B constant.
With the queue sized in rollouts (a fixed Q), the sampler–trainer gap then stays fixed as B grows.

With Adam momentum β1 the per-step updates are correlated over ~1/(1 − β1) steps, so over a lag of L = Q/B steps
the noise-driven drift is L·lr²·σ²·r(L) (`momentum_drift_factor`), not L·lr²·σ². The rule that holds that fixed
is `sqrt_momentum`: lr = base_lr · sqrt(batch/base_batch) · sqrt(r(Q/base_batch) / r(Q/batch)) (= `sqrt` at
β1 = 0). Measured (studies/async_gap/README.md §4.1): it holds on the exact-gap toy, but on the tiny transformer at
β1 = 0.9, Q = 256 it overshoots (gap ×1.6 / ×2.4 at 4× / 16× B; the plain square root shrinks it ×0.55 / ×0.20), so
it is available by name only, never chosen by `auto`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from covrl.settings import Section

__all__ = ["LR_RULES", "OPTIMIZER_RULES", "BatchScalingConfig", "LagContext", "lr_for_batch",
           "momentum_drift_factor", "scaled_lr"]


def momentum_drift_factor(beta1: float, lag: int) -> float:
    """r(L) = Var(Σ_{k=1..L} m_k) / (L·σ²) for a stationary EMA m_k = β1·m_{k−1} + (1−β1)·g_k of white noise g of
    variance σ²: how much of the random-walk drift lr²·L·σ² momentum delivers within a lag of L steps.
    Σ_k m_k = Σ_{i=1..L} (1 − β1^{L−i+1}) g_i + (1 − β1^L)·Σ_{i≤0} β1^{1−i} g_i, so
    r(L) = [Σ_{n=1..L} (1 − β1^n)² + (1 − β1^L)²·β1²/(1 − β1²)] / L  (→ 1 for L ≫ 1/(1−β1); r ≡ 1 at β1 = 0)."""
    if lag < 1:
        raise ValueError(f"lag must be >= 1 step, got {lag}")
    b = float(beta1)
    if not 0.0 <= b < 1.0:
        raise ValueError(f"beta1 must lie in [0, 1), got {beta1!r}")
    inside = sum((1 - b ** n) ** 2 for n in range(1, lag + 1))
    before = (1 - b ** lag) ** 2 * b * b / (1 - b * b)
    return (inside + before) / lag


@dataclass(frozen=True)
class LagContext:
    """What the momentum-aware rule needs besides the batch ratio: Adam's β1 and the queue Q in rollouts."""

    beta1: float
    queue_rollouts: int


def _linear(base_batch: int, batch: int, ctx: LagContext | None) -> float:
    return batch / base_batch


def _sqrt(base_batch: int, batch: int, ctx: LagContext | None) -> float:
    return math.sqrt(batch / base_batch)


def _none(base_batch: int, batch: int, ctx: LagContext | None) -> float:
    return 1.0


def _sqrt_momentum(base_batch: int, batch: int, ctx: LagContext | None) -> float:
    if ctx is None or ctx.queue_rollouts < max(base_batch, batch):
        raise ValueError("lr rule 'sqrt_momentum' needs Adam's beta1 and a queue of at least one step at both "
                         f"batches (Q >= {max(base_batch, batch)} rollouts); got {ctx}")
    lag0, lag = ctx.queue_rollouts // base_batch, ctx.queue_rollouts // batch
    r0, r = momentum_drift_factor(ctx.beta1, lag0), momentum_drift_factor(ctx.beta1, lag)
    return math.sqrt(batch / base_batch * r0 / r)


# rule name -> multiplier of the base lr as a function of (base_batch, batch, lag context)
LR_RULES: dict[str, Callable[[int, int, LagContext | None], float]] = {
    "linear": _linear, "sqrt": _sqrt, "none": _none, "sqrt_momentum": _sqrt_momentum}

# optimizer name (lower case) -> its rule
OPTIMIZER_RULES: dict[str, str] = {"sgd": "linear", "momentum": "linear", "adam": "sqrt", "adamw": "sqrt"}


def lr_for_batch(base_lr: float, base_batch: int, batch: int, optimizer: str = "adamw",
                 rule: str | None = None, lag: LagContext | None = None) -> float:
    """Learning rate for `batch` rollouts per step, given `base_lr` tuned at `base_batch`.

    lr = base_lr · f(batch / base_batch) with f(x) = x for SGD (linear rule) and f(x) = sqrt(x) for Adam/AdamW
    (square-root rule). `rule` ("linear" | "sqrt" | "none" | "sqrt_momentum") overrides the optimizer's own
    rule; `sqrt_momentum` needs `lag` (β1 and the queue in rollouts).
    """
    if not (base_lr > 0 and math.isfinite(base_lr)):
        raise ValueError(f"base_lr must be a finite positive number, got {base_lr!r}")
    if int(base_batch) < 1 or int(batch) < 1:
        raise ValueError(f"base_batch and batch must be >= 1 rollouts, got base_batch={base_batch}, batch={batch}")
    if rule is None:
        key = optimizer.lower()
        if key not in OPTIMIZER_RULES:
            raise ValueError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZER_RULES)} "
                             f"(or pass rule= one of {', '.join(LR_RULES)})")
        rule = OPTIMIZER_RULES[key]
    if rule not in LR_RULES:
        raise ValueError(f"unknown lr rule {rule!r}; allowed: {', '.join(LR_RULES)}")
    return base_lr * LR_RULES[rule](int(base_batch), int(batch), lag)


class BatchScalingConfig(Section):
    """Scale the lr when the batch (rollouts per step) differs from the batch the lr was tuned at."""

    scale_lr: bool = Field(False, description="scale optim.lr from base_batch_rollouts to the run's rollouts per "
                                              "step by the optimizer's rule (AdamW: square root)")
    base_batch_rollouts: int | None = Field(None, ge=1, description="rollouts per step at which optim.lr was tuned "
                                                                    "(required when scale_lr=true)")
    rule: Literal["auto", "linear", "sqrt", "none", "sqrt_momentum"] = Field(
        "auto", description="auto = the optimizer's rule (SGD linear, Adam/AdamW square root); sqrt_momentum = "
                            "the square root corrected for Adam's beta1 at the async queue's lag (needs "
                            "async_loop.max_staleness_rollouts)")


def scaled_lr(base_lr: float, batch: int, cfg: BatchScalingConfig, optimizer: str = "adamw",
              lag: LagContext | None = None) -> float:
    """The lr a run uses: `lr_for_batch(base_lr, cfg.base_batch_rollouts, batch, optimizer)` when
    `cfg.scale_lr`, else `base_lr` unchanged. `lag` is the run's β1 and queue (for `sqrt_momentum`)."""
    if not cfg.scale_lr:
        return float(base_lr)
    if cfg.base_batch_rollouts is None:
        raise ValueError("batch_scaling.scale_lr=true needs batch_scaling.base_batch_rollouts (the rollouts per "
                         "step at which optim.lr was tuned)")
    rule = None if cfg.rule == "auto" else cfg.rule
    return lr_for_batch(base_lr, cfg.base_batch_rollouts, batch, optimizer, rule=rule, lag=lag)
