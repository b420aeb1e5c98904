"""The entropy a policy-gradient step takes away, and Clip-Cov, which restrains it (docs/theory.md §16).

At one context with logits z and π = softmax(z), a logit move Δz changes the entropy to first order by
ΔH = −Cov_{v∼π}(log π_v, Δz_v). A sampled token whose log-probability and advantage are both above their means
pushes the entropy down; `token_covariance` measures that per token, `clip_cov_keep` drops the gradient of the
tokens that push it down most (Cui et al. 2025, Clip-Cov, with a deterministic top share instead of a random one).

Shapes: advantages, logprobs, mask [B, T]; group_ids [B] integer (rows with equal ids form a group). Means are
taken over each group's masked tokens, so a micro-batch of whole groups gets the same selection as the full batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from covrl.math._util import check_2d, check_same_shape, masked_mean

__all__ = ["ClipCovOutput", "clip_cov_keep", "token_covariance"]


def _group_index(group_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    if group_ids.dim() != 1 or group_ids.shape[0] != rows:
        raise ValueError(f"group_ids must be [B] with B = {rows}; got {list(group_ids.shape)}")
    uniq, index = torch.unique(group_ids, return_inverse=True)
    return index, int(uniq.numel())


def _group_token_mean(x: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
    """Per row, the mean of x over the masked tokens of the row's group ([B, 1]; 0 for a group with none)."""
    sums = torch.zeros(groups, dtype=torch.float32, device=x.device).index_add_(0, index, (x * mask).sum(1))
    counts = torch.zeros(groups, dtype=torch.float32, device=x.device).index_add_(0, index, mask.sum(1))
    return (sums / counts.clamp_min(1.0))[index].unsqueeze(1)


def token_covariance(advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor,
                     group_ids: torch.Tensor) -> torch.Tensor:
    """(A_t − Ā)(log π_t − mean log π) per token, the means over the token's group; 0 off the mask. Detached fp32."""
    check_2d("advantages", advantages)
    check_same_shape(advantages=advantages, logprobs=logprobs, mask=mask)
    m = mask.detach().float()
    a = torch.where(m > 0, advantages.detach().float(), torch.zeros((), device=m.device))
    lp = torch.where(m > 0, logprobs.detach().float(), torch.zeros((), device=m.device))
    index, groups = _group_index(group_ids, m.shape[0])
    cov = (a - _group_token_mean(a, m, index, groups)) * (lp - _group_token_mean(lp, m, index, groups))
    return cov * m


@dataclass
class ClipCovOutput:
    """keep [B, T] fp32 0/1 (the mask less the clipped tokens), metrics."""

    keep: torch.Tensor
    metrics: dict[str, float]


def clip_cov_keep(advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                  fraction: float) -> ClipCovOutput:
    """Drop, in each group, the round(fraction · n) tokens of largest positive `token_covariance` (n: the group's
    masked tokens; ties broken by position, so the selection is deterministic).

    Metrics: clip_cov/clipped_frac (of the masked tokens), clip_cov/cov_mean (mean token covariance, the step's
    push on the entropy before clipping), clip_cov/clipped_cov_share (the share of the positive covariance the
    clipped tokens carried)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must lie in [0, 1), got {fraction}")
    cov = token_covariance(advantages, logprobs, mask, group_ids)
    m = mask.detach().float()
    rows, width = m.shape
    index, groups = _group_index(group_ids, rows)
    flat_group = index.unsqueeze(1).expand(rows, width).reshape(-1)
    flat_cov = cov.reshape(-1)
    candidate = (m.reshape(-1) > 0) & (flat_cov > 0)
    key = torch.where(candidate, flat_cov, torch.full_like(flat_cov, float("-inf")))
    # rank of each token within its group, by covariance descending: a stable sort by key, then by group
    by_key = torch.argsort(key, descending=True, stable=True)
    order = by_key[torch.argsort(flat_group[by_key], stable=True)]
    counts = torch.zeros(groups, dtype=torch.long, device=m.device).index_add_(0, index, m.sum(1).long())
    sizes = torch.bincount(flat_group, minlength=groups)   # positions per group in `order`, masked or not
    start = torch.cumsum(sizes, 0) - sizes
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=m.device) - start[flat_group[order]]
    quota = torch.floor(counts.double() * fraction + 0.5).long()
    clipped = candidate & (rank < quota[flat_group])
    keep = (m.reshape(-1) * (~clipped).float()).reshape(rows, width)
    positive = cov.clamp_min(0.0).sum()   # cov is 0 off the mask
    metrics = {"clip_cov/clipped_frac": float(clipped.sum()) / max(float(m.sum()), 1.0),
               "clip_cov/cov_mean": float(masked_mean(cov, m)),
               "clip_cov/clipped_cov_share": (float(flat_cov[clipped].sum() / positive)
                                              if float(positive) > 0 else 0.0)}
    return ClipCovOutput(keep, metrics)
