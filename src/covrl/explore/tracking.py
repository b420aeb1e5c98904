"""How well the particles of Ensemble++ track the posterior covariance (sequential JL, docs/theory.md §10).

The diagnostic is the spectrum of Σ^{-1/2} A Aᵀ Σ^{-1/2}: all eigenvalues in [1−ε, 1+ε] means
(1−ε)Σ ≼ AAᵀ ≼ (1+ε)Σ. With Σ = L Lᵀ (Cholesky), L⁻¹AAᵀL⁻ᵀ is orthogonally similar to Σ^{-1/2}AAᵀΣ^{-1/2}
(L⁻¹Σ^{1/2} is orthogonal), so its eigenvalues are the same and cost one triangular solve."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CovarianceBand:
    """Eigenvalues [S, d] (ascending) of Σ^{-1/2}AAᵀΣ^{-1/2}; low/high [S] are the extreme ones."""

    eigenvalues: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def covariance_tracking(agent) -> CovarianceBand:
    """Band [λ_min, λ_max] of Σ_t^{-1/2} A_t A_tᵀ Σ_t^{-1/2} for an agent with particles (`LinearEnsemblePP`,
    `EnsembleSampling`: for the latter the models are centred at their mean and scaled by 1/√(M−1) so the
    quantity is their sample covariance against Σ_t). Rank-deficient A (M < d) gives λ_min = 0."""
    A = getattr(agent, "_A", None)
    if A is None:
        models = getattr(agent, "_models", None)
        if models is None:
            raise TypeError(f"covariance_tracking needs an agent with particles, got {type(agent).__name__}")
        M = models.shape[-1]
        if M < 2:
            raise ValueError("covariance_tracking of EnsembleSampling needs M >= 2")
        A = (models - models.mean(-1, keepdim=True)) / (M - 1) ** 0.5
    cov = agent._cov
    chol, info = torch.linalg.cholesky_ex(cov)
    if bool((info != 0).any()):
        raise ValueError("posterior covariance is not positive definite; cannot whiten the particles")
    white = torch.linalg.solve_triangular(chol, A, upper=False)  # L⁻¹A, [S, d, M]
    eig = torch.linalg.eigvalsh(white @ white.transpose(-1, -2))
    low, high = eig[..., 0], eig[..., -1]
    return CovarianceBand(eig, low, high, {"band_low_median": float(low.median()),
                                           "band_high_median": float(high.median())})


class BandTracker:
    """Records the band over time: `observe(agent)` after each update; `low_min`/`high_max` [S] are the
    extremes over all observed t (the uniform-in-time band that the sequential JL lemma controls)."""

    def __init__(self):
        self.steps: list[int] = []
        self.lows: list[torch.Tensor] = []
        self.highs: list[torch.Tensor] = []

    def observe(self, agent, step: int | None = None) -> CovarianceBand:
        band = covariance_tracking(agent)
        self.steps.append(int(agent.t if step is None else step))
        self.lows.append(band.low)
        self.highs.append(band.high)
        return band

    @property
    def low(self) -> torch.Tensor:
        """[n_observed, S] lower band edge over time."""
        return torch.stack(self.lows)

    @property
    def high(self) -> torch.Tensor:
        return torch.stack(self.highs)

    @property
    def low_min(self) -> torch.Tensor:
        return self.low.min(0).values

    @property
    def high_max(self) -> torch.Tensor:
        return self.high.max(0).values
