"""Staleness bookkeeping of asynchronous RL on a data clock (docs/theory.md §9): admission control, a rollout queue
ordered by admission ticket, an optional drop of stale rollouts, and the per-sample staleness record.

Vocabulary
- B: rollouts consumed per optimizer step. Trainer version v = optimizer steps done (the weights it trains).
- Sampler version s: the trainer version whose weights the sampler holds (s ≤ v; it lags by the weight sync).
- A *chunk* is what one `generate` call produces (a few whole prompt groups). Every chunk gets consecutive
  tickets at admission; the trainer consumes rollouts strictly in ticket order, B at a time.
- Staleness of a consumed rollout, in steps: v − s_rollout (v at consumption, s_rollout when it was generated);
  in rollouts: (v − s_rollout)·B (rollouts consumed by the trainer while it waited).

Admission control (AReaL-style, with the queue sized in rollouts): a chunk of n rollouts may start with sampler
version s only if n ≤ capacity, where

    capacity(s) = (s + 1)·B + Q − (accepted + running)

`accepted` counts every completed rollout that was not dropped (consumed or still queued), `running` the
rollouts being generated, Q = `queue_rollouts` (the queue size; Q = η·B gives the classic
`(η + s + 1)·B − (accepted + running)`). Why it bounds staleness: the rollout's position p in the consumption
order is at most `accepted + running` at its admission (drops only move it earlier), so p < (s+1)·B + Q and
it is consumed at step ⌊p/B⌋ ≤ s + ⌈Q/B⌉; its staleness is at most ⌈Q/B⌉ steps (0 when Q = 0: exactly the
synchronous loop), whatever the generation times. Also, rollouts admitted but not yet consumed never exceed
Q + B. Consumption in ticket order is what makes the bound hold when chunks finish out of order.

Drop (optional, `drop_older_than_rollouts` D): a completed chunk at the head of the queue whose staleness in
rollouts exceeds D is discarded instead of trained on; its rollouts leave `accepted`, which frees capacity.

Filter (dynamic sampling in the async loop): a chunk may complete with fewer rows than it was admitted with
(`complete(chunk, payload, kept=...)`: the groups without reward contrast removed). Only the kept rows enter
`accepted`, so the filtered ones free capacity and the sampler generates more (DAPO's oversampling, on the
data clock); the bound is unchanged, since like a drop a filter only moves later rollouts earlier in the
consumption order. A batch is then the next B kept rows in ticket order, which may split a chunk (`split`: a
function payload, k -> (first k rows, the rest)); the rest stays at the head of the queue.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Chunk", "StalenessManager", "TakeResult", "staleness_metrics"]


@dataclass
class Chunk:
    """One admitted generation unit: tickets [ticket, ticket + size), generated with weights `version`."""

    ticket: int
    size: int
    version: int
    meta: dict = field(default_factory=dict)   # e.g. sampler id, RNG state before generating
    payload: Any = None                        # the scored RolloutBatch once complete
    done: bool = False


@dataclass
class TakeResult:
    """What one optimizer step consumes: whole chunks totalling B rollouts, in ticket order."""

    chunks: list[Chunk]
    staleness_steps: list[int]          # per rollout
    dropped: list[Chunk]
    metrics: dict[str, float]


def staleness_metrics(staleness_steps: list[int], batch_rollouts: int) -> dict[str, float]:
    """mean / max staleness in steps and in rollouts (= steps·B) and the fraction of stale (> 0) rollouts."""
    if not staleness_steps:
        return {"async/staleness_mean": 0.0, "async/staleness_max": 0.0, "async/stale_fraction": 0.0,
                "async/lag_rollouts_mean": 0.0}
    n = len(staleness_steps)
    mean = sum(staleness_steps) / n
    return {"async/staleness_mean": mean, "async/staleness_max": float(max(staleness_steps)),
            "async/stale_fraction": sum(1 for s in staleness_steps if s > 0) / n,
            "async/lag_rollouts_mean": mean * batch_rollouts}


class StalenessManager:
    """Admission control + ticket-ordered queue (pure bookkeeping; the loop adds the locking).

    batch_rollouts            B, rollouts per optimizer step
    queue_rollouts          Q, the queue size in rollouts (None: unbounded, no admission control)
    max_running               at most this many rollouts generating at once (None: unbounded)
    drop_older_than_rollouts  D, drop a completed chunk whose staleness·B exceeds D (None: never drop)
    split                     payload, k -> (first k rows, rest): lets a batch end inside a filtered chunk
    """

    def __init__(self, batch_rollouts: int, queue_rollouts: int | None = 0, *, max_running: int | None = None,
                 drop_older_than_rollouts: int | None = None,
                 split: Callable[[Any, int], tuple[Any, Any]] | None = None) -> None:
        if int(batch_rollouts) < 1:
            raise ValueError(f"batch_rollouts must be >= 1, got {batch_rollouts}")
        for name, value in (("queue_rollouts", queue_rollouts), ("max_running", max_running),
                            ("drop_older_than_rollouts", drop_older_than_rollouts)):
            if value is not None and int(value) < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        if max_running is not None and int(max_running) < 1:
            raise ValueError(f"max_running must be >= 1 or None, got {max_running}")
        self.batch_rollouts = int(batch_rollouts)
        self.queue_rollouts = None if queue_rollouts is None else int(queue_rollouts)
        self.max_running = None if max_running is None else int(max_running)
        self.drop_older_than_rollouts = None if drop_older_than_rollouts is None else int(drop_older_than_rollouts)
        self.accepted = 0       # completed, not dropped (queued or consumed)
        self.running = 0        # admitted, not completed
        self.consumed = 0       # handed to the trainer
        self.dropped = 0        # discarded as too stale
        self.skipped_batches = 0   # consumed batches whose update was not applied (no new policy version)
        self.filtered = 0          # rows removed at completion (no reward contrast), all time
        self.filtered_since_take = 0
        self.split = split
        self.next_ticket = 0
        self._chunks: list[Chunk] = []     # admitted and not yet consumed/dropped, ticket order
        self._restart: list[Chunk] = []    # admitted before a resume, to be generated again (ticket order)
        self._pending_drops: list[Chunk] = []

    # -- admission ---------------------------------------------------------------------------------------------
    @property
    def staleness_bound_steps(self) -> int | None:
        """⌈Q/B⌉: the most steps any consumed rollout can lag (None when unbounded)."""
        if self.queue_rollouts is None:
            return None
        return math.ceil(self.queue_rollouts / self.batch_rollouts)

    def capacity(self, sampler_version: int) -> int:
        """capacity(s) = (s + m + 1)·B + Q − (accepted + running), also limited by max_running − running, with
        m = `skipped_batches`. A very large number when both are unbounded.

        Why m: a consumed batch whose update is skipped (non-finite loss, empty batch) advances the data clock but
        not the policy version, so without m the sampler's version would stop admitting while the trainer waits for
        data (a deadlock). The bound still holds: a rollout admitted at (s, m) is consumed in a batch k ≤ s + m + η,
        when the trainer's version is at most k − m ≤ s + η (skips are never undone)."""
        cap = math.inf
        if self.queue_rollouts is not None:
            cap = (int(sampler_version) + self.skipped_batches + 1) * self.batch_rollouts \
                + self.queue_rollouts - (self.accepted + self.running)
        if self.max_running is not None:
            cap = min(cap, self.max_running - self.running)
        return int(cap) if cap != math.inf else 2**62

    def batch_skipped(self) -> None:
        """The last batch taken was not applied (the trainer skipped its update): see `capacity`."""
        self.skipped_batches += 1

    def try_start(self, size: int, sampler_version: int, meta: dict | None = None) -> Chunk | None:
        """Admit a chunk of `size` rollouts generated with weights `sampler_version`, or return None.

        A chunk left over from a resume (see `load_state_dict`) is handed out first, with its original tickets
        and meta; it is already counted in `running`, and its new version is ≥ the old one, so it still obeys the
        bound."""
        if self._restart:
            chunk = self._restart.pop(0)
            chunk.version = int(sampler_version)
            chunk.meta["restarted"] = True
            return chunk
        if size < 1:
            raise ValueError(f"chunk size must be >= 1, got {size}")
        if size > self.capacity(sampler_version):
            return None
        chunk = Chunk(ticket=self.next_ticket, size=int(size), version=int(sampler_version), meta=dict(meta or {}))
        self.next_ticket += size
        self.running += size
        self._chunks.append(chunk)
        return chunk

    def requeue(self, chunk: Chunk) -> None:
        """A running chunk whose worker died is handed out again by `try_start`, first and with its tickets and
        meta (as after a resume), so its rollouts are neither lost nor generated twice."""
        if chunk.done or chunk not in self._chunks:
            raise ValueError(f"only a running chunk of this queue can be requeued (ticket {chunk.ticket})")
        if chunk not in self._restart:
            self._restart.append(chunk)
            self._restart.sort(key=lambda c: c.ticket)

    def complete(self, chunk: Chunk, payload: Any = None, kept: int | None = None) -> None:
        """The chunk finished generating (and was scored); it becomes available in ticket order. `kept`: the
        rows of `payload` when fewer than admitted (the rest filtered out); a chunk that kept none leaves the
        queue."""
        if chunk.done:
            raise ValueError(f"chunk with ticket {chunk.ticket} completed twice")
        kept = chunk.size if kept is None else int(kept)
        if not 0 <= kept <= chunk.size:
            raise ValueError(f"chunk with ticket {chunk.ticket}: kept {kept} of {chunk.size} rows")
        if kept < chunk.size and self.split is None and kept:
            raise ValueError("a chunk completed with fewer rows needs a `split` function (batches may end in it)")
        chunk.done = True
        chunk.payload = payload
        self.running -= chunk.size
        self.accepted += kept
        self.filtered += chunk.size - kept
        self.filtered_since_take += chunk.size - kept
        chunk.size = kept
        if not kept:
            self._chunks.remove(chunk)

    # -- consumption -------------------------------------------------------------------------------------------
    def _is_stale(self, chunk: Chunk, trainer_version: int) -> bool:
        d = self.drop_older_than_rollouts
        return d is not None and (trainer_version - chunk.version) * self.batch_rollouts > d

    def _drop_stale_head(self, trainer_version: int) -> list[Chunk]:
        """Drop completed chunks that are too stale, scanning the contiguous completed prefix of the queue."""
        dropped, keep = [], []
        prefix = True
        for chunk in self._chunks:
            prefix = prefix and chunk.done
            if prefix and self._is_stale(chunk, trainer_version):
                dropped.append(chunk)
                self.accepted -= chunk.size
                self.dropped += chunk.size
            else:
                keep.append(chunk)
        self._chunks = keep
        return dropped

    def ready(self, trainer_version: int) -> bool:
        """True when the next B rollouts in ticket order are complete (after dropping stale ones)."""
        self._pending_drops += self._drop_stale_head(trainer_version)
        total = 0
        for chunk in self._chunks:
            if not chunk.done:
                return False
            total += chunk.size
            if total >= self.batch_rollouts:
                return True
        return False

    def take(self, trainer_version: int) -> TakeResult:
        """Pop the next B rollouts (whole chunks, ticket order). Call only when `ready(trainer_version)`."""
        if not self.ready(trainer_version):
            raise RuntimeError("take() called before the next batch is complete; check ready() first")
        taken, total = [], 0
        while total < self.batch_rollouts:
            chunk = self._chunks.pop(0)
            need = self.batch_rollouts - total
            if chunk.size > need and self.split is not None:   # the batch ends inside this chunk
                head, rest = self.split(chunk.payload, need)
                self._chunks.insert(0, Chunk(ticket=chunk.ticket, size=chunk.size - need, version=chunk.version,
                                             meta=dict(chunk.meta), payload=rest, done=True))
                chunk = Chunk(ticket=chunk.ticket, size=need, version=chunk.version, meta=chunk.meta,
                              payload=head, done=True)
            taken.append(chunk)
            total += chunk.size
        if total != self.batch_rollouts:
            raise RuntimeError(f"chunks do not tile the batch: took {total} rollouts for B={self.batch_rollouts}; "
                               "the chunk size must divide the rollouts per step")
        self.consumed += total
        self.filtered_since_take = 0
        staleness = [trainer_version - c.version for c in taken for _ in range(c.size)]
        dropped, self._pending_drops = self._pending_drops, []
        metrics = staleness_metrics(staleness, self.batch_rollouts)
        metrics.update({"async/dropped_rollouts": float(sum(c.size for c in dropped)),
                        "async/dropped_total": float(self.dropped)})
        return TakeResult(chunks=taken, staleness_steps=staleness, dropped=dropped, metrics=metrics)

    # -- observation ---------------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Completed rollouts waiting for the trainer."""
        return sum(c.size for c in self._chunks if c.done)

    @property
    def frontier_ticket(self) -> int:
        """The first ticket not yet consumed (or filtered / dropped): where the data stream stands."""
        return self._chunks[0].ticket if self._chunks else self.next_ticket

    @property
    def outstanding(self) -> int:
        """Admitted rollouts not yet consumed or dropped (queued + running)."""
        return self.accepted + self.running - self.consumed

    def check_invariants(self) -> None:
        """Raise if the counters disagree with the queue (used by tests)."""
        queued = sum(c.size for c in self._chunks if c.done)
        running = sum(c.size for c in self._chunks if not c.done)
        if queued != self.accepted - self.consumed or running != self.running:
            raise AssertionError(f"counters out of sync: queued {queued} vs accepted-consumed "
                                 f"{self.accepted - self.consumed}; running {running} vs {self.running}")

    # -- checkpoint ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Counters and every admitted chunk not yet consumed: completed ones with their payload (trained later
        exactly as they are), running ones as descriptors (generated again after a resume, same tickets)."""
        return {
            "batch_rollouts": self.batch_rollouts, "accepted": self.accepted, "running": self.running,
            "consumed": self.consumed, "dropped": self.dropped, "next_ticket": self.next_ticket,
            "skipped_batches": self.skipped_batches, "filtered": self.filtered,
            "filtered_since_take": self.filtered_since_take,
            "chunks": [{"ticket": c.ticket, "size": c.size, "version": c.version, "meta": c.meta,
                        "done": c.done, "payload": c.payload if c.done else None}
                       for c in self._chunks],
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["batch_rollouts"]) != self.batch_rollouts:
            raise ValueError(f"resumed queue has batch_rollouts={state['batch_rollouts']}, this run "
                             f"{self.batch_rollouts}; the data clock needs the same rollouts per step")
        for key in ("accepted", "running", "consumed", "dropped", "next_ticket"):
            setattr(self, key, int(state[key]))
        self.skipped_batches = int(state.get("skipped_batches", 0))   # absent in checkpoints before it existed
        self.filtered = int(state.get("filtered", 0))
        self.filtered_since_take = int(state.get("filtered_since_take", 0))
        chunks = [Chunk(ticket=int(c["ticket"]), size=int(c["size"]), version=int(c["version"]),
                        meta=dict(c["meta"]), payload=c["payload"], done=bool(c["done"]))
                  for c in state["chunks"]]
        chunks.sort(key=lambda c: c.ticket)
        self._chunks = chunks
        self._restart = [c for c in chunks if not c.done]
