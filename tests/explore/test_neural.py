"""Neural Ensemble++ and baselines: the symmetrised loss's cross terms cancel, the index is an input (one
forward pass for many samples), FIFO buffer, any module as feature extractor, save/load."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from covrl.explore import EnsemblePlus, EpiNet, Greedy, NeuralEnsemblePP, load_agent, save_agent
from covrl.explore.lm import LMFeatures
from covrl.explore.neural import (
    EnsemblePPNet,
    NeuralConfig,
    ensemble_pp_loss,
    ensemble_pp_loss_decomposed,
    symmetric_indices,
)

torch.set_num_threads(1)


def _net(M=5, d=4, H=6, prior_scale=0.7, seed=0):
    torch.manual_seed(seed)
    extractor = torch.nn.Sequential(torch.nn.Linear(d, H), torch.nn.Tanh())
    net = EnsemblePPNet(extractor, H, M, prior_scale)
    with torch.no_grad():
        net.heads.normal_()  # non-zero heads so the cross terms are non-trivial
    return net


def _batch(B=7, d=4, M=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, d, generator=g)
    y = torch.randn(B, generator=g)
    z = torch.randn(B, M, generator=g)
    return x, y, z / z.norm(dim=-1, keepdim=True)


def test_symmetric_loss_equals_decomposed_loss():
    net = _net()
    x, y, z = _batch()
    torch.testing.assert_close(ensemble_pp_loss(net, x, y, z, 0.3), ensemble_pp_loss_decomposed(net, x, y, z, 0.3))


def test_cross_terms_cancel_in_the_gradient():
    """Base head and extractor get exactly the gradient of mean (b(h(x)) − y)²; the heads get exactly the gradient
    of mean ‖g − σ_p z‖² (they never see y)."""
    net = _net()
    x, y, z = _batch()
    params = dict(net.named_parameters())
    full = torch.autograd.grad(ensemble_pp_loss(net, x, y, z, 0.3), list(params.values()))
    base, g = net.parts(x)
    base_only = torch.autograd.grad(((base - y) ** 2).mean(), list(params.values()), allow_unused=True)
    heads_only = torch.autograd.grad(((g - 0.3 * z) ** 2).sum(-1).mean(), list(params.values()), allow_unused=True)
    for (name, _), gf, gb, gh in zip(params.items(), full, base_only, heads_only):
        expected = (gb if gb is not None else 0) + (gh if gh is not None else 0)
        torch.testing.assert_close(gf, expected, msg=name)
        if name == "heads":
            assert gb is None  # stop-gradient: y never reaches the heads through the base term
        else:
            assert gh is None  # the head term does not reach the base or the features


def test_symmetric_indices():
    U = symmetric_indices(3)
    assert U.shape == (6, 3)
    torch.testing.assert_close(U.T @ U / 6, torch.eye(3))  # E uuᵀ = I over the 2M indices


def test_index_is_an_input_one_forward_pass_for_many_samples():
    net = _net()
    x, _, _ = _batch()
    zetas = torch.randn(9, 5)
    together = net(x, zetas)
    one_by_one = torch.stack([net(x, zeta.unsqueeze(0))[:, 0] for zeta in zetas], dim=1)
    torch.testing.assert_close(together, one_by_one)
    base, g = net.parts(x)
    torch.testing.assert_close(together, base.unsqueeze(1) + g @ zetas.T)


def test_fifo_buffer_keeps_the_latest_capacity_items():
    agent = NeuralEnsemblePP(3, buffer_size=5, sgd_steps=0, hidden_sizes=(8,), seed=0)
    for i in range(7):
        agent.update(torch.full((3,), float(i)), torch.tensor(float(i)))
    assert agent._size == 5
    assert sorted(agent._by.tolist()) == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert sorted(agent._bx[:, 0].tolist()) == [2.0, 3.0, 4.0, 5.0, 6.0]
    torch.testing.assert_close(agent._bz.norm(dim=-1), torch.ones(5))  # sphere perturbations


@pytest.mark.parametrize("cls", [NeuralEnsemblePP, EnsemblePlus, EpiNet, Greedy])
def test_agents_learn_a_linear_reward(cls):
    """Fed 150 uniformly random arms with reward ⟨x, θ⟩ (4 SGD steps per round), every agent's choice is then
    among the 3 best of 20 arms (this checks learning; exploration is measured by the regret repros)."""
    g = torch.Generator().manual_seed(0)
    arms = torch.randn(20, 3, generator=g)
    theta = torch.tensor([1.0, -1.0, 0.5])
    agent = cls(3, hidden_sizes=(16,), lr=1e-2, sgd_steps=4, batch_size=32, M=4, noise_scale=0.05, seed=0)
    for k in torch.randint(0, 20, (150,), generator=g).tolist():
        agent.update(arms[k], arms[k] @ theta)
    top3 = (arms @ theta).argsort(descending=True)[:3].tolist()
    picks = [int(agent.act(arms)) for _ in range(5)]
    assert all(k in top3 for k in picks), (picks, top3)
    counts = agent.parameter_counts()
    assert counts["trainable"] > 0 and agent.num_parameters() == counts["trainable"] + counts["fixed"]


def test_parameter_counts_ensemble_pp_vs_ensemble_plus():
    epp = NeuralEnsemblePP(10, M=8, hidden_sizes=(64, 64))
    eplus = EnsemblePlus(10, M=8, hidden_sizes=(64, 64))
    body = (10 * 64 + 64) + (64 * 64 + 64)
    assert epp.parameter_counts() == {"trainable": body + 65 + 64 * 8, "fixed": 64 * 8}
    assert eplus.parameter_counts() == {"trainable": 8 * (body + 65), "fixed": 8 * (body + 65)}


def test_language_model_as_feature_extractor():
    from covrl.models import char_tokenizer, tiny_llama

    tok = char_tokenizer()
    lm = tiny_llama(len(tok), hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    extractor = LMFeatures(lm, pad_token_id=tok.pad_token_id)
    agent = NeuralEnsemblePP(feature_extractor=extractor, M=4, sgd_steps=1, batch_size=4, seed=0)
    ids = tok(["good post", "spam!!", "hello"], padding=True, return_tensors="pt")["input_ids"]
    k = int(agent.act(ids))
    assert 0 <= k < 3
    agent.update(ids[k], torch.tensor(1.0))
    counts = agent.parameter_counts()
    assert counts["trainable"] == 33 + 32 * 4  # base head + heads; the frozen LM counts as fixed
    assert all(not p.requires_grad for p in lm.parameters())


@pytest.mark.parametrize("cls", [NeuralEnsemblePP, EnsemblePlus, EpiNet, Greedy])
def test_save_load_continues_identically(cls, tmp_path):
    arms = torch.randn(10, 3, generator=torch.Generator().manual_seed(1))

    def play(agent, n):
        picks = []
        for _ in range(n):
            k = int(agent.act(arms))
            agent.update(arms[k], arms[k].sum())
            picks.append(k)
        return picks

    kw = {"hidden_sizes": (8,), "M": 3, "batch_size": 8, "lr": 1e-2, "seed": 5}
    full = play(cls(3, **kw), 16)
    first = cls(3, **kw)
    head = play(first, 8)
    loaded = load_agent(save_agent(first, tmp_path / "a.pt"))
    assert head + play(loaded, 8) == full


def test_config_rejects_bad_values():
    with pytest.raises(ValidationError, match="bogus"):
        NeuralConfig(bogus=1)
    with pytest.raises(ValidationError, match="M"):
        NeuralConfig(M=0)
    with pytest.raises(ValueError, match="reference"):
        NeuralEnsemblePP(3, reference="nope")
    with pytest.raises(ValueError, match="batch"):
        Greedy(3, batch=4)
    with pytest.raises(ValueError, match="arms"):
        Greedy(3).act(torch.zeros(5, 4))
