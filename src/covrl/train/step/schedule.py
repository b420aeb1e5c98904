"""Learning-rate shape on the data clock (docs/theory.md §9): warm-up and decay are counted in rollouts consumed."""

from __future__ import annotations

import math


def lr_factor(rollouts: int, batch_rollouts: int, *, warmup: int, total: int, schedule: str,
              min_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr for a step that starts at data clock `rollouts` and consumes `batch_rollouts`.

    warm-up:  f_w = min(1, (rollouts + batch_rollouts) / warmup)   (1 when warmup = 0; the first step gets a
              non-zero lr)
    constant: f = f_w
    cosine:   p = clamp((rollouts − warmup) / (total − warmup), 0, 1),
              f = f_w · (min_ratio + (1 − min_ratio) · ½(1 + cos πp))
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
    warm = 1.0 if warmup <= 0 else min(1.0, (rollouts + batch_rollouts) / warmup)
    return warm * SCHEDULES[schedule](rollouts, warmup, total, min_ratio)


def _constant(rollouts: int, warmup: int, total: int, min_ratio: float) -> float:
    return 1.0


def _cosine(rollouts: int, warmup: int, total: int, min_ratio: float) -> float:
    span = max(1, total - warmup)
    progress = min(1.0, max(0.0, (rollouts - warmup) / span))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


SCHEDULES = {"constant": _constant, "cosine": _cosine}
