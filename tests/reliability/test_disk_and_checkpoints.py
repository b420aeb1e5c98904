"""Checkpoints are written atomically and a failing disk never costs the last good one:

- a folder without COMPLETE (or without trainer_state.pt) is never listed, loaded or resumed from;
- ENOSPC in any writer (weights, trainer state, COMPLETE marker) -> CheckpointError naming the failure and
  the intact previous checkpoint; the partial folder is removed; `covrl train` exits 4 without a traceback
  and `--resume` continues from the previous checkpoint;
- leftovers of a kill (temporary folders, a re-save interrupted between its two renames, a torn last line in
  metrics.jsonl) are cleaned up on resume;
- every exit of `covrl train` (codes 1, 2, 3, 4, 5, 130; mid-run and during the setup) leaves summary.json with
  a final status, the reason and the exit code;
- `--resume` skips a newest checkpoint that does not load (truncated weights or trainer state) for the newest
  one that does, and the resumed run equals the uninterrupted one; when none loads it changes nothing;
- `--resume` on a folder without a complete checkpoint starts from scratch in that folder (never over a
  completed run); a plain rerun still takes `<name>-2`."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from _reliability_tiny import REWARDS, TINY, comparable, final_weights, metrics, tiny_overrides

from covrl.models import tiny_llama
from covrl.train import faults
from covrl.train.run import checkpoint as ckpt


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
    from covrl.train.launch.modes import train_from_config

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


# ------------------------------------------------------------------- through the `covrl` entry point

def _cli(tmp_path: Path, name: str, *extra: str, resume: bool = False) -> int:
    from covrl.cli import main

    torch.set_num_threads(1)
    args = tiny_overrides(tmp_path, name, "logging.console=false", "sft_warmup.steps=0",
                          "logging.diagnostics=false", *extra)
    return main(["train", "--config", str(TINY), *args, *(["--resume"] if resume else [])])


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _at_call(n: int, exc: BaseException, real=None):
    """A stand-in that raises `exc` at its n-th call and otherwise calls `real`."""
    calls = {"n": 0}

    def fn(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(*args, **kwargs)

    return fn


def _nan_after_two_steps(monkeypatch):
    import math

    from covrl.train.step import trainer as trainer_module

    real = trainer_module.forward_batch
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] > 2 * 2:   # 2 micro-batches per step: steps 3, 4, ... get NaN log-probs
            out.logprobs = out.logprobs * math.nan
        return out

    monkeypatch.setattr(trainer_module, "forward_batch", poisoned)


def _kill_sampler_thread(monkeypatch):
    from covrl.rollout import hf as sampler_module

    monkeypatch.setattr(sampler_module.HFSampler, "generate",
                        _at_call(3, RuntimeError("sampler died (injected)"), sampler_module.HFSampler.generate))


# exit path -> (extra overrides, fault setup, exit code, status, text in the reason)
EXITS = {
    "reward-error": ([f"task.reward={REWARDS}:crash", "task.reward_errors=raise"], None, 2, "failed",
                     "RewardFunctionError"),
    "prompt-too-long": (["task.max_prompt_tokens=3", "task.overlong=error"], None, 2, "failed",
                        "PromptTooLongError"),
    "disk-full": ([], "enospc", 4, "failed", "No space left on device"),
    "diverged": (["loop.steps=6", "optim.max_bad_steps=2"], "nan", 3, "diverged", "step 4: TrainingDivergedError"),
    "sampler-died": (["loop.mode=async", "async_loop.chunk_prompts=2"], "sampler", 5, "failed",
                     "SamplerWorkerError"),
    "interrupted": ([], "interrupt", 130, "interrupted", "KeyboardInterrupt"),
    "unexpected": ([], "unexpected", 1, "failed", "RuntimeError: boom"),
    "interrupted-in-setup": (["sft_warmup.steps=2"], "setup-interrupt", 130, "interrupted", "KeyboardInterrupt"),
}


@pytest.mark.parametrize("case", list(EXITS))
def test_every_exit_of_covrl_train_leaves_a_final_summary(tmp_path, monkeypatch, capsys, case):
    from covrl.train.run import components as run_module
    from covrl.train.run import sources as sources_module

    extra, fault, code, status, reason = EXITS[case]
    if fault == "enospc":
        monkeypatch.setenv(faults.ENV, "checkpoint-write:2:enospc")
    faults.reset()
    if fault == "nan":
        _nan_after_two_steps(monkeypatch)
    elif fault == "sampler":
        _kill_sampler_thread(monkeypatch)
    elif fault in ("interrupt", "unexpected"):
        exc = KeyboardInterrupt() if fault == "interrupt" else RuntimeError("boom")
        monkeypatch.setattr(sources_module, "score_rollouts", _at_call(2, exc, sources_module.score_rollouts))
    elif fault == "setup-interrupt":   # Ctrl-C during the SFT warm-up: the run folder exists, no Run yet
        monkeypatch.setattr(run_module, "sft_warmup", _at_call(1, KeyboardInterrupt()))
    try:
        if code == 1:   # a bug keeps its traceback
            with pytest.raises(RuntimeError, match="boom"):
                _cli(tmp_path, "x", *extra)
        else:
            assert _cli(tmp_path, "x", *extra) == code
    finally:
        monkeypatch.undo()
        faults.reset()
    summary = _summary(tmp_path / "x")
    assert summary["status"] == status and summary["exit_code"] == code, summary
    assert reason in summary["reason"], summary["reason"]
    if code != 1:
        err = capsys.readouterr().err
        if case == "reward-error":   # the user's function's own traceback is shown, covrl's is not
            assert "in crash" in err and "covrl/train/" not in err, err
        else:
            assert "Traceback" not in err
    if case == "diverged":
        # the diverging step (4) is logged and counted too (its metrics travel on the exception)
        records = metrics(tmp_path / "x")
        assert [r["step"] for r in records] == [1, 2, 3, 4] and summary["steps"] == 4
        assert records[-1]["skipped"] == 1.0 and "step 4:" in summary["reason"]


def test_resume_falls_back_past_a_corrupt_newest_checkpoint(tmp_path, capsys):
    """A finished 3-step run (checkpoints at 16, 32, 48 rollouts; the last two kept). Its newest checkpoint is
    damaged: first the weights, then (after the resume re-wrote it) the trainer/optimizer state. Each time
    --resume warns, moves the bad folder aside, resumes from ckpt-32, re-runs step 3, and the run folder ends
    equal to the uninterrupted run."""
    run_dir = tmp_path / "fb"
    assert _cli(tmp_path, "fb", "loop.steps=3") == 0
    want_metrics = [comparable(r) for r in metrics(run_dir)]
    want_weights = {k: v.clone() for k, v in final_weights(run_dir).items()}   # not views of the file damaged below
    newest, older = ckpt.checkpoint_name(48), ckpt.checkpoint_name(32)
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [older, newest]
    damaged = {"weights": (Path(ckpt.MODEL_DIR) / "model.safetensors", "unreadable weights"),
               "trainer state": (Path(ckpt.STATE_FILE), "is corrupt")}
    for k, (what, (rel, why)) in enumerate(damaged.items(), start=1):
        f = run_dir / "checkpoints" / newest / rel
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])   # truncated, as by a full disk
        # as a kill right after the last checkpoint leaves the run (a completed run is complete: not resumed)
        (run_dir / "summary.json").write_text(json.dumps({**_summary(run_dir), "status": "running"}))
        capsys.readouterr()
        assert _cli(tmp_path, "fb", "loop.steps=3", resume=True) == 0, what
        out, err = capsys.readouterr()
        assert f"skipped {run_dir / 'checkpoints' / newest}" in err and why in err, err
        assert f"resumed from {run_dir / 'checkpoints' / older}" in out, out
        set_aside = run_dir / "checkpoints" / (f"corrupt-{newest}" + ("" if k == 1 else f"-{k}"))
        assert (set_aside / rel).is_file(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        # steps after ckpt-32 were truncated and re-run once: the same records, the same weights
        assert [comparable(r) for r in metrics(run_dir)] == want_metrics, what
        got = final_weights(run_dir)
        assert got.keys() == want_weights.keys() and all(torch.equal(got[n], want_weights[n]) for n in got), what
        assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [older, newest]
        summary = _summary(run_dir)
        assert summary["status"] == "completed" and summary["exit_code"] is None
        assert [s["checkpoint"] for s in summary["resume_skipped"]] == [str(run_dir / "checkpoints" / newest)]


def test_resume_when_no_checkpoint_loads_is_a_clear_error_and_changes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "bad"
    assert _cli(tmp_path, "bad", "loop.steps=2") == 0
    for c in ckpt.list_checkpoints(run_dir):
        (c / ckpt.STATE_FILE).write_bytes(b"\x80\x04garbage")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert _cli(tmp_path, "bad", "loop.steps=3", resume=True) == 2
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "loads" in err and "Traceback" not in err
    assert ckpt.checkpoint_name(16) in err and ckpt.checkpoint_name(32) in err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before   # nothing renamed or rewritten


def test_resume_without_a_complete_checkpoint_starts_from_scratch_in_place(tmp_path, capsys):
    from covrl.config import load_config
    from covrl.train.run.folder import choose_run_dir

    assert _cli(tmp_path, "ref", "loop.steps=2") == 0
    # what a kill before the first complete checkpoint leaves: config, a half-written checkpoint, the first
    # step's metrics line, a summary saying "running"
    run_dir = tmp_path / "early"
    (run_dir / "checkpoints" / f".tmp-{ckpt.checkpoint_name(16)}-1" / "model").mkdir(parents=True)
    (run_dir / "config.yaml").write_text((tmp_path / "ref" / "config.yaml").read_text())
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew')
    (run_dir / "summary.json").write_text('{"status": "running", "phase": "setup"}')
    capsys.readouterr()
    assert _cli(tmp_path, "early", "loop.steps=2", resume=True) == 0
    out, err = capsys.readouterr()
    assert "started from scratch" in out and "starting the run from scratch" in err
    assert [comparable(r) for r in metrics(run_dir)] == [comparable(r) for r in metrics(tmp_path / "ref")]
    got, want = final_weights(run_dir), final_weights(tmp_path / "ref")
    assert all(torch.equal(got[n], want[n]) for n in want)
    summary = _summary(run_dir)
    assert summary["status"] == "completed" and summary["resume_started_fresh"] is True
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["early", "ref"]     # no early-2
    # a plain rerun (no --resume) still never writes into a used folder
    cfg = load_config(TINY, tiny_overrides(tmp_path, "early"))
    assert choose_run_dir(cfg, config_path=TINY, resume=False) == tmp_path / "early-2"
    # a completed run without checkpoints (checkpoints off) is never restarted over
    import shutil

    shutil.rmtree(run_dir / "checkpoints")
    kept = (run_dir / "metrics.jsonl").read_text()
    assert _cli(tmp_path, "early", "loop.steps=2", resume=True) == 2
    assert "holds a completed run" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == kept and _summary(run_dir)["status"] == "completed"
