"""Resuming and naming runs as a newcomer meets them: `--resume` of a finished run says it is complete (and how to
train further) without re-evaluating; `loop.steps=M` on resume extends it; a taken name is announced; a run that
kept its final weights only says it cannot be resumed for more steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from covrl.cli import main
from covrl.train.run import checkpoint as ckpt

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def tiny_args(out: Path, name: str, *extra: str, steps: int = 2) -> list[str]:
    """`covrl train` on a 1-layer tiny model: 16 rollouts a step, a few held-out prompts, no warm-up."""
    return ["train", "--config", str(TINY), f"run.output_dir={out}", f"run.name={name}", f"loop.steps={steps}",
            "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
            "model.tiny.intermediate_size=64", "model.tiny.max_positions=48", "task.arithmetic.num_terms=2",
            "task.n_train=64", "task.n_eval=8", "eval.max_prompts=4", "sampler.max_batch=64", "sft_warmup.steps=0",
            "optim.micro_batch_size=32", "loop.prompts_per_step=4", "loop.group_size=4", "logging.curves=false",
            "logging.progress_bar=false", *extra]


def snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_resume_of_a_completed_run_says_so_touches_nothing_and_loop_steps_extends_it(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "done"
    assert main(tiny_args(tmp_path, "done")) == 0
    out = capsys.readouterr().out
    # the end of a run says where its checkpoint is, how big, and what the folder uses
    assert f"checkpoint: {run_dir / 'checkpoints' / ckpt.checkpoint_name(32)} (" in out, out
    assert "weights + optimizer state; --resume continues from it" in out and f"disk: {run_dir} uses " in out, out
    before = snapshot(run_dir)

    # the run is complete: nothing is loaded or evaluated, nothing in the folder changes, exit 0
    import covrl.train.run.components as components
    import covrl.train.run.folder as folder

    def no_eval(*args, **kwargs):
        raise AssertionError("a complete run was evaluated again")

    monkeypatch.setattr(folder, "evaluate", no_eval)
    monkeypatch.setattr(components, "load_model", no_eval)
    assert main(["train", "--resume", "--name", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"run done is complete (2 steps); to train further: covrl train --resume --name {run_dir} loop.steps=4" \
        in out, out
    assert snapshot(run_dir) == before
    monkeypatch.undo()

    # loop.steps=M on resume extends the run from its checkpoint to M steps
    assert main(["train", "--resume", "--name", str(run_dir), "loop.steps=4"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run_dir / 'checkpoints' / ckpt.checkpoint_name(32)}" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4 and summary["rollouts"] == 64
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # the default retention keeps one complete checkpoint: the newest, what --resume needs
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [ckpt.checkpoint_name(64)]


def test_a_taken_run_name_is_announced(tmp_path, capsys):
    assert main(tiny_args(tmp_path, "default", "eval.before=false", "eval.after=false", steps=1)) == 0
    capsys.readouterr()
    assert main(tiny_args(tmp_path, "default", "eval.before=false", "eval.after=false", steps=1)) == 0
    out = capsys.readouterr().out
    assert (f"{tmp_path / 'default'} exists; this run writes {tmp_path / 'default-2'} (use --resume to continue "
            f"{tmp_path / 'default'}") in out, out
    assert f"run folder: {tmp_path / 'default-2'}" in out
    # a free name says nothing of the kind
    assert main(tiny_args(tmp_path, "other", "eval.before=false", "eval.after=false", steps=1)) == 0
    assert "exists; this run writes" not in capsys.readouterr().out


def test_final_weights_only_is_smaller_and_refuses_more_steps_clearly(tmp_path, capsys):
    common = ("eval.before=false", "eval.after=false", "checkpoint.every_rollouts=16")
    assert main(tiny_args(tmp_path, "full", *common)) == 0
    assert main(tiny_args(tmp_path, "slim", *common, "checkpoint.final=weights")) == 0
    out = capsys.readouterr().out
    slim = tmp_path / "slim"
    final = slim / "checkpoints" / ckpt.FINAL
    assert (final / ckpt.MODEL_DIR / "model.safetensors").is_file() and not (final / ckpt.STATE_FILE).exists()
    assert ckpt.list_checkpoints(slim) == []            # the full checkpoints are gone: nothing to resume
    assert f"checkpoint: {final} (" in out and "weights only (checkpoint.final=weights)" in out, out
    full, kept = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("full", "slim"))
    assert kept["checkpoint"]["kind"] == "weights" and kept["checkpoint"]["resumable"] is False
    assert full["checkpoint"]["kind"] == "full" and full["checkpoint"]["resumable"] is True
    assert kept["checkpoint"]["bytes"] < full["checkpoint"]["bytes"] / 2   # no AdamW state (2 more copies)
    assert kept["disk_bytes"] < full["disk_bytes"]
    assert kept["disk_bytes"] >= kept["checkpoint"]["bytes"] > 0

    # resume: complete at the same steps (exit 0); more steps are refused, saying why and what to do instead
    before = snapshot(slim)
    assert main(["train", "--resume", "--name", str(slim)]) == 0
    assert "run slim is complete (2 steps); it kept its final weights only" in capsys.readouterr().out
    assert main(["train", "--resume", "--name", str(slim), "loop.steps=4"]) == 2
    err = capsys.readouterr().err
    assert "cannot be resumed for loop.steps=4" in err and f"model.path={final / ckpt.MODEL_DIR}" in err, err
    assert "Traceback" not in err and snapshot(slim) == before
    # its weights still serve covrl eval --run
    assert main(["eval", "--run", str(slim), "--out", str(tmp_path / "e.json")]) == 0
