"""covrl's OpenAI-compatible endpoint (covrl.rollout.openai_api) through the real `openai` client: chat and
completions sample from covrl's sampler and answer its exact log q; the recorded prompt ids are the chat
template's; episodes are named by the API key (or a header); max_tokens / stop cut the draw; tools reach the
template and tool calls come back in OpenAI's form; unknown fields are a 400 naming them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scripted import TEMPLATE, ScriptedSampler, encode, tiny_model  # noqa: E402

from covrl.rollout import SamplerConfig, build_sampler  # noqa: E402
from covrl.rollout.openai_api import EPISODE_HEADER, CallLog, OpenAIServer, episode_api_key  # noqa: E402

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4="}]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture
def hf_server(tiny):
    model, tok = tiny
    sampler = build_sampler(SamplerConfig(max_new_tokens=6, temperature=1.0), model, tok)
    warnings: list[str] = []
    server = OpenAIServer(sampler, tok, chat_template=TEMPLATE, generator=torch.Generator().manual_seed(11),
                          warn=warnings.append)
    server.warnings = warnings
    yield server
    server.close()


def _client(server, episode="e1", **kw):
    return openai.OpenAI(base_url=server.base_url, api_key=episode_api_key(episode), max_retries=0, **kw)


def _direct(sampler, prompt, seed=11):
    """The same draw straight from the sampler: the endpoint's generator is seeded alike."""
    out = sampler.generate([prompt], 1, generator=torch.Generator().manual_seed(seed))
    length = int(out.response_mask[0].sum())
    return out.response_ids[0, :length].tolist(), out.sampler_logprobs[0, :length].tolist()


def test_chat_samples_the_samplers_tokens_and_records_the_templates_prompt(hf_server, tiny):
    _, tok = tiny
    r = _client(hf_server).chat.completions.create(model="anything", messages=MESSAGES, logprobs=True,
                                                   extra_body={"return_token_ids": True})
    prompt = encode(tok, tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True,
                                                 tokenize=False))
    assert tok.decode(prompt) == "S:Be brief.\nU:3+4=\nA:"
    ids, lps = _direct(hf_server.sampler, prompt)
    choice = r.choices[0]
    assert r.model_extra["prompt_token_ids"] == prompt
    assert choice.model_extra["token_ids"] == ids
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(lps, abs=1e-6)
    assert choice.finish_reason == ("stop" if ids[-1] == tok.eos_token_id else "length")
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
    (call,) = hf_server.calls.calls("e1")
    assert call.prompt_ids == prompt and call.completion_ids == ids and call.policy_version == 0
    assert call.logprobs == pytest.approx(lps, abs=1e-6) and call.finish_reason == choice.finish_reason
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)


def test_completions_with_max_tokens_keep_the_first_draws(hf_server, tiny):
    _, tok = tiny
    r = _client(hf_server, "e2").completions.create(model="covrl", prompt="3+4=", max_tokens=2, logprobs=1)
    prompt = encode(tok, "3+4=")
    ids, lps = _direct(hf_server.sampler, prompt)
    (call,) = hf_server.calls.calls("e2")
    assert call.prompt_ids == prompt and call.completion_ids == ids[:2]
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(lps[:2], abs=1e-6)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text == tok.decode(ids[:2])


def test_n_choices_are_one_batch_and_models_lists_the_model(hf_server):
    before = hf_server.batches
    r = _client(hf_server, "e3").chat.completions.create(model="covrl", messages=MESSAGES, n=3)
    assert len(r.choices) == 3 and hf_server.batches == before + 1
    assert len(hf_server.calls.calls("e3")) == 3
    assert [m.id for m in _client(hf_server).models.list().data] == ["covrl"]


def test_unknown_field_is_a_400_naming_it_and_other_sampling_is_warned_once(hf_server):
    client = _client(hf_server, "e4")
    with pytest.raises(openai.BadRequestError, match="'frobnicate'"):
        client.chat.completions.create(model="covrl", messages=MESSAGES, extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="covrl", messages=MESSAGES, tool_choice="required",
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert hf_server.calls.calls("e4") == []     # refused requests record nothing
    for _ in range(2):
        client.chat.completions.create(model="covrl", messages=MESSAGES, temperature=0.3, seed=5)
    assert len(hf_server.warnings) == 2
    assert any("temperature=0.3 is not applied" in w for w in hf_server.warnings)
    assert any("seed=5" in w for w in hf_server.warnings)
    client.chat.completions.create(model="covrl", messages=MESSAGES, temperature=1.0, top_p=1.0)   # the sampler's
    assert len(hf_server.warnings) == 2


def test_episode_naming_and_strict_log(tiny):
    _, tok = tiny
    sampler = ScriptedSampler(tok, lambda prompt: "7")
    log = CallLog(strict=True)
    server = OpenAIServer(sampler, tok, calls=log, chat_template=TEMPLATE, generator=torch.Generator())
    try:
        with pytest.raises(openai.AuthenticationError, match="not open"):
            _client(server, "nope").chat.completions.create(model="covrl", messages=MESSAGES)
        with pytest.raises(openai.AuthenticationError, match="no episode named"):
            openai.OpenAI(base_url=server.base_url, api_key="sk-x", max_retries=0).chat.completions.create(
                model="covrl", messages=MESSAGES)
        log.open("a")
        log.open("b")
        _client(server, "a").chat.completions.create(model="covrl", messages=MESSAGES)
        openai.OpenAI(base_url=server.base_url, api_key="sk-x", max_retries=0,
                      default_headers={EPISODE_HEADER: "b"}).completions.create(model="covrl", prompt="x")
        a, b = log.close("a"), log.close("b")
        assert len(a) == 1 and len(b) == 1 and b[0].prompt_ids == encode(tok, "x")
        assert a[0].completion_ids == encode(tok, "7") + [tok.eos_token_id]
        assert a[0].logprobs == pytest.approx(sampler.logq(a[0].completion_ids))
    finally:
        server.close()


def test_tools_reach_the_template_and_tool_calls_come_back(tiny):
    _, tok = tiny
    reply = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    sampler = ScriptedSampler(tok, lambda prompt: reply if prompt.endswith("4=\nA:") else "7")
    server = OpenAIServer(sampler, tok, chat_template=TEMPLATE, generator=torch.Generator())
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    try:
        client = _client(server, "t")
        r = client.chat.completions.create(model="covrl", messages=MESSAGES, tools=tools)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (tc,) = choice.message.tool_calls
        assert tc.function.name == "add" and tc.function.arguments == '{"a": 3, "b": 4}'
        # the agent sends the call back with the tool's result: the template renders them, and the prompt
        # extends the first call's prompt + sampled ids (the call re-renders as sampled)
        history = MESSAGES + [choice.message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": tc.id, "content": "7"}]
        r2 = client.chat.completions.create(model="covrl", messages=history, tools=tools)
        assert r2.choices[0].message.content == "7" and r2.choices[0].finish_reason == "stop"
        first, second = server.calls.calls("t")
        assert tok.decode(first.prompt_ids).startswith("tools: add\n")
        head = first.prompt_ids + first.completion_ids
        assert second.prompt_ids[:len(head)] == head
        assert tok.decode(second.prompt_ids[len(head):]) == "T:7\nA:"
    finally:
        server.close()


def test_stop_strings_cut_after_the_completing_token_and_streaming(tiny):
    _, tok = tiny
    sampler = ScriptedSampler(tok, lambda prompt: "hello world")
    server = OpenAIServer(sampler, tok, chat_template=TEMPLATE, generator=torch.Generator())
    try:
        client = _client(server, "s")
        r = client.chat.completions.create(model="covrl", messages=MESSAGES, stop=[" wor", "zzz"])
        assert r.choices[0].message.content == "hello" and r.choices[0].finish_reason == "stop"
        (call,) = server.calls.calls("s")
        assert call.completion_ids == encode(tok, "hello wor")      # the draws up to the completing token
        chunks = list(client.chat.completions.create(model="covrl", messages=MESSAGES, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "hello world" and chunks[-1].choices[0].finish_reason == "stop"
    finally:
        server.close()
