"""Episodes through the hf sampler on the tiny model: the trainer's tokens are the sampler's across 3+ turns,
environment tokens are context only (masked out of the loss, no sampler log-prob), the normaliser counts
model tokens, and the tiny tool preset runs end to end via prepare_run + run_loop."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_helpers import tiny_cfg  # noqa: E402

import covrl.train.step.algorithm as algorithm_mod  # noqa: E402
from covrl.rollout.episodes import generate_episodes, score_episodes  # noqa: E402
from covrl.tasks import environments  # noqa: E402
from covrl.tasks.environments import EnvStep  # noqa: E402
from covrl.train.run.driver import run_loop  # noqa: E402
from covrl.train.run.folder import prepare_run  # noqa: E402
from covrl.train.run.sinks import read_jsonl  # noqa: E402
from covrl.train.run.sources import SyncSource, build_sync_source  # noqa: E402
from covrl.train.step.trainer import Trainer, forward_batch  # noqa: E402

torch.set_num_threads(1)


class Echo:
    """Replies to every assistant message for `turns` turns, then ends the episode with reward 1."""

    tools: list = []

    def __init__(self, turns: int = 4):
        self.turns, self.seen = turns, 0

    def reset(self, example):
        return [{"role": "user", "content": example.plain_prompt}]

    def step(self, text):
        self.seen += 1
        if self.seen >= self.turns:
            return EnvStep(done=True, reward=1.0)
        return EnvStep([{"role": "tool", "content": f"r{self.seen}"}])


@pytest.fixture
def echo_env(monkeypatch):
    monkeypatch.setitem(environments.ENVIRONMENTS, "echo", lambda task, cfg: lambda: Echo())
    return "echo"


def _run(tmp_path, env_name, **over):
    cfg = tiny_cfg(tmp_path, **{"task.env.name": env_name, "task.env.max_turns": 4, "model.tiny.max_positions": 160,
                                "sampler.max_new_tokens": 8, "sft_warmup.steps": 0, **over})
    return prepare_run(cfg, console=False)


def test_episode_tokens_are_the_samplers_across_turns(tmp_path, echo_env):
    run = _run(tmp_path, echo_env, **{"run.name": "bytes"})
    sampler, tok = run.sampler, run.tokenizer
    # stop on common characters too, so that random-weight turns end and episodes reach 3+ turns
    sampler.eos_ids = sorted(set(sampler.eos_ids) | set(tok("abcdefghijklmnopqrstuvwxyz")["input_ids"]))
    seen: list[list[list[int]]] = []
    generate = sampler.generate

    def recording(prompts, n, **kw):
        out = generate(prompts, n, **kw)
        seen.append([list(p) + out.response_ids[j, :int(out.response_mask[j].sum())].tolist()
                     for j, p in enumerate(prompts)])
        return out

    sampler.generate = recording
    examples = run.task.train[:3]
    eb = generate_episodes(sampler, tok, run.task.environment, examples, 4, generator=torch.Generator().manual_seed(0),
                           chat_template=False, max_turns=4)
    b = eb.batch
    assert max(e.turns for e in eb.episodes) >= 3 and sum(e.turns >= 3 for e in eb.episodes) >= 2
    # the trainer's sequence per row: prompt + response tokens with mask 1
    rows = [b.prompt_ids[i][b.prompt_mask[i] > 0].tolist() + b.response_ids[i][b.response_mask[i] > 0].tolist()
            for i in range(len(b))]
    for i, ep in enumerate(eb.episodes):
        # every turn's (context + drawn tokens) is a prefix of the trainer's row, in order: nothing re-tokenised
        live_prefixes = [seq for call in seen for seq in call if rows[i][:len(seq)] == seq]
        assert len(live_prefixes) >= ep.turns
        assert rows[i] == ep.prompt + ep.tokens
    # the sequence the sampler drew its last turn from, plus that turn, IS the row (byte for byte)
    longest = max(range(len(b)), key=lambda i: eb.episodes[i].turns)
    assert any(seq == rows[longest] for call in seen for seq in call)
    # masks: env tokens are context (response_mask 1) but not the model's (loss_mask 0, log-prob 0)
    env_tok = (b.response_mask > 0) & (b.loss_mask == 0)
    assert env_tok.any() and torch.all(b.sampler_logprobs[env_tok] == 0)
    assert torch.all(b.loss_mask <= b.response_mask)
    assert "r1" in tok.decode(b.response_ids[longest][env_tok[longest]].tolist())
    # the trainer's log-probs of the model tokens equal the sampler's (same fp32 weights, same context)
    fwd = forward_batch(run.model, b, 1.0)
    model_tok = b.loss_mask > 0
    assert torch.allclose(fwd.logprobs[model_tok], b.sampler_logprobs[model_tok], atol=1e-4)

    scored = score_episodes(run.task, tok, eb, examples, 4)
    captured = []
    real = algorithm_mod.aggregate

    def spy(loss, mask, mode, **kw):
        captured.append(mask.clone())
        return real(loss, mask, mode, **kw)

    algorithm_mod.aggregate = spy
    try:
        result = run.trainer.step(scored)
    finally:
        algorithm_mod.aggregate = real
    assert captured and all(torch.equal(m, b.loss_mask) for m in captured)   # the normaliser: model tokens
    assert result.metrics["response_tokens"] == float(b.loss_mask.sum()) < float(b.response_mask.sum())
    run.close()


def test_tiny_tool_preset_runs_end_to_end(tmp_path, echo_env):
    # the add tool on the tiny char model (plain prompts), 2 RL steps, evaluations with episodes
    run = _run(tmp_path, "add", **{"run.name": "tool", "loop.steps": 2, "algorithm.advantage": "otb_tir"})
    assert type(build_sync_source(run)) is SyncSource
    summary = run_loop(run, build_sync_source(run))
    run.close()
    assert summary["status"] == "completed"
    records = read_jsonl(tmp_path / "tool" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"task/turns", "task/tool_call_rate", "task/tool_calls"} <= set(r)
    evals = run.evals
    assert "tool_call_rate" in evals[0]["greedy"] and len(evals) == 2
    # the multi-turn echo environment through the same loop: the step counts model tokens only
    run = _run(tmp_path, echo_env, **{"run.name": "echo", "loop.steps": 2, "eval.before": False,
                                      "eval.after": False, "algorithm.advantage": "otb_tir"})
    run.sampler.eos_ids = sorted(set(run.sampler.eos_ids) | set(run.tokenizer("abcdefghijklm")["input_ids"]))
    run_loop(run, build_sync_source(run))
    run.close()
    records = read_jsonl(tmp_path / "echo" / "metrics.jsonl")
    assert all(r["task/turns"] > 1.5 for r in records)
    assert all(r["response_tokens"] < r["batch_rows"] * 8 * r["task/turns"] + 1 for r in records)


def test_score_centring_runs_on_episodes_with_the_model_tokens_top_k(tmp_path, echo_env, monkeypatch):
    """With sampler.return_topk the episodes carry the sampler's top-k of every model token (the trainer's own
    log-probs of those ids, at the same weights), zeros on environment tokens; score centring then runs on the
    model tokens only (its mask is loss_mask), and the tiny `add` preset trains 2 steps with it, finite."""
    sc = {"sampler.return_topk": 4, "algorithm.score_centering": True, "algorithm.loss": "covariance"}
    run = _run(tmp_path, echo_env, **{"run.name": "sc-echo", "logging.noise_scale": False, **sc})  # 1 micro-batch
    run.sampler.eos_ids = sorted(set(run.sampler.eos_ids) | set(run.tokenizer("abcdefghijklm")["input_ids"]))
    examples = run.task.train[:2]
    eb = generate_episodes(run.sampler, run.tokenizer, run.task.environment, examples, 3,
                           generator=torch.Generator().manual_seed(0), chat_template=False, max_turns=4)
    b = eb.batch
    B, T = b.response_ids.shape
    assert b.sampler_topk_ids.shape == (B, T, 4) and b.sampler_topk_logprobs.shape == (B, T, 4)
    model_tok, env_tok = b.loss_mask > 0, (b.response_mask > 0) & (b.loss_mask == 0)
    assert env_tok.any()
    assert torch.all(b.sampler_topk_ids[env_tok] == 0) and torch.all(b.sampler_topk_logprobs[env_tok] == 0)
    # aligned with the tokens: the trainer's log-probs of the sampler's top-k ids are the sampler's, and the
    # top-1 log-prob is at least the drawn token's
    fwd = forward_batch(run.model, b, 1.0, topk_ids=b.sampler_topk_ids)
    assert torch.allclose(fwd.topk_logprobs[model_tok], b.sampler_topk_logprobs[model_tok], atol=1e-4)
    assert torch.all(b.sampler_topk_logprobs[model_tok][:, 0] >= b.sampler_logprobs[model_tok] - 1e-5)
    masks = []
    real = algorithm_mod.score_centering_term

    def spy(trainer_topk, sampler_topk, advantages, mask, **kw):
        masks.append(mask.clone())
        return real(trainer_topk, sampler_topk, advantages, mask, **kw)

    monkeypatch.setattr(algorithm_mod, "score_centering_term", spy)
    result = run.trainer.step(score_episodes(run.task, run.tokenizer, eb, examples, 3))
    run.close()
    assert len(masks) == 1 and torch.equal(masks[0], b.loss_mask)
    assert "score_center/rho_tail_mean" in result.metrics and torch.isfinite(torch.tensor(result["loss"]))
    monkeypatch.undo()

    run = _run(tmp_path, "add", **{"run.name": "sc-add", "loop.steps": 2, "eval.before": False, "eval.after": False,
                                   **sc})
    summary = run_loop(run, build_sync_source(run))
    run.close()
    assert summary["status"] == "completed"
    records = read_jsonl(tmp_path / "sc-add" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("loss", "loss/score_centering", "score_center/rho_tail_mean", "score_center/abs_c_sum_mean"):
            assert math.isfinite(r[key]), key


# keys that measure wall time or only exist in the async loop
_ASYNC_ONLY = ("time/", "async/", "gap/")
_WALL = {"tokens_per_s", "generate_tokens_per_s", "train_tokens_per_s"}


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(_ASYNC_ONLY) and k not in _WALL} for r in records]


def test_async_loop_runs_episodes_and_equals_sync_at_staleness_zero(tmp_path, echo_env, monkeypatch):
    """loop.mode=async generates episodes through the same generate_batch / score_batch as the sync loop: with
    staleness 0 (serial emulation and a real sampler thread) every metric equals the sync loop's, and the
    trained batches carry environment tokens outside loss_mask."""
    from covrl.train.asyncrl.config import AsyncLoopConfig
    from covrl.train.asyncrl.source import prepare_async_run, train_async

    stepped = []
    real_step = Trainer.step

    def recording_step(self, batch, *a, **kw):
        stepped.append(batch)
        return real_step(self, batch, *a, **kw)

    monkeypatch.setattr(Trainer, "step", recording_step)
    over = {"task.env.name": echo_env, "task.env.max_turns": 4, "model.tiny.max_positions": 160,
            "sampler.max_new_tokens": 8, "sft_warmup.steps": 0, "loop.steps": 2, "eval.before": False,
            "eval.after": False, "sampler.share_weights": "never", "algorithm.advantage": "otb_tir"}

    def records(name, prepare, train):
        run = prepare(tiny_cfg(tmp_path, **{"run.name": name, **over}), console=False)
        # stop on common characters too, so that random-weight turns end and episodes reach 2+ turns
        run.sampler.eos_ids = sorted(set(run.sampler.eos_ids) | set(run.tokenizer("abcdefghijklm")["input_ids"]))
        try:
            train(run)
        finally:
            run.close()
        return read_jsonl(tmp_path / name / "metrics.jsonl")

    sync = records("sync", prepare_run, lambda run: run_loop(run, build_sync_source(run)))
    assert len(stepped) == 2 and all(r["task/turns"] > 1.5 for r in sync)
    for emulate in (True, False):
        stepped.clear()
        name = "async-serial" if emulate else "async-thread"
        acfg = AsyncLoopConfig(max_staleness_steps=0, emulate=emulate, local_backend="thread")
        got = records(name, prepare_async_run, lambda run, acfg=acfg: train_async(run, acfg=acfg))
        assert _comparable(got) == _comparable(sync), name
        assert all(r["async/staleness_max"] == 0 for r in got)
        assert len(stepped) == 2
        for b in stepped:
            env_tok = (b.response_mask > 0) & (b.loss_mask == 0)
            assert env_tok.any() and torch.all(b.sampler_logprobs[env_tok] == 0)


# slow (~9 s): the process pool keeps its default tests (staleness 0, restarts, agents, reward errors)
@pytest.mark.slow
def test_process_pool_runs_episodes(tmp_path):
    """The process pool's worker builds the task with its environment from the config (the tiny `add` preset):
    at staleness 0 the run equals the sync loop's episodes."""
    from covrl.train.asyncrl.config import AsyncLoopConfig
    from covrl.train.asyncrl.source import prepare_async_run, train_async

    over = {"task.env.name": "add", "task.env.max_turns": 2, "model.tiny.max_positions": 160,
            "sampler.max_new_tokens": 8, "sft_warmup.steps": 0, "loop.steps": 2, "eval.before": False,
            "eval.after": False, "sampler.share_weights": "never"}
    sync_run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "sync", **over}), console=False)
    run_loop(sync_run, build_sync_source(sync_run))
    sync_run.close()
    run = prepare_async_run(tiny_cfg(tmp_path, **{"run.name": "process", **over}), console=False)
    try:
        train_async(run, acfg=AsyncLoopConfig(max_staleness_steps=0, local_backend="process"))
    finally:
        run.close()
    records = read_jsonl(tmp_path / "process" / "metrics.jsonl")
    assert len(records) == 2 and all("task/turns" in r for r in records)
    assert _comparable(records) == _comparable(read_jsonl(tmp_path / "sync" / "metrics.jsonl"))


class Coin:
    """Ends every episode at its first message; reward 1 when the message has an even length (varied groups)."""

    tools: list = []

    def reset(self, example):
        return [{"role": "user", "content": example.plain_prompt}]

    def step(self, text):
        return EnvStep(done=True, reward=float(len(text) % 2 == 0))


def test_dynamic_sampling_with_episodes_keeps_only_groups_with_contrast(tmp_path, monkeypatch):
    """DAPO's dynamic sampling on multi-turn episodes: every trained group has unequal rewards, the model-token
    mask travels with the kept rows, and both data clocks are counted."""
    from covrl.train.run.sources import DynamicSamplingSource

    monkeypatch.setitem(environments.ENVIRONMENTS, "coin", lambda task, cfg: lambda: Coin())
    run = _run(tmp_path, "coin", **{"run.name": "dyn", "loop.steps": 3, "loop.dynamic_sampling": True,
                                    "eval.before": False, "eval.after": False, "algorithm.advantage": "grpo"})
    run.sampler.eos_ids = sorted(set(run.sampler.eos_ids) | set(run.tokenizer("abcdefghijklm")["input_ids"]))
    source = build_sync_source(run)
    assert isinstance(source, DynamicSamplingSource)
    trained = []
    step = run.trainer.step
    run.trainer.step = lambda b: (trained.append(b), step(b))[1]
    summary = run_loop(run, source)
    run.close()
    assert summary["status"] == "completed" and len(trained) == 3
    for batch in trained:
        rewards = batch.sequence_rewards.view(-1, 4)
        assert ((rewards.max(1).values - rewards.min(1).values) > 0).all()
        assert batch.loss_mask is not None
    records = read_jsonl(tmp_path / "dyn" / "metrics.jsonl")
    assert records[-1]["dynamic/generated_rollouts"] >= records[-1]["dynamic/trained_rollouts"]
