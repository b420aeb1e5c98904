"""Deterministic prompt stream: the order depends only on (seed, position), so a run resumed at position k
sees exactly the prompts the uninterrupted run would have seen."""

from __future__ import annotations

import random
from typing import Generic, TypeVar

T = TypeVar("T")


class DataStream(Generic[T]):
    """Endless stream over `items`: epoch e is a permutation drawn from Random(seed · 1_000_003 + e); the
    stream position counts items handed out since the start of the run (the prompt index of `RolloutBatch`).

    `take(k)` -> (items, positions). State: `position` (an int) via `state_dict()` / `load_state_dict()`.
    """

    def __init__(self, items: list[T], seed: int = 0, position: int = 0, *, shuffle: bool = True):
        if not items:
            raise ValueError("the task has no training examples (empty dataset); check task.n_train / task.path")
        self.items = list(items)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.position = int(position)
        self._epoch = -1
        self._order: list[int] = []

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(len(self.items)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def index_at(self, position: int) -> int:
        """Index into `items` of the item at stream `position`."""
        epoch, offset = divmod(position, len(self.items))
        return self._order_of(epoch)[offset]

    def take(self, k: int) -> tuple[list[T], list[int]]:
        """The next k items and their stream positions; advances the stream."""
        positions = list(range(self.position, self.position + k))
        self.position += k
        return [self.items[self.index_at(p)] for p in positions], positions

    @property
    def epoch(self) -> float:
        return self.position / len(self.items)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed, "size": len(self.items)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state.get("size", len(self.items))) != len(self.items):
            raise ValueError(f"data stream size changed since the checkpoint: {state['size']} -> {len(self.items)} "
                             f"(task.n_train or the dataset file changed); resume needs the same data")
        self.seed = int(state.get("seed", self.seed))
        self.position = int(state["position"])
