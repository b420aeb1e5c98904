"""Reach of one policy-gradient step (docs/theory.md §2, seed ¶2), measured on a real `nn.Module`.

For a step Δθ = η g with g = E_q[A s] (A centred under the sampler q), the log-odds of two responses y1, y2 move
at rate `⟨d, g⟩ = Cov_q(A, ⟨d, s(Y)⟩) ≤ std_q(A)·‖d‖_{F_q}`, d = s(y1) − s(y2), ‖d‖²_{F_q} = Var_q⟨d, s(Y)⟩.
On the sampler's empirical batch the inequality is Cauchy–Schwarz, so it holds exactly.

This module also holds the small sequence plumbing shared by the model-level diagnostics (`fisher.py`):
a batch of token sequences with a mask of scored positions, sequence log-probs, and per-sample scores.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

# ----------------------------------------------------------------------------------------------------------
# sequences


@dataclass
class Sequences:
    """B right-padded token sequences.

    input_ids [B, L] long; attention_mask [B, L] (1 = real token, real tokens first);
    score_mask [B, L] bool: position t counts in log p(Y) = Σ_t log p(input_ids[t] | input_ids[<t]) (t ≥ 1).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    score_mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def row(self, b: int) -> Sequences:
        n = int(self.attention_mask[b].sum())
        return Sequences(self.input_ids[b:b + 1, :n], self.attention_mask[b:b + 1, :n], self.score_mask[b:b + 1, :n])

    def rows(self, index: list[int]) -> Sequences:
        idx = torch.as_tensor(index, dtype=torch.long)
        n = max(1, int(self.attention_mask[idx].sum(-1).max()))
        return Sequences(self.input_ids[idx, :n], self.attention_mask[idx, :n], self.score_mask[idx, :n])


def _pad_rows(rows: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int = 0) -> Sequences:
    if not rows:
        raise ValueError("the batch has no rows")
    L = max(int(ids.numel()) for ids, _ in rows)
    B = len(rows)
    ids_out = torch.full((B, L), pad_id, dtype=torch.long)
    am = torch.zeros(B, L, dtype=torch.long)
    sm = torch.zeros(B, L, dtype=torch.bool)
    for b, (ids, score) in enumerate(rows):
        n = ids.numel()
        ids_out[b, :n] = ids
        am[b, :n] = 1
        sm[b, :n] = score.bool()
        if n and bool(sm[b, 0]):
            raise ValueError(f"row {b}: the first token cannot be scored (it has no prefix); start with a prompt/BOS")
    return Sequences(ids_out, am, sm)


def as_sequences(batch, pad_id: int = 0) -> Sequences:
    """Normalise a batch to `Sequences`.

    Accepted: `Sequences`; a `covrl.rollout.types.RolloutBatch` (prompt tokens where prompt_mask = 1, then the
    response up to its last valid token; scored where response_mask = 1); a dict with `input_ids` [B, L],
    optional `attention_mask` [B, L] (padding may sit anywhere; it is squeezed out) and `score_mask` or
    `response_mask` [B, L]; a tuple `(input_ids, score_mask)` of [L] or [B, L] tensors.
    """
    if isinstance(batch, Sequences):
        return batch
    if hasattr(batch, "prompt_ids") and hasattr(batch, "response_ids"):
        rows = []
        for b in range(batch.prompt_ids.shape[0]):
            p = batch.prompt_ids[b][batch.prompt_mask[b] > 0]
            rm = batch.response_mask[b] > 0
            last = int(rm.nonzero().max()) + 1 if rm.any() else 0
            r = batch.response_ids[b, :last]
            ids = torch.cat([p.long(), r.long()])
            score = torch.cat([torch.zeros(p.numel(), dtype=torch.bool), rm[:last]])
            rows.append((ids, score))
        return _pad_rows(rows, pad_id)
    if isinstance(batch, dict):
        if "input_ids" not in batch:
            raise ValueError(f"a dict batch needs 'input_ids'; got keys {sorted(batch)}")
        ids = torch.as_tensor(batch["input_ids"])
        score = batch.get("score_mask", batch.get("response_mask"))
        if score is None:
            raise ValueError("a dict batch needs 'score_mask' (or 'response_mask'): which tokens form the response")
        score = torch.as_tensor(score)
        am = torch.as_tensor(batch.get("attention_mask", torch.ones_like(ids)))
        if ids.dim() == 1:
            ids, score, am = ids[None], score[None], am[None]
        if score.shape != ids.shape or am.shape != ids.shape:
            raise ValueError(f"input_ids {list(ids.shape)}, score_mask {list(score.shape)} and attention_mask "
                             f"{list(am.shape)} must have the same shape")
        rows = [(ids[b][am[b] > 0], score[b][am[b] > 0]) for b in range(ids.shape[0])]
        return _pad_rows(rows, pad_id)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return as_sequences({"input_ids": batch[0], "score_mask": batch[1]}, pad_id)
    raise TypeError(f"cannot read a batch of type {type(batch).__name__}; pass Sequences, a RolloutBatch, "
                    "a dict with input_ids/score_mask or a tuple (input_ids, score_mask)")


def _call_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    except TypeError:
        out = model(input_ids)
    return out.logits if hasattr(out, "logits") else out


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def sequence_logprobs(model: nn.Module, seqs: Sequences, temperature: float = 1.0) -> torch.Tensor:
    """log p(Y_b) = Σ_{t scored} log softmax(z_{t−1}/τ)[y_t], one forward pass; [B] in fp32 (fp64 for fp64 models).

    Differentiable with respect to the model's parameters. The logits at position t−1 predict token t.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    device = next(model.parameters()).device
    ids = seqs.input_ids.to(device)
    logits = _call_logits(model, ids, seqs.attention_mask.to(device))
    if logits.shape[:2] != ids.shape:
        raise ValueError(f"the model returned logits {list(logits.shape)} for input_ids {list(ids.shape)}")
    z = logits[:, :-1].to(_work_dtype(logits)) / temperature
    lp = torch.log_softmax(z, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (lp * seqs.score_mask[:, 1:].to(device, lp.dtype)).sum(-1)


def select_params(model: nn.Module, params=None) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs a diagnostic differentiates.

    None: every parameter with requires_grad; a string: names matching that regular expression (re.search);
    a list of names. Shared (tied) parameters appear once.
    """
    named = list(model.named_parameters())
    if params is None:
        chosen = [(n, p) for n, p in named if p.requires_grad]
    elif isinstance(params, str):
        rx = re.compile(params)
        chosen = [(n, p) for n, p in named if rx.search(n)]
    else:
        wanted = list(params)
        lookup = dict(named)
        missing = [n for n in wanted if n not in lookup]
        if missing:
            raise ValueError(f"unknown parameter name(s) {missing[:3]}; e.g. {[n for n, _ in named[:3]]}")
        chosen = [(n, lookup[n]) for n in wanted]
    if not chosen:
        raise ValueError(f"no parameter selected by params={params!r}")
    return chosen


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Evaluate without dropout, restoring the module's train/eval state afterwards."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


@contextlib.contextmanager
def _eager_attention(model: nn.Module):
    # forward-mode AD is not implemented for the fused SDPA kernels; eager attention is the same math
    config = getattr(model, "config", None)
    old = getattr(config, "_attn_implementation", None) if config is not None else None
    switched = False
    if old not in (None, "eager") and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("eager")
            switched = True
        except Exception:  # noqa: BLE001 - keep the model's own implementation if it cannot switch
            switched = False
    try:
        yield
    finally:
        if switched:
            model.set_attn_implementation(old)


def per_sample_scores(model: nn.Module, seqs: Sequences, params: list[tuple[str, nn.Parameter]],
                      temperature: float = 1.0) -> Iterator[tuple[int, float, list[torch.Tensor]]]:
    """Yield (b, log p(Y_b), s(Y_b)) with s = ∇_θ log p(Y_b) per selected parameter: one forward + backward per
    row (unused parameters get zeros)."""
    tensors = [p for _, p in params]
    for b in range(len(seqs)):
        logp = sequence_logprobs(model, seqs.row(b), temperature)[0]
        grads = torch.autograd.grad(logp, tensors, allow_unused=True)
        yield b, float(logp.detach()), [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, tensors)]


def _dot(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(xs, ys)))


def directional_logprobs(model: nn.Module, seqs: Sequences, params: list[tuple[str, nn.Parameter]],
                         direction: list[torch.Tensor], temperature: float = 1.0, method: str = "auto",
                         chunk: int = 8) -> tuple[torch.Tensor, str]:
    """⟨direction, ∇_θ log p(Y_b)⟩ for every row b, [B] fp64, and the method used.

    method "jvp": forward-mode JVP through `torch.func.functional_call` (one forward per chunk of rows; attention
    switched to eager for the duration); "backward": one backward pass per row; "auto": jvp, falling back to
    backward if the model has an operation without a forward-mode derivative.
    """
    if method not in ("auto", "jvp", "backward"):
        raise ValueError(f"method must be 'auto', 'jvp' or 'backward'; got {method!r}")
    if method in ("auto", "jvp"):
        try:
            from torch.func import jvp

            primals = {n: p.detach() for n, p in params}
            tangents = {n: t.to(p.dtype) for (n, p), t in zip(params, direction)}
            out = []
            with _eager_attention(model):
                for start in range(0, len(seqs), chunk):
                    part = seqs.rows(list(range(start, min(start + chunk, len(seqs)))))

                    def f(p, part=part):
                        return sequence_logprobs(_Bound(model, p), part, temperature)

                    _, jv = jvp(f, (primals,), (tangents,))
                    out.append(jv.detach().double())
            return torch.cat(out), "jvp"
        except (NotImplementedError, RuntimeError) as err:
            if method == "jvp":
                raise RuntimeError(f"forward-mode JVP failed on this model ({err}); use method='backward'") from err
    vals = [_dot(s, direction) for _, _, s in per_sample_scores(model, seqs, params, temperature)]
    return torch.tensor(vals, dtype=torch.float64), "backward"


class _Bound(nn.Module):
    """A view of `model` whose selected parameters are replaced by the given tensors (for torch.func)."""

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor]):
        super().__init__()
        self.model = model
        self.params = params

    def forward(self, input_ids, attention_mask=None):
        from torch.func import functional_call

        try:
            return functional_call(self.model, self.params, (), {"input_ids": input_ids, "attention_mask": attention_mask})
        except TypeError:
            return functional_call(self.model, self.params, (input_ids,))

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)


def _weights(weights, B: int) -> torch.Tensor:
    if weights is None:
        return torch.full((B,), 1.0 / B, dtype=torch.float64)
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if w.numel() != B:
        raise ValueError(f"weights must have one entry per row ({B}); got {w.numel()}")
    if (w < 0).any() or float(w.sum()) <= 0:
        raise ValueError("weights must be >= 0 with a positive sum")
    return w / w.sum()


def _seq_advantages(advantages, B: int) -> torch.Tensor:
    a = torch.as_tensor(advantages).detach().to(torch.float64)
    if a.dim() == 2 and a.shape[0] == B:
        # per-token advantages that are constant over the response (outcome rewards): take the row's value
        nz = a != 0
        first = torch.where(nz.any(-1), a.gather(-1, nz.float().argmax(-1, keepdim=True)).squeeze(-1), a[:, 0] * 0)
        if not torch.all((a == first[:, None]) | ~nz):
            raise ValueError("advantages [B, T] vary along the sequence; pass one advantage per sequence [B]")
        a = first
    if a.dim() != 1 or a.shape[0] != B:
        raise ValueError(f"advantages must be [B] = [{B}] (one per sequence); got {list(a.shape)}")
    return a


# ----------------------------------------------------------------------------------------------------------
# reach bound


@dataclass
class ReachBound:
    """d = s(y1) − s(y2) per selected parameter (`direction`), the projections ⟨d, s(Y_b)⟩ [B] (`projections`),
    the method used and `metrics`: rate, bound, ratio, covariance, drift, std_adv, fisher_norm, d_norm, logodds."""

    direction: list[torch.Tensor]
    projections: torch.Tensor
    method: str
    metrics: dict[str, float] = field(default_factory=dict)


def reach_bound(
    model: nn.Module,
    sampler_batch,
    advantages,
    y1,
    y2,
    *,
    center: bool = True,
    weights=None,
    temperature: float = 1.0,
    params=None,
    method: str = "auto",
) -> ReachBound:
    """How fast one policy-gradient step can move the log-odds of y1 over y2 (docs/theory.md §2).

    sampler_batch: B sampled responses (`Sequences`, RolloutBatch, dict or tuple, see `as_sequences`);
    advantages [B] (one per sequence); y1, y2: one sequence each (same formats, one row), e.g. prompt + response.
    weights [B] (optional): probabilities of the rows for exact enumeration (default uniform 1/B).

    d = ∇ log p(y1) − ∇ log p(y2) (two backward passes); x_b = ⟨d, s(Y_b)⟩ by forward-mode JVP (or one backward
    per row). With w the row weights, Ā = Σ w A, and A centred (`center=True`: A − Ā):
      rate   = ⟨d, g⟩ = Σ_b w_b A_b x_b,   g = Σ_b w_b A_b s(Y_b)   (d/dη of log-odds after θ += η g)
      bound  = std(A)·‖d‖_F,  std(A)² = Σ w (A − Ā)²,  ‖d‖_F² = Σ w (x − x̄)²  (empirical sampler Fisher)
      ratio  = rate / bound ∈ [−1, 1] for centred A (Cauchy–Schwarz; exact on the batch).
    Uncentred (`center=False`) the rate gains the drift Ā·x̄, which the bound does not cover; both parts are in
    the metrics (`covariance` + `drift` = rate). `d_norm` is the Euclidean ‖d‖, `logodds` = log p(y1) − log p(y2).
    """
    seqs = as_sequences(sampler_batch)
    B = len(seqs)
    a = _seq_advantages(advantages, B)
    w = _weights(weights, B)
    chosen = select_params(model, params)
    tensors = [p for _, p in chosen]
    with eval_mode(model):
        pair = []
        for y in (y1, y2):
            ys = as_sequences(y)
            if len(ys) != 1:
                raise ValueError(f"y1 and y2 must be one sequence each; got {len(ys)} rows")
            lp = sequence_logprobs(model, ys, temperature)[0]
            grads = torch.autograd.grad(lp, tensors, allow_unused=True)
            pair.append((float(lp.detach()), [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, tensors)]))
        direction = [g1 - g2 for g1, g2 in zip(pair[0][1], pair[1][1])]
        x, used = directional_logprobs(model, seqs, chosen, direction, temperature, method)
    a_mean = float((w * a).sum())
    a_c = a - a_mean
    x_mean = float((w * x).sum())
    std_a = float((w * a_c.pow(2)).sum().sqrt())
    fisher_norm = float((w * (x - x_mean).pow(2)).sum().sqrt())
    covariance = float((w * a_c * (x - x_mean)).sum())
    drift = a_mean * x_mean
    rate = float((w * (a_c if center else a) * x).sum())
    bound = std_a * fisher_norm
    metrics = {
        "rate": rate,
        "bound": bound,
        "ratio": rate / bound if bound > 0 else float("nan"),
        "covariance": covariance,
        "drift": 0.0 if center else drift,
        "std_adv": std_a,
        "fisher_norm": fisher_norm,
        "d_norm": _dot(direction, direction) ** 0.5,
        "logodds": pair[0][0] - pair[1][0],
        "batch": float(B),
    }
    return ReachBound(direction=direction, projections=x, method=used, metrics=metrics)
