"""Gradient noise in parameter units: the signal / power / noise split of docs/theory.md §7 and the gradient noise scale
of McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", appendix A), from gradient norms that a
trainer with gradient accumulation already has, so it costs one norm per micro-batch.

Why not the forward-only proxy P = mean_b Â_b²·Ŵ_b (docs/theory.md §7)? It is the per-sequence gradient power of a
model whose parameters are the per-position logits; a real network's gradient norm ‖ḡ‖² is in parameter units
(it also carries ‖h‖² and the layers below), so (P − ‖ḡ‖²)/(N − 1) compares two different units and is clamped to
0 on real models. covrl keeps that forward-only P as a trend (`adv/var_power`, covrl.math.advantages) and estimates
the split itself in parameter units here.

Two batch sizes b_small < b_big with measured squared norms ‖G_small‖², ‖G_big‖² of the mean gradients:
    |G|²  ≈ (b_big ‖G_big‖² − b_small ‖G_small‖²) / (b_big − b_small)
    tr Σ  ≈ (‖G_small‖² − ‖G_big‖²) / (1/b_small − 1/b_big)
    B_simple = tr Σ / |G|²
Both estimates are unbiased; their ratio is not, so the monitor also reports EMA(trΣ)/EMA(|G|²). With N = b_big,
the §7 quantities in parameter units follow:
    signal S = ‖G_big‖² = ‖ḡ‖²,  power P = |G|² + tr Σ (≈ mean_b ‖g_b‖²),  noise = tr Σ / N = (P − S)/(N − 1).

Micro-batches give the small batch for free: with gradient accumulation over k micro-batches of sizes b_i, the
mean of the micro-batches' own gradient norms² has expectation |G|² + trΣ·mean_i(1/b_i) (so b_small is the
harmonic mean of the b_i) and the accumulated gradient is the big batch b_big = Σ b_i. "Size" counts the unit the
loss averages over (`LOSS_UNITS`: rows for a sequence-mean loss, tokens for a token-mean loss). A trainer that
scales each micro-batch's loss by b_i / b_big (so the accumulated gradient is the full-batch mean) measures the norm
of that scaled contribution c_i, e.g. as the norm of `.grad` after minus before the micro-batch's backward; pass
`micro_scaled=True` and the monitor rescales ‖g_i‖² = ‖c_i‖²·(b_big / b_i)².
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# What one unit of "batch size" is, per loss aggregation (covrl.math.losses.aggregate): the loss is a mean over it.
LOSS_UNITS: dict[str, str] = {
    "token-mean": "tokens",
    "seq-mean-token-sum": "rows",
    "seq-mean-token-mean": "rows",
    "seq-mean-token-sum-norm": "rows",
}


@dataclass
class NoiseScale:
    grad_sq: float          # unbiased estimate of |G|² (may be negative for a noisy batch)
    trace_sigma: float      # unbiased estimate of tr Σ (per-sample covariance)
    b_simple: float         # trace_sigma / grad_sq, nan when grad_sq <= 0
    signal: float           # ‖G_big‖², the squared norm of the full-batch mean gradient
    power: float            # |G|² + tr Σ, the per-sample gradient power
    noise: float            # max(0, tr Σ / b_big), the noise power left in the full-batch mean gradient
    metrics: dict[str, float] = field(default_factory=dict)


def gradient_noise_scale(small_norm_sq: float, big_norm_sq: float, small_batch: float,
                         big_batch: float) -> NoiseScale:
    """Two-batch-size estimates (McCandlish et al. 2018, A.1):
    |G|² = (b_big‖G_big‖² − b_small‖G_small‖²)/(b_big − b_small), trΣ = (‖G_small‖² − ‖G_big‖²)/(1/b_small − 1/b_big),
    B_simple = trΣ/|G|² (nan when |G|² <= 0), and the §7 split signal = ‖G_big‖², power = |G|² + trΣ,
    noise = max(0, trΣ/b_big). `small_norm_sq` may be an average over several small batches."""
    b_s, b_b = float(small_batch), float(big_batch)
    if not (b_s > 0 and b_b > b_s):
        raise ValueError(f"need 0 < small_batch < big_batch, got small_batch={small_batch}, big_batch={big_batch}")
    for name, v in (("small_norm_sq", small_norm_sq), ("big_norm_sq", big_norm_sq)):
        if not math.isfinite(float(v)) or float(v) < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
    g_s, g_b = float(small_norm_sq), float(big_norm_sq)
    grad_sq = (b_b * g_b - b_s * g_s) / (b_b - b_s)
    trace_sigma = (g_s - g_b) / (1.0 / b_s - 1.0 / b_b)
    b_simple = trace_sigma / grad_sq if grad_sq > 0 else float("nan")
    power = grad_sq + trace_sigma
    noise = max(0.0, trace_sigma / b_b)
    metrics = {"noise/grad_sq": grad_sq, "noise/trace_sigma": trace_sigma, "noise/signal": g_b,
               "noise/power": power, "noise/noise": noise}
    if math.isfinite(b_simple):
        metrics["noise/b_simple"] = b_simple
    return NoiseScale(grad_sq=grad_sq, trace_sigma=trace_sigma, b_simple=b_simple, signal=g_b, power=power,
                      noise=noise, metrics=metrics)


def micro_batch_noise_scale(micro_norms_sq: Sequence[float], micro_sizes: Sequence[float] | float,
                            full_norm_sq: float, *, micro_scaled: bool = False) -> NoiseScale:
    """Noise scale from gradient accumulation: small batch = each micro-batch, big batch = their union.

    b_big = Σ b_i, b_small = 1 / mean_i(1/b_i) (harmonic mean: E mean_i‖g_i‖² = |G|² + trΣ·mean_i(1/b_i)),
    ‖G_small‖² = mean_i ‖g_i‖² with g_i the micro-batch's own mean gradient; if `micro_scaled`, the given norms
    are of the contributions c_i = (b_i/b_big)·g_i and are rescaled by (b_big/b_i)². Needs >= 2 micro-batches."""
    norms = [float(v) for v in micro_norms_sq]
    k = len(norms)
    sizes = [float(micro_sizes)] * k if isinstance(micro_sizes, (int, float)) else [float(s) for s in micro_sizes]
    if len(sizes) != k:
        raise ValueError(f"micro_sizes has {len(sizes)} entries but micro_norms_sq has {k}")
    if k < 2:
        raise ValueError(f"micro_batch_noise_scale needs at least 2 micro-batches, got {k}")
    if any(s <= 0 for s in sizes):
        raise ValueError(f"micro_sizes must all be > 0, got {sizes}")
    big = sum(sizes)
    if micro_scaled:
        norms = [v * (big / s) ** 2 for v, s in zip(norms, sizes)]
    small = 1.0 / (sum(1.0 / s for s in sizes) / k)
    return gradient_noise_scale(sum(norms) / k, full_norm_sq, small, big)


class GradientNoiseMonitor:
    """Logs the §7 signal / power / noise split and the gradient noise scale every step, each with an EMA.

    Call `update(grad_norm_sq=..., micro_grad_norms_sq=..., micro_batch_sizes=...)` once per optimizer step with
    the full-batch gradient norm² (before clipping) and the micro-batches' norms² and sizes (see the module doc);
    with fewer than two micro-batches only `noise/signal` is logged. Every metric x in `_EMA_KEYS` also gets
    `x_ema` (EMA with weight `ema_alpha` on the newest value, initialised to the first value), and
    `noise/b_simple_ema = EMA(trΣ)/EMA(|G|²)` when EMA(|G|²) > 0.
    """

    _EMA_KEYS = ("noise/signal", "noise/power", "noise/noise", "noise/grad_sq", "noise/trace_sigma")

    def __init__(self, ema_alpha: float = 0.1):
        if not 0.0 < ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {ema_alpha}")
        self.ema_alpha = float(ema_alpha)
        self.ema: dict[str, float] = {}

    def _ema(self, key: str, value: float) -> float:
        prev = self.ema.get(key)
        self.ema[key] = value if prev is None else (1.0 - self.ema_alpha) * prev + self.ema_alpha * value
        return self.ema[key]

    def update(self, *, grad_norm_sq: float, micro_grad_norms_sq: Sequence[float] | None = None,
               micro_batch_sizes: Sequence[float] | float | None = None,
               micro_scaled: bool = False) -> dict[str, float]:
        grad_norm_sq = float(grad_norm_sq)
        if not math.isfinite(grad_norm_sq) or grad_norm_sq < 0:
            raise ValueError(f"grad_norm_sq must be finite and >= 0, got {grad_norm_sq!r}")
        metrics: dict[str, float] = {"noise/signal": grad_norm_sq}
        if micro_grad_norms_sq is not None and len(micro_grad_norms_sq) >= 2:  # one micro-batch: nothing to compare
            if micro_batch_sizes is None:
                raise ValueError("the noise scale needs micro_batch_sizes with micro_grad_norms_sq")
            if not isinstance(micro_batch_sizes, (int, float)) and len(micro_batch_sizes) == len(micro_grad_norms_sq):
                # a micro-batch with nothing in the loss (only failed agent episodes, say) is no sample of the
                # small-batch gradient: it is left out (the big batch's size is the same sum without it)
                kept = [(n, b) for n, b in zip(micro_grad_norms_sq, micro_batch_sizes) if float(b) > 0]
                micro_grad_norms_sq, micro_batch_sizes = [n for n, _ in kept], [b for _, b in kept]
        if micro_grad_norms_sq is not None and len(micro_grad_norms_sq) >= 2:
            metrics.update(micro_batch_noise_scale(micro_grad_norms_sq, micro_batch_sizes, grad_norm_sq,
                                                   micro_scaled=micro_scaled).metrics)
        for key in self._EMA_KEYS:
            if key in metrics:
                metrics[key + "_ema"] = self._ema(key, metrics[key])
        g_ema, s_ema = self.ema.get("noise/grad_sq"), self.ema.get("noise/trace_sigma")
        if "noise/trace_sigma" in metrics and g_ema is not None and s_ema is not None and g_ema > 0:
            metrics["noise/b_simple_ema"] = s_ema / g_ema
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"ema": dict(self.ema), "ema_alpha": self.ema_alpha}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = {str(k): float(v) for k, v in state["ema"].items()}
        self.ema_alpha = float(state.get("ema_alpha", self.ema_alpha))
