"""The sampler Fisher as a cap on every coordinate of a policy-gradient update (docs/theory.md §3–§4, seed ¶3–¶4).

Covariance split: `E_q[A s] = E_q[A]·E_q[s] + Cov_q(A, s)` (drift / mean shift + signal). With A or the score
centred under the sampler, only the covariance remains and Cauchy–Schwarz gives, per coordinate,
`|Cov_q(A, s_i)| ≤ std_q(A)·sqrt(F_ii)`, `F_ii = Var_q(s_i)`. On an empirical batch (expectations = weighted
batch means) the inequality is exact, which the tests use as a correctness check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from covrl.diagnostics.reach import (
    _seq_advantages,
    _weights,
    as_sequences,
    eval_mode,
    per_sample_scores,
    select_params,
)

CENTERS = ("score", "advantage", "none")

# ----------------------------------------------------------------------------------------------------------
# covariance split on explicit score vectors


@dataclass
class CovarianceSplit:
    """Per coordinate (tensors [P], fp64): gradient g = E[A s], drift = E[A]·E[s], signal = Cov(A, s),
    fisher = Var(s), cap = std(A)·sqrt(fisher), corr = Cov/(std(A)·std(s)) (0 where a std is 0); `metrics`."""

    grad: torch.Tensor
    drift: torch.Tensor
    signal: torch.Tensor
    fisher: torch.Tensor
    cap: torch.Tensor
    corr: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def _over_cap(value: torch.Tensor, cap: torch.Tensor, scale: torch.Tensor, rtol: float) -> torch.Tensor:
    # a coordinate exceeds its cap only beyond the rounding error of the terms that formed it
    return value.abs() - cap > rtol * (cap + scale)


def covariance_split(scores: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor | None = None,
                     *, rtol: float = 1e-9) -> CovarianceSplit:
    """Split the policy gradient on a set of samples into drift and covariance (docs/theory.md §0, identity 1).

    scores [B, P]: score vectors s_b = ∇ log p(Y_b) (rows = samples); advantages [B]; weights [B] (optional,
    default uniform; pass exact probabilities for an enumeration). With E = Σ_b w_b (·):
      grad = E[A s] = drift + signal,  drift = E[A]·E[s],  signal = Cov(A, s) = E[(A − Ā)(s − s̄)],
      fisher = Var(s) = E[(s − s̄)²],  cap = std(A)·sqrt(fisher),  corr = signal / (std(A)·std(s)).
    Metrics: `signal_over_cap_frac` (0 up to rounding: Cauchy–Schwarz), `grad_over_cap_frac` (the uncentred
    gradient can exceed the cap through the drift), `drift_share` ‖drift‖²/‖grad‖², `mean_score_norm` ‖E[s]‖
    (0 on-policy), `identity_error` ‖grad − drift − signal‖/‖grad‖, `max_abs_corr`, `std_adv`.
    """
    s = torch.as_tensor(scores).detach().to(torch.float64)
    if s.dim() == 1:
        s = s[:, None]
    if s.dim() != 2:
        raise ValueError(f"scores must be [B, P]; got shape {list(s.shape)}")
    B = s.shape[0]
    a = torch.as_tensor(advantages).detach().to(torch.float64).flatten()
    if a.numel() != B:
        raise ValueError(f"advantages must be [B] = [{B}] (one per score row); got {list(advantages.shape)}")
    w = _weights(weights, B)
    a_mean = (w * a).sum()
    a_c = a - a_mean
    s_mean = w @ s
    s_c = s - s_mean
    grad = (w * a) @ s
    drift = a_mean * s_mean
    signal = (w * a_c) @ s_c
    fisher = w @ s_c.pow(2)
    std_a = (w * a_c.pow(2)).sum().sqrt()
    std_s = fisher.sqrt()
    cap = std_a * std_s
    denom = std_a * std_s
    corr = torch.where(denom > 0, signal / denom.clamp_min(1e-300), torch.zeros_like(signal))
    scale = (w * a_c.abs()) @ s.abs()
    gnorm2 = float(grad.pow(2).sum())
    metrics = {
        "std_adv": float(std_a),
        "mean_adv": float(a_mean),
        "grad_norm": gnorm2 ** 0.5,
        "signal_norm": float(signal.norm()),
        "drift_norm": float(drift.norm()),
        "drift_share": float(drift.pow(2).sum()) / gnorm2 if gnorm2 > 0 else 0.0,
        "mean_score_norm": float(s_mean.norm()),
        "identity_error": float((grad - drift - signal).norm()) / (gnorm2 ** 0.5) if gnorm2 > 0 else 0.0,
        "signal_over_cap_frac": float(_over_cap(signal, cap, scale, rtol).double().mean()),
        "grad_over_cap_frac": float(_over_cap(grad, cap, scale, rtol).double().mean()),
        "max_abs_corr": float(corr.abs().max()) if corr.numel() else 0.0,
        "fisher_sum": float(fisher.sum()),
    }
    return CovarianceSplit(grad=grad, drift=drift, signal=signal, fisher=fisher, cap=cap, corr=corr, metrics=metrics)


# ----------------------------------------------------------------------------------------------------------
# concentration


def concentration(fisher, values, frac: float = 0.2) -> float:
    """Share of Σ values that sits in the coordinates with the top `frac` Fisher values (all tensors pooled).

    fisher, values: tensors or matching lists/dicts of tensors (e.g. F_ii and Δθ_i²). Ties at the threshold are
    shared in proportion, so the result does not depend on the order of equal Fisher values. A uniform
    spread gives `frac`; 1.0 means all of the values sit in the top-Fisher coordinates.
    """
    if not (0.0 < frac <= 1.0):
        raise ValueError(f"frac must lie in (0, 1]; got {frac}")
    if isinstance(fisher, dict):
        keys = list(fisher)
        fisher, values = [fisher[k] for k in keys], [values[k] for k in keys]
    if isinstance(fisher, torch.Tensor):
        fisher, values = [fisher], [values]
    f = torch.cat([x.detach().flatten().to(torch.float64) for x in fisher])
    v = torch.cat([x.detach().flatten().to(torch.float64) for x in values])
    if f.shape != v.shape:
        raise ValueError(f"fisher and values must have the same number of coordinates; got {f.numel()} and {v.numel()}")
    total = float(v.sum())
    if total <= 0 or f.numel() == 0:
        return float("nan")
    n_top = max(1, int(math.ceil(frac * f.numel())))
    thr = torch.kthvalue(f, f.numel() - n_top + 1).values
    above = f > thr
    tie = f == thr
    n_above = int(above.sum())
    share = float(v[above].sum())
    if int(tie.sum()):
        share += float(v[tie].sum()) * (n_top - n_above) / int(tie.sum())
    return share / total


# ----------------------------------------------------------------------------------------------------------
# model-level Fisher cap


@dataclass
class TensorCap:
    """One parameter tensor: batch gradient (per `center`), sampler-Fisher diagonal, cap std(A)·sqrt(F),
    mean-shift part E[A]·E[s] (all shaped like the parameter; None when keep_tensors=False), and metrics."""

    grad: torch.Tensor | None
    fisher: torch.Tensor | None
    cap: torch.Tensor | None
    mean_shift: torch.Tensor | None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class FisherCap:
    """Per parameter name a TensorCap; pooled `metrics`; `method` is "per-sample" or "lm_head-exact"."""

    tensors: dict[str, TensorCap]
    metrics: dict[str, float]
    method: str
    logprobs: torch.Tensor | None = None


class _Moments:
    """Weighted streaming moments of per-sample scores: mean (Welford), M2, Σ w (A − Ā) s."""

    def __init__(self, shapes: list[torch.Size], dtype: torch.dtype, track_cov: bool = True):
        self.mean = [torch.zeros(s, dtype=dtype) for s in shapes]
        self.m2 = [torch.zeros(s, dtype=dtype) for s in shapes]
        # the advantage-weighted sums are not needed for the Fisher alone (saves memory on real models)
        self.cov = [torch.zeros(s, dtype=dtype) for s in shapes] if track_cov else None
        self.scale = [torch.zeros(s, dtype=dtype) for s in shapes] if track_cov else None
        self.total = 0.0

    def add(self, scores: list[torch.Tensor], w: float, a_c: float) -> None:
        self.total += w
        r = w / self.total
        for i, x in enumerate(scores):
            x = x.detach().to(self.mean[i].dtype).cpu()
            delta = x - self.mean[i]
            self.mean[i].add_(delta, alpha=r)
            self.m2[i].add_(delta * (x - self.mean[i]), alpha=w)
            if self.cov is not None:
                self.cov[i].add_(x, alpha=w * a_c)
                self.scale[i].add_(x.abs(), alpha=w * abs(a_c))


def _lm_head(model: nn.Module):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Linear) else None


def _lm_head_fast_scores(model, seqs, head, want_bias, temperature, chunk=4):
    """Exact per-sample scores of the lm_head from one forward pass: s_b = Σ_t (e_{y_t} − π_t) h_tᵀ / τ."""
    captured = {}

    def hook(_module, inputs):
        captured["h"] = inputs[0]

    handle = head.register_forward_pre_hook(hook)
    try:
        device = head.weight.device
        for start in range(0, len(seqs), chunk):
            idx = list(range(start, min(start + chunk, len(seqs))))
            part = seqs.rows(idx)
            with torch.no_grad():
                out = model(input_ids=part.input_ids.to(device), attention_mask=part.attention_mask.to(device))
            logits = out.logits if hasattr(out, "logits") else out
            h = captured["h"]
            work = torch.float64 if logits.dtype == torch.float64 else torch.float32
            recomputed = head(h)
            if not torch.allclose(recomputed.float(), logits.float(), rtol=1e-4, atol=1e-4):
                raise RuntimeError("the model's logits are not lm_head(h); the lm_head fast path does not apply")
            for j, b in enumerate(idx):
                sm = part.score_mask[j, 1:].to(device)
                z = logits[j, :-1][sm].to(work) / temperature
                y = part.input_ids[j, 1:].to(device)[sm]
                pi = torch.softmax(z, -1)
                lp = float(torch.log_softmax(z, -1).gather(-1, y[:, None]).sum())
                resid = -pi
                resid[torch.arange(y.numel()), y] += 1.0
                resid = resid / temperature
                scores = [resid.T @ h[j, :-1][sm].to(work)]
                if want_bias:
                    scores.append(resid.sum(0))
                yield b, lp, scores
    finally:
        handle.remove()


def score_moments(model: nn.Module, batch, advantages=None, *, weights=None, params=None, temperature: float = 1.0,
                  lm_head_fast: bool = True, accum_dtype: torch.dtype | None = None):
    """Weighted per-sample score moments over a batch of sequences (the sampler's samples).

    Returns (names, moments, logprobs [B], Ā, std(A), method): for each selected parameter the weighted mean
    s̄ = E[s], M2 (so F = Var(s) = M2 with weights summing to 1) and Σ_b w_b (A_b − Ā) s_b. Scores come from one
    backward per row, or — when the selection is exactly the lm_head (weight, optional bias) and the model's
    logits are lm_head(h) — from the closed form (e_y − π)hᵀ of one batched forward ("lm_head-exact").
    """
    seqs = as_sequences(batch)
    B = len(seqs)
    a = torch.zeros(B, dtype=torch.float64) if advantages is None else _seq_advantages(advantages, B)
    w = _weights(weights, B)
    chosen = select_params(model, params)
    a_mean = float((w * a).sum())
    std_a = float((w * (a - a_mean).pow(2)).sum().sqrt())
    n_params = sum(p.numel() for _, p in chosen)
    if accum_dtype is None:
        is64 = any(p.dtype == torch.float64 for _, p in chosen)
        accum_dtype = torch.float64 if is64 or n_params <= 20_000_000 else torch.float32
    moments = _Moments([p.shape for _, p in chosen], accum_dtype, track_cov=advantages is not None)
    head = _lm_head(model)
    method = "per-sample"
    source = None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and emb is not None and getattr(emb, "weight", None) is head.weight
    # a tied lm_head also receives gradient through the input embedding: no closed form then
    if lm_head_fast and head is not None and not tied:
        head_params = {id(head.weight)} | ({id(head.bias)} if head.bias is not None else set())
        ids = [id(p) for _, p in chosen]
        if ids and ids[0] == id(head.weight) and set(ids) <= head_params and len(ids) == len(set(ids)):
            want_bias = len(ids) == 2
            source = _lm_head_fast_scores(model, seqs, head, want_bias, temperature)
            method = "lm_head-exact"
    logps = torch.zeros(B, dtype=torch.float64)
    with eval_mode(model):
        if source is None:
            source = per_sample_scores(model, seqs, chosen, temperature)
        for b, lp, scores in source:
            logps[b] = lp
            moments.add(scores, float(w[b]), float(a[b]) - a_mean)
    return [n for n, _ in chosen], moments, logps, a_mean, std_a, method


def fisher_diagonal(model: nn.Module, batch, *, weights=None, params=None, temperature: float = 1.0,
                    lm_head_fast: bool = True) -> dict[str, torch.Tensor]:
    """Diagonal of the sampler Fisher, `F_ii = Var_b(s_i(Y_b))` over the batch's sequences (weighted), per
    selected parameter name. The batch must come from the sampler whose Fisher you want."""
    names, mom, *_ = score_moments(model, batch, None, weights=weights, params=params, temperature=temperature,
                                   lm_head_fast=lm_head_fast)
    return {n: m2 / mom.total for n, m2 in zip(names, mom.m2)}


def fisher_cap(
    model: nn.Module,
    batch,
    advantages,
    sampler_logprobs=None,
    center: str = "score",
    *,
    weights=None,
    params=None,
    temperature: float = 1.0,
    lm_head_fast: bool = True,
    keep_tensors: bool = True,
    top_frac: float = 0.2,
    rtol: float | None = None,
) -> FisherCap:
    """Per parameter tensor: batch gradient, sampler-Fisher diagonal, the cap std(A)·sqrt(F) and who exceeds it.

    batch: B sequences sampled from the sampler (`Sequences`, RolloutBatch, dict, tuple); advantages [B];
    weights [B] optional (exact enumeration). With E = Σ_b w_b (·) over the batch, s_b = ∇ log p(Y_b):
      F_ii = Var(s_i)   cap_i = std(A)·sqrt(F_ii)   mean_shift_i = E[A]·E[s_i]
      grad = E[A s]                       (center="none": the uncentred estimator; can exceed the cap)
      grad = E[(A − Ā) s] = E[A (s − s̄)]  (center="advantage" / "score": on one empirical batch both equal
                                           Cov(A, s), so |grad_i| ≤ cap_i exactly — Cauchy–Schwarz)
    Score centring under the sampler (docs/theory.md §4) differs from advantage centring per token and in expectation;
    on a single batch of whole sequences they coincide. sampler_logprobs ([B] = log q(Y_b), or [B, T] summed over
    T) is optional and only used to report the sampler–trainer mismatch of the batch (`mismatch_*` metrics).

    Per-tensor metrics: numel, grad_norm, mean_shift_norm, mean_shift_share (‖mean shift‖²/‖uncentred grad‖²),
    over_cap_frac, max_cap_ratio (max |g|/cap over cap > 0), fisher_sum, fisher_top_share (share of ΣF in the
    top `top_frac` coordinates), grad_top_fisher_share (share of ‖g‖² in the top-`top_frac` Fisher coordinates).
    Pooled metrics use the same names over all selected coordinates. With only the lm_head selected (params =
    "lm_head") the scores are computed in closed form from one forward pass (`method = "lm_head-exact"`).
    """
    if center not in CENTERS:
        raise ValueError(f"center must be one of {CENTERS}; got {center!r}")
    names, mom, logps, a_mean, std_a, method = score_moments(
        model, batch, advantages, weights=weights, params=params, temperature=temperature, lm_head_fast=lm_head_fast)
    if rtol is None:
        rtol = 1e-9 if mom.mean[0].dtype == torch.float64 else 1e-4
    tensors: dict[str, TensorCap] = {}
    pooled = {"numel": 0.0, "over": 0.0, "g2": 0.0, "ms2": 0.0, "un2": 0.0, "fsum": 0.0, "max_ratio": 0.0}
    all_f, all_g2 = [], []
    for i, name in enumerate(names):
        fisher = mom.m2[i] / mom.total
        cap = std_a * fisher.sqrt()
        cov = mom.cov[i]
        mean_shift = a_mean * mom.mean[i]
        uncentred = cov + mean_shift
        grad = uncentred if center == "none" else cov
        scale = mom.scale[i] + mean_shift.abs()
        over = _over_cap(grad, cap, scale, rtol)
        pos = cap > 0
        ratio = float((grad.abs()[pos] / cap[pos]).max()) if pos.any() else 0.0
        g2 = float(grad.double().pow(2).sum())
        ms2 = float(mean_shift.double().pow(2).sum())
        un2 = float(uncentred.double().pow(2).sum())
        metrics = {
            "numel": float(grad.numel()),
            "grad_norm": g2 ** 0.5,
            "mean_shift_norm": ms2 ** 0.5,
            "mean_shift_share": ms2 / un2 if un2 > 0 else 0.0,
            "over_cap_frac": float(over.double().mean()),
            "max_cap_ratio": ratio,
            "fisher_sum": float(fisher.double().sum()),
            "fisher_top_share": concentration(fisher, fisher, top_frac) if float(fisher.sum()) > 0 else float("nan"),
            "grad_top_fisher_share": concentration(fisher, grad.pow(2), top_frac) if g2 > 0 else float("nan"),
        }
        pooled["numel"] += grad.numel()
        pooled["over"] += float(over.double().sum())
        pooled["g2"] += g2
        pooled["ms2"] += ms2
        pooled["un2"] += un2
        pooled["fsum"] += metrics["fisher_sum"]
        pooled["max_ratio"] = max(pooled["max_ratio"], ratio)
        all_f.append(fisher)
        all_g2.append(grad.pow(2))
        tensors[name] = TensorCap(*((grad, fisher, cap, mean_shift) if keep_tensors else (None,) * 4), metrics=metrics)
    metrics = {
        "numel": pooled["numel"],
        "std_adv": std_a,
        "mean_adv": a_mean,
        "grad_norm": pooled["g2"] ** 0.5,
        "mean_shift_norm": pooled["ms2"] ** 0.5,
        "mean_shift_share": pooled["ms2"] / pooled["un2"] if pooled["un2"] > 0 else 0.0,
        "over_cap_frac": pooled["over"] / max(1.0, pooled["numel"]),
        "max_cap_ratio": pooled["max_ratio"],
        "fisher_sum": pooled["fsum"],
        "fisher_top_share": concentration(all_f, all_f, top_frac) if pooled["fsum"] > 0 else float("nan"),
        "grad_top_fisher_share": concentration(all_f, all_g2, top_frac) if pooled["g2"] > 0 else float("nan"),
        "batch": float(len(logps)),
    }
    if sampler_logprobs is not None:
        q = torch.as_tensor(sampler_logprobs).detach().to(torch.float64)
        q = q.sum(-1) if q.dim() == 2 else q
        if q.shape != logps.shape:
            raise ValueError(f"sampler_logprobs must be [B] or [B, T] with B = {len(logps)}; got {list(q.shape)}")
        log_ratio = logps - q
        metrics["mismatch_log_ratio_mean"] = float(log_ratio.mean())
        metrics["mismatch_log_ratio_abs_max"] = float(log_ratio.abs().max())
    return FisherCap(tensors=tensors, metrics=metrics, method=method, logprobs=logps)
