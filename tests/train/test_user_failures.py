"""Failures users cause, surfaced end to end: a reward that fails on most rows stops `covrl train` within a few
steps with exit code 2 and its traceback shown at once; a token budget that cuts most answers says so."""

from __future__ import annotations

import json

from train_helpers import tiny_cfg

from covrl.cli import main
from covrl.config import dump_config


def _config(tmp_path, **over):
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(tiny_cfg(tmp_path, **{"eval.before": False, "eval.after": False, **over})))
    return str(path)


def test_a_reward_failing_on_most_rows_stops_the_run_with_exit_2(tmp_path, capsys):
    reward = tmp_path / "myreward.py"
    reward.write_text("def broken(completion, example):\n    return float(example.solution)\n")
    rc = main(["train", "--config", _config(tmp_path), "--no-progress", "--name", "bad", "loop.steps=50",
               f"task.reward={reward}:broken", "task.reward_error_window=32"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("(the first failure") == 1 and "AttributeError" in err and "example.answer" in err
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] <= 3   # 16 rollouts a step, window 32


def test_answers_cut_by_the_token_budget_are_reported(tmp_path, capsys):
    rc = main(["train", "--config", _config(tmp_path, **{"sampler.max_new_tokens": 1}), "--no-progress",
               "--name", "cut", "loop.steps=3", "logging.console=true"])
    assert rc == 0
    out = capsys.readouterr()
    assert "end at sampler.max_new_tokens=1" in out.out + out.err and "cut 100%" in out.out
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["response_at_max_frac"] == 1.0


ENV = """
import itertools
from covrl.tasks import EnvStep
counter = itertools.count()

class Flaky:
    tools = []
    def reset(self, example):
        return [{"role": "user", "content": example.plain_prompt}]
    def step(self, text):
        if next(counter) % EVERY == 0:
            return {}["score"]          # the environment's own bug: a KeyError
        return EnvStep(done=True, reward=1.0)
"""


def _env_run(tmp_path, every: int, name: str, capsys):
    env = tmp_path / f"{name}.py"
    env.write_text(ENV.replace("EVERY", str(every)))
    rc = main(["train", "--config", _config(tmp_path, **{"model.tiny.max_positions": 64}), "--no-progress",
               "--name", name, "loop.steps=8", f"task.env.name={env}:Flaky", "task.reward_error_window=32",
               "sft_warmup.steps=60", "sft_warmup.lr=3e-3"])   # answers end with EOS: episodes reach env.step
    return rc, capsys.readouterr().err, json.loads((tmp_path / name / "summary.json").read_text())


def test_an_environment_failing_on_most_steps_stops_the_run_with_its_traceback(tmp_path, capsys):
    rc, err, summary = _env_run(tmp_path, 1, "env-bad", capsys)
    assert rc == 2 and summary["status"] == "failed" and summary["steps"] <= 3
    assert err.count("(the first failure") == 1 and "KeyError" in err and "env-bad.py" in err
    assert "environment" in summary["reason"] and "environment steps" in summary["reason"]


def test_an_environment_failing_rarely_is_counted_and_the_run_completes(tmp_path, capsys):
    rc, err, summary = _env_run(tmp_path, 16, "env-rare", capsys)
    assert rc == 0 and summary["status"] == "completed"
    assert err.count("(the first failure") == 1 and "KeyError" in err
