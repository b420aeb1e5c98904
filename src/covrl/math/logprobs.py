"""Per-token quantities computed from logits: log-probs at a temperature, entropy, Σπ², logit-gradient proxy.

All results are fp32 whatever the logits' dtype. Work is done in chunks of rows so that at most one
chunk-sized fp32 copy of the logits exists at a time (V = 49152 makes a full [B, T, V] fp32 copy expensive);
`token_logprobs` also recomputes the softmax chunk by chunk in its backward pass instead of saving it.
"""

from __future__ import annotations

import torch

# blocks of the logits hold about this many elements (64 MiB in fp32)
CHUNK_ELEMENTS = 1 << 24


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[..., V] as [N0, N1, V]; a view for 2-D/3-D input, so sliced logits (e.g. logits[:, -T-1:-1]) are not copied."""
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _blocks(rows: int, cols: int, vocab: int):
    """(row slice, col slice) blocks of a [rows, cols, V] tensor holding about CHUNK_ELEMENTS elements each."""
    step = _chunk_rows(vocab)
    if step >= cols:
        per = max(1, step // max(cols, 1))
        for r in range(0, rows, per):
            yield slice(r, r + per), slice(0, cols)
    else:
        for r in range(rows):
            for c in range(0, cols, step):
                yield slice(r, r + 1), slice(c, c + step)


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not (t > 0.0) or t != t or t == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0; got {temperature!r}")
    return t


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """z/τ in fp32 (autograd-friendly); may return z itself (fp32, τ = 1): never modify the result in place."""
    z = z.float()
    return z if temperature == 1.0 else z / temperature


def _shifted_copy(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """A fresh fp32 tensor u = z/τ − max(z/τ), safe to modify in place.

    The shift keeps logsumexp differences exact at |z| ~ 1e4, where the fp32 spacing is ~1e-3; one block-sized
    copy is the only allocation.
    """
    u = z.to(torch.float32, copy=True)
    if temperature != 1.0:
        u.div_(temperature)
    return u.sub_(u.amax(dim=-1, keepdim=True))


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(z/τ)[tokens] without materialising a full fp32 log-softmax; chunked forward and backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
        z3 = _as_3d(logits)
        n0, n1, vocab = z3.shape
        tok = tokens.reshape(n0, n1, -1)
        out = torch.empty(tok.shape, dtype=torch.float32, device=logits.device)
        # per position: lse = log Σ exp(u) of the shifted logits u, so that π = exp(u − lse)
        lse = torch.empty((n0, n1), dtype=torch.float32, device=logits.device)
        for rs, cs in _blocks(n0, n1, vocab):
            u = _shifted_copy(z3[rs, cs], temperature)
            picked = u.gather(-1, tok[rs, cs])
            lse_c = u.exp_().sum(-1).log_()  # max(u) = 0, so the sum is in [1, V]
            lse[rs, cs] = lse_c
            out[rs, cs] = picked - lse_c[..., None]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        return out.reshape(tokens.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, tokens, lse = ctx.saved_tensors
        temperature = ctx.temperature
        z3 = _as_3d(logits)
        n0, n1, vocab = z3.shape
        tok = tokens.reshape(n0, n1, -1)
        g = grad_out.reshape(tok.shape).float()
        grad = torch.empty(z3.shape, dtype=logits.dtype, device=logits.device)
        # d/dz log π_y = (e_y − π)/τ, summed over the K gathered tokens of each position
        for rs, cs in _blocks(n0, n1, vocab):
            gz = _shifted_copy(z3[rs, cs], temperature).sub_(lse[rs, cs, None]).exp_()
            gz.mul_(-g[rs, cs].sum(-1, keepdim=True))
            gz.scatter_add_(-1, tok[rs, cs], g[rs, cs])
            if temperature != 1.0:
                gz.div_(temperature)
            grad[rs, cs] = gz
        return grad.reshape(logits.shape), None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of `tokens` under softmax(logits / temperature), in fp32.

    `log π(y) = z_y/τ − logsumexp_v(z_v/τ)`.

    logits [B, T, V] (any float dtype); tokens [B, T] -> [B, T], or [B, T, K] (e.g. a sampler's top-k ids)
    -> [B, T, K]. Differentiable w.r.t. logits (gradient `(e_y − π)/τ`); the softmax is recomputed chunk by
    chunk in the backward pass, so no [B, T, V] fp32 tensor is kept alive between forward and backward.
    """
    t = _check_temperature(temperature)
    if logits.dim() < 2:
        raise ValueError(f"logits must be [..., V]; got shape {list(logits.shape)}")
    lead = tuple(logits.shape[:-1])
    if tuple(tokens.shape) != lead and tuple(tokens.shape[:-1]) != lead:
        raise ValueError(f"tokens must have shape {list(lead)} or {list(lead)}+[K] to match logits "
                         f"{list(logits.shape)}; got tokens {list(tokens.shape)}")
    if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"tokens must be an integer tensor; got dtype {tokens.dtype}")
    tokens = tokens.long()
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= logits.shape[-1]):
        raise ValueError(f"token ids must lie in [0, {logits.shape[-1]}); got range "
                         f"[{int(tokens.min())}, {int(tokens.max())}]")
    squeeze = tuple(tokens.shape) == lead
    tok = tokens.unsqueeze(-1) if squeeze else tokens
    out = _TokenLogprobs.apply(logits, tok.contiguous(), t)
    return out.squeeze(-1) if squeeze else out


def _per_row(logits: torch.Tensor, temperature: float, differentiable, in_place) -> torch.Tensor:
    """Apply a per-position reduction block by block. With autograd on, `differentiable(z/τ)` is used;
    otherwise `in_place(u)` on a fresh shifted copy u = z/τ − max (fewer block-sized temporaries)."""
    z3 = _as_3d(logits)
    n0, n1, vocab = z3.shape
    grad = torch.is_grad_enabled() and logits.requires_grad
    parts = [differentiable(_scaled(z3[rs, cs], temperature)) if grad
             else in_place(_shifted_copy(z3[rs, cs], temperature))
             for rs, cs in _blocks(n0, n1, vocab)]
    if not parts:
        return torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    if len(parts) == 1:
        return parts[0].reshape(logits.shape[:-1])
    # blocks are either whole rows (concatenate along dim 0) or pieces of one row (along dim 1, then rows)
    if parts[0].shape[1] == n1:
        out = torch.cat(parts, 0)
    else:
        per_row = -(-n1 // _chunk_rows(vocab))
        out = torch.cat([torch.cat(parts[i:i + per_row], 1) for i in range(0, len(parts), per_row)], 0)
    return out.reshape(logits.shape[:-1])


def _entropy_grad(u: torch.Tensor) -> torch.Tensor:
    u = u - u.detach().amax(dim=-1, keepdim=True)  # H is shift invariant; small numbers keep precision
    # π·u with u = −inf (a masked logit) must be 0, not 0·(−inf) = NaN: clamp u to the dtype's finite minimum
    return torch.logsumexp(u, dim=-1) - (torch.softmax(u, dim=-1) * u.clamp(min=torch.finfo(u.dtype).min)).sum(-1)


def _entropy_in_place(u: torch.Tensor) -> torch.Tensor:
    e = u.exp()
    total = e.sum(-1)  # ≥ 1 because max(u) = 0
    u.clamp_(min=torch.finfo(u.dtype).min)  # masked (−inf) logits: e = 0 there, and 0·finite = 0 (not NaN)
    return total.log() - u.mul_(e).sum(-1) / total


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits/τ) per position, fp32 [B, T].

    `H = log Σ_v e^{u_v} − Σ_v π_v u_v` with u = z/τ − max(z/τ) (equal to `−Σ π log π`, without forming
    log π). Differentiable when the logits require grad.
    """
    return _per_row(logits, _check_temperature(temperature), _entropy_grad, _entropy_in_place)


def _sps_grad(u: torch.Tensor) -> torch.Tensor:
    u = u - u.detach().amax(dim=-1, keepdim=True)  # Σπ² is shift invariant; small numbers keep precision
    return torch.exp(torch.logsumexp(2.0 * u, dim=-1) - 2.0 * torch.logsumexp(u, dim=-1)).clamp(max=1.0)


def _sps_in_place(u: torch.Tensor) -> torch.Tensor:
    e = u.exp_()
    s1 = e.sum(-1)  # ≥ 1 because max(u) = 0: no overflow, no underflow of the ratio
    return (e.square_().sum(-1) / s1.square()).clamp(max=1.0)


def sum_pi_squared(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Σ_v π_v² of π = softmax(logits/τ) per position, fp32 [B, T].

    Logsumexp form `Σπ² = exp(logsumexp(2u) − 2·logsumexp(u))` with u = z/τ − max(z/τ): since max(u) = 0 this
    equals `Σ e^{2u} / (Σ e^{u})²` with both sums in [1, V], so nothing overflows at any |z| (tested at 1e4,
    where the shift also keeps full fp32 precision); result in [1/V, 1]. Differentiable when the logits
    require grad (callers usually use it detached).
    """
    return _per_row(logits, _check_temperature(temperature), _sps_grad, _sps_in_place)


def logit_grad_proxy(logprobs: torch.Tensor, sum_pi_sq: torch.Tensor) -> torch.Tensor:
    """Logit-gradient proxy `w = ‖e_y − π‖² = 1 − 2π_y + Σ_v π_v²` (docs/theory.md §1, §7), fp32, clamped at ≥ 0.

    logprobs [B, T]: log π_y of the drawn tokens (same temperature as `sum_pi_sq`); sum_pi_sq [B, T].
    This is the squared norm of ∂ log π_y / ∂z (z = logits/τ); it is 0 for a one-hot π on y and at most 2.
    """
    if tuple(logprobs.shape) != tuple(sum_pi_sq.shape):
        raise ValueError(f"shape mismatch: logprobs {list(logprobs.shape)} vs sum_pi_sq {list(sum_pi_sq.shape)}")
    pi_y = torch.exp(logprobs.float().clamp(max=0.0))
    return (1.0 - 2.0 * pi_y + sum_pi_sq.float()).clamp_min(0.0)
