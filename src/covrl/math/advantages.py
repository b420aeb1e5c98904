"""Advantage estimators (docs/theory.md §7), one registry with one signature.

`compute_advantages(name, *, rewards, mask, group_ids, **inputs)` prepares an `AdvantageBatch` (token rewards,
reward-to-go, per-sequence scores, compact group index) and calls `ADVANTAGE_ESTIMATORS[name](batch, **options)`,
which returns advantages [B, T]. Adding an estimator is one function plus one registry line (`ADVANTAGE_SPECS`).
Each registry entry (`AdvantageSpec`) reads once, from the signature, which of the caller-supplied
`ADVANTAGE_INPUTS` the estimator takes and its user options (names, types, defaults); `AdvantageSpec.compute`
runs it without any lookup or signature inspection, so a caller can bind an estimator once.

Conventions
- rewards [B] (outcome) are placed on the last valid token of each row; rewards [B, T] are per token.
- score_b = Σ_t r_bt m_bt for per-token rewards, = rewards_b for outcome rewards (so an all-masked row still
  counts in its group's statistics); reward-to-go G_t = Σ_{k≥t} r_k m_k. `returns` = G_t·m_t for every estimator.
- group_ids [B] integer (any values); rows with equal ids form a group. Everything is vectorised with index_add
  over a compact group index; no Python loop over groups or positions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from pydantic import Field

from covrl.math._registry import Registered
from covrl.math._util import check_2d, choose, item, masked_mean
from covrl.math.logprobs import logit_grad_proxy

GRPO_EPS = 1e-6
OTB_EPS = 1e-8
WHITEN_EPS = 1e-8   # GDPO's batch normalisation: (A − μ)/sqrt(var + 1e-8), verl's masked_whiten

NonNegative = Annotated[float, Field(ge=0)]


@dataclass
class AdvantageOutput:
    """advantages [B, T] and returns [B, T] (reward-to-go, 0 on padding), both fp32 and detached; metrics."""

    advantages: torch.Tensor
    returns: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class AdvantageBatch:
    """What every estimator receives (built by `compute_advantages`).

    token_rewards [B, T] fp32 (outcome rewards already placed on the last valid token), mask [B, T] fp32,
    returns [B, T] reward-to-go G_t·m_t, scores [B] per-sequence score, group_index [B] long in [0, num_groups),
    group_size [B] long (size of each row's group).
    """

    token_rewards: torch.Tensor
    mask: torch.Tensor
    returns: torch.Tensor
    scores: torch.Tensor
    group_index: torch.Tensor
    num_groups: int
    group_size: torch.Tensor

    def group_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over the rows of each group: [B, ...] -> [num_groups, ...]."""
        out = torch.zeros((self.num_groups, *x.shape[1:]), dtype=x.dtype, device=x.device)
        return out.index_add_(0, self.group_index, x)

    def group_mean_std(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row group mean and unbiased std of `scores` ([B] each); std = 0 for a group of one."""
        n = self.group_size.to(self.scores.dtype)
        mean = (self.group_sum(self.scores) / self.group_sum(torch.ones_like(self.scores)))[self.group_index]
        dev2 = self.group_sum((self.scores - mean).square())[self.group_index]
        std = torch.where(n > 1, (dev2 / (n - 1).clamp_min(1)).sqrt(), torch.zeros_like(dev2))
        return mean, std


# ---------------------------------------------------------------------------------------------- estimators

def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_seq[:, None] * mask


def constant_groups(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[num_groups] bool: every row of the group has the same value (exact max == min, no float mean)."""
    high = torch.full((num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    low = torch.full_like(high, torch.inf)
    high = high.scatter_reduce_(0, group_index, values, "amax")
    low = low.scatter_reduce_(0, group_index, values, "amin")
    return high == low


def constant_score_groups(batch: AdvantageBatch) -> torch.Tensor:
    """[B] bool: the row's group has more than one row and every row's score equal (no contrast in it)."""
    same = constant_groups(batch.scores, batch.group_index, batch.num_groups)
    return same[batch.group_index] & (batch.group_size > 1)


def _zero_constant(batch: AdvantageBatch, adv: torch.Tensor, on: bool) -> torch.Tensor:
    """`zero_constant_groups` of every estimator: A = 0 exactly in a group whose scores are all equal (float
    means of equal non-binary rewards, OTB's tail and low-energy terms leave residues there otherwise)."""
    if not on:
        return adv
    return torch.where(constant_score_groups(batch)[:, None], torch.zeros_like(adv), adv)


def grpo(batch: AdvantageBatch, *, eps: float = GRPO_EPS, zero_constant_groups: bool = False) -> torch.Tensor:
    """A = (R − mean_g) / (std_g + eps), std unbiased; a group of one uses mean 0, std 1 (A = R), as verl does."""
    mean, std = batch.group_mean_std()
    single = batch.group_size == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return _zero_constant(batch, _broadcast((batch.scores - mean) / (std + eps), batch.mask), zero_constant_groups)


def dr_grpo(batch: AdvantageBatch, *, zero_constant_groups: bool = False) -> torch.Tensor:
    """A = R − mean_g (no std); a group of one uses mean 0 (A = R)."""
    mean, _ = batch.group_mean_std()
    mean = torch.where(batch.group_size == 1, torch.zeros_like(mean), mean)
    return _zero_constant(batch, _broadcast(batch.scores - mean, batch.mask), zero_constant_groups)


def rloo(batch: AdvantageBatch, *, zero_constant_groups: bool = False) -> torch.Tensor:
    """A = R − mean of the other N−1 rows of the group = N/(N−1)·(R − mean_g); 0 for a group of one."""
    total = batch.group_sum(batch.scores)[batch.group_index]
    n = batch.group_size.to(batch.scores.dtype)
    loo = (total - batch.scores) / (n - 1).clamp_min(1)
    adv = torch.where(batch.group_size > 1, batch.scores - loo, torch.zeros_like(loo))
    return _zero_constant(batch, _broadcast(adv, batch.mask), zero_constant_groups)


def maxrl(batch: AdvantageBatch, *, eps: NonNegative = GRPO_EPS, zero_constant_groups: bool = False) -> torch.Tensor:
    """MaxRL (arXiv 2602.02710): A = (R − mean_g)/(mean_g + eps), the group-centred reward divided by the group
    mean instead of the std (SkyRL's `compute_maxrl_advantage`, eps = 1e-6). A group whose mean is ≤ 0 gets A = 0
    (prime-rl's rule: no success, no signal; SkyRL divides by eps there, ±R/eps for a mixed-sign group of mean
    0, and flips every sign for a negative mean). A group of one gets A = R (SkyRL, as grpo)."""
    if eps < 0:
        raise ValueError(f"maxrl option eps must be >= 0; got {eps}")
    mean, _ = batch.group_mean_std()
    positive = mean > 0
    adv = torch.where(positive, (batch.scores - mean) / torch.where(positive, mean + eps, torch.ones_like(mean)),
                      torch.zeros_like(mean))
    adv = torch.where(batch.group_size == 1, batch.scores, adv)
    return _zero_constant(batch, _broadcast(adv, batch.mask), zero_constant_groups)


def _group_normalised(batch: AdvantageBatch, values: torch.Tensor, eps: float) -> torch.Tensor:
    """GRPO of every column of `values` [B, K] within the groups: (v − mean_g)/(std_g + eps), std unbiased; a
    group of one uses mean 0, std 1 (as `grpo`)."""
    count = batch.group_size.to(values.dtype)[:, None]
    mean = (batch.group_sum(values) / batch.group_sum(torch.ones_like(values)))[batch.group_index]
    dev2 = batch.group_sum((values - mean).square())[batch.group_index]
    std = (dev2 / (count - 1).clamp_min(1)).sqrt()
    single = (batch.group_size == 1)[:, None]
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return (values - mean) / (std + eps)


def _whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x − μ)/sqrt(var + 1e-8) with μ and the unbiased variance over the entries where mask > 0 (a variance of
    0 where fewer than two entries count): verl's masked_whiten."""
    n = mask.sum()
    mu = (x * mask).sum() / n.clamp_min(1)
    var = ((x - mu).square() * mask).sum() / (n - 1).clamp_min(1)
    return (x - mu) * torch.rsqrt(torch.where(n > 1, var, torch.zeros_like(var)) + WHITEN_EPS)


def gdpo(batch: AdvantageBatch, *, reward_terms: torch.Tensor | None = None,
         reward_weights: torch.Tensor | None = None, eps: NonNegative = GRPO_EPS,
         batch_norm: Literal["token", "sequence", "none"] = "token",
         zero_constant_groups: bool = False) -> torch.Tensor:
    """GDPO (arXiv 2601.05242; verl's `compute_gdpo_outcome_advantage`): every reward term normalised within the
    group on its own, then combined, then normalised over the batch.

    reward_terms [B, K]: each rollout's unweighted value of each term; reward_weights [K] (default 1 each).
    A_b = Σ_k w_k·(r_bk − mean_g r_k)/(std_g r_k + eps) (std unbiased; a group of one: mean 0, std 1), then
    `batch_norm`: "token" whitens A over the valid tokens (verl: mean and unbiased variance over tokens,
    (A − μ)/sqrt(var + 1e-8), so a long response weighs more), "sequence" over the rows (TRL's
    `normalize_then_sum`, NeMo-RL), "none" leaves it. With one term (K = 1, or `reward_terms` None) it is `grpo`
    of `rewards` exactly, as TRL-GDPO applies GDPO only to more than one reward.
    `zero_constant_groups`: A = 0 in a group where every term is constant (the batch normalisation would shift
    such a group to −μ/σ otherwise)."""
    if eps < 0:
        raise ValueError(f"gdpo option eps must be >= 0; got {eps}")
    if reward_terms is None or reward_terms.shape[-1] == 1:
        return grpo(batch, eps=eps, zero_constant_groups=zero_constant_groups)
    rows = batch.scores.shape[0]
    if reward_terms.dim() != 2 or reward_terms.shape[0] != rows:
        raise ValueError(f"gdpo reward_terms must be [B, K] with B = {rows}; got {list(reward_terms.shape)}")
    terms = reward_terms.detach().float().to(batch.scores.device)
    k = terms.shape[1]
    weights = (torch.ones(k, device=terms.device) if reward_weights is None
               else torch.as_tensor(reward_weights, dtype=torch.float32, device=terms.device).detach())
    if tuple(weights.shape) != (k,):
        raise ValueError(f"gdpo reward_weights must hold one weight per term ({k}); got {list(weights.shape)}")
    if not torch.isfinite(terms).all():
        raise ValueError("gdpo reward_terms hold a non-finite value")
    combined = (_group_normalised(batch, terms, eps) * weights).sum(1)
    if batch_norm == "token":
        adv = _whiten(_broadcast(combined, batch.mask), batch.mask)
    elif batch_norm == "sequence":
        adv = _broadcast(_whiten(combined, torch.ones_like(combined)), batch.mask)
    elif batch_norm == "none":
        adv = _broadcast(combined, batch.mask)
    else:
        raise ValueError(f"gdpo batch_norm must be 'token', 'sequence' or 'none'; got {batch_norm!r}")
    adv = adv * batch.mask
    if not zero_constant_groups:
        return adv
    constant = torch.stack([constant_groups(terms[:, j].contiguous(), batch.group_index, batch.num_groups)
                            for j in range(k)]).all(0)[batch.group_index] & (batch.group_size > 1)
    return torch.where(constant[:, None], torch.zeros_like(adv), adv)


def reinforce(batch: AdvantageBatch, *, zero_constant_groups: bool = False) -> torch.Tensor:
    """A_t = G_t (reward-to-go, no baseline); equals R on every valid token for outcome rewards."""
    return _zero_constant(batch, batch.returns.clone(), zero_constant_groups)


def _otb_core(returns: torch.Tensor, mask: torch.Tensor, w: torch.Tensor, batch: AdvantageBatch,
              handle_zero_tail: bool, zero_constant_groups: bool = False) -> torch.Tensor:
    """OTB on an aligned [B, T] layout: W_t = Σ_{j≤t} w_j m_j, B_t = Σ_i G W m / (Σ_i W m + 1e-8), A = (G − B)m."""
    energy = torch.cumsum(w * mask, dim=1)
    num = batch.group_sum(returns * energy * mask)[batch.group_index]
    den = batch.group_sum(energy * mask)[batch.group_index]
    baseline = num / (den + OTB_EPS)
    no_baseline = (batch.group_size == 1)[:, None].expand_as(baseline)
    if handle_zero_tail:
        # positions where only one row of the group is still valid: the uniquely longest row's tail
        valid_count = batch.group_sum((mask > 0).to(torch.float32))[batch.group_index]
        no_baseline = no_baseline | (valid_count <= 1)
    baseline = torch.where(no_baseline, torch.zeros_like(baseline), baseline)
    return _zero_constant(batch, (returns - baseline) * mask, zero_constant_groups)


def _otb_proxy(logprobs, sum_pi_sq, is_weights, mask) -> torch.Tensor:
    for name, x in (("logprobs", logprobs), ("sum_pi_sq", sum_pi_sq), ("is_weights", is_weights)):
        if x is not None and tuple(x.shape) != tuple(mask.shape):
            raise ValueError(f"otb input {name} must have the shape of mask {list(mask.shape)}; "
                             f"got {list(x.shape)}")
    if logprobs is None or sum_pi_sq is None:
        raise ValueError("otb needs the trainer's `logprobs` [B, T] and `sum_pi_sq` [B, T] "
                         "(covrl.math.sum_pi_squared of the trainer's temperature-scaled logits)")
    w = logit_grad_proxy(logprobs.detach(), sum_pi_sq.detach())
    if is_weights is not None:
        w = w * is_weights.detach().float().square()
    return w


def otb(batch: AdvantageBatch, *, logprobs: torch.Tensor | None = None, sum_pi_sq: torch.Tensor | None = None,
        is_weights: torch.Tensor | None = None, handle_zero_tail: bool = True,
        zero_constant_groups: bool = False) -> torch.Tensor:
    """Optimal Token Baseline (docs/theory.md §7), per token and causal.

    w_t = 1 − 2π_t(y_t) + Σπ_t² (·ρ̄_t² with `is_weights`), W_t = Σ_{j≤t} w_j m_j, G_t reward-to-go,
    B_t = Σ_{i∈g} G_t W_t m_t / (Σ_{i∈g} W_t m_t + 1e-8) per group and position t, A_t = (G_t − B_t)·m_t.
    A group of one gets A = G. `handle_zero_tail`: where only one row of a group is valid (the uniquely
    longest row past the second-longest length) the baseline is 0 instead of ≈ G.
    `zero_constant_groups`: A = 0 in a group whose per-sequence scores are all equal. The formula leaves such a
    group A = G on the uniquely longest row's tail (handle_zero_tail) and G·1e-8/(Σ W + 1e-8) where the
    group's energy is ~0 (confident tokens, where 1 − 2π + Σπ² cancels to 0 in fp32: A = G there), so a step
    of all-correct groups is not an exact zero and `optim.skip_zero_gradient` cannot leave it out.
    """
    w = _otb_proxy(logprobs, sum_pi_sq, is_weights, batch.mask)
    return _otb_core(batch.returns, batch.mask, w, batch, handle_zero_tail, zero_constant_groups)


def otb_tir(batch: AdvantageBatch, *, logprobs: torch.Tensor | None = None,
            sum_pi_sq: torch.Tensor | None = None, is_weights: torch.Tensor | None = None,
            generated_mask: torch.Tensor | None = None, handle_zero_tail: bool = True,
            zero_constant_groups: bool = False) -> torch.Tensor:
    """OTB for multi-turn rollouts with tool output inside the response (tool-integrated reasoning).

    `generated_mask` [B, T]: 1 on model-generated tokens, 0 on tool/observation tokens (default: `mask`, i.e.
    tool tokens already masked out). Tokens with mask·generated_mask = 1 are re-indexed k = 0, 1, ... per row;
    the energy W and the baseline are computed on that compact index (the k-th generated token of each row is
    compared with the k-th generated token of the others), the reward-to-go G_t in the original layout (rewards
    after a token count, wherever they sit). Tool tokens get A = 0. `zero_constant_groups` as in `otb`.
    """
    mask = batch.mask
    if generated_mask is None:
        generated_mask = mask
    if tuple(generated_mask.shape) != tuple(mask.shape):
        raise ValueError(f"otb_tir generated_mask must have the shape of mask {list(mask.shape)}; "
                         f"got {list(generated_mask.shape)}")
    w = _otb_proxy(logprobs, sum_pi_sq, is_weights, mask)
    eff = (mask > 0) & (generated_mask > 0)
    rows, cols = mask.shape
    compact_len = int(eff.sum(1).max().item()) if rows else 0
    k = torch.cumsum(eff.long(), dim=1) - 1
    # non-generated tokens are scattered into a trash column at index compact_len
    target = torch.where(eff, k, torch.full_like(k, compact_len))

    def compact(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((rows, compact_len + 1), dtype=torch.float32, device=x.device)
        return out.scatter_(1, target, x.float())[:, :compact_len]

    mask_c = compact(eff.float())
    adv_c = _otb_core(compact(batch.returns), mask_c, compact(w), batch, handle_zero_tail, zero_constant_groups)
    adv_c = torch.cat([adv_c, torch.zeros((rows, 1), dtype=adv_c.dtype, device=adv_c.device)], dim=1)
    return adv_c.gather(1, target) * eff.float()


# Inputs a caller supplies to every estimator besides the AdvantageBatch (the trainer's detached log-probs, Σπ²
# and IS weights; each rollout's per-term rewards [B, K] and the terms' weights [K]); every other keyword
# parameter of an estimator is a user option. compute_advantages also uses the first three for the
# variance-proxy metrics, whether or not the estimator takes them.
ADVANTAGE_INPUTS = frozenset({"logprobs", "sum_pi_sq", "is_weights", "reward_terms", "reward_weights"})


@dataclass(frozen=True)
class AdvantageSpec(Registered):
    """A registered estimator: `fn(batch, **inputs, **options) -> advantages [B, T]` (see `Registered`)."""

    @classmethod
    def of(cls, name: str, fn: Callable[..., torch.Tensor]) -> AdvantageSpec:
        return cls.build(name, fn, ADVANTAGE_INPUTS, positional=1)

    def spans_batch(self, options: Mapping[str, Any]) -> bool:
        """Whether, with `options`, the advantages of a row depend on rows outside its group (GDPO's batch
        normalisation unless `batch_norm` is "none"): the caller must then run the estimator on the whole batch."""
        if "batch_norm" not in self.options:
            return False
        return options.get("batch_norm", self.options["batch_norm"].default) != "none"

    def compute(self, *, rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                logprobs: torch.Tensor | None = None, sum_pi_sq: torch.Tensor | None = None,
                is_weights: torch.Tensor | None = None, reward_terms: torch.Tensor | None = None,
                reward_weights: torch.Tensor | None = None, options: Mapping[str, Any] | None = None,
                with_metrics: bool = True) -> AdvantageOutput:
        """Advantages of this estimator with already-checked `options` (see `compute_advantages`); the inputs it
        does not take only feed the metrics. `with_metrics=False` skips the metrics (e.g. per micro-batch)."""
        supplied = {"logprobs": logprobs, "sum_pi_sq": sum_pi_sq, "is_weights": is_weights,
                    "reward_terms": reward_terms, "reward_weights": reward_weights}
        batch = make_advantage_batch(rewards, mask, group_ids)
        with torch.no_grad():
            adv = self.fn(batch, **{k: v for k, v in supplied.items() if k in self.inputs}, **(options or {}))
            adv = adv.float()
            metrics = (advantage_metrics(batch, adv, logprobs=logprobs, sum_pi_sq=sum_pi_sq, is_weights=is_weights)
                       if with_metrics else {})
        return AdvantageOutput(advantages=adv, returns=batch.returns, metrics=metrics)


ADVANTAGE_SPECS: dict[str, AdvantageSpec] = {spec.name: spec for spec in (
    AdvantageSpec.of("grpo", grpo),
    AdvantageSpec.of("dr_grpo", dr_grpo),
    AdvantageSpec.of("rloo", rloo),
    AdvantageSpec.of("reinforce", reinforce),
    AdvantageSpec.of("maxrl", maxrl),
    AdvantageSpec.of("gdpo", gdpo),
    AdvantageSpec.of("otb", otb),
    AdvantageSpec.of("otb_tir", otb_tir),
)}
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {n: spec.fn for n, spec in ADVANTAGE_SPECS.items()}


# ------------------------------------------------------------------------------------------------ plumbing

def _place_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards [B, T] and scores [B] from outcome ([B]) or per-token ([B, T]) rewards."""
    rows, cols = mask.shape
    if rewards.dim() == 1:
        if rewards.shape[0] != rows:
            raise ValueError(f"rewards [B] must have B = {rows} (mask {list(mask.shape)}); got {list(rewards.shape)}")
        valid = mask > 0
        positions = torch.arange(cols, device=mask.device).expand(rows, cols)
        last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=1)
        token = torch.zeros((rows, cols), dtype=torch.float32, device=mask.device)
        has = last >= 0
        token[has, last[has]] = rewards.float()[has]
        return token, rewards.float()
    if tuple(rewards.shape) != (rows, cols):
        raise ValueError(f"rewards must be [B] or [B, T] = {list(mask.shape)}; got {list(rewards.shape)}")
    token = rewards.float() * mask
    return token, token.sum(1)


def make_advantage_batch(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> AdvantageBatch:
    """Validate inputs and precompute what the estimators share (see `AdvantageBatch`)."""
    check_2d("mask", mask)
    mask = mask.float()
    if group_ids.dim() != 1 or group_ids.shape[0] != mask.shape[0]:
        raise ValueError(f"group_ids must be [B] with B = {mask.shape[0]}; got {list(group_ids.shape)}")
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor; got dtype {group_ids.dtype}")
    token_rewards, scores = _place_rewards(rewards.detach(), mask)
    returns = torch.flip(torch.cumsum(torch.flip(token_rewards * mask, [1]), 1), [1]) * mask
    uniq, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(uniq.numel())
    counts = torch.bincount(index, minlength=num_groups)
    return AdvantageBatch(token_rewards=token_rewards, mask=mask, returns=returns, scores=scores,
                          group_index=index, num_groups=num_groups, group_size=counts[index])


def variance_proxies(advantages: torch.Tensor, mask: torch.Tensor, proxy: torch.Tensor) -> dict[str, float]:
    """Forward-only gradient-variance proxies (docs/theory.md §7), in logit-gradient units.

    Per sequence Â_b = mean_t A (valid tokens), Ŵ_b = Σ_t w_t m_t with w the logit-gradient proxy;
    total power P = mean_b Â_b²·max(Ŵ_b, 0) (exactly mean_b ‖g_b‖² when the parameters are the per-position
    logits and A is constant along a row). A network's gradient norm is in parameter units, so the §7 noise
    (P − ‖ḡ‖²)/(N − 1) is not formed here: covrl.diagnostics.noise estimates the split in parameter units.
    """
    a_hat = masked_mean(advantages.float(), mask, dim=1)
    w_hat = (proxy.float() * mask).sum(1)
    power = (a_hat.square() * w_hat.clamp_min(0)).mean()
    return {"adv/var_power": item(power), "adv/var_proxy_mean": item(w_hat.mean())}


def _metrics(batch: AdvantageBatch, adv: torch.Tensor) -> dict[str, float]:
    mask = batch.mask
    valid = mask > 0
    _, std = batch.group_mean_std()
    zero_std_rows = (std == 0).float()
    # a group has zero std iff all its rows do; groups of one count as zero-std (no contrast)
    zero_std_groups = batch.group_sum(zero_std_rows) == batch.group_sum(torch.ones_like(zero_std_rows))
    vals = adv[valid]
    m = {
        "adv/mean": item(vals.mean()) if vals.numel() else 0.0,
        "adv/std": item(vals.std(unbiased=False)) if vals.numel() else 0.0,
        "adv/abs_max": item(vals.abs().max()) if vals.numel() else 0.0,
        "adv/num_groups": float(batch.num_groups),
        "adv/group_size_mean": float(batch.scores.shape[0]) / max(batch.num_groups, 1),
        "adv/frac_zero_std_groups": item(zero_std_groups.float().mean()) if batch.num_groups else 0.0,
        "adv/frac_singleton_groups": item((batch.group_sum(torch.ones_like(zero_std_rows)) == 1).float().mean())
        if batch.num_groups else 0.0,
        "adv/score_mean": item(batch.scores.mean()) if batch.scores.numel() else 0.0,
        "adv/score_std": item(batch.scores.std(unbiased=False)) if batch.scores.numel() else 0.0,
        "adv/frac_zero_adv_tokens": item((vals == 0).float().mean()) if vals.numel() else 0.0,
    }
    return m


def advantage_metrics(batch: AdvantageBatch, advantages: torch.Tensor, *, logprobs: torch.Tensor | None = None,
                      sum_pi_sq: torch.Tensor | None = None,
                      is_weights: torch.Tensor | None = None) -> dict[str, float]:
    """The metrics of `compute_advantages` for `advantages` [B, T] of `batch` (see there); the variance proxies
    need `logprobs` and `sum_pi_sq`."""
    with torch.no_grad():
        metrics = _metrics(batch, advantages)
        if logprobs is not None and sum_pi_sq is not None:
            proxy = _otb_proxy(logprobs, sum_pi_sq, is_weights, batch.mask)
            metrics.update(variance_proxies(advantages, batch.mask, proxy))
    return metrics


def compute_advantages(name: str, *, rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                       **inputs) -> AdvantageOutput:
    """Advantages [B, T] by estimator `name` (one of ADVANTAGE_ESTIMATORS: grpo, dr_grpo, rloo, reinforce, maxrl,
    gdpo, otb, otb_tir). See each estimator's docstring for its formula and options.

    rewards [B] or [B, T]; mask [B, T]; group_ids [B] integer. Extra `inputs` are the estimator's options
    (e.g. otb: logprobs, sum_pi_sq, is_weights, handle_zero_tail; grpo: eps; gdpo: reward_terms [B, K],
    reward_weights [K], batch_norm). Any estimator also accepts
    `logprobs` + `sum_pi_sq` (+ `is_weights`) to report the forward-only gradient-variance proxies of
    docs/theory.md §7. Unknown inputs raise a TypeError naming the accepted ones.
    Metrics: adv/mean, adv/std, adv/abs_max, adv/num_groups, adv/group_size_mean, adv/frac_zero_std_groups,
    adv/frac_singleton_groups, adv/score_mean, adv/score_std, adv/frac_zero_adv_tokens, adv/var_* (proxies).
    """
    spec: AdvantageSpec = choose(name, "advantage estimator", ADVANTAGE_SPECS)
    unknown = [k for k in inputs if k not in ADVANTAGE_INPUTS and k not in spec.options]
    if unknown:
        raise TypeError(f"advantage estimator {name!r} got unknown inputs {unknown}; accepted: "
                        f"{sorted(ADVANTAGE_INPUTS | set(spec.options))}")
    supplied = {k: v for k, v in inputs.items() if k in ADVANTAGE_INPUTS}
    options = {k: v for k, v in inputs.items() if k not in ADVANTAGE_INPUTS}
    spec.check_no_bool(options)
    return spec.compute(rewards=rewards, mask=mask, group_ids=group_ids, options=options, **supplied)
