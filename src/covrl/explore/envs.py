"""Bandit environments (docs/theory.md §10), batched over S seeds.

Seed s of an environment built with `seed=base` uses its own generator seeded `base + s`, so an environment
with S seeds is exactly S one-seed environments side by side (a batched linear agent and a one-seed neural
agent see the same instances). Each round: `arms()` gives the offered actions [S, K, d]; `step(index[S])`
returns the chosen features, the noisy reward, and the regret  max_k f(arm_k) − f(arm_chosen)  of that round.

Registry `ENVS`: name -> factory(S, seed, **options) -> BanditEnv."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from covrl.explore.lm import load_lm_bandit_features, pca_reduce


@dataclass
class StepOutcome:
    """One round for S seeds: chosen features x [S, d], observed reward [S], its mean [S], best mean [S],
    regret = best − mean [S]."""

    x: torch.Tensor
    reward: torch.Tensor
    expected: torch.Tensor
    best: torch.Tensor
    regret: torch.Tensor


def _check_int(name: str, value, low: int = 1) -> int:
    if not (isinstance(value, int) and value >= low):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _check_pos(name: str, value, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")
    return float(value)


def _unit_rows(n: int, d: int, gen: torch.Generator, dtype) -> torch.Tensor:
    g = torch.randn(n, d, generator=gen, dtype=dtype)
    return g / g.norm(dim=-1, keepdim=True)


class BanditEnv:
    """Base: subclasses set `d`, `noise_std`, `prior_var` (the prior a Bayesian agent should assume) and
    implement `_offer(s) -> arms [K, d]` and `_means(arms[S, K, d]) -> [S, K]`."""

    name = "env"
    fixed_arms = False  # True when the offered set never changes (arms computed once)

    def __init__(self, S: int, seed: int, noise_std: float, dtype=torch.float64):
        self.S = _check_int("S", S)
        self.seed = int(seed)
        self.noise_std = _check_pos("noise_std", noise_std, allow_zero=True)
        self.dtype = dtype
        self.gens = [torch.Generator().manual_seed(self.seed + s) for s in range(self.S)]
        # the observation noise a Bayesian agent should assume (deterministic rewards still need some)
        self.agent_noise_std = self.noise_std if self.noise_std > 0 else 0.5
        self._current: torch.Tensor | None = None
        self._current_means: torch.Tensor | None = None
        self.t = 0

    prior_var: float = 1.0
    d: int = 0

    def _offer(self, s: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def _means(self, arms: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    NOISE_CHUNK = 1024

    def _noise(self) -> torch.Tensor:
        """Standard normal noise [S], one per seed; drawn in chunks of NOISE_CHUNK rounds per seed (fewer
        generator calls; the sequence of draws of a seed does not depend on S or on the agent)."""
        k = self.t % self.NOISE_CHUNK
        if k == 0:
            self._noise_block = torch.stack([torch.randn(self.NOISE_CHUNK, generator=g, dtype=self.dtype)
                                             for g in self.gens])
        return self._noise_block[:, k]

    def arms(self) -> torch.Tensor:
        """Actions offered this round, [S, K, d] (the same object until `step` is called)."""
        if self._current is None:
            self._current = torch.stack([self._offer(s) for s in range(self.S)])
            self._current_means = self._means(self._current)
        return self._current

    def step(self, index: torch.Tensor) -> StepOutcome:
        """Play arm `index[s]` in seed s; reward = mean + noise_std · N(0, 1)."""
        arms = self.arms()
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        if index.shape[0] != self.S:
            raise ValueError(f"index must have {self.S} entries (one per seed), got {index.shape[0]}")
        K = arms.shape[1]
        if bool(((index < 0) | (index >= K)).any()):
            raise ValueError(f"index out of range [0, {K}): {index.tolist()}")
        rows = torch.arange(self.S)
        means = self._current_means
        expected = means[rows, index]
        best = means.max(dim=1).values
        noise = self._noise()
        out = StepOutcome(arms[rows, index], expected + self.noise_std * noise, expected, best, best - expected)
        if not self.fixed_arms:
            self._current = None
        self.t += 1
        return out


class FiniteArmLinear(BanditEnv):
    """Russo-style finite-arm linear bandit: θ ~ N(0, prior_var·I_d); n_arms fixed arms with coordinates
    U[−arm_scale, arm_scale] (default 1/√5); reward ⟨x, θ⟩ + N(0, noise_std²)."""

    name = "linear"
    fixed_arms = True

    def __init__(self, S: int = 1, seed: int = 0, *, d: int = 10, n_arms: int = 1000, prior_var: float = 10.0,
                 noise_std: float = 1.0, arm_scale: float = 1 / math.sqrt(5)):
        super().__init__(S, seed, noise_std)
        self.d = _check_int("d", d)
        self.n_arms = _check_int("n_arms", n_arms)
        self.prior_var = _check_pos("prior_var", prior_var)
        arm_scale = _check_pos("arm_scale", arm_scale)
        self.theta = torch.stack([math.sqrt(self.prior_var) * torch.randn(d, generator=g, dtype=self.dtype)
                                  for g in self.gens])
        self._fixed = torch.stack([arm_scale * (2 * torch.rand(n_arms, d, generator=g, dtype=self.dtype) - 1)
                                   for g in self.gens])

    def _offer(self, s: int) -> torch.Tensor:
        return self._fixed[s]

    def _means(self, arms: torch.Tensor) -> torch.Tensor:
        return torch.einsum("skd,sd->sk", arms, self.theta)


class SphereLinear(BanditEnv):
    """Linear bandit with actions on the unit sphere: each round n_arms fresh directions U(S^{d−1}) are offered
    (a finite stand-in for the whole sphere, whose best action is θ/‖θ‖); θ ~ N(0, prior_var·I)."""

    name = "sphere"

    def __init__(self, S: int = 1, seed: int = 0, *, d: int = 10, n_arms: int = 100, prior_var: float = 1.0,
                 noise_std: float = 1.0):
        super().__init__(S, seed, noise_std)
        self.d = _check_int("d", d)
        self.n_arms = _check_int("n_arms", n_arms)
        self.prior_var = _check_pos("prior_var", prior_var)
        self.theta = torch.stack([math.sqrt(self.prior_var) * torch.randn(d, generator=g, dtype=self.dtype)
                                  for g in self.gens])

    def _offer(self, s: int) -> torch.Tensor:
        return _unit_rows(self.n_arms, self.d, self.gens[s], self.dtype)

    def _means(self, arms: torch.Tensor) -> torch.Tensor:
        return torch.einsum("skd,sd->sk", arms, self.theta)


class _PoolEnv(BanditEnv):
    """A fixed pool of n_actions unit vectors; each round n_offered of them (without replacement) are offered."""

    def _init_pool(self, d: int, n_actions: int, n_offered: int) -> None:
        self.d = _check_int("d", d)
        self.n_actions = _check_int("n_actions", n_actions)
        self.n_offered = _check_int("n_offered", n_offered)
        if n_offered > n_actions:
            raise ValueError(f"n_offered ({n_offered}) must be <= n_actions ({n_actions})")
        self.pool = torch.stack([_unit_rows(n_actions, d, g, self.dtype) for g in self.gens])

    def _offer(self, s: int) -> torch.Tensor:
        pick = torch.randperm(self.n_actions, generator=self.gens[s])[: self.n_offered]
        return self.pool[s, pick]


class Quadratic(_PoolEnv):
    """Quadratic bandit f(x) = scale · xᵀΘΘᵀx, Θ ∈ R^{d×d} with N(0, 1) entries, x in a pool of unit vectors
    (scale = 1/d by default, which is the 10⁻² of the d = 100 setting; f(x) ≈ 1 on average)."""

    name = "quadratic"

    def __init__(self, S: int = 1, seed: int = 0, *, d: int = 20, n_actions: int = 1000, n_offered: int = 50,
                 noise_std: float = 0.1, scale: float | None = None):
        super().__init__(S, seed, noise_std)
        self._init_pool(d, n_actions, n_offered)
        self.scale = 1.0 / d if scale is None else _check_pos("scale", scale)
        self.Theta = torch.stack([torch.randn(d, d, generator=g, dtype=self.dtype) for g in self.gens])

    def _means(self, arms: torch.Tensor) -> torch.Tensor:
        proj = torch.einsum("skd,sde->ske", arms, self.Theta)
        return self.scale * (proj * proj).sum(-1)


class NeuralTeacher(_PoolEnv):
    """Reward from a random 2-layer ReLU MLP teacher f(x) = w₂ᵀ relu(W₁x + b₁), W₁ ~ N(0, 1/d), b₁ ~ N(0, 0.1²),
    w₂ ~ N(0, 1/hidden), rescaled so f has unit standard deviation over the seed's action pool."""

    name = "neural"

    def __init__(self, S: int = 1, seed: int = 0, *, d: int = 10, hidden: int = 50, n_actions: int = 1000,
                 n_offered: int = 50, noise_std: float = 0.1):
        super().__init__(S, seed, noise_std)
        self._init_pool(d, n_actions, n_offered)
        hidden = _check_int("hidden", hidden)
        self.W1 = torch.stack([torch.randn(hidden, d, generator=g, dtype=self.dtype) / math.sqrt(d)
                               for g in self.gens])
        self.b1 = torch.stack([0.1 * torch.randn(hidden, generator=g, dtype=self.dtype) for g in self.gens])
        self.w2 = torch.stack([torch.randn(hidden, generator=g, dtype=self.dtype) / math.sqrt(hidden)
                               for g in self.gens])
        self.w2 = self.w2 / self._raw(self.pool).std(dim=1, keepdim=True)

    def _raw(self, arms: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.einsum("skd,shd->skh", arms, self.W1) + self.b1.unsqueeze(1))
        return torch.einsum("skh,sh->sk", h, self.w2)

    def _means(self, arms: torch.Tensor) -> torch.Tensor:
        return self._raw(arms)


def disjoint_arms(context: torch.Tensor, n_actions: int) -> torch.Tensor:
    """Disjoint encoding: arm a of context c ∈ R^p is e_a ⊗ c ∈ R^{n_actions·p}, [n_actions, n_actions·p]."""
    eye = torch.eye(n_actions, dtype=context.dtype)
    return torch.einsum("ab,p->abp", eye, context).reshape(n_actions, n_actions * context.shape[-1])


SKLEARN_DATASETS = ("iris", "wine", "breast_cancer", "digits")


def load_sklearn_dataset(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardised features [n, p] (float64) and integer labels [n] of a dataset bundled with scikit-learn."""
    if name not in SKLEARN_DATASETS:
        raise ValueError(f"dataset={name!r} is not known; allowed: {', '.join(SKLEARN_DATASETS)}")
    from covrl._lazy import require

    datasets = require("sklearn.datasets", "explore")
    data = getattr(datasets, f"load_{name}")()
    X = torch.as_tensor(data.data, dtype=torch.float64)
    X = (X - X.mean(0)) / X.std(0).clamp_min(1e-8)
    return X, torch.as_tensor(data.target, dtype=torch.long)


class ContextualTable(BanditEnv):
    """A contextual bandit over a table of contexts [n, p] with a per-(row, action) reward table [n, A]:
    each round a row is drawn uniformly, the arms are its disjoint encodings, and playing a earns table[row, a]
    (+ optional noise). `append_bias` adds a constant 1 to every context."""

    fixed_arms = False

    def _init_table(self, contexts: torch.Tensor, rewards: torch.Tensor, append_bias: bool) -> None:
        if append_bias:
            contexts = torch.cat([contexts, torch.ones(contexts.shape[0], 1, dtype=contexts.dtype)], dim=1)
        self.contexts = contexts.to(self.dtype)
        self.table = rewards.to(self.dtype)
        self.n_actions = rewards.shape[1]
        self.d = self.n_actions * contexts.shape[1]
        self._rows = torch.zeros(self.S, dtype=torch.long)

    def arms(self) -> torch.Tensor:
        if self._current is None:
            rows = torch.stack([torch.randint(0, self.contexts.shape[0], (), generator=g) for g in self.gens])
            self._rows = rows
            self._current = torch.stack([disjoint_arms(self.contexts[r], self.n_actions) for r in rows.tolist()])
            self._current_means = self.table[rows]
        return self._current


class Classification(ContextualTable):
    """Classification as a bandit: a random sample of a scikit-learn dataset is the context, the N classes are
    the actions (disjoint encoding, dimension N·(p+1) with a bias), reward 1 for the right class else 0;
    regret per round = 1 − accuracy."""

    name = "classification"

    def __init__(self, S: int = 1, seed: int = 0, *, dataset: str = "wine", noise_std: float = 0.0,
                 prior_var: float = 1.0):
        super().__init__(S, seed, noise_std)
        X, y = load_sklearn_dataset(dataset)
        n_classes = int(y.max()) + 1
        self.prior_var = _check_pos("prior_var", prior_var)
        self._init_table(X, torch.nn.functional.one_hot(y, n_classes).to(torch.float64), append_bias=True)
        # the reward is Bernoulli-like (variance ≤ 1/4): the noise an agent should assume
        self.agent_noise_std = max(self.noise_std, 0.5)


class LMFeatureBandit(ContextualTable):
    """Publish/block moderation on language-model features: each round a short post from the shipped text
    set is drawn; publishing a post labelled `publish` earns +1, publishing a `block` post earns −1
    (`block_penalty`), blocking earns 0. Contexts are the SmolLM2 last-layer hidden state (mean over tokens),
    reduced to `feature_dim` principal components and standardised; features are cached under `cache_dir`
    (computed once). The two actions use the disjoint encoding (dimension 2·(feature_dim+1))."""

    name = "lm"

    def __init__(self, S: int = 1, seed: int = 0, *, cache_dir: str | Path = "runs/bandit/cache",
                 feature_dim: int = 16, block_penalty: float = 1.0, noise_std: float = 0.0, prior_var: float = 1.0,
                 features: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        super().__init__(S, seed, noise_std)
        if features is None or labels is None:
            features, labels = load_lm_bandit_features(Path(cache_dir))
        feature_dim = _check_int("feature_dim", feature_dim)
        block_penalty = _check_pos("block_penalty", block_penalty)
        self.prior_var = _check_pos("prior_var", prior_var)
        X = pca_reduce(features.to(torch.float64), feature_dim)
        publish_reward = torch.where(labels == 1, 1.0, -block_penalty).to(torch.float64)
        rewards = torch.stack([publish_reward, torch.zeros_like(publish_reward)], dim=1)  # actions: publish, block
        self._init_table(X, rewards, append_bias=True)
        self.labels = labels
        self.agent_noise_std = max(self.noise_std, 0.5)


ENVS: dict[str, Callable[..., BanditEnv]] = {
    "linear": FiniteArmLinear,
    "sphere": SphereLinear,
    "quadratic": Quadratic,
    "neural": NeuralTeacher,
    "classification": Classification,
    "lm": LMFeatureBandit,
}


def make_env(name: str, S: int = 1, seed: int = 0, **options) -> BanditEnv:
    """Build the environment `name` with S seeds; unknown names or options raise a ValueError naming them."""
    if name not in ENVS:
        raise ValueError(f"env={name!r} is not known; allowed: {', '.join(ENVS)}")
    import inspect

    allowed = [p for p in inspect.signature(ENVS[name].__init__).parameters if p not in ("self", "S", "seed")]
    unknown = [k for k in options if k not in allowed]
    if unknown:
        raise ValueError(f"env {name!r} has no option {unknown[0]!r}; allowed: {', '.join(allowed)}")
    return ENVS[name](S, seed, **options)
