"""DAPO pieces: dynamic sampling (DynamicSamplingSource: kept / generated counts, the attempt cap, exact resume),
the soft overlong penalty, and pass@k evaluation (unbiased estimator vs brute force)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from train_helpers import comparable, tiny_cfg

from covrl.math import constant_groups
from covrl.rollout.types import RolloutBatch
from covrl.tasks import Example, TaskConfig, build_task
from covrl.tasks.rewards import overlong_penalty
from covrl.train.run.driver import train_sync
from covrl.train.run.evaluate import pass_at_k
from covrl.train.run.folder import prepare_run
from covrl.train.run.sinks import read_jsonl
from covrl.train.run.sources import DynamicSamplingError

torch.set_num_threads(1)
DYN = {"loop.dynamic_sampling": True, "sampler.temperature": 1.0, "eval.sampled": False}


def test_constant_groups():
    rows = 6
    batch = RolloutBatch(prompt_ids=torch.zeros(rows, 1, dtype=torch.long), prompt_mask=torch.ones(rows, 1),
                         response_ids=torch.zeros(rows, 2, dtype=torch.long), response_mask=torch.ones(rows, 2),
                         sampler_logprobs=torch.zeros(rows, 2), group_ids=torch.arange(3).repeat_interleave(2),
                         policy_version=torch.zeros(rows, dtype=torch.long))
    def same(rewards):   # what dynamic sampling drops: groups whose sequence rewards are all equal
        scored = batch.scored(rewards)
        return constant_groups(scored.sequence_rewards, scored.group_ids, 3).tolist()

    assert same(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])) == [True, False, True]
    per_token = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.0]])
    assert same(per_token) == [True, False, False]   # sequence sums


def test_dynamic_sampling_keeps_only_varied_groups_and_counts_both_clocks(tmp_path):
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "dyn", **DYN}), console=False)
    summary = train_sync(run)
    run.close()
    records = read_jsonl(tmp_path / "dyn" / "metrics.jsonl")
    assert len(records) == 3
    trained = 0
    for r in records:
        kept = r["dynamic/kept_groups"]
        assert r["zero_variance_groups"] == 0.0          # the trainer never sees a constant group
        assert 1 <= kept <= 4 and r["dynamic/rounds"] >= 1
        trained += kept * 4
        assert r["dynamic/trained_rollouts"] == trained == r["rollouts"]
        assert r["dynamic/generated_rollouts"] >= r["dynamic/trained_rollouts"]
    last = records[-1]
    generated_groups = last["dynamic/generated_rollouts"] / 4
    assert generated_groups == sum(r["dynamic/kept_groups"] + r["dynamic/dropped_groups"] for r in records)
    assert summary["dynamic_sampling"]["generated_rollouts"] == last["dynamic/generated_rollouts"]


def test_dynamic_sampling_resumes_exactly(tmp_path):
    over = {"loop.steps": 4, "eval.before": False, **DYN}
    straight = prepare_run(tiny_cfg(tmp_path, **{"run.name": "straight", **over}), console=False)
    train_sync(straight)
    straight.close()
    first = prepare_run(tiny_cfg(tmp_path, **{"run.name": "split", **over}), console=False)
    train_sync(first, stop_after=2)
    first.close()
    resumed = prepare_run(tiny_cfg(tmp_path, **{"run.name": "split", **over}), resume=True, console=False)
    train_sync(resumed)
    resumed.close()
    a = comparable(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))
    b = comparable(read_jsonl(tmp_path / "split" / "metrics.jsonl"))
    assert len(a) == len(b) == 4 and a == b
    for (ka, va), (kb, vb) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


def test_dynamic_sampling_cap_stops_a_constant_task(tmp_path):
    """Every reward 0 (weight 0): no group is ever kept; the cap ends the run with a clear error, exit code 2."""
    from covrl.train.launch.modes import train_from_config

    cfg = tiny_cfg(tmp_path, **{"run.name": "const", **DYN, "loop.dynamic_sampling_max_rounds": 3,
                                "eval.before": False, "task.rewards": [{"fn": "last_number", "weight": 0.0}]})
    run = prepare_run(cfg, console=False)
    with pytest.raises(DynamicSamplingError, match="kept no group in 3 rounds"):
        train_sync(run)
    run.close()
    cfg = tiny_cfg(tmp_path, **{"run.name": "const-cli", **DYN, "loop.dynamic_sampling_max_rounds": 2,
                                "eval.before": False, "task.rewards": [{"fn": "last_number", "weight": 0.0}]})
    assert train_from_config(cfg) == 2
    summary = json.loads((tmp_path / "const-cli" / "summary.json").read_text())
    assert summary["status"] == "failed" and "dynamic sampling kept no group" in summary["reason"]


def test_dynamic_sampling_is_accepted_by_the_async_loops():
    assert tiny_cfg(None, **{"loop.dynamic_sampling": True, "loop.mode": "async"}).loop.dynamic_sampling


# ------------------------------------------------------------------------------------------ overlong

def test_overlong_penalty_hand_cases():
    assert overlong_penalty(10, 16, 4) == 0.0 and overlong_penalty(12, 16, 4) == 0.0
    assert overlong_penalty(13, 16, 4) == -0.25 and overlong_penalty(14, 16, 4, penalty=2.0) == -1.0
    assert overlong_penalty(16, 16, 4) == -1.0 and overlong_penalty(40, 16, 4) == -1.0
    assert overlong_penalty(16, 16, 0) == 0.0
    for length in range(0, 20):   # DAPO's formula written out
        expected = 0.0 if length <= 12 else ((12 - length) / 4 if length <= 16 else -1.0)
        assert math.isclose(overlong_penalty(length, 16, 4), expected)


def test_overlong_shaping_in_task_score_and_config():
    task = build_task(TaskConfig(n_eval=2, n_train=4, overlong_reward={"buffer": 4, "max_tokens": 8}))
    ex = Example("Compute 1+1.", "2")
    out = task.score(["2", "2", "3"], [ex] * 3, lengths=[4, 6, 8])
    assert out.rewards == [1.0, 0.5, -1.0] and out.correct == [True, True, False]
    assert out.metrics["reward/overlong_frac"] == pytest.approx(2 / 3)
    cfg = tiny_cfg(None, **{"task.overlong_reward.buffer": 2, "sampler.max_new_tokens": 4})
    assert cfg.task.overlong_reward.max_tokens is None   # validators do not fill values in
    budgeted = build_task(cfg.task.model_copy(update={"n_eval": 2, "n_train": 4}), response_budget=4)
    out = budgeted.score(["2", "2"], [ex] * 2, lengths=[2, 4])   # the sampler's budget by default
    assert out.rewards == [1.0, 0.0]   # 1 + the full penalty -1 at the budget
    with pytest.raises(ValueError, match="overlong_reward.max_tokens is unset"):
        build_task(cfg.task.model_copy(update={"n_eval": 2, "n_train": 4})).score(["2"], [ex], lengths=[2])
    with pytest.raises(Exception, match="exceeds the response budget"):
        tiny_cfg(None, **{"task.overlong_reward.buffer": 9, "sampler.max_new_tokens": 4})


def test_overlong_run_logs_the_penalty(tmp_path):
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "ol", "task.overlong_reward.buffer": 2,
                                            "eval.before": False}), console=False)
    train_sync(run)
    run.close()
    records = read_jsonl(tmp_path / "ol" / "metrics.jsonl")
    assert all("task/overlong_penalty" in r and r["task/overlong_penalty"] <= 0 for r in records)


# ------------------------------------------------------------------------------------------- pass@k

def brute_pass_at_k(n, c, k):
    """Fraction of k-subsets of n samples (c correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0 and pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)    # 1 - C(3,2)/C(4,2) = 1 - 3/6
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_eval_reports_pass_at_k(tmp_path):
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "pk", "eval.pass_at_k": 2, "eval.pass_at_k_samples": 4,
                                            "loop.steps": 1}), console=False)
    summary = train_sync(run)
    run.close()
    evals = json.loads((tmp_path / "pk" / "eval.json").read_text())["evals"]
    for e in evals:
        pk = e["pass@k"]
        assert pk["k"] == 2 and pk["n"] == 4 and len(pk["correct_counts"]) == 4
        expected = sum(pass_at_k(4, c, 2) for c in pk["correct_counts"]) / 4
        assert pk["pass@k"] == pytest.approx(expected) and pk["pass@k"] >= pk["pass@1"]
    assert summary["eval_after"]["k"] == 2
    with pytest.raises(Exception, match="pass_at_k_samples"):
        tiny_cfg(None, **{"eval.pass_at_k": 4, "eval.pass_at_k_samples": 2})
