"""Registry entries of covrl.math: a registered function, the caller-supplied inputs it accepts and its user
options, read once from its signature when it is registered (never per call)."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, create_model


def reject_bool(value: Any) -> Any:
    """Before-validator of a numeric field: pydantic would read True as 1.0 (e.g. a YAML `clip_low: true` would
    silently be a clip of 1), so a boolean is an error."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {value!r}")
    return value


def _is_numeric(annotation: Any) -> bool:
    """Whether `annotation` admits int or float (alone or in a union, e.g. `float | None`) but not bool."""
    annotation = _bare(annotation)
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        return bool not in args and any(a in (int, float) for a in args)
    return False


@dataclass(frozen=True)
class Registered:
    """`name` -> `fn`. `inputs`: the caller-supplied keyword inputs (of the registry's `supplied` set) that `fn`
    accepts. `options`: every other keyword parameter, name -> inspect.Parameter (annotation resolved), in
    signature order. `options_model`: a pydantic model of the options (types and defaults), extra keys
    forbidden."""

    name: str
    fn: Callable[..., Any]
    inputs: frozenset[str]
    options: Mapping[str, inspect.Parameter]
    options_model: type[BaseModel]

    @classmethod
    def build(cls, name: str, fn: Callable[..., Any], supplied: frozenset[str], *, positional: int = 0,
              **extra: Any):
        """The entry of `fn`; its first `positional` parameters are passed positionally (not inputs or options),
        `extra`: the fields a subclass adds."""
        # extras kept: an option may carry its bounds, e.g. Annotated[float, Field(ge=0)], which the model checks
        hints = typing.get_type_hints(fn, include_extras=True)
        params = list(inspect.signature(fn).parameters.values())[positional:]
        keyword = [p for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        options = {p.name: p.replace(annotation=hints.get(p.name, Any)) for p in keyword if p.name not in supplied}
        fields = {n: (Annotated[p.annotation, BeforeValidator(reject_bool)] if _is_numeric(p.annotation)
                      else p.annotation, ... if p.default is p.empty else p.default) for n, p in options.items()}
        model = create_model(f"{name}_options", __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True),
                             **fields)
        return cls(name=name, fn=fn, inputs=frozenset(p.name for p in keyword if p.name in supplied),
                   options=MappingProxyType(options), options_model=model, **extra)

    def describe_options(self) -> str:
        """`name (type = default), ...` for error messages; '(none)' when the function has no options."""
        parts = []
        for n, p in sorted(self.options.items()):
            kind = _type_name(p.annotation)
            parts.append(f"{n} ({kind})" if p.default is p.empty else f"{n} ({kind} = {p.default!r})")
        return ", ".join(parts) or "(none)"

    def unknown_options(self, keys) -> list[str]:
        return [k for k in keys if k not in self.options]

    def check_no_bool(self, values: Mapping[str, Any]) -> None:
        """TypeError naming the option when a numeric option is given a boolean (the direct-call path, which
        does not run `validate_options`)."""
        for k, v in values.items():
            if isinstance(v, bool) and k in self.options and _is_numeric(self.options[k].annotation):
                raise TypeError(f"{self.name} option {k} expects a number, got the boolean {v!r}")

    def validate_options(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The given options, type-checked and coerced by `options_model` (pydantic ValidationError if one is
        wrong); options left out keep the function's own defaults."""
        checked = self.options_model.model_validate(dict(values))
        return {k: getattr(checked, k) for k in values}


def _bare(annotation: Any) -> Any:
    """The type inside Annotated[type, ...] (bounds and validators left out)."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation


def _type_name(annotation: Any) -> str:
    annotation = _bare(annotation)
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("torch.", "").replace("NoneType", "None")
