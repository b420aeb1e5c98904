"""Episodes of an agent program through covrl's OpenAI-compatible endpoint (covrl.rollout.openai_api), and the
training rows made of their recorded calls, without re-tokenising anything.

Running. `AgentRunner.run` plays n episodes per example, at most `concurrency` at once, each under its own
deadline: the program `run(base_url, api_key, example)` gets the endpoint's URL and an API key naming its
episode; every call it makes is sampled by covrl's sampler and recorded (prompt ids, sampled ids, log q, finish
reason, policy version). An episode fails (its error kept, nothing of it trained) when the program raises,
passes the deadline, returns something that is not a finite number or None, or makes no call.

Rows (`episode_rows`): the calls in the order they completed. A call whose prompt ids begin with an earlier
row's whole sequence (its prompt, then every token after it) extends that row, the longest such: the tokens in
between (tool results, user turns, the template's separators) join the row as context (loss_mask 0, log q 0),
then the call's sampled tokens (loss_mask 1, their log q; with a truncating sampler, each one's kept-set size
for the trainer's replay, 0 on the context tokens). A call that extends no row (the chat template
rewrote the history: dropped an earlier <think> block, re-formatted a tool call; a retry; another of n choices)
starts a new row. Every row of an episode gets the episode's reward; rows of one example share a group."""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from covrl.rollout.episodes import Episode, _assemble, _pad_id
from covrl.rollout.openai_api import AgentCall, CallLog, OpenAIServer, episode_api_key
from covrl.rollout.types import RolloutBatch, RolloutTiming

__all__ = ["AgentEpisode", "AgentRunner", "Row", "agent_batch", "episode_rows"]


@dataclass
class Row:
    """One training row: `prompt` (the first call's prompt ids), then `tokens` with `model` (1 = sampled) and
    `logq` (log q of sampled tokens, 0 elsewhere); `versions`: the policy version of each call merged in;
    `token_versions`: per token of `tokens`, the version of the call that added it (None: not recorded);
    `kept`: per token, a truncating sampler's kept-set size (0 on context tokens), None where a call has none."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)
    logq: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    token_versions: list[int | None] = field(default_factory=list)
    kept: list[int] | None = field(default_factory=list)

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


def episode_rows(calls: list[AgentCall]) -> list[Row]:
    """The rows of one episode's calls (see the module docstring: the merge rule)."""
    rows: list[Row] = []
    for call in calls:
        best, best_len = None, -1
        for row in rows:
            seq = row.sequence
            if len(seq) <= len(call.prompt_ids) and len(seq) > best_len and call.prompt_ids[:len(seq)] == seq:
                best, best_len = row, len(seq)
        if best is None:
            best = Row(prompt=list(call.prompt_ids))
            rows.append(best)
            gap: list[int] = []
        else:
            gap = list(call.prompt_ids[best_len:])
        best.tokens += gap + list(call.completion_ids)
        best.model += [0] * len(gap) + [1] * len(call.completion_ids)
        best.logq += [0.0] * len(gap) + [float(x) for x in call.logprobs]
        best.token_versions += [call.policy_version] * (len(gap) + len(call.completion_ids))
        if best.kept is not None and call.kept is not None:
            best.kept += [0] * len(gap) + [int(k) for k in call.kept]
        else:
            best.kept = None
        if call.policy_version is not None:
            best.versions.append(int(call.policy_version))
    return rows


@dataclass
class AgentEpisode:
    """One episode: its example's index, the calls recorded, the program's reward (None: the task scores
    `final_text`), the error that failed it (None = it finished), its seconds."""

    example: int
    calls: list[AgentCall]
    reward: float | None = None
    error: BaseException | None = None
    seconds: float = 0.0

    @property
    def final_text(self) -> str:
        """The last assistant text of the episode (the last call's first choice)."""
        return self.calls[-1].text if self.calls else ""

    @property
    def timed_out(self) -> bool:
        return isinstance(self.error, TimeoutError)


def _reward(value) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
        raise TypeError(f"the agent returned {type(value).__name__} {value!r:.80}; it must return a number (the "
                        "episode's reward) or None (the task's reward of the last assistant text)")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"the agent returned the reward {reward}; a finite number is required")
    return reward


class AgentRunner:
    """Plays agent episodes against `server` (an OpenAIServer whose CallLog is strict) on an event loop of its
    own (a daemon thread). `fn`: the program, async or plain (a plain one runs in a worker thread)."""

    def __init__(self, server: OpenAIServer, fn: Callable, *, concurrency: int, timeout_s: float):
        if not server.calls.strict:
            raise ValueError("AgentRunner needs the server's CallLog strict (only open episodes are recorded)")
        self.server, self.fn = server, fn
        self.concurrency, self.timeout_s = int(concurrency), float(timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        # what `run` is doing now, for the run's stall report (read from the watchdog's thread)
        self._lock = threading.Lock()
        self._running: dict[int, float] = {}    # episode (job index) -> its start (time.monotonic)
        self._total = self._finished = 0

    def progress(self) -> str:
        """What the current (or last) `run` waits for: episodes running of those asked, the oldest one's age."""
        with self._lock:
            running, total, finished = list(self._running.values()), self._total, self._finished
        if not total:
            return "no agent episodes asked yet"
        text = (f"waiting for agent episodes: {len(running)} of {total} running, {finished} finished, "
                f"{total - finished - len(running)} queued (task.agent.concurrency={self.concurrency})")
        if running:
            text += f", oldest {time.monotonic() - min(running):.0f} s (task.agent.timeout_s={self.timeout_s:g})"
        return text

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="covrl-agents", daemon=True).start()
        return self._loop

    async def _one(self, index: int, example, gate: asyncio.Semaphore, out: list, board: dict) -> None:
        async with gate:
            with self._lock:
                board[index] = time.monotonic()
            try:
                await self._play(index, example, out)
            finally:
                with self._lock:
                    board.pop(index, None)
                    if board is self._running:   # not a late episode of an abandoned run
                        self._finished += 1

    async def _play(self, index: int, example, out: list) -> None:
        episode = uuid.uuid4().hex
        log: CallLog = self.server.calls
        log.open(episode)
        t0 = time.perf_counter()
        reward, error = None, None
        try:
            if inspect.iscoroutinefunction(self.fn):
                job = self.fn(self.server.base_url, episode_api_key(episode), example)
            else:
                job = asyncio.to_thread(self.fn, self.server.base_url, episode_api_key(episode), example)
            value = await asyncio.wait_for(job, self.timeout_s)
            reward = _reward(value)
        except TimeoutError as err:   # the deadline's, or one the program raised itself
            late = time.perf_counter() - t0 >= self.timeout_s
            error = TimeoutError(f"the agent's episode passed task.agent.timeout_s={self.timeout_s:g}") if late \
                else err
        except Exception as err:  # noqa: BLE001 - the program's failure is counted, the run goes on
            error = err
        calls = log.close(episode)   # later calls of this episode (an abandoned thread) are refused
        if error is None and not calls:
            error = RuntimeError("the agent made no model call (it must call the endpoint at base_url with "
                                 "api_key, e.g. openai.AsyncOpenAI(base_url=base_url, api_key=api_key))")
        out[index] = AgentEpisode(index, calls, reward if error is None else None, error,
                                  time.perf_counter() - t0)

    def run(self, examples: list, n: int | list[int]) -> list[AgentEpisode]:
        """n episodes per example (n[i] for example i), example-major; `AgentEpisode.example` is the index of
        the example. Blocks until every episode finished or failed."""
        sizes = [n] * len(examples) if isinstance(n, int) else list(n)
        jobs = [(i, ex) for i, (ex, size) in enumerate(zip(examples, sizes)) for _ in range(size)]
        out: list[AgentEpisode | None] = [None] * len(jobs)
        board: dict[int, float] = {}
        with self._lock:
            self._running, self._total, self._finished = board, len(jobs), 0

        async def play():
            gate = asyncio.Semaphore(self.concurrency)
            await asyncio.gather(*(self._one(k, ex, gate, out, board) for k, (_, ex) in enumerate(jobs)))

        # a program that blocks the event loop (a synchronous sleep / HTTP call inside `async def`) defeats the
        # per-episode deadline: the batch's own deadline catches it, and that loop is abandoned
        waves = math.ceil(len(jobs) / self.concurrency)
        future = asyncio.run_coroutine_threadsafe(play(), self._event_loop())
        try:
            future.result(timeout=self.timeout_s * waves + 30.0)
        except TimeoutError:
            future.cancel()
            self._loop = None
        episodes = []
        for k, (i, _) in enumerate(jobs):
            ep = out[k]
            if ep is None:
                ep = AgentEpisode(i, [], error=TimeoutError(
                    "the agent blocked its event loop past every deadline (a synchronous call inside an async "
                    "function?); use await-able calls (openai.AsyncOpenAI) or a plain def (run in a thread)"))
            else:
                ep.example = i
            episodes.append(ep)
        return episodes

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


def agent_batch(episodes: list[AgentEpisode], sampler, tokenizer, *, policy_version: int | None = None,
                timing: RolloutTiming | None = None) -> tuple[RolloutBatch, list[int]]:
    """The training rows of the finished episodes (failed ones give none), as one RolloutBatch (group id = the
    episode's example index; policy_version = the oldest version of a row's calls), and each row's episode
    index; `token_versions`: each token's call's version (the staleness ledger counts per call: a row whose calls
    were drawn by two weight versions is mixed). With no finished episode: one placeholder row with nothing in the
    loss (episode index -1)."""
    rows: list[Episode] = []
    owner: list[int] = []
    groups: list[int] = []
    versions: list[int] = []
    per_token: list[list[int]] = []
    kept: list[list[int] | None] = []
    fallback = sampler.version if policy_version is None else int(policy_version)
    for k, ep in enumerate(episodes):
        if ep.error is not None:
            continue
        for row in episode_rows(ep.calls):
            rows.append(Episode(prompt=row.prompt, tokens=row.tokens, model=row.model, logq=row.logq))
            owner.append(k)
            groups.append(ep.example)
            versions.append(min(row.versions) if row.versions else fallback)
            per_token.append([fallback if v is None else int(v) for v in row.token_versions])
            kept.append(row.kept)
    if not rows:
        rows = [Episode(prompt=[_pad_id(sampler, tokenizer)], tokens=[], model=[], logq=[])]
        owner, groups, versions, per_token = [-1], [0], [fallback], [[]]
    batch = _assemble(rows, 1, sampler, tokenizer, policy_version, timing or RolloutTiming())
    token_versions = torch.tensor(versions, dtype=torch.long)[:, None].repeat(1, batch.response_ids.shape[1])
    for i, row_versions in enumerate(per_token):
        token_versions[i, :len(row_versions)] = torch.tensor(row_versions, dtype=torch.long)
    sampler_kept = None
    if kept and all(k is not None for k in kept):   # a truncating sampler recorded every call's kept sets
        sampler_kept = torch.zeros(batch.response_ids.shape, dtype=torch.long)
        for i, row_kept in enumerate(kept):
            sampler_kept[i, :len(row_kept)] = torch.tensor(row_kept, dtype=torch.long)
    batch = replace(batch, group_ids=torch.tensor(groups, dtype=torch.long),
                    policy_version=torch.tensor(versions, dtype=torch.long), token_versions=token_versions,
                    sampler_kept=sampler_kept)
    return batch, owner
