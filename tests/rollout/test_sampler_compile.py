"""sampler.compile: the hf sampler's decode step behind torch.compile over a static KV cache draws the eager loop's
tokens (same generator), with log-probs within fp32 rounding, the same EOS / response masks, compile time reported
apart, and a bounded number of graphs (one per rows x cache-length bucket).

The default tests capture with the eager backend (dynamo only, eager kernels: seconds); the inductor test (real
generated kernels, a minute or more of compiling on a loaded 2-core machine) is slow."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from covrl.models import ModelConfig, load_model
from covrl.models.compiled import compile_decode_step
from covrl.rollout import SamplerConfig, build_sampler

torch.set_num_threads(1)

# lengths 4, 3, 7 and 9: one cache-length bucket of 64 with 12 new tokens
PROMPTS = [[5, 76, 12, 84], [13, 9, 84], [20, 21, 22, 23, 24, 25, 84], [30, 31, 32, 33, 34, 35, 36, 37, 84]]
LOGPROB_TOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()   # each test counts its own graphs: no cache entries carried over
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model(ModelConfig(source="tiny", tiny={"hidden_size": 64, "num_layers": 2,
                                                             "intermediate_size": 128}), seed=3)
    with torch.no_grad():   # raise the EOS logit so that some rows stop early and others run to the end
        model.lm_head.weight[2] += 0.35 * model.lm_head.weight[2].norm() / 8
    model.eval()
    return model, tok


def _pair(tiny, backend="eager", **over):
    model, tok = tiny
    base = {"max_new_tokens": 12, "max_batch": 4, **over}
    eager = build_sampler(SamplerConfig(**base), model, tok)
    compiled = build_sampler(SamplerConfig(**base, compile=True, compile_backend=backend), model, tok)
    return eager, compiled


def _same(a, b):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    torch.testing.assert_close(b.sampler_logprobs, a.sampler_logprobs, rtol=0.0, atol=LOGPROB_TOL)
    if a.sampler_topk_ids is not None:
        assert torch.equal(a.sampler_topk_ids, b.sampler_topk_ids)
        torch.testing.assert_close(b.sampler_topk_logprobs, a.sampler_topk_logprobs, rtol=0.0, atol=LOGPROB_TOL)


@pytest.mark.parametrize("opts", [{}, {"temperature": 1.5, "top_k": 40, "top_p": 0.95, "return_topk": 3}])
def test_compiled_decode_draws_the_eager_tokens(tiny, opts):
    eager, compiled = _pair(tiny, **opts)
    a = eager.generate(PROMPTS[:3], 3, generator=torch.Generator().manual_seed(0))
    b = compiled.generate(PROMPTS[:3], 3, generator=torch.Generator().manual_seed(0))
    _same(a, b)
    lengths = a.response_mask.sum(1)
    assert lengths.min() < 12 and lengths.max() == 12, "some rows end at EOS, others run to max_new_tokens"
    assert b.timing.compile_s > 0.0 and a.timing.compile_s == 0.0
    # 9 rows in chunks of 4 / 4 / 1: row buckets 4 and 1, one cache-length bucket -> two graphs
    assert compiled.decode_graphs == 2


def test_greedy_and_no_recompile_within_a_bucket(tiny):
    eager, compiled = _pair(tiny)
    _same(eager.generate(PROMPTS[:2], 2, generator=torch.Generator().manual_seed(1), greedy=True),
          compiled.generate(PROMPTS[:2], 2, generator=torch.Generator().manual_seed(1), greedy=True))
    graphs = compiled.decode_graphs
    # another prompt length (9 tokens), 3 rows padded to 4, a new generator: the same graph
    for seed, prompts, n in ((2, PROMPTS[3:], 3), (3, PROMPTS[1:3], 2)):
        a = eager.generate(prompts, n, generator=torch.Generator().manual_seed(seed))
        b = compiled.generate(prompts, n, generator=torch.Generator().manual_seed(seed))
        _same(a, b)
        assert b.timing.compile_s == 0.0
    assert compiled.decode_graphs == graphs == 1


def test_a_longer_cache_bucket_compiles_once_more(tiny):
    eager, compiled = _pair(tiny, compile_bucket=8)   # 4 + 12 -> 16 slots; 9 + 12 -> 24 slots
    for prompts in (PROMPTS[:1], PROMPTS[3:], PROMPTS[:1]):
        _same(eager.generate(prompts, 4, generator=torch.Generator().manual_seed(4)),
              compiled.generate(prompts, 4, generator=torch.Generator().manual_seed(4)))
    assert compiled.decode_graphs == 2


def test_new_weights_reuse_the_graph(tiny):
    """load_weights copies into the sampler's parameters in place: the compiled step reads them (no re-compile,
    no stale weights baked into the graph)."""
    model, tok = tiny
    eager, compiled = (build_sampler(SamplerConfig(max_new_tokens=12, max_batch=4, share_weights="never", **c),
                                     model, tok) for c in ({}, {"compile": True, "compile_backend": "eager"}))
    compiled.generate(PROMPTS[:2], 2, generator=torch.Generator().manual_seed(5))
    graphs = compiled.decode_graphs
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    for sampler in (eager, compiled):
        sampler.load_weights(state, version=1)
    a = eager.generate(PROMPTS[:2], 2, generator=torch.Generator().manual_seed(6))
    b = compiled.generate(PROMPTS[:2], 2, generator=torch.Generator().manual_seed(6))
    _same(a, b)
    assert compiled.decode_graphs == graphs and b.timing.compile_s == 0.0
    old = build_sampler(SamplerConfig(max_new_tokens=12, max_batch=4), model, tok).generate(
        PROMPTS[:2], 2, generator=torch.Generator().manual_seed(6))
    assert not torch.allclose(old.sampler_logprobs, b.sampler_logprobs), "the new weights were used"


def test_compile_options_are_checked():
    with pytest.raises(ValidationError, match="compile_backend"):
        SamplerConfig(compile=True, compile_backend="tvm")
    with pytest.raises(ValidationError, match="compile_bucket"):
        SamplerConfig(compile_bucket=0)
    with pytest.raises(ValueError, match="sampler.compile_backend='tvm'"):
        compile_decode_step("tvm")
    cfg = SamplerConfig.model_construct(**{**SamplerConfig().model_dump(), "backend": "vllm", "compile": True})
    with pytest.raises(ValueError, match="sampler.compile=true compiles the hf sampler"):
        cfg._compile_hf_only()


@pytest.mark.slow
def test_inductor_decode_draws_the_eager_tokens(tiny):
    eager, compiled = _pair(tiny, backend="inductor")
    for seed in (0, 1):
        a = eager.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(seed))
        b = compiled.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(seed))
        _same(a, b)
    assert compiled.decode_graphs == 1   # 8 rows in two chunks of 4, one cache-length bucket
