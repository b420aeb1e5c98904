"""Truncated sampling (top-k, top-p, min-p) as an exact object (docs/theory.md §12).

A truncating sampler draws from q_t = π_t restricted to a kept set K_t and renormalised by its mass
S_t = π_t(K_t). Scoring the drawn tokens with the full softmax makes every ratio π/q carry the factor S_t
(E_q[π/q] = S_t, not 1). Replaying the kept set on the trainer's own logits gives π_K = π restricted to K and
renormalised: π and q are then distributions over the same support and the ratio is exact.

Every kept set here is a threshold on the temperature-scaled logits u = z/τ (ties at the boundary are kept):
top-k keeps u ≥ the k-th largest, top-p the shortest sorted prefix whose mass reaches p (on what top-k kept),
min-p the tokens with π_v ≥ min_p·max π (u ≥ max u + log min_p); the combination keeps the shortest prefix.
A sampler records |K_t| per drawn token (`kept_mask(...).sum(-1)`); the trainer replays it as its own top |K_t|.

The truncated distribution is the softmax of the logits with −inf outside K (`truncate_logits`), so every
per-token function of covrl.math (log-probs, entropy, Σπ²) applies to it unchanged, and gradients flow through
the renormaliser logsumexp over K. K is piecewise constant in the logits, so this is the gradient of log π_K
almost everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from covrl.math.logprobs import _as_3d, _blocks, _check_temperature

__all__ = ["TruncationRule", "kept_log_mass", "kept_mask", "truncate_logits"]


@dataclass(frozen=True)
class TruncationRule:
    """A sampler's truncation: `top_k` (0 = off), `top_p` (1 = off), `min_p` (0 = off)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if self.top_k < 0 or not (0.0 < self.top_p <= 1.0) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"truncation rule out of range: top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1; "
                             f"got {self}")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _at_least_fp32(z: torch.Tensor) -> torch.Tensor:
    return z.to(torch.promote_types(z.dtype, torch.float32))


def _rule_threshold(u: torch.Tensor, rule: TruncationRule) -> torch.Tensor:
    """[..., 1] threshold of the kept set on scaled logits u [..., V] (fp32)."""
    vocab = u.shape[-1]
    thr = torch.full(u.shape[:-1] + (1,), -math.inf, dtype=u.dtype, device=u.device)
    if 0 < rule.top_k < vocab:
        thr = torch.topk(u, rule.top_k, dim=-1).values[..., -1:]
    if rule.top_p < 1.0:
        masked = u.masked_fill(u < thr, -math.inf)
        lse = torch.logsumexp(masked, dim=-1, keepdim=True)
        # the largest values in order, as many as it takes to cover the mass p on every row (a top-k of a few
        # hundred is much cheaper than sorting the vocabulary)
        k = min(vocab, rule.top_k or vocab, 64)
        while True:
            top = torch.topk(masked, k, dim=-1).values
            probs = torch.exp(top - lse)
            cum = torch.cumsum(probs, dim=-1)
            if k >= min(vocab, rule.top_k or vocab) or bool((cum[..., -1] >= rule.top_p).all()):
                break
            k = min(vocab, rule.top_k or vocab, 4 * k)
        # the most likely token has mass_before 0 and is always kept; count = the shortest prefix reaching p
        count = ((cum - probs) < rule.top_p).sum(-1, keepdim=True).clamp(min=1)
        thr = torch.maximum(thr, top.gather(-1, count - 1))
    if rule.min_p > 0.0:
        thr = torch.maximum(thr, u.amax(-1, keepdim=True) + math.log(rule.min_p))
    return thr


def _count_threshold(u: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[..., 1] threshold keeping the top `counts` [...] values of u (0 = everything)."""
    vocab = u.shape[-1]
    n = counts.long().clamp(min=0, max=vocab)
    full = n == 0
    k = int(n.max()) if n.numel() else 0
    if k == 0:
        return torch.full(u.shape[:-1] + (1,), -math.inf, dtype=u.dtype, device=u.device)
    top = torch.topk(u, k, dim=-1).values
    thr = top.gather(-1, (n.clamp(min=1) - 1)[..., None])
    return thr.masked_fill(full[..., None], -math.inf)


@torch.no_grad()
def kept_mask(logits: torch.Tensor, temperature: float = 1.0, rule: TruncationRule | None = None, *,
              counts: torch.Tensor | None = None, include: torch.Tensor | None = None) -> torch.Tensor:
    """bool [..., V]: the kept set K of each position of `logits` [..., V] at `temperature`.

    Either by `rule` (the sampler's own truncation, recomputed on these logits) or by `counts` [...] (a
    sampler's recorded |K|: the top-|K| of these logits; 0 = no truncation). `include` [...] (token ids, e.g.
    the drawn tokens) are added to K, so a token the sampler drew is never outside the trainer's support when
    the two rank the boundary differently by rounding. No rule and no counts: every token is kept.
    """
    t = _check_temperature(temperature)
    z3 = _as_3d(logits)
    n0, n1, vocab = z3.shape
    out = torch.ones(z3.shape, dtype=torch.bool, device=logits.device)
    if counts is None and (rule is None or not rule.active):
        return _include(out, include, logits.shape)
    c3 = None if counts is None else counts.reshape(n0, n1)
    for rs, cs in _blocks(n0, n1, vocab):
        u = _at_least_fp32(z3[rs, cs]) / t
        thr = _rule_threshold(u, rule) if c3 is None else _count_threshold(u, c3[rs, cs])
        out[rs, cs] = u >= thr
    return _include(out, include, logits.shape)


def _include(mask: torch.Tensor, include: torch.Tensor | None, shape) -> torch.Tensor:
    mask = mask.reshape(shape)
    if include is not None:
        mask.scatter_(-1, include.long().unsqueeze(-1), True)
    return mask


def truncate_logits(logits: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The logits of the truncated distribution: −inf outside the kept set (softmax = π restricted to K and
    renormalised). Differentiable: the gradient reaches the kept logits only."""
    return logits.masked_fill(~kept, -math.inf)


@torch.no_grad()
def kept_log_mass(logits: torch.Tensor, temperature: float, kept: torch.Tensor) -> torch.Tensor:
    """log S = log π(K) per position [...] (fp32; 0 where everything is kept), π = softmax(logits/τ): the factor
    by which π's and π_K's log-probs of a kept token differ (log π = log π_K + log S)."""
    t = _check_temperature(temperature)
    u = _at_least_fp32(logits) / t
    return torch.logsumexp(u.masked_fill(~kept, -math.inf), dim=-1) - torch.logsumexp(u, dim=-1)
