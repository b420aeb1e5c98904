"""task.agent: an agent program's episodes through covrl's OpenAI-compatible endpoint become training rows from
the recorded token ids (no re-tokenising). Checked by hand-built ids: a call that extends the previous call's
prompt + completion merges into one row whose loss mask covers exactly the sampled tokens; a call after the
history was rewritten starts a second row with the episode's reward; an agent that raises, hangs, returns a
non-number or makes no call is shown, counted by the user-code rule and trains nothing; a tiny sync run trains
with a toy agent end to end. On the tiny model (no chat template) a two-call tool agent merges into one row with
exact masks and exact ratios; held-out evaluation plays the agent (greedy = the sampler's greedy decoding);
command agents (task.agent.command) report a reward or fail visibly; the threaded async loop trains an agent with
each token's call version in the staleness ledger; agent rows train the same packed or padded; at sampler.top_k
they carry the kept-set sizes and the replayed ratios are exact; a step waiting on slow episodes says so."""

from __future__ import annotations

import asyncio
import json
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

from covrl.rollout.agents import AgentEpisode, AgentRunner, agent_batch, episode_rows  # noqa: E402
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
    # the timeout leaves a loaded machine room for the three calls that should finish
    runner = AgentRunner(endpoint, misbehaving, concurrency=4, timeout_s=4.0)
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
            assert re.fullmatch(r"Compute \d[+]\d\. Answer with just the number\.\n", run.tokenizer.decode(prompt))
            assert encode(run.tokenizer, run.tokenizer.decode(prompt)) == prompt
        assert torch.equal(b.train_mask, b.response_mask)


TOOL_AGENT = '''
import openai

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


async def run(base_url, api_key, example):
    """Asks, sends the tool's result back, asks again; odd answers: the first reply comes back rewritten."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": example.plain_prompt}]
    first = await client.chat.completions.create(model="covrl", messages=messages, tools=TOOLS)
    said = first.choices[0].message.content
    messages += [{"role": "assistant", "content": "?" if int(example.answer) % 2 else said},
                 {"role": "tool", "tool_call_id": "call_0", "content": example.answer}]
    second = await client.chat.completions.create(model="covrl", messages=messages, tools=TOOLS)
    return float(second.choices[0].message.content == example.answer)
'''


def test_a_two_call_tool_agent_on_the_tiny_model_merges_and_its_ratios_are_exact(tmp_path):
    """A tokenizer without a chat template: covrl's plain agent format (the generation prompt is the line break
    the next rendering puts before the assistant text) lets the second call extend the first, so the episode is
    one row: the first prompt, the first draw, the EOS + tool turn + line break (context), the second draw. A
    rewritten first reply gives two rows. On both, the trainer's fp32 forward of the built rows reproduces the
    recorded sampler log-probs: the mismatch k3 is at the fp32 floor."""
    (tmp_path / "tool_agent.py").write_text(TOOL_AGENT)
    cfg = tiny_cfg(tmp_path, **{"run.name": "merge", "task.agent.fn": f"{tmp_path / 'tool_agent.py'}:run",
                                "model.tiny.max_positions": 96, "sampler.max_new_tokens": 6, "sft_warmup.steps": 0})
    run = prepare_run(cfg, console=False)
    tok, eos = run.tokenizer, run.tokenizer.eos_token_id
    source = AgentSource(run)
    source.player._endpoint().version = lambda: 0
    examples = run.task.eval[:8]
    try:
        episodes = source.player.runner.run(examples, 2)
    finally:
        source.stop()
    assert [ep.error for ep in episodes] == [None] * 16
    batch, owner = agent_batch(episodes, run.sampler, tok, policy_version=0)
    merged = split = 0
    for k, ep in enumerate(episodes):
        ex = examples[ep.example]
        first, second = ep.calls
        # the prompts, rendered by hand: the user line + the generation prompt's line break ...
        prompt = encode(tok, ex.plain_prompt + "\n")
        assert first.prompt_ids == prompt
        drawn = first.completion_ids[:-1] if first.completion_ids[-1:] == [eos] else first.completion_ids
        rewritten = int(ex.answer) % 2 == 1
        said = encode(tok, "?" if rewritten else tok.decode(drawn, skip_special_tokens=True))
        # ... then the assistant text, its EOS, the tool line and the next generation prompt
        assert second.prompt_ids == prompt + said + [eos] + encode(tok, "\n" + ex.answer + "\n")
        rows = [i for i, o in enumerate(owner) if o == k]
        lengths = batch.response_mask.sum(1).long().tolist()
        if said == drawn:      # the reply came back as drawn: one row, the gap (EOS if cut, tool turn) masked
            merged += 1
            gap = second.prompt_ids[len(prompt) + len(first.completion_ids):]
            tokens = first.completion_ids + gap + second.completion_ids
            mask = [1.0] * len(first.completion_ids) + [0.0] * len(gap) + [1.0] * len(second.completion_ids)
            logq = first.logprobs + [0.0] * len(gap) + second.logprobs
            (i,) = rows
            assert lengths[i] == len(tokens) and batch.response_ids[i, :len(tokens)].tolist() == tokens
            assert batch.prompt_ids[i][batch.prompt_mask[i] > 0].tolist() == prompt
            assert batch.train_mask[i, :len(tokens)].tolist() == mask and batch.train_mask[i].sum() == sum(mask)
            assert batch.sampler_logprobs[i, :len(tokens)].tolist() == pytest.approx(logq)
        else:                  # a rewritten (or not re-encodable) reply: one row per call, every token sampled
            split += 1
            assert len(rows) == 2
            for i, call in zip(rows, ep.calls):
                assert batch.prompt_ids[i][batch.prompt_mask[i] > 0].tolist() == call.prompt_ids
                assert batch.response_ids[i, :lengths[i]].tolist() == call.completion_ids
                assert batch.train_mask[i].sum() == lengths[i] == len(call.completion_ids)
    assert merged >= 4 and split >= 4
    fwd = forward_batch(run.model, batch, float(run.cfg.sampler.temperature), with_stats=False)
    mask = batch.train_mask > 0
    log_r = fwd.logprobs[mask] - batch.sampler_logprobs[mask]
    k3 = torch.expm1(log_r) - log_r
    assert mask.sum() > 0 and log_r.abs().max() < 1e-4 and k3.mean() < 1e-9
    run.close()


def test_held_out_evaluation_plays_the_agent_greedily(tmp_path):
    """With task.agent, eval runs the agent on the held-out prompts: its greedy pass gets the sampler's greedy
    completion of the agent's prompt (compared with sampler.generate(greedy=True) on the same ids), graded by
    the task; the accuracy printed and kept in eval.json is the agent's, before and after training."""
    (tmp_path / "toy_agent.py").write_text(AGENT)
    cfg = tiny_cfg(tmp_path, **{"run.name": "agent-eval", "task.agent.fn": f"{tmp_path / 'toy_agent.py'}:run",
                                "loop.steps": 1, "sft_warmup.steps": 2, "eval.max_prompts": 6,
                                "eval.pass_at_k": 2, "model.tiny.max_positions": 64})
    run = prepare_run(cfg, console=False)
    examples = run.task.eval[:6]
    tok = run.tokenizer
    from covrl.rollout.openai_api import PLAIN_AGENT_TEMPLATE

    prompts = [encode(tok, ex.prompt + "\n") for ex in examples]
    assert prompts[0] == encode(tok, tok.apply_chat_template([{"role": "user", "content": examples[0].prompt}],
                                                             chat_template=PLAIN_AGENT_TEMPLATE, tokenize=False,
                                                             add_generation_prompt=True))
    out = run.sampler.generate(prompts, 1, generator=torch.Generator().manual_seed(0), greedy=True)
    lengths = out.response_mask.sum(1).long().tolist()
    texts = [tok.decode(out.response_ids[i, :lengths[i]].tolist(), skip_special_tokens=True) for i in range(6)]
    graded = run.task.score(texts, examples)
    summary = train_sync(run)
    run.close()
    assert summary["status"] == "completed"
    evals = read_jsonl_evals(tmp_path / "agent-eval" / "eval.json")
    assert [e["label"] for e in evals] == ["before", "after"]
    before = evals[0]
    assert before["greedy"]["n"] == 6 and before["greedy"]["agent_calls"] == 1.0
    assert before["greedy"]["agent_failed"] == 0.0
    assert [e["completion"] for e in before["greedy"]["examples"]] == texts[:5]
    assert before["greedy"]["accuracy"] == pytest.approx(sum(graded.correct) / 6)
    assert before["greedy"]["reward_mean"] == pytest.approx(sum(graded.rewards) / 6)
    assert before["sampled"]["n"] == 6 and before["pass@k"]["n"] == 2 and len(before["pass@k"]["correct_counts"]) == 6
    assert all(0 <= c <= 2 for c in before["pass@k"]["correct_counts"])
    assert evals[1]["greedy"]["n"] == 6 and evals[1]["policy_version"] == 1
    # `covrl eval` of the run's checkpoint plays the agent too: its greedy episodes are the run's after-evaluation
    from covrl.cli import main as covrl_main

    out = tmp_path / "eval-cli.json"
    assert covrl_main(["eval", "--run", str(tmp_path / "agent-eval"), "--out", str(out)]) == 0
    cli = json.loads(out.read_text())
    assert cli["agent"] == cfg.task.agent.spec and cli["greedy"]["agent_calls"] == 1.0
    assert cli["greedy"]["examples"] == evals[1]["greedy"]["examples"]
    assert cli["greedy"]["accuracy"] == evals[1]["greedy"]["accuracy"]


def read_jsonl_evals(path):
    import json

    return json.loads(path.read_text())["evals"]


COMMAND_AGENT = r'''
import json, os, subprocess, sys, time, urllib.request

example = json.load(sys.stdin)
kind = example["meta"].get("kind", "ok")
print("log line on stdout", flush=True)
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
    data=json.dumps({"model": "covrl", "messages": [{"role": "user", "content": example["prompt"]}]}).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
answer = json.load(urllib.request.urlopen(request))["choices"][0]["message"]["content"]
if kind == "exit":
    print("the agent broke", file=sys.stderr)
    sys.exit(3)
if kind == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(example["meta"]["pid_file"], "w").write(str(child.pid))
    time.sleep(60)
if kind == "garbage":
    print("seven")
elif kind == "null":
    print("null")
else:
    print(0.5 if answer == "x1" else 0.0)
'''


def test_command_agents_read_the_example_and_report_a_reward_or_fail_visibly(endpoint, tok, tmp_path):
    """task.agent.command: a program per episode with the endpoint and the episode's key in its environment and
    the example as JSON on stdin; its last stdout line is the reward (null: the task's). A non-zero exit, a
    timeout (the process group killed: a child it started is gone too) and a last line that is not a number
    fail the episode, shown at once with the program's stderr, and counted by the user-code rule."""
    import os

    from covrl.tasks.agent import AgentCommandError, AgentConfig, build_agent, parse_reward_line

    script = tmp_path / "agent.py"
    script.write_text(COMMAND_AGENT)
    pid_file = tmp_path / "child.pid"
    kinds = ["ok", "null", "exit", "hang", "garbage"]
    examples = [Example(prompt=f"{k}?", answer="", meta={"kind": k, "pid_file": str(pid_file)}) for k in kinds]
    fn = build_agent(AgentConfig(command=f"{sys.executable} {script}", timeout_s=3.0))
    runner = AgentRunner(endpoint, fn, concurrency=5, timeout_s=3.0)
    try:
        episodes = runner.run(examples, 1)
    finally:
        runner.close()
    by_kind = dict(zip(kinds, episodes))
    assert by_kind["ok"].error is None and by_kind["ok"].reward == 0.5
    assert by_kind["null"].error is None and by_kind["null"].reward is None
    assert [c.prompt_ids for c in by_kind["ok"].calls] == [encode(tok, "U:ok?\nA:")]    # the episode's calls
    exit_error = by_kind["exit"].error
    assert isinstance(exit_error, AgentCommandError) and "status 3" in str(exit_error)
    assert "the agent broke" in str(exit_error)
    assert by_kind["hang"].timed_out
    child = int(pid_file.read_text())
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the agent command's child outlived the episode's timeout")
    assert isinstance(by_kind["garbage"].error, AgentCommandError) and "'seven'" in str(by_kind["garbage"].error)
    assert all(len(ep.calls) == 1 for ep in episodes)
    reports: list[str] = []
    watch = FailureWatch("agent command", unit="episodes", window=5, max_rate=0.5, report=reports.append)
    with pytest.raises(UserCodeError, match="status 3"):
        count_failures(watch, episodes, examples)      # 3 of 5 failed: past the rate
    assert watch.failures == 3 and len(reports) == 1 and "the agent broke" in reports[0]
    # the reward line, by hand
    assert parse_reward_line("a\n 1.5 \n\n") == 1.5
    assert parse_reward_line("") is None and parse_reward_line("None") is None
    for bad in ("nan", "inf", "1.5 points"):
        with pytest.raises(AgentCommandError):
            parse_reward_line(bad)
    with pytest.raises(ValueError, match="not both"):
        AgentConfig(fn="a.py:run", command="python a.py")


def test_tiny_sync_run_trains_a_command_agent(tmp_path):
    (tmp_path / "agent.py").write_text(COMMAND_AGENT)
    command = f"{sys.executable} {tmp_path / 'agent.py'}"
    cfg = tiny_cfg(tmp_path, **{"run.name": "command", "task.agent.command": command,
                                "loop.steps": 1, "sft_warmup.steps": 0, "eval.before": False, "eval.after": False})
    run = prepare_run(cfg, console=False)
    summary = train_sync(run)
    run.close()
    assert summary["status"] == "completed" and summary["agent"]["failed_episodes"] == 0
    (record,) = read_jsonl(tmp_path / "command" / "metrics.jsonl")
    assert record["task/agent_calls"] == 1.0 and record["task/agent_failed"] == 0.0


def test_token_versions_are_each_calls_weights_version(tok):
    """A row merged from calls drawn by different weight versions: each token carries its call's version (the
    gap the second call's), the row's policy_version is the oldest; the async loop's ledger reads them."""
    from covrl.train.asyncrl.source import token_lag_metrics

    calls = [AgentCall([5, 6], [7, 8], [-0.1, -0.2], "stop", 3, ""),
             AgentCall([5, 6, 7, 8, 9], [10], [-0.3], "stop", 4, ""),
             AgentCall([11], [12, 13], [-0.4, -0.5], "stop", 4, "")]   # a rewritten history: a second row
    ep = AgentEpisode(0, calls, reward=1.0)
    sampler = ScriptedSampler(tok, lambda p: "")
    batch, owner = agent_batch([ep], sampler, tok, policy_version=9)
    assert owner == [0, 0] and batch.policy_version.tolist() == [3, 4]
    assert batch.versions_per_token[0, :4].tolist() == [3, 3, 4, 4]      # 7 8 | gap 9 | 10
    assert batch.versions_per_token[1, :2].tolist() == [4, 4]
    lag = token_lag_metrics(batch, 5)
    # sampled tokens: 7, 8 (version 3), 10, 12, 13 (version 4): lags 2, 2, 1, 1, 1
    assert lag["async/token_lag_mean"] == pytest.approx(7 / 5) and lag["async/token_lag_max"] == 2.0
    assert lag["async/mixed_rows_frac"] == 0.5


def test_threaded_async_loop_trains_an_agent_within_the_staleness_bound(tmp_path, monkeypatch):
    """loop.mode=async, thread backend: the sampler thread plays chunks of agent episodes through the endpoint
    around its own weights while the trainer trains; every row's tokens carry the version that drew them, within
    the staleness bound, and the final evaluation plays the agent."""
    from covrl.train.asyncrl.config import AsyncLoopConfig
    from covrl.train.asyncrl.source import prepare_async_run, train_async

    (tmp_path / "toy_agent.py").write_text(AGENT)
    stepped = []
    real_step = Trainer.step

    def recording_step(self, batch, *a, **kw):
        stepped.append((self.version, batch))
        return real_step(self, batch, *a, **kw)

    monkeypatch.setattr(Trainer, "step", recording_step)
    cfg = tiny_cfg(tmp_path, **{"run.name": "agent-async", "task.agent.fn": f"{tmp_path / 'toy_agent.py'}:run",
                                "loop.steps": 4, "sft_warmup.steps": 0, "eval.before": False, "eval.sampled": False,
                                "model.tiny.max_positions": 64})
    run = prepare_async_run(cfg, console=False)
    summary = train_async(run, acfg=AsyncLoopConfig(max_staleness_steps=1, chunk_prompts=1))
    run.close()
    assert summary["status"] == "completed" and summary["agent"]["failed_episodes"] == 0
    assert summary["async"]["rollouts_consumed"] == 4 * 16
    records = read_jsonl(tmp_path / "agent-async" / "metrics.jsonl")
    assert len(records) == 4 and all(r["async/staleness_max"] <= 1 for r in records)
    assert all(r["task/agent_calls"] == 1.0 for r in records)
    assert len(stepped) == 4
    for version, batch in stepped:
        drawn = batch.versions_per_token[batch.train_mask > 0]
        assert drawn.numel() and bool((drawn <= version).all()) and bool((version - drawn <= 1).all())
        for i in range(len(batch)):    # one call per episode: every sampled token from the row's version
            assert set(batch.versions_per_token[i][batch.train_mask[i] > 0].tolist()) == {int(batch.policy_version[i])}
    evals = read_jsonl_evals(tmp_path / "agent-async" / "eval.json")
    assert [e["label"] for e in evals] == ["after"] and evals[0]["greedy"]["agent_calls"] == 1.0
    assert run.agent.server is None     # the endpoint is closed at the end


PARTIAL_AGENT = '''
import asyncio
import threading

import openai

hooks = {"first_call_done": None, "may_go_on": None}   # set by the test
started = {"n": 0}
lock = threading.Lock()


async def run(base_url, api_key, example):
    with lock:
        index = started["n"]
        started["n"] += 1
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": example.prompt}]
    first = await client.chat.completions.create(model="covrl", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Again."}]
    if index >= 16:   # step 2's episodes: the second call waits for the trainer's version 1
        hooks["first_call_done"]()
        while not hooks["may_go_on"]():
            await asyncio.sleep(0.02)
    await client.chat.completions.create(model="covrl", messages=messages)
    return None
'''


def test_partial_rollouts_hand_an_agents_later_calls_the_newer_weights(tmp_path, monkeypatch):
    """async_loop.partial_rollouts with an agent (thread pool): weights published while a chunk's episodes run
    are taken between calls. Step 2's episodes make their first call with version 0, the trainer's step 1 is held
    until they have, and their second call waits for version 1: its tokens carry version 1, the first call's
    version 0, and each row's policy_version is its oldest call's."""
    import importlib

    from covrl.train.asyncrl.config import AsyncLoopConfig
    from covrl.train.asyncrl.pools import ThreadPool
    from covrl.train.asyncrl.source import prepare_async_run, train_async

    (tmp_path / "partial_agent.py").write_text(PARTIAL_AGENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    agent = importlib.import_module("partial_agent")
    first_done, published = __import__("threading").Event(), __import__("threading").Event()
    agent.hooks.update(first_call_done=first_done.set, may_go_on=published.is_set)
    real_publish, real_step = ThreadPool.publish, Trainer.step
    stepped = []

    def publish(self, model, version):
        real_publish(self, model, version)
        if version >= 1:
            published.set()

    def step(self, batch, *a, **kw):
        if self.version == 0:   # step 1 waits until step 2's episodes made their first call with version 0
            assert first_done.wait(120), "no episode of step 2 started"
        stepped.append((self.version, batch))
        return real_step(self, batch, *a, **kw)

    monkeypatch.setattr(ThreadPool, "publish", publish)
    monkeypatch.setattr(Trainer, "step", step)
    cfg = tiny_cfg(tmp_path, **{"run.name": "agent-partial", "task.agent.fn": "partial_agent:run",
                                "loop.steps": 2, "sft_warmup.steps": 0, "eval.before": False, "eval.after": False,
                                "model.tiny.max_positions": 96})
    run = prepare_async_run(cfg, console=False)
    try:
        summary = train_async(run, acfg=AsyncLoopConfig(max_staleness_steps=1, chunk_prompts=4,
                                                        partial_rollouts=True))
    finally:
        run.close()
    assert summary["status"] == "completed" and summary["agent"]["failed_episodes"] == 0
    (v1, first), (v2, second) = stepped
    assert v1 == 0 and v2 == 1
    drawn = first.versions_per_token[first.train_mask > 0]
    assert set(drawn.tolist()) == {0}
    drawn = second.versions_per_token[second.train_mask > 0]
    assert set(drawn.tolist()) == {0, 1}        # the first calls at version 0, the second at version 1
    for i in range(len(second)):
        mine = second.versions_per_token[i][second.train_mask[i] > 0]
        assert int(second.policy_version[i]) == int(mine.min())
    records = read_jsonl(tmp_path / "agent-partial" / "metrics.jsonl")
    # the ledger: rows drawn by two versions, and a token lag below the rows' staleness
    assert records[1]["async/mixed_rows_frac"] > 0
    assert records[1]["async/token_lag_mean"] < records[1]["async/staleness_mean"]


FLAKY_AGENT = '''
import openai


async def run(base_url, api_key, example):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="covrl", messages=[{"role": "user", "content": example.prompt}])
    if "3" in example.prompt:
        raise ValueError("boom in a worker's agent")
    return None
'''


def _pool_agent_run(tmp_path, name: str, agent: str, backend: str, **over):
    from covrl.train.asyncrl.config import AsyncLoopConfig
    from covrl.train.asyncrl.source import prepare_async_run, train_async

    (tmp_path / f"{name}.py").write_text(agent)
    cfg = tiny_cfg(tmp_path, **{"run.name": name, "task.agent.fn": f"{tmp_path / name}.py:run", "loop.steps": 3,
                                "sft_warmup.steps": 0, "eval.before": False, "eval.sampled": False,
                                "model.tiny.max_positions": 64, **over})
    run = prepare_async_run(cfg, console=False)
    try:
        return run, train_async(run, acfg=AsyncLoopConfig(local_backend=backend, max_staleness_steps=1,
                                                          chunk_prompts=1))
    finally:
        run.close()


def test_process_pool_workers_play_agent_episodes_around_their_own_samplers(tmp_path):
    """async_loop.local_backend=process: each sampler process serves the agent's endpoint around its own
    sampler; the rows carry the versions that drew them (within the staleness bound), the trainer's forward
    matches the recorded log-probs where the weights are the same, and the final evaluation plays the agent in the
    trainer's process."""
    run, summary = _pool_agent_run(tmp_path, "agent_proc", AGENT, "process")
    assert summary["status"] == "completed" and summary["agent"]["failed_episodes"] == 0
    assert summary["async"]["rollouts_consumed"] == 3 * 16
    records = read_jsonl(tmp_path / "agent_proc" / "metrics.jsonl")
    assert len(records) == 3 and all(r["async/staleness_max"] <= 1 for r in records)
    assert all(r["task/agent_calls"] == 1.0 and r["task/agent_failed"] == 0.0 for r in records)
    # at version 0 the trainer's weights are the sampler's: the ratio is 1 up to fp32 (k3 at the floor)
    assert records[0]["mismatch/k3"] < 1e-8
    evals = read_jsonl_evals(tmp_path / "agent_proc" / "eval.json")
    assert [e["label"] for e in evals] == ["after"] and evals[0]["greedy"]["agent_calls"] == 1.0


# slow (~13 s): the process pool's agent run stays in the default suite; failing agents are tested in process
@pytest.mark.slow
def test_a_failing_agent_in_a_sampler_process_is_shown_and_counted_in_the_summary(tmp_path, capfd):
    """An agent that raises inside a sampler process: the first traceback is printed at once, the failed
    episodes train nothing, and the run's summary counts them (a failure rate under the rule's limit)."""
    run, summary = _pool_agent_run(tmp_path, "agent_flaky", FLAKY_AGENT, "process",
                                   **{"task.max_reward_error_rate": 0.9})
    shown = capfd.readouterr()    # the worker process writes to the file descriptors it inherited
    assert summary["status"] == "completed"
    assert summary["agent"]["failed_episodes"] > 0
    records = read_jsonl(tmp_path / "agent_flaky" / "metrics.jsonl")
    assert sum(r["task/agent_failed"] for r in records) > 0
    assert "boom in a worker's agent" in shown.err + shown.out and "Traceback" in shown.err + shown.out


def _packing_step(cfg, batch):
    from covrl.models import tiny_llama

    model = tiny_llama(40, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=48, seed=0)
    trainer = Trainer(model, cfg)
    captured = []
    trainer.optimizer.step = lambda *a, **k: captured.append([p.grad.detach().clone() for p in trainer.params])
    result = trainer.step(batch)
    return captured[0], result.metrics


@pytest.mark.parametrize("top_k", [0, 8])
def test_agent_rows_train_the_same_packed_or_padded(top_k):
    """Merged multi-call rows (context tokens inside the response, out of the loss) and a rewritten-history row,
    built by `agent_batch` from hand-made calls: a trainer.packing=true step equals the padded one (gradients
    and every metric to 1e-5 in fp32, as tests/train/test_packing.py checks ordinary rows); with top_k the rows
    carry each call's kept-set sizes and the step replays them (trainer.truncation=replay) the same both ways."""
    from types import SimpleNamespace

    from train_helpers import TIME_KEYS, TIME_PREFIXES

    g = torch.Generator().manual_seed(0)

    def ids(lo, hi):
        return torch.randint(1, 40, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    def call(prompt, completion, version=0):
        logq = (-3.7 + 0.3 * torch.randn(len(completion), generator=g)).tolist()
        return AgentCall(prompt, completion, logq, "stop", version, "", [top_k] * len(completion) if top_k else None)

    episodes = []
    for example in range(3):
        prompt = ids(3, 6)
        for j in range(3):
            first, gap, second = ids(2, 5), ids(1, 3), ids(1, 4)
            calls = [call(prompt, first), call(prompt + first + gap, second)]
            if j == 2:   # a rewritten history: a second row of the episode
                calls.append(call(prompt + ids(1, 2), ids(1, 3)))
            episodes.append(AgentEpisode(example, calls, reward=float(torch.rand(1, generator=g))))
    batch, owner = agent_batch(episodes, SimpleNamespace(version=0, pad_id=0), None, policy_version=0)
    assert len(owner) == 12 and (batch.response_mask - batch.loss_mask).sum() > 0    # context inside responses
    assert (batch.sampler_kept is not None) == bool(top_k)
    if top_k:   # the kept sizes sit on the sampled tokens only
        assert torch.equal(batch.sampler_kept > 0, batch.loss_mask > 0)
    scored = batch.scored(torch.tensor([episodes[k].reward for k in owner]))
    over = {"logging.noise_scale": False, "optim.micro_batch_size": 64, "sampler.top_k": top_k}
    if top_k:
        over["trainer.truncation"] = "replay"
    cfg = tiny_cfg(**over)
    packed = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"packing": True})})
    (ga, ma), (gb, mb) = _packing_step(cfg, scored), _packing_step(packed, scored)
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), float((a - b).abs().max())
    keys = [k for k in ma if not k.startswith(TIME_PREFIXES) and k not in TIME_KEYS]
    assert set(keys) <= set(mb) and ma["grad_norm"] > 0
    if top_k:
        assert ma["truncation/replay"] == 1.0 and "truncation/count_mismatch_frac" in ma
    for k in keys:
        assert ma[k] == pytest.approx(mb[k], rel=1e-4, abs=1e-5), (k, ma[k], mb[k])


def test_agent_rows_at_top_k_carry_the_kept_sets_and_replay_makes_the_ratios_exact(tmp_path):
    """sampler.top_k=5: the endpoint records each call's kept-set sizes, the merged rows carry them (0 on the
    context between calls), and the trainer's fp32 forward with trainer.truncation=replay reproduces the
    recorded log q of the truncated sampler (the mismatch k3 at the fp32 floor, docs/theory.md §12); without
    the replay the ratios are those of the untruncated π, far from 1."""
    from covrl.train.step.micro_step import truncation_replay

    (tmp_path / "tool_agent.py").write_text(TOOL_AGENT)
    cfg = tiny_cfg(tmp_path, **{"run.name": "topk", "task.agent.fn": f"{tmp_path / 'tool_agent.py'}:run",
                                "model.tiny.max_positions": 96, "sampler.max_new_tokens": 6, "sft_warmup.steps": 0,
                                "sampler.top_k": 5, "trainer.truncation": "replay"})
    run = prepare_run(cfg, console=False)
    source = AgentSource(run)
    source.player._endpoint().version = lambda: 0
    try:
        episodes = source.player.runner.run(run.task.eval[:6], 2)
    finally:
        source.stop()
    assert [ep.error for ep in episodes] == [None] * 12
    for ep in episodes:
        for c in ep.calls:
            assert c.kept is not None and len(c.kept) == len(c.completion_ids) and min(c.kept) >= 5
    batch, owner = agent_batch(episodes, run.sampler, run.tokenizer, policy_version=0)
    mask = batch.train_mask > 0
    assert batch.sampler_kept is not None and torch.equal(batch.sampler_kept > 0, mask)
    assert (batch.response_mask - batch.train_mask).sum() > 0     # some rows merged two calls
    rule, replay = truncation_replay(run.cfg.sampler, run.cfg.trainer.truncation)
    assert rule is not None and replay
    temperature = float(run.cfg.sampler.temperature)
    fwd = forward_batch(run.model, batch, temperature, with_stats=False, truncation=rule, replay=True)
    log_r = fwd.logprobs[mask] - batch.sampler_logprobs[mask]
    k3 = torch.expm1(log_r) - log_r
    assert log_r.abs().max() < 1e-4 and k3.mean() < 1e-9
    assert not fwd.truncation.count_mismatch[mask].any() and not fwd.truncation.sampled_outside[mask].any()
    full = forward_batch(run.model, batch, temperature, with_stats=False)
    assert (full.logprobs[mask] - batch.sampler_logprobs[mask]).abs().max() > 1e-2
    run.close()


SLOW_AGENT = '''
import asyncio

import openai


async def run(base_url, api_key, example):
    await asyncio.sleep(0.8)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="covrl", messages=[{"role": "user", "content": example.prompt}])
    return 1.0
'''


def test_a_step_waiting_on_slow_agent_episodes_says_so(tmp_path, capsys):
    """run.stall_warning_s below an episode's length: the run's stall report names the agent episodes it waits
    for (running of those asked, finished, queued behind task.agent.concurrency, the oldest one's age), and the
    run completes."""
    (tmp_path / "slow_agent.py").write_text(SLOW_AGENT)
    cfg = tiny_cfg(tmp_path, **{"run.name": "slow", "task.agent.fn": f"{tmp_path / 'slow_agent.py'}:run",
                                "task.agent.concurrency": 2, "loop.prompts_per_step": 2, "loop.group_size": 2,
                                "loop.steps": 1, "sft_warmup.steps": 0, "eval.before": False, "eval.after": False,
                                "run.stall_warning_s": 0.3})
    run = prepare_run(cfg, console=False)
    try:
        summary = train_sync(run)
    finally:
        run.close()
    err = capsys.readouterr().err
    assert summary["status"] == "completed"
    assert "waiting for the step's rollouts (step 1)" in err
    found = re.findall(r"waiting for agent episodes: (\d) of 4 running, (\d) finished, (\d) queued "
                       r"\(task.agent.concurrency=2\), oldest (\d+) s", err)
    assert found, err
    for running, finished, queued, _ in found:
        assert 1 <= int(running) <= 2 and int(running) + int(finished) + int(queued) == 4
    assert "slow_agent.py:run" in err
