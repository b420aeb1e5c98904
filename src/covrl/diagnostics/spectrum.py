"""Spectrum of a weight update (docs/theory.md §1): how many directions carry its energy."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class UpdateSpectrum:
    """Singular values of one matrix (descending, fp64) and scalar summaries in `metrics`:

    energy_top_k     Σ_{i<k} σ_i² / Σ_i σ_i²  (share of ‖Δ‖_F² in the top k directions; 1.0 for Δ = 0)
    numerical_rank   #{i : σ_i > rtol·σ_max}
    stable_rank      ‖Δ‖_F² / ‖Δ‖_2²  (≤ rank; insensitive to tiny singular values)
    effective_rank   exp(H(p)), p_i = σ_i / Σ_j σ_j (Roy & Vetterli 2007)
    rank_ratio       numerical_rank / min(m, n)
    frobenius_sq     ‖Δ‖_F², spectral = σ_max, k, full_rank = min(m, n), rtol
    """

    singular_values: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def default_rtol(shape: tuple[int, int], dtype: torch.dtype) -> float:
    """Relative cut-off for the numerical rank: `max(m, n)·eps(dtype)` (the NumPy/LAPACK convention)."""
    return max(shape) * torch.finfo(dtype).eps


def update_spectrum(delta: torch.Tensor, k: int, *, rtol: float | None = None) -> UpdateSpectrum:
    """Spectral summary of an update matrix Δ (e.g. θ_after − θ_before of one weight matrix).

    Singular values σ_1 ≥ … ≥ σ_r of Δ, in fp64 (from the Gram matrix when the rank cut-off is ≥ 1e-6, i.e. for
    fp32/bf16 updates; by SVD otherwise). Reports the energy in the top k directions
    `Σ_{i<k} σ_i² / Σ σ_i²`, the numerical rank `#{σ_i > rtol·σ_1}` with `rtol = max(m, n)·eps(dtype of Δ)` by
    default, the stable rank `‖Δ‖_F²/σ_1²` and the effective rank `exp(−Σ p_i log p_i)`, `p_i = σ_i/Σσ`.
    A 1-D tensor is treated as a 1×n matrix. k must be ≥ 1 (values above min(m, n) are allowed: energy 1).
    """
    if not isinstance(delta, torch.Tensor):
        raise TypeError(f"delta must be a torch.Tensor; got {type(delta).__name__}")
    if delta.dim() == 1:
        delta = delta[None, :]
    if delta.dim() != 2:
        raise ValueError(f"delta must be a matrix [m, n] (or a vector); got shape {list(delta.shape)}")
    if int(k) < 1:
        raise ValueError(f"k must be >= 1; got {k}")
    if not delta.is_floating_point():
        raise ValueError(f"delta must be a floating-point tensor; got dtype {delta.dtype}")
    k = int(k)
    src_dtype = delta.dtype
    m, n = delta.shape
    tol = default_rtol((m, n), src_dtype) if rtol is None else float(rtol)
    if not torch.isfinite(delta).all():
        raise ValueError("delta contains NaN or Inf")
    d = delta.detach().to(torch.float64)
    if min(m, n) == 0:
        s = torch.zeros(0, dtype=torch.float64)
    elif tol >= 1e-6:
        # σ² = eigenvalues of the smaller Gram matrix: several times faster than an SVD and, in fp64, accurate to
        # ~1e-16·σ_max², far below the rank cut-off (tol·σ_max)² ≥ 1e-12·σ_max² used for fp32/bf16 updates
        gram = d.T @ d if m >= n else d @ d.T
        s = torch.linalg.eigvalsh(gram).flip(0).clamp_min(0.0).sqrt()
    else:
        s = torch.linalg.svdvals(d)
    energy = s.pow(2)
    total = float(energy.sum())
    smax = float(s[0]) if s.numel() else 0.0
    if total > 0.0:
        top = float(energy[:k].sum()) / total
        stable = total / (smax * smax)
        p = s / s.sum()
        p = p[p > 0]
        eff = float(torch.exp(-(p * p.log()).sum()))
        nrank = int((s > tol * smax).sum())
    else:
        top, stable, eff, nrank = 1.0, 0.0, 0.0, 0
    full = min(m, n)
    return UpdateSpectrum(
        singular_values=s,
        metrics={
            "energy_top_k": top,
            "k": float(k),
            "numerical_rank": float(nrank),
            "stable_rank": stable,
            "effective_rank": eff,
            "full_rank": float(full),
            "rank_ratio": nrank / full if full else 0.0,
            "frobenius_sq": total,
            "spectral": smax,
            "rtol": float(tol),
        },
    )
