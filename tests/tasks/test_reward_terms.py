"""Reward functions in TRL's signature, weighted reward terms each logged, and a reward that keeps failing
stopping the run with its own traceback (instead of training at reward 0 to the end)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from covrl.tasks import RewardFunctionError, TaskConfig, build_task
from covrl.tasks.rewards import detect_signature

REPO = Path(__file__).resolve().parents[2]

USER_REWARDS = textwrap.dedent('''
    calls = []

    def trl_len(completions, **kwargs):
        calls.append(sorted(kwargs))
        return [float(len(c)) for c in completions]

    def trl_match(prompts, completions, solution, level):
        # no **kwargs: gets only the columns it names; `solution` is the answer field, `level` a row field
        return [1.0 + lv if c.strip() == s else None for c, s, lv in zip(completions, solution, level)]

    def trl_wrong_length(completions, **kwargs):
        return [1.0]

    def trl_crash(completions, **kwargs):
        raise KeyError("no such column")

    def row_crash(completion, example):
        raise RuntimeError("boom from the user")

    def row_flaky(completion, example):
        if "x" in completion:
            raise ValueError("flaky")
        return 1.0
''')


@pytest.fixture()
def rewards_file(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return path


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"question": f"q{i}", "solution": str(i), "level": i % 3} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def jsonl_task(data_file, **options):
    return build_task(TaskConfig(name="jsonl", path=str(data_file), prompt_field="question", answer_field="solution",
                                 n_train=8, n_eval=2, **options))


def test_signature_detection():
    def covrl_style(completion, example):
        return 0.0

    def trl_style(completions, **kwargs):
        return []

    def neither(x):
        return 0.0

    assert detect_signature(covrl_style, "a") == "covrl"
    assert detect_signature(trl_style, "b") == "trl"
    with pytest.raises(ValueError, match="task.reward_signature"):
        detect_signature(neither, "c:neither")


def test_trl_reward_gets_the_batch_with_the_dataset_columns(rewards_file, data_file):
    task = jsonl_task(data_file, reward=f"{rewards_file}:trl_len")
    ex = task.train[:3]
    out = task.score(["a", "bb", "ccc"], ex)
    assert out.rewards == [1.0, 2.0, 3.0] and out.errors == 0
    # the TRL convention: prompts + every dataset column by its field name (the answer field included)
    assert task._reward.fn.__globals__["calls"][-1] == ["level", "prompts", "solution"]


def test_trl_reward_without_kwargs_gets_only_its_columns_and_none_counts_zero(rewards_file, data_file):
    task = jsonl_task(data_file, reward=f"{rewards_file}:trl_match")
    ex = task.train[:2]
    out = task.score([ex[0].answer, "wrong"], ex)
    assert out.rewards == [1.0 + ex[0].meta["level"], 0.0] and out.errors == 0


@pytest.mark.parametrize("fn, pattern", [("trl_wrong_length", "returned 1 values for 3 completions"),
                                         ("trl_crash", "KeyError")])
def test_a_failing_trl_call_fails_the_batch(rewards_file, data_file, fn, pattern):
    task = jsonl_task(data_file, reward=f"{rewards_file}:{fn}")
    out = task.score(["a", "b", "c"], task.train[:3])
    assert out.rewards == [0.0] * 3 and out.errors == 3
    raising = jsonl_task(data_file, reward=f"{rewards_file}:{fn}", reward_errors="raise")
    with pytest.raises(RewardFunctionError, match=pattern):
        raising.score(["a", "b", "c"], raising.train[:3])


def test_weighted_terms_sum_and_are_each_logged(rewards_file, data_file):
    task = jsonl_task(data_file, rewards=[{"fn": "exact_match"},
                                          {"fn": f"{rewards_file}:trl_len", "weight": 0.5, "name": "length"},
                                          {"fn": f"{rewards_file}:row_flaky", "weight": -1.0}])
    ex = task.train[:2]
    out = task.score([ex[0].answer, "xx"], ex)
    assert out.rewards == [1.0 + 0.5 * len(ex[0].answer) - 1.0, 0.0 + 0.5 * 2 + 0.0]
    assert out.errors == 1
    m = out.metrics
    assert m["reward/reward/exact_match"] == 0.5 and m["reward/reward/length"] == (len(ex[0].answer) + 2) / 2
    assert m["reward/reward/row_flaky"] == 0.5 and m["reward/errors/row_flaky"] == 1.0
    assert m["reward/errors/length"] == 0.0 and m["reward/mean"] == sum(out.rewards) / 2
    assert "exact_match" in task.reward_name and "0.5*length" in task.reward_name


@pytest.mark.parametrize("fields, pattern", [
    ({"reward": "a.py:f", "rewards": [{"fn": "exact_match"}]}, "both set"),
    ({"rewards": [{"fn": "exact_match"}, {"fn": "exact_match"}]}, "distinct"),
    ({"rewards": [{"fn": "exact_match", "weight": True}]}, "weight"),
    ({"rewards": [{"fn": "exact_match", "wieght": 2}]}, "wieght"),
    ({"max_consecutive_reward_errors": 0}, "max_consecutive_reward_errors"),
])
def test_reward_config_errors(fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        TaskConfig(**fields)


@pytest.mark.parametrize("fn", ["row_crash", "trl_crash"])
def test_a_reward_that_always_fails_stops_with_its_own_traceback(rewards_file, data_file, fn):
    task = jsonl_task(data_file, reward=f"{rewards_file}:{fn}", max_consecutive_reward_errors=3)
    ex = task.train[:2]
    for _ in range(2):
        assert task.score(["a", "b"], ex).errors == 2
    with pytest.raises(RewardFunctionError) as info:
        task.score(["a", "b"], ex)
    text = str(info.value)
    assert "3 batches in a row" in text and "task.max_consecutive_reward_errors=3" in text
    assert "Traceback (most recent call last)" in text and "user_rewards.py" in text
    assert ("RuntimeError: boom from the user" if fn == "row_crash" else "KeyError: 'no such column'") in text


def test_partial_failures_reset_the_count_and_none_never_stops(rewards_file, data_file):
    task = jsonl_task(data_file, reward=f"{rewards_file}:row_flaky", max_consecutive_reward_errors=2)
    ex = task.train[:2]
    for _ in range(5):   # one of two completions fails each time: never every completion of a batch
        assert task.score(["x", "ok"], ex).errors == 1
    assert task.score(["x", "x"], ex).errors == 2
    assert task.score(["ok", "ok"], ex).errors == 0   # a success resets
    assert task.score(["x", "x"], ex).errors == 2
    with pytest.raises(RewardFunctionError, match="flaky"):
        task.score(["x", "x"], ex)
    never = jsonl_task(data_file, reward=f"{rewards_file}:row_crash", max_consecutive_reward_errors=None)
    for _ in range(10):
        assert never.score(["a"], ex[:1]).errors == 1


def test_process_isolation_shows_the_remote_traceback(rewards_file, data_file):
    task = jsonl_task(data_file, reward=f"{rewards_file}:row_crash", max_consecutive_reward_errors=1,
                      reward_isolation="process", reward_timeout_s=60)
    try:
        with pytest.raises(RewardFunctionError) as info:
            task.score(["a"], task.train[:1])
    finally:
        task.close()
    assert "Traceback (most recent call last)" in str(info.value) and "boom from the user" in str(info.value)


def test_run_stops_with_exit_2_and_the_traceback(tmp_path, rewards_file, capsys):
    """End to end on the tiny model: the run stops at the second batch with exit code 2 and summary.json
    'failed' whose reason holds the user function's exception."""
    import torch

    from covrl.config import load_config
    from covrl.train.launch.modes import train_from_config

    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"run.output_dir={tmp_path}", "run.name=stops", "loop.steps=6", "loop.prompts_per_step=2",
        "loop.group_size=2", "sft_warmup.steps=0", "eval.before=false", "eval.after=false",
        "logging.curves=false", "logging.console=false", "logging.progress_bar=false", "logging.diagnostics=false",
        "task.n_train=16", "task.n_eval=4", "checkpoint.at_end=false", f"task.reward={rewards_file}:row_crash",
        "task.max_consecutive_reward_errors=2"])
    assert train_from_config(cfg) == 2
    summary = json.loads((tmp_path / "stops" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 2
    assert "boom from the user" in summary["reason"]
    printed = capsys.readouterr()
    assert "Traceback (most recent call last)" in printed.out + printed.err
    records = [json.loads(line) for line in (tmp_path / "stops" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) <= 1 and all(r["task/errors"] == 4.0 for r in records)
