"""Micro-batches of one optimisation step: which rows go together, how each one's loss is its share of the full
batch's aggregate (so gradient accumulation gives the full-batch gradient whatever the split), how their metrics
fold into the step's, and the per-micro-batch gradient norms of the gradient-noise split.

Used by the Trainer and by covrl.api's `TrainingClient.forward_backward`: one definition of the globally
normalised micro-batched backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from covrl.diagnostics.noise import LOSS_UNITS
from covrl.rollout.types import RolloutBatch

__all__ = ["MicroNorms", "fold_micro_metrics", "groups_of", "halves", "mean_over", "micro_batch_share", "pad_cols",
           "plan_micro_batches", "plan_packed", "trim_columns"]


def pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    """`x` [B, T, ...] right-padded with zeros to `width` columns."""
    if x.shape[1] == width:
        return x
    pad = torch.zeros((x.shape[0], width - x.shape[1], *x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def mean_over(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Σ x·m / Σ m as a Python float (0.0 when nothing is masked in): a step metric."""
    den = float(mask.sum())
    return float((x * mask).sum()) / den if den > 0 else 0.0


def trim_columns(mb: RolloutBatch) -> RolloutBatch:
    """Drop all-padding columns: leading prompt columns and trailing response columns (faster forward)."""
    prompt_cols = (mb.prompt_mask > 0).any(0).nonzero()
    p0 = int(prompt_cols[0]) if prompt_cols.numel() else mb.prompt_mask.shape[1]
    resp_cols = (mb.response_mask > 0).any(0).nonzero()
    t = int(resp_cols[-1]) + 1 if resp_cols.numel() else 1
    t = max(t, 1)
    upd: dict[str, Any] = {"prompt_ids": mb.prompt_ids[:, p0:], "prompt_mask": mb.prompt_mask[:, p0:],
                           "response_ids": mb.response_ids[:, :t], "response_mask": mb.response_mask[:, :t],
                           "sampler_logprobs": mb.sampler_logprobs[:, :t]}
    if mb.rewards is not None and mb.rewards.dim() == 2:
        upd["rewards"] = mb.rewards[:, :t]
    if mb.sampler_topk_ids is not None:
        upd["sampler_topk_ids"] = mb.sampler_topk_ids[:, :t]
    if mb.sampler_topk_logprobs is not None:
        upd["sampler_topk_logprobs"] = mb.sampler_topk_logprobs[:, :t]
    if mb.sampler_kept is not None:
        upd["sampler_kept"] = mb.sampler_kept[:, :t]
    if mb.loss_mask is not None:
        upd["loss_mask"] = mb.loss_mask[:, :t]
    return replace(mb, **upd)


def micro_batch_share(token_loss: torch.Tensor, idx: torch.Tensor, full_mask: torch.Tensor,
                      aggregate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """This micro-batch's share of the full-batch aggregate: its token losses (rows `idx`) placed in a [B, T]
    zero tensor and aggregated with the full batch's mask, so the micro-batch losses sum to the full-batch loss
    (and their gradients to its gradient) whatever the split."""
    padded = pad_cols(token_loss.float(), full_mask.shape[1])
    full = torch.zeros(full_mask.shape, dtype=torch.float32, device=padded.device).index_copy(0, idx, padded)
    return aggregate(full, full_mask)


_LOSS_PARTS = ("loss/policy", "loss/score_centering", "loss/kl")


def fold_micro_metrics(total: dict[str, float], mb_metrics: dict[str, float], share: float, idle: bool) -> None:
    """Fold a micro-batch's loss metrics into the step's: the loss parts (already this micro-batch's share of
    the full-batch loss) add up, *_max / *_min take the extreme, the other means weigh by the token share. An
    idle micro-batch adds its keys only."""
    for key, v in mb_metrics.items():
        if key.endswith("_max"):
            total[key] = max(total.get(key, -math.inf), -math.inf if idle else v)
        elif key.endswith("_min"):
            total[key] = min(total.get(key, math.inf), math.inf if idle else v)
        else:
            total[key] = total.get(key, 0.0) + (0.0 if idle else v if key in _LOSS_PARTS else share * v)


def groups_of(group_ids: torch.Tensor) -> list[list[int]]:
    """The rows of each group, groups in the order of their first row."""
    groups: dict[int, list[int]] = {}
    for row, gid in enumerate(group_ids.tolist()):
        groups.setdefault(int(gid), []).append(row)
    return list(groups.values())


def plan_micro_batches(group_ids: torch.Tensor, size: int, own: list[int] | None = None
                       ) -> tuple[list[list[int]], bool]:
    """Micro-batches of at most `size` rows made of whole groups (aligned=True), or plain chunks when a group is
    larger than a micro-batch (aligned=False); of the rows `own` (a rank's shard of whole groups) when given."""
    groups = groups_of(group_ids)
    rows = list(range(len(group_ids))) if own is None else own
    if any(len(g) > size for g in groups):   # the full batch's groups: every rank takes one path
        return [rows[s:s + size] for s in range(0, len(rows), size)], False
    mine = set(rows)
    plan: list[list[int]] = []
    current: list[int] = []
    for g in (g for g in groups if g[0] in mine):
        if current and len(current) + len(g) > size:
            plan.append(current)
            current = []
        current = current + g
    if current:
        plan.append(current)
    return plan, True


def plan_packed(group_ids: torch.Tensor, tokens: torch.Tensor, budget: int, own: list[int] | None = None
                ) -> list[list[int]]:
    """Micro-batches of whole groups whose tokens (`tokens` [B]: each row's prompt + response tokens) fit
    `budget`, filled greedily in group order; a group larger than the budget is a micro-batch alone. Of the rows
    `own` (a rank's shard of whole groups) when given."""
    mine = None if own is None else set(own)
    plan: list[list[int]] = []
    current: list[int] = []
    used = 0
    for g in groups_of(group_ids):
        if mine is not None and g[0] not in mine:
            continue
        size = int(tokens[g].sum())
        if current and used + size > budget:
            plan.append(current)
            current, used = [], 0
        current, used = current + g, used + size
    if current:
        plan.append(current)
    return plan


def halves(groups: list[list[int]]) -> list[list[int]]:
    """Two micro-batches of whole groups with row counts as equal as the groups allow."""
    total = sum(len(g) for g in groups)
    first: list[int] = []
    k = 0
    while k < len(groups) - 1 and abs(2 * (len(first) + len(groups[k])) - total) <= abs(2 * len(first) - total):
        first += groups[k]
        k += 1
    if not first:
        first, k = list(groups[0]), 1
    return [first, [row for g in groups[k:] for row in g]]


class MicroNorms:
    """Squared norm and size (in the loss's averaging unit) of each micro-batch's contribution to the accumulated
    gradient: ‖.grad after − .grad before‖², with one snapshot of .grad kept between backward passes. Under DDP
    the synced micro-batch's own contribution is read from the comm hook (`from_bucket`), before the all-reduce."""

    def __init__(self, params: list[torch.Tensor], agg_mode: str):
        self.params = params
        self.count_tokens = LOSS_UNITS.get(agg_mode, "rows") == "tokens"
        self.norms_sq: list[float] = []
        self.sizes: list[float] = []
        self._before: list[torch.Tensor | None] | None = None
        self._index = {id(p): i for i, p in enumerate(params)}
        self._hooked_sq: dict[int, float] = {}   # parameter index -> squared norm, from DDP's buckets

    def before_backward(self) -> None:
        if self.norms_sq:  # the first micro-batch starts from zero gradients: no snapshot needed
            self._before = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    @torch.no_grad()
    def _contribution_sq(self, params, grads) -> dict[int, float]:
        """Parameter index -> squared norm of its contribution."""
        prev = [None if self._before is None else self._before[self._index[id(p)]] for p in params]
        if any(b is not None for b in prev):
            grads = [g if b is None else g - b for g, b in zip(grads, prev)]
        # fused per-tensor norms (fp32 accumulation is ample for a noise estimate)
        norms = torch._foreach_norm(grads) if grads else []
        return {self._index[id(p)]: float(n) ** 2 for p, n in zip(params, norms)}

    @staticmethod
    def _total(squares: dict[int, float]) -> float:
        # summed in float64 in parameter order: the same bits whatever DDP's bucket layout (it is rebuilt after
        # a process's first step, so a resumed run would otherwise differ in the last digits from a straight one)
        return sum(squares[i] for i in sorted(squares))

    def from_bucket(self, bucket) -> None:
        """DDP's comm hook, before the all-reduce: this rank's accumulated gradient of a bucket's parameters."""
        self._hooked_sq.update(self._contribution_sq(bucket.parameters(), bucket.gradients()))

    def rescale_gathered(self, parts: list[tuple[list[float], list[float]]], world: int) -> None:
        """Every rank's (norms, sizes), in rank order; the norms back in the loss's own scale (each rank
        backwarded its loss times the world size)."""
        self.norms_sq = [v / world ** 2 for norms, _ in parts for v in norms]
        self.sizes = [v for _, sizes in parts for v in sizes]

    @torch.no_grad()
    def after_backward(self, response_mask: torch.Tensor, hooked: bool = False) -> None:
        if hooked:   # the synced backward: .grad holds the ranks' average now, the hook saw this rank's own
            total, self._hooked_sq = self._total(self._hooked_sq), {}
        else:
            params = [p for p in self.params if p.grad is not None]
            total = self._total(self._contribution_sq(params, [p.grad for p in params]))
        self._before = None
        self.norms_sq.append(total)
        rows_with_tokens = (response_mask.sum(1) > 0).sum()
        self.sizes.append(float(response_mask.sum() if self.count_tokens else rows_with_tokens))
