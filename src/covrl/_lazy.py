"""Lazy import of optional extras with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    pass


def require(module: str, extra: str) -> ModuleType:
    """Import `module` or raise an error telling the user which covrl extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise MissingExtraError(
            f"'{module}' is not installed; install the extra with: pip install 'covrl[{extra}]'"
        ) from err
