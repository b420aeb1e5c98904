"""Bandit environments, the agent loop's bookkeeping, and the registries' names."""

from __future__ import annotations

import pytest
import torch

from covrl.explore.envs import ENVS, disjoint_arms, make_env
from covrl.explore.loop import AGENTS, run_bandit
from covrl.explore.names import AGENT_NAMES, ENV_NAMES

torch.set_num_threads(1)


def test_names_mirror_registries():
    assert tuple(ENVS) == ENV_NAMES
    assert tuple(AGENTS) == AGENT_NAMES


@pytest.mark.parametrize("name,opts", [("linear", {"d": 3, "n_arms": 7}), ("sphere", {"d": 3, "n_arms": 5}),
                                       ("quadratic", {"d": 3, "n_actions": 20, "n_offered": 4}),
                                       ("neural", {"d": 3, "n_actions": 20, "n_offered": 4}),
                                       ("classification", {"dataset": "iris"})])
def test_batched_env_equals_one_seed_envs(name, opts):
    """Seed s of an S-seed environment is the one-seed environment with seed base + s."""
    S, base = 3, 11
    batched = make_env(name, S=S, seed=base, **opts)
    singles = [make_env(name, S=1, seed=base + s, **opts) for s in range(S)]
    for _ in range(4):
        arms = batched.arms()
        for s, e in enumerate(singles):
            torch.testing.assert_close(arms[s], e.arms()[0])
        index = torch.arange(S) % arms.shape[1]
        out = batched.step(index)
        for s, e in enumerate(singles):
            o = e.step(index[s: s + 1])
            torch.testing.assert_close(out.reward[s: s + 1], o.reward)
            torch.testing.assert_close(out.regret[s: s + 1], o.regret)


def test_linear_env_means_and_regret():
    env = make_env("linear", S=2, seed=0, d=4, n_arms=9, noise_std=0.0)
    arms = env.arms()
    means = torch.einsum("skd,sd->sk", arms, env.theta)
    best = means.argmax(1)
    out = env.step(best)
    torch.testing.assert_close(out.regret, torch.zeros(2, dtype=torch.float64))
    out = env.step(torch.tensor([0, 1]))
    expected = means.max(1).values - means[torch.arange(2), torch.tensor([0, 1])]
    torch.testing.assert_close(out.regret, expected)
    torch.testing.assert_close(out.reward, means[torch.arange(2), torch.tensor([0, 1])])  # noise_std = 0
    assert bool((arms.abs() <= 1 / 5 ** 0.5).all())


def test_quadratic_env_formula():
    env = make_env("quadratic", S=1, seed=0, d=5, n_actions=30, n_offered=6, noise_std=0.0)
    arms = env.arms()
    x = arms[0, 2]
    value = float(x @ env.Theta[0] @ env.Theta[0].T @ x) / 5
    out = env.step(torch.tensor([2]))
    assert float(out.reward) == pytest.approx(value)
    torch.testing.assert_close(arms.norm(dim=-1), torch.ones(1, 6, dtype=torch.float64))


def test_disjoint_encoding():
    c = torch.tensor([1.0, 2.0])
    arms = disjoint_arms(c, 3)
    assert arms.tolist() == [[1, 2, 0, 0, 0, 0], [0, 0, 1, 2, 0, 0], [0, 0, 0, 0, 1, 2]]


def test_classification_env_rewards_the_true_class():
    env = make_env("classification", S=1, seed=0, dataset="wine")
    arms = env.arms()
    assert arms.shape == (1, 3, 3 * 14)  # 13 features + bias, 3 classes
    row = int(env._rows[0])
    label = int(env.table[row].argmax())
    out = env.step(torch.tensor([label]))
    assert float(out.reward) == 1.0 and float(out.regret) == 0.0
    wrong = (label + 1) % 3
    env.arms()
    row = int(env._rows[0])
    label = int(env.table[row].argmax())
    out = env.step(torch.tensor([(label + 1) % 3]))
    assert float(out.reward) == 0.0 and float(out.regret) == 1.0
    assert wrong in range(3)


def test_lm_env_from_given_features():
    """The publish/block bandit on given features: publishing a `publish` post earns +1, a `block` post −1,
    blocking 0; the best action's regret is 0."""
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(12, 8, generator=g)
    labels = torch.tensor([0, 1] * 6)
    env = make_env("lm", S=2, seed=0, features=feats, labels=labels, feature_dim=3)
    arms = env.arms()
    assert arms.shape == (2, 2, 2 * 4)
    rows = env._rows
    best = torch.where(labels[rows] == 1, 0, 1)  # publish good posts, block spam
    out = env.step(best)
    torch.testing.assert_close(out.regret, torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(out.reward, labels[rows].to(torch.float64))


def test_shipped_text_set():
    from covrl.explore.lm import load_lm_bandit_texts

    texts, labels = load_lm_bandit_texts()
    assert 100 <= len(texts) <= 200 and len(texts) == len(labels)
    assert 0.3 < float(labels.float().mean()) < 0.7
    assert len(set(texts)) == len(texts)


def test_unknown_env_option_is_named():
    with pytest.raises(ValueError, match="n_armz"):
        make_env("linear", n_armz=3)
    with pytest.raises(ValueError, match="allowed"):
        make_env("nope")
    with pytest.raises(ValueError, match="dataset"):
        make_env("classification", dataset="mnist")


def test_neural_agent_run_records_compute():
    r = run_bandit("neural", "neural-ensemble++", steps=20, seeds=2,
                   env_options={"d": 3, "n_actions": 30, "n_offered": 5},
                   agent_options={"hidden_sizes": (8,), "M": 2})
    assert r.regret.shape == (2, 20) and bool((r.regret >= 0).all())
    assert r.num_parameters > 0 and r.seconds_per_step > 0
    assert r.step_seconds.shape == (20,)


def test_linear_agent_on_classification_learns():
    r = run_bandit("classification", "lints", steps=300, seeds=4, env_options={"dataset": "iris"})
    acc_last = 1 - float(r.regret[:, -100:].mean())
    assert acc_last > 0.8


def test_track_band_records_over_time():
    r = run_bandit("linear", "ensemble++", steps=30, seeds=3, env_options={"d": 3, "n_arms": 10},
                   agent_options={"M": 40}, track_band_every=10)
    assert r.band_steps == [0, 10, 20, 30]
    assert r.band_low.shape == (4, 3) and bool((r.band_low <= r.band_high).all())


@pytest.mark.slow
def test_lm_env_with_smollm2_features(tmp_path):
    """Computes SmolLM2 features of the shipped text set once (cached under tmp_path), then Ensemble++ learns
    to publish on-topic posts and block spam."""
    env = make_env("lm", S=2, seed=0, cache_dir=tmp_path)
    assert (tmp_path / "lm_bandit_features.pt").exists()
    r = run_bandit("lm", "ensemble++", steps=300, seeds=4, env_options={"cache_dir": str(tmp_path)},
                   agent_options={"M": 16})
    assert float(r.regret[:, -100:].mean()) < 0.3
    assert env.d == 2 * 17
