"""THE micro-step: forward one micro-batch, take its share of the full batch's loss, backward, and keep a detached
record. The Trainer (`covrl.train.step.trainer`) and covrl.api's `TrainingClient.forward_backward` both run it;
the step's full-batch pieces and folded loss metrics come from the records (`collect`).

    rec = micro_step(mb, rows, forward=..., prepare=..., loss=..., tokens=..., full_mask=...)
      forward(mb)                  -> ResponseForward (log p with grad; detached entropy, Σπ², kept-set stats)
      prepare: Prepared            -> advantages, IS weights, keep-mask of these rows (from a pre-pass), or
               (mb, fwd) -> Prepared  computed from this micro-batch's own log-probs (whole groups)
      loss(mb, rows, fwd, prepared) -> LossTerms: this micro-batch's share of the full batch's loss
      backward(loss)                (rank mechanics, e.g. DDP's world-size factor, wrap it from outside)

How a run forwards a batch (`forward_batch`) and whether it replays a truncating sampler's kept sets
(`truncation_replay`, docs/theory.md §12) are defined here once as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from covrl.math.truncation import TruncationRule
from covrl.models.forward import ResponseForward, TruncationStats, forward_tokens
from covrl.rollout import truncation_rule
from covrl.train.step.micro import fold_micro_metrics, pad_cols

__all__ = ["LossTerms", "MicroRecord", "Prepared", "StepPieces", "collect", "forward_batch", "micro_step",
           "truncation_replay"]


def truncation_replay(sampler_cfg, mode: str) -> tuple[TruncationRule | None, bool]:
    """The sampler's truncation as the trainer's forward sees it: (its rule when it truncates, else None; whether
    the forward replays the kept sets, which it does unless `mode` (trainer.truncation) is "full")."""
    rule = truncation_rule(sampler_cfg)
    active = rule if rule.active else None
    return active, active is not None and mode != "full"


def forward_batch(model, batch, temperature: float, *, with_stats: bool = True,
                  topk_ids: torch.Tensor | None = None, share_prompts: bool = True, autocast: str = "none",
                  truncation: TruncationRule | None = None, replay: bool = False,
                  packing: bool = False) -> ResponseForward:
    """Trainer log-probs (and detached entropy / Σπ², optional top-k log-probs) of the response tokens of a batch
    (a RolloutBatch or covrl.api's TrainBatch) in one forward pass: covrl.models.forward.forward_tokens on the
    batch's tensors (`autocast`: trainer.autocast; the log-probs are fp32 either way). `truncation`: the
    sampler's rule, whose kept sets (the batch's `sampler_kept` sizes where the sampler recorded them) are
    measured, and with `replay` applied (docs/theory.md §12)."""
    return forward_tokens(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask,
                          temperature, with_stats=with_stats, topk_ids=topk_ids, share_prompts=share_prompts,
                          autocast=autocast, truncation=truncation, replay=replay,
                          kept_counts=getattr(batch, "sampler_kept", None), packing=packing)


@dataclass
class Prepared:
    """Detached advantages, IS weights (None without correction.is_level) and keep-mask of some rows: one
    micro-batch (from a pre-pass, or computed from its own forward) or the whole batch; `grad_keep`: the tokens
    whose gradient the loss keeps where that is fewer than `keep` (algorithm.clip_cov), else None."""

    advantages: torch.Tensor | None
    weights: torch.Tensor | None
    keep: torch.Tensor
    grad_keep: torch.Tensor | None = None

    def rows(self, idx: torch.Tensor, width: int) -> Prepared:
        def cut(x):
            return None if x is None else x[idx][:, :width]
        return Prepared(cut(self.advantages), cut(self.weights), cut(self.keep), cut(self.grad_keep))


@dataclass
class LossTerms:
    """A micro-batch's share of the full batch's loss (a scalar with grad), its metrics, and (when the caller
    returns them) its detached per-token losses."""

    loss: torch.Tensor
    metrics: dict[str, float]
    token_loss: torch.Tensor | None = None


@dataclass
class MicroRecord:
    """What a micro-step leaves, all detached: its rows of the full batch, the forward's per-token pieces, the
    prepared quantities it computed itself (None when they were given), its per-token losses (when the loss gave
    them), its loss share as a float, its loss metrics, its token share of the full batch, and why the step must
    be skipped (a non-finite loss) or None. An idle micro-batch (a rank with fewer) records nothing but its keys."""

    rows: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    sum_pi_sq: torch.Tensor
    truncation: TruncationStats | None
    prepared: Prepared | None
    token_loss: torch.Tensor | None
    loss: float
    metrics: dict[str, float]
    share: float
    idle: bool = False
    bad: str | None = None


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


def micro_step(mb, rows: torch.Tensor, *, forward: Callable[[Any], ResponseForward],
               prepare: Prepared | Callable[[Any, ResponseForward], Prepared],
               loss: Callable[[Any, torch.Tensor, ResponseForward, Prepared], LossTerms],
               tokens: torch.Tensor, full_mask: torch.Tensor,
               backward: Callable[[torch.Tensor], None] = _backward, idle: bool = False,
               backward_bad: bool = False) -> MicroRecord:
    """One micro-batch `mb` (rows `rows` of the full batch): forward, prepared quantities, its share of the full
    batch's loss, backward; returns the detached record.

    `tokens`: the micro-batch's counted tokens (its share of the metrics is their count over `full_mask`'s).
    `idle`: a rank's padding micro-batch (the same backward passes on every rank): its loss is zeroed and nothing
    is recorded. A non-finite loss is recorded in `bad` and not backwarded, unless `backward_bad` (ranks that
    must still meet in the backward's collectives)."""
    fwd = forward(mb)
    computed = callable(prepare)
    prep = prepare(mb, fwd) if computed else prepare
    terms = loss(mb, rows, fwd, prep)
    value, bad = terms.loss, None
    if idle:
        value = value * 0.0
    elif not torch.isfinite(value):
        bad = f"non-finite loss ({float(value.detach())}) in a micro-batch of {len(rows)} rows"
    if bad is None or backward_bad:
        backward(value)
    total = float(full_mask.sum())
    share = 0.0 if idle or total == 0 else float(tokens.sum()) / total   # idle: keys, no weight
    return MicroRecord(rows=rows, logprobs=fwd.logprobs.detach(), entropy=fwd.entropy, sum_pi_sq=fwd.sum_pi_sq,
                       truncation=fwd.truncation, prepared=prep if computed else None,
                       token_loss=None if terms.token_loss is None else terms.token_loss.detach(),
                       loss=0.0 if idle else float(value.detach()), metrics=terms.metrics, share=share, idle=idle,
                       bad=bad)


_TRUNCATION_PIECES = ("log_kept_mass", "count_mismatch", "sampled_outside")


@dataclass
class StepPieces:
    """The micro-steps' records assembled over the full batch ([B, T], zeros on rows no record covers, e.g. other
    ranks'): log-probs, entropy, Σπ², the kept-set measurements (`truncation`, per token), the prepared
    quantities computed inside the micro-steps (`prepared`), the per-token losses, the loss (the sum of the
    shares) and the loss metrics folded by token share (`fold_micro_metrics`), and the first reason to skip."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    sum_pi_sq: torch.Tensor
    truncation: dict[str, torch.Tensor] | None = None
    prepared: Prepared | None = None
    token_loss: torch.Tensor | None = None
    loss: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    bad: str | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The per-row tensors, in a fixed order (what a distributed step sums over ranks)."""
        out = [self.logprobs, self.entropy, self.sum_pi_sq, *(self.truncation or {}).values()]
        if self.prepared is not None:
            p = self.prepared
            out += [p.advantages, p.keep] + ([] if p.weights is None else [p.weights])
        return out


def collect(records: list[MicroRecord], rows: int, width: int, device: torch.device, *, prepared: bool = False,
            weights: bool = False, truncation: bool = False, token_loss: bool = False) -> StepPieces:
    """The full batch's pieces from the records, in their order. The flags say which optional pieces exist (the
    same on every rank, whatever rows its records cover): `prepared` (with IS `weights`), the kept-set
    `truncation` measurements, the `token_loss`."""
    def zeros():
        return torch.zeros((rows, width), dtype=torch.float32, device=device)

    out = StepPieces(zeros(), zeros(), zeros(),
                     truncation={k: zeros() for k in _TRUNCATION_PIECES} if truncation else None,
                     prepared=Prepared(zeros(), zeros() if weights else None, zeros()) if prepared else None,
                     token_loss=zeros() if token_loss else None)
    for rec in records:
        if not rec.idle:
            idx = rec.rows
            out.logprobs[idx] = pad_cols(rec.logprobs.float(), width)
            out.entropy[idx] = pad_cols(rec.entropy, width)
            out.sum_pi_sq[idx] = pad_cols(rec.sum_pi_sq, width)
            if out.truncation is not None:
                t = rec.truncation
                for key, piece in zip(_TRUNCATION_PIECES, (t.log_kept_mass, t.count_mismatch, t.sampled_outside)):
                    out.truncation[key][idx] = pad_cols(piece.float(), width)
            if out.prepared is not None and rec.prepared is not None:
                out.prepared.advantages[idx] = pad_cols(rec.prepared.advantages, width)
                out.prepared.keep[idx] = pad_cols(rec.prepared.keep, width)
                if rec.prepared.weights is not None:
                    out.prepared.weights[idx] = pad_cols(rec.prepared.weights, width)
            if out.token_loss is not None:
                out.token_loss[idx] = pad_cols(rec.token_loss.float(), width)
        out.loss += rec.loss
        fold_micro_metrics(out.metrics, rec.metrics, rec.share, rec.idle or rec.share == 0.0)   # no tokens: no extremes
        out.bad = out.bad or rec.bad
    return out
