"""Named config presets (configs/NAME.yaml) for the reproductions, benchmarks and tests: an experiment's
config reads as "preset + these overrides".

The YAMLs live in the package (`src/covrl/configs/`, package data, so an installed covrl has them); the
repository's `configs/` is a link to that folder, so `--config configs/default.yaml` works in a checkout."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from covrl.config import load_config
from covrl.train.config import TrainConfig

_CHECKOUT_CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def preset_path(name: str) -> Path:
    """Path of the preset `name` ("tiny", "default"): the installed package's copy, else the checkout's."""
    packaged = resources.files("covrl").joinpath("configs", f"{name}.yaml")
    if packaged.is_file():
        return Path(str(packaged))
    path = _CHECKOUT_CONFIGS / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in _CHECKOUT_CONFIGS.glob("*.yaml")) if _CHECKOUT_CONFIGS.is_dir() else []
        raise FileNotFoundError(f"no config preset {name!r} (looked in the package's configs/ and {path.parent}); "
                                f"known: {', '.join(known) or 'none'}")
    return path


def override_strings(overrides: dict[str, Any]) -> list[str]:
    """{"optim.lr": 1e-3, "run.name": None, ...} -> ["optim.lr=0.001", "run.name=null", ...]: load_config's
    `key=value` form. Non-strings are written as JSON (which load_config parses back as YAML), so numbers, None,
    booleans, lists and dicts keep their type; a dict value replaces the whole section `key`."""
    return [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in overrides.items()]


def load_preset(name: str, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """configs/NAME.yaml with dotted `overrides` applied, validated (covrl.config.load_config)."""
    return load_config(preset_path(name), override_strings(overrides or {}))


# configs/tiny.yaml trains on three-term addition; the reproductions use one-digit addition (100 problems).
ONE_DIGIT_ADDITION = {"task.arithmetic.num_terms": 2, "task.n_train": 1000, "task.n_eval": 50}
# a run driven by an experiment: it evaluates and reports itself, so the run's own evals, checkpoints, console
# and curve plots are off
DRIVEN = {"eval.before": False, "eval.after": False, "checkpoint.at_end": False, "logging.console": False,
          "logging.curves": False}
