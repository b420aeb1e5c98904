"""Index distributions of Ensemble++ (docs/theory.md §10).

Two registries with one signature `fn(shape, M, generator, dtype) -> Tensor[*shape, M]`:

- `REFERENCES` (the index ζ drawn to act): E ζ = 0 and E ζζᵀ = I_M, so θ = μ + Aζ has covariance AAᵀ.
- `PERTURBATIONS` (the z stored with each observation): unit norm ‖z‖ = 1 (gaussian: E‖z‖² = 1 only),
  so E[(Σ_s x_s z_sᵀ)(Σ_s x_s z_sᵀ)ᵀ] = Σ_s x_s x_sᵀ and the particles track the posterior covariance.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

IndexSampler = Callable[[tuple, int, torch.Generator, torch.dtype], torch.Tensor]


def _gaussian(shape: tuple, M: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, M, generator=gen, dtype=dtype)


def _unit_sphere(shape: tuple, M: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    g = torch.randn(*shape, M, generator=gen, dtype=dtype)
    return g / g.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def _signs(shape: tuple, M: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(0, 2, (*shape, M), generator=gen).to(dtype) * 2 - 1


def _signed_coordinate(shape: tuple, M: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """±e_i with i uniform and an independent fair sign."""
    idx = torch.randint(0, M, shape, generator=gen)
    sign = torch.randint(0, 2, shape, generator=gen).to(dtype) * 2 - 1
    out = torch.zeros(*shape, M, dtype=dtype)
    out.scatter_(-1, idx.unsqueeze(-1), sign.unsqueeze(-1))
    return out


def reference_gaussian(shape, M, gen, dtype):
    """ζ ~ N(0, I_M)."""
    return _gaussian(shape, M, gen, dtype)


def reference_sphere(shape, M, gen, dtype):
    """ζ = √M · u, u ~ U(S^{M−1}); E ζζᵀ = M · I/M = I."""
    return math.sqrt(M) * _unit_sphere(shape, M, gen, dtype)


def reference_cube(shape, M, gen, dtype):
    """ζ_i = ±1 independent fair signs."""
    return _signs(shape, M, gen, dtype)


def reference_coordinate(shape, M, gen, dtype):
    """ζ = ±√M e_i, i ~ U{1..M}: picks one particle (ensemble sampling, symmetrised); E ζζᵀ = (1/M)·M·I."""
    return math.sqrt(M) * _signed_coordinate(shape, M, gen, dtype)


def reference_sparse(shape, M, gen, dtype):
    """Sparse sign entries (Achlioptas): ζ_i = √3 · {+1 w.p. 1/6, 0 w.p. 2/3, −1 w.p. 1/6}; E ζ_i² = 1."""
    u = torch.rand(*shape, M, generator=gen, dtype=dtype)
    return math.sqrt(3.0) * ((u < 1 / 6).to(dtype) - (u > 5 / 6).to(dtype))


def perturbation_sphere(shape, M, gen, dtype):
    """z ~ U(S^{M−1}) (‖z‖ = 1)."""
    return _unit_sphere(shape, M, gen, dtype)


def perturbation_cube(shape, M, gen, dtype):
    """z_i = ±1/√M (‖z‖ = 1)."""
    return _signs(shape, M, gen, dtype) / math.sqrt(M)


def perturbation_coordinate(shape, M, gen, dtype):
    """z = ±e_i (‖z‖ = 1): each observation perturbs one particle."""
    return _signed_coordinate(shape, M, gen, dtype)


def perturbation_gaussian(shape, M, gen, dtype):
    """z ~ N(0, I/M): unit norm in mean square only (E‖z‖² = 1)."""
    return _gaussian(shape, M, gen, dtype) / math.sqrt(M)


REFERENCES: dict[str, IndexSampler] = {
    "gaussian": reference_gaussian,
    "sphere": reference_sphere,
    "cube": reference_cube,
    "coordinate": reference_coordinate,
    "sparse": reference_sparse,
}

PERTURBATIONS: dict[str, IndexSampler] = {
    "sphere": perturbation_sphere,
    "cube": perturbation_cube,
    "coordinate": perturbation_coordinate,
    "gaussian": perturbation_gaussian,
}


def get_reference(name: str) -> IndexSampler:
    """The reference sampler called `name`, or a ValueError listing the allowed names."""
    if name not in REFERENCES:
        raise ValueError(f"reference={name!r} is not known; allowed: {', '.join(REFERENCES)}")
    return REFERENCES[name]


def get_perturbation(name: str) -> IndexSampler:
    """The perturbation sampler called `name`, or a ValueError listing the allowed names."""
    if name not in PERTURBATIONS:
        raise ValueError(f"perturbation={name!r} is not known; allowed: {', '.join(PERTURBATIONS)}")
    return PERTURBATIONS[name]
