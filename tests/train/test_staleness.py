"""Admission control and the ticket-ordered rollout queue (covrl.train.asyncrl.staleness), driven by a discrete-event
simulation with random generation and training times (hypothesis)."""

from __future__ import annotations

import heapq
import math
import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from covrl.train.asyncrl.staleness import StalenessManager, staleness_metrics


def simulate(*, chunk: int, chunks_per_step: int, lag: int | None, samplers: int, steps: int, seed: int,
             sync_every: int = 1, drop: int | None = None, max_running: int | None = None,
             resume_at: int | None = None, slow_tail: float = 0.0, skip_prob: float = 0.0,
             filter_prob: float = 0.0):
    """Samplers (each one chunk at a time) and one trainer on a shared clock. Generation time per chunk and
    step time are random (seeded); with probability `slow_tail` a chunk takes 20x longer (out-of-order finishes).
    `filter_prob`: each completed row is filtered out with this probability (dynamic sampling); payloads are then
    the lists of the kept rows' tickets.
    A sampler picks up the newest published weights (every `sync_every` steps) before each chunk.
    `resume_at`: after that many steps, round-trip the manager through state_dict (pickled) into a new one;
    running chunks are then generated again. `skip_prob`: a step's update is skipped (no new policy version, as
    after a non-finite loss) with this probability. Returns (manager, consumed chunks, per-step staleness, peaks)."""
    rng = random.Random(seed)
    B = chunk * chunks_per_step
    split = (lambda rows, k: (rows[:k], rows[k:])) if filter_prob else None
    mgr = StalenessManager(B, lag, drop_older_than_rollouts=drop, max_running=max_running, split=split)
    clock = 0.0
    events: list = []            # (time, seq, kind, data)
    seq = 0
    trainer_version, published = 0, 0
    sampler_version = [0] * samplers
    sampler_busy = [False] * samplers
    trainer_busy = False
    consumed, step_staleness = [], []
    peak_outstanding = 0
    steps_done = 0
    epoch = 0                     # bumps at a resume: completions of chunks started before it are ignored

    def push(t, kind, data):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    def try_samplers():
        for i in range(samplers):
            if sampler_busy[i]:
                continue
            sampler_version[i] = published          # weight sync before each chunk
            # with filtering, a chunk shrinks to the room left (AsyncState.chunk_size, groups of one row here)
            size = max(min(chunk, mgr.capacity(published)), 1) if filter_prob else chunk
            c = mgr.try_start(size, sampler_version[i], meta={"sampler": i})
            if c is None:
                continue
            sampler_busy[i] = True
            dur = rng.expovariate(1.0) * (20.0 if rng.random() < slow_tail else 1.0)
            push(clock + dur, "done", (i, c, epoch))

    def try_trainer():
        nonlocal trainer_busy
        if not trainer_busy and steps_done < steps and mgr.ready(trainer_version):
            res = mgr.take(trainer_version)
            consumed.extend(res.chunks)
            step_staleness.append(res.staleness_steps)
            trainer_busy = True
            push(clock + rng.uniform(0.1, 2.0), "step", None)

    try_samplers()
    while steps_done < steps:
        assert events, "deadlock: nothing running and the trainer cannot proceed"
        clock, _, kind, data = heapq.heappop(events)
        if kind == "done":
            i, c, e = data
            if e != epoch:
                continue
            sampler_busy[i] = False
            if filter_prob:
                rows = [t for t in range(c.ticket, c.ticket + c.size) if rng.random() >= filter_prob]
                mgr.complete(c, payload=rows, kept=len(rows))
            else:
                mgr.complete(c, payload={"ticket": c.ticket, "version": c.version})
        else:
            trainer_busy = False
            steps_done += 1
            if skip_prob and rng.random() < skip_prob:
                mgr.batch_skipped()
            else:
                trainer_version += 1
                if trainer_version % sync_every == 0:
                    published = trainer_version
            if resume_at is not None and steps_done == resume_at:
                state = pickle.loads(pickle.dumps(mgr.state_dict()))
                mgr = StalenessManager(B, lag, drop_older_than_rollouts=drop, max_running=max_running, split=split)
                mgr.load_state_dict(state)
                epoch += 1
                sampler_busy = [False] * samplers
                published = trainer_version          # a resumed run starts from the checkpoint's weights
        mgr.check_invariants()
        peak_outstanding = max(peak_outstanding, mgr.outstanding)
        try_trainer()
        try_samplers()
        try_trainer()
    return mgr, consumed, step_staleness, peak_outstanding


@settings(max_examples=60, deadline=None)
@given(chunk=st.integers(1, 4), chunks_per_step=st.integers(1, 4), lag_steps=st.integers(0, 3),
       extra=st.integers(0, 3), samplers=st.integers(1, 4), sync_every=st.integers(1, 3),
       slow_tail=st.sampled_from([0.0, 0.3]), skip_prob=st.sampled_from([0.0, 0.0, 0.4]),
       seed=st.integers(0, 10_000))
def test_admission_never_exceeds_the_bound(chunk, chunks_per_step, lag_steps, extra, samplers, sync_every,
                                           slow_tail, skip_prob, seed):
    """Random generation and step times, out-of-order finishes, weight syncs every k steps and skipped updates
    (which must neither deadlock admission nor break the bound)."""
    B = chunk * chunks_per_step
    # weights synced every k steps lag up to k - 1 steps behind the trainer: Q < (k - 1)*B would deadlock
    # (the loop's config refuses it), so the bound is raised to at least that.
    lag_steps = max(lag_steps, sync_every - 1)
    Q = lag_steps * B + extra * chunk             # Q need not be a multiple of B
    mgr, consumed, staleness, peak = simulate(chunk=chunk, chunks_per_step=chunks_per_step, lag=Q,
                                              samplers=samplers, steps=12, seed=seed, sync_every=sync_every,
                                              slow_tail=slow_tail, skip_prob=skip_prob)
    bound = math.ceil(Q / B)
    assert mgr.staleness_bound_steps == bound
    assert max(max(s) for s in staleness) <= bound
    assert min(min(s) for s in staleness) >= 0
    assert peak <= Q + B
    # every rollout consumed once, in ticket order, none skipped
    tickets = [c.ticket for c in consumed]
    assert tickets == list(range(0, 12 * B, chunk))


@settings(max_examples=30, deadline=None)
@given(lag_steps=st.integers(0, 2), samplers=st.integers(1, 3), resume_at=st.integers(1, 8),
       seed=st.integers(0, 10_000))
def test_queue_survives_resume(lag_steps, samplers, resume_at, seed):
    """Across a state_dict round trip, no rollout is lost or trained twice and the bound still holds."""
    chunk, per_step = 2, 2
    B = chunk * per_step
    mgr, consumed, staleness, _ = simulate(chunk=chunk, chunks_per_step=per_step, lag=lag_steps * B,
                                           samplers=samplers, steps=10, seed=seed, resume_at=resume_at,
                                           slow_tail=0.3)
    assert [c.ticket for c in consumed] == list(range(0, 10 * B, chunk))
    assert max(max(s) for s in staleness) <= lag_steps
    # completed chunks restored from the checkpoint keep the version that generated them
    for c in consumed:
        if c.done and c.payload is not None:
            assert c.payload["ticket"] == c.ticket


@settings(max_examples=40, deadline=None)
@given(chunk=st.integers(1, 4), chunks_per_step=st.integers(1, 3), lag_steps=st.integers(0, 2),
       samplers=st.integers(1, 3), filter_prob=st.sampled_from([0.2, 0.5, 0.8]),
       resume_at=st.sampled_from([None, 3]), seed=st.integers(0, 10_000))
def test_filtered_rows_keep_the_bound_and_the_order(chunk, chunks_per_step, lag_steps, samplers, filter_prob,
                                                     resume_at, seed):
    """Dynamic sampling: rows filtered at completion free capacity, each step takes exactly B kept rows (a
    chunk may be split between steps), in ticket order, each once, with staleness within ⌈Q/B⌉ — across a
    resume too."""
    B = chunk * chunks_per_step
    Q = lag_steps * B
    mgr, consumed, staleness, peak = simulate(chunk=chunk, chunks_per_step=chunks_per_step, lag=Q,
                                              samplers=samplers, steps=8, seed=seed, filter_prob=filter_prob,
                                              resume_at=resume_at, slow_tail=0.3)
    assert all(len(s) == B for s in staleness)
    assert max(max(s) for s in staleness) <= lag_steps and peak <= Q + B
    rows = [t for c in consumed for t in c.payload]
    assert len(rows) == 8 * B and rows == sorted(set(rows))
    assert mgr.filtered > 0 or filter_prob < 0.5


def test_filtered_chunk_splits_a_batch_by_hand():
    mgr = StalenessManager(4, 4, split=lambda rows, k: (rows[:k], rows[k:]))
    a, b = mgr.try_start(4, 0), mgr.try_start(4, 0)
    mgr.complete(a, payload=["a0", "a1"], kept=2)       # half filtered: capacity for 2 more rows
    assert mgr.filtered == mgr.filtered_since_take == 2 and mgr.capacity(0) == 2
    c = mgr.try_start(2, 0)
    assert c is not None and not mgr.ready(0)
    mgr.complete(b, payload=["b0", "b1", "b2", "b3"])
    res = mgr.take(0)                                   # a's 2 rows, then 2 of b's 4
    assert [ch.payload for ch in res.chunks] == [["a0", "a1"], ["b0", "b1"]]
    assert mgr.filtered_since_take == 0 and mgr.queue_depth == 2 and mgr.frontier_ticket == b.ticket
    mgr.complete(c, payload=[], kept=0)                 # kept nothing: leaves the queue
    mgr.check_invariants()
    with pytest.raises(ValueError, match="kept 5 of"):
        mgr.complete(mgr.try_start(4, 1), payload=[], kept=5)
    plain = StalenessManager(4, 0)
    with pytest.raises(ValueError, match="split"):
        plain.complete(plain.try_start(4, 0), payload=[1], kept=1)


def test_staleness_zero_is_lockstep():
    """Q = 0: the sampler can only generate the next step's B rollouts with the newest weights."""
    mgr = StalenessManager(4, 0)
    a = mgr.try_start(2, 0)
    b = mgr.try_start(2, 0)
    assert a is not None and b is not None
    assert mgr.try_start(2, 0) is None and mgr.capacity(0) == 0
    mgr.complete(b, "b")
    assert not mgr.ready(0)                      # ticket order: a is still running
    mgr.complete(a, "a")
    res = mgr.take(0)
    assert [c.payload for c in res.chunks] == ["a", "b"] and res.staleness_steps == [0] * 4
    assert mgr.capacity(0) == 0 and mgr.capacity(1) == 4   # opens only with the new weights


def test_capacity_formula_by_hand():
    # B = 8, Q = 16 (eta = 2 steps): capacity(s) = (s + 1)*8 + 16 - (accepted + running)
    mgr = StalenessManager(8, 16)
    assert mgr.capacity(0) == 24
    chunks = [mgr.try_start(8, 0) for _ in range(3)]
    assert all(chunks) and mgr.try_start(8, 0) is None
    for c in chunks[:2]:
        mgr.complete(c)
    assert mgr.capacity(0) == 0 and mgr.capacity(1) == 8 and mgr.capacity(3) == 24
    assert mgr.outstanding == 24 and mgr.queue_depth == 16


def test_drop_discards_stale_chunks_and_frees_capacity():
    mgr = StalenessManager(2, None, drop_older_than_rollouts=2)   # unbounded admission, drop lag > 2 rollouts
    old = [mgr.try_start(2, 0) for _ in range(3)]
    for c in old:
        mgr.complete(c, c.ticket)
    assert mgr.take(0).staleness_steps == [0, 0]
    assert mgr.take(1).staleness_steps == [1, 1]                  # lag 2 rollouts: kept
    fresh = mgr.try_start(2, 2)
    mgr.complete(fresh, fresh.ticket)
    res = mgr.take(2)                                            # chunk 2 (version 0) has lag 4 > 2: dropped
    assert [c.ticket for c in res.dropped] == [4] and [c.ticket for c in res.chunks] == [6]
    assert mgr.dropped == 2 and res.metrics["async/dropped_rollouts"] == 2.0
    mgr.check_invariants()


def test_max_running_limits_concurrency():
    mgr = StalenessManager(4, None, max_running=4)
    assert mgr.try_start(4, 0) is not None and mgr.try_start(1, 0) is None


def test_sync_every_needs_lag():
    """Weights synced every 2 steps with Q = 0: the sampler's version lags, capacity stays 0: a deadlock."""
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(chunk=1, chunks_per_step=1, lag=0, samplers=1, steps=4, seed=0, sync_every=2)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="batch_rollouts"):
        StalenessManager(0, 0)
    with pytest.raises(ValueError, match="queue_rollouts"):
        StalenessManager(4, -1)
    mgr = StalenessManager(4, 0)
    with pytest.raises(RuntimeError, match="ready"):
        mgr.take(0)
    other = StalenessManager(8, 0)
    with pytest.raises(ValueError, match="batch_rollouts"):
        other.load_state_dict(mgr.state_dict())


def test_metrics_by_hand():
    m = staleness_metrics([0, 0, 1, 3], 8)
    assert m["async/staleness_mean"] == 1.0 and m["async/staleness_max"] == 3.0
    assert m["async/stale_fraction"] == 0.5 and m["async/lag_rollouts_mean"] == 8.0


def test_requeued_chunk_is_handed_out_again_first_with_its_tickets():
    m = StalenessManager(batch_rollouts=4, queue_rollouts=8)
    a = m.try_start(4, 0, meta={"rng_before": "A"})
    b = m.try_start(4, 0, meta={"rng_before": "B"})
    m.complete(b, "payload-b")
    m.requeue(a)                                  # a's worker died
    again = m.try_start(4, 1)
    assert again is a and again.ticket == 0 and again.meta["rng_before"] == "A" and again.version == 1
    assert m.running == 4 and m.accepted == 4     # counted once, not twice
    m.complete(again, "payload-a")
    m.check_invariants()
    with pytest.raises(ValueError, match="running chunk"):
        m.requeue(b)                              # a finished chunk cannot go back
    with pytest.raises(ValueError, match="completed twice"):
        m.complete(a, "again")
