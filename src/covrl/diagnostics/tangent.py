"""Gain of a policy update measured from the sampler: tangent + remainder (docs/theory.md §5).

For any trainer p and sampler q with supp p ⊆ supp q, ρ(y) = p(y)/q(y) and r̄ = E_q[R]:

    J(p) − J(q) = E_q[(ρ − 1)(R − r̄)] = Cov_q(R, log ρ) + E_q[(ρ − 1 − log ρ)(R − r̄)]
                                           tangent            remainder

and since ρ − 1 − log ρ ≥ 0 with E_q[ρ − 1 − log ρ] = KL_seq(q‖p):  |remainder| ≤ max|R − r̄|·KL_seq.

Two halves:

* `tangent_remainder`: batch estimators of these quantities from the log-probs the trainer already has
  (logged every step; cheap, detached, fp64).
* Exact enumeration for small autoregressive models (vocabulary V, fixed length T, V**T sequences): sequences,
  per-prefix categorical tables, `exact_tangent_remainder` and the classical horizon-dependent trust-region
  bounds `trust_region_bounds` (Kakade & Langford 2002; Schulman et al. 2015, TRPO Thm. 1; Achiam et al. 2017,
  CPO Cor. 1), written for a finite horizon T with the reward at the end (see their docstrings).

Tables: `tables[t]` has shape [V**t, V] and holds the next-token logits after prefix c_t = (y_0..y_{t-1});
the row of a prefix is its big-endian base-V number Σ_s y_s V**(t-1-s), so the children of row c are rows
c·V + a of table t+1 and `all_sequences` lists sequences in the same (lexicographic) order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from covrl.math import KL_ESTIMATORS, LOG_RATIO_CLAMP

MAX_ENUMERATED_SEQUENCES = 2_000_000  # V**T above this is not a "small" model any more


# ----------------------------------------------------------------------------------------------------------
# Batch estimators
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TangentRemainder:
    """Per-sequence pieces of the gain split and their batch means in `metrics`.

    seq_log_ratio   [B] log ρ_b = Σ_t mask·lr_t (token lr clamped to ±20, the sum clamped to ±20 too)
    centred_rewards [B] R_b − r̄_b
    seq_kl          [B] Σ_t mask·k3(ρ_t), k3(r) = r − 1 − log r
    remainder_terms [B] (ρ_b − 1 − log ρ_b)(R_b − r̄_b)
    metrics         tangent, remainder, gain, kl_seq, kl_seq_ratio, r_max, bound, bound_ratio,
                    remainder_over_bound, reward_mean, log_ratio_abs_max, seq_log_ratio_abs_max, clamped_fraction
    """

    seq_log_ratio: Tensor
    centred_rewards: Tensor
    seq_kl: Tensor
    remainder_terms: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@torch.no_grad()
def tangent_remainder(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    rewards: Tensor,
    mask: Tensor,
    r_max: float | None = None,
    group_ids: Tensor | None = None,
    *,
    weights: Tensor | None = None,
) -> TangentRemainder:
    """Batch estimators of the tangent/remainder split of docs/theory.md §5 (detached, computed in fp64).

    With lr_t = log p(y_t|c_t) − log q(y_t|c_t) on the drawn (sampler) tokens, log ρ_b = Σ_t lr_t and
    mean_b the batch mean (weighted by `weights` when given, normalised to sum 1):

        r̄_b        = mean reward of row b's group (`group_ids`), or of the whole batch when group_ids is None
        tangent    = mean_b[(R_b − r̄_b)·log ρ_b]                       ≈ Cov_q(R, log ρ)
        remainder  = mean_b[(ρ_b − 1 − log ρ_b)(R_b − r̄_b)]            ≈ E_q[(ρ − 1 − log ρ)(R − r̄)]
        gain       = tangent + remainder = mean_b[(ρ_b − 1)(R_b − r̄_b)] ≈ J(p) − J(q)   (IS estimate)
        kl_seq     = mean_b Σ_t k3(ρ_t),  k3(r) = r − 1 − log r          ≈ KL_seq(q‖p)
        kl_seq_ratio = mean_b k3(ρ_b)  (same expectation, uses the sequence ratio)
        r_max      = `r_max` if given, else max_b |R_b − r̄_b| over rows with positive weight
        bound      = r_max·kl_seq;  bound_ratio = r_max·kl_seq_ratio

    `bound_ratio` bounds |remainder| on every batch (the inequality holds row by row); `bound` is the
    estimator of R_max·KL_seq from docs/theory.md (per-token k3, lower variance), which bounds the exact
    remainder in expectation. With group ids, r̄ is the per-prompt (group) mean, i.e. the identity is applied
    per prompt and averaged over prompts. With `weights = q(y)` on the full enumeration of a small model all
    these equal their exact values. The 1/B means make `tangent` the biased (1/B) sample covariance.

    trainer_logprobs, sampler_logprobs: [B, T] log-probs of the drawn tokens; values where mask == 0 are
    ignored (may be -inf or nan). rewards: [B] outcome rewards, or [B, T] per-token rewards summed over the
    mask into a return. mask: [B, T] float, 1 on response tokens. group_ids: [B] integer. weights: [B] ≥ 0.
    """
    _check_batch(trainer_logprobs, sampler_logprobs, rewards, mask, group_ids, weights, r_max)
    f64 = torch.float64
    valid = mask.to(f64) > 0
    maskf = mask.to(f64)
    log_ratio = trainer_logprobs.detach().to(f64) - sampler_logprobs.detach().to(f64)
    raw_abs = torch.where(valid, log_ratio.abs(), torch.zeros_like(log_ratio))
    log_ratio = torch.where(valid, log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(log_ratio))
    token_k3 = KL_ESTIMATORS["k3"](log_ratio) * maskf
    seq_log_ratio_raw = (log_ratio * maskf).sum(dim=1)
    seq_log_ratio = seq_log_ratio_raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_kl = token_k3.sum(dim=1)

    returns = rewards.detach().to(f64)
    if returns.dim() == 2:  # per-token rewards: the outcome of a row is its masked sum
        returns = (returns * maskf).sum(dim=1)
    batch = returns.shape[0]
    w = torch.full((batch,), 1.0 / batch, dtype=f64) if weights is None else weights.detach().to(f64)
    w = w / w.sum()

    if group_ids is None:
        baseline = (w * returns).sum().expand(batch)
    else:
        _, inverse = torch.unique(group_ids, return_inverse=True)
        n_groups = int(inverse.max().item()) + 1
        group_w = torch.zeros(n_groups, dtype=f64).index_add_(0, inverse, w)
        group_wr = torch.zeros(n_groups, dtype=f64).index_add_(0, inverse, w * returns)
        # a group whose weights are all zero never contributes; avoid 0/0 there
        baseline = (group_wr / group_w.clamp_min(torch.finfo(f64).tiny))[inverse]
    centred = returns - baseline

    seq_k3 = KL_ESTIMATORS["k3"](seq_log_ratio)  # ρ − 1 − log ρ ≥ 0
    remainder_terms = seq_k3 * centred
    tangent = (w * centred * seq_log_ratio).sum()
    remainder = (w * remainder_terms).sum()
    kl_seq = (w * seq_kl).sum()
    kl_seq_ratio = (w * seq_k3).sum()
    if r_max is None:
        positive = w > 0
        r_max_value = float(centred[positive].abs().max().item()) if positive.any() else 0.0
    else:
        r_max_value = float(r_max)
    bound = r_max_value * float(kl_seq)
    n_tokens = float(maskf.sum().item())
    clamped = float(((raw_abs > LOG_RATIO_CLAMP) & valid).sum().item()) + float(
        (seq_log_ratio_raw.abs() > LOG_RATIO_CLAMP).sum().item()
    )
    metrics = {
        "tangent": float(tangent),
        "remainder": float(remainder),
        "gain": float(tangent + remainder),
        "kl_seq": float(kl_seq),
        "kl_seq_ratio": float(kl_seq_ratio),
        "r_max": r_max_value,
        "bound": bound,
        "bound_ratio": r_max_value * float(kl_seq_ratio),
        "remainder_over_bound": abs(float(remainder)) / bound if bound > 0 else 0.0,
        "reward_mean": float((w * returns).sum()),
        "log_ratio_abs_max": float(raw_abs.max().item()) if raw_abs.numel() else 0.0,
        "seq_log_ratio_abs_max": float(seq_log_ratio_raw.abs().max().item()) if batch else 0.0,
        "clamped_fraction": clamped / max(n_tokens + batch, 1.0),
    }
    return TangentRemainder(
        seq_log_ratio=seq_log_ratio.float(),
        centred_rewards=centred.float(),
        seq_kl=seq_kl.float(),
        remainder_terms=remainder_terms.float(),
        metrics=metrics,
    )


def _check_batch(trainer_logprobs, sampler_logprobs, rewards, mask, group_ids, weights, r_max) -> None:
    for name, x in (("trainer_logprobs", trainer_logprobs), ("sampler_logprobs", sampler_logprobs), ("mask", mask)):
        if not isinstance(x, Tensor) or x.dim() != 2:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a [B, T] tensor, got {shape}")
    shape = tuple(mask.shape)
    for name, x in (("trainer_logprobs", trainer_logprobs), ("sampler_logprobs", sampler_logprobs)):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but mask has shape {shape}; they must match")
    if shape[0] == 0:
        raise ValueError("the batch is empty (B = 0); tangent_remainder needs at least one row")
    if not isinstance(rewards, Tensor) or tuple(rewards.shape) not in ((shape[0],), shape):
        got = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must have shape [B]={shape[0]} or [B, T]={shape}, got {got}")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards))[0].tolist()
        raise ValueError(f"rewards must be finite; row {bad[0]} is {rewards[tuple(bad)].item()}")
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("mask must contain only 0 and 1")
    if group_ids is not None:
        if not isinstance(group_ids, Tensor) or tuple(group_ids.shape) != (shape[0],):
            got = tuple(group_ids.shape) if isinstance(group_ids, Tensor) else type(group_ids).__name__
            raise ValueError(f"group_ids must be a [B]={shape[0]} integer tensor, got {got}")
        if group_ids.is_floating_point():
            raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if weights is not None:
        if not isinstance(weights, Tensor) or tuple(weights.shape) != (shape[0],):
            got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
            raise ValueError(f"weights must be a [B]={shape[0]} tensor, got {got}")
        if not torch.isfinite(weights).all() or (weights < 0).any() or not weights.sum() > 0:
            raise ValueError("weights must be finite, non-negative and have a positive sum")
    if r_max is not None and not (float(r_max) >= 0 and float(r_max) < float("inf")):
        raise ValueError(f"r_max must be a finite number ≥ 0 or None, got {r_max}")
    valid = mask > 0
    for name, x in (("trainer_logprobs", trainer_logprobs), ("sampler_logprobs", sampler_logprobs)):
        bad = valid & ~torch.isfinite(x)
        if bad.any():
            row, col = torch.nonzero(bad)[0].tolist()
            raise ValueError(f"{name} is not finite at row {row}, token {col} inside the mask")


# ----------------------------------------------------------------------------------------------------------
# Exact enumeration on small autoregressive models
# ----------------------------------------------------------------------------------------------------------


def _check_small(vocab_size: int, horizon: int) -> None:
    if int(vocab_size) < 2:
        raise ValueError(f"vocab_size must be ≥ 2, got {vocab_size}")
    if int(horizon) < 1:
        raise ValueError(f"horizon must be ≥ 1, got {horizon}")
    if vocab_size**horizon > MAX_ENUMERATED_SEQUENCES:
        raise ValueError(
            f"vocab_size**horizon = {vocab_size}**{horizon} = {vocab_size**horizon} sequences is too many to "
            f"enumerate (limit {MAX_ENUMERATED_SEQUENCES})"
        )


def all_sequences(vocab_size: int, horizon: int) -> Tensor:
    """Every sequence of length T over V tokens, [V**T, T] long, in lexicographic order (row n is n in base V)."""
    _check_small(vocab_size, horizon)
    n = torch.arange(vocab_size**horizon)
    powers = vocab_size ** torch.arange(horizon - 1, -1, -1)
    return (n[:, None] // powers) % vocab_size


def prefix_rows(sequences: Tensor, vocab_size: int) -> Tensor:
    """[N, T] long: the row of prefix c_t = (y_0..y_{t-1}) in table t, i.e. Σ_{s<t} y_s V**(t-1-s)."""
    rows = torch.zeros_like(sequences)
    for t in range(1, sequences.shape[1]):
        rows[:, t] = rows[:, t - 1] * vocab_size + sequences[:, t - 1]
    return rows


def check_tables(tables: Sequence[Tensor], name: str = "tables") -> tuple[int, int]:
    """Validate per-prefix logit tables (tables[t] of shape [V**t, V]); returns (V, T)."""
    if len(tables) == 0:
        raise ValueError(f"{name} is empty; need one [V**t, V] logit table per position t")
    vocab = int(tables[0].shape[-1])
    for t, table in enumerate(tables):
        if table.dim() != 2 or tuple(table.shape) != (vocab**t, vocab):
            raise ValueError(f"{name}[{t}] must have shape [V**t, V] = {(vocab**t, vocab)}, got {tuple(table.shape)}")
        if not torch.isfinite(table).all():
            raise ValueError(f"{name}[{t}] contains non-finite logits")
    _check_small(vocab, len(tables))
    return vocab, len(tables)


def random_tables(
    vocab_size: int, horizon: int, *, scale: float = 1.0, generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> list[Tensor]:
    """Per-prefix logits with i.i.d. N(0, scale²) entries: tables[t] has shape [V**t, V]."""
    _check_small(vocab_size, horizon)
    return [scale * torch.randn(vocab_size**t, vocab_size, generator=generator, dtype=dtype) for t in range(horizon)]


def perturb_tables(
    tables: Sequence[Tensor], epsilon: float, *, generator: torch.Generator | None = None,
    direction: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """tables + ε·direction (direction i.i.d. N(0, 1) when not given): a trainer near the sampler."""
    check_tables(tables)
    if direction is None:
        direction = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in tables]
    return [t + epsilon * d for t, d in zip(tables, direction)]


def tables_from_next_token_fn(
    next_token_logits: Callable[[Tensor], Tensor], vocab_size: int, horizon: int
) -> list[Tensor]:
    """Tables of a (tiny parametric) model: tables[t] = next_token_logits(prefixes) for all V**t prefixes.

    `next_token_logits(prefixes [M, t] long) -> [M, V]` is called once per position t (t = 0 gets an
    [1, 0] tensor). Differentiable if the model is.
    """
    _check_small(vocab_size, horizon)
    tables = []
    for t in range(horizon):
        prefixes = all_sequences(vocab_size, t) if t > 0 else torch.zeros(1, 0, dtype=torch.long)
        logits = next_token_logits(prefixes)
        if tuple(logits.shape) != (vocab_size**t, vocab_size):
            raise ValueError(
                f"next_token_logits returned shape {tuple(logits.shape)} for {vocab_size**t} prefixes of length "
                f"{t}; expected {(vocab_size**t, vocab_size)}"
            )
        tables.append(logits)
    return tables


def token_logprobs_from_tables(tables: Sequence[Tensor], sequences: Tensor | None = None) -> Tensor:
    """log π(y_t | c_t) for each sequence and position, [N, T] (all V**T sequences when `sequences` is None)."""
    vocab, horizon = check_tables(tables)
    if sequences is None:
        sequences = all_sequences(vocab, horizon)
    if sequences.dim() != 2 or sequences.shape[1] != horizon:
        raise ValueError(f"sequences must have shape [N, T={horizon}], got {tuple(sequences.shape)}")
    if sequences.min() < 0 or sequences.max() >= vocab:
        raise ValueError(f"sequences must hold token ids in [0, {vocab}), got range "
                         f"[{int(sequences.min())}, {int(sequences.max())}]")
    rows = prefix_rows(sequences, vocab)
    cols = [torch.log_softmax(table, dim=-1)[rows[:, t], sequences[:, t]] for t, table in enumerate(tables)]
    return torch.stack(cols, dim=1)


@dataclass
class ExactTangentRemainder:
    """Exact quantities of docs/theory.md §5 on an enumerated model (0-d tensors, differentiable in the trainer).

    metrics: j_trainer, j_sampler, gain (= J(p) − J(q) from Σ p R − Σ q R), tangent, remainder, kl_seq, r_max,
    bound (= r_max·kl_seq), identity_error (= gain − tangent − remainder), remainder_over_bound.
    """

    j_trainer: Tensor
    j_sampler: Tensor
    tangent: Tensor
    remainder: Tensor
    kl_seq: Tensor
    r_max: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def exact_tangent_remainder(
    trainer_token_logprobs: Tensor, sampler_token_logprobs: Tensor, rewards: Tensor
) -> ExactTangentRemainder:
    """Exact gain split by summing over every sequence (rows = the complete enumeration, e.g. `all_sequences`).

    With log p(y) = Σ_t trainer_token_logprobs, log q(y) likewise, ρ = p/q, r̄ = Σ_y q(y) R(y):
        J(p) = Σ_y p(y) R(y),  J(q) = Σ_y q(y) R(y)
        tangent   = Σ_y q(y)(R(y) − r̄)(log p(y) − log q(y))          = Cov_q(R, log ρ)
        remainder = Σ_y q(y)(ρ − 1 − log ρ)(R(y) − r̄)
        KL_seq    = Σ_y q(y)(log q(y) − log p(y)),   R_max = max_y |R(y) − r̄|
    Raises if the sampler probabilities do not sum to 1 (the rows are not a complete enumeration).
    """
    if trainer_token_logprobs.shape != sampler_token_logprobs.shape or trainer_token_logprobs.dim() != 2:
        raise ValueError(
            f"trainer_token_logprobs {tuple(trainer_token_logprobs.shape)} and sampler_token_logprobs "
            f"{tuple(sampler_token_logprobs.shape)} must be [N, T] of the same shape"
        )
    if tuple(rewards.shape) != (trainer_token_logprobs.shape[0],):
        raise ValueError(f"rewards must have shape [N]={trainer_token_logprobs.shape[0]}, got {tuple(rewards.shape)}")
    log_p = trainer_token_logprobs.to(torch.float64).sum(dim=1)
    log_q = sampler_token_logprobs.to(torch.float64).sum(dim=1)
    q = log_q.exp()
    total_q = float(q.detach().sum())
    if abs(total_q - 1.0) > 1e-6:
        raise ValueError(f"sampler probabilities sum to {total_q:.8f}, not 1: the rows must enumerate every sequence")
    p = log_p.exp()
    reward = rewards.to(torch.float64)
    j_trainer = (p * reward).sum()
    j_sampler = (q * reward).sum()
    centred = reward - j_sampler
    log_ratio = log_p - log_q
    tangent = (q * centred * log_ratio).sum()
    remainder = (q * (torch.expm1(log_ratio) - log_ratio) * centred).sum()
    kl_seq = (q * (log_q - log_p)).sum()
    r_max = centred.abs().max()
    gain = j_trainer - j_sampler
    bound = r_max * kl_seq
    values = {"j_trainer": j_trainer, "j_sampler": j_sampler, "gain": gain, "tangent": tangent,
              "remainder": remainder, "kl_seq": kl_seq, "r_max": r_max, "bound": bound,
              "identity_error": gain - tangent - remainder}
    metrics = {k: float(v.detach()) for k, v in values.items()}
    metrics["remainder_over_bound"] = abs(metrics["remainder"]) / metrics["bound"] if metrics["bound"] > 0 else 0.0
    return ExactTangentRemainder(j_trainer, j_sampler, tangent, remainder, kl_seq, r_max, metrics)


@dataclass
class TrustRegionBounds:
    """Classical horizon-dependent bounds on |J(p) − J(q) − L_q(p)| for an enumerated model (see
    `trust_region_bounds`). metrics: surrogate, surrogate_error, adv_max, expected_adv_max, tv_max, kl_max,
    kl_seq_from_tables, bound_trpo_tv, bound_trpo_kl, bound_cpo_tv."""

    metrics: dict[str, float] = field(default_factory=dict)


def trust_region_bounds(trainer_tables: Sequence[Tensor], sampler_tables: Sequence[Tensor], rewards: Tensor) -> TrustRegionBounds:
    """Classical trust-region bounds, finite horizon T, reward R(y) at the end, state = prefix c_t.

    Sampler values V_q(c_T) = R, V_q(c_t) = Σ_a q(a|c_t) V_q(c_t a); advantages A_q(c, a) = V_q(c a) − V_q(c).
    Surrogate (Kakade & Langford 2002):  L_q(p) = Σ_t E_{c_t∼q} E_{a∼p(·|c_t)} A_q(c_t, a).
    Performance difference: J(p) − J(q) = Σ_t E_{c_t∼p} E_{a∼p} A_q(c_t, a), hence with
    ε = max_{c,a}|A_q(c,a)|, α = max_c TV(p(·|c), q(·|c)), KL_max = max_c KL(q(·|c)‖p(·|c)):

        |J(p) − J(q) − L_q(p)| ≤ Σ_{t<T} 2·TV(d_t^p, d_t^q)·2αε ≤ Σ_t 2(tα)(2αε) = 2·ε·T(T−1)·α²  (bound_trpo_tv)
                                ≤ ε·T(T−1)·KL_max         (Pinsker α² ≤ KL_max/2;               bound_trpo_kl)

    the finite-horizon form of TRPO Thm. 1 (Schulman et al. 2015: 4εγα²/(1−γ)², with 1/(1−γ) ↔ T).
    A CPO-style form (Achiam et al. 2017, Cor. 1) uses expected instead of maximal TV:
    with ε' = max_c |E_{a∼p} A_q(c, a)| and τ_s = E_{c_s∼q} TV(p(·|c_s), q(·|c_s)),

        |J(p) − J(q) − L_q(p)| ≤ 2ε' Σ_{t<T} Σ_{s<t} τ_s                                       (bound_cpo_tv)

    All three grow like T² (at a fixed per-step divergence); the tangent's remainder bound R_max·KL_seq has no
    horizon factor. `surrogate_error` = J(p) − J(q) − L_q(p) exactly, so the bounds can be checked.
    """
    vocab, horizon = check_tables(sampler_tables, "sampler_tables")
    vocab_p, horizon_p = check_tables(trainer_tables, "trainer_tables")
    if (vocab_p, horizon_p) != (vocab, horizon):
        raise ValueError(f"trainer_tables are V={vocab_p}, T={horizon_p} but sampler_tables are V={vocab}, T={horizon}")
    if tuple(rewards.shape) != (vocab**horizon,):
        raise ValueError(f"rewards must have shape [V**T] = [{vocab**horizon}], got {tuple(rewards.shape)}")
    f64 = torch.float64
    q_cond = [torch.softmax(t.to(f64), dim=-1) for t in sampler_tables]
    p_cond = [torch.softmax(t.to(f64), dim=-1) for t in trainer_tables]
    # backward: values of every prefix under the sampler
    values = [None] * (horizon + 1)
    values[horizon] = rewards.to(f64)
    for t in range(horizon - 1, -1, -1):
        values[t] = (q_cond[t] * values[t + 1].view(-1, vocab)).sum(dim=1)
    # forward: prefix marginals under both policies
    d_q, d_p = [torch.ones(1, dtype=f64)], [torch.ones(1, dtype=f64)]
    for t in range(horizon - 1):
        d_q.append((d_q[t][:, None] * q_cond[t]).reshape(-1))
        d_p.append((d_p[t][:, None] * p_cond[t]).reshape(-1))
    surrogate = torch.zeros((), dtype=f64)
    exact_gain = torch.zeros((), dtype=f64)
    adv_max = exp_adv_max = tv_max = kl_max = 0.0
    kl_seq = 0.0
    tau = []
    for t in range(horizon):
        adv = values[t + 1].view(-1, vocab) - values[t][:, None]
        expected_adv = (p_cond[t] * adv).sum(dim=1)  # E_{a∼p} A_q(c, a), per prefix
        surrogate = surrogate + (d_q[t] * expected_adv).sum()
        exact_gain = exact_gain + (d_p[t] * expected_adv).sum()  # performance-difference lemma
        tv = 0.5 * (p_cond[t] - q_cond[t]).abs().sum(dim=1)
        kl = (q_cond[t] * (q_cond[t].log() - p_cond[t].log())).sum(dim=1)
        adv_max = max(adv_max, float(adv.abs().max()))
        exp_adv_max = max(exp_adv_max, float(expected_adv.abs().max()))
        tv_max = max(tv_max, float(tv.max()))
        kl_max = max(kl_max, float(kl.max()))
        kl_seq += float((d_q[t] * kl).sum())
        tau.append(float((d_q[t] * tv).sum()))
    gain = float((d_p[-1][:, None] * p_cond[-1]).reshape(-1) @ values[horizon]) - float(values[0][0])
    cpo = 2.0 * exp_adv_max * sum(sum(tau[:t]) for t in range(horizon))
    metrics = {
        "surrogate": float(surrogate),
        "surrogate_error": gain - float(surrogate),
        "gain_pdl": float(exact_gain),
        "gain": gain,
        "adv_max": adv_max,
        "expected_adv_max": exp_adv_max,
        "tv_max": tv_max,
        "kl_max": kl_max,
        "kl_seq_from_tables": kl_seq,
        "bound_trpo_tv": 2.0 * adv_max * horizon * (horizon - 1) * tv_max**2,
        "bound_trpo_kl": adv_max * horizon * (horizon - 1) * kl_max,
        "bound_cpo_tv": cpo,
    }
    return TrustRegionBounds(metrics=metrics)


def exact_from_tables(
    trainer_tables: Sequence[Tensor], sampler_tables: Sequence[Tensor], rewards: Tensor
) -> ExactTangentRemainder:
    """`exact_tangent_remainder` on the full enumeration of two table models (rewards in `all_sequences` order)."""
    vocab, horizon = check_tables(sampler_tables, "sampler_tables")
    if check_tables(trainer_tables, "trainer_tables") != (vocab, horizon):
        raise ValueError("trainer_tables and sampler_tables must have the same V and T")
    sequences = all_sequences(vocab, horizon)
    return exact_tangent_remainder(
        token_logprobs_from_tables(trainer_tables, sequences), token_logprobs_from_tables(sampler_tables, sequences), rewards
    )
