"""The hf sampler on a tiny Llama: shapes, EOS masking, log-probs vs a full forward, filters, determinism."""

import math

import pytest
import torch

from covrl._lazy import MissingExtraError
from covrl.math.truncation import TruncationRule
from covrl.models import ModelConfig, load_model
from covrl.rollout import (
    SamplerConfig,
    build_sampler,
    decode_responses,
    filtered_logprobs,
    sample_from_logprobs,
    truncation_rule,
)
from covrl.rollout.vllm import vllm_available

torch.set_num_threads(1)

PROMPTS = [[5, 76, 12, 84], [13, 9, 84], [20, 21, 22, 23, 24, 25, 84]]


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model(ModelConfig(source="tiny", tiny={"hidden_size": 64, "num_layers": 2,
                                                             "intermediate_size": 128}), seed=3)
    # Raise the EOS logit so that some rows stop early and others run to max_new_tokens.
    with torch.no_grad():
        model.lm_head.weight[2] += 0.35 * model.lm_head.weight[2].norm() / 8
    return model, tok


def recompute_logprobs(model, batch, cfg: SamplerConfig, dtype=torch.float32):
    """log q of the drawn tokens from ONE full forward over [prompt | response] (no KV cache)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model.to(dtype)(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    P = batch.prompt_ids.shape[1]
    logits = logits[:, P - 1: -1]  # the logit that predicts each response token
    logq = filtered_logprobs(logits, cfg.temperature, truncation_rule(cfg))[0]
    return logq.gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask


def test_shapes_groups_and_eos_masking(tiny):
    model, tok = tiny
    cfg = SamplerConfig(max_new_tokens=12, max_batch=4)
    sampler = build_sampler(cfg, model, tok)
    batch = sampler.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(0))
    B = len(PROMPTS) * 3
    T = batch.response_ids.shape[1]
    assert batch.prompt_ids.shape == (B, 7) and batch.prompt_mask.shape == (B, 7)
    assert batch.response_mask.shape == (B, T) and batch.sampler_logprobs.shape == (B, T)
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert batch.policy_version.tolist() == [0] * B
    # prompts are left-padded copies of the inputs
    for i in range(B):
        p = PROMPTS[i // 3]
        assert batch.prompt_ids[i, -len(p):].tolist() == p
        assert batch.prompt_mask[i].sum() == len(p)
    lengths = batch.response_mask.sum(1).long()
    stopped = 0
    for i in range(B):
        L = int(lengths[i])
        assert batch.response_mask[i, :L].eq(1).all() and batch.response_mask[i, L:].eq(0).all()
        row = batch.response_ids[i, :L].tolist()
        # EOS, if any, is the last response token (and is masked in); nothing generated after it
        assert 2 not in row[:-1]
        if row[-1] == 2:
            stopped += 1
        else:
            assert L == cfg.max_new_tokens
        assert batch.response_ids[i, L:].eq(tok.pad_token_id).all()
        assert batch.sampler_logprobs[i, L:].eq(0).all() and batch.sampler_logprobs[i, :L].lt(0).all()
    assert 0 < stopped < B, "the fixture should give both stopped and truncated rows"
    texts = decode_responses(tok, batch)
    for i in range(B):  # the text drops padding and the EOS token
        kept = [t for t in batch.response_ids[i, : int(lengths[i])].tolist() if t > 3]
        assert texts[i] == tok.decode(kept)
    assert batch.timing.generate_s > 0 and batch.num_response_tokens == int(lengths.sum())


@pytest.mark.parametrize("opts", [{}, {"temperature": 0.7, "top_k": 20}, {"temperature": 1.3, "top_p": 0.8}])
def test_logprobs_match_full_forward_fp32(tiny, opts):
    model, tok = tiny
    cfg = SamplerConfig(max_new_tokens=10, max_batch=5, **opts)
    sampler = build_sampler(cfg, model, tok)
    batch = sampler.generate(PROMPTS, 4, generator=torch.Generator().manual_seed(1))
    ref = recompute_logprobs(model, batch, cfg)
    assert torch.allclose(batch.sampler_logprobs, ref, atol=2e-5, rtol=0)


def test_bf16_sampler_mismatch_vs_fp32(tiny):
    model, tok = tiny
    cfg = SamplerConfig(max_new_tokens=10, dtype="bfloat16")
    sampler = build_sampler(cfg, model, tok)
    assert not sampler.shares_weights and next(sampler.module.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the trainer's model is untouched
    batch = sampler.generate(PROMPTS, 4, generator=torch.Generator().manual_seed(2))
    ref = recompute_logprobs(model, batch, cfg)
    gap = (batch.sampler_logprobs - ref).abs()[batch.response_mask.bool()]
    assert gap.max() > 1e-4  # a real engine mismatch, far above fp32 round-off
    assert gap.mean() < 0.2  # but the same model


def test_filtered_logprobs_renormalised_on_the_kept_set():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    lq = filtered_logprobs(logits, 1.0, TruncationRule(top_k=2))[0]
    expected = torch.log_softmax(torch.tensor([2.0, 1.0]), -1)
    assert torch.allclose(lq[0, :2], expected) and torch.isinf(lq[0, 2:]).all()
    # top-p: probabilities of [3, 2, 1, 0] / T=1 are ~[.644, .237, .087, .032]; p=0.85 keeps the first two
    lq = filtered_logprobs(torch.tensor([[1.0, 3.0, 0.0, 2.0]]), 1.0, TruncationRule(top_p=0.85))[0]
    kept = torch.isfinite(lq[0]).nonzero().squeeze(-1).tolist()
    assert sorted(kept) == [1, 3]
    assert math.isclose(lq[0, [1, 3]].exp().sum().item(), 1.0, rel_tol=1e-6)
    # temperature divides the logits before the softmax
    lq = filtered_logprobs(torch.tensor([[1.0, 0.0]]), 0.5)[0]
    assert torch.allclose(lq, torch.log_softmax(torch.tensor([[2.0, 0.0]]), -1))


def test_inverse_cdf_sampling_frequencies_and_support():
    logq = torch.log(torch.tensor([[0.5, 0.0, 0.3, 0.2]])).expand(20000, 4)
    draws = sample_from_logprobs(logq, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[1] == 0
    assert torch.allclose(freq, torch.tensor([0.5, 0.0, 0.3, 0.2]), atol=0.015)


def test_topk_outputs_are_the_sampling_distribution(tiny):
    model, tok = tiny
    cfg = SamplerConfig(max_new_tokens=6, return_topk=5, top_k=3)
    batch = build_sampler(cfg, model, tok).generate(PROMPTS, 2, generator=torch.Generator().manual_seed(4))
    m = batch.response_mask.bool()
    lp = batch.sampler_topk_logprobs[m]
    # top_k=3 filter: three kept tokens carry all the mass; the other two slots hold the floor
    assert torch.allclose(lp[:, :3].exp().sum(-1), torch.ones(lp.shape[0]), atol=1e-5)
    assert lp[:, 3:].eq(-1.0e4).all()
    # the drawn token is among the kept ids and its log-prob matches
    ids = batch.sampler_topk_ids[m][:, :3]
    drawn = batch.response_ids[m]
    hit = ids.eq(drawn[:, None])
    assert hit.any(-1).all()
    assert torch.allclose(lp[:, :3][hit], batch.sampler_logprobs[m], atol=1e-6)
    assert batch.sampler_topk_logprobs[~m].eq(0).all()


def test_determinism_greedy_and_generator(tiny):
    model, tok = tiny
    sampler = build_sampler(SamplerConfig(max_new_tokens=8, max_batch=4), model, tok)
    a = sampler.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(7))
    b = sampler.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(7))
    c = sampler.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    g1 = sampler.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(1), greedy=True)
    g2 = sampler.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(2), greedy=True)
    assert torch.equal(g1.response_ids, g2.response_ids)
    assert torch.equal(g1.response_ids[0::2], g1.response_ids[1::2])  # both samples of a prompt agree


def test_load_weights_versions_and_staleness(tiny):
    model, tok = tiny
    trainer_model = load_model(ModelConfig(source="tiny", tiny={"hidden_size": 64, "num_layers": 2,
                                                                "intermediate_size": 128}), seed=3)[0]
    trainer_model.load_state_dict(model.state_dict())
    cfg = SamplerConfig(max_new_tokens=5, sync_every=2)
    sampler = build_sampler(cfg, trainer_model, tok)
    assert not sampler.shares_weights and sampler.version == 0
    before = sampler.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0), greedy=True)
    with torch.no_grad():  # a trainer step: the sampler's copy must not see it until load_weights
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    stale = sampler.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0), greedy=True)
    assert torch.equal(stale.response_ids, before.response_ids)
    sampler.load_weights(trainer_model, version=1)
    fresh = sampler.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0), greedy=True)
    assert sampler.version == 1 and fresh.policy_version.eq(1).all()
    assert torch.allclose(fresh.sampler_logprobs, recompute_logprobs(trainer_model, fresh, cfg), atol=2e-5)
    sampler.load_weights(trainer_model.state_dict(), version=5)
    assert sampler.generate(PROMPTS, 1, generator=torch.Generator(), policy_version=4).policy_version.eq(4).all()
    assert sampler.version == 5


def test_shared_weights_and_training_mode_restored(tiny):
    model, tok = tiny
    sampler = build_sampler(SamplerConfig(max_new_tokens=3), model, tok)
    assert sampler.shares_weights and sampler.module is model
    model.train()
    sampler.generate(PROMPTS[:1], 1, generator=torch.Generator())
    assert model.training
    model.eval()


def test_bad_inputs_and_backends(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="backend"):
        build_sampler(SamplerConfig(backend="nope"), model, tok)
    if not vllm_available():   # without the extra: refused at config validation and at build time
        with pytest.raises(ValueError, match=r"sampler.backend=vllm needs vLLM: pip install 'covrl\[vllm\]'"):
            SamplerConfig(backend="vllm")
        with pytest.raises(MissingExtraError, match=r"pip install 'covrl\[vllm\]'"):
            build_sampler(SamplerConfig.model_construct(backend="vllm"), model, tok)
    sampler = build_sampler(SamplerConfig(), model, tok)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.generate([[1, 2], []], 1, generator=torch.Generator())
    with pytest.raises(ValueError, match="max_position_embeddings=256"):  # no silent RoPE extrapolation
        build_sampler(SamplerConfig(max_new_tokens=24), model, tok).generate(
            [[5] * 233], 1, generator=torch.Generator())
    with pytest.raises(ValueError, match="share_weights"):
        build_sampler(SamplerConfig(dtype="bfloat16", share_weights="always"), model, tok)


def test_lora_model_sampler_copy_matches_forward():
    model, tok = load_model(ModelConfig(source="tiny", tiny={"hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                                             "intermediate_size": 64},
                                        lora={"rank": 2, "target_modules": ["q_proj"]}), seed=0)
    cfg = SamplerConfig(max_new_tokens=5, share_weights="never")
    sampler = build_sampler(cfg, model, tok)
    with torch.no_grad():  # a trained adapter: the copy sees it only after load_weights
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    assert not any("lora" in n for n, _ in sampler.module.named_parameters())  # merged: plain Linear layers
    sampler.load_weights(model, version=2)
    batch = sampler.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(batch.sampler_logprobs, recompute_logprobs(model, batch, cfg), atol=2e-5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n:
                p.mul_(-1.0)
    sampler.load_weights({k: v.clone() for k, v in model.state_dict().items()}, version=3)  # a state dict
    batch = sampler.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(batch.sampler_logprobs, recompute_logprobs(model, batch, cfg), atol=2e-5)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-8, 8), min_size=2, max_size=12), st.floats(0.2, 3.0), st.integers(0, 14),
       st.floats(0.05, 1.0))
def test_filter_properties(values, temperature, top_k, top_p):
    """Normalised on the kept set; top-k keeps >= min(k, V) tokens (ties), all >= the k-th logit; the nucleus
    is minimal up to ties: dropping its least likely tokens (all tied at the boundary) leaves mass < top_p,
    while the kept mass (before renormalising) reaches top_p."""
    z = torch.tensor([values], dtype=torch.float32)
    lq = filtered_logprobs(z, temperature, TruncationRule(top_k=top_k, top_p=top_p))[0]
    kept = torch.isfinite(lq[0])
    assert abs(lq[0][kept].exp().sum().item() - 1.0) < 1e-5
    after_k = filtered_logprobs(z, temperature, TruncationRule(top_k=top_k))[0]
    kept_k = torch.isfinite(after_k[0])
    if 0 < top_k < len(values):
        assert kept_k.sum() >= top_k
        scaled = z[0] / temperature if temperature != 1.0 else z[0]
        kth = torch.topk(scaled, top_k).values[-1]
        assert (scaled[kept_k] >= kth).all()
    else:
        assert kept_k.all()
    if top_p < 1.0:
        p = after_k[0].exp()  # the distribution the nucleus is cut from
        mass = p[kept].sum().item()
        assert mass >= top_p - 1e-6
        lowest = p[kept].min()   # ties at the boundary are kept together (a threshold on the logits)
        assert mass - p[kept][p[kept] <= lowest * (1 + 1e-6)].sum().item() < top_p + 1e-6


def test_string_and_token_stops_end_a_row_where_they_appear(tiny):
    """sampler.stop_strings: a row ends at the token that completes a stop string (kept) and nowhere else, or
    at EOS / the budget; stop_token_ids end it at that token like EOS."""
    model, tok = tiny
    base = build_sampler(SamplerConfig(max_new_tokens=16, share_weights="never"), model, tok).generate(
        PROMPTS, 4, generator=torch.Generator().manual_seed(1))
    texts = [tok.decode(base.response_ids[i, :int(base.response_mask[i].sum())].tolist(), skip_special_tokens=True)
             for i in range(len(base))]
    stop = max(sorted(set("".join(texts)) - {" ", "\n"}), key=lambda c: sum(c in t for t in texts))
    cut = build_sampler(SamplerConfig(max_new_tokens=16, share_weights="never", stop_strings=[stop]), model,
                        tok).generate(PROMPTS, 4, generator=torch.Generator().manual_seed(1))
    stopped = 0
    eos = set(build_sampler(SamplerConfig(), model, tok).eos_ids)
    for i in range(len(cut)):
        n = int(cut.response_mask[i].sum())
        ids = cut.response_ids[i, :n].tolist()
        if stop in tok.decode(ids, skip_special_tokens=True):
            stopped += 1
            assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)   # completed by the last token
        else:
            assert n == 16 or ids[-1] in eos
    assert stopped >= 2
    first = int(base.response_ids[0, 0])
    by_id = build_sampler(SamplerConfig(max_new_tokens=16, share_weights="never", stop_token_ids=[first]), model,
                          tok).generate(PROMPTS, 4, generator=torch.Generator().manual_seed(1))
    assert int(by_id.response_mask[0].sum()) == 1 and int(by_id.response_ids[0, 0]) == first
