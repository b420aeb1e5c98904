"""The sync loop end to end on a tiny model: run folder contents, exact resume, atomic checkpoints, the data
stream, RNG capture, and the train/eval command lines."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from train_helpers import comparable, tiny_cfg

from covrl.cli import main as covrl_main
from covrl.train.run import checkpoint as ckpt
from covrl.train.run.driver import train_sync
from covrl.train.run.folder import prepare_run
from covrl.train.run.sinks import read_jsonl
from covrl.train.run.stream import DataStream

torch.set_num_threads(1)


def finite_numbers(record):
    return all(math.isfinite(v) for v in record.values() if isinstance(v, float))


def test_tiny_run_writes_the_run_folder(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"run.name": "e2e", "logging.curves": True, "checkpoint.every_rollouts": 32,
                                "checkpoint.keep_last": 2, "run.save_initial": True})
    run = prepare_run(cfg, console=False)
    summary = train_sync(run)
    run.close()
    d = tmp_path / "e2e"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "curves.png", "eval.json"):
        assert (d / name).is_file(), name
    records = read_jsonl(d / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(finite_numbers(r) for r in records)
    assert [r["rollouts"] for r in records] == [16, 32, 48]
    evals = json.loads((d / "eval.json").read_text())["evals"]
    assert [e["label"] for e in evals] == ["before", "after"]
    assert {"greedy", "sampled", "settings"} <= set(evals[0])
    assert summary["status"] == "completed" and summary["eval_after"]["greedy"] == evals[1]["greedy"]["accuracy"]
    assert summary["versions"]["torch"] and "commit" in summary["git"]
    # the CPU model and its bf16 support: results at fixed threads differ across CPU models
    assert {"cpu_model", "cpu_capability", "cpu_bf16"} <= set(summary["versions"])
    saved = json.loads((d / "summary.json").read_text())
    assert saved["steps"] == 3 and saved["rollouts"] == 48
    names = [p.name for p in ckpt.list_checkpoints(d)]
    assert names == ["ckpt-000000032", "ckpt-000000048"]          # every 32 rollouts + at end, keep_last 2
    assert (d / "checkpoints" / "initial" / "model").is_dir()
    assert (d / "checkpoints" / "ckpt-000000048" / "model" / "model.safetensors").is_file()


LORA = {"model.lora": "{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}", "optim.lr": 1e-2}


@pytest.mark.parametrize("extra", [{}, LORA], ids=["full", "lora"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, extra):
    over = {"loop.steps": 6, "eval.before": False, "eval.sampled": False, "sampler.temperature": 1.0, **extra}
    straight = prepare_run(tiny_cfg(tmp_path, **{"run.name": "straight", **over}), console=False)
    train_sync(straight)
    straight.close()

    first = prepare_run(tiny_cfg(tmp_path, **{"run.name": "split", **over}), console=False)
    summary = train_sync(first, stop_after=3)
    first.close()
    assert summary["status"] == "stopped" and summary["steps"] == 3
    resumed = prepare_run(tiny_cfg(tmp_path, **{"run.name": "split", **over}), resume=True, console=False)
    assert resumed.step == 3 and resumed.trainer.rollouts == 48
    train_sync(resumed)
    resumed.close()

    a = comparable(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))
    b = comparable(read_jsonl(tmp_path / "split" / "metrics.jsonl"))
    assert len(a) == len(b) == 6
    assert a == b
    for (ka, va), (kb, vb) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


def test_interrupted_checkpoint_write_leaves_the_previous_one(tmp_path):
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "atomic", "loop.steps": 1, "eval.before": False,
                                            "eval.after": False}), console=False)
    train_sync(run)
    run.close()
    d = tmp_path / "atomic"
    good = ckpt.latest_checkpoint(d)
    # a kill mid-write: a temporary folder without COMPLETE, and a renamed folder missing its marker
    (d / "checkpoints" / ".tmp-ckpt-000000099-1" / "model").mkdir(parents=True)
    broken = d / "checkpoints" / "ckpt-000000099"
    broken.mkdir()
    (broken / ckpt.STATE_FILE).write_bytes(b"partial")
    assert ckpt.latest_checkpoint(d) == good
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.load_state(broken)
    resumed = prepare_run(tiny_cfg(tmp_path, **{"run.name": "atomic", "loop.steps": 2, "eval.before": False,
                                                "eval.after": False}), resume=True, console=False)
    assert resumed.resumed_from == str(good)
    assert not (d / "checkpoints" / ".tmp-ckpt-000000099-1").exists()
    resumed.close()


def test_data_stream_is_a_function_of_seed_and_position():
    items = list(range(10))
    s = DataStream(items, seed=3)
    first, pos = s.take(25)
    assert pos == list(range(25)) and sorted(first[:10]) == items and sorted(first[10:20]) == items
    t = DataStream(items, seed=3)
    t.load_state_dict({"position": 7, "seed": 3, "size": 10})
    assert t.take(18)[0] == first[7:]
    assert DataStream(items, seed=4).take(10)[0] != first[:10]
    with pytest.raises(ValueError, match="empty dataset"):
        DataStream([], seed=0)
    with pytest.raises(ValueError, match="size changed"):
        t.load_state_dict({"position": 1, "seed": 3, "size": 11})


def test_rng_states_round_trip_through_weights_only_load(tmp_path):
    gen = torch.Generator().manual_seed(5)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = ckpt.capture_rng(gen)
    torch.save(state, tmp_path / "s.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=gen))
    ckpt.restore_rng(torch.load(tmp_path / "s.pt", weights_only=True), gen)
    got = (random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=gen))
    assert expected[:2] == got[:2] and torch.equal(expected[2], got[2]) and torch.equal(expected[3], got[3])


def test_cli_train_reports_config_errors_with_field_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  source: tiny\nloop:\n  stepz: 3\n")
    assert covrl_main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4" in err and "loop.stepz" in err and "allowed keys" in err
    assert covrl_main(["train", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_cli_takes_overrides_and_flags_in_any_order(tmp_path, capsys):
    """As users copy them into torchrun lines: an override after the flags, flags between overrides."""
    cfg_file = tmp_path / "t.yaml"
    cfg_file.write_text("model:\n  source: tiny\n")
    assert covrl_main(["train", "--config", str(cfg_file), "--no-progress", "--name", "x", "optim.lrr=1"]) == 2
    assert "optim.lrr" in capsys.readouterr().err   # the override reached the config, not argparse's error
    assert covrl_main(["train", "loop.stepz=1", "--config", str(cfg_file), "optim.lrr=1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "loop.stepz" in err and "optim.lrr" in err


def test_cli_train_then_eval(tmp_path, capsys):
    cfg_file = tmp_path / "t.yaml"
    from covrl.config import dump_config

    cfg_file.write_text(dump_config(tiny_cfg(tmp_path, **{"loop.steps": 2, "eval.before": False})))
    assert covrl_main(["train", "--config", str(cfg_file), "--name", "cli", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "after" in out
    assert covrl_main(["eval", "--run", str(tmp_path / "cli"), "--out", str(tmp_path / "e.json")]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    assert 0.0 <= result["greedy"]["accuracy"] <= 1.0 and result["settings"]["n_prompts"] == 4
    # a fresh run never overwrites a used folder; --resume continues the named one from its own config
    assert covrl_main(["train", "--config", str(cfg_file), "--name", "cli", "--no-progress"]) == 0
    assert (tmp_path / "cli-2" / "summary.json").is_file()
    assert covrl_main(["train", "--resume", "--name", str(tmp_path / "cli"), "loop.steps=3", "--no-progress"]) == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "cli" / "metrics.jsonl")] == [1, 2, 3]
    assert "resumed from" in capsys.readouterr().out
    assert covrl_main(["eval", "--run", str(tmp_path / "missing")]) == 2


@pytest.mark.slow
def test_tiny_config_improves_reward_during_rl(tmp_path):
    """configs/tiny.yaml end to end (about 15-20 s on 2 idle cores): the RL phase raises the train reward."""
    from pathlib import Path

    from covrl.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml",
                      [f"run.output_dir={tmp_path}", "logging.console=false", "checkpoint.at_end=false"])
    run = prepare_run(cfg, console=False)
    summary = train_sync(run)
    run.close()
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    first = sum(r["reward/mean"] for r in records[:10]) / 10
    last = sum(r["reward/mean"] for r in records[-10:]) / 10
    assert summary["status"] == "completed" and last > first + 0.05, (first, last)


@pytest.mark.parametrize("rows, expected", [
    ('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n', r"bad.jsonl:2: missing field 'prompt'"),
    ("", "empty"),
])
def test_cli_train_bad_dataset_fails_before_creating_the_run_folder(tmp_path, capsys, rows, expected):
    import re

    data = tmp_path / "bad.jsonl"
    data.write_text(rows)
    args = ["train", "--no-progress", "--config", str(tmp_path / "c.yaml")]
    from covrl.config import dump_config

    (tmp_path / "c.yaml").write_text(dump_config(tiny_cfg(tmp_path / "runs", **{
        "task.name": "jsonl", "task.path": str(data), "task.n_eval": 1})))
    assert covrl_main(args) == 2
    assert re.search(expected, capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


def test_cli_train_missing_model_is_a_clear_error(tmp_path, capsys):
    from covrl.config import dump_config

    (tmp_path / "c.yaml").write_text(dump_config(tiny_cfg(tmp_path / "runs", **{
        "model.source": "hf", "model.path": str(tmp_path / "no-such-model")})))
    assert covrl_main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    assert "model.path" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_optional_sinks_name_their_extra(tmp_path):
    import importlib.util

    from covrl._lazy import MissingExtraError
    from covrl.train.run.sinks import TensorBoardSink, WandbSink

    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(MissingExtraError, match=r"covrl\[tensorboard\]"):
            TensorBoardSink(tmp_path)
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(MissingExtraError, match=r"covrl\[wandb\]"):
            WandbSink("p", "n", {}, tmp_path)
