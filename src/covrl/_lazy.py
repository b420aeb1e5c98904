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


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's module `__getattr__` (PEP 562) that imports `exports[name]`'s module on first use, so
    importing the package stays cheap; the value is cached in the package's namespace."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(importlib.import_module(package), name, value)   # resolved once
        return value

    return __getattr__
