"""Checkpoints are written atomically and a failing disk never costs the last good one:

- a folder without COMPLETE (or without trainer_state.pt) is never listed, loaded or resumed from;
- ENOSPC in any writer (weights, trainer state, COMPLETE marker) -> CheckpointError naming the failure and
  the intact previous checkpoint; the partial folder is removed; `covrl train` exits 4 without a traceback
  and `--resume` continues from the previous checkpoint;
- leftovers of a kill (temporary folders, a re-save interrupted between its two renames, a torn last line in
  metrics.jsonl) are cleaned up on resume."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from _reliability_tiny import TINY, metrics, tiny_overrides

from covrl.models import tiny_llama
from covrl.train import checkpoint as ckpt
from covrl.train import faults


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_llama(100, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=32)


def weights(m) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_incomplete_folders_are_never_listed_or_loaded(tmp_path, model):
    good = ckpt.save_checkpoint(tmp_path, ckpt.checkpoint_name(16), model=model, state={"x": torch.ones(2)})
    no_marker = tmp_path / "checkpoints" / ckpt.checkpoint_name(32)
    (no_marker / "model").mkdir(parents=True)
    torch.save({"x": torch.zeros(2)}, no_marker / ckpt.STATE_FILE)
    no_state = tmp_path / "checkpoints" / ckpt.checkpoint_name(48)
    no_state.mkdir()
    (no_state / ckpt.COMPLETE).write_text("{}")
    assert ckpt.list_checkpoints(tmp_path) == [good]
    assert ckpt.latest_checkpoint(tmp_path) == good
    for broken in (no_marker, no_state):
        with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
            ckpt.load_state(broken)
    assert torch.equal(ckpt.load_state(good)["x"], torch.ones(2))


@pytest.mark.parametrize("writer", ["weights", "trainer_state", "complete_marker"])
def test_enospc_in_any_writer_keeps_the_previous_checkpoint(tmp_path, model, monkeypatch, writer):
    before = weights(model)
    first = ckpt.save_checkpoint(tmp_path, ckpt.checkpoint_name(16), model=model, state={"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    target = {"weights": (ckpt, "save_model"), "trainer_state": (torch, "save"),
              "complete_marker": (ckpt.json, "dump")}[writer]
    monkeypatch.setattr(*target, enospc)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save_checkpoint(tmp_path, ckpt.checkpoint_name(32), model=model, state={"step": 2})
    monkeypatch.undo()
    text = str(info.value)
    assert "No space left on device" in text and str(first) in text and "is intact" in text
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert leftovers == [first.name]  # the partial folder is gone (frees the space it took)
    assert ckpt.latest_checkpoint(tmp_path) == first and ckpt.load_state(first) == {"step": 1}
    fresh = tiny_llama(100, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=32)
    ckpt.load_model_weights(fresh, first / "model")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(1.0)


def test_clean_temporary_removes_partials_and_restores_an_interrupted_swap(tmp_path, model):
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(tmp_path, ckpt.checkpoint_name(16), model=model, state={"step": 1})
    # a re-save of ckpt-32 killed between "final -> .old" and ".tmp -> final": only .old holds it
    ckpt.save_checkpoint(tmp_path, ckpt.checkpoint_name(32), model=model, state={"step": 2})
    (root / ckpt.checkpoint_name(32)).rename(root / f".old-{ckpt.checkpoint_name(32)}-4242")
    (root / f".tmp-{ckpt.checkpoint_name(32)}-4242" / "model").mkdir(parents=True)
    (root / f".tmp-{ckpt.checkpoint_name(48)}-99").mkdir()
    ckpt.clean_temporary(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == [ckpt.checkpoint_name(16), ckpt.checkpoint_name(32)]
    assert ckpt.load_state(ckpt.latest_checkpoint(tmp_path)) == {"step": 2}


def _run(tmp_path, name, *extra, resume=False, capsys=None):
    from covrl.config import load_config
    from covrl.train.cli import train_from_config

    torch.set_num_threads(1)
    cfg = load_config(TINY, tiny_overrides(tmp_path, name, "logging.console=false", "sft_warmup.steps=0",
                                           "logging.diagnostics=false", *extra))
    return train_from_config(cfg, resume=resume)


def test_disk_full_mid_run_exits_4_then_resume_completes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(faults.ENV, "checkpoint-write:2:enospc")
    faults.reset()
    try:
        assert _run(tmp_path, "full") == 4
    finally:
        monkeypatch.delenv(faults.ENV)
        faults.reset()
    err = capsys.readouterr().err
    run_dir = tmp_path / "full"
    assert "No space left on device" in err and "Traceback" not in err
    assert f"{ckpt.checkpoint_name(16)} is intact" in err and "--resume --name full" in err
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [ckpt.checkpoint_name(16)]
    assert _run(tmp_path, "full", resume=True) == 0
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["rollouts"] for r in records] == [16.0, 32.0, 48.0, 64.0]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_a_torn_last_metrics_line_does_not_block_resume(tmp_path, monkeypatch):
    assert _run(tmp_path, "torn", "loop.steps=2") == 0
    run_dir = tmp_path / "torn"
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # what a full disk or power loss can leave behind
    assert _run(tmp_path, "torn", "loop.steps=3", resume=True) == 0
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]


def test_resume_without_any_complete_checkpoint_is_a_clear_error(tmp_path, capsys):
    run_dir = tmp_path / "empty"
    (run_dir / "checkpoints" / f".tmp-{ckpt.checkpoint_name(16)}-1").mkdir(parents=True)
    assert _run(tmp_path, "empty", resume=True) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert not list((run_dir / "checkpoints").iterdir())
