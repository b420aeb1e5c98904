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
    files = list(tmp_path.glob("explore-*.json"))
    assert len(files) == 1
    rows = json.loads(files[0].read_text())["results"]["rows"]
    assert [r["d"] for r in rows] == [4, 8]
    assert all(r["M_dlogT"] == int(-(-r["d"] * 1.6094379124341003 // 1)) for r in rows)  # ceil(d ln 5)
    assert "LinTS" in (tmp_path / "explore.md").read_text()


@pytest.mark.parametrize("name", ["ensemble_linear", "seq_jl", "ensemble_neural"])
def test_fast_repro_passes_its_criteria(name, tmp_path):
    import importlib

    module = importlib.import_module(f"covrl.repro.{name}")
    result = module.run(tmp_path, fast=True, seed=0)
    failed = [(c.name, c.measured, c.target) for c in result.criteria if not c.passed]
    assert result.criteria and not failed, failed
    assert all((tmp_path / f).exists() for f in result.figures)
