"""math-verify as a reward / grader and reasoning-gym datasets as a task (extra covrl[reasoning]; skipped when
not installed), each run end to end from `covrl train`'s entry on the tiny model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from covrl.tasks import Example, TaskConfig, build_task
from covrl.tasks.graders import extract_tagged_answer

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data" / "math_verify.jsonl"
TINY_RUN = ["sft_warmup.steps=0", "loop.steps=2", "loop.prompts_per_step=2", "loop.group_size=2",
            "eval.max_prompts=2", "logging.curves=false", "logging.console=false", "logging.progress_bar=false",
            "logging.diagnostics=false", "logging.noise_scale=false", "checkpoint.at_end=false",
            "model.tiny.max_positions=160", "task.max_prompt_tokens=140"]


def _train(tmp_path, name, overrides):
    import torch

    from covrl.config import load_config
    from covrl.train.launch.modes import train_from_config

    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs" / "tiny.yaml",
                      [f"run.output_dir={tmp_path}", f"run.name={name}", *TINY_RUN, *overrides])
    code = train_from_config(cfg)
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return code, records, json.loads((tmp_path / name / "summary.json").read_text())


def test_extract_tagged_answer():
    assert extract_tagged_answer("think <answer>1</answer> then <answer> 42 </answer>") == "42"
    assert extract_tagged_answer("  17 \n") == "17"


# ------------------------------------------------------------------------------------------- math-verify

@pytest.fixture(scope="module")
def mv():
    pytest.importorskip("math_verify")
    from covrl.tasks import graders
    return graders


@pytest.mark.parametrize("reference, completion, expected", [
    ("0.5", r"so the answer is \boxed{1/2}", 1.0),
    (r"\frac{1}{2}", "The answer is 0.5", 1.0),
    (r"\frac{1}{2}", r"$\frac{2}{4}$", 1.0),
    ("1/2", r"\boxed{\frac{1}{2}}", 1.0),
    ("12", "7+5=12", 1.0),
    ("x+1", r"\boxed{1+x}", 1.0),
    ("0.5", r"\boxed{0.6}", 0.0),                 # wrong
    (r"\frac{3}{4}", r"\boxed{\frac{4}{3}}", 0.0),  # wrong
    ("3", "no idea", 0.0),                        # nothing to parse
    ("3", r"\boxed{", 0.0),                       # unparseable LaTeX
    ("3", "", 0.0),
])
def test_math_verify_hand_cases(mv, reference, completion, expected):
    assert mv.math_verify_reward(completion, Example("q", reference)) == expected


def test_unparseable_reference_is_an_error_not_a_zero(mv):
    for reference in ("", "?!"):
        with pytest.raises(ValueError, match="cannot parse the reference"):
            mv.math_verify_reward(r"\boxed{1}", Example("q", reference))


def _jsonl_task(**over):
    return build_task(TaskConfig(name="jsonl", path=str(DATA), answer_field="solution", reward="math_verify",
                                 n_eval=4, n_train=16, **over))


def test_math_verify_jsonl_task_scores_and_grades(mv):
    task = _jsonl_task()
    assert task.grader_name == "math_verify" and task.reward_name == "math_verify"
    ex = Example("q", r"\frac{3}{4}")
    out = task.score([r"\boxed{0.75}", "3/4", r"\boxed{1}", "???"], [ex] * 4)
    assert out.rewards == [1.0, 1.0, 0.0, 0.0] and out.correct == [True, True, False, False]
    assert out.errors == 0


def test_math_verify_times_out_isolated(mv, monkeypatch):
    from covrl.tasks import rewards

    def hangs(completion, example):
        time.sleep(5)
        return 1.0

    monkeypatch.setitem(rewards.REWARDS, "math_verify", hangs)
    task = _jsonl_task(reward_timeout_s=0.2, grader="exact_match")
    t0 = time.perf_counter()
    out = task.score(["1"], [Example("q", "1")])
    assert time.perf_counter() - t0 < 2.0
    assert out.rewards == [0.0] and out.metrics["reward/timeouts"] == 1.0


def test_math_verify_in_a_process_worker(mv):
    task = _jsonl_task(reward_isolation="process", reward_timeout_s=120)
    try:
        out = task.score([r"\boxed{1/2}", "7"], [Example("q", "0.5")] * 2)
    finally:
        task.close()
    assert out.rewards == [1.0, 0.0] and out.correct == [True, False]


def test_math_verify_jsonl_run_from_the_cli_entry(mv, tmp_path):
    code, records, summary = _train(tmp_path, "mv", [
        "task.name=jsonl", f"task.path={DATA}", "task.answer_field=solution", "task.reward=math_verify",
        "task.n_eval=4", "task.n_train=16", "sampler.max_new_tokens=8"])
    assert code == 0 and summary["status"] == "completed"
    assert len(records) == 2 and all(r["task/errors"] == 0.0 for r in records)
    evals = json.loads((tmp_path / "mv" / "eval.json").read_text())["evals"]
    assert [e["label"] for e in evals] == ["before", "after"]


# ------------------------------------------------------------------------------------------ reasoning-gym

@pytest.fixture(scope="module")
def rg():
    return pytest.importorskip("reasoning_gym")


def _rg_task(**over):
    kw = dict(name="reasoning_gym", n_train=30, n_eval=10, seed=3,
              reasoning_gym={"dataset": "leg_counting", "options": {"max_animals": 3}})
    kw.update(over)
    return build_task(TaskConfig(**kw))


def test_reasoning_gym_examples_split_and_score(rg):
    task = _rg_task()
    assert len(task.train) == 30 and len(task.eval) == 10
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.eval}
    assert {e.meta["rg_index"] for e in task.eval} == set(range(10))
    assert min(e.meta["rg_index"] for e in task.train) >= 10          # disjoint generator seeds
    again = _rg_task()                                                # deterministic in task.seed
    assert [e.prompt for e in again.train] == [e.prompt for e in task.train]
    other = _rg_task(seed=4)
    assert [e.prompt for e in other.eval] != [e.prompt for e in task.eval]
    ex = task.eval[0]
    assert "legs" in ex.prompt and ex.answer.isdigit()
    wrong = str(int(ex.answer) + 1)
    out = task.score([ex.answer, f"thinking... <answer>{ex.answer}</answer>", wrong, ""], [ex] * 4)
    assert out.rewards[:2] == [1.0, 1.0] and out.rewards[2] < 1.0 and out.rewards[3] == 0.0
    assert out.correct == [True, True, False, False]
    assert task.reward_name == task.grader_name == "reasoning_gym"


def test_reasoning_gym_prompts_render_like_other_tasks(rg):
    from covrl.models.tiny import char_tokenizer

    tok = char_tokenizer()
    task = _rg_task(chat_template=False)
    ex = task.train[0]
    assert task.prompt_text(tok, ex) == ex.prompt
    assert tok.decode(task.encode(tok, ex)) .replace(" ", "") == ex.prompt.replace(" ", "")


def test_reasoning_gym_bad_options_fail_clearly(rg):
    with pytest.raises(ValueError, match="task.reasoning_gym"):
        _rg_task(reasoning_gym={"dataset": "leg_counting", "options": {"no_such_option": 1}})
    with pytest.raises(ValueError, match="task.reasoning_gym.dataset is required"):
        TaskConfig(name="reasoning_gym")


def test_reasoning_gym_scores_in_a_process_worker(rg):
    task = _rg_task(reward_isolation="process", reward_timeout_s=120)
    ex = task.eval[0]
    try:
        out = task.score([ex.answer, "0"], [ex, ex])
    finally:
        task.close()
    assert out.rewards[0] == 1.0 and out.correct == [True, False]


def test_reasoning_gym_run_from_the_cli_entry(rg, tmp_path):
    code, records, summary = _train(tmp_path, "rg", [
        "task.name=reasoning_gym", "task.reasoning_gym.dataset=basic_arithmetic",
        "task.reasoning_gym.options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
        "task.n_train=16", "task.n_eval=4"])
    assert code == 0 and summary["status"] == "completed" and summary["steps"] == 2
    assert [r["rollouts"] for r in records] == [4, 8]
    assert all(r["task/errors"] == 0.0 for r in records)
