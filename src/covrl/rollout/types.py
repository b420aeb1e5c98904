"""The data that flows from the sampler to the trainer, as immutable typed records:

    sampler.generate -> RolloutBatch -> score (task) -> ScoredBatch -> Trainer.step -> StepResult (covrl.train)

No side channel: everything a later stage reads is a named field. Concatenation of chunks (the async loops
stack several generate calls into one step) is defined per field in `concat_batches`; row selection
(micro-batches) in `RolloutBatch.select`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

# The samplers' top-k log-probs use this floor instead of -inf outside the filtered support, so products
# with zero-weight tokens stay finite (exp(-1e4) == 0 in fp32).
TOPK_LOGPROB_FLOOR = -1.0e4

__all__ = ["TOPK_LOGPROB_FLOOR", "RolloutBatch", "RolloutTiming", "ScoredBatch", "batch_from_state", "batch_to_state", "concat_batches"]


@dataclass(frozen=True)
class RolloutTiming:
    """Seconds spent producing a batch (summed when chunks are concatenated)."""

    generate_s: float = 0.0
    prefill_s: float = 0.0
    score_s: float = 0.0
    compile_s: float = 0.0   # torch.compile time inside generate_s (sampler.compile; 0 once every shape is compiled)

    def __add__(self, other: RolloutTiming) -> RolloutTiming:
        return RolloutTiming(self.generate_s + other.generate_s, self.prefill_s + other.prefill_s,
                             self.score_s + other.score_s, self.compile_s + other.compile_s)


@dataclass(frozen=True)
class RolloutBatch:
    """B rollouts as the sampler produced them, right-padded to a common length.

    prompt_ids       [B, P] long, left-padded prompts (pad = pad_token_id), with prompt_mask [B, P]
    response_ids     [B, T] long, right-padded responses; response_mask [B, T] float (1 = generated token)
    sampler_logprobs [B, T] float32: log q(y_t | c_t) of the distribution actually sampled from, 0 on padding
    group_ids        [B] long: rows with the same id answer the same prompt
    policy_version   [B] long: the trainer version whose weights generated each row
    sampler_topk_ids / sampler_topk_logprobs [B, T, K] (optional): the sampler's top-k for score centring
    sampler_kept     [B, T] long (optional): size of the kept set each token was drawn from under top-k / top-p /
                     min-p truncation (0 = the whole vocabulary), for the trainer's replay (docs/theory.md §12)
    prompt_index     [B] long (optional): position of the prompt in the task's data stream (exact resume)
    token_versions   [B, T] long (optional, partial rollouts): the policy version whose weights drew each token;
                     None = every token of a row from its `policy_version`
    loss_mask        [B, T] float (optional, multi-turn episodes): 1 on the model's own tokens, 0 on environment /
                     tool-result tokens that sit inside the response as context (response_mask 1, no sampler
                     log-prob); None = every response token is the model's (`train_mask` is response_mask)
    timing           seconds spent generating (and, once scored, scoring)
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    sampler_logprobs: torch.Tensor
    group_ids: torch.Tensor
    policy_version: torch.Tensor
    sampler_topk_ids: torch.Tensor | None = None
    sampler_topk_logprobs: torch.Tensor | None = None
    sampler_kept: torch.Tensor | None = None
    prompt_index: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None
    timing: RolloutTiming = field(default_factory=RolloutTiming)

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def train_mask(self) -> torch.Tensor:
        """The tokens the loss, the corrections and the mismatch metrics count: the model's own tokens
        (loss_mask) where environment tokens sit in the response, else the response mask."""
        return self.response_mask if self.loss_mask is None else self.loss_mask

    @property
    def versions_per_token(self) -> torch.Tensor:
        """[B, T] long: the version that drew each token (`token_versions`, else the row's policy_version)."""
        if self.token_versions is not None:
            return self.token_versions
        return self.policy_version[:, None].expand(self.response_ids.shape)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def tensor_fields(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def row_fields(self) -> dict[str, tuple]:
        """Per-row python values (tuples of length B)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), tuple) and len(getattr(self, f.name)) == len(self)}

    def select(self, index: torch.Tensor | list[int]) -> RolloutBatch:
        """Rows `index` (micro-batching, dropping stale rows), of every per-row field."""
        idx = torch.as_tensor(index, dtype=torch.long)
        updates: dict[str, Any] = {k: v[idx.to(v.device)] for k, v in self.tensor_fields().items()}
        rows = idx.tolist()
        updates.update({k: tuple(v[i] for i in rows) for k, v in self.row_fields().items()})
        return replace(self, **updates)

    def scored(self, rewards: torch.Tensor, *, correct=None, texts=None, task_metrics=None,
               score_s: float = 0.0, reward_terms: Mapping[str, list[float]] | None = None,
               reward_term_weights: Mapping[str, float] | None = None) -> ScoredBatch:
        """This batch with the task's verdict attached (a new object; `self` is unchanged). `reward_terms`:
        name -> each row's unweighted value of that reward term, with `reward_term_weights` (task.score's)."""
        base = {f.name: getattr(self, f.name) for f in fields(RolloutBatch)}
        base["timing"] = replace(self.timing, score_s=self.timing.score_s + float(score_s))
        terms = None
        if reward_terms:
            columns = [list(v) for v in reward_terms.values()]
            if any(len(c) != len(self) for c in columns):
                raise ValueError(f"reward_terms need {len(self)} values per term; got {[len(c) for c in columns]}")
            terms = torch.tensor(columns, dtype=torch.float32).reshape(len(columns), len(self)).T.contiguous()
        weights = dict(reward_term_weights or {})
        if reward_terms and list(weights) != list(reward_terms):
            raise ValueError(f"reward_term_weights names {list(weights)} must be the reward_terms' "
                             f"{list(reward_terms)}")
        return ScoredBatch(**base, rewards=rewards, correct=None if correct is None else tuple(bool(c) for c in correct),
                           texts=None if texts is None else tuple(texts), task_metrics=task_metrics or {},
                           reward_terms=terms, reward_term_weights=weights if terms is not None else {})


@dataclass(frozen=True)
class ScoredBatch(RolloutBatch):
    """A RolloutBatch with the task's verdict.

    rewards       [B] (outcome) or [B, T] (per token) float32
    correct       per-row bool verdicts of the task's grader (accuracy, pass@n), or None
    texts         per-row decoded responses, or None
    task_metrics  the task's own batch metrics (e.g. task/errors), already prefixed `task/`
    reward_terms  [B, K] float32: each row's unweighted value of each reward term (task.rewards, in order, and
                  the overlong penalty), or None (episodes: the environment's reward has no terms)
    reward_term_weights  term name -> weight, K entries in the columns' order (empty without reward_terms)
    """

    rewards: torch.Tensor | None = None
    correct: tuple[bool, ...] | None = None
    texts: tuple[str, ...] | None = None
    task_metrics: Mapping[str, float] = field(default_factory=dict)
    reward_terms: torch.Tensor | None = None
    reward_term_weights: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rewards is None:
            raise ValueError("ScoredBatch.rewards is None: score the rollouts (task.score) before Trainer.step")
        n = len(self)
        for name in ("correct", "texts"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"ScoredBatch.{name} has {len(value)} entries for {n} rows")
        if self.rewards.shape[0] != n:
            raise ValueError(f"ScoredBatch.rewards has {self.rewards.shape[0]} rows for {n} rows")
        if self.reward_terms is not None and (self.reward_terms.dim() != 2 or self.reward_terms.shape[0] != n
                                              or self.reward_terms.shape[1] != len(self.reward_term_weights)):
            raise ValueError(f"ScoredBatch.reward_terms must be [B, K] = [{n}, {len(self.reward_term_weights)}] "
                             f"(one column per reward_term_weights entry); got {list(self.reward_terms.shape)}")

    @property
    def reward_weights(self) -> torch.Tensor | None:
        """[K] float32: the weights of the reward_terms' columns (None without reward_terms)."""
        if self.reward_terms is None:
            return None
        return torch.tensor(list(self.reward_term_weights.values()), dtype=torch.float32,
                            device=self.reward_terms.device)

    @property
    def sequence_rewards(self) -> torch.Tensor:
        """[B] float32: the outcome rewards, or per-token rewards summed over the model's tokens."""
        rewards = self.rewards.float()
        return rewards if rewards.dim() == 1 else (rewards * self.train_mask.float()).sum(1)


# ------------------------------------------------------------------------------------------ concatenation

def _pad(x: torch.Tensor, width: int, value: float = 0, *, left: bool = False) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1], *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def _cat_optional(parts: list, width: int | None = None):
    if any(p is None for p in parts):
        return None
    if width is None:
        return torch.cat(parts)
    return torch.cat([_pad(p, width) for p in parts])


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Stack chunks into one batch, field by field: prompts left-padded and responses right-padded to common
    widths; group ids offset so that groups stay distinct; per-row tuples concatenated; timings summed; the
    task's batch metrics averaged over chunks weighted by their rows. Scored chunks give a ScoredBatch."""
    if not batches:
        raise ValueError("concat_batches: no batches")
    if len(batches) == 1:
        return batches[0]
    P = max(b.prompt_ids.shape[1] for b in batches)
    T = max(b.response_ids.shape[1] for b in batches)
    offset, gids = 0, []
    for b in batches:
        gids.append(b.group_ids + offset)
        offset += int(b.group_ids.max()) + 1 if len(b) else 0
    timing = RolloutTiming()
    for b in batches:
        timing = timing + b.timing
    out: dict[str, Any] = {
        "group_ids": torch.cat(gids),
        "prompt_ids": torch.cat([_pad(b.prompt_ids, P, pad_id, left=True) for b in batches]),
        "prompt_mask": torch.cat([_pad(b.prompt_mask, P, left=True) for b in batches]),
        "response_ids": torch.cat([_pad(b.response_ids, T, pad_id) for b in batches]),
        "response_mask": torch.cat([_pad(b.response_mask, T) for b in batches]),
        "sampler_logprobs": torch.cat([_pad(b.sampler_logprobs, T) for b in batches]),
        "sampler_topk_ids": _cat_optional([b.sampler_topk_ids for b in batches], T),
        "sampler_topk_logprobs": _cat_optional([b.sampler_topk_logprobs for b in batches], T),
        "sampler_kept": _cat_optional([b.sampler_kept for b in batches], T),
        "policy_version": torch.cat([b.policy_version for b in batches]),
        "prompt_index": _cat_optional([b.prompt_index for b in batches]),
        "token_versions": None if all(b.token_versions is None for b in batches)
        else torch.cat([_pad(b.versions_per_token, T) for b in batches]),
        # single-turn chunks beside episodes: all their response tokens are the model's
        "loss_mask": None if all(b.loss_mask is None for b in batches)
        else torch.cat([_pad(b.train_mask, T) for b in batches]),
        "timing": timing,
    }
    if not all(isinstance(b, ScoredBatch) for b in batches):
        return RolloutBatch(**out)
    rewards = [b.rewards for b in batches]
    out["rewards"] = torch.cat(rewards) if rewards[0].dim() == 1 else torch.cat([_pad(r, T) for r in rewards])
    for name in ("correct", "texts"):
        parts = [getattr(b, name) for b in batches]
        out[name] = None if any(p is None for p in parts) else tuple(x for p in parts for x in p)
    rows = sum(len(b) for b in batches)
    task_metrics: dict[str, float] = {}
    for b in batches:
        for k, v in b.task_metrics.items():
            task_metrics[k] = task_metrics.get(k, 0.0) + float(v) * len(b) / rows
    out["task_metrics"] = task_metrics
    # per-term rewards only where every chunk has the same terms (the same task scored them all)
    weights = [dict(b.reward_term_weights) for b in batches]
    same = all(b.reward_terms is not None for b in batches) and all(w == weights[0] for w in weights)
    out["reward_terms"] = torch.cat([b.reward_terms for b in batches]) if same else None
    out["reward_term_weights"] = weights[0] if same else {}
    return ScoredBatch(**out)


# -------------------------------------------------------------------------------------- checkpoint form

def batch_to_state(batch: RolloutBatch) -> dict[str, Any]:
    """A batch as plain values (tensors, lists, dicts, floats): loadable with torch.load(weights_only=True)."""
    state: dict[str, Any] = {"scored": isinstance(batch, ScoredBatch)}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, RolloutTiming):
            value = {k.name: getattr(value, k.name) for k in fields(value)}
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        state[f.name] = value
    return state


def batch_from_state(state: dict[str, Any]) -> RolloutBatch:
    state = dict(state)
    scored = state.pop("scored", state.get("rewards") is not None)
    legacy = state.pop("info", None)     # checkpoints written before the typed fields
    if legacy:
        state.setdefault("correct", legacy.get("correct"))
        state.setdefault("texts", legacy.get("texts"))
        state.setdefault("task_metrics", legacy.get("task_metrics") or {})
        state.setdefault("timing", {"generate_s": float(legacy.get("generate_s", 0.0)),
                                    "prefill_s": float(legacy.get("prefill_s", 0.0)),
                                    "score_s": float(legacy.get("score_s", 0.0))})
    timing = state.pop("timing", None) or {}
    state["timing"] = RolloutTiming(**timing)
    for name in ("correct", "texts"):
        if state.get(name) is not None:
            state[name] = tuple(state[name])
    if not scored:
        for name in ("rewards", "correct", "texts", "task_metrics", "reward_terms", "reward_term_weights"):
            state.pop(name, None)
        return RolloutBatch(**state)
    return ScoredBatch(**state)
