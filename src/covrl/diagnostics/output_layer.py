"""What backpropagation carries into the network from the output layer (docs/theory.md §1, seed ¶1).

For logits z = W_U h (W_U ∈ R^{V×d}, rows w_v) and π = softmax(z/τ), one token's policy-gradient signal at the
lm_head input is `A·∂ log π(y)/∂h = (A/τ)·(w_y − Σ_v π_v w_v)`. It lies in span{w_u − w_v : u, v competing} up
to a leak of the size of the tail mass outside the competing set, so a map that feeds the unembedding gets an
update of rank at most (#competing − 1) plus the leak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from covrl.diagnostics.spectrum import UpdateSpectrum, update_spectrum


@dataclass
class OutputLayerSignal:
    """Per valid position n (row-major over the [B, T] mask):

    signal          [N, d]  A_n·(w_y − Σ_v π_v w_v)/τ, the backprop signal into h
    positions       [N, 2]  (b, t) of each row
    competing_sizes [N]     |K_n|: smallest top set with mass ≥ 1 − tail_eps, plus the drawn token
    tail_mass       [N]     1 − Σ_{v∈K_n} π_v
    span_share      [N]     ‖P_n g_n‖²/‖g_n‖², P_n = projection on span{w_u − w_v : u, v ∈ K_n} (NaN if g_n = 0)
    proxy           [N]     logit-gradient proxy ‖e_y − π‖² = 1 − 2π_y + Σ_v π_v²
    row_share       [N]     Σ_{v∈K_n} (e_y − π)_v² / ‖e_y − π‖²: share of this position's lm_head gradient
                            (e_y − π)hᵀ in competing rows
    spectrum                update_spectrum of the stacked signal [N, d]
    lm_head_grad    [V, d]  Σ_n A_n (e_y − π_n) h_nᵀ/τ when `hidden` is given (the ascent direction), else None
    metrics                 scalar summaries (see `output_layer_signal`)
    """

    signal: torch.Tensor
    positions: torch.Tensor
    competing_sizes: torch.Tensor
    tail_mass: torch.Tensor
    span_share: torch.Tensor
    proxy: torch.Tensor
    row_share: torch.Tensor
    spectrum: UpdateSpectrum
    lm_head_grad: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def _check_inputs(logits, tokens, advantages, W_U, mask, hidden):
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V]; got shape {list(logits.shape)}")
    B, T, V = logits.shape
    if tuple(tokens.shape) != (B, T):
        raise ValueError(f"tokens must be [B, T] = {[B, T]}; got {list(tokens.shape)}")
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"mask must be [B, T] = {[B, T]}; got {list(mask.shape)}")
    if advantages.dim() == 1:
        if advantages.shape[0] != B:
            raise ValueError(f"advantages must be [B] = [{B}] or [B, T]; got {list(advantages.shape)}")
        advantages = advantages[:, None].expand(B, T)
    elif tuple(advantages.shape) != (B, T):
        raise ValueError(f"advantages must be [B] = [{B}] or [B, T] = {[B, T]}; got {list(advantages.shape)}")
    if W_U.dim() != 2 or W_U.shape[0] != V:
        raise ValueError(f"W_U must be [V, d] with V = {V} (the logits' last dim); got {list(W_U.shape)}")
    if hidden is not None and tuple(hidden.shape) != (B, T, W_U.shape[1]):
        raise ValueError(f"hidden must be [B, T, d] = {[B, T, W_U.shape[1]]}; got {list(hidden.shape)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= V):
        raise ValueError(f"token ids must lie in [0, {V}); got [{int(tokens.min())}, {int(tokens.max())}]")
    return advantages


def output_layer_signal(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    advantages: torch.Tensor,
    W_U: torch.Tensor,
    mask: torch.Tensor,
    tail_eps: float = 1e-2,
    *,
    temperature: float = 1.0,
    hidden: torch.Tensor | None = None,
    k: int | None = None,
    max_competing: int = 64,
    chunk: int = 256,
) -> OutputLayerSignal:
    """Backprop signal at the lm_head input and how much of it the competing tokens explain.

    Inputs: logits [B, T, V] = W_U h (+ bias) at the positions that produced `tokens` [B, T]; advantages [B] or
    [B, T]; W_U [V, d] the unembedding (`model.lm_head.weight`); mask [B, T] (1 = valid response token);
    hidden [B, T, d] (optional) the lm_head input, for the exact lm_head gradient.

    Per valid position: π = softmax(z/τ); signal `g = (A/τ)·(w_y − πᵀW_U)` (= A·∂ log π(y)/∂h);
    competing set K = smallest top-probability set with mass ≥ 1 − tail_eps (at most `max_competing` tokens) plus
    the drawn token; tail mass ε = 1 − π(K); span share `‖P g‖²/‖g‖²` with P the orthogonal projection on
    span{w_u − w_v : u, v ∈ K}; logit-gradient proxy `1 − 2π_y + Σπ²`; share of the lm_head gradient
    `(e_y − π)hᵀ` in the competing rows `Σ_{v∈K}(e_y − π)_v²/‖e_y − π‖²`.

    Metrics: `span_share` (Σ‖Pg‖²/Σ‖g‖², signal-weighted), `span_share_mean`, `competing_size_mean|max`,
    `competing_union` (|∪K_n|), `competing_capped_frac` (positions where max_competing tokens did not reach
    1 − tail_eps), `tail_mass_mean|max`, `energy_top_k`, `k` (default |∪K_n| − 1, at most d), `numerical_rank`,
    `stable_rank`, `effective_rank` of the stacked signal, `proxy_mean`, `row_share` (A²-weighted per-position
    share) and, with `hidden`, `lm_head_competing_share`: share of ‖Σ_n A_n(e_y − π_n)h_nᵀ‖_F² in rows ∪K_n.
    """
    advantages = _check_inputs(logits, tokens, advantages, W_U, mask, hidden)
    if not (0.0 <= tail_eps < 1.0):
        raise ValueError(f"tail_eps must lie in [0, 1); got {tail_eps}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if max_competing < 1:
        raise ValueError(f"max_competing must be >= 1; got {max_competing}")
    B, T, V = logits.shape
    d = W_U.shape[1]
    work = torch.float64 if logits.dtype == torch.float64 or W_U.dtype == torch.float64 else torch.float32
    valid = mask > 0
    pos = valid.nonzero()  # [N, 2]
    z_all = logits[valid]
    y_all = tokens[valid].long()
    a_all = advantages[valid].to(work)
    h_all = hidden[valid].to(work) if hidden is not None else None
    W = W_U.detach().to(work)
    M = min(max_competing, V)

    signals, sizes, tails, shares, proxies, row_shares = [], [], [], [], [], []
    union = torch.zeros(V, dtype=torch.bool)
    capped = 0
    lm_grad = torch.zeros(V, d, dtype=work) if hidden is not None else None
    for start in range(0, pos.shape[0], chunk):
        sl = slice(start, start + chunk)
        z = z_all[sl].detach().to(work) / temperature
        y = y_all[sl]
        a = a_all[sl]
        c = z.shape[0]
        pi = torch.softmax(z, dim=-1)
        resid = -pi
        resid[torch.arange(c), y] += 1.0  # e_y − π
        g = (a / temperature)[:, None] * (resid @ W)  # [c, d]

        # competing set: top-M prefix reaching 1 − tail_eps, plus the drawn token
        top_p, top_i = pi.topk(M, dim=-1)
        before = top_p.cumsum(-1) - top_p
        in_prefix = before < 1.0 - tail_eps
        capped += int((top_p.sum(-1) < 1.0 - tail_eps).sum())
        y_in = ((top_i == y[:, None]) & in_prefix).any(-1)
        idx = torch.cat([top_i, y[:, None]], dim=1)  # [c, M+1]
        active = torch.cat([in_prefix, ~y_in[:, None]], dim=1)
        size = active.sum(-1)
        tail = 1.0 - (torch.gather(pi, 1, idx) * active).sum(-1)
        union[idx[active]] = True

        # span{w_u − w_v : u, v ∈ K} = span{w_u − w_{u0}}, u0 = the most likely token; inactive slots give 0 rows
        base = W[idx[:, 0]]  # [c, d]
        D = (W[idx[:, 1:]] - base[:, None, :]) * active[:, 1:, None]  # [c, M, d]
        Dg = torch.einsum("cmd,cd->cm", D.double(), g.double())
        gram = D.double() @ D.double().transpose(1, 2)
        evals, evecs = torch.linalg.eigh(gram)
        keep = evals > 1e-10 * evals.amax(-1, keepdim=True).clamp_min(1e-300)
        coef = torch.einsum("cmk,cm->ck", evecs, Dg)
        proj_sq = (coef.pow(2) / evals.clamp_min(1e-300) * keep).sum(-1)
        g_sq = g.double().pow(2).sum(-1)
        share = torch.where(g_sq > 0, proj_sq / g_sq.clamp_min(1e-300), torch.full_like(g_sq, float("nan")))

        resid_sq = resid.pow(2)
        # scatter_add, not scatter: the drawn token may sit twice in idx (inactive in the top-M, active at the end)
        row_in = torch.zeros(resid_sq.shape, dtype=torch.long).scatter_add_(1, idx, active.long()) > 0
        proxy = resid_sq.sum(-1)
        row_share = (resid_sq * row_in).sum(-1) / proxy.clamp_min(1e-30)
        if lm_grad is not None:
            lm_grad += ((a / temperature)[:, None] * resid).T @ h_all[sl]

        signals.append(g)
        sizes.append(size)
        tails.append(tail)
        shares.append(share.clamp(max=1.0))
        proxies.append(proxy)
        row_shares.append(row_share)

    def cat(xs, dtype=work):
        return torch.cat(xs) if xs else torch.zeros(0, dtype=dtype)

    signal = cat(signals).reshape(-1, d)
    sizes_t = cat(sizes, torch.long)
    tails_t = cat(tails)
    shares_t = cat(shares, torch.float64)
    proxies_t = cat(proxies)
    rows_t = cat(row_shares)
    n_union = int(union.sum())
    k_eff = int(k) if k is not None else max(1, min(n_union - 1, d))
    spec = update_spectrum(signal, k_eff) if signal.shape[0] else update_spectrum(torch.zeros(1, d), k_eff)

    g_sq = signal.double().pow(2).sum(-1)
    finite = torch.isfinite(shares_t)
    weighted = float((shares_t[finite] * g_sq[finite]).sum() / g_sq.sum()) if float(g_sq.sum()) > 0 else float("nan")
    a_sq = a_all.double().pow(2)
    row_w = a_sq * (h_all.double().pow(2).sum(-1) if h_all is not None else 1.0)
    metrics = {
        "positions": float(pos.shape[0]),
        "span_share": weighted,
        "span_share_mean": float(shares_t[finite].mean()) if finite.any() else float("nan"),
        "competing_size_mean": float(sizes_t.double().mean()) if sizes_t.numel() else 0.0,
        "competing_size_max": float(sizes_t.max()) if sizes_t.numel() else 0.0,
        "competing_union": float(n_union),
        "competing_capped_frac": capped / max(1, pos.shape[0]),
        "tail_mass_mean": float(tails_t.double().mean()) if tails_t.numel() else 0.0,
        "tail_mass_max": float(tails_t.max()) if tails_t.numel() else 0.0,
        "proxy_mean": float(proxies_t.double().mean()) if proxies_t.numel() else 0.0,
        "row_share": float((rows_t.double() * row_w).sum() / row_w.sum()) if float(row_w.sum()) > 0 else float("nan"),
        **{key: spec.metrics[key] for key in ("energy_top_k", "k", "numerical_rank", "stable_rank", "effective_rank")},
    }
    if lm_grad is not None:
        total = float(lm_grad.double().pow(2).sum())
        metrics["lm_head_competing_share"] = (
            float(lm_grad[union].double().pow(2).sum()) / total if total > 0 else float("nan"))
    return OutputLayerSignal(
        signal=signal, positions=pos, competing_sizes=sizes_t, tail_mass=tails_t, span_share=shares_t,
        proxy=proxies_t, row_share=rows_t, spectrum=spec, lm_head_grad=lm_grad, metrics=metrics,
    )
