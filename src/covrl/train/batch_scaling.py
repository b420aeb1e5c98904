"""Step size that follows the batch size (RESEARCH §9).

When the batch grows from `base_batch` to `batch` rollouts per step, the learning rate follows the optimizer:

    SGD (and momentum SGD):   lr = base_lr · (batch / base_batch)          (linear rule)
    Adam / AdamW:             lr = base_lr · sqrt(batch / base_batch)      (square-root rule)

Why: on the data clock (rollouts consumed) the parameter drift per rollout is then independent of the batch. For
SGD a step moves lr·ḡ and there are 1/B steps per rollout. Adam divides by sqrt(v) ≈ σ/sqrt(B) when gradient
noise dominates, so its step is ≈ lr·sqrt(B)·ḡ/σ and lr ∝ sqrt(B) makes B·(drift per step)/B constant.
With the queue sized in rollouts (a fixed Q), the sampler–trainer gap then stays fixed as B grows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from pydantic import Field

from covrl.settings import Section

__all__ = ["LR_RULES", "OPTIMIZER_RULES", "BatchScalingConfig", "lr_for_batch", "scaled_lr"]


def _linear(ratio: float) -> float:
    return ratio


def _sqrt(ratio: float) -> float:
    return math.sqrt(ratio)


def _none(ratio: float) -> float:
    return 1.0


# rule name -> multiplier of the base lr as a function of batch / base_batch
LR_RULES: dict[str, Callable[[float], float]] = {"linear": _linear, "sqrt": _sqrt, "none": _none}

# optimizer name (lower case) -> its rule
OPTIMIZER_RULES: dict[str, str] = {"sgd": "linear", "momentum": "linear", "adam": "sqrt", "adamw": "sqrt"}


def lr_for_batch(base_lr: float, base_batch: int, batch: int, optimizer: str = "adamw",
                 rule: str | None = None) -> float:
    """Learning rate for `batch` rollouts per step, given `base_lr` tuned at `base_batch`.

    lr = base_lr · f(batch / base_batch) with f(x) = x for SGD (linear rule) and f(x) = sqrt(x) for Adam/AdamW
    (square-root rule). `rule` ("linear" | "sqrt" | "none") overrides the optimizer's own rule.
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
    return base_lr * LR_RULES[rule](batch / base_batch)


class BatchScalingConfig(Section):
    """Scale the lr when the batch (rollouts per step) differs from the batch the lr was tuned at."""

    scale_lr: bool = Field(False, description="scale optim.lr from base_batch_rollouts to the run's rollouts per "
                                              "step by the optimizer's rule (AdamW: square root)")
    base_batch_rollouts: int | None = Field(None, ge=1, description="rollouts per step at which optim.lr was tuned "
                                                                    "(required when scale_lr=true)")
    rule: Literal["auto", "linear", "sqrt", "none"] = Field(
        "auto", description="auto = the optimizer's rule (SGD linear, Adam/AdamW square root)")


def scaled_lr(base_lr: float, batch: int, cfg: BatchScalingConfig, optimizer: str = "adamw") -> float:
    """The lr a run uses: `lr_for_batch(base_lr, cfg.base_batch_rollouts, batch, optimizer)` when
    `cfg.scale_lr`, else `base_lr` unchanged."""
    if not cfg.scale_lr:
        return float(base_lr)
    if cfg.base_batch_rollouts is None:
        raise ValueError("batch_scaling.scale_lr=true needs batch_scaling.base_batch_rollouts (the rollouts per "
                         "step at which optim.lr was tuned)")
    rule = None if cfg.rule == "auto" else cfg.rule
    return lr_for_batch(base_lr, cfg.base_batch_rollouts, batch, optimizer, rule=rule)
