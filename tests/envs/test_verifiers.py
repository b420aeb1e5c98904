"""verifiers environments (task.name=verifiers), unchanged, trained with covrl: verifiers' own harness (null:
its chat program, in a subprocess) and interception server drive covrl's sampler through covrl's generate
endpoint. The tasksets are written in verifiers' own format (tests/envs/verifiers_toy/). Checked: the row's
prompt is covrl's own encoding of the problem, every sampled token's log q equals the trainer's fp32 forward,
environment tokens are out of the loss, the rewards are the environment's, greedy episodes are covrl's own greedy
rollouts, a run trains end to end, and a failing reward stops the run by the user-code rule."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verifiers.v1")
pytest.importorskip("renderers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_helpers import tiny_cfg  # noqa: E402

from covrl.rollout.episodes import generate_episodes, score_episodes  # noqa: E402
from covrl.tasks import FailureWatch, UserCodeError  # noqa: E402
from covrl.train.run.driver import train_sync  # noqa: E402
from covrl.train.run.folder import prepare_run  # noqa: E402
from covrl.train.step.trainer import forward_batch  # noqa: E402

TOY = Path(__file__).parent / "verifiers_toy"
pytestmark = pytest.mark.timeout(300)


def _cfg(tmp_path, taskset: str, **over):
    return tiny_cfg(tmp_path, **{"task.name": "verifiers", "task.verifiers.taskset": str(TOY / taskset),
                                 "task.chat_template": False, "task.n_train": 8, "task.n_eval": 2,
                                 "sft_warmup.steps": 0, "run.num_threads": 1, **over})


@pytest.fixture(scope="module")
def sum_run(tmp_path_factory):
    run = prepare_run(_cfg(tmp_path_factory.mktemp("vf"), "vf_toy_sum", **{"run.name": "sum"}), console=False)
    yield run
    run.close()
    run.task.environment.close()


def _episodes(run, examples, n, *, greedy=False, seed=0, failures=None):
    task = run.task
    return generate_episodes(run.sampler, run.tokenizer, task.environment, examples, n,
                             generator=torch.Generator().manual_seed(seed), chat_template=False, max_turns=4,
                             greedy=greedy, failures=task.env_failures if failures is None else failures)


def _logq_matches_the_trainer(run, batch):
    fwd = forward_batch(run.model, batch, float(run.cfg.sampler.temperature), with_stats=False)
    mask = batch.loss_mask > 0
    assert mask.any()
    assert torch.allclose(fwd.logprobs[mask], batch.sampler_logprobs[mask], atol=2e-4), \
        (fwd.logprobs[mask] - batch.sampler_logprobs[mask]).abs().max()
    assert torch.all(batch.sampler_logprobs[~mask] == 0)


def test_single_turn_rows_are_covrls_tokens_and_the_environments_rewards(sum_run):
    run, task = sum_run, sum_run.task
    examples = task.train[:2]
    out = _episodes(run, examples, 2)
    batch = out.batch
    assert batch.prompt_ids.shape[0] == 4 and batch.group_ids.tolist() == [0, 0, 1, 1]
    for i, ep in enumerate(out.episodes):
        ex = examples[i // 2]
        # the rendered prompt is covrl's own plain encoding of the problem ("3+4=")
        assert ep.prompt == task.encode(run.tokenizer, ex) and run.tokenizer.decode(ep.prompt) == ex.prompt
        assert ep.end == "done" and all(ep.model) and len(ep.tokens) <= run.cfg.sampler.max_new_tokens
        # the environment's rubric: correct (weight 1) + short (weight 0.25), on the reply it saw
        found = re.findall(r"-?\d+", ep.final_text)
        correct = float(bool(found) and found[-1] == ex.answer)
        assert ep.reward == pytest.approx(correct + 0.25 * float(len(ep.final_text.strip()) <= 2))
        assert ep.env_metrics["reward/correct"] == correct
    _logq_matches_the_trainer(run, batch)
    scored = score_episodes(task, run.tokenizer, out, examples, 2)
    assert {"task/reward/correct", "task/reward/short", "task/verifiers_multi_branch"} <= set(scored.task_metrics)
    assert torch.allclose(scored.rewards, torch.tensor([e.reward for e in out.episodes]))


def test_greedy_episodes_are_covrls_own_greedy_rollouts(sum_run):
    run, task = sum_run, sum_run.task
    examples = task.eval[:2]
    out = _episodes(run, examples, 1, greedy=True)
    own = run.sampler.generate([task.encode(run.tokenizer, ex) for ex in examples], 1,
                               generator=torch.Generator(), greedy=True)
    for j, ep in enumerate(out.episodes):
        length = int(own.response_mask[j].sum())
        assert ep.tokens == own.response_ids[j, :length].tolist()
        assert ep.logq == pytest.approx(own.sampler_logprobs[j, :length].tolist(), abs=1e-5)


def test_multi_turn_environment_tokens_are_out_of_the_loss(tmp_path):
    run = prepare_run(_cfg(tmp_path, "vf_toy_retry", **{"run.name": "retry"}), console=False)
    try:
        out = _episodes(run, run.task.train[:2], 2)
        two_turns = [ep for ep in out.episodes if 0 in ep.model]
        # the plain template closes an assistant turn with EOS as sampled: one row holds both turns
        assert all(ep.env_metrics["branches"] == 1 for ep in out.episodes)
        assert two_turns, "an episode whose first turn ends at EOS gets the second turn"
        for ep in two_turns:
            first_env = ep.model.index(0)
            reply = [t for t, m in zip(ep.tokens, ep.model) if m == 0]
            assert "again=" in run.tokenizer.decode(reply)       # the environment's user turn, in the row
            assert all(ep.model[:first_env]) and any(ep.model[first_env:])   # model, environment, model
            assert all(lq == 0.0 for lq, m in zip(ep.logq, ep.model) if m == 0)
        _logq_matches_the_trainer(run, out.batch)
        rows = [i for i, ep in enumerate(out.episodes) if ep in two_turns]
        mask = out.batch.loss_mask[rows]
        assert (mask.sum(1) < out.batch.response_mask[rows].sum(1)).all()   # replies attended to, not trained
    finally:
        run.close()
        run.task.environment.close()


class ScriptedToolUser:
    """A sampler that calls the `add` tool on a fresh problem and answers with the tool's result after it: the
    tool path without a model that has learnt the call format. Its log q is -0.5 per token."""

    def __init__(self, tok):
        from covrl.rollout import SamplerConfig

        self.tok, self.cfg = tok, SamplerConfig(max_new_tokens=64)
        self.eos_ids, self.pad_id, self.context, self.version = [tok.eos_token_id], 0, 512, 0
        self.call, self.end = tok.convert_tokens_to_ids("<tool_call>"), tok.convert_tokens_to_ids("</tool_call>")

    def generate(self, prompts, n, *, generator, policy_version=None, greedy=False):
        from covrl.rollout.types import RolloutBatch

        tok, rows = self.tok, []
        for p in prompts:
            text = tok.decode(p)
            if "<tool_call>" not in text:
                a, b = re.search(r"(\d)\+(\d)=", text).groups()
                body = json.dumps({"name": "add", "arguments": {"a": int(a), "b": int(b)}})
                rows.append([self.call, *tok(body, add_special_tokens=False)["input_ids"], self.end, tok.eos_token_id])
            else:
                rows.append([*tok(re.findall(r"\d+", text)[-1], add_special_tokens=False)["input_ids"],
                             tok.eos_token_id])
        B, T, P = len(rows), max(map(len, rows)), max(map(len, prompts))
        ids, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1.0
        return RolloutBatch(prompt_ids=torch.zeros(B, P, dtype=torch.long), prompt_mask=torch.ones(B, P),
                            response_ids=ids, response_mask=mask, sampler_logprobs=-0.5 * mask,
                            group_ids=torch.arange(B), policy_version=torch.zeros(B, dtype=torch.long))


# slow (~15-30 s): a real tool environment end to end; the multi-turn test keeps the masks in the default suite
@pytest.mark.slow
def test_tool_environment_results_are_environment_tokens():
    """A verifiers Toolset (an MCP server per rollout) and the renderer's hermes-style tool parser: the model's
    call and its final answer are in the loss, the tool's result between them is not, in one row."""
    from covrl.models.tiny import char_tokenizer
    from covrl.tasks import build_task

    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    cfg = tiny_cfg(None, **{"task.name": "verifiers", "task.verifiers.taskset": str(TOY / "vf_toy_tools"),
                            "task.chat_template": False, "task.n_train": 4, "task.n_eval": 2,
                            "task.verifiers.renderer": {"name": "default", "tool_parser": "qwen3"}})
    task = build_task(cfg.task)
    try:
        out = generate_episodes(ScriptedToolUser(tok), tok, task.environment, task.train[:2], 1,
                                generator=torch.Generator(), chat_template=False, max_turns=4,
                                failures=task.env_failures)
    finally:
        task.environment.close()
    for ep, ex in zip(out.episodes, task.train[:2]):
        assert ep.end == "done" and ep.env_metrics["branches"] == 1 and ep.reward == 1.0
        assert tok.decode(ep.prompt) == ex.prompt
        call_end = ep.tokens.index(tok.eos_token_id) + 1          # the call turn, closed by EOS
        env = [t for t, m in zip(ep.tokens, ep.model) if m == 0]
        assert tok.decode(env).strip() == ex.answer             # the tool's result: 4+3 -> "7"
        assert all(ep.model[:call_end]) and ep.model[-2:] == [1, 1] and tok.decode(ep.tokens[-2:-1]) == ex.answer
        assert all(lq == 0.0 for lq, m in zip(ep.logq, ep.model) if m == 0)
        assert all(lq == -0.5 for lq, m in zip(ep.logq, ep.model) if m == 1)


@pytest.mark.slow   # a long end-to-end run: make test-slow (the default suite stays near 10 minutes)
def test_a_verifiers_environment_trains_end_to_end(tmp_path):
    cfg = _cfg(tmp_path, "vf_toy_sum", **{"run.name": "train", "loop.steps": 2, "loop.prompts_per_step": 2,
                                          "loop.group_size": 2, "eval.max_prompts": 2, "eval.before": False})
    run = prepare_run(cfg, console=False)
    try:
        summary = train_sync(run)
    finally:
        run.close()
        run.task.environment.close()
    assert summary["status"] == "completed"
    records = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollouts"] for r in records] == [4.0, 8.0]
    assert all("task/reward/correct" in r and r["task/end_error"] == 0.0 for r in records)
    assert 0.0 <= summary["eval_after"]["greedy"] <= 1.0   # the held-out tasks, played by the environment


def test_a_failing_environment_reward_is_shown_and_stops_the_run(tmp_path, capsys):
    run = prepare_run(_cfg(tmp_path, "vf_toy_broken", **{"run.name": "broken"}), console=False)
    try:
        watch = FailureWatch("verifiers environment vf_toy_broken", unit="episodes", window=4, max_rate=0.5)
        with pytest.raises(UserCodeError, match="failed on 100% of its last 4 episodes"):
            _episodes(run, run.task.train[:2], 2, failures=watch)
        err = capsys.readouterr().err
        assert err.count("ZeroDivisionError") >= 1 and "(the first failure" in err
    finally:
        run.close()
        run.task.environment.close()


def test_config_names_the_missing_taskset():
    with pytest.raises(Exception, match="task.verifiers.taskset is required"):
        tiny_cfg(None, **{"task.name": "verifiers"})
    with pytest.raises(Exception, match="leave task.env.name unset"):
        tiny_cfg(None, **{"task.name": "verifiers", "task.verifiers.taskset": "x", "task.env.name": "add"})
