"""What one trainer step returns."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepResult(Mapping):
    """The outcome of `Trainer.step`: flat float metrics (read it like a dict: `result["loss/policy"]`), whether
    the update was applied, and the trainer's data clock after the step."""

    metrics: dict[str, float] = field(default_factory=dict)
    skip_reason: str | None = None   # None: the optimizer step was applied
    version: int = 0                 # policy version after the step (optimizer updates applied)
    rollouts: int = 0                # rollouts consumed so far, skipped steps included

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None

    def __getitem__(self, key: str) -> float:
        return self.metrics[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)
