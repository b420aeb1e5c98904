"""Gradient noise: the per-batch variance proxies of RESEARCH.md §7 and the gradient noise scale of McCandlish
et al. 2018 ("An Empirical Model of Large-Batch Training", appendix A), both cheap enough to log every step.

Variance proxies (forward-only; the logit-gradient proxy w_t = 1 − 2π_t(y_t) + Σ_v π_t(v)² is ‖∂ log π(y_t)/∂z_t‖²):
    per sequence  Â_b = mean_t A_{b,t},  Ŵ_b = Σ_t w_{b,t}          (valid tokens only)
    signal  S = ‖ḡ‖²                       (grad norm² of the batch-mean sequence-sum loss, before clipping)
    power   P = mean_b Â_b² · max(Ŵ_b, 0)  (≈ mean_b ‖g_b‖², the per-sequence gradient power)
    noise   = max(0, (P − S) / (N − 1))    (N = rows; ≈ tr Σ / N, the noise power left in the mean gradient)
Why: E‖ḡ‖² = ‖G‖² + trΣ/N and E mean_b‖g_b‖² = ‖G‖² + trΣ, so (P − S)/(N − 1) estimates trΣ/N. The identity
P = mean_b ‖g_b‖² is exact when the parameters are the per-position logits themselves and A is constant along
a sequence; for a real network P is in logit-gradient units (it omits ‖h‖² and the layers below), so read the
noise proxy as a trend, not an absolute number.

Gradient noise scale from two batch sizes b_small < b_big with measured ‖G_small‖², ‖G_big‖²:
    |G|²  ≈ (b_big ‖G_big‖² − b_small ‖G_small‖²) / (b_big − b_small)
    tr Σ  ≈ (‖G_small‖² − ‖G_big‖²) / (1/b_small − 1/b_big)
    B_simple = tr Σ / |G|²
Both estimates are unbiased; their ratio is not, so the monitor also reports EMA(trΣ)/EMA(|G|²).

Micro-batches give the small batch for free: with gradient accumulation over k micro-batches of sizes b_i, the
mean of the micro-batches' own gradient norms² has expectation |G|² + trΣ·mean_i(1/b_i) (so b_small is the
harmonic mean of the b_i) and the accumulated gradient is the big batch b_big = Σ b_i. "Size" counts the unit the
loss averages over (rows for a sequence-mean loss, tokens for a token-mean loss). A trainer that scales each
micro-batch's loss by b_i / b_big (so the accumulated gradient is the full-batch mean) measures the norm of that
scaled contribution c_i, e.g. as the norm of `.grad` after minus before the micro-batch's backward; pass
`micro_scaled=True` and the monitor rescales ‖g_i‖² = ‖c_i‖²·(b_big / b_i)².
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

AGGREGATIONS = ("seq-mean-token-sum", "token-mean")


@dataclass
class VarianceProxies:
    signal: float
    power: float
    noise: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class NoiseScale:
    grad_sq: float          # unbiased estimate of |G|² (may be negative for a noisy batch)
    trace_sigma: float      # unbiased estimate of tr Σ (per-sample covariance)
    b_simple: float         # trace_sigma / grad_sq, nan when grad_sq <= 0
    metrics: dict[str, float] = field(default_factory=dict)


def _check_bt(name: str, x: torch.Tensor, shape: torch.Size) -> None:
    if x.shape != shape:
        raise ValueError(f"{name} must have shape [B, T] = {list(shape)}, got {list(x.shape)}")


def variance_proxies(advantages: torch.Tensor, logit_grad_proxy: torch.Tensor, mask: torch.Tensor,
                     grad_norm_sq: float, *, aggregation: str = "seq-mean-token-sum") -> VarianceProxies:
    """Signal, total power and noise proxies of RESEARCH §7 for one batch.

    Â_b = Σ_t A m / Σ_t m (0 for an empty row), Ŵ_b = Σ_t w m, P = mean_b Â_b²·max(Ŵ_b, 0), S = ‖ḡ‖²,
    noise = max(0, (P − S)/(N − 1)), N = B rows.
    `grad_norm_sq` is ‖∇L‖² of the trainer's loss before clipping; `aggregation` says how that loss averaged
    tokens so that S refers to the batch-mean sequence-sum gradient ḡ = (1/B) Σ_b Σ_t A ∇log π:
    "seq-mean-token-sum" (L = (1/B) Σ_b Σ_t ·): S = ‖∇L‖²; "token-mean" (L = Σ_{b,t} · / M, M valid tokens):
    ∇L = (B/M)·ḡ, so S = ‖∇L‖²·(M/B)².
    """
    shape = advantages.shape
    if advantages.dim() != 2:
        raise ValueError(f"advantages must be [B, T], got shape {list(shape)}")
    _check_bt("logit_grad_proxy", logit_grad_proxy, shape)
    _check_bt("mask", mask, shape)
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    rows = shape[0]
    if rows < 2:
        raise ValueError(f"variance_proxies needs at least 2 rows (N − 1 divides), got B = {rows}")
    grad_norm_sq = float(grad_norm_sq)
    if not math.isfinite(grad_norm_sq) or grad_norm_sq < 0:
        raise ValueError(f"grad_norm_sq must be finite and >= 0, got {grad_norm_sq!r}")
    m = mask.detach().double()
    a = advantages.detach().double()
    w = logit_grad_proxy.detach().double()
    lengths = m.sum(dim=1)
    a_hat = (a * m).sum(dim=1) / lengths.clamp_min(1.0)
    w_hat = (w * m).sum(dim=1)
    power = float((a_hat.square() * w_hat.clamp_min(0.0)).mean())
    if aggregation == "token-mean":
        signal = grad_norm_sq * (float(lengths.sum()) / rows) ** 2
    else:
        signal = grad_norm_sq
    noise = max(0.0, (power - signal) / (rows - 1))
    metrics = {"noise/signal": signal, "noise/power": power, "noise/noise": noise,
               "noise/w_hat_mean": float(w_hat.mean()), "noise/a_hat_sq_mean": float(a_hat.square().mean())}
    return VarianceProxies(signal=signal, power=power, noise=noise, metrics=metrics)


def gradient_noise_scale(small_norm_sq: float, big_norm_sq: float, small_batch: float,
                         big_batch: float) -> NoiseScale:
    """Two-batch-size estimates (McCandlish et al. 2018, A.1):
    |G|² = (b_big‖G_big‖² − b_small‖G_small‖²)/(b_big − b_small), trΣ = (‖G_small‖² − ‖G_big‖²)/(1/b_small − 1/b_big),
    B_simple = trΣ/|G|² (nan when |G|² <= 0). `small_norm_sq` may be an average over several small batches."""
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
    metrics = {"noise/grad_sq": grad_sq, "noise/trace_sigma": trace_sigma}
    if math.isfinite(b_simple):
        metrics["noise/b_simple"] = b_simple
    return NoiseScale(grad_sq=grad_sq, trace_sigma=trace_sigma, b_simple=b_simple, metrics=metrics)


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
    """Logs the §7 variance proxies and the gradient noise scale every step, each with an EMA.

    Call `update(...)` once per optimizer step with what the trainer has; each part is optional:
      - variance proxies: `grad_norm_sq`, `advantages`, `logit_grad_proxy`, `mask` (and `aggregation`);
      - noise scale: `grad_norm_sq` (full batch) + `micro_grad_norms_sq` and `micro_batch_sizes` (see module doc).
    Returns `noise/*` metrics; every metric x also gets `x_ema` (EMA with weight `ema_alpha` on the newest value,
    initialised to the first value), and `noise/b_simple_ema = EMA(trΣ)/EMA(|G|²)` when EMA(|G|²) > 0.
    """

    _EMA_KEYS = ("noise/signal", "noise/power", "noise/noise", "noise/grad_sq", "noise/trace_sigma")

    def __init__(self, ema_alpha: float = 0.1, aggregation: str = "token-mean"):
        if not 0.0 < ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {ema_alpha}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        self.ema_alpha = float(ema_alpha)
        self.aggregation = aggregation
        self.ema: dict[str, float] = {}

    def _ema(self, key: str, value: float) -> float:
        prev = self.ema.get(key)
        self.ema[key] = value if prev is None else (1.0 - self.ema_alpha) * prev + self.ema_alpha * value
        return self.ema[key]

    def update(self, *, grad_norm_sq: float | None = None, advantages: torch.Tensor | None = None,
               logit_grad_proxy: torch.Tensor | None = None, mask: torch.Tensor | None = None,
               micro_grad_norms_sq: Sequence[float] | None = None,
               micro_batch_sizes: Sequence[float] | float | None = None, micro_scaled: bool = False,
               aggregation: str | None = None) -> dict[str, float]:
        metrics: dict[str, float] = {}
        proxies_given = [x is not None for x in (advantages, logit_grad_proxy, mask)]
        if any(proxies_given):
            if not all(proxies_given) or grad_norm_sq is None:
                raise ValueError("variance proxies need grad_norm_sq, advantages, logit_grad_proxy and mask together")
            metrics.update(variance_proxies(advantages, logit_grad_proxy, mask, grad_norm_sq,
                                            aggregation=aggregation or self.aggregation).metrics)
        if micro_grad_norms_sq is not None:
            if grad_norm_sq is None or micro_batch_sizes is None:
                raise ValueError("the noise scale needs grad_norm_sq, micro_grad_norms_sq and micro_batch_sizes")
            if len(micro_grad_norms_sq) >= 2:  # one micro-batch = one batch size: nothing to compare
                metrics.update(micro_batch_noise_scale(micro_grad_norms_sq, micro_batch_sizes, grad_norm_sq,
                                                       micro_scaled=micro_scaled).metrics)
        if grad_norm_sq is not None:
            metrics["noise/grad_norm_sq"] = float(grad_norm_sq)
        for key in self._EMA_KEYS:
            if key in metrics:
                metrics[key + "_ema"] = self._ema(key, metrics[key])
        g_ema, s_ema = self.ema.get("noise/grad_sq"), self.ema.get("noise/trace_sigma")
        if "noise/trace_sigma" in metrics and g_ema is not None and s_ema is not None and g_ema > 0:
            metrics["noise/b_simple_ema"] = s_ema / g_ema
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"ema": dict(self.ema), "ema_alpha": self.ema_alpha, "aggregation": self.aggregation}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = {str(k): float(v) for k, v in state["ema"].items()}
        self.ema_alpha = float(state.get("ema_alpha", self.ema_alpha))
        self.aggregation = state.get("aggregation", self.aggregation)
