"""In-flight weight updates of the hf sampler (async_loop.partial_rollouts): new weights handed between two
decode steps are used for every later token, each token records the version that drew it, and log q of each
token is exactly that version's (checked against a full forward of each version's weights)."""

import copy

import pytest
import torch
from tests.rollout.test_sampler import PROMPTS, recompute_logprobs

from covrl.models import ModelConfig, load_model
from covrl.rollout import SamplerConfig, build_sampler

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def two_versions():
    model, tok = load_model(ModelConfig(source="tiny", tiny={"hidden_size": 64, "num_layers": 2,
                                                             "intermediate_size": 128}), seed=3)
    with torch.no_grad():   # some rows stop early, others run to the budget
        model.lm_head.weight[2] += 0.3 * model.lm_head.weight[2].norm() / 8
    newer = copy.deepcopy(model)
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return model, newer, tok


def _push_at(step: int, weights, version: int):
    """A refresh that hands `weights` after decode step `step` (its token drawn), once."""
    calls = {"n": 0}

    def refresh():
        calls["n"] += 1
        return (weights, version) if calls["n"] == step + 1 else None
    return refresh


@pytest.mark.parametrize("sampling", [{}, {"top_k": 5, "temperature": 0.8}])
def test_a_push_mid_generation_changes_only_the_tokens_after_it(two_versions, sampling):
    old, new, tok = two_versions
    cfg = SamplerConfig(max_new_tokens=14, max_batch=64, share_weights="never", **sampling)
    k = 4
    plain = build_sampler(cfg, old, tok)
    base = plain.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(0))
    partial = build_sampler(cfg, old, tok)
    pushed = partial.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(0),
                              refresh=_push_at(k, new.state_dict(), 1))
    assert partial.version == 1
    mask = pushed.response_mask > 0
    versions = pushed.token_versions
    assert versions is not None and versions.shape == pushed.response_ids.shape
    position = torch.arange(versions.shape[1])[None, :].expand_as(versions)
    assert (versions[mask & (position <= k)] == 0).all() and (versions[mask & (position > k)] == 1).all()
    # tokens up to the push are the plain run's, bit for bit; a row that ended by then is the plain run's whole
    lengths = base.response_mask.sum(1).long()
    assert torch.equal(pushed.response_ids[:, : k + 1], base.response_ids[:, : k + 1])
    assert torch.equal(pushed.sampler_logprobs[:, : k + 1], base.sampler_logprobs[:, : k + 1])
    ended = lengths <= k + 1
    assert ended.any() and (~ended).any()
    assert torch.equal(pushed.response_ids[ended], base.response_ids[ended][:, : pushed.response_ids.shape[1]])
    # every token's log q is exactly its version's: a full forward of each version's weights
    before, after = recompute_logprobs(old, pushed, cfg), recompute_logprobs(new, pushed, cfg)
    expected = torch.where(versions == 1, after, before)
    assert torch.allclose(pushed.sampler_logprobs[mask], expected[mask], atol=2e-5)
    # and the tokens after the push differ from the plain run's somewhere (the weights changed)
    late = ~ended
    assert not torch.equal(pushed.response_ids[late], base.response_ids[late][:, : pushed.response_ids.shape[1]])


def test_a_refresh_that_hands_nothing_changes_nothing(two_versions):
    old, _, tok = two_versions
    cfg = SamplerConfig(max_new_tokens=10)
    base = build_sampler(cfg, old, tok).generate(PROMPTS, 2, generator=torch.Generator().manual_seed(5))
    same = build_sampler(cfg, old, tok).generate(PROMPTS, 2, generator=torch.Generator().manual_seed(5),
                                                 refresh=lambda: None)
    assert torch.equal(same.response_ids, base.response_ids)
    assert torch.equal(same.sampler_logprobs, base.sampler_logprobs)
    assert (same.token_versions == 0).all() and base.token_versions is None


def test_the_compiled_loop_refuses_in_flight_updates(two_versions):
    old, _, tok = two_versions
    sampler = build_sampler(SamplerConfig(max_new_tokens=4, compile=True, compile_backend="eager"), old, tok)
    with pytest.raises(ValueError, match="sampler.compile=false"):
        sampler.generate(PROMPTS, 1, generator=torch.Generator().manual_seed(0), refresh=lambda: None)
