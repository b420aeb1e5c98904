"""The one base class of every config section, so that every section validates the same way, and the rule for
sections that hold alternatives: the options of a choice not taken are refused, never ignored."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Collection
from typing import Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

__all__ = ["SECTION_POLICY", "Section", "config_note", "inactive_choice_message", "known_name", "one_of"]

# extra="forbid": a misspelt key is an error, not a silently ignored setting;
# validate_assignment: `cfg.optim.lr = -1` in code is checked like the same value in a file;
# allow_inf_nan=False: inf/nan are refused at start-up (a field where inf means something opts in explicitly).
# covrl.math.CorrectionConfig repeats this dict (math imports nothing from covrl); a test checks they agree.
SECTION_POLICY = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

_NOTED: set[str] = set()


def one_of(value: str, allowed: Collection[str], what: str) -> str:
    """`value` when it is one of `allowed` (a registry's names), else a ValueError listing them, with the
    closest one when there is one: the one message every registry-backed field gives."""
    if value in allowed:
        return value
    names = sorted(allowed)
    close = difflib.get_close_matches(str(value), names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(names)}{hint}")


def known_name(allowed: Collection[str], what: str) -> Any:
    """The type of a config field that names an entry of a registry: `Annotated[str, known_name(TASKS, "task")]`
    (the registry is read at validation, so entries registered after import count)."""
    return AfterValidator(lambda v: one_of(v, allowed, what))


def config_note(message: str) -> None:
    """One line on stderr about how a config was read (an old key's new name, a preset's options dropped),
    printed once per process: the run goes on, the user learns what to write next time."""
    if message not in _NOTED:
        _NOTED.add(message)
        print(f"note: {message}", file=sys.stderr)


def _value_at(model: BaseModel, dotted: str) -> Any:
    for part in dotted.split("."):
        model = getattr(model, part)
    return model


def inactive_choice_message(where: str, sub: str, choice: str, active: Any, readers: frozenset[str]) -> str:
    """`task.arithmetic is read by task.name=arithmetic only; the active choice is task.name='jsonl': ...`."""
    prefix = f"{where}." if where else ""
    wanted = " or ".join(f"{prefix}{choice}={r}" for r in sorted(readers))
    return (f"{prefix}{sub} is read by {wanted} only; the active choice is {prefix}{choice}={active!r}: "
            f"remove {prefix}{sub} or change {prefix}{choice}")


class Section(BaseModel):
    """Base of every config section (and of the root models such as `TrainConfig`).

    A section with alternatives declares them in `choices`: sub-section -> (the field that chooses, the values
    that read the sub-section), e.g. TaskConfig's ``{"arithmetic": ("name", {"arithmetic"})}``. A sub-section
    that differs from its defaults while its choice is not taken is an error naming the active choice (a
    resolved config, every section at its defaults, still loads); `config_key` is the section's dotted name in
    messages. The loader (covrl.settings.io) drops a preset's options when an override changes the choice."""

    model_config = SECTION_POLICY
    choices: ClassVar[dict[str, tuple[str, frozenset[str]]]] = {}
    config_key: ClassVar[str] = ""

    @model_validator(mode="after")
    def _options_of_inactive_choices(self):
        for sub, (choice, readers) in self.choices.items():
            active = _value_at(self, choice)
            if active in readers:
                continue
            default = type(self).model_fields[sub].get_default(call_default_factory=True)
            if getattr(self, sub) != default:
                raise ValueError(inactive_choice_message(self.config_key, sub, choice, active, readers))
        return self
