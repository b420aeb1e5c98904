"""The Sampler protocol: what every backend (covrl.rollout.hf, covrl.rollout.vllm) offers the loops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from covrl.rollout.types import RolloutBatch

__all__ = ["Sampler", "WeightsRefresh"]

# refresh() -> (weights, version) newer than the sampler's, or None: polled between decode steps
WeightsRefresh = Callable[[], "tuple[object, int] | None"]


class Sampler(Protocol):
    version: int

    def generate(self, prompts: list[list[int]], n: int, *, generator: torch.Generator,
                 policy_version: int | None = None, greedy: bool = False,
                 refresh: WeightsRefresh | None = None) -> RolloutBatch: ...

    def load_weights(self, model_or_state_dict, version: int) -> None: ...
