"""Checkpoints: atomic writes, latest-complete lookup, RNG capture, model weights round trip.

Layout: `<run>/checkpoints/ckpt-<rollouts:09d>/{model/, trainer_state.pt, COMPLETE}`, plus `dcp/` for a
sharded (FSDP2) trainer: its weights and optimizer state as torch.distributed.checkpoint shards, every rank
writing its own into the same (shared) folder; `model/` then holds the full weights gathered on rank 0 (the
export that eval and the sampler read) and trainer_state.pt names `dcp/` in place of the optimizer state. A checkpoint is written
into a hidden temporary folder, the COMPLETE marker is written last, then the folder is renamed into place, so
a kill at any moment leaves either no new checkpoint or a complete one (the previous one stays usable). A
complete checkpoint that does not load (damaged later: truncated weights or state) is skipped by resume for the
newest one that does (`newest_loadable`) and renamed `corrupt-ckpt-...` (`set_aside`).
`trainer_state.pt` holds only tensors, numbers, strings, lists and dicts and is read with
`torch.load(..., weights_only=True)`. With `checkpoint.final=weights` a completed run ends with its weights alone in
`checkpoints/final/{model/, COMPLETE}` (not a `ckpt-*`: never listed, never resumed) and no `ckpt-*` left.
Retention: `checkpoint.keep_last` newest complete `ckpt-*` (`prune_checkpoints`)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from covrl.train.faults import fault_point
from covrl.train.parallel import shards
from covrl.train.parallel.wrappers import DCP_KEY

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"
PREFIX = "ckpt-"
FINAL = "final"   # checkpoint.final=weights: a completed run's weights alone, checkpoints/final/ (never resumed)


class CheckpointError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------ RNG

def capture_rng(generator: torch.Generator | None = None) -> dict[str, Any]:
    """python, numpy, torch (and CUDA) RNG states, plus the sampler's generator, as weights_only-safe values."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [int(version), [int(x) for x in internal], gauss],
        "numpy": [str(np_state[0]), torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["sampler_generator"] = generator.get_state()
    return state


def restore_rng(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "sampler_generator" in state:
        generator.set_state(state["sampler_generator"])


# ---------------------------------------------------------------------------------------------- model

def _unwrap_peft(model):
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def save_model(model, directory: Path, tokenizer=None, weights: dict[str, torch.Tensor] | None = None) -> None:
    """`save_pretrained` (safetensors); LoRA models save their adapters. The tokenizer goes alongside so the
    folder can be loaded with `model.source=hf model.path=<folder>`. `weights`: the full state dict to write
    in place of the model's own (a sharded model's, gathered)."""
    directory.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # transformers prints a shard progress bar on save; keep run logs clean
    model.save_pretrained(str(directory), safe_serialization=True, state_dict=weights)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def read_model_weights(model, directory: Path) -> dict[str, torch.Tensor]:
    """Read the weights saved by `save_model` and check them against `model` (names and shapes) without
    touching the model, so a resume can try an older checkpoint when this one is unreadable."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if _unwrap_peft(model):
        path = directory / "adapter_model.safetensors"
        if not path.is_file():
            raise CheckpointError(f"{directory}: no adapter_model.safetensors (the run trains LoRA adapters)")
        try:
            return load_file(str(path))
        except Exception as err:  # a truncated/corrupt file: SafetensorError names no file
            raise CheckpointError(f"{path}: unreadable weights ({err})") from None
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as err:  # a truncated/corrupt file: SafetensorError names no file
            raise CheckpointError(f"{f}: unreadable weights ({err})") from None
    own = model.state_dict()
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in own if k not in state and k not in tied]
    unexpected = [k for k in state if k not in own]
    reshaped = [f"{k} {tuple(state[k].shape)} != {tuple(own[k].shape)}" for k in state
                if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or reshaped:
        raise CheckpointError(f"{directory}: weights do not match the model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}, wrong shape {reshaped[:5]})")
    return state


def apply_model_weights(model, weights: dict[str, torch.Tensor]) -> None:
    """Copy weights returned by `read_model_weights` into the model (exact round trip)."""
    if _unwrap_peft(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, weights)
        return
    model.load_state_dict(weights, strict=False)  # names and shapes were checked when reading


def load_model_weights(model, directory: Path) -> None:
    """Load weights saved by `save_model` into an already built model of the same shape (exact round trip)."""
    apply_model_weights(model, read_model_weights(model, directory))


# --------------------------------------------------------------------------------------- checkpoints

def weights_fingerprint(model) -> str:
    """A digest of every tensor of the model's state (names, dtypes, shapes, bytes): equal digests mean
    bit-identical weights. What `covrl diagnose` checks a rebuilt initial model against."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def checkpoint_name(rollouts: int) -> str:
    return f"{PREFIX}{int(rollouts):09d}"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / STATE_FILE).is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (by data clock)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and is_complete(p)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def incomplete_checkpoints(run_dir: Path) -> list[Path]:
    """`ckpt-*` folders without COMPLETE or trainer_state.pt. A write never leaves one (the folder is renamed into
    place after its marker): a file was deleted later. Never listed; resume sets them aside with a warning."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and not is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def newest_loadable(run_dir: Path, read: Callable[[Path], Any]) -> tuple[Path | None, Any, list[tuple[Path, str]]]:
    """The newest complete checkpoint that `read(path)` loads (it raises CheckpointError when it cannot):
    (path, what `read` returned, [(newer checkpoint skipped, why)]). (None, None, skipped) when none loads,
    including when there is none."""
    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, read(path), skipped
        except CheckpointError as err:
            skipped.append((path, str(err)))
    return None, None, skipped


def set_aside(path: Path) -> Path:
    """Rename an unloadable checkpoint to `checkpoints/corrupt-<name>[-k]`: no longer listed (so neither
    resumed from nor counted by pruning, which would otherwise keep it instead of a good one), but kept for
    inspection."""
    path = Path(path)
    target = path.with_name(f"corrupt-{path.name}")
    k = 2
    while target.exists():
        target = path.with_name(f"corrupt-{path.name}-{k}")
        k += 1
    os.replace(path, target)
    return target


def save_checkpoint(run_dir: Path, name: str, *, model, state: dict[str, Any], tokenizer=None,
                    info: dict[str, Any] | None = None, with_state: bool = True,
                    sharded: Callable[[Path], dict[str, torch.Tensor] | None] | None = None) -> Path:
    """Write `<run>/checkpoints/<name>/` atomically (tmp folder, COMPLETE last, rename). Returns its path.
    `sharded(folder)` (a sharded trainer's, a collective of every rank) writes the shards into `folder/dcp`
    and returns the full weights for `model/`; the marker goes after it, so the shards are inside the
    atomic checkpoint."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        weights = sharded(tmp) if sharded is not None else None
        save_model(model, tmp / MODEL_DIR, tokenizer, weights)
        fault_point("checkpoint-write")  # reliability tests: COVRL_FAULT (no-op otherwise)
        if with_state:
            torch.save(state, tmp / STATE_FILE)
        marker = {"name": name, "time": time.time(), **(info or {})}
        with open(tmp / COMPLETE, "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:  # e.g. a full disk: drop the partial folder (frees space), name what is still usable
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(run_dir)
        raise CheckpointError(f"writing checkpoint {final} failed: {err}; the last complete checkpoint "
                              f"{previous or '(none)'} is intact") from err
    fault_point("checkpoint-commit")  # reliability tests: COVRL_FAULT (no-op otherwise)
    if final.exists():  # re-saving the same data clock (e.g. end of a resumed run): swap atomically
        old = root / f".old-{name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def load_state(path: Path) -> dict[str, Any]:
    """trainer_state.pt of a checkpoint (weights_only=True)."""
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE} marker or {STATE_FILE})")
    try:
        state = torch.load(path / STATE_FILE, weights_only=True, map_location="cpu")
    except Exception as err:  # torch's own message suggests weights_only=False: never for a file we cannot trust
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path / STATE_FILE} is corrupt or holds more than tensors/numbers/strings "
                              f"({first[:200]}); it is not unpickled") from None
    optimizer = state.get("trainer", {}).get("optimizer") if isinstance(state, dict) else None
    if isinstance(optimizer, dict) and DCP_KEY in optimizer:   # the shards' folder, wherever the run now lives
        try:
            shards.check(path / optimizer[DCP_KEY])
        except ValueError as err:   # missing, truncated or overwritten: met here, while an older one can be used
            raise CheckpointError(f"{path}: the sharded state {optimizer[DCP_KEY]}/ is missing or damaged "
                                  f"({err})") from None
        optimizer[DCP_KEY] = str(path / optimizer[DCP_KEY])
    return state


def marker(path: Path) -> dict[str, Any]:
    """The COMPLETE marker of a checkpoint (name, time, step, rollouts, ...); {} when unreadable."""
    try:
        data = json.loads((Path(path) / COMPLETE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def final_weights(run_dir: Path) -> Path | None:
    """checkpoints/final/ of a run that ended with checkpoint.final=weights (complete), else None."""
    path = Path(run_dir) / "checkpoints" / FINAL
    return path if (path / COMPLETE).is_file() and (path / MODEL_DIR).is_dir() else None


def folder_bytes(path: Path) -> int:
    """Bytes of the files under `path` (links not followed; files that vanish meanwhile are skipped)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def format_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as `du -h --si` and file managers show them)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def prune_checkpoints(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (0: all of them)."""
    removed = []
    ckpts = list_checkpoints(run_dir)
    for p in ckpts[:-keep_last] if keep_last > 0 else ckpts:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def clean_temporary(run_dir: Path) -> None:
    """Remove half-written checkpoint folders left by a killed run."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                final = root / p.name[len(".old-"):].rsplit("-", 1)[0]
                if p.name.startswith(".old-") and not final.exists() and is_complete(p):
                    os.replace(p, final)  # killed between the two renames of a re-save: the old one is the copy
                    continue
                shutil.rmtree(p, ignore_errors=True)
