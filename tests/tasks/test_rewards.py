"""Reward functions (hand cases), user reward loading, exception isolation and timeouts."""

import time

import pytest

from covrl.tasks import (
    Example,
    RewardFunctionError,
    TaskConfig,
    build_task,
    load_user_reward,
    parse_last_number,
)
from covrl.tasks.rewards import REWARDS

EX12 = Example(prompt="Compute 7+5. Answer with just the number.", answer="12")
EXNEG = Example(prompt="Compute 3-7. Answer with just the number.", answer="-4")


@pytest.mark.parametrize("text,value", [
    ("12", 12.0), ("7+5=12", 12.0), ("The answer is 12.", 12.0), ("12 apples, no 13", 13.0),
    ("it is -4", -4.0), ("3-7=-4", -4.0), ("10-4", 4.0), ("(2)-3", 3.0), ("1,000", 1000.0),
    ("x = 2.5", 2.5), ("no number here", None), ("", None), ("-", None),
])
def test_parse_last_number(text, value):
    assert parse_last_number(text) == value


@pytest.mark.parametrize("completion,reward", [
    ("12", 1.0), (" 12\n", 1.0), ("7+5=12", 1.0), ("The answer is 12. Done", 1.0), ("12.0", 1.0),
    ("13", 0.0), ("12 or 13", 0.0), ("", 0.0), ("twelve", 0.0), ("-12", 0.0),
])
def test_last_number_reward(completion, reward):
    assert REWARDS["last_number"](completion, EX12) == reward


def test_last_number_negative_answers():
    assert REWARDS["last_number"]("3-7=-4", EXNEG) == 1.0
    assert REWARDS["last_number"]("4", EXNEG) == 0.0
    assert REWARDS["last_number"]("minus: -4", EXNEG) == 1.0


def test_exact_match_and_format():
    ex = Example(prompt="sort", answer="abc")
    assert REWARDS["exact_match"](" abc\n", ex) == 1.0
    assert REWARDS["exact_match"]("ab c", ex) == 0.0
    assert REWARDS["format"]("12", EX12) == 1.0 and REWARDS["format"]("13", EX12) == 1.0
    assert REWARDS["format"]("It is 12", EX12) == 0.0 and REWARDS["format"]("", EX12) == 0.0
    assert REWARDS["last_number_format"]("12", EX12) == 1.0
    assert REWARDS["last_number_format"]("It is 12", EX12) == pytest.approx(0.9)
    assert REWARDS["last_number_format"]("It is 13", EX12) == pytest.approx(-0.1)


USER_REWARDS = '''
import time

def length_reward(completion, example):
    return float(len(completion))

def flaky(completion, example):
    if completion == "boom":
        raise RuntimeError("user code failed")
    if completion == "nan":
        return float("nan")
    return 1.0

def hang(completion, example):
    if completion == "hang":
        time.sleep(30)
    return 1.0

not_callable = 3
'''


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def _task(**kw):
    return build_task(TaskConfig(n_train=5, n_eval=5, **kw))


def test_user_reward_from_file_and_module(user_file, monkeypatch):
    task = _task(reward=f"{user_file}:length_reward")
    out = task.score(["abc", ""], task.train[:2])
    assert out.rewards == [3.0, 0.0] and out.errors == 0
    monkeypatch.syspath_prepend(str(user_file.parent))
    fn = load_user_reward("my_rewards:length_reward")
    assert fn("abcd", EX12) == 4.0


@pytest.mark.parametrize("spec,match", [
    ("no_colon", "expected"), ("missing_file.py:f", "does not exist"),
    ("covrl_no_such_module_xyz:f", "no module named 'covrl_no_such_module_xyz'"), ("{file}:not_callable", "no callable"),
    ("{file}:absent", "defines no function 'absent'; it defines: "),
])
def test_user_reward_spec_errors(user_file, spec, match):
    with pytest.raises((ValueError, FileNotFoundError, ImportError, AttributeError), match=match):
        load_user_reward(spec.format(file=user_file))


def test_raising_reward_counts_as_zero_or_raises(user_file):
    task = _task(reward=f"{user_file}:flaky")
    out = task.score(["ok", "boom", "nan", "ok"], task.train[:4])
    assert out.rewards == [1.0, 0.0, 0.0, 1.0]
    assert out.errors == 2 and out.metrics["reward/errors"] == 2.0
    strict = _task(reward=f"{user_file}:flaky", reward_errors="raise")
    with pytest.raises(RewardFunctionError, match="completion 1"):
        strict.score(["ok", "boom"], strict.train[:2])


def test_hanging_reward_is_cut_by_timeout(user_file):
    task = _task(reward=f"{user_file}:hang", reward_timeout_s=0.2)
    t0 = time.perf_counter()
    out = task.score(["ok", "hang", "ok"], task.train[:3])
    assert time.perf_counter() - t0 < 5.0  # bounded by the timeout, not the 30 s sleep
    assert out.rewards == [1.0, 0.0, 1.0]
    assert out.errors == 1 and out.metrics["reward/timeouts"] == 1.0


def test_score_correct_uses_grader_and_counts_empty():
    task = _task(reward="format")
    ex = task.train[0]
    right = ex.answer
    out = task.score([right, f"It is {right}", ""], [ex, ex, ex])
    assert out.rewards == [1.0, 0.0, 0.0]  # the optimised reward is the format
    assert out.correct == [True, True, False]  # accuracy is the task's grader (last number)
    assert out.metrics["reward/empty"] == 1.0
    assert out.metrics["reward/accuracy"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="2 completions but 1 examples"):
        task.score(["a", "b"], [ex])


def test_unknown_reward_name():
    with pytest.raises(ValueError, match="not registered"):
        _task(reward="nope")


def test_process_isolation_survives_crash_hang_and_exit(user_file):
    with open(user_file, "a") as f:
        f.write("\nimport os\n\ndef hard_exit(completion, example):\n"
                "    if completion == 'exit':\n        os._exit(3)\n    if completion == 'hang':\n"
                "        time.sleep(30)\n    if completion == 'boom':\n        raise SystemExit(1)\n"
                "    return float(len(completion))\n")
    task = _task(reward=f"{user_file}:hard_exit", reward_isolation="process", reward_timeout_s=1.0)
    try:
        out = task.score(["ab", "exit", "abc", "hang", "boom", "a"], task.train[:5] + task.train[:1])
        assert out.rewards == [2.0, 0.0, 3.0, 0.0, 0.0, 1.0]
        assert out.errors == 3 and out.metrics["reward/timeouts"] == 1.0
    finally:
        task.close()
