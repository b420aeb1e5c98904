"""Load a training config: YAML file + dotted `key=value` overrides -> validated `TrainConfig`.

Every error names the field, the file and line (or the override) and, where it applies, the allowed keys or
values, e.g. ``configs/x.yaml:12: optim.lrr: unknown key; allowed keys: betas, eps, lr, ...``.

The machinery is `covrl.settings` (generic in the root model, importable from every layer); the sections are
defined by the layers that use them and composed in `covrl.train.config`. This module sits above `covrl.train`
and is the stable public entry point; code inside covrl's layers imports `covrl.settings` /
`covrl.train.config` instead.  `python -m covrl.config` prints the reference table of docs/configuration.md."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from covrl.settings import ConfigError, apply_overrides, dump_config, parse_overrides, read_yaml
from covrl.settings import config_reference as _config_reference
from covrl.settings import format_validation_error as _format_validation_error
from covrl.train import TrainConfig, build_config, load_config

__all__ = ["ConfigError", "TrainConfig", "apply_overrides", "build_config", "config_reference", "dump_config",
           "format_validation_error", "load_config", "load_preset", "override_strings", "parse_overrides",
           "preset_path", "read_yaml"]

# the presets ship in the package (package data); the repository's configs/ is a link to that folder
_PACKAGED = "configs"


def preset_path(name: str) -> Path:
    """Path of the preset `name` ("tiny", "default", ...): configs/NAME.yaml of the installed package."""
    folder = resources.files("covrl").joinpath(_PACKAGED)
    packaged = folder.joinpath(f"{name}.yaml")
    if not packaged.is_file():
        known = sorted(Path(str(f.name)).stem for f in folder.iterdir() if f.name.endswith(".yaml"))
        raise FileNotFoundError(f"no config preset {name!r}; known: {', '.join(known) or 'none'}")
    return Path(str(packaged))


def override_strings(overrides: dict[str, Any]) -> list[str]:
    """{"optim.lr": 1e-3, "run.name": None, ...} -> ["optim.lr=0.001", "run.name=null", ...]: load_config's
    `key=value` form. Non-strings are written as JSON (which load_config parses back as YAML), so numbers, None,
    booleans, lists and dicts keep their type; a dict value replaces the whole section `key`."""
    return [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in overrides.items()]


def load_preset(name: str, overrides: dict[str, Any] | list[str] | None = None) -> TrainConfig:
    """configs/NAME.yaml with dotted `overrides` ({"optim.lr": 1e-3} or ["optim.lr=1e-3"]) applied, validated."""
    strings = override_strings(overrides) if isinstance(overrides, dict) else list(overrides or [])
    return load_config(preset_path(name), strings)


def format_validation_error(err: ValidationError, *, source: str = "<config>",
                            lines: dict[tuple, int] | None = None, overrides: dict[tuple, str] | None = None,
                            root: type[BaseModel] = TrainConfig) -> str:
    """One line per problem: `where: field: what is wrong (allowed ...)` (root model: TrainConfig)."""
    return _format_validation_error(err, source=source, lines=lines, overrides=overrides, root=root)


def config_reference(root: type[BaseModel] = TrainConfig) -> str:
    """Markdown reference of every config field: dotted key, type, default, description (docs/configuration.md)."""
    return _config_reference(root)


if __name__ == "__main__":  # python -m covrl.config > reference table
    print(config_reference(), end="")
