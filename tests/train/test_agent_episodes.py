"""task.agent: an agent program's episodes through covrl's OpenAI-compatible endpoint become training rows from
the recorded token ids (no re-tokenising). Checked by hand-built ids: a call that extends the previous call's
prompt + completion merges into one row whose loss mask covers exactly the sampled tokens; a call after the
history was rewritten starts a second row with the episode's reward; an agent that raises, hangs, returns a
non-number or makes no call is shown, counted by the user-code rule and trains nothing; a tiny sync run trains
with a toy agent end to end."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from scripted import TEMPLATE, ScriptedSampler, encode, tiny_model  # noqa: E402
from train_helpers import tiny_cfg  # noqa: E402

from covrl.rollout.agents import AgentRunner, agent_batch, episode_rows  # noqa: E402
from covrl.rollout.openai_api import AgentCall, CallLog, OpenAIServer  # noqa: E402
from covrl.tasks import Example, FailureWatch, UserCodeError  # noqa: E402
from covrl.train.run.agent_source import AgentSource, count_failures, score_agent_episodes  # noqa: E402
from covrl.train.run.driver import train_sync  # noqa: E402
from covrl.train.run.folder import prepare_run  # noqa: E402
from covrl.train.run.sinks import read_jsonl  # noqa: E402
from covrl.train.step.trainer import Trainer, forward_batch  # noqa: E402

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return tiny_model()[1]


def _script(prompt: str) -> str:
    if prompt.endswith("T:R\nA:"):
        return "done"
    return "x1"


@pytest.fixture
def endpoint(tok):
    sampler = ScriptedSampler(tok, _script)
    server = OpenAIServer(sampler, tok, calls=CallLog(strict=True), chat_template=TEMPLATE,
                          generator=torch.Generator())
    yield server
    server.close()


def _chat(client, messages):
    return client.chat.completions.create(model="covrl", messages=messages)


async def two_calls(base_url, api_key, example):
    """Asks, gets a tool result back, asks again: the second prompt extends the first prompt + completion."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": example.prompt}]
    first = await _chat(client, messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "tool", "content": "R"}]
    second = await _chat(client, messages)
    return 1.0 if second.choices[0].message.content == "done" else 0.5


async def rewriting(base_url, api_key, example):
    """The second call sends the first answer rewritten (as templates that drop earlier <think> blocks do)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": example.prompt}]
    await _chat(client, messages)
    messages += [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "R"}]
    await _chat(client, messages)
    return 0.25


def _hand_row(tok, sampler, question: str):
    """The merged row of `two_calls`, built by hand from the texts: (prompt, tokens, loss mask, log q)."""
    eos = tok.eos_token_id
    prompt = encode(tok, f"U:{question}\nA:")
    first, gap, second = encode(tok, "x1") + [eos], encode(tok, "T:R\nA:"), encode(tok, "done") + [eos]
    tokens = first + gap + second
    mask = [1] * len(first) + [0] * len(gap) + [1] * len(second)
    logq = sampler.logq(first) + [0.0] * len(gap) + sampler.logq(second)
    return prompt, tokens, mask, logq


def test_a_call_that_extends_the_last_one_merges_into_one_row(endpoint, tok):
    sampler = endpoint.sampler
    runner = AgentRunner(endpoint, two_calls, concurrency=4, timeout_s=30)
    examples = [Example(prompt="3+4=", answer="7"), Example(prompt="12+1=", answer="13")]
    try:
        episodes = runner.run(examples, 2)
    finally:
        runner.close()
    assert [ep.error for ep in episodes] == [None] * 4 and [ep.example for ep in episodes] == [0, 0, 1, 1]
    assert all(len(ep.calls) == 2 and ep.reward == 1.0 for ep in episodes)
    batch, owner = agent_batch(episodes, sampler, tok, policy_version=3)
    assert owner == [0, 1, 2, 3] and batch.group_ids.tolist() == [0, 0, 1, 1]
    for i, ep in enumerate(episodes):
        prompt, tokens, mask, logq = _hand_row(tok, sampler, examples[ep.example].prompt)
        P, T = batch.prompt_ids.shape[1], len(tokens)
        assert batch.prompt_ids[i, P - len(prompt):].tolist() == prompt and batch.prompt_mask[i].sum() == len(prompt)
        assert batch.response_ids[i, :T].tolist() == tokens and batch.response_mask[i].sum() == T
        assert batch.loss_mask[i].tolist() == [float(m) for m in mask] + [0.0] * (batch.loss_mask.shape[1] - T)
        assert batch.sampler_logprobs[i, :T].tolist() == pytest.approx(logq)
        # the loss mask covers exactly the sampled ids: brute force over the recorded calls
        sampled = [t for call in ep.calls for t in call.completion_ids]
        assert [t for t, m in zip(tokens, mask) if m] == sampled
    assert batch.policy_version.tolist() == [0] * 4     # the version that drew them (the scripted sampler's)


def test_a_rewritten_history_gives_two_rows_sharing_the_reward(endpoint, tok):
    runner = AgentRunner(endpoint, rewriting, concurrency=2, timeout_s=30)
    examples = [Example(prompt="3+4=", answer="7")]
    try:
        episodes = runner.run(examples, 1)
    finally:
        runner.close()
    (ep,) = episodes
    rows = episode_rows(ep.calls)
    assert len(rows) == 2
    assert rows[0].prompt == encode(tok, "U:3+4=\nA:") and rows[0].tokens == encode(tok, "x1") + [tok.eos_token_id]
    assert rows[1].prompt == encode(tok, "U:3+4=\nA:x<eos>T:R\nA:") and rows[1].model == [1] * len(rows[1].tokens)
    scored = score_agent_episodes(None, tok, episodes, examples, endpoint.sampler, policy_version=0, positions=[7])
    assert scored.rewards.tolist() == [0.25, 0.25] and scored.group_ids.tolist() == [0, 0]
    assert scored.prompt_index.tolist() == [7, 7]
    assert scored.task_metrics["task/agent_split_episodes"] == 1.0 and scored.task_metrics["task/agent_rows"] == 2.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 9), max_size=3),
                          st.lists(st.integers(0, 9), min_size=1, max_size=3)), min_size=1, max_size=8))
def test_merge_rule_rebuilds_the_rows_an_episode_grew(steps):
    """Random episodes: each call either extends a row grown so far (its whole sequence, a gap, then the
    completion) or opens a new one (a prompt starting with a token no other row has); `episode_rows` must give
    back exactly those rows, with the sampled tokens in the loss and the gaps out."""
    expected: list[dict] = []
    calls = []
    for pick, gap, completion in steps:
        if pick < len(expected) and pick < 3:
            row = expected[pick]
            prompt = row["prompt"] + row["tokens"] + gap
            row["tokens"] += gap + completion
            row["model"] += [0] * len(gap) + [1] * len(completion)
        else:
            prompt = [100 + len(expected)] + gap
            expected.append({"prompt": prompt, "tokens": list(completion), "model": [1] * len(completion)})
        logq = [-0.5 - t for t in completion]
        calls.append(AgentCall(list(prompt), list(completion), logq, "stop", 0, ""))
    rows = episode_rows(calls)
    assert [{"prompt": r.prompt, "tokens": r.tokens, "model": r.model} for r in rows] == expected
    for r in rows:
        assert [q for q, m in zip(r.logq, r.model) if not m] == [0.0] * (len(r.model) - sum(r.model))
        assert [q for q, t, m in zip(r.logq, r.tokens, r.model) if m] == [-0.5 - t for t, m in zip(r.tokens, r.model)
                                                                          if m]


async def misbehaving(base_url, api_key, example):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await _chat(client, [{"role": "user", "content": example.prompt}])   # recorded, then the episode fails
    kind = example.prompt
    if kind == "raise":
        raise ValueError("boom in the agent")
    if kind == "hang":
        await asyncio.sleep(60)
    if kind == "text":
        return "seven"
    return 1.0


def blocking_no_call(base_url, api_key, example):
    time.sleep(0.05)
    return 1.0


def test_failing_agents_are_shown_counted_and_train_nothing(endpoint, tok):
    reports: list[str] = []
    watch = FailureWatch("agent toy.py:run", unit="episodes", window=8, max_rate=0.5, report=reports.append)
    examples = [Example(prompt=p, answer="") for p in ("ok", "raise", "hang", "text")]
    runner = AgentRunner(endpoint, misbehaving, concurrency=4, timeout_s=1.0)
    try:
        episodes = runner.run(examples, 1)
    finally:
        runner.close()
    errors = [type(ep.error).__name__ if ep.error else None for ep in episodes]
    assert errors == [None, "ValueError", "TimeoutError", "TypeError"]
    assert all(len(ep.calls) == 1 for ep in episodes)      # each was recorded before it failed
    count_failures(watch, episodes, examples)
    assert watch.failures == 3 and len(reports) == 1
    assert "boom in the agent" in reports[0] and "Traceback" in reports[0] and "misbehaving" in reports[0]
    scored = score_agent_episodes(None, tok, episodes, examples, endpoint.sampler, policy_version=0)
    assert len(scored) == 1 and scored.rewards.tolist() == [1.0]          # the finished episode's row only
    assert scored.task_metrics["task/agent_failed"] == 0.75 and scored.task_metrics["task/agent_timeouts"] == 0.25
    # more failures pass the rate: the run stops, naming the first error
    runner = AgentRunner(endpoint, blocking_no_call, concurrency=2, timeout_s=5.0)
    try:
        none = runner.run(examples, 1)
    finally:
        runner.close()
    assert all("no model call" in str(ep.error) for ep in none)
    batch, owner = agent_batch(none, endpoint.sampler, tok)
    assert owner == [-1] and batch.train_mask.sum() == 0      # a placeholder: nothing in the loss
    with pytest.raises(UserCodeError, match="boom in the agent"):
        count_failures(watch, none, examples)


AGENT = '''
import openai


async def run(base_url, api_key, example):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="covrl", messages=[{"role": "user", "content": example.prompt}])
    return None   # the task's reward of the answer
'''


def test_tiny_sync_run_trains_a_toy_agent(tmp_path, monkeypatch):
    (tmp_path / "toy_agent.py").write_text(AGENT)
    stepped = []
    real_step = Trainer.step

    def recording_step(self, batch, *a, **kw):
        stepped.append(batch)
        return real_step(self, batch, *a, **kw)

    monkeypatch.setattr(Trainer, "step", recording_step)
    cfg = tiny_cfg(tmp_path, **{"run.name": "agent", "task.agent.fn": f"{tmp_path / 'toy_agent.py'}:run",
                                "task.agent.concurrency": 8, "loop.steps": 2, "sft_warmup.steps": 0,
                                "eval.before": False, "eval.after": False})
    run = prepare_run(cfg, console=False)
    # before training: every sampled token's recorded log q is the trainer's own fp32 forward of the row
    source = AgentSource(run)
    batch = source.next_batch(0).batch
    source.stop()
    fwd = forward_batch(run.model, batch, float(run.cfg.sampler.temperature), with_stats=False)
    mask = batch.train_mask > 0
    assert mask.any() and torch.allclose(fwd.logprobs[mask], batch.sampler_logprobs[mask], atol=2e-4)
    summary = train_sync(run)
    run.close()
    assert summary["status"] == "completed" and summary["agent"]["failed_episodes"] == 0
    records = read_jsonl(tmp_path / "agent" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["task/agent_calls"] == 1.0 and r["task/agent_failed"] == 0.0 and r["task/agent_rows"] == 1.0
    assert len(stepped) == 2
    for version, b in enumerate(stepped):
        assert b.policy_version.tolist() == [version] * len(b)     # each step's rows drawn by the weights before it
        assert len(b) == 16 and b.group_ids.tolist() == torch.arange(4).repeat_interleave(4).tolist()
        # the tokenizer has no chat template: covrl's plain one renders the user turn as its text, exactly
        for i in range(len(b)):
            prompt = b.prompt_ids[i][b.prompt_mask[i] > 0].tolist()
            assert re.fullmatch(r"Compute \d[+]\d\. Answer with just the number\.", run.tokenizer.decode(prompt))
            assert encode(run.tokenizer, run.tokenizer.decode(prompt)) == prompt
        assert torch.equal(b.train_mask, b.response_mask)
