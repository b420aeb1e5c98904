"""Linear Ensemble++ and baselines: closed forms of the posterior and of the particles, index distributions,
covariance band, regret ordering, reproducibility, save/load."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from covrl.explore import (
    EnsembleSampling,
    LinearEnsemblePP,
    LinearTS,
    covariance_tracking,
    load_agent,
    run_bandit,
    save_agent,
)
from covrl.explore.distributions import PERTURBATIONS, REFERENCES, get_reference

torch.set_num_threads(1)


def _data(T, d, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, d, generator=g, dtype=torch.float64)
    y = torch.randn(T, generator=g, dtype=torch.float64)
    return X, y


def _ridge(X, y, prior_var, noise_var):
    """Closed-form posterior: Σ = (I/prior_var + XᵀX/σ²)⁻¹, μ = Σ Xᵀy/σ²."""
    d = X.shape[1]
    precision = torch.eye(d, dtype=torch.float64) / prior_var + X.T @ X / noise_var
    cov = torch.linalg.inv(precision)
    return cov @ X.T @ y / noise_var, cov


@pytest.mark.parametrize("cls", [LinearEnsemblePP, LinearTS, EnsembleSampling])
def test_mean_and_cov_equal_closed_form_ridge(cls):
    d, T, prior_var, noise_var = 4, 30, 2.5, 0.5
    X, y = _data(T, d, 0)
    agent = cls(d, prior_var=prior_var, noise_var=noise_var, seed=1)
    for x, yy in zip(X, y):
        agent.update(x, yy)
    mu, cov = _ridge(X, y, prior_var, noise_var)
    torch.testing.assert_close(agent.mean, mu, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(agent.cov, cov, rtol=1e-9, atol=1e-10)


@settings(max_examples=15, deadline=None)
@given(d=st.integers(1, 6), M=st.integers(1, 9), T=st.integers(0, 25), seed=st.integers(0, 10_000),
       prior_var=st.floats(0.1, 10.0), noise_var=st.floats(0.05, 4.0),
       perturbation=st.sampled_from(sorted(PERTURBATIONS)))
def test_particles_equal_closed_form_random_projection(d, M, T, seed, prior_var, noise_var, perturbation):
    """A_T = Σ_T (Σ_0⁻¹ A_0 + Σ_s x_s z_sᵀ / σ) for the recorded perturbations z_s."""
    X, y = _data(T, d, seed)
    agent = LinearEnsemblePP(d, M, prior_var=prior_var, noise_var=noise_var, perturbation=perturbation, seed=seed)
    A0 = agent.particles.clone()
    zs = [agent.update(x, yy) for x, yy in zip(X, y)]
    sigma = math.sqrt(noise_var)
    history = sum((torch.outer(x, z) for x, z in zip(X, zs)), torch.zeros(d, M, dtype=torch.float64))
    _, cov = _ridge(X, y, prior_var, noise_var)
    expected = cov @ (A0 / prior_var + history / sigma)
    torch.testing.assert_close(agent.particles, expected, rtol=1e-7, atol=1e-9)


def test_batched_agent_equals_independent_unbatched_updates():
    d, M, S, T = 3, 5, 4, 12
    batched = LinearEnsemblePP(d, M, prior_var=3.0, noise_var=0.7, seed=0, batch=S)
    singles = []
    for s in range(S):
        a = LinearEnsemblePP(d, M, prior_var=3.0, noise_var=0.7, seed=0)
        a.load_state_dict({"mu": batched._mu[s: s + 1].clone(), "cov": batched._cov[s: s + 1].clone(),
                           "A": batched._A[s: s + 1].clone(), "t": 0, "rng": a.gen.get_state()})
        singles.append(a)
    X, y = _data(T * S, d, 3)
    X, y = X.reshape(T, S, d), y.reshape(T, S)
    for t in range(T):
        zs = batched.update(X[t], y[t])
        for s in range(S):
            singles[s].update(X[t, s], y[t, s], z=zs[s])
    for s in range(S):
        torch.testing.assert_close(batched.particles[s], singles[s].particles)
        torch.testing.assert_close(batched.mean[s], singles[s].mean)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_reference_mean_zero_identity_covariance(name):
    M, n = 6, 100_000
    zeta = get_reference(name)((n,), M, torch.Generator().manual_seed(0), torch.float64)
    assert zeta.shape == (n, M)
    torch.testing.assert_close(zeta.mean(0), torch.zeros(M, dtype=torch.float64), atol=0.03, rtol=0)
    torch.testing.assert_close(zeta.T @ zeta / n, torch.eye(M, dtype=torch.float64), atol=0.04, rtol=0)


@pytest.mark.parametrize("name", ["sphere", "cube", "coordinate"])
def test_perturbations_unit_norm(name):
    z = PERTURBATIONS[name]((1000,), 7, torch.Generator().manual_seed(1), torch.float64)
    torch.testing.assert_close(z.norm(dim=-1), torch.ones(1000, dtype=torch.float64))


def test_gaussian_perturbation_unit_norm_in_mean_square():
    z = PERTURBATIONS["gaussian"]((50_000,), 7, torch.Generator().manual_seed(1), torch.float64)
    assert abs(float((z * z).sum(-1).mean()) - 1.0) < 0.01


def test_sparse_reference_is_sparse():
    zeta = REFERENCES["sparse"]((20_000,), 8, torch.Generator().manual_seed(2), torch.float64)
    assert abs(float((zeta == 0).double().mean()) - 2 / 3) < 0.01


def test_lints_samples_have_posterior_moments():
    d, S = 3, 40_000
    agent = LinearTS(d, prior_var=2.0, noise_var=0.5, seed=0, batch=S)
    X, y = _data(10, d, 4)
    for x, yy in zip(X, y):
        agent.update(x.expand(S, d), yy.expand(S))
    theta = agent.sample_theta()
    torch.testing.assert_close(theta.mean(0), agent.mean[0], atol=0.02, rtol=0)
    centred = theta - agent.mean[0]
    torch.testing.assert_close(centred.T @ centred / S, agent.cov[0], atol=0.02, rtol=0)


def test_covariance_band_is_one_for_exact_square_root_and_zero_when_rank_deficient():
    d, M = 4, 6
    agent = LinearEnsemblePP(d, M, prior_var=1.5, noise_var=1.0, seed=0)
    X, y = _data(8, d, 5)
    for x, yy in zip(X, y):
        agent.update(x, yy)
    chol = torch.linalg.cholesky(agent._cov[0])
    q, _ = torch.linalg.qr(torch.randn(M, d, dtype=torch.float64))  # M×d with orthonormal columns
    agent._A = (chol @ q.T).unsqueeze(0)  # A Aᵀ = L Qᵀ Q Lᵀ = Σ
    band = covariance_tracking(agent)
    torch.testing.assert_close(band.eigenvalues, torch.ones(1, d, dtype=torch.float64))
    small = LinearEnsemblePP(d, 2, seed=0)
    assert float(covariance_tracking(small).low[0]) == pytest.approx(0.0, abs=1e-10)


def test_band_at_start_within_gaussian_matrix_edges():
    """At t = 0, Σ^{-1/2}A_0 = Z_0 with N(0, 1/M) entries: eigenvalues inside the Marchenko–Pastur edges
    (1 ± √(d/M))² (up to fluctuations) and around 1."""
    d, M = 20, 800
    band = covariance_tracking(LinearEnsemblePP(d, M, prior_var=10.0, seed=0, batch=10))
    lo, hi = (1 - math.sqrt(d / M)) ** 2, (1 + math.sqrt(d / M)) ** 2
    assert lo - 0.03 <= float(band.low.min()) < 1.0 < float(band.high.max()) <= hi + 0.03
    assert float(band.high.median()) > 1 + 0.5 * (hi - 1)  # the top edge is reached, not just bounded


def test_regret_ordering_small_instance():
    """d = 5, 200 arms, 300 rounds, 40 seeds: exploring agents beat greedy; Ensemble++ at M = 16 is close to
    LinTS; the gaussian reference beats the coordinate one at M = 2."""
    env = {"d": 5, "n_arms": 200}
    r = {name: run_bandit("linear", agent, steps=300, seeds=40, env_options=env, agent_options=opts)
         .metrics["final_regret_mean"]
         for name, agent, opts in [("ts", "lints", {}), ("greedy", "linear-greedy", {}),
                                   ("epp16", "ensemble++", {"M": 16}),
                                   ("epp2g", "ensemble++", {"M": 2, "reference": "gaussian"}),
                                   ("epp2c", "ensemble++", {"M": 2, "reference": "coordinate"})]}
    assert r["ts"] < r["greedy"] and r["epp16"] < r["greedy"]
    assert r["epp16"] <= 1.25 * r["ts"]
    assert r["epp2g"] < r["epp2c"]


def test_seeds_reproducible_and_distinct():
    a = run_bandit("linear", "ensemble++", steps=50, seeds=3, seed=7, env_options={"d": 4, "n_arms": 30})
    b = run_bandit("linear", "ensemble++", steps=50, seeds=3, seed=7, env_options={"d": 4, "n_arms": 30})
    c = run_bandit("linear", "ensemble++", steps=50, seeds=3, seed=8, env_options={"d": 4, "n_arms": 30})
    assert torch.equal(a.regret, b.regret)
    assert not torch.equal(a.regret, c.regret)


@pytest.mark.parametrize("cls", [LinearEnsemblePP, LinearTS, EnsembleSampling])
def test_save_load_continues_identically(cls, tmp_path):
    d, K = 3, 20
    arms = torch.randn(K, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    theta = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)

    def play(agent, n):
        picks = []
        for _ in range(n):
            k = int(agent.act(arms))
            agent.update(arms[k], arms[k] @ theta)
            picks.append(k)
        return picks

    ref = cls(d, prior_var=2.0, noise_var=1.0, seed=3)
    full = play(ref, 40)
    first = cls(d, prior_var=2.0, noise_var=1.0, seed=3)
    head = play(first, 20)
    path = save_agent(first, tmp_path / "agent.pt")
    loaded = load_agent(path)
    assert type(loaded) is cls
    assert head + play(loaded, 20) == full


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="reference"):
        LinearEnsemblePP(3, 4, reference="uniform")
    with pytest.raises(ValueError, match="perturbation"):
        LinearEnsemblePP(3, 4, perturbation="uniform")
    with pytest.raises(ValueError, match="prior_var"):
        LinearTS(3, prior_var=-1.0)
    agent = LinearEnsemblePP(3, 4, batch=2)
    with pytest.raises(ValueError, match="arms"):
        agent.act(torch.zeros(2, 5, 4))
    with pytest.raises(ValueError, match="x must"):
        agent.update(torch.zeros(3), torch.zeros(2))
