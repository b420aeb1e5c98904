"""Load a training config: YAML file + dotted `key=value` overrides -> validated `TrainConfig`.

Every error names the field, the file and line (or the override) and, where it applies, the allowed keys or
values, e.g. ``configs/x.yaml:12: optim.lrr: unknown key; allowed keys: betas, eps, lr, ...``.

The machinery is `covrl.settings` (generic in the root model, importable from every layer); the sections are
defined by the layers that use them and composed in `covrl.train.config`. This module sits above `covrl.train`
and is the stable public entry point; code inside covrl's layers imports `covrl.settings` /
`covrl.train.config` instead.  `python -m covrl.config` prints the reference table of docs/configuration.md."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from covrl.settings import ConfigError, apply_overrides, dump_config, parse_overrides, read_yaml
from covrl.settings import config_reference as _config_reference
from covrl.settings import format_validation_error as _format_validation_error
from covrl.train.config import TrainConfig, build_config, load_config

__all__ = ["ConfigError", "TrainConfig", "apply_overrides", "build_config", "config_reference", "dump_config",
           "format_validation_error", "load_config", "parse_overrides", "read_yaml"]


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
