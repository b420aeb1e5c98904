"""Linear-Gaussian bandit agents (docs/theory.md §10), batched over S independent seeds.

Model: y = ⟨x, θ⟩ + ε, ε ~ N(0, σ²), prior θ ~ N(0, Σ_0) with Σ_0 = prior_var · I. All agents keep the exact
ridge posterior (μ_t, Σ_t) with rank-one (Sherman–Morrison / Kalman) updates, O(d²) per step:

    Σ_t = Σ_{t−1} − Σ_{t−1} x xᵀ Σ_{t−1} / (σ² + xᵀ Σ_{t−1} x)
    μ_t = μ_{t−1} + Σ_t x (y − xᵀ μ_{t−1}) / σ²

and differ in how they draw the θ they act on:

- `LinearEnsemblePP`: particles A ∈ R^{d×M}, θ = μ + Aζ with one reference ζ (E ζζᵀ = I); O(d² + dM).
- `LinearTS`: exact posterior sample θ = μ + chol(Σ) ε, O(d³) per step.
- `EnsembleSampling`: M independently perturbed least-squares models, play one chosen uniformly.
- `LinearGreedy`: θ = μ (no exploration).

Shapes: with `batch=None` the agent is one seed and `act(arms[K, d]) -> int tensor []`, `update(x[d], y[])`;
with `batch=S` it holds S seeds and `act(arms[S, K, d] or [K, d]) -> long[S]`, `update(x[S, d], y[S])`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from covrl.explore.base import BanditAgent, register_agent
from covrl.explore.distributions import get_perturbation, get_reference


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class _LinearGaussian(BanditAgent):
    """Shared exact posterior state μ [S, d], Σ [S, d, d] and the batching conventions."""

    batched = True

    def __init__(self, d: int, prior_var: float = 1.0, noise_var: float = 1.0, *, seed: int = 0,
                 batch: int | None = None, dtype: str = "float64"):
        if not (isinstance(d, int) and d >= 1):
            raise ValueError(f"d must be a positive integer, got {d!r}")
        if batch is not None and not (isinstance(batch, int) and batch >= 1):
            raise ValueError(f"batch must be None or a positive integer, got {batch!r}")
        if dtype not in ("float64", "float32"):
            raise ValueError(f"dtype must be 'float64' or 'float32', got {dtype!r}")
        self.d = d
        self.prior_var = _positive("prior_var", prior_var)
        self.noise_var = _positive("noise_var", noise_var)
        self.batch = batch
        self.S = batch or 1
        self.dtype = getattr(torch, dtype)
        self.seed = seed
        self.gen = torch.Generator().manual_seed(int(seed))
        self.t = 0
        self._mu = torch.zeros(self.S, d, dtype=self.dtype)
        self._cov = (self.prior_var * torch.eye(d, dtype=self.dtype)).expand(self.S, d, d).clone()
        self.config = {"d": d, "prior_var": prior_var, "noise_var": noise_var, "seed": seed, "batch": batch,
                       "dtype": dtype}

    # -- public state (unbatched views when batch=None) -------------------------------------------------
    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return t[0] if self.batch is None else t

    @property
    def mean(self) -> torch.Tensor:
        """Posterior mean μ_t ([d] or [S, d])."""
        return self._out(self._mu)

    @property
    def cov(self) -> torch.Tensor:
        """Posterior covariance Σ_t ([d, d] or [S, d, d])."""
        return self._out(self._cov)

    # -- input checks ---------------------------------------------------------------------------------
    def _arms(self, arms: torch.Tensor) -> torch.Tensor:
        arms = torch.as_tensor(arms, dtype=self.dtype)
        if self.batch is None:
            if arms.dim() != 2 or arms.shape[-1] != self.d:
                raise ValueError(f"arms must have shape [K, d={self.d}], got {tuple(arms.shape)}")
            return arms.unsqueeze(0)
        if arms.dim() == 2 and arms.shape[-1] == self.d:
            return arms.unsqueeze(0).expand(self.S, -1, -1)
        if arms.dim() != 3 or arms.shape[0] != self.S or arms.shape[-1] != self.d:
            raise ValueError(f"arms must have shape [S={self.S}, K, d={self.d}] or [K, d], got {tuple(arms.shape)}")
        return arms

    def _xy(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.as_tensor(x, dtype=self.dtype)
        y = torch.as_tensor(y, dtype=self.dtype)
        want_x, want_y = ((self.d,), ()) if self.batch is None else ((self.S, self.d), (self.S,))
        if tuple(x.shape) != want_x:
            raise ValueError(f"x must have shape {list(want_x)}, got {list(x.shape)}")
        if tuple(y.shape) != want_y:
            raise ValueError(f"y must have shape {list(want_y)}, got {list(y.shape)}")
        return x.reshape(self.S, self.d), y.reshape(self.S)

    def _pick(self, arms: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """argmax_k ⟨arms[s, k], θ_s⟩ per seed."""
        scores = torch.bmm(arms, theta.unsqueeze(-1)).squeeze(-1)
        return self._out(scores.argmax(dim=-1))

    # -- exact posterior update ------------------------------------------------------------------------
    def _posterior_gain(self, x: torch.Tensor) -> torch.Tensor:
        """Update Σ in place (Sherman–Morrison) and return the gain Σ_t x / σ² = Σ_{t−1}x / (σ² + xᵀΣ_{t−1}x)."""
        sx = torch.bmm(self._cov, x.unsqueeze(-1)).squeeze(-1)
        denom = self.noise_var + (x * sx).sum(-1, keepdim=True)
        # Σ −= v vᵀ with v = Σx/√denom: one in-place pass over Σ, and exactly symmetric (v_i v_j = v_j v_i)
        v = sx / denom.sqrt()
        self._cov.baddbmm_(v.unsqueeze(-1), v.unsqueeze(-2), alpha=-1)
        return sx / denom

    def _update_mean(self, gain: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        self._mu += gain * (y - (x * self._mu).sum(-1)).unsqueeze(-1)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Exact posterior update with the observation (x, y)."""
        x, y = self._xy(x, y)
        gain = self._posterior_gain(x)
        self._update_mean(gain, x, y)
        self.t += 1

    def num_parameters(self) -> int:
        """Floats of state per seed: μ (d) + Σ (d²)."""
        return self.d + self.d * self.d

    def state_dict(self) -> dict[str, Any]:
        return {"mu": self._mu.clone(), "cov": self._cov.clone(), "t": self.t, "rng": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._mu = state["mu"].clone()
        self._cov = state["cov"].clone()
        self.t = int(state["t"])
        self.gen.set_state(state["rng"])


@register_agent
class LinearEnsemblePP(_LinearGaussian):
    """Linear Ensemble++: posterior mean μ, covariance Σ and M particles A ∈ R^{d×M}.

    Init: μ_0 = 0, Σ_0 = prior_var·I, A_0 = Σ_0^{1/2} Z_0 with Z_0 entries N(0, 1/M), so E A_0A_0ᵀ = Σ_0.
    Act: one reference ζ ~ P_ζ (E ζ = 0, E ζζᵀ = I_M), θ = μ + Aζ, play argmax_x ⟨x, θ⟩.
    Update (O(d² + dM), Kalman form, σ² = noise_var, fresh perturbation z ~ P_z with ‖z‖ = 1):
        A_t = A_{t−1} + Σ_t x (σ zᵀ − xᵀA_{t−1}) / σ²
    which equals the closed form A_t = Σ_t (Σ_0⁻¹ A_0 + Σ_s x_s z_sᵀ / σ): the particles are a random
    projection of the data history, and E A_tA_tᵀ = Σ_t.
    """

    def __init__(self, d: int, M: int = 8, prior_var: float = 1.0, noise_var: float = 1.0,
                 reference: str = "gaussian", perturbation: str = "sphere", seed: int = 0, *,
                 batch: int | None = None, dtype: str = "float64"):
        super().__init__(d, prior_var, noise_var, seed=seed, batch=batch, dtype=dtype)
        if not (isinstance(M, int) and M >= 1):
            raise ValueError(f"M must be a positive integer, got {M!r}")
        self.M = M
        self._reference = get_reference(reference)
        self._perturbation = get_perturbation(perturbation)
        z0 = torch.randn(self.S, d, M, generator=self.gen, dtype=self.dtype) / math.sqrt(M)
        self._A = math.sqrt(self.prior_var) * z0
        self.config.update(M=M, reference=reference, perturbation=perturbation)

    @property
    def particles(self) -> torch.Tensor:
        """Particles A_t ([d, M] or [S, d, M])."""
        return self._out(self._A)

    def sample_reference(self) -> torch.Tensor:
        """One reference ζ per seed, [S, M]."""
        return self._reference((self.S,), self.M, self.gen, self.dtype)

    def sample_theta(self) -> torch.Tensor:
        """θ = μ + Aζ ([d] or [S, d])."""
        zeta = self.sample_reference()
        return self._out(self._mu + torch.einsum("sdm,sm->sd", self._A, zeta))

    def act(self, arms: torch.Tensor) -> torch.Tensor:
        """argmax_x ⟨x, μ + Aζ⟩ with one ζ shared by all arms of a seed."""
        arms = self._arms(arms)
        zeta = self.sample_reference()
        theta = self._mu + torch.bmm(self._A, zeta.unsqueeze(-1)).squeeze(-1)
        return self._pick(arms, theta)

    def update(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """Kalman update of μ, Σ, A with (x, y); `z` ([M] or [S, M]) overrides the drawn perturbation.
        Returns the perturbation used."""
        x, y = self._xy(x, y)
        if z is None:
            z = self._perturbation((self.S,), self.M, self.gen, self.dtype)
        else:
            z = torch.as_tensor(z, dtype=self.dtype).reshape(self.S, self.M)
        gain = self._posterior_gain(x)
        sigma = math.sqrt(self.noise_var)
        residual = sigma * z - torch.bmm(x.unsqueeze(1), self._A).squeeze(1)
        self._A.baddbmm_(gain.unsqueeze(-1), residual.unsqueeze(-2))  # in place: one pass over A
        self._update_mean(gain, x, y)
        self.t += 1
        return self._out(z)

    def num_parameters(self) -> int:
        """Floats of state per seed: μ (d) + Σ (d²) + A (dM)."""
        return self.d + self.d * self.d + self.d * self.M

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "A": self._A.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._A = state["A"].clone()


@register_agent
class LinearTS(_LinearGaussian):
    """Exact linear Thompson sampling: θ = μ + L ε, L = chol(Σ_t), ε ~ N(0, I_d); O(d³) per act."""

    def __init__(self, d: int, prior_var: float = 1.0, noise_var: float = 1.0, seed: int = 0, *,
                 batch: int | None = None, dtype: str = "float64"):
        super().__init__(d, prior_var, noise_var, seed=seed, batch=batch, dtype=dtype)

    def sample_theta(self) -> torch.Tensor:
        """θ ~ N(μ_t, Σ_t) ([d] or [S, d])."""
        chol, info = torch.linalg.cholesky_ex(self._cov)
        if bool((info != 0).any()):  # round-off made Σ indefinite: add the smallest jitter that works
            jitter = 1e-10 * self.prior_var
            while bool((info != 0).any()):
                chol, info = torch.linalg.cholesky_ex(self._cov + jitter * torch.eye(self.d, dtype=self.dtype))
                jitter *= 10
        eps = torch.randn(self.S, self.d, generator=self.gen, dtype=self.dtype)
        return self._out(self._mu + torch.einsum("sij,sj->si", chol, eps))

    def act(self, arms: torch.Tensor) -> torch.Tensor:
        """argmax_x ⟨x, θ⟩ with θ an exact posterior sample."""
        arms = self._arms(arms)
        theta = self.sample_theta()
        return self._pick(arms, theta.reshape(self.S, self.d))


@register_agent
class EnsembleSampling(_LinearGaussian):
    """Ensemble sampling (Lu & Van Roy 2017): M models θ_m, each the ridge fit of its own prior draw
    θ_m^0 ~ N(0, Σ_0) and perturbed targets y + w_m, w_m ~ N(0, σ²):
        θ_m ← θ_m + Σ_t x (y + w_m − xᵀθ_m) / σ²      (O(d² + dM) per step)
    Act: m ~ U{1..M}, play argmax_x ⟨x, θ_m⟩."""

    def __init__(self, d: int, M: int = 8, prior_var: float = 1.0, noise_var: float = 1.0, seed: int = 0, *,
                 batch: int | None = None, dtype: str = "float64"):
        super().__init__(d, prior_var, noise_var, seed=seed, batch=batch, dtype=dtype)
        if not (isinstance(M, int) and M >= 1):
            raise ValueError(f"M must be a positive integer, got {M!r}")
        self.M = M
        self._models = math.sqrt(self.prior_var) * torch.randn(self.S, d, M, generator=self.gen, dtype=self.dtype)
        self.config.update(M=M)

    @property
    def particles(self) -> torch.Tensor:
        """The M models ([d, M] or [S, d, M])."""
        return self._out(self._models)

    def act(self, arms: torch.Tensor) -> torch.Tensor:
        arms = self._arms(arms)
        m = torch.randint(0, self.M, (self.S,), generator=self.gen)
        theta = self._models[torch.arange(self.S), :, m]
        return self._pick(arms, theta)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = self._xy(x, y)
        w = math.sqrt(self.noise_var) * torch.randn(self.S, self.M, generator=self.gen, dtype=self.dtype)
        gain = self._posterior_gain(x)
        residual = y.unsqueeze(-1) + w - torch.bmm(x.unsqueeze(1), self._models).squeeze(1)
        self._models.baddbmm_(gain.unsqueeze(-1), residual.unsqueeze(-2))
        self._update_mean(gain, x, y)
        self.t += 1

    def num_parameters(self) -> int:
        """Floats of state per seed: μ (d) + Σ (d²) + models (dM)."""
        return self.d + self.d * self.d + self.d * self.M

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "models": self._models.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._models = state["models"].clone()


@register_agent
class LinearGreedy(_LinearGaussian):
    """Greedy on the ridge posterior mean: play argmax_x ⟨x, μ_t⟩ (no exploration)."""

    def __init__(self, d: int, prior_var: float = 1.0, noise_var: float = 1.0, seed: int = 0, *,
                 batch: int | None = None, dtype: str = "float64"):
        super().__init__(d, prior_var, noise_var, seed=seed, batch=batch, dtype=dtype)

    def act(self, arms: torch.Tensor) -> torch.Tensor:
        return self._pick(self._arms(arms), self._mu)
