"""`covrl bandit` end to end, `covrl bench explore` on tiny sizes, and the fast variants of the three
reproductions (asserting their criteria)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from covrl.cli import main


def test_cli_module_imports_only_stdlib():
    code = ("import sys, covrl.explore.cli; "
            "print(sorted(m for m in ('torch', 'numpy', 'pydantic', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bandit_cli_writes_json_png_and_agents(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["bandit", "--env", "linear", "--agent", "ensemble++,lints", "--M", "4", "--steps", "30",
               "--seeds", "3", "--env-arg", "d=3", "--env-arg", "n_arms=12", "--track-band", "10",
               "--save-agents", "--no-progress", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["agent"] for r in results] == ["ensemble++", "lints"]
    assert results[0]["options"]["agent"] == {"M": 4}  # --M routed only to agents that accept it
    assert results[1]["options"]["agent"] == {}
    assert len(results[0]["cumulative_regret_mean"]) == 30 and "band" in results[0]
    assert (out / "regret.png").stat().st_size > 1000
    assert (out / "agent-ensemble++.pt").exists() and (out / "config.json").exists()
    assert "ms/step" in capsys.readouterr().out


def test_bandit_cli_neural_agent(tmp_path):
    rc = main(["bandit", "--env", "quadratic", "--agent", "neural-ensemble++", "--steps", "10", "--seeds", "1",
               "--env-arg", "d=3", "--env-arg", "n_actions=20", "--env-arg", "n_offered=4",
               "--agent-arg", "hidden_sizes=[8]", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    assert json.loads((tmp_path / "results.json").read_text())[0]["options"]["agent"]["hidden_sizes"] == [8]


@pytest.mark.parametrize("argv,message", [(["--env", "nope"], "env"), (["--agent", "ucb"], "agent"),
                                          (["--env-arg", "d"], "KEY=VALUE"), (["--env-arg", "n_armz=3"], "n_armz")])
def test_bandit_cli_errors_name_the_option(tmp_path, capsys, argv, message):
    rc = main(["bandit", "--steps", "2", "--seeds", "1", "--no-progress", "--out", str(tmp_path), *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_bench_explore_tiny(tmp_path):
    rc = main(["bench", "explore", "--dims", "4,8", "--steps", "5", "--arms", "10", "--out", str(tmp_path)])
    assert rc == 0
    files = list(tmp_path.glob("explore/*.json"))
    assert len(files) == 1
    rows = json.loads(files[0].read_text())["results"]["rows"]
    assert [r["d"] for r in rows] == [4, 8]
    assert all(r["M_dlogT"] == int(-(-r["d"] * 1.6094379124341003 // 1)) for r in rows)  # ceil(d ln 5)
    assert "LinTS" in files[0].with_suffix(".md").read_text()


# ensemble_linear's fast run is slow (~10 s): the other two keep the repro harness in the default suite
@pytest.mark.parametrize("name", [pytest.param("ensemble_linear", marks=pytest.mark.slow), "seq_jl", "ensemble_neural"])
def test_fast_repro_passes_its_criteria(name, tmp_path):
    import importlib

    module = importlib.import_module(f"studies.{name}.{name}")
    result = module.run(tmp_path, fast=True, seed=0)
    failed = [(c.name, c.measured, c.target) for c in result.criteria if not c.passed]
    assert result.criteria and not failed, failed
    assert all((tmp_path / f).exists() for f in result.figures)


def test_ensemble_neural_paper_fast_runs_resumes_and_reports(tmp_path):
    import json

    from studies.ensemble_neural import ensemble_neural_paper as paper

    from studies import STUDIES

    assert STUDIES["ensemble-neural-paper"] == "studies.ensemble_neural.ensemble_neural_paper"
    result = paper.run(tmp_path, fast=True, seed=0, log=lambda _: None)
    cfg = paper.FAST
    lines = (tmp_path / "jobs.jsonl").read_text().splitlines()
    n_tune = 3 * len(cfg.prior_grid) * len(cfg.tune_seeds)
    assert len(lines) == n_tune + len(paper.AGENTS) * len(cfg.eval_seeds)
    table = result.numbers["table"]
    assert set(table) == {"Ensemble++ M=8", "Ensemble+ M=8", "EpiNet M=8", "Greedy"}
    assert result.numbers["complete"]
    for name, row in table.items():
        assert row["seeds"] == len(cfg.eval_seeds)
        assert row["prior_scale"] in ((0.0,) if name == "Greedy" else cfg.prior_grid)
    assert table["Ensemble+ M=8"]["parameters"] > table["Ensemble++ M=8"]["parameters"]
    assert [c.name[:2] for c in result.criteria] == ["R1", "R2", "R3"]
    assert set(result.numbers["paired_ensemblepp_minus_other"]) == {"Ensemble+ M=8", "EpiNet M=8", "Greedy"}
    assert all((tmp_path / f).exists() for f in result.figures)
    # a second run finds every job in jobs.jsonl and plays nothing
    again = paper.run(tmp_path, fast=True, seed=0, log=lambda _: None)
    assert len((tmp_path / "jobs.jsonl").read_text().splitlines()) == len(lines)
    assert again.numbers["table"] == json.loads(json.dumps(table))


def test_neural_agent_update_start_delays_training():
    import torch

    from covrl.explore.neural import NeuralEnsemblePP

    agent = NeuralEnsemblePP(3, seed=0, update_start=4, sgd_steps=1, batch_size=2)
    before = [p.clone() for p in agent.trainable_parameters()]
    for _ in range(3):
        agent.update(torch.ones(3), torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, agent.trainable_parameters()))
    agent.update(torch.ones(3), torch.tensor(1.0))
    assert any(not torch.equal(a, b) for a, b in zip(before, agent.trainable_parameters()))
