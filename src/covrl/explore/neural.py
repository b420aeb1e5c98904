"""Neural bandit agents with index inputs (docs/theory.md §10): Neural Ensemble++ and its baselines.

NeuralEnsemblePP:  f(x, ζ) = b(h(x)) + ⟨(Θ + p·Θ⁰) ζ, sg(h(x))⟩
  h: shared feature extractor (any torch module; default an MLP), b: base linear head (trains h),
  Θ ∈ R^{H×M}: M trainable linear heads on stop-gradient features, Θ⁰: M fixed prior heads scaled by p.
  A posterior sample is one forward pass with a reference index ζ (E ζζᵀ = I) as a second input.
  Loss on buffered (x, y, z) (z a unit-norm perturbation drawn when the datum arrived), averaged over the 2M
  update indices u ∈ {±√M e_m}:  (f(x, u) − y − σ_p ⟨u, z⟩)²  + (λ/|D|)‖trainable‖².
  Cross terms cancel:  mean_u (…)² = (b(h(x)) − y)² + ‖(Θ + pΘ⁰)ᵀ sg(h(x)) − σ_p z‖²,
  so the base head fits y and head m fits the perturbations σ_p z_m (see `ensemble_pp_loss_decomposed`).

Baselines with the same interface: `EnsemblePlus` (M networks + M fixed random prior networks, each fitting
its own perturbed targets; act with one chosen uniformly), `EpiNet` (base MLP + index-conditioned epinet on
[sg φ(x), x, z] with a fixed prior epinet), `Greedy` (one network, no exploration).

Each round: `act(arms)` draws an index and returns argmax_k f(arm_k, index); `update(x, y)` stores (x, y, z) in a
FIFO buffer (capacity C) and takes G Adam steps on minibatches drawn uniformly from it (none until the buffer
holds `update_start` data).
Shapes: `batch=None` -> act(arms[K, *in]) returns a scalar tensor, update(x[*in], y[]);
`batch=1` -> act(arms[1, K, *in]) returns long[1], update(x[1, *in], y[1]) (the runner's convention).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from covrl.explore.base import BanditAgent, register_agent
from covrl.explore.distributions import PERTURBATIONS, REFERENCES, get_perturbation, get_reference


class NeuralConfig(BaseModel):
    """Hyper-parameters shared by the neural agents (defaults of docs/theory.md §10)."""

    model_config = ConfigDict(extra="forbid")

    hidden_sizes: tuple[int, ...] = Field((64, 64), description="widths of the default MLP feature extractor")
    M: int = Field(8, ge=1, le=4096, description="index dimension / number of heads or ensemble members")
    reference: str = Field("sphere", description=f"index drawn to act: {', '.join(REFERENCES)}")
    perturbation: str = Field("sphere", description=f"perturbation stored per datum: {', '.join(PERTURBATIONS)}")
    noise_scale: float = Field(0.01, ge=0.0, description="σ_p: scale of the target perturbation σ_p⟨u, z⟩")
    prior_scale: float = Field(1.0, ge=0.0, description="p: scale of the fixed prior heads / networks")
    weight_decay: float = Field(0.01, ge=0.0, description="λ: weight decay λ/|D| on the trainable parameters")
    buffer_size: int = Field(10_000, ge=1, description="C: FIFO buffer capacity")
    batch_size: int = Field(128, ge=1, description="minibatch size of each SGD step")
    sgd_steps: int = Field(1, ge=0, description="G: Adam steps per round")
    update_start: int = Field(0, ge=0, description="no Adam steps until the buffer holds this many data")
    lr: float = Field(1e-4, gt=0.0, description="Adam learning rate")
    epi_hidden_sizes: tuple[int, ...] = Field((15, 15), description="EpiNet: widths of the epinet MLPs")
    n_index_samples: int = Field(8, ge=1, description="EpiNet: index samples per datum in the loss")

    def model_post_init(self, __context: Any) -> None:
        get_reference(self.reference)
        get_perturbation(self.perturbation)
        if any(h < 1 for h in (*self.hidden_sizes, *self.epi_hidden_sizes)):
            raise ValueError(f"hidden sizes must be positive, got {self.hidden_sizes} / {self.epi_hidden_sizes}")


class MLP(nn.Module):
    """x -> relu(W_L … relu(W_1 x)); the identity when `hidden_sizes` is empty. `out_features` is the width."""

    def __init__(self, in_features: int, hidden_sizes: tuple[int, ...] = (64, 64)):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden_sizes:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.net = nn.Sequential(*layers)
        self.out_features = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class EnsembleMLP(nn.Module):
    """M independent MLPs R^in -> R evaluated together with batched matmuls: output [M, B]."""

    def __init__(self, M: int, in_features: int, hidden_sizes: tuple[int, ...]):
        super().__init__()
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        width = in_features
        for h in (*hidden_sizes, 1):
            bound = 1.0 / math.sqrt(width)  # nn.Linear's default init, per member
            self.weights.append(nn.Parameter(torch.empty(M, width, h).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(M, 1, h).uniform_(-bound, bound)))
            width = h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.unsqueeze(0)
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            out = torch.baddbmm(b, out.expand(w.shape[0], -1, -1), w)
            if i < len(self.weights) - 1:
                out = torch.relu(out)
        return out.squeeze(-1)


def _count(module: nn.Module, trainable: bool) -> int:
    """Trainable parameters, or fixed ones (frozen parameters + buffers such as prior heads)."""
    n = sum(p.numel() for p in module.parameters() if p.requires_grad == trainable)
    return n if trainable else n + sum(b.numel() for b in module.buffers())


class _NeuralAgent(BanditAgent):
    """FIFO buffer, optimiser, index sampling and the act/update loop shared by the neural agents."""

    batched = False

    def __init__(self, input_dim: int | None, seed: int, batch: int | None, config: dict[str, Any]):
        if batch not in (None, 1):
            raise ValueError(f"neural agents hold one seed: batch must be None or 1, got {batch!r}")
        self.cfg = NeuralConfig(**config)
        self.input_dim = input_dim
        self.batch = batch
        self.seed = int(seed)
        self.M = self.cfg.M
        self.gen = torch.Generator().manual_seed(self.seed)
        self._reference = get_reference(self.cfg.reference)
        self._perturbation = get_perturbation(self.cfg.perturbation)
        self.t = 0
        self._bx: torch.Tensor | None = None
        self._by = torch.zeros(self.cfg.buffer_size)
        self._bz = torch.zeros(self.cfg.buffer_size, self.M)
        self._size = 0
        self._next = 0
        self.config = {"input_dim": input_dim, "seed": seed, "batch": batch, **self.cfg.model_dump()}
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            self._build()
        self.optimizer = torch.optim.Adam(self.trainable_parameters(), lr=self.cfg.lr)

    # subclasses: build modules, predict scores for arms given an index, compute the loss of a batch
    def _build(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def modules(self) -> dict[str, nn.Module]:  # pragma: no cover - interface
        raise NotImplementedError

    def _scores(self, arms: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def loss(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules().values() for p in m.parameters() if p.requires_grad]

    def _default_extractor(self) -> nn.Module:
        if self.input_dim is None:
            raise ValueError("input_dim is required when no feature_extractor is given")
        return MLP(int(self.input_dim), tuple(self.cfg.hidden_sizes))

    # -- shapes -------------------------------------------------------------------------------------------
    @staticmethod
    def _as_input(x: torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(x)
        return x.float() if x.is_floating_point() else x

    def _strip_batch(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if self.batch is None:
            return t
        if t.dim() == 0 or t.shape[0] != 1:
            raise ValueError(f"{what} must have a leading seed dimension of size 1 (batch=1), got {tuple(t.shape)}")
        return t[0]

    # -- act / update -------------------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, arms: torch.Tensor) -> torch.Tensor:
        """argmax_k f(arm_k, index) for one freshly drawn index."""
        arms = self._strip_batch(self._as_input(arms), "arms")
        if self.input_dim is not None and (arms.dim() != 2 or arms.shape[-1] != self.input_dim):
            raise ValueError(f"arms must have shape [K, input_dim={self.input_dim}], got {tuple(arms.shape)}")
        best = self._scores(arms).argmax()
        return best.reshape(1) if self.batch == 1 else best

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Store (x, y, z ~ P_z) in the FIFO buffer, then take G Adam steps on minibatches from it (once it
        holds `update_start` data)."""
        x = self._strip_batch(self._as_input(x), "x")
        y = self._strip_batch(torch.as_tensor(y, dtype=torch.float32).reshape(-1 if self.batch else ()), "y")
        z = self._perturbation((), self.M, self.gen, torch.float32)
        if self._bx is None:
            self._bx = torch.zeros(self.cfg.buffer_size, *x.shape, dtype=x.dtype)
        self._bx[self._next] = x
        self._by[self._next] = y
        self._bz[self._next] = z
        self._next = (self._next + 1) % self.cfg.buffer_size
        self._size = min(self._size + 1, self.cfg.buffer_size)
        self.t += 1
        if self._size < self.cfg.update_start:
            return
        for _ in range(self.cfg.sgd_steps):
            self.train_step()

    def train_step(self) -> float:
        """One Adam step on a minibatch drawn uniformly (with replacement) from the buffer; returns the loss."""
        n = min(self.cfg.batch_size, self._size)
        idx = torch.randint(0, self._size, (n,), generator=self.gen)
        loss = self.loss(self._bx[idx], self._by[idx], self._bz[idx])
        decay = sum((p * p).sum() for p in self.trainable_parameters())
        total = loss + self.cfg.weight_decay / self._size * decay
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        self.optimizer.step()
        return float(loss.detach())

    # -- bookkeeping --------------------------------------------------------------------------------------
    def parameter_counts(self) -> dict[str, int]:
        """Trainable and fixed (prior) parameters."""
        mods = self.modules().values()
        return {"trainable": sum(_count(m, True) for m in mods), "fixed": sum(_count(m, False) for m in mods)}

    def num_parameters(self) -> int:
        """Trainable + fixed prior parameters (the compute a forward pass touches)."""
        counts = self.parameter_counts()
        return counts["trainable"] + counts["fixed"]

    def state_dict(self) -> dict[str, Any]:
        return {"modules": {k: m.state_dict() for k, m in self.modules().items()},
                "optimizer": self.optimizer.state_dict(), "rng": self.gen.get_state(), "t": self.t,
                "buffer": {"x": self._bx, "y": self._by.clone(), "z": self._bz.clone(), "size": self._size,
                           "next": self._next}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, m in self.modules().items():
            m.load_state_dict(state["modules"][k])
        self.optimizer.load_state_dict(state["optimizer"])
        self.gen.set_state(state["rng"])
        self.t = int(state["t"])
        buf = state["buffer"]
        self._bx = None if buf["x"] is None else buf["x"].clone()
        self._by, self._bz = buf["y"].clone(), buf["z"].clone()
        self._size, self._next = int(buf["size"]), int(buf["next"])


class EnsemblePPNet(nn.Module):
    """f(x, ζ) = b(h(x)) + ⟨(Θ + p·Θ⁰) ζ, sg(h(x))⟩ with Θ ∈ R^{H×M} trainable (init 0) and Θ⁰ fixed,
    entries N(0, 1/(M·H)) so that Var_ζ of the prior term is p²‖h‖²/H whatever M."""

    def __init__(self, extractor: nn.Module, feature_dim: int, M: int, prior_scale: float):
        super().__init__()
        self.extractor = extractor
        self.base = nn.Linear(feature_dim, 1)
        self.heads = nn.Parameter(torch.zeros(feature_dim, M))
        self.register_buffer("prior_heads", torch.randn(feature_dim, M) / math.sqrt(M * feature_dim))
        self.prior_scale = float(prior_scale)

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(base prediction [B], head outputs g = (Θ + pΘ⁰)ᵀ sg(h(x)) [B, M])."""
        h = self.extractor(x)
        base = self.base(h).squeeze(-1)
        g = h.detach() @ (self.heads + self.prior_scale * self.prior_heads)
        return base, g

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Predictions for indices: index [J, M] -> [B, J]; index [B, J, M] -> [B, J]."""
        base, g = self.parts(x)
        if index.dim() == 2:
            return base.unsqueeze(-1) + g @ index.T
        return base.unsqueeze(-1) + torch.einsum("bm,bjm->bj", g, index)


def symmetric_indices(M: int) -> torch.Tensor:
    """The 2M update indices {+√M e_m} ∪ {−√M e_m}, [2M, M]."""
    eye = math.sqrt(M) * torch.eye(M)
    return torch.cat([eye, -eye])


def ensemble_pp_loss(net: EnsemblePPNet, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                     noise_scale: float) -> torch.Tensor:
    """mean over the batch and the 2M indices u ∈ {±√M e_m} of (f(x, u) − y − σ_p⟨u, z⟩)²
    (all 2M predictions come from one forward pass: the index is an input)."""
    U = symmetric_indices(z.shape[-1]).to(z.dtype)
    pred = net(x, U)  # [B, 2M]
    target = y.unsqueeze(-1) + noise_scale * z @ U.T
    return ((pred - target) ** 2).mean()


def ensemble_pp_loss_decomposed(net: EnsemblePPNet, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor,
                                noise_scale: float) -> torch.Tensor:
    """The same loss after the cross terms cancel: mean over the batch of (b(h(x)) − y)² + ‖g − σ_p z‖²."""
    base, g = net.parts(x)
    return ((base - y) ** 2 + ((g - noise_scale * z) ** 2).sum(-1)).mean()


@register_agent
class NeuralEnsemblePP(_NeuralAgent):
    """Neural Ensemble++ (module docstring). `feature_extractor`: any module mapping an arm's input to
    features [B, H] (default: MLP(input_dim, hidden_sizes)); `feature_dim` = H (read from the module's
    `out_features` when omitted)."""

    def __init__(self, input_dim: int | None = None, *, feature_extractor: nn.Module | None = None,
                 feature_dim: int | None = None, seed: int = 0, batch: int | None = None, **config: Any):
        self._custom_extractor = feature_extractor
        self._feature_dim = feature_dim
        super().__init__(input_dim, seed, batch, config)
        self.config.update(feature_dim=feature_dim, feature_extractor=None)

    def _build(self) -> None:
        extractor = self._custom_extractor or self._default_extractor()
        H = self._feature_dim or getattr(extractor, "out_features", None)
        if H is None:
            raise ValueError("feature_dim is required: the feature extractor has no `out_features` attribute")
        self.net = EnsemblePPNet(extractor, int(H), self.M, self.cfg.prior_scale)

    def modules(self) -> dict[str, nn.Module]:
        return {"net": self.net}

    def sample_index(self) -> torch.Tensor:
        """A reference index ζ [M] (E ζζᵀ = I)."""
        return self._reference((), self.M, self.gen, torch.float32)

    def _scores(self, arms: torch.Tensor) -> torch.Tensor:
        return self.net(arms, self.sample_index().unsqueeze(0))[:, 0]

    def loss(self, x, y, z):
        return ensemble_pp_loss(self.net, x, y, z, self.cfg.noise_scale)


@register_agent
class EnsemblePlus(_NeuralAgent):
    """Ensemble+ (randomised prior functions): M networks f_m plus fixed random priors p·f⁰_m; member m fits
    y + σ_p √M z_m (so each member's target noise has variance σ_p²); act with one member chosen uniformly."""

    def __init__(self, input_dim: int, *, seed: int = 0, batch: int | None = None, **config: Any):
        super().__init__(input_dim, seed, batch, config)

    def _build(self) -> None:
        sizes = tuple(self.cfg.hidden_sizes)
        self.members = EnsembleMLP(self.M, int(self.input_dim), sizes)
        self.priors = EnsembleMLP(self.M, int(self.input_dim), sizes).requires_grad_(False)

    def modules(self) -> dict[str, nn.Module]:
        return {"members": self.members, "priors": self.priors}

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """All members' predictions [M, B]."""
        return self.members(x) + self.cfg.prior_scale * self.priors(x)

    def _scores(self, arms):
        m = int(torch.randint(0, self.M, (), generator=self.gen))
        return self.predict(arms)[m]

    def loss(self, x, y, z):
        target = y.unsqueeze(0) + self.cfg.noise_scale * math.sqrt(self.M) * z.T  # [M, B]
        return ((self.predict(x) - target) ** 2).mean()


@register_agent
class EpiNet(_NeuralAgent):
    """EpiNet: f(x, ζ) = μ(x) + ⟨σ_L([sg φ(x), x, ζ]), ζ⟩ + p·⟨σ_P([sg φ(x), x, ζ]), ζ⟩ with μ = linear∘φ
    (φ an MLP), σ_L a trainable MLP to R^M, σ_P a fixed random MLP; ζ ~ N(0, I_M). Loss: for n_index_samples
    indices per datum, (f(x, ζ) − y − σ_p ⟨ζ, c⟩)² with c = √M z (E ccᵀ = I) the stored perturbation."""

    def __init__(self, input_dim: int, *, seed: int = 0, batch: int | None = None, **config: Any):
        config.setdefault("reference", "gaussian")
        super().__init__(input_dim, seed, batch, config)

    def _build(self) -> None:
        self.features = MLP(int(self.input_dim), tuple(self.cfg.hidden_sizes))
        self.mean_head = nn.Linear(self.features.out_features, 1)
        epi_in = self.features.out_features + int(self.input_dim) + self.M
        self.epinet = nn.Sequential(MLP(epi_in, tuple(self.cfg.epi_hidden_sizes)),
                                    nn.Linear(self.cfg.epi_hidden_sizes[-1] if self.cfg.epi_hidden_sizes else epi_in,
                                              self.M))
        self.prior_epinet = nn.Sequential(MLP(epi_in, tuple(self.cfg.epi_hidden_sizes)),
                                          nn.Linear(self.cfg.epi_hidden_sizes[-1] if self.cfg.epi_hidden_sizes
                                                    else epi_in, self.M)).requires_grad_(False)

    def modules(self) -> dict[str, nn.Module]:
        return {"features": self.features, "mean_head": self.mean_head, "epinet": self.epinet,
                "prior_epinet": self.prior_epinet}

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x [B, in], index [J, M] -> [B, J]."""
        phi = self.features(x)
        mean = self.mean_head(phi)  # [B, 1]
        B, J = x.shape[0], index.shape[0]
        epi_in = torch.cat([phi.detach().unsqueeze(1).expand(B, J, -1), x.unsqueeze(1).expand(B, J, -1),
                            index.unsqueeze(0).expand(B, J, -1)], dim=-1)
        epi = self.epinet(epi_in) + self.cfg.prior_scale * self.prior_epinet(epi_in)  # [B, J, M]
        return mean + (epi * index.unsqueeze(0)).sum(-1)

    def _scores(self, arms):
        return self.forward(arms, self._reference((1,), self.M, self.gen, torch.float32))[:, 0]

    def loss(self, x, y, z):
        index = torch.randn(self.cfg.n_index_samples, self.M, generator=self.gen)
        pred = self.forward(x, index)  # [B, J]
        target = y.unsqueeze(-1) + self.cfg.noise_scale * math.sqrt(self.M) * z @ index.T
        return ((pred - target) ** 2).mean()


@register_agent
class Greedy(_NeuralAgent):
    """One network (MLP + linear head) fit by squared error; plays argmax of its prediction."""

    def __init__(self, input_dim: int, *, seed: int = 0, batch: int | None = None, **config: Any):
        super().__init__(input_dim, seed, batch, config)

    def _build(self) -> None:
        self.features = MLP(int(self.input_dim), tuple(self.cfg.hidden_sizes))
        self.head = nn.Linear(self.features.out_features, 1)

    def modules(self) -> dict[str, nn.Module]:
        return {"features": self.features, "head": self.head}

    def predict(self, x):
        return self.head(self.features(x)).squeeze(-1)

    def _scores(self, arms):
        return self.predict(arms)

    def loss(self, x, y, z):
        return ((self.predict(x) - y) ** 2).mean()
