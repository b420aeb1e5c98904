"""Small shared helpers for covrl.math: shape checks, masked reductions, log-ratio clamping."""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # log-ratios are clamped to ±20 before exp (exp(20) ≈ 4.9e8 stays finite in fp32)


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming every argument and its shape when the given (non-None) tensors differ in shape."""
    given = {k: v for k, v in tensors.items() if v is not None}
    shapes = {k: tuple(v.shape) for k, v in given.items()}
    if len(set(shapes.values())) > 1:
        listing = ", ".join(f"{k} {list(s)}" for k, s in shapes.items())
        raise ValueError(f"shape mismatch: expected equal shapes, got {listing}")


def check_2d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [B, T]; got shape {list(x.shape)}")


def choose(kind: str, what: str, registry) -> object:
    """Look `kind` up in `registry`, or raise a ValueError listing the valid names."""
    try:
        return registry[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {what} {kind!r}; valid choices: {sorted(registry)}") from None


def clamped_log_ratio(logp_num: torch.Tensor, logp_den: torch.Tensor) -> torch.Tensor:
    """log(num/den) in fp32, clamped to ±LOG_RATIO_CLAMP."""
    return (logp_num.float() - logp_den.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    # where() instead of x*mask so that inf/nan on padding cannot leak into the sum
    y = torch.where(mask > 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))
    return y.sum() if dim is None else y.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Σ x·m / Σ m; 0 where Σ m = 0 (all-masked rows)."""
    den = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / den.clamp_min(1e-8)


def masked_max(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Max over valid entries; -inf... replaced by 0 when nothing is valid."""
    neg = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    y = torch.where(mask > 0, x, neg)
    out = y.amax() if dim is None else y.amax(dim)
    return torch.where(torch.isfinite(out), out, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return -masked_max(-x, mask)


def item(x: torch.Tensor | float) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)
