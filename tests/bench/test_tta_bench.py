"""`covrl bench tta`: the suite module (every task's overrides build a config, the shipped-free reverse_word data is
written where asked) and the --quick run on the tiny model: the probe's sizes reach the TRL arms, every arm is
trained to the same clock and evaluated before and at the budget, and the JSON, table and plot are written under
the chosen folder. Timings are never asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from covrl.bench import BENCHES
from covrl.bench.tta_suite import REVERSE_PATH, TASKS, materialise, reverse_records


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-cache")


def test_tta_is_registered():
    assert BENCHES["tta"] == "covrl.bench.tta_bench"


@pytest.mark.parametrize("name", list(TASKS))
def test_every_suite_task_builds_a_default_config(name, tmp_path):
    from covrl.bench.tta_bench import AUTO_SIZES
    from covrl.config import load_preset

    if TASKS[name].needs:
        pytest.importorskip(TASKS[name].needs)
    overrides = materialise(name, tmp_path)
    assert REVERSE_PATH not in overrides.values()
    cfg = load_preset("default", {**overrides, "sampler.max_new_tokens": TASKS[name].max_new_tokens})
    assert cfg.sampler.max_new_tokens == TASKS[name].max_new_tokens
    auto = load_preset("default", {**overrides, **AUTO_SIZES})   # single-turn: auto is accepted
    assert auto.loop.group_size == "auto"


def test_reverse_word_data_is_written_and_distinct(tmp_path):
    path = Path(materialise("reverse_word", tmp_path)["task.path"])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == reverse_records()
    words = [r["answer"][::-1] for r in rows]
    assert len(set(words)) == len(words) and all(w != w[::-1] for w in words)
    with pytest.raises(ValueError, match="unknown suite task"):
        materialise("calculator", tmp_path)


def _run(out: Path, cache: Path, *extra: str) -> dict:
    import importlib

    module = importlib.import_module(BENCHES["tta"])
    parser = argparse.ArgumentParser()
    module.configure(parser)
    args = parser.parse_args(["--quick", "--out", str(out), "--cache-dir", str(cache), *extra])
    assert module.run(args) == 0
    files = sorted(out.glob("*/*.json"))
    assert len(files) == 1, files
    assert files[0].with_suffix(".md").is_file() and files[0].with_suffix(".png").is_file()
    payload = json.loads(files[0].read_text())
    assert payload["headline"] in (out / "README.md").read_text()
    return payload["results"]


@pytest.mark.slow
def test_tta_quick_runs_every_arm_to_the_same_clock(tmp_path, cache_dir):
    pytest.importorskip("trl")
    from covrl.bench.tta_bench import TRL_FIXED

    res = _run(tmp_path, cache_dir)
    (task,) = res["tasks"]
    probe = task["probe"]["config"]
    tokens = probe["sampler.max_new_tokens"]
    assert task["eval_max_new_tokens"] == tokens
    arms = task["arms"]
    assert list(arms) == ["covrl", "trl", "trl_sized"]
    assert arms["trl"]["shape"] == {"prompts": TRL_FIXED["n_prompts"], "group": TRL_FIXED["group_size"],
                                    "max_new_tokens": tokens}
    assert arms["trl_sized"]["shape"] == {"prompts": probe["loop.prompts_per_step"],
                                          "group": probe["loop.group_size"], "max_new_tokens": tokens}
    budget = res["settings"]["budget_s"]
    for arm in arms.values():
        assert arm["steps"] >= 1 and arm["train_clock_s"] >= budget
        assert [e["train_clock_s"] for e in arm["evals"]][-1] >= budget   # evaluated at the budget
        assert all(0.0 <= e["accuracy"] <= 1.0 for e in arm["evals"]) and len(arm["evals"]) >= 2


@pytest.mark.slow
def test_tta_quick_sizes_covrl_from_its_probe_and_fixed_keeps_the_suite_budget(tmp_path, cache_dir):
    """By default covrl's arm runs with the sizes its own probe chose (the same probe the bench ran first: same
    seed, same weights) and its clock starts at the probe's seconds; --fixed gives it the task's budget, 4 x 4."""
    res = _run(tmp_path, cache_dir, "--arms", "covrl")
    (task,) = res["tasks"]
    shape, probe = task["arms"]["covrl"]["shape"], task["probe"]["config"]
    assert (shape["prompts"], shape["group"], shape["max_new_tokens"]) == (
        probe["loop.prompts_per_step"], probe["loop.group_size"], probe["sampler.max_new_tokens"])
    assert task["arms"]["covrl"]["evals"][0]["train_clock_s"] == shape["probe_s"] > 0
    first = task["arms"]["covrl"]["records"][0]   # each step says the shape it sampled with
    assert (first["prompts"], first["group_size"], first["max_new_tokens"]) == (
        shape["prompts"], shape["group"], shape["max_new_tokens"])
    for rec in task["arms"]["covrl"]["records"]:   # solved groups are constant groups
        assert 0.0 <= rec["solved_groups"] <= rec["constant_groups"] <= 1.0
    res = _run(tmp_path / "fixed", cache_dir, "--fixed", "--arms", "covrl")
    (task,) = res["tasks"]
    assert task["arms"]["covrl"]["shape"] == {"prompts": 4, "group": 4, "max_new_tokens": 4}
    assert task["arms"]["covrl"]["evals"][0]["train_clock_s"] == 0


@pytest.mark.parametrize("name", [n for n in TASKS if n.endswith("_ln") or n == "sub1"])
def test_last_number_tasks_score_an_explained_answer_by_its_last_number(name, tmp_path):
    # the point of the _ln tasks: a completion that explains and ends with the right number scores 1, under the
    # dataset's own scorer it would score less
    from covrl.config import load_preset
    from covrl.tasks import build_task

    if TASKS[name].needs:
        pytest.importorskip(TASKS[name].needs)
    task = build_task(load_preset("default", materialise(name, tmp_path)).task)
    try:
        ex = task.eval[0]
        wrong = str(int(ex.answer) + 1)
        out = task.score([f"Let me work it out step by step. The answer is {ex.answer}", ex.answer,
                          f"The answer is {wrong}"], [ex, ex, ex])
        assert list(out.correct) == [True, True, False]
        assert [float(r) for r in out.rewards] == [1.0, 1.0, 0.0]
    finally:
        task.close()


@pytest.mark.parametrize("probe_shape, runs_trl_sized", [((2, 8), False), ((4, 4), True)])
def test_trl_sized_is_not_run_again_when_the_probe_chose_trls_own_shape(probe_shape, runs_trl_sized, tmp_path,
                                                                        monkeypatch, cache_dir):
    # at 2 x 8 trl_sized is the trl run itself (same settings, same seed): it reports trl's result, marked
    import covrl.bench.tta_bench as tta

    prompts, group = probe_shape
    monkeypatch.setattr(tta, "probe_sizes", lambda cfg: {
        "config": {"sampler.max_new_tokens": 8, "loop.group_size": group, "loop.prompts_per_step": prompts},
        "evidence": {}, "predicted_failing": {}, "warnings": [], "time/probe_s": 1.0, "time/probe_cpu_s": 1.0})
    ran = {}

    def fake_run_arms(specs, progress=None):
        ran.update(specs)
        ready = {"accuracy_before": 0.1, "probe_s": 1.0,
                 "sizes": {"prompts_per_step": prompts, "group_size": group, "max_new_tokens": 8}}
        records = [{"train_clock_s": 2.0, "accuracy": 0.5 if arm == "trl" else 0.7, "step_time": 2.0,
                    "reward_mean": 0.3, "gen_tokens": 64, "load1": 1.0} for arm in specs]
        return {"ready": dict.fromkeys(specs, ready), "records": {a: [r] for a, r in zip(specs, records)}}

    monkeypatch.setattr(tta, "run_arms", fake_run_arms)
    args = argparse.Namespace(model="tiny", cache_dir=cache_dir, threads=1, quick=True, fixed=False,
                              eval_interval_s=1.0, eval_prompts=4, budget_s=2.0)
    result = tta.run_task("add1", 0, args, tta.ARMS, tmp_path, progress=lambda _: None)
    assert ("trl_sized" in ran) is runs_trl_sized and "trl" in ran and "covrl" in ran
    sized = result["arms"]["trl_sized"]
    assert sized["shape"] == {"prompts": prompts, "group": group, "max_new_tokens": 8}
    if runs_trl_sized:
        assert "same_as" not in sized and sized["final_accuracy"] == 0.7
    else:
        assert sized["same_as"] == "trl" and sized["final_accuracy"] == result["arms"]["trl"]["final_accuracy"]


def test_set_overrides_reach_covrl_arm_only(tmp_path, monkeypatch, cache_dir):
    # `--set` changes covrl's arm; the probe that sizes TRL's arms (and the evaluations) stays the default's
    import covrl.bench.tta_bench as tta

    probed = []

    def fake_probe(cfg):
        probed.append(cfg)
        return {"config": {"sampler.max_new_tokens": 8, "loop.group_size": 8, "loop.prompts_per_step": 2},
                "evidence": {}, "predicted_failing": {}, "warnings": [], "time/probe_s": 1.0,
                "time/probe_cpu_s": 1.0}

    ran = {}

    def fake_run_arms(specs, progress=None):
        ran.update(specs)
        ready = {"accuracy_before": 0.1, "probe_s": 1.0,
                 "sizes": {"prompts_per_step": 2, "group_size": 8, "max_new_tokens": 8}}
        rec = {"train_clock_s": 2.0, "accuracy": 0.5, "step_time": 2.0, "reward_mean": 0.3, "gen_tokens": 64,
               "load1": 1.0, "constant_groups": 0.5, "solved_groups": 0.25}
        return {"ready": dict.fromkeys(specs, ready), "records": {a: [dict(rec)] for a in specs}}

    monkeypatch.setattr(tta, "probe_sizes", fake_probe)
    monkeypatch.setattr(tta, "run_arms", fake_run_arms)
    parser = argparse.ArgumentParser()
    tta.configure(parser)
    args = parser.parse_args(["--quick", "--cache-dir", str(cache_dir), "--set", "selection.strategy=skip_constant",
                              "--set", "optim.lr=2e-5"])
    args.model, args.eval_interval_s, args.eval_prompts, args.budget_s = "tiny", 1.0, 4, 2.0
    result = tta.run_task("add1", 0, args, ("covrl", "trl"), tmp_path, progress=lambda _: None)
    covrl_cfg = ran["covrl"][1]
    assert covrl_cfg.selection.strategy == "skip_constant" and covrl_cfg.optim.lr == 2e-5
    assert probed[0].selection.strategy == "uniform" and probed[0].optim.lr == 1e-5
    assert result["arms"]["covrl"]["solved_groups"] == 0.25
    table = tta.table([result], args)
    assert "with selection.strategy=skip_constant optim.lr=2e-5" in table and "50% (25%)" in table
    args.covrl_set = ["selection.strategy"]   # not KEY=VALUE: the error names the item
    with pytest.raises(Exception, match="selection.strategy"):
        tta.run_task("add1", 0, args, ("covrl",), tmp_path, progress=lambda _: None)
