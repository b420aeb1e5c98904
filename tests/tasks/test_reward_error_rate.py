"""A user reward that fails on most rows stops the run within a few steps, with its first traceback shown at
once; one that fails on a rare malformed row does not; TRL-style `example["answer"]` works on covrl's Example.
The case from a user's report: `m[-1]` on completions without digits short-circuited before the failing line on
a few rows per batch, so the old every-completion rule never fired and the run trained 50 steps at reward 0."""

from __future__ import annotations

import json
import textwrap

import pytest

from covrl.tasks import RewardFunctionError, TaskConfig, build_task
from covrl.tasks.base import Example

USER = textwrap.dedent('''
    import re

    def last_int(completion, example):   # as TRL's docs write rewards
        m = re.findall(r"-?\\d+", completion)
        return float(bool(m) and m[-1] == str(example["answer"]))

    def mostly_broken(completion, example):
        if completion.startswith("ok"):
            return 1.0
        return float(example.solution)   # covrl's Example has no attribute 'solution'

    def rarely_broken(completion, example):
        if completion == "malformed":
            raise ValueError("a malformed row")
        return 0.5
''')


@pytest.fixture()
def task_for(tmp_path):
    (tmp_path / "user.py").write_text(USER)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i), "level": i}) + "\n" for i in range(20)))

    def make(fn, **options):
        return build_task(TaskConfig(name="jsonl", path=str(data), reward=f"{tmp_path / 'user.py'}:{fn}",
                                     n_eval=4, **options))
    return make


def test_example_reads_like_a_data_row():
    ex = Example(prompt="p", answer="7", meta={"level": 3})
    assert ex["answer"] == "7" and ex["prompt"] == "p" and ex["level"] == 3
    with pytest.raises(KeyError, match="'prompt', 'answer', 'level'"):
        ex["solution"]


def test_the_reported_trl_style_reward_now_scores(task_for):
    task = task_for("last_int")
    ex = task.train[:4]
    out = task.score([f"it is {e.answer}" for e in ex[:2]] + ["no digits", "12"], ex)
    assert out.errors == 0 and out.rewards[:3] == [1.0, 1.0, 0.0]


def test_a_reward_failing_on_most_rows_stops_within_a_few_steps_with_its_first_traceback(task_for):
    shown = []
    task = task_for("mostly_broken", reward_error_window=64, max_reward_error_rate=0.5)
    task._terms[0][2].watch.report = shown.append      # where the first failure is shown (stderr by default)
    ex = task.train[:16]
    completions = ["ok"] + ["x"] * 15              # one success per batch of 16: the old rule never fired
    with pytest.raises(RewardFunctionError) as info:
        for _ in range(8):
            task.score(completions, ex)
    assert len(shown) == 1 and "AttributeError" in shown[0] and "example.answer" in shown[0]
    assert "Traceback (most recent call last)" in shown[0]
    text = str(info.value)
    assert "94% of its last 64 completions" in text and "task.max_reward_error_rate=0.5" in text
    assert "AttributeError" in text   # the first error's traceback comes with the stop


def test_a_rare_malformed_row_does_not_stop_the_run(task_for):
    shown = []
    task = task_for("rarely_broken")
    task._terms[0][2].watch.report = shown.append
    ex = task.train[:16]
    for _ in range(20):
        out = task.score(["malformed"] + ["fine"] * 15, ex)
        assert out.errors == 1
    assert len(shown) == 1     # shown once
