"""Where a `--resume` starts: whether the run is already complete (`RunComplete`), the newest complete checkpoint
that loads (newer ones that do not are renamed `corrupt-*` and never tried again), and the refusal to start a
finished run over from scratch. Everything is read and checked before the run folder is changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from covrl.train.run import checkpoint as ckpt

if TYPE_CHECKING:   # the run's config composes this room's sections: imported for types only
    from covrl.train.config import TrainConfig

__all__ = ["RunComplete", "check_resume_target", "find_resume_point", "recorded_initial_weights",
           "refuse_fresh_start_over", "resume_command"]


class RunComplete(Exception):
    """`--resume` of a run that already did every step asked of it: nothing to train. `covrl train` prints the
    message (what to do to train further) and exits 0, without loading anything or touching the folder."""


def resume_command(run_dir: Path) -> str:
    """`covrl train --resume --name X` for a run folder (X: the name under runs/, else the folder's path)."""
    run_dir = Path(run_dir)
    return f"covrl train --resume --name {run_dir.name if run_dir.parent == Path('runs') else run_dir}"


def check_resume_target(cfg: TrainConfig, run_dir: Path) -> None:
    """Before anything is loaded: a completed run whose newest checkpoint holds its last step, and that
    `loop.steps` asks no more of, is complete (RunComplete, exit 0, nothing re-evaluated); a completed run that
    kept only its final weights (checkpoint.final=weights) cannot train on (CheckpointError naming what to do
    instead). A newest checkpoint behind the last step (checkpoint.at_end=false) resumes as before, and a run
    without any checkpoint is left to the fresh-start rule (`refuse_fresh_start_over`)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(summary, dict) or summary.get("status") != "completed" or not isinstance(summary.get("steps"), int):
        return
    steps, name = summary["steps"], run_dir.name
    full = ckpt.list_checkpoints(run_dir)
    final = ckpt.final_weights(run_dir)
    weights_only = final is not None and not full
    start_new = (f"start a new run from them: covrl train --config FILE model.source=hf "
                 f"model.path={final / ckpt.MODEL_DIR}") if final is not None else ""
    at_end = ckpt.marker(full[-1]).get("step") == steps if full else weights_only
    if steps >= cfg.loop.steps and at_end:
        if weights_only:
            raise RunComplete(f"run {name} is complete ({steps} steps); it kept its final weights only ({final}, "
                              f"checkpoint.final=weights), so it cannot train further; to train on, {start_new}")
        raise RunComplete(f"run {name} is complete ({steps} steps); to train further: {resume_command(run_dir)} "
                          f"loop.steps={2 * steps}")
    if weights_only:
        raise ckpt.CheckpointError(
            f"--resume: run {name} completed {steps} steps and kept its final weights only ({final}, "
            f"checkpoint.final=weights): no optimizer state, so it cannot be resumed for loop.steps="
            f"{cfg.loop.steps}; {start_new}")


def _read_resume_point(path: Path, model) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Everything `prepare_run` needs from a checkpoint, read and checked before anything is changed (so an
    unloadable one can be skipped for an older one)."""
    state = ckpt.load_state(path)
    missing = [k for k in ("trainer", "stream", "rng", "loop") if not isinstance(state, dict) or k not in state]
    if missing or not all(k in state["loop"] for k in ("step", "metrics_lines")):
        raise ckpt.CheckpointError(f"{path / ckpt.STATE_FILE}: not a run checkpoint (missing "
                                   f"{missing or ['loop.step/metrics_lines']})")
    return state, ckpt.read_model_weights(model, path / ckpt.MODEL_DIR)


def refuse_fresh_start_over(run_dir: Path) -> None:
    """`--resume` without a checkpoint starts from scratch, which must never replace a finished run (e.g. one
    run with checkpoints off)."""
    try:
        status = json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return
    if status == "completed":
        raise FileNotFoundError(f"--resume: {run_dir} holds a completed run and no complete checkpoint; nothing "
                                "to resume (start a new run, or delete the folder to redo it)")


def find_resume_point(run_dir: Path, model, resume: bool) -> tuple[Path | None, dict | None, dict | None, list]:
    """The newest complete checkpoint that loads (path, state, weights) and the newer ones that did not (renamed
    `corrupt-*`, never tried again); (None, None, None, []) for a fresh run or a folder with no checkpoint."""
    if not resume:
        return None, None, None, []
    if not ckpt.list_checkpoints(run_dir):
        incomplete = _set_aside_incomplete(run_dir, "none is complete")
        print(f"warning: --resume: {run_dir}/checkpoints holds no complete checkpoint (killed before the first "
              f"one?); starting the run from scratch in {run_dir}", file=sys.stderr)
        return None, None, None, incomplete
    latest, loaded, skipped = ckpt.newest_loadable(run_dir, lambda p: _read_resume_point(p, model))
    if latest is None:
        raise ckpt.CheckpointError(f"--resume: no checkpoint in {run_dir}/checkpoints loads (nothing was "
                                   "changed):\n" + "\n".join(f"  {p.name}: {why}" for p, why in skipped))
    for p, why in skipped:   # out of the listing: never tried again, never kept by pruning over a good one
        moved = ckpt.set_aside(p)
        print(f"warning: --resume: skipped {p} ({why}); renamed it {moved.name}; resuming from the older "
              f"{latest.name}", file=sys.stderr)
    state, weights = loaded
    return latest, state, weights, skipped + _set_aside_incomplete(run_dir, f"resuming from {latest.name}")


def _set_aside_incomplete(run_dir: Path, then: str) -> list[tuple[Path, str]]:
    """Rename `ckpt-*` folders that lost their COMPLETE marker or trainer_state.pt `corrupt-*`, with a warning (a
    resumed run would otherwise write over one of them, or keep it past pruning)."""
    out = []
    for p in ckpt.incomplete_checkpoints(run_dir):
        why = f"no {ckpt.COMPLETE} marker" if not (p / ckpt.COMPLETE).is_file() else f"no {ckpt.STATE_FILE}"
        moved = ckpt.set_aside(p)
        print(f"warning: --resume: skipped {p} ({why}: not a complete checkpoint); renamed it {moved.name}; {then}",
              file=sys.stderr)
        out.append((p, why))
    return out


def recorded_initial_weights(run_dir: Path) -> dict[str, Any] | None:
    """The initial-weights record of the attempt a resume continues (its summary.json), before it is rewritten."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("initial_weights")
    except (OSError, ValueError):
        return None
