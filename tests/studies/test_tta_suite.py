"""The task suite and arms of studies/tta (the time-to-accuracy diagnosis): every suite task builds from its
overrides, holds 50 held-out prompts, and scores its own reference answer as correct (reward 1) and a wrong one as
incorrect (reward 0); the shipped JSONL is the generator's; every arm is a valid config; the per-batch measures
count what they say."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
from studies.tta.arms import ARMS, arm_overrides, batch_stats, run_config
from studies.tta.tasks import REVERSE_JSONL, TTA_TASKS, reverse_records, task_overrides

from covrl.config import load_preset
from covrl.tasks import build_task

NEEDS = {"reasoning_gym": "reasoning_gym", "verifiers": "verifiers"}


def _family_params():
    for name, t in TTA_TASKS.items():
        marks = [pytest.mark.slow] if t.family == "verifiers" else []   # imports verifiers' stack (~15 s)
        yield pytest.param(name, marks=marks, id=name)


def test_suite_covers_the_families():
    families = {t.family for t in TTA_TASKS.values()}
    assert {"arithmetic", "string", "reasoning_gym", "tool", "verifiers"} <= families
    assert len(TTA_TASKS) >= 8
    assert sum(t.family == "reasoning_gym" for t in TTA_TASKS.values()) >= 3


@pytest.mark.parametrize("name", list(_family_params()))
def test_task_scores_reference_as_correct_and_wrong_as_incorrect(name):
    module = NEEDS.get(TTA_TASKS[name].family)
    if module and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed")
    cfg = load_preset("default", task_overrides(name))
    assert cfg.sampler.max_new_tokens == TTA_TASKS[name].max_new_tokens
    task = build_task(cfg.task)
    try:
        assert len(task.eval) >= 50 and len(task.train) > 0
        ex = task.eval[0]
        out = task.score([ex.answer, "I do not know."], [ex, ex])
        assert list(out.correct) == [True, False]
        assert [float(r) for r in out.rewards] == [1.0, 0.0]
    finally:
        task.close()


def test_shipped_reverse_jsonl_is_the_generators():
    import json

    rows = [json.loads(line) for line in REVERSE_JSONL.read_text().splitlines()]
    assert rows == reverse_records()
    assert all(r["answer"] == r["prompt"].split("'")[1][::-1] for r in rows)


@pytest.mark.parametrize("arm", list(ARMS))
def test_every_arm_is_a_valid_config(arm):
    cfg = run_config("mul1", arm, seed=3)
    assert cfg.run.seed == 3 and cfg.sampler.max_new_tokens == TTA_TASKS["mul1"].max_new_tokens
    if arm == "cut_penalty":
        assert cfg.task.overlong_reward.buffer == TTA_TASKS["mul1"].max_new_tokens // 2
    if arm == "default":
        assert cfg.algorithm == load_preset("default").algorithm and cfg.optim == load_preset("default").optim
    assert set(arm_overrides("mul1", arm)) == set(ARMS[arm])


def test_batch_stats_counts_cut_constant_groups_and_variance():
    eos, budget = 0, 3
    # four rows, two groups: row 0 fills the budget without EOS (cut), row 1 ends in EOS at the budget (not cut),
    # rows 2-3 are short; group 0 rewards (1, 0), group 1 rewards (0, 0) = constant
    ids = torch.tensor([[5, 6, 7], [5, 6, eos], [5, eos, 0], [eos, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    batch = types.SimpleNamespace(response_ids=ids, response_mask=mask, group_ids=torch.tensor([0, 0, 1, 1]),
                                  rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]))
    s = batch_stats(batch, eos, budget)
    assert s["cut_rate"] == 0.25
    assert s["constant_groups"] == 0.5
    assert s["reward_var_within"] == pytest.approx((0.25 + 0.0) / 2)
    assert s["length_mean"] == pytest.approx(9 / 4)



def test_constant_answer_is_the_most_common_held_out_answer(monkeypatch):
    """studies.tta.constant_answer on a task whose held-out answers are known: the most common one and its share."""
    from studies.tta import constant_answer as ca

    held_out = [types.SimpleNamespace(answer=a) for a in [1, 1, 2, " 1", 3, 2]]
    monkeypatch.setattr(ca, "build_task", lambda cfg: types.SimpleNamespace(eval=held_out))
    assert ca.constant_answer("count_letters") == {"answer": "1", "accuracy": 0.5, "distinct_answers": 3,
                                                   "prompts": 6}
