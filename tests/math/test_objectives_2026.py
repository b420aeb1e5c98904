"""The 2026 advantage estimators (maxrl, gdpo) and rollout-correction masks (IcePop, KPop): parity with a
plain-torch transcription of each reference's math on random batches, hand cases at the edges, the theory
statements of docs/theory.md §14 by exact enumeration, selection by name (YAML config, covrl.math / covrl.api)
and a tiny end-to-end trainer step of gdpo with two reward terms.

References transcribed below (each function names its file):
- SkyRL, NovaSky-AI/SkyRL @ a9564572eb8e91076be43c1bd5e4615e3de17265,
  skyrl/backends/skyrl_train/utils/ppo_utils.py `compute_maxrl_advantage`.
- prime-rl, PrimeIntellect-ai/prime-rl @ 559b44772e471d1538537b8805cc77f3824a5e64,
  src/prime_rl/orchestrator/algo/max_rl.py `MaxRLAlgorithm.score_group`.
- verl, verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9 (examples/gdpo_trainer/README.md runs it):
  verl/trainer/ppo/core_algos.py `compute_gdpo_outcome_advantage`, `compute_grpo_outcome_advantage`;
  verl/utils/torch_functional.py `masked_whiten`, `masked_var`; verl/trainer/ppo/rollout_corr_helper.py
  `compute_rollout_correction_weights` (IcePop: a "lower_upper" threshold).
- TRL, huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py
  `_generate_and_score_completions`: multi_objective_aggregation "normalize_then_sum" (GDPO) and
  vllm_importance_sampling_mode "token_mask" / "sequence_mask" (IcePop); trl/trainer/utils.py `nanstd`.
- AReaL, areal-project/AReaL @ cbff54d645d2cd8ee1f1c358a82f3f473588433d, areal/utils/functional/functional.py
  `apply_rejection_sampling` (metric "ratio": IcePop, "binary_kl": KPop), `compute_binary_kl_divergence`,
  `ppo_actor_loss_fn`.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from covrl.config import ConfigError, load_preset
from covrl.math import (
    ADVANTAGE_SPECS,
    REJECTION_CRITERIA,
    CorrectionConfig,
    compute_advantages,
    policy_loss,
    rollout_correction,
)
from covrl.math.correction import BINARY_KL_EPS, bidirectional_binary_kl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_helpers import synthetic_batch, tiny_cfg  # noqa: E402

torch.set_num_threads(1)

SEEDS = (0, 1, 2)
SHAPES = ((9, 7), (16, 12), (5, 1))   # B, T: a singleton group, a one-token width


def _layout(seed: int, B: int, T: int):
    """Random lengths 0..T (row 0 full, row 1 empty when B > 2), groups of 4 in shuffled order (the last smaller:
    a singleton for B = 9, 5)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    if B > 2:
        lengths[1] = 0
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    group_ids = (torch.arange(B) // 4)[torch.randperm(B, generator=g)] * 7 + 3   # arbitrary id values
    return g, mask, group_ids


# ------------------------------------------------------------------------------------------------- MaxRL

def skyrl_maxrl(token_level_rewards, response_mask, index, epsilon=1e-6):
    """SkyRL `compute_maxrl_advantage`, transcribed (its per-group Python loop)."""
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        id2mean[idx] = torch.tensor(0.0) if len(id2score[idx]) == 1 else torch.mean(torch.tensor(id2score[idx]))
    for i in range(scores.shape[0]):
        if len(id2score[index[i]]) > 1:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2mean[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores.unsqueeze(-1) * response_mask


def prime_rl_maxrl(rewards: torch.Tensor) -> torch.Tensor:
    """prime-rl `MaxRLAlgorithm.score_group` on one group's rewards."""
    mean = rewards.mean()
    return torch.zeros_like(rewards) if mean <= 0 else (rewards - mean) / mean


def _token_rewards(rewards, mask):
    """Outcome rewards on each row's last valid token (how SkyRL / verl receive them)."""
    out = torch.zeros_like(mask)
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        if n:
            out[b, n - 1] = rewards[b]
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("kind", ["binary", "uniform"])
def test_maxrl_equals_skyrl_on_random_batches(seed, B, T, kind):
    g, mask, group_ids = _layout(seed, B, T)
    rewards = (torch.rand(B, generator=g) < 0.4).float() if kind == "binary" else torch.rand(B, generator=g)
    # SkyRL reads the score from the token rewards, so an empty row scores 0 there: give it 0 (docs/math.md)
    rewards = rewards * (mask.sum(1) > 0)
    ours = compute_advantages("maxrl", rewards=rewards, mask=mask, group_ids=group_ids).advantages
    ref = skyrl_maxrl(_token_rewards(rewards, mask), mask, group_ids.tolist())
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_maxrl_equals_prime_rl_with_eps_zero(seed):
    g, mask, group_ids = _layout(seed, 16, 5)
    rewards = (torch.rand(16, generator=g) < 0.3).float()
    rewards[group_ids == group_ids[0]] = 0.0          # one group without a success: mean 0
    ours = compute_advantages("maxrl", rewards=rewards, mask=torch.ones(16, 5), group_ids=group_ids,
                              eps=0.0).advantages[:, 0]
    for gid in group_ids.unique():
        rows = group_ids == gid
        torch.testing.assert_close(ours[rows], prime_rl_maxrl(rewards[rows]), rtol=1e-6, atol=0)


def test_maxrl_hand_cases_at_the_edges():
    mask = torch.ones(11, 2)
    rewards = torch.tensor([1.0, 0, 0, 0,     # p̂ = 1/4: A = (1 − ¼)/¼ = 3 and −1 (prime-rl's test case)
                            0, 0,            # no success: group mean 0 -> 0
                            -1, 1,           # mixed signs, mean 0 -> 0 (SkyRL: ±1/eps)
                            -1, -2,          # negative mean -> 0 (SkyRL flips the sign)
                            5])              # a group of one: A = R (SkyRL; prime-rl gives 0)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4])
    adv = compute_advantages("maxrl", rewards=rewards, mask=mask, group_ids=ids, eps=0.0).advantages
    expected = torch.tensor([3.0, -1, -1, -1, 0, 0, 0, 0, 0, 0, 5])
    torch.testing.assert_close(adv, expected[:, None].expand(11, 2))
    sky = skyrl_maxrl(_token_rewards(rewards, mask), mask, ids.tolist())[:, -1]
    assert sky[6].item() == pytest.approx(-1e6, rel=1e-3) and sky[7].item() == pytest.approx(1e6, rel=1e-3)
    assert sky[8].item() < 0 < sky[9].item()       # the better row (−1 > −2) pushed down by the sign flip
    assert prime_rl_maxrl(torch.tensor([5.0])).item() == 0.0
    # an all-masked row still counts in its group (outcome reward), and gets no advantage on its (no) tokens
    m = torch.tensor([[1.0, 1], [0, 0], [1, 0]])
    out = compute_advantages("maxrl", rewards=torch.tensor([1.0, 1, 0]), mask=m, group_ids=torch.zeros(3).long(),
                             eps=0.0).advantages
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.5], [0, 0], [-1, 0]]))
    # a zero-variance group of successes is exactly 0; zero_constant_groups also zeroes a singleton-free group
    same = compute_advantages("maxrl", rewards=torch.full((4,), 0.7), mask=torch.ones(4, 1),
                              group_ids=torch.zeros(4).long(), zero_constant_groups=True).advantages
    assert torch.equal(same, torch.zeros(4, 1))
    with pytest.raises(ValueError, match="eps must be >= 0"):
        compute_advantages("maxrl", rewards=rewards, mask=mask, group_ids=ids, eps=-1e-3)


def _expected_maxrl_gradient(N: int, logits: torch.Tensor, reward: torch.Tensor, eps: float = 0.0):
    """E over N iid draws of a V-way categorical policy softmax(logits) of the MaxRL estimator
    (1/N)·Σ_i A_i ∇log π(y_i), by enumerating all V^N outcomes (covrl's maxrl for A)."""
    V = logits.shape[0]
    grad = torch.zeros(V, dtype=torch.float64)
    for draw in torch.cartesian_prod(*[torch.arange(V)] * N).reshape(-1, N):
        adv = compute_advantages("maxrl", rewards=reward[draw].float(), mask=torch.ones(N, 1),
                                 group_ids=torch.zeros(N, dtype=torch.long), eps=eps).advantages[:, 0].double()
        lp = torch.log_softmax(logits, 0)
        weight = lp[draw].sum().exp()
        (g,) = torch.autograd.grad((adv * lp[draw]).sum() / N, logits)
        grad += weight.detach() * g
    return grad


@pytest.mark.parametrize("N", [2, 3, 4])
def test_maxrl_expected_update_is_the_gradient_of_the_order_n_minus_1_likelihood(N):
    """docs/theory.md §14: with binary rewards E[ĝ] = ∇J_{N−1}, J_m(p) = −Σ_{k=1}^{m} (1 − p)^k / k (the order-m
    truncation of log p), i.e. ∇p·(1 − (1 − p)^{N−1})/p; and ∇J_N once an all-fail group is pushed down by
    A = −1 instead of 0 (the term the group-mean rule drops)."""
    logits = torch.tensor([0.3, -0.4, 0.1], dtype=torch.float64, requires_grad=True)
    reward = torch.tensor([1, 0, 0])
    got = _expected_maxrl_gradient(N, logits, reward)
    p = torch.softmax(logits, 0)[0]

    def truncated_log(m):
        return -sum((1 - p) ** k / k for k in range(1, m + 1))

    (want,) = torch.autograd.grad(truncated_log(N - 1), logits, retain_graph=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # the dropped all-fail term: E[−(1/N) Σ_i ∇log π(y_i) · 1{no success}] = ∇J_N − ∇J_{N−1}
    (full,) = torch.autograd.grad(truncated_log(N), logits)
    lp = torch.log_softmax(logits, 0)
    all_fail = torch.zeros(3, dtype=torch.float64)
    for draw in torch.cartesian_prod(*[torch.arange(1, 3)] * N).reshape(-1, N):
        (g,) = torch.autograd.grad(-lp[draw].sum() / N, logits, retain_graph=True)
        all_fail += lp[draw].sum().exp().detach() * g
    torch.testing.assert_close(got + all_fail, full, rtol=1e-5, atol=1e-7)


# -------------------------------------------------------------------------------------------------- GDPO

def verl_grpo_outcome(token_level_rewards, response_mask, index, epsilon=1e-6):
    """verl `compute_grpo_outcome_advantage` (norm_adv_by_std_in_grpo=True), transcribed."""
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            t = torch.stack(id2score[idx])
            id2mean[idx], id2std[idx] = torch.mean(t), torch.std(t)
    for i in range(scores.shape[0]):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
    return scores.unsqueeze(-1) * response_mask


def verl_masked_whiten(values, mask):
    """verl `masked_whiten` (shift_mean=True) with `masked_mean` / `masked_var(unbiased=True)`."""
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = ((values - mean) ** 2 * mask).sum() / (mask.sum() + 1e-8)
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_gdpo(score_list, response_mask, index, weights, epsilon=1e-6):
    """verl `compute_gdpo_outcome_advantage`: GRPO per term, weighted sum, masked_whiten over the tokens."""
    new = None
    for i, scores in enumerate(score_list):
        part = weights[i] * verl_grpo_outcome(scores, response_mask, index, epsilon)
        new = part if new is None else new + part
    return verl_masked_whiten(new, response_mask) * response_mask


def trl_normalize_then_sum(rewards_per_func, num_generations, reward_weights):
    """TRL's multi_objective_aggregation == "normalize_then_sum" (groups contiguous, num_generations each)."""
    def nanstd(t, dim=None, keepdim=False):
        mean = torch.nanmean(t, dim=dim, keepdim=True)
        var = torch.nanmean((t - mean) ** 2, dim=dim, keepdim=True)
        count = torch.sum(~torch.isnan(t), dim=dim, keepdim=True)
        var = var * torch.where(count > 1, count / (count - 1), torch.full_like(count / 1.0, float("nan")))
        std = torch.sqrt(var)
        return std if keepdim else std.squeeze()

    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    pre = rewards.clone()
    return pre, (rewards - torch.nanmean(rewards)) / (nanstd(rewards) + 1e-4)


def _terms(g, B, K=2):
    """Per-term rewards of different kinds: binary correctness, a graded format score, a penalty."""
    cols = [(torch.rand(B, generator=g) < 0.5).float(), torch.rand(B, generator=g).round(decimals=1),
            -torch.rand(B, generator=g)]
    return torch.stack(cols[:K], 1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("K", [2, 3])
def test_gdpo_equals_verl_on_random_batches(seed, B, T, K):
    g, mask, group_ids = _layout(seed, B, T)
    if mask.sum() < 2:
        mask[0, 0] = mask[min(2, B - 1), 0] = 1.0   # verl's unbiased token variance needs two tokens
    terms = _terms(g, B, K)
    weights = torch.tensor([1.0, 0.5, 2.0][:K])
    terms = terms * (mask.sum(1, keepdim=True) > 0)   # verl reads scores from the tokens: an empty row scores 0
    ours = compute_advantages("gdpo", rewards=terms @ weights, mask=mask, group_ids=group_ids, reward_terms=terms,
                              reward_weights=weights).advantages
    ref = verl_gdpo([_token_rewards(terms[:, k], mask) for k in range(K)], mask, group_ids.tolist(), weights)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_gdpo_sequence_level_equals_trl_normalize_then_sum(seed):
    """TRL normalises with (std + 1e-4) at both levels; covrl per term with (std + eps) and over the batch with
    sqrt(var + 1e-8): equal before the batch step with eps = 1e-4, and after it up to that documented factor."""
    g = torch.Generator().manual_seed(seed)
    B, n = 16, 4
    terms = _terms(g, B, 3)
    weights = torch.tensor([1.0, 0.5, 2.0])
    ids = torch.arange(B) // n
    kwargs = dict(rewards=terms @ weights, mask=torch.ones(B, 3), group_ids=ids, reward_terms=terms,
                  reward_weights=weights, eps=1e-4)
    pre, trl = trl_normalize_then_sum(terms, n, weights)
    none = compute_advantages("gdpo", batch_norm="none", **kwargs).advantages[:, 0]
    torch.testing.assert_close(none, pre, rtol=1e-5, atol=1e-6)
    seq = compute_advantages("gdpo", batch_norm="sequence", **kwargs).advantages[:, 0]
    var = pre.var()
    torch.testing.assert_close(seq * (var + 1e-8).sqrt() / (var.sqrt() + 1e-4), trl, rtol=1e-5, atol=1e-6)


def test_gdpo_with_one_term_is_grpo_exactly():
    g, mask, ids = _layout(0, 16, 6)
    r = torch.rand(16, generator=g)
    grpo = compute_advantages("grpo", rewards=r, mask=mask, group_ids=ids).advantages
    for terms in (None, r[:, None]):
        for norm in ("token", "sequence", "none"):
            adv = compute_advantages("gdpo", rewards=r, mask=mask, group_ids=ids, reward_terms=terms,
                                     batch_norm=norm).advantages
            assert torch.equal(adv, grpo)


def test_gdpo_hand_cases_at_the_edges():
    ids = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 1)
    # the sum is constant in group 0 (1 + 0 = 0 + 1): GRPO gives 0 there, GDPO keeps both terms' contrast
    terms = torch.tensor([[1.0, 0], [0, 1], [1, 1], [0, 0]])
    r = terms.sum(1)
    assert torch.equal(compute_advantages("grpo", rewards=r, mask=mask, group_ids=ids).advantages[:2],
                       torch.zeros(2, 1))
    none = compute_advantages("gdpo", rewards=r, mask=mask, group_ids=ids, reward_terms=terms,
                              batch_norm="none", eps=0.0).advantages[:, 0]
    s = 1 / math.sqrt(2)   # unbiased std of (1, 0) is 1/√2, each centred value ±½ -> ±1/√2 per term
    torch.testing.assert_close(none, torch.tensor([0.5 / s - 0.5 / s, -0.5 / s + 0.5 / s, 2 * 0.5 / s,
                                                   -2 * 0.5 / s]))
    # every term constant in every group: all zero, and whitening a zero vector stays zero
    flat = compute_advantages("gdpo", rewards=torch.ones(4), mask=mask, group_ids=ids,
                              reward_terms=torch.ones(4, 2)).advantages
    assert torch.equal(flat, torch.zeros(4, 1))
    # the token-level whitening shifts a group whose terms are all constant off 0 (lengths differ);
    # zero_constant_groups puts it back to exactly 0
    m = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    ids3 = torch.tensor([0, 0, 1, 1, 2, 2])
    t3 = torch.tensor([[1.0, 0.2], [0, 0.4], [0, 1], [1, 0], [1, 1], [1, 1]])
    shifted = compute_advantages("gdpo", rewards=t3.sum(1), mask=m, group_ids=ids3, reward_terms=t3).advantages
    assert shifted[4:].abs().sum() > 0
    fixed = compute_advantages("gdpo", rewards=t3.sum(1), mask=m, group_ids=ids3, reward_terms=t3,
                               zero_constant_groups=True).advantages
    assert torch.equal(fixed[4:], torch.zeros(2, 3)) and torch.equal(fixed[:4], shifted[:4])
    # single valid token in the batch: no variance to divide by, centred to 0 (verl raises there)
    one = compute_advantages("gdpo", rewards=torch.zeros(2), mask=torch.tensor([[1.0], [0.0]]),
                             group_ids=torch.tensor([0, 0]), reward_terms=torch.tensor([[1.0, 0], [0, 1]])).advantages
    assert torch.equal(one, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="reward_weights must hold one weight per term"):
        compute_advantages("gdpo", rewards=r, mask=mask, group_ids=ids, reward_terms=terms,
                           reward_weights=torch.ones(3))
    with pytest.raises(ValueError, match=r"reward_terms must be \[B, K\]"):
        compute_advantages("gdpo", rewards=r, mask=mask, group_ids=ids, reward_terms=terms[:3])


# ---------------------------------------------------------------------------------------- IcePop / KPop

def verl_is_weights(log_ratio, response_mask, rollout_is, lower, upper):
    """verl `compute_rollout_correction_weights` with a "lower_upper" threshold (IcePop), no batch norm."""
    if rollout_is == "token":
        raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:
        log_sum = (log_ratio * response_mask).sum(-1, keepdim=True)
        raw = torch.exp(torch.clamp(log_sum, min=-20.0, max=20.0)).expand_as(log_ratio)
    raw = raw * response_mask
    kept = (raw >= lower) & (raw <= upper)
    return torch.where(kept, raw, torch.zeros_like(raw))


def trl_is_mask(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min, clip_max):
    """TRL's vllm_importance_sampling_mode "token_mask" / "sequence_mask" ratio (0 outside [C_min, C_max])."""
    diff = (old_per_token_logps - sampling_per_token_logps) * mask
    logps_diff = diff.sum(dim=-1, keepdim=True) if mode == "sequence_mask" else diff
    ratio = torch.exp(logps_diff)
    invalid = (ratio < clip_min) | (ratio > clip_max)
    return ratio.masked_fill(invalid, value=0.0)


def areal_binary_kl(log_p, log_q, eps=1e-8):
    """AReaL `compute_binary_kl_divergence` (computed in the dtype of its inputs)."""
    p = torch.clamp(torch.exp(log_p), eps, 1.0 - eps)
    q = torch.clamp(torch.exp(log_q), eps, 1.0 - eps)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def areal_rejection(proximal, old, loss_mask, *, metric, level="token", agg="mean", upper, lower=None):
    """AReaL `apply_rejection_sampling`, 2D padded inputs, action "mask": (loss mask, behave_imp_weight)."""
    log_ratio = proximal.detach().float() - old.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    if metric == "ratio":
        value = torch.exp(log_ratio)
    else:
        value = torch.maximum(areal_binary_kl(proximal.detach(), old.detach()),
                              areal_binary_kl(old.detach(), proximal.detach()))
    weight = torch.exp(log_ratio)

    def inside(x):
        return (x >= lower) & (x <= upper) if lower is not None else x <= upper

    if level == "sequence":
        log_agg = metric == "ratio"
        agg_values = log_ratio if log_agg else value
        masked = torch.where(loss_mask.bool(), agg_values, 0.0)
        count = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
        if log_agg:
            weight = torch.exp(masked.sum(dim=-1, keepdim=True) / count).expand_as(log_ratio)
        if agg == "sum":
            seq = masked.sum(dim=-1, keepdim=True)
        elif agg == "mean":
            seq = masked.sum(dim=-1, keepdim=True) / count
        else:
            seq = agg_values.masked_fill(~loss_mask.bool(), float("-inf")).max(dim=-1, keepdim=True)[0]
            seq = torch.where(loss_mask.sum(dim=-1, keepdim=True) == 0, torch.zeros_like(seq), seq)
        in_bounds = inside(torch.exp(seq) if log_agg else seq).expand_as(loss_mask)
    else:
        in_bounds = inside(value)
    updated = (loss_mask.bool() & in_bounds).to(loss_mask.dtype)
    return updated, torch.where(updated.bool(), weight, 0.0)


def _logprobs(seed: int, B: int, T: int, noise: float = 0.7):
    """Sampler log-probs q ∈ [−6, −0.01] and trainer p = q + noise·N(0, 1) clamped below −1e-3, some probable
    tokens (q near 0), padding 0."""
    g, mask, _ = _layout(seed, B, T)
    logq = -(torch.rand(B, T, generator=g) * 6 + 0.01)
    logq[:, ::3] = -torch.rand(B, (T + 2) // 3, generator=g) * 0.05
    logp = (logq + noise * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    return logp * mask, logq * mask, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_is_the_existing_band_and_equals_verl_trl_and_areal(seed, B, T, level):
    logp, logq, mask = _logprobs(seed, B, T)
    lo, hi = (0.5, 5.0) if level == "token" else (0.2, 8.0)
    cfg = CorrectionConfig.icepop(lo, hi, level)
    # the named preset is the existing criteria, as YAML writes them (verl's "lo_hi" strings)
    crit = "token_k1" if level == "token" else "seq_sum_k1"
    assert cfg == CorrectionConfig(is_level=level, is_threshold=f"{lo}_{hi}", rs=[crit], rs_threshold=[f"{lo}_{hi}"])
    out = rollout_correction(logp, logq, mask, cfg)
    lr = (logp - logq) * mask
    torch.testing.assert_close(out.weights, verl_is_weights(lr, mask, level, lo, hi), rtol=1e-6, atol=1e-7)
    trl = trl_is_mask(logp, logq, mask, f"{level}_mask", lo, hi).expand_as(mask) * mask
    torch.testing.assert_close(out.weights * out.keep, trl, rtol=1e-6, atol=1e-7)
    keep, _ = areal_rejection(logp, logq, mask, metric="ratio", level=level, agg="sum", upper=hi, lower=lo)
    assert torch.equal(out.keep, keep)
    if level == "token":   # AReaL's sequence-level weight is the geometric mean: not covrl's sequence IS
        _, weight = areal_rejection(logp, logq, mask, metric="ratio", upper=hi, lower=lo)
        torch.testing.assert_close(out.weights * out.keep, weight, rtol=1e-6, atol=1e-7)
    # the geometric (AReaL agg="mean") band is seq_mean_k1
    geo = rollout_correction(logp, logq, mask, CorrectionConfig(rs=["seq_mean_k1"], rs_threshold=[(lo, hi)]))
    keep, _ = areal_rejection(logp, logq, mask, metric="ratio", level="sequence", agg="mean", upper=hi, lower=lo)
    assert torch.equal(geo.keep, keep)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("criterion,level,agg", [("token_bkl", "token", None), ("seq_sum_bkl", "sequence", "sum"),
                                                  ("seq_mean_bkl", "sequence", "mean"),
                                                  ("seq_max_bkl", "sequence", "max")])
def test_kpop_equals_areal_binary_kl(seed, B, T, criterion, level, agg):
    logp, logq, mask = _logprobs(seed, B, T)
    stat = bidirectional_binary_kl(logp, logq)
    ref = torch.maximum(areal_binary_kl(logp.double(), logq.double()), areal_binary_kl(logq.double(), logp.double()))
    torch.testing.assert_close(stat.double(), ref, rtol=1e-4, atol=1e-6)
    # φ halfway between the two middle values of the criterion's statistic: about half masked, no value near φ
    units = REJECTION_CRITERIA[criterion]((logp - logq) * mask, mask, logp, logq).expand_as(mask)[mask > 0]
    values = units.unique().sort().values
    phi = float(values[len(values) // 2 - 1: len(values) // 2 + 1].mean()) if len(values) > 1 else 0.1
    out = rollout_correction(logp, logq, mask, CorrectionConfig.kpop(phi, criterion))
    keep, weight = areal_rejection(logp.double(), logq.double(), mask, metric="binary_kl", level=level,
                                   agg=agg or "mean", upper=phi)
    assert torch.equal(out.keep, keep.float())
    torch.testing.assert_close(out.weights * out.keep, weight.float(), rtol=1e-6, atol=1e-7)
    assert out.metrics[f"correction/rejected_frac/{criterion}"] == pytest.approx(1 - float(keep.sum() / mask.sum())
                                                                                  if mask.sum() else 0.0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("preset", ["icepop", "kpop"])
def test_masked_loss_gradient_equals_areal_ppo_actor_loss(seed, preset):
    """AReaL's loss with rejection (logprobs = proximal: ratio 1, gradient ∇log p, times the detached behaviour
    ratio on kept tokens, over the original token count) equals covrl's reinforce loss with the preset's keep
    mask and IS weights, token-mean over the full mask."""
    logp, logq, mask = _logprobs(seed, 16, 12)
    adv = torch.randn(16, 12, generator=torch.Generator().manual_seed(seed + 10)) * mask
    if preset == "icepop":
        cfg, rs = CorrectionConfig.icepop(0.5, 2.0), dict(metric="ratio", upper=2.0, lower=0.5)
    else:
        cfg, rs = CorrectionConfig.kpop(0.02), dict(metric="binary_kl", upper=0.02)
    leaf = logp.clone().requires_grad_(True)
    keep, weight = areal_rejection(leaf, logq, mask, **rs)
    assert 0 < keep.sum() < mask.sum()
    ratio = torch.where(mask.bool(), torch.exp(leaf - leaf.detach()), 0)
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28)) * weight
    ref = torch.where(keep.bool(), pg, 0).sum() / mask.count_nonzero()
    (ref_grad,) = torch.autograd.grad(ref, leaf)
    out = rollout_correction(logp, logq, mask, cfg)
    leaf2 = logp.clone().requires_grad_(True)
    ours = policy_loss("reinforce", logprobs=leaf2, sampler_logprobs=logq, advantages=adv, mask=out.keep,
                       is_weights=out.weights, agg_mode="token-mean").token_loss
    (grad,) = torch.autograd.grad((ours * out.keep).sum() / mask.sum(), leaf2)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_binary_kl_hand_cases_and_the_fp32_reference_bug():
    # KL(Bern(½) ‖ Bern(¼)) = ½ log 2 + ½ log(2/3)
    half, quarter = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert bidirectional_binary_kl(half, half).item() == 0.0
    fwd = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    rev = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert bidirectional_binary_kl(half, quarter).item() == pytest.approx(max(fwd, rev), rel=1e-6)
    # a token of probability 1 in fp32: AReaL clamps at 1 − 1e-8, which is 1.0 in fp32, and gets 0·log 0 = nan
    # (then masks the token: nan <= phi is False); covrl's complement from expm1 is exact and finite
    one, likely = torch.tensor([0.0]), torch.tensor([-1e-3])
    assert torch.isnan(areal_binary_kl(one, likely)).all()
    ours = bidirectional_binary_kl(one, likely)
    assert ours.item() == pytest.approx(1.05e-2, rel=1e-2)
    ref = torch.maximum(areal_binary_kl(one.double(), likely.double()), areal_binary_kl(likely.double(),
                                                                                         one.double()))
    torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=0)
    keep = rollout_correction(one[None], likely[None], torch.ones(1, 1), CorrectionConfig.kpop(0.1)).keep
    assert keep.item() == 1.0                       # bkl ≈ 1.05e-2 < 0.1: kept (AReaL would mask it)
    # extreme ratios: log-probs at the sampler's floor and beyond the ±20 clamp stay finite
    extreme = bidirectional_binary_kl(torch.tensor([-1e4, -1e-9, -30.0]), torch.tensor([-1e-9, -1e4, -0.1]))
    assert torch.isfinite(extreme).all() and (extreme > 5).all()
    assert BINARY_KL_EPS == 1e-8


def test_masking_edge_cases_and_mismatch_metrics_count_the_masked_tokens():
    logq = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0], [-0.3, 0, 0]])
    logp = logq + torch.tensor([[0.0, 3.0, -0.1], [0.0, 0.0, 0.0], [-25.0, 0, 0]])
    mask = torch.tensor([[1.0, 1, 1], [0, 0, 0], [1, 0, 0]])        # an all-masked row, a single-token row
    plain = rollout_correction(logp, logq, mask)
    for cfg in (CorrectionConfig.icepop(0.5, 5.0), CorrectionConfig.kpop(0.05),
                CorrectionConfig(is_level="token", is_threshold=(0.5, 5.0))):
        out = rollout_correction(logp, logq, mask, cfg)
        assert out.keep[1].sum() == 0 and out.weights[1].sum() == 0
        # token 2 (ratio e³ ≈ 20) and the single extreme token (ratio e^−20 after the clamp) are dropped
        dropped = torch.tensor([[0.0, 1, 0], [0, 0, 0], [1, 0, 0]])
        assert out.metrics["correction/dropped_frac"] == pytest.approx(0.5)
        for key in ("mismatch/k1", "mismatch/k3", "mismatch/bkl", "mismatch/max_abs_lr", "mismatch/chi2_token"):
            assert out.metrics[key] == plain.metrics[key]   # over every valid token, masked ones included
        k3 = (torch.expm1((logp - logq).clamp(-20, 20)) - (logp - logq).clamp(-20, 20))
        assert out.metrics["mismatch/k3_dropped"] == pytest.approx(float((k3 * dropped).sum() / 2), rel=1e-5)
        assert out.metrics["mismatch/k3_kept"] == pytest.approx(float((k3 * (mask - dropped)).sum() / 2), rel=1e-5)
        if cfg.rs:
            assert out.metrics["correction/masked_frac"] == pytest.approx(0.5)
        else:   # the IS band alone: the tokens keep their mask, with weight 0
            assert out.metrics["correction/masked_frac"] == 0.0
            assert out.metrics["correction/zero_weight_frac"] == pytest.approx(0.5)
    assert plain.metrics["correction/dropped_frac"] == 0.0 and plain.metrics["correction/zero_weight_frac"] == 0.0
    # everything masked
    none_kept = rollout_correction(logp, logq, mask, CorrectionConfig.icepop(1.5, 2.0))
    assert none_kept.keep.sum() == 0 and none_kept.metrics["correction/dropped_frac"] == 1.0
    assert none_kept.metrics["mismatch/k3_kept"] == 0.0
    # p = q: nothing masked, statistics 0
    same = rollout_correction(logq, logq, torch.ones(3, 3), CorrectionConfig.kpop(1e-12))
    assert same.keep.sum() == 9 and same.metrics["mismatch/bkl"] == 0.0


# ------------------------------------------------------------------------------------ selection by name

def test_selectable_from_yaml_and_covrl_api_and_refused_with_the_option_named(tmp_path):
    two_terms = {"task.rewards": [{"fn": "last_number"}, {"fn": "format", "weight": 0.5}]}
    cfg = load_preset("tiny", {"algorithm.advantage": "gdpo", "algorithm.advantage_options": {
        "batch_norm": "sequence", "eps": 1e-4}, **two_terms})
    assert cfg.algorithm.advantage == "gdpo"
    assert load_preset("tiny", {"algorithm.advantage": "gdpo"}).algorithm.advantage == "gdpo"   # one term: GRPO
    assert load_preset("tiny", {"algorithm.advantage": "maxrl", "algorithm.advantage_options": {"eps": 0.0}}
                       ).algorithm.advantage_options == {"eps": 0.0}
    ice = load_preset("tiny", {"correction.is_level": "token", "correction.is_threshold": "0.5_5.0",
                               "correction.rs": ["token_k1"], "correction.rs_threshold": ["0.5_5.0"]})
    assert ice.correction == CorrectionConfig.icepop()
    kpop = load_preset("tiny", {"correction.is_level": "token", "correction.is_threshold": ".inf",
                                "correction.rs": ["token_bkl"], "correction.rs_threshold": [0.1]})
    assert kpop.correction == CorrectionConfig.kpop()
    for over, named in [
        ({"algorithm.advantage": "maxrl", "algorithm.advantage_options": {"epsilon": 1e-6}},
         "algorithm.advantage_options.epsilon is not an option of maxrl"),
        ({"algorithm.advantage": "maxrl", "algorithm.advantage_options": {"eps": -1.0}},
         "algorithm.advantage_options.eps: Input should be greater than or equal to 0"),
        ({"algorithm.advantage": "maxrl", "algorithm.advantage_options": {"eps": True}},
         "algorithm.advantage_options.eps"),
        ({"algorithm.advantage": "gdpo", "algorithm.advantage_options": {"batch_norm": "batch"}},
         "algorithm.advantage_options.batch_norm: Input should be 'token', 'sequence' or 'none'"),
        ({"algorithm.advantage": "gdpo", "kl.coef": 0.1, "kl.mode": "reward", **two_terms},
         "no per-term rewards: kl.mode=reward"),
        ({"algorithm.advantage": "gdpo", "task.env.name": "calculator"},
         "no per-term rewards: multi-turn episodes"),
        ({"correction.rs": ["token_bkl"], "correction.rs_threshold": [[0.1, 0.2]]},
         "rs_threshold for token_bkl: k2/k3/bkl thresholds are upper bounds"),
        ({"correction.rs": ["token_bkl"], "correction.rs_threshold": [0.0]}, "rs_threshold for token_bkl must be > 0"),
        ({"correction.rs": ["token_kpop"], "correction.rs_threshold": [0.1]}, "rs: unknown criteria ['token_kpop']"),
    ]:
        with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            load_preset("tiny", over)
    # covrl.api takes the same names: a config (preset + overrides) and a client's correction
    from covrl.api import TrainingClient, resolve_config
    assert resolve_config("tiny", {"algorithm.advantage": "maxrl"}).algorithm.advantage == "maxrl"
    client = TrainingClient.from_config("tiny", {"sft_warmup.steps": 0, "task.n_train": 16, "task.n_eval": 4,
                                                 "correction.rs": ["token_bkl"], "correction.rs_threshold": [0.1],
                                                 "correction.is_level": "token", "correction.is_threshold": ".inf"},
                                        state_dir=tmp_path)
    assert client.correction == CorrectionConfig.kpop()
    with pytest.raises(ValueError, match="kpop criterion must be one of the"):
        CorrectionConfig.kpop(0.1, "token_k3")
    assert {"maxrl", "gdpo"} <= set(ADVANTAGE_SPECS)
    assert ADVANTAGE_SPECS["gdpo"].spans_batch({}) and not ADVANTAGE_SPECS["gdpo"].spans_batch({"batch_norm": "none"})


# ------------------------------------------------------------------------------------------ the trainer

def _grads(cfg, batch):
    from covrl.models import tiny_llama
    from covrl.train.step.trainer import Trainer

    model = tiny_llama(40, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=32, seed=0)
    trainer = Trainer(model, cfg)
    captured = []
    trainer.optimizer.step = lambda *a, **k: captured.append([p.grad.detach().clone() for p in trainer.params])
    result = trainer.step(batch)
    assert captured, result.skip_reason
    return captured[0], result


def _with_terms(batch, terms: torch.Tensor, weights: dict[str, float]):
    from dataclasses import replace
    return replace(batch, rewards=terms @ torch.tensor(list(weights.values())), reward_terms=terms,
                   reward_term_weights=weights)


def test_trainer_gdpo_one_term_is_grpo_and_two_terms_need_the_whole_batch():
    from covrl.models import tiny_llama

    model = tiny_llama(40, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=32, seed=0)
    batch = synthetic_batch(model, groups=3, group_size=4)
    base = {"optim.max_grad_norm": None, "algorithm.loss": "reinforce"}
    grpo, _ = _grads(tiny_cfg(**base, **{"algorithm.advantage": "grpo"}), batch)
    one, _ = _grads(tiny_cfg(**base, **{"algorithm.advantage": "gdpo"}), batch)   # no terms on the batch: one
    assert all(torch.equal(a, b) for a, b in zip(grpo, one))
    g = torch.Generator().manual_seed(3)
    terms = _terms(g, 12, 2)
    weights = {"last_number": 1.0, "format": 0.5}
    two = {"algorithm.advantage": "gdpo", "task.rewards": [{"fn": "last_number"}, {"fn": "format", "weight": 0.5}]}
    full, res = _grads(tiny_cfg(**base, **two, **{"optim.micro_batch_size": 12}), _with_terms(batch, terms, weights))
    # micro-batches of whole groups: the batch normalisation still sees the whole batch (a pre-pass)
    split, _ = _grads(tiny_cfg(**base, **two, **{"optim.micro_batch_size": 4}), _with_terms(batch, terms, weights))
    for a, b in zip(full, split):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    expected = compute_advantages("gdpo", rewards=terms @ torch.tensor([1.0, 0.5]), mask=batch.response_mask,
                                  group_ids=batch.group_ids, reward_terms=terms,
                                  reward_weights=torch.tensor([1.0, 0.5])).metrics
    for key in ("adv/mean", "adv/std", "adv/abs_max"):
        assert res.metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6)
    with pytest.raises(ValueError, match="carries no per-term rewards"):
        _grads(tiny_cfg(**base, **two), batch)


def test_per_term_rewards_travel_with_the_batch():
    """ScoredBatch.reward_terms through select (micro-batches), concat_batches (async chunks) and the checkpoint
    form; chunks scored with other terms, or without them (episodes), concatenate to none."""
    from covrl.models import tiny_llama
    from covrl.rollout.types import batch_from_state, batch_to_state, concat_batches

    model = tiny_llama(40, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=32, seed=0)
    base = synthetic_batch(model, groups=2, group_size=2)
    terms = {"a": [1.0, 0.0, 2.0, 3.0], "b": [0.5, 0.5, 0.0, 1.0]}
    scored = base.scored(base.rewards, reward_terms=terms, reward_term_weights={"a": 1.0, "b": -2.0})
    assert torch.equal(scored.reward_terms, torch.tensor(list(zip(terms["a"], terms["b"]))))
    assert torch.equal(scored.reward_weights, torch.tensor([1.0, -2.0]))
    assert torch.equal(scored.select([2, 0]).reward_terms, scored.reward_terms[[2, 0]])
    both = concat_batches([scored, scored], pad_id=0)
    assert torch.equal(both.reward_terms, torch.cat([scored.reward_terms] * 2))
    assert dict(both.reward_term_weights) == {"a": 1.0, "b": -2.0}
    assert concat_batches([scored, base], pad_id=0).reward_terms is None
    other = base.scored(base.rewards, reward_terms=terms, reward_term_weights={"a": 1.0, "b": 2.0})
    assert concat_batches([scored, other], pad_id=0).reward_terms is None
    back = batch_from_state(batch_to_state(scored))
    assert torch.equal(back.reward_terms, scored.reward_terms) and back.reward_term_weights == {"a": 1.0, "b": -2.0}
    with pytest.raises(ValueError, match="reward_term_weights names"):
        base.scored(base.rewards, reward_terms=terms, reward_term_weights={"a": 1.0})
    with pytest.raises(ValueError, match="need 4 values per term"):
        base.scored(base.rewards, reward_terms={"a": [1.0]}, reward_term_weights={"a": 1.0})


def length_term(completion: str, example) -> float:
    """A reward term of the end-to-end test: the response length in characters, over 4."""
    return len(completion) / 4


def digit_term(completion: str, example) -> float:
    """A reward term of the end-to-end test: 1 when the response holds a digit."""
    return float(any(c.isdigit() for c in completion))


def test_end_to_end_gdpo_step_with_two_reward_terms(tmp_path):
    """A tiny run's own path: the sampler generates, the task scores two terms (kept per rollout on the batch),
    Trainer.step normalises each within its group and the sum over the batch, and the step is taken."""
    from covrl.train.run.folder import prepare_run
    from covrl.train.run.sources import build_sync_source

    here = Path(__file__).resolve()
    cfg = tiny_cfg(tmp_path, **{
        "algorithm.advantage": "gdpo", "sft_warmup.steps": 0, "loop.steps": 1, "eval.before": False,
        "eval.after": False, "checkpoint.at_end": False, "task.n_train": 16, "task.n_eval": 4,
        "task.rewards": [{"fn": f"{here}:length_term", "name": "length"},
                         {"fn": f"{here}:digit_term", "name": "digit", "weight": 2.0}]})
    run = prepare_run(cfg, console=False)
    try:
        batch = build_sync_source(run).next_batch(0).batch
        assert dict(batch.reward_term_weights) == {"length": 1.0, "digit": 2.0}
        assert tuple(batch.reward_terms.shape) == (16, 2)
        torch.testing.assert_close(batch.rewards, batch.reward_terms @ torch.tensor([1.0, 2.0]))
        assert batch.reward_terms[:, 0].std() > 0      # the terms vary, so GDPO has something to normalise
        before = [p.detach().clone() for p in run.model.parameters()]
        result = run.trainer.step(batch)
        assert result.metrics["skipped"] == 0.0 and math.isfinite(result.metrics["loss"])
        expected = compute_advantages("gdpo", rewards=batch.rewards, mask=batch.train_mask, group_ids=batch.group_ids,
                                      reward_terms=batch.reward_terms, reward_weights=batch.reward_weights).metrics
        assert result.metrics["adv/std"] == pytest.approx(expected["adv/std"], rel=1e-5)
        assert any(not torch.equal(a, b) for a, b in zip(before, run.model.parameters()))
    finally:
        run.close()


# ----------------------------------------------------------------------------- measured on the tiny preset

def stale_sampler_masks(steps: int = 30, seed: int = 0) -> dict[str, float]:
    """What IcePop (0.5, 5) and KPop (φ = 0.1) mask when the sampler is `steps` RL steps stale: configs/tiny.yaml
    (its warm-up, then `steps` steps of its own algorithm); the rollouts of the first step, drawn by the warmed-up
    policy, are scored by the trained one. Split by the sampler's probability q of the drawn token."""
    import tempfile

    from covrl.config import load_preset as preset
    from covrl.train.run.folder import prepare_run
    from covrl.train.run.sources import build_sync_source
    from covrl.train.step.trainer import forward_batch

    with tempfile.TemporaryDirectory() as tmp:
        cfg = preset("tiny", {"run.output_dir": tmp, "run.seed": seed, "eval.before": False, "eval.after": False,
                              "logging.console": False, "logging.curves": False, "checkpoint.at_end": False})
        run = prepare_run(cfg, console=False)
        try:
            source = build_sync_source(run)
            stale = source.next_batch(0).batch
            for _ in range(steps):
                run.trainer.step(source.next_batch(run.trainer.version).batch)
                source.publish(run.model, run.trainer.version)
            with torch.no_grad():
                logp = forward_batch(run.model, stale, cfg.sampler.temperature, with_stats=False).logprobs.float()
        finally:
            run.close()
    logq, mask = stale.sampler_logprobs.float(), stale.train_mask.float()
    out = {"tokens": float(mask.sum())}
    confident = ((logq.exp() > 0.9).float() * mask)
    for name, cfg_ in (("icepop", CorrectionConfig.icepop(0.5, 5.0)), ("kpop", CorrectionConfig.kpop(0.1))):
        res = rollout_correction(logp, logq, mask, cfg_)
        dropped = (1 - res.keep) * mask
        out[f"{name}/masked_frac"] = res.metrics["correction/masked_frac"]
        out[f"{name}/masked_frac_q>0.9"] = float((dropped * confident).sum() / confident.sum().clamp_min(1))
        out[f"{name}/k3_dropped"] = res.metrics["mismatch/k3_dropped"]
        out[f"{name}/k3_kept"] = res.metrics["mismatch/k3_kept"]
    out["mismatch/k3"], out["mismatch/bkl"] = res.metrics["mismatch/k3"], res.metrics["mismatch/bkl"]
    out["frac_q>0.9"] = float(confident.sum() / mask.sum())
    return out


if __name__ == "__main__":   # python tests/math/test_objectives_2026.py: the numbers quoted in docs/theory.md §14
    rows = [stale_sampler_masks(seed=s) for s in SEEDS]
    print(f"{'seed':28s} " + " ".join(f"{s:>9d}" for s in SEEDS))
    for key in rows[0]:
        print(f"{key:28s} " + " ".join(f"{r[key]:9.4g}" for r in rows))
