"""`python -m studies suite`: the task registry (each task a task-only override of the default run), the shipped JSONL
task and its user reward file, the per-(task, seed, side) JSONs, resuming, and the summary's numbers (censored
medians, ratios) checked against the JSONs. The workers are faked in the fast tests (the alternation itself is
time_to_accuracy's, tested in test_benches.py); one slow test runs both real sides on the tiny model."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest
from studies.common import TYPED_DEFAULT_SIZES
from studies.suite import suite
from studies.suite.suite_tasks import DEFAULT_TASKS, LARGER_JSONL, larger_records

from covrl.config import load_preset
from covrl.tasks import build_task
from covrl.tasks.base import Example
from studies import COMMANDS


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    suite.configure(parser)
    return parser.parse_args(list(argv))


def test_registered_and_default_suite_excludes_one_digit_addition():
    assert COMMANDS["suite"] == "studies.suite.suite"
    assert len(DEFAULT_TASKS) >= 4
    # the study was registered against the default of its time: the sizes it typed (now auto in the file)
    default = load_preset("default", TYPED_DEFAULT_SIZES)
    for name in DEFAULT_TASKS:
        cfg = suite.task_config(name, 3, quick=False, cache="unused")
        # the covrl side is that default run: only the task section and the seed differ
        for section in type(cfg).model_fields:
            if section not in ("task", "run"):
                assert getattr(cfg, section) == getattr(default, section), (name, section)
        assert cfg.run.model_copy(update={"seed": 0}) == default.run and cfg.run.seed == 3
        assert cfg.task != default.task, name
        a = cfg.task.arithmetic
        assert not (cfg.task.name == "arithmetic" and a.ops == ["+"] and a.digits == 1), name
        task = build_task(cfg.task)
        assert len(task.eval) == 50 and not {e.prompt for e in task.eval} & {e.prompt for e in task.train}


def test_larger_jsonl_is_the_generated_one_and_graded_by_its_user_reward():
    assert LARGER_JSONL.read_text().splitlines() == [json.dumps(r) for r in larger_records()]
    task = build_task(suite.task_config("larger", 0, quick=False, cache="unused").task)
    assert task.reward_name.endswith("suite_reward.py:first_number") and task.grader_name == "last_number"
    ex = Example(prompt="Which number is larger, 47 or 74? Reply with that number only.", answer="74")
    scored = task.score(["74", "47 or 74: 74", "74 is larger than 47", "none"], [ex] * 4)
    assert list(scored.rewards) == [1.0, 0.0, 1.0, 0.0]      # the first number counts
    assert list(scored.correct) == [True, True, False, False]  # the grader reads the last


@pytest.mark.parametrize(("times", "median"), [
    ([10.0, 30.0, 20.0], 20.0), ([10.0, None, 30.0], 30.0), ([None, 10.0, None], None),
    ([10.0, 20.0], 15.0), ([10.0, None], None), ([], None), ([5.0], 5.0),
])
def test_median_time_censors_unreached_runs_above_reached(times, median):
    assert suite.median_time(times) == median


def fake_alternating(calls: list):
    """run_alternating's result without workers: covrl reaches accuracy 0.9 at 40 s (seed 0: 60 s) and ends at
    0.95; TRL reaches 0.9 only with seed 2 (at 100 s) and ends at 0.6 + 0.1*seed; every side trains to 120 s."""

    def fake(per_side, sides, timeout_s, progress=None):
        calls.append((per_side[sides[0]].task["name"], per_side[sides[0]].seed, tuple(sides)))
        seed = per_side[sides[0]].seed
        curves = {"covrl": [(20.0, 0.5), (40.0 if seed else 50.0, 0.7 if seed == 0 else 0.9), (60.0, 0.9),
                            (120.0, 0.95)],
                  "trl": [(20.0, 0.4), (60.0, 0.5), (100.0, 0.9 if seed == 2 else 0.55), (120.0, 0.6 + 0.1 * seed)]}
        all_records, ready, summary = {}, {}, {}
        for side in sides:
            all_records[side] = [{"train_clock_s": t, "accuracy": a, "step": i, "step_time": 1.0, "load1": 2.0}
                                 for i, (t, a) in enumerate(curves[side])]
            ready[side] = {"ready": True, "accuracy_before": 0.3}
            summary[side] = {"steps": 4}
        return {"ready": ready, "all_records": all_records, "records": all_records, "summary": summary}

    return fake


def test_suite_writes_one_json_per_run_resumes_and_summarises_them(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(suite, "run_alternating", fake_alternating(calls))
    out = tmp_path / "out"
    argv = ("--quick", "--tasks", "mul1,larger", "--seeds", "0,1,2", "--out", str(out),
            "--cache-dir", str(tmp_path / "cache"))
    assert suite.run(parse(*argv)) == 0
    assert calls == [(t, s, ("covrl", "trl")) for t in ("arithmetic", "jsonl") for s in (0, 1, 2)]
    files = sorted(p.name for p in out.glob("*.json") if p.name != "suite-summary.json")
    assert files == sorted(f"{t}-seed{s}-{side}.json" for t in ("mul1", "larger") for s in (0, 1, 2)
                           for side in ("covrl", "trl"))
    payload = json.loads((out / "mul1-seed1-trl.json").read_text())
    assert payload["task"] == "mul1" and payload["seed"] == 1 and payload["side"] == "trl"
    assert payload["settings"]["stop_at_target"] is False and payload["result"]["final_accuracy"] == 0.7

    # resume: nothing left to run; a missing side is run alone
    calls.clear()
    assert suite.run(parse(*argv)) == 0
    assert calls == []
    (out / "larger-seed2-covrl.json").unlink()
    assert suite.run(parse(*argv)) == 0
    assert calls == [("jsonl", 2, ("covrl",))]
    calls.clear()   # stored runs made with other settings are not mixed into one table
    assert suite.run(parse(*argv, "--target", "0.8")) == 2
    assert calls == []

    # the summary's numbers from the JSONs
    summary = json.loads((out / "suite-summary.json").read_text())
    for task in ("mul1", "larger"):
        res = {(side, s): json.loads((out / f"{task}-seed{s}-{side}.json").read_text())["result"]
               for side in ("covrl", "trl") for s in (0, 1, 2)}
        for side in ("covrl", "trl"):
            finals = [res[side, s]["final_accuracy"] for s in (0, 1, 2)]
            got = summary[task]["sides"][side]
            assert (got["final_min"], got["final_median"], got["final_max"]) == (
                min(finals), statistics.median(finals), max(finals))
            assert got["accuracy_before"] == 0.3
        c, t = summary[task]["sides"]["covrl"], summary[task]["sides"]["trl"]
        assert c["reached"] == 3 and c["median_time_to_target_s"] == 40.0   # 60 (seed 0), 40, 40
        assert t["reached"] == 1 and t["median_time_to_target_s"] is None   # 2 of 3 censored
        assert summary[task]["time_ratio"] is None
        assert summary[task]["time_ratio_upper_bound"] == pytest.approx(40.0 / 120.0)
        assert summary[task]["final_ratio"] == pytest.approx(0.95 / 0.7)
        assert summary[task]["covrl_final_ge_trl"] is True
    table = (out / "suite.md").read_text()
    assert "| trl | 0,1,2 | 30% | 60% / 70% / 80% | 1/3 | > 0 | 120 |" in table
    assert "| covrl | 0,1,2 | 30% | 95% / 95% / 95% | 3/3 | 40 | 120 |" in table
    assert "**< 0.33**" in table and "**1.36**" in table


def test_covrl_set_changes_only_the_covrl_side_and_its_run_key(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(suite, "run_alternating", fake_alternating(calls))
    out = tmp_path / "out"
    base = ("--quick", "--tasks", "mul1", "--seeds", "0", "--out", str(out), "--cache-dir", str(tmp_path / "cache"))
    assert suite.run(parse(*base)) == 0
    cfg = json.loads((out / "mul1-seed0-covrl.json").read_text())["covrl_config"]
    assert cfg["loop"]["dynamic_sampling"] is False
    # a candidate default: the stored TRL run is reused, the covrl run is not (its key names the override)
    (out / "mul1-seed0-covrl.json").unlink()
    calls.clear()
    candidate = (*base, "--covrl-set", "loop.dynamic_sampling=true", "--covrl-set", "loop.dynamic_sampling_max_rounds=9")
    assert suite.run(parse(*candidate)) == 0
    assert calls == [("arithmetic", 0, ("covrl",))]
    payload = json.loads((out / "mul1-seed0-covrl.json").read_text())
    assert payload["covrl_config"]["loop"]["dynamic_sampling"] is True
    assert payload["covrl_config"]["loop"]["dynamic_sampling_max_rounds"] == 9
    assert payload["run_key"]["covrl_set"] == ["loop.dynamic_sampling=true", "loop.dynamic_sampling_max_rounds=9"]
    assert "covrl_set" not in json.loads((out / "mul1-seed0-trl.json").read_text())["run_key"]
    assert "loop.dynamic_sampling=true" in (out / "suite.md").read_text()
    assert suite.run(parse(*base)) == 2     # the covrl run made with the override is not mixed with plain ones
    # a misspelt key stops before any run, naming it
    calls.clear()
    capsys.readouterr()
    assert suite.run(parse(*base, "--out", str(tmp_path / "x"), "--covrl-set", "loop.dynamic_samplin=true")) == 2
    assert calls == [] and "dynamic_samplin" in capsys.readouterr().err
    assert suite.run(parse(*base, "--out", str(tmp_path / "x"), "--covrl-set", "loop")) == 2


def test_suite_refuses_unknown_tasks(tmp_path):
    assert suite.run(parse("--tasks", "mul1,nope", "--out", str(tmp_path))) == 2


@pytest.mark.slow
def test_suite_quick_runs_both_real_sides_and_skips_them_after(tmp_path):
    pytest.importorskip("trl")
    out, cache = tmp_path / "out", tmp_path / "cache"
    argv = ("--quick", "--seeds", "0", "--out", str(out), "--cache-dir", str(cache))
    assert suite.run(parse(*argv)) == 0
    names = [f"{t}-seed0-{side}.json" for t in ("mul1", "count_letters") for side in ("covrl", "trl")]
    stamps = {}
    summary = json.loads((out / "suite-summary.json").read_text())
    for name in names:
        payload = json.loads((out / name).read_text())
        r = payload["result"]
        assert r["steps"] == 2 and len(r["evals"]) == 2 and 0.0 <= r["final_accuracy"] <= 1.0
        assert r["accuracy_before"] is not None
        got = summary[payload["task"]]["sides"][payload["side"]]
        assert got["final_median"] == r["final_accuracy"] and got["runs"] == 1
        stamps[name] = (out / name).stat().st_mtime_ns
    assert suite.run(parse(*argv)) == 0   # every run present: nothing is re-run or rewritten
    assert {name: (out / name).stat().st_mtime_ns for name in names} == stamps


def test_run_key_is_the_same_from_another_checkout():
    # a stored run of `larger` made in another clone names the shipped JSONL by that clone's absolute path
    key = suite.run_key(parse("--tasks", "larger"), "larger", "trl")
    assert key["task_overrides"]["task.path"] == "<studies>/suite/data/suite_larger.jsonl"
    assert key["task_overrides"]["task.reward_fn"].startswith("<studies>/suite/suite_reward.py:")
    stored = json.loads(json.dumps(key).replace("<studies>/", "/elsewhere/pin7/studies/"))
    assert stored != key and suite.portable_key(stored) == key
    assert suite.portable_key({"a": ["/x/covrl/tests/y"]}) == {"a": ["/x/covrl/tests/y"]}   # only package data
