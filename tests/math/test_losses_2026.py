"""The 2026 policy losses (dppo, dro, vespo, luspo) and the one-sided CISPO clip: parity with a plain-torch
transcription of each reference's math (value and gradient, random batches), hand edge cases, selection by name
(YAML config, covrl.api's loss_fn, the Tinker facade), and the docs/theory.md §14 statements by exact enumeration
over every response of a tiny model.

References transcribed below (each function names its file):
- prime-rl, PrimeIntellect-ai/prime-rl @ 559b44772e471d1538537b8805cc77f3824a5e64,
  src/prime_rl/trainer/rl/loss.py `default_loss_fn` (DPPO-Binary-TV + squared log-ratio; defaults from
  packages/prime-rl-configs/src/prime_rl/configs/trainer.py `DefaultLossConfig`).
- verl, verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py
  `compute_policy_loss_dppo_tv`, `compute_policy_loss_dppo_kl`, `compute_policy_loss_dro` (docs/algo/dro.md).
- SkyRL, NovaSky-AI/SkyRL @ a9564572eb8e91076be43c1bd5e4615e3de17265,
  skyrl/backends/skyrl_train/utils/ppo_utils.py `dppo_policy_loss`, `reduce_loss`.
- TRL, huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py
  `get_gamma_weights` and `_compute_loss` (loss_type "vespo"; "luspo" with importance_sampling_level "sequence").
- tinker-cookbook, thinking-machines-lab/tinker-cookbook @ 9dfcc3a2cf44432d621a01005073dc6d76a1e87a
  (recommendation added in eb2dc4eedc50a459e6f476290a1ac8bcf2a267dd), tutorials/202_loss_functions.py: CISPO's
  one-sided default `clip(ratio, 0.0, 4.0)`.

`python tests/math/test_losses_2026.py` prints the enumeration table quoted in docs/theory.md §14.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from covrl.api import API_LOSSES, MATH_LOSSES, TINKER_LOSSES, get_loss
from covrl.api.losses import LossInputs
from covrl.config import ConfigError, load_preset
from covrl.math import LOSS_SPECS, aggregate, policy_loss
from covrl.models import tiny_llama

torch.set_num_threads(1)

NEW = ["dppo", "dro", "vespo", "luspo"]
SEEDS = (0, 1, 2)
SHAPES = ((9, 7), (16, 12), (5, 1))   # B, T: includes a one-token width


def _batch(seed: int, B: int, T: int, noise: float = 0.5, outcome: bool = True):
    """Random rows of lengths 0..T (row 0 full, row 1 empty when B > 2), sampler log-probs q < 0, trainer
    log-probs p = q + noise·N(0, 1) as a leaf (clamped below 0), advantages per row (outcome) or per token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    if B > 2:
        lengths[1] = 0
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    q = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64).clamp(0.02, 0.98)).float()
    p = (q + noise * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone() if outcome else torch.randn(B, T, generator=g)
    return p.requires_grad_(True), q, adv, mask


def _grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got.detach(), want.detach(), atol=tol, rtol=tol)


# ------------------------------------------------------------------------------- reference transcriptions

def prime_rl_default_loss(trainer_lp, inference_lp, advantages, loss_mask, *, dppo_mask_low=0.2,
                          dppo_mask_high=0.2, adv_tau=1.0, kl_tau=1e-3):
    """prime-rl `default_loss_fn` per sample (one row), summed, normalised by the global token count (prime-rl's
    rl_scale in `compute_loss`)."""
    total = trainer_lp.sum() * 0.0
    for b in range(trainer_lp.shape[0]):
        lm = loss_mask[b].bool()
        log_ratio = trainer_lp[b] - inference_lp[b]
        ratio = torch.exp(log_ratio)
        probs_diff = torch.exp(trainer_lp[b]) - torch.exp(inference_lp[b])
        invalid_high = probs_diff > dppo_mask_high
        invalid_low = probs_diff < -dppo_mask_low
        is_masked = torch.where(advantages[b] > 0, invalid_high, invalid_low)
        keep = lm & ~is_masked
        pg = keep * (adv_tau * advantages[b]) * ratio
        kl = lm * log_ratio ** 2
        total = total + (-pg + kl_tau * kl).sum()
    return total / loss_mask.sum()


def verl_dppo(old_lp, lp, adv, mask, *, kind, clip_low, clip_high, clip_ratio_c=20.0, rollout_is_weights=None):
    """verl `compute_policy_loss_dppo_tv` / `_kl` with loss_agg_mode token-mean (returns the loss and the
    token-level valid mask)."""
    neg_kl = torch.clamp(lp - old_lp, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(lp), torch.exp(old_lp)
    if kind == "tv":
        valid_pos = (prob - old_prob) <= clip_high
        valid_neg = (prob - old_prob) >= -clip_low
    else:
        binary_kl = old_prob * (old_lp - lp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_pos = (binary_kl <= clip_high) | (prob <= old_prob)
        valid_neg = (binary_kl <= clip_low) | (prob >= old_prob)
    valid = torch.where(adv > 0, valid_pos, valid_neg).detach().float()
    pg = -adv * truncated * lp * valid
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    return (pg * mask).sum() / mask.sum(), valid


def skyrl_dppo(lp, mu_lp, adv, loss_mask, *, dppo_type, delta_low, delta_high):
    """SkyRL `dppo_policy_loss` (rollout log-probs as μ) with token-mean reduction (SkyRL sums the loss after
    scaling the advantages by 1 / token count, `apply_loss_reduction_to_advantages_minibatch`)."""
    ratio = torch.clamp((lp - mu_lp).float(), -20.0, 20.0).exp()
    with torch.no_grad():
        cur, mu = torch.exp(lp), torch.exp(mu_lp)
        diff = cur - mu
        m = torch.ones_like(adv)
        if dppo_type == "binary_tv":
            m[(adv > 0) & (diff > delta_high)] = 0.0
            m[(adv < 0) & (-diff > delta_low)] = 0.0
        else:
            bkl = mu * (mu_lp - lp) + (1 - mu) * torch.log((1 - mu + 1e-8) / (1 - cur + 1e-8))
            m[(adv > 0) & (diff > 0) & (bkl > delta_high)] = 0.0
            m[(adv < 0) & (diff < 0) & (bkl > delta_low)] = 0.0
    loss = -(ratio * adv * m)
    return (loss * loss_mask).sum() / loss_mask.sum()


def verl_dro(old_lp, lp, adv, mask, *, beta, rollout_is_weights=None):
    """verl `compute_policy_loss_dro`, loss_agg_mode token-mean."""
    log_ratio = lp - old_lp
    pg = -(lp * adv - 0.5 * beta * log_ratio.square())
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    return (pg * mask).sum() / mask.sum()


def trl_vespo(per_token_logps, old_per_token_logps, advantages, mask, *, k_pos=2.0, lambda_pos=3.0, k_neg=3.0,
              lambda_neg=2.0):
    """TRL `get_gamma_weights` + the vespo branch of `_compute_loss` (no vLLM IS ratio), normalised by
    num_items_in_batch = the batch's token count on one process."""
    with torch.no_grad():
        lower = math.log(1e-8)
        lr = torch.clamp(per_token_logps - old_per_token_logps, -20.0, 20.0)
        seq = torch.sum(lr * mask, dim=-1, keepdim=True)
        log_w = torch.clamp(seq, lower, 20.0)
        w = torch.exp(log_w)
        nonneg = advantages >= 0
        k = torch.where(nonneg, k_pos, k_neg)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    per_token_loss = -phi * advantages * per_token_logps
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def trl_luspo(per_token_logps, old_per_token_logps, advantages, mask, *, epsilon_low, epsilon_high):
    """TRL `_compute_loss` with loss_type "luspo", importance_sampling_level "sequence", advantages [B, 1]."""
    log_ratio = per_token_logps - old_per_token_logps
    log_iw = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_iw)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return (per_token_loss * mask.sum(1, keepdim=True)).mean()


def tinker_cookbook_cispo(lp, q, adv, w, *, clip_low_threshold=0.0, clip_high_threshold=4.0):
    """Tinker's `cispo` (tinker-cookbook tutorials/202_loss_functions.py): −Σ sg(clip(ρ, low, high))·log p·A, with
    the one-sided default thresholds."""
    clipped = torch.clamp(torch.exp(lp - q), clip_low_threshold, clip_high_threshold)
    return -(clipped.detach() * lp * adv * w).sum()


# ---------------------------------------------------------------------------------------------- parity

CASES = [(seed, shape) for seed in SEEDS for shape in SHAPES]


@pytest.mark.parametrize("seed, shape", CASES)
def test_dppo_equals_prime_rl_default_loss(seed, shape):
    lp, q, adv, mask = _batch(seed, *shape, noise=0.6, outcome=seed % 2 == 0)
    got = policy_loss("dppo", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask, kl_coef=1e-3)
    want = prime_rl_default_loss(lp, q, adv, mask)
    _close(got.loss, want)
    _close(_grad(got.loss, lp), _grad(want, lp))


@pytest.mark.parametrize("seed, shape", CASES)
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_equals_skyrl(seed, shape, kind):
    lp, q, adv, mask = _batch(seed, *shape, noise=0.6, outcome=seed % 2 == 1)
    delta = {"tv": 0.15, "kl": 0.05}[kind]
    got = policy_loss("dppo", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask, divergence=kind,
                      delta_low=delta, delta_high=delta * 1.5)
    want = skyrl_dppo(lp, q, adv, mask, dppo_type=f"binary_{kind}", delta_low=delta, delta_high=delta * 1.5)
    _close(got.loss, want)
    _close(_grad(got.loss, lp), _grad(want, lp))


@pytest.mark.parametrize("seed, shape", CASES)
@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("cap", [20.0, 1.3])
def test_dppo_gradient_equals_verl(seed, shape, kind, cap):
    """verl's token loss is −A·sg(min(ρ, C))·log p·valid: another value (REINFORCE form), the same gradient and
    the same mask; the rollout-correction weights multiply it in both."""
    lp, q, adv, mask = _batch(seed, *shape, noise=0.6)
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) + 0.5
    got = policy_loss("dppo", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask, is_weights=w,
                      divergence=kind, delta_low=0.1, delta_high=0.2, is_cap=cap)
    want, valid = verl_dppo(q, lp, adv, mask, kind=kind, clip_low=0.1, clip_high=0.2, clip_ratio_c=cap,
                            rollout_is_weights=w)
    _close(_grad(got.loss, lp), _grad(want, lp))
    # verl counts 1 − valid over every token (A = 0 ones by the low side); covrl counts tokens with A ≠ 0 only
    nonzero = mask * (adv != 0).float()
    assert got.metrics["loss/clip_frac"] == pytest.approx(float(((1 - valid) * nonzero).sum() / mask.sum()),
                                                          abs=1e-6)


@pytest.mark.parametrize("seed, shape", CASES)
def test_dro_equals_verl_with_and_without_correction_weights(seed, shape):
    lp, q, adv, mask = _batch(seed, *shape, outcome=seed % 2 == 0)
    for w in (None, torch.rand(mask.shape, generator=torch.Generator().manual_seed(7)) + 0.5):
        got = policy_loss("dro", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask, is_weights=w, beta=0.3)
        want = verl_dro(q, lp, adv, mask, beta=0.3, rollout_is_weights=w)
        _close(got.loss, want)
        _close(_grad(got.loss, lp), _grad(want, lp))
    assert LOSS_SPECS["dro"].takes_is_weights   # its A·log p term has no ratio: the pairing rule passes them


@pytest.mark.parametrize("seed, shape", CASES)
@pytest.mark.parametrize("outcome", [True, False], ids=["outcome_adv", "token_adv"])
def test_vespo_equals_trl(seed, shape, outcome):
    lp, q, adv, mask = _batch(seed, *shape, noise=0.3, outcome=outcome)
    opts = {} if seed == 0 else {"k_pos": 1.5, "lambda_pos": 2.0, "k_neg": 2.5, "lambda_neg": 1.0}
    got = policy_loss("vespo", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask, **opts)
    want = trl_vespo(lp, q, adv if not outcome else adv[:, :1], mask, **opts)
    _close(got.loss, want)
    _close(_grad(got.loss, lp), _grad(want, lp))


@pytest.mark.parametrize("seed, shape", CASES)
def test_luspo_with_seq_mean_token_sum_equals_trl(seed, shape):
    lp, q, adv, mask = _batch(seed, *shape, noise=0.02)   # sequence ratios around the paper's 2e-3 clip
    got = policy_loss("luspo", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask,
                      agg_mode="seq-mean-token-sum")
    want = trl_luspo(lp, q, adv[:, :1], mask, epsilon_low=2e-3, epsilon_high=2.5e-3)
    _close(got.loss, want)
    _close(_grad(got.loss, lp), _grad(want, lp))


def test_luspo_aggregations_token_mean_is_a_constant_multiple_and_seq_mean_token_mean_is_gspo():
    lp, q, adv, mask = _batch(4, 9, 7, noise=0.02)
    kw = dict(logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask)
    trl = policy_loss("luspo", agg_mode="seq-mean-token-sum", **kw)
    tok = policy_loss("luspo", agg_mode="token-mean", **kw)
    _close(tok.loss, trl.loss * mask.shape[0] / mask.sum())
    gspo = policy_loss("gspo", agg_mode="seq-mean-token-mean", clip_low=2e-3, clip_high=2.5e-3, **kw)
    _close(policy_loss("luspo", agg_mode="seq-mean-token-mean", **kw).loss, gspo.loss)


@pytest.mark.parametrize("seed, shape", CASES)
def test_one_sided_cispo_equals_tinker_cookbook(seed, shape):
    """covrl's `cispo` with clip_low=None (its default: one-sided) and clip_high=3 is Tinker's default
    clip(ρ, 0, 4); the Tinker facade's `tinker_cispo` defaults to it, summed over the scored positions."""
    lp, q, adv, mask = _batch(seed, *shape, noise=1.0)
    got = policy_loss("cispo", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask, clip_high=3.0,
                      agg_mode="seq-mean-token-sum")
    want = tinker_cookbook_cispo(lp, q, adv, mask) / mask.shape[0]
    _close(got.loss, want)
    _close(_grad(got.loss, lp), _grad(want, lp))
    spec = TINKER_LOSSES["tinker_cispo"]
    x = LossInputs(logprobs=lp, sampler_logprobs=q, advantages=adv, sampled=mask, weights=mask, keep=mask,
                   is_weights=None)
    out = spec.fn(x, spec.check_options({}))
    _close(out.loss, tinker_cookbook_cispo(lp, q, adv, mask))


def test_tinker_dro_is_covrl_dro_summed():
    lp, q, adv, mask = _batch(3, 9, 7)
    spec = TINKER_LOSSES["tinker_dro"]
    x = LossInputs(logprobs=lp, sampler_logprobs=q, advantages=adv, sampled=mask, weights=mask, keep=mask,
                   is_weights=None)
    out = spec.fn(x, spec.check_options({"beta": 0.4}))
    want = -((lp * adv - 0.2 * (lp - q) ** 2) * mask).sum()   # Tinker's documented formula, β/2 = 0.2
    _close(out.loss, want)
    _close(_grad(out.loss, lp), _grad(want, lp))
    math_dro = policy_loss("dro", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask, beta=0.4,
                           agg_mode="seq-mean-token-sum")
    _close(math_dro.loss * mask.shape[0], want)


# ------------------------------------------------------------------------------------------ hand cases

def test_dppo_hand_case_masks_only_the_pushed_direction():
    # p = [0.9, 0.9, 0.3, 0.3], q = [0.6, 0.6, 0.6, 0.6]: |p − q| = 0.3 > 0.2 on every token
    lp = torch.log(torch.tensor([[0.9, 0.9, 0.3, 0.3]])).requires_grad_(True)
    q = torch.log(torch.full((1, 4), 0.6))
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    out = policy_loss("dppo", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=torch.ones(1, 4),
                      agg_mode="seq-mean-token-sum")
    # token 0: risen with A > 0 -> masked; 1: risen, A < 0 -> kept; 2: fallen, A < 0 -> masked; 3: fallen, A > 0
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5])
    keep = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert out.loss.item() == pytest.approx(float(-(adv[0] * ratio * keep).sum()), rel=1e-6)
    _close(_grad(out.loss, lp), (-(adv * ratio * keep)))
    assert out.metrics["loss/clip_frac_high"] == 0.25 and out.metrics["loss/clip_frac_low"] == 0.25
    # binary KL of (0.6 -> 0.9) = 0.6·log(0.6/0.9) + 0.4·log(0.4/0.1) ≈ 0.3112 > 0.2 and of (0.6 -> 0.3) ≈ 0.1920
    out = policy_loss("dppo", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=torch.ones(1, 4),
                      divergence="kl", delta_low=0.2, delta_high=0.2)
    assert out.metrics["loss/clip_frac_high"] == 0.25 and out.metrics["loss/clip_frac_low"] == 0.0


def test_dppo_low_probability_token_with_a_huge_ratio_is_not_masked_by_tv():
    # p = 1e-3, q = 1e-5: ρ = 100, |p − q| ≈ 1e-3 < 0.2 -> kept, gradient −A·ρ (or −A·is_cap)
    lp = torch.log(torch.tensor([[1e-3]])).requires_grad_(True)
    q = torch.log(torch.tensor([[1e-5]]))
    kw = dict(logprobs=lp, sampler_logprobs=q, advantages=torch.ones(1, 1), mask=torch.ones(1, 1))
    out = policy_loss("dppo", **kw)
    assert out.metrics["loss/clip_frac"] == 0.0
    _close(_grad(out.loss, lp), torch.tensor([[-100.0]]), tol=1e-3)
    out = policy_loss("dppo", is_cap=5.0, **kw)
    _close(_grad(out.loss, lp), torch.tensor([[-5.0]]))
    assert out.metrics["loss/dual_clip_frac"] == 1.0
    assert policy_loss("ppo_clip", **kw).metrics["loss/clip_frac_high"] == 1.0   # the ratio clip would cut it


def test_dro_hand_case():
    # log p = −1, log q = −1.5, A = 2, β = 0.5: ℓ = −(2·(−1) − 0.25·0.25) = 2.0625; dℓ/dlog p = −(2 − 0.5·0.5)
    lp = torch.tensor([[-1.0]], requires_grad=True)
    out = policy_loss("dro", logprobs=lp, sampler_logprobs=torch.tensor([[-1.5]]), advantages=torch.tensor([[2.0]]),
                      mask=torch.ones(1, 1), beta=0.5)
    assert out.loss.item() == pytest.approx(2.0625)
    _close(_grad(out.loss, lp), torch.tensor([[-1.75]]))
    assert out.metrics["loss/k2"] == pytest.approx(0.125)


def test_vespo_hand_case_gamma_weight():
    # one row, log-ratios 0.1 and 0.2: W = e^0.3; A = 1 -> φ = W²·e^{3(1 − W)}; A = −1 -> φ = W³·e^{2(1 − W)}
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    q = torch.tensor([[-1.1, -2.2]])
    W = math.exp(0.3)
    for a, phi in ((1.0, W ** 2 * math.exp(3 * (1 - W))), (-1.0, W ** 3 * math.exp(2 * (1 - W)))):
        out = policy_loss("vespo", logprobs=lp, sampler_logprobs=q, advantages=torch.full((1, 2), a),
                          mask=torch.ones(1, 2), agg_mode="seq-mean-token-sum")
        assert out.loss.item() == pytest.approx(-phi * a * (-3.0), rel=1e-6)
        _close(_grad(out.loss, lp), torch.full((1, 2), -phi * a))
        assert out.metrics["loss/vespo_phi_mean"] == pytest.approx(phi, rel=1e-6)
        assert out.metrics["loss/seq_log_ratio_mean"] == pytest.approx(0.3, rel=1e-6)


def test_luspo_hand_case_length_weighting():
    # rows of 1 and 3 tokens, on-policy (s = 1, inside the clip), A = [1, 1]: seq-mean-token-sum gives
    # (1/2)(1·(−1) + 3·(−1)) = −2 and the gradient −1/2 on every token (GSPO's would be −1/2·1/|y_b|)
    lp = torch.tensor([[-1.0, 0.0, 0.0], [-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    out = policy_loss("luspo", logprobs=lp, sampler_logprobs=lp.detach(), advantages=torch.ones(2, 3), mask=mask,
                      agg_mode="seq-mean-token-sum")
    assert out.loss.item() == pytest.approx(-2.0)
    _close(_grad(out.loss, lp), -0.5 * mask)
    # sequence ratios past the clip: s = exp(0.01) > 1 + 2.5e-3 in both rows with A > 0 -> all 4 tokens counted
    out = policy_loss("luspo", logprobs=lp, sampler_logprobs=lp.detach() - 0.01 * mask, advantages=torch.ones(2, 3),
                      mask=mask)
    assert out.metrics["loss/clip_frac_high"] == 1.0 and out.metrics["loss/seq_ratio_max"] == pytest.approx(
        math.exp(0.01), rel=1e-6)


def test_cispo_clip_metrics_count_the_capped_weights_of_either_sign():
    lp = torch.tensor([[-1.0, -1.0, -3.0]], requires_grad=True)
    q = torch.tensor([[-1.5, -1.5, -1.0]])      # ρ = e^0.5, e^0.5, e^−2
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    one_sided = policy_loss("cispo", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=torch.ones(1, 3))
    assert one_sided.metrics["loss/clip_frac_high"] == pytest.approx(2 / 3)   # A < 0 weight capped too
    assert one_sided.metrics["loss/clip_frac_low"] == 0.0 and one_sided.metrics["loss/dual_clip_frac"] == 0.0
    two_sided = policy_loss("cispo", logprobs=lp, sampler_logprobs=q, advantages=adv, mask=torch.ones(1, 3),
                            clip_low=0.2)
    assert two_sided.metrics["loss/clip_frac_low"] == pytest.approx(1 / 3)
    # the one-sided clip leaves the small weight e^−2 on the token the trainer moved away from
    (g,) = torch.autograd.grad(one_sided.loss, lp)
    _close(g[0, 2], torch.tensor(math.exp(-2.0) / 3))


@pytest.mark.parametrize("name", NEW + ["cispo"])
def test_all_masked_and_single_token(name):
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = policy_loss(name, logprobs=lp, sampler_logprobs=torch.tensor([[-1.5, float("-inf")]]),
                      advantages=torch.ones(1, 2), mask=torch.zeros(1, 2))
    assert out.loss.item() == 0.0 and torch.all(_grad(out.loss, lp) == 0)
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics
    # one valid token followed by padding whose sampler log-prob is −inf
    out = policy_loss(name, logprobs=lp, sampler_logprobs=torch.tensor([[-1.0, float("-inf")]]),
                      advantages=torch.ones(1, 2), mask=torch.tensor([[1.0, 0.0]]))
    g = _grad(out.loss, lp)
    assert torch.isfinite(out.loss) and torch.all(torch.isfinite(g)) and g[0, 1] == 0
    _close(g[0, 0], torch.tensor(-1.0))   # on-policy: −A·∇log p
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics


@pytest.mark.parametrize("name", NEW + ["cispo"])
@pytest.mark.parametrize("shift", [-40.0, 40.0])
def test_extreme_ratios_stay_finite(name, shift):
    lp = torch.tensor([[-30.0, -1e-4, -5.0]], requires_grad=True)
    q = torch.tensor([[-30.0 + shift, -1e-4 + shift, -5.0]]).clamp(max=0.0)
    for adv in (torch.tensor([[1.0, -1.0, 2.0]]), -torch.tensor([[1.0, -1.0, 2.0]])):
        out = policy_loss(name, logprobs=lp, sampler_logprobs=q, advantages=adv, mask=torch.ones(1, 3))
        g = _grad(out.loss, lp)
        assert torch.isfinite(out.loss) and torch.all(torch.isfinite(g)), (name, out.loss, g)
        assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics


def test_vespo_weight_vanishes_for_a_huge_sequence_ratio_and_equals_one_on_policy():
    lp = torch.tensor([[-0.1, -0.1]], requires_grad=True)
    out = policy_loss("vespo", logprobs=lp, sampler_logprobs=torch.tensor([[-30.0, -30.0]]),
                      advantages=torch.ones(1, 2), mask=torch.ones(1, 2))
    assert out.metrics["loss/vespo_phi_mean"] == 0.0 and torch.all(_grad(out.loss, lp) == 0)
    out = policy_loss("vespo", logprobs=lp, sampler_logprobs=lp.detach(), advantages=-torch.ones(1, 2),
                      mask=torch.ones(1, 2))
    assert out.metrics["loss/vespo_phi_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("name, bad, field", [
    ("dppo", {"delta_low": -0.1}, "delta_low"), ("dppo", {"is_cap": 0.0}, "is_cap"),
    ("dppo", {"kl_coef": -1.0}, "kl_coef"), ("dppo", {"divergence": "js"}, "divergence"),
    ("dro", {"beta": 0.0}, "beta"), ("vespo", {"lambda_neg": -1.0}, "lambda_neg"),
    ("luspo", {"clip_low": 1.0}, "clip_low")])
def test_invalid_option_values_raise_naming_the_option(name, bad, field):
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=field if field != "divergence" else "dppo divergence 'js'"):
        policy_loss(name, logprobs=lp, sampler_logprobs=lp, advantages=lp, mask=torch.ones(1, 2), **bad)


def test_pairing_rule_and_flags():
    for name in ("dppo", "vespo", "luspo"):
        assert LOSS_SPECS[name].ratio_vs_sampler and not LOSS_SPECS[name].takes_is_weights
    assert not LOSS_SPECS["dro"].ratio_vs_sampler
    # none of them bounds the token ratio at 1 ∓ clip_*: their clip counts come from their own metrics
    assert not any(LOSS_SPECS[n].token_clip for n in NEW) and LOSS_SPECS["cispo"].token_clip
    assert all(LOSS_SPECS[n].metrics is not None for n in NEW)


# --------------------------------------------------------------------------- selection by name

@pytest.mark.parametrize("name, options", [
    ("dppo", {"divergence": "kl", "delta_low": 0.05, "delta_high": 0.1, "is_cap": 20, "kl_coef": 1e-3}),
    ("dro", {"beta": 0.1}), ("vespo", {"k_pos": 1, "lambda_pos": 0}), ("luspo", {"clip_high": 3e-3}),
    ("cispo", {"clip_low": None, "clip_high": 3.0})])
def test_selectable_from_yaml(name, options):
    from covrl.train.step.algorithm import bind_algorithm

    cfg = load_preset("tiny", {"algorithm.loss": name, "algorithm.loss_options": options,
                               "algorithm.agg_mode": "seq-mean-token-sum"})
    alg = bind_algorithm(cfg)
    assert alg.loss.name == name and alg.loss_takes_is_weights == LOSS_SPECS[name].takes_is_weights
    assert dict(alg.loss_options) == {k: (float(v) if isinstance(v, int) else v) for k, v in options.items()}


@pytest.mark.parametrize("name, options, pattern", [
    ("dppo", {"delta": 0.2}, r"algorithm\.loss_options\.delta is not an option of dppo; allowed: delta_high"),
    ("dppo", {"divergence": "js"}, r"algorithm\.loss_options\.divergence: Input should be 'tv' or 'kl'"),
    ("dro", {"beta": True}, r"algorithm\.loss_options\.beta: .*boolean"),
    ("vespo", {"k": 2}, r"algorithm\.loss_options\.k is not an option of vespo; allowed: k_neg"),
    ("luspo", {"clip_low": "x"}, r"algorithm\.loss_options\.clip_low: Input should be a valid number")])
def test_bad_yaml_options_are_refused_naming_them(name, options, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_preset("tiny", {"algorithm.loss": name, "algorithm.loss_options": options})


@pytest.mark.parametrize("name", NEW)
def test_selectable_through_covrl_api(name):
    loss = get_loss(name)
    assert loss is MATH_LOSSES[name] and loss.family == "covrl.math" and API_LOSSES[name] is loss
    assert loss.requires == {"advantages", "sampler_logprobs"}
    lp, q, adv, mask = _batch(5, 9, 7)
    x = LossInputs(logprobs=lp, sampler_logprobs=q, advantages=adv, sampled=mask, weights=mask, keep=mask,
                   is_weights=None)
    out = loss.fn(x, loss.check_options({}))
    want = policy_loss(name, logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask)
    assert torch.equal(aggregate(out.token_loss, mask), want.loss)
    with pytest.raises(TypeError, match="unknown options"):
        loss.check_options({"nope": 1})


def test_tinker_facade_names_map_to_tinkers_meaning():
    from covrl.api.tinker import _loss_name

    assert _loss_name("dro") == "tinker_dro" and _loss_name("cispo") == "tinker_cispo"
    assert _loss_name("dppo") == "dppo"   # not a Tinker name: covrl's, by the registry name
    assert TINKER_LOSSES["tinker_cispo"].options == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    with pytest.raises(TypeError, match="needs the option"):
        TINKER_LOSSES["tinker_dro"].check_options({})


# ------------------------------------------------- docs/theory.md §14 by enumeration on a tiny model

V, T_LEN = 5, 3


def _enumeration(sigma: float, seed: int = 0):
    """Every response of length 3 over a 5-token vocabulary after the prompt [1] (125 rows), a 1-layer tiny
    Llama (lm_head × 40) as the trainer p, the same model with noise N(0, (σ·std W)²) on its lm_head weights W as
    the sampler q, and the reward R(y) = #(y_t = 3) + 0.5·[y_1 = 4]. Returns (model, ids, targets, log q, R)."""
    model = tiny_llama(V, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=8,
                       seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)   # a peaked policy (the random init is near uniform)
    targets = torch.cartesian_prod(*[torch.arange(V)] * T_LEN)
    ids = torch.cat([torch.ones(len(targets), 1, dtype=torch.long), targets], 1)
    sampler = copy.deepcopy(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 100)
        head = sampler.lm_head.weight
        head.add_(sigma * head.std() * torch.randn(head.shape, generator=g))
        lq = _token_logprobs(sampler, ids, targets)
    R = (targets == 3).sum(1).float() + 0.5 * (targets[:, 0] == 4).float()
    return model, ids, targets, lq, R


def _token_logprobs(model, ids, targets):
    logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]


def _flat_grad(value, model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, params)])


def expected_updates(sigma: float, losses: dict[str, tuple[str, dict]], seed: int = 0) -> dict:
    """Exact expectations under the sampler over all 125 responses: ∇J(p), the tangent gradient
    E_q[(R − r̄)∇log p] and each loss's expected update −∇E_q[Σ_t ℓ_t] (A = R − r̄, r̄ = E_q R, every row full
    so Σ_t is `seq-mean-token-sum` per row), plus token statistics weighted by q."""
    model, ids, targets, lq, R = _enumeration(sigma, seed)
    q_seq = torch.exp(lq.sum(1).double()).float()
    lp = _token_logprobs(model, ids, targets)
    grad_j = _flat_grad((torch.exp(lp.sum(1)) * R).sum(), model)
    adv = (R - (q_seq * R).sum())[:, None].expand_as(lp)
    mask = torch.ones_like(lp)
    out = {"q_total": float(q_seq.sum()), "grad_j": grad_j, "max_abs_log_w": float((lp.detach() - lq).sum(1).abs().max())}
    lp = _token_logprobs(model, ids, targets)
    out["tangent"] = _flat_grad((q_seq * adv[:, 0] * lp.sum(1)).sum(), model)
    lp = _token_logprobs(model, ids, targets)
    out["toward_q"] = _flat_grad((q_seq * lp.sum(1)).sum(), model)   # −∇KL_seq(q‖p): the pull towards q
    for label, (name, opts) in losses.items():
        lp = _token_logprobs(model, ids, targets)
        token_loss = LOSS_SPECS[name].fn(logprobs=lp, sampler_logprobs=lq, advantages=adv, mask=mask,
                                         is_weights=None, **opts)
        out[label] = -_flat_grad((q_seq[:, None] * token_loss).sum(), model)
    with torch.no_grad():
        lp = _token_logprobs(model, ids, targets)
        w = q_seq[:, None].expand_as(lp) / T_LEN     # q-mass of each token slot (rows sum to 1/T each)
        ratio, p, q = torch.exp(lp - lq), torch.exp(lp), torch.exp(lq)
        tv = (p - q).abs() > 0.2
        clip = (ratio < 0.8) | (ratio > 1.28)
        k3 = ratio - 1 - (lp - lq)
        out["stats"] = {"k3": float((w * k3).sum()), "tv_frac": float((w * tv).sum()),
                        "clip_frac": float((w * clip).sum()),
                        "q_tv": float((w * tv * q).sum() / (w * tv).sum().clamp_min(1e-30)),
                        "q_clip": float((w * clip * q).sum() / (w * clip).sum().clamp_min(1e-30)),
                        "k3_tv": float((w * tv * k3).sum() / (w * tv).sum().clamp_min(1e-30)),
                        "k3_clip": float((w * clip * k3).sum() / (w * clip).sum().clamp_min(1e-30))}
    return out


THEORY_LOSSES = {
    "dppo": ("dppo", {}), "dppo_tv_0.05": ("dppo", {"delta_low": 0.05, "delta_high": 0.05}),
    "dppo_kl": ("dppo", {"divergence": "kl"}), "dro": ("dro", {}),
    "vespo": ("vespo", {}), "luspo": ("luspo", {}), "luspo_0.2": ("luspo", {"clip_low": 0.2, "clip_high": 0.2}),
    "cispo_one_sided": ("cispo", {"clip_high": 3.0}), "cispo_two_sided": ("cispo", {"clip_low": 0.2, "clip_high": 0.28}),
    "seq_is": ("vespo", {"k_pos": 1.0, "lambda_pos": 0.0, "k_neg": 1.0, "lambda_neg": 0.0}),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_on_policy_every_new_loss_has_the_expected_update_grad_j():
    """At p = q (σ = 0): −∇E_q[Σ_t ℓ_t] = ∇J exactly for each loss (§14: the covariance of §4)."""
    out = expected_updates(0.0, THEORY_LOSSES)
    assert out["q_total"] == pytest.approx(1.0, abs=1e-5)
    for label in THEORY_LOSSES:
        assert _rel(out[label], out["grad_j"]) < 1e-4, label


def test_sequence_is_special_case_of_vespo_is_unbiased_off_policy():
    """k = 1, λ = 0 makes φ(W) = W: E_q[W·A·∇log p(y)] = ∇J for any sampler; the other losses are biased there."""
    out = expected_updates(0.5, THEORY_LOSSES)
    assert out["max_abs_log_w"] < 18   # inside VESPO's clamp of log W, so φ(W) = W exactly
    assert _rel(out["seq_is"], out["grad_j"]) < 1e-4
    assert _rel(out["tangent"], out["grad_j"]) > 1e-2          # the sampler really differs
    for label in ("dppo", "dro", "vespo", "cispo_one_sided"):
        assert _rel(out[label], out["grad_j"]) > 1e-3, label


def test_binary_divergences_lower_bound_the_token_divergences():
    """§14: DPPO's binary TV / KL of the sampled token never exceed the TV / KL(q‖p) of the whole next-token
    distribution (coarse-graining to {y, not y}), so a bound on them bounds neither."""
    g = torch.Generator().manual_seed(0)
    z_p, z_q = torch.randn(200, 7, generator=g, dtype=torch.float64) * 2, torch.randn(200, 7, generator=g,
                                                                                      dtype=torch.float64) * 2
    p, q = torch.softmax(z_p, -1), torch.softmax(z_q, -1)
    tv = 0.5 * (p - q).abs().sum(-1, keepdim=True)
    kl = (q * (q.log() - p.log())).sum(-1, keepdim=True)
    binary_kl = q * (q.log() - p.log()) + (1 - q) * ((1 - q).log() - (1 - p).log())
    assert torch.all((p - q).abs() <= tv + 1e-12) and torch.all(binary_kl <= kl + 1e-12)
    assert float(((p - q).abs() / tv).max()) > 0.9 and float(((p - q).abs() / tv).median()) < 0.5   # tight / loose


def main() -> None:
    """The §14 table: for each sampler perturbation σ, each loss's expected update g against ∇J (cosine and the
    projection ⟨g, ∇J⟩/‖∇J‖²), against the tangent gradient, the cosine of its bias g − ∇J with the pull towards
    the sampler −∇KL_seq(q‖p), and where DPPO's TV mask and PPO's ratio clip fall."""
    for sigma in (0.1, 0.3, 1.0):
        out = expected_updates(sigma, THEORY_LOSSES)
        gj, tg, tq = out["grad_j"], out["tangent"], out["toward_q"]
        s = out["stats"]
        print(f"sigma={sigma}: q-mean token k3 {s['k3']:.4f}; q-mass of tokens |p-q|>0.2: {s['tv_frac']:.4f} "
              f"(mean q {s['q_tv']:.3f}, mean k3 {s['k3_tv']:.3f}); ratio outside [0.8, 1.28]: {s['clip_frac']:.4f} "
              f"(mean q {s['q_clip']:.3f}, mean k3 {s['k3_clip']:.3f})")
        print(f"  {'update':16s} {'cos(g,gradJ)':>12s} {'proj on gradJ':>13s} {'cos(g,tangent)':>14s} "
              f"{'cos(g-gradJ,toward q)':>21s}")
        for label in ["tangent", *THEORY_LOSSES]:
            g = out[label]
            cos_j = float(torch.dot(g, gj) / (g.norm() * gj.norm()))
            proj = float(torch.dot(g, gj) / gj.norm() ** 2)
            cos_t = float(torch.dot(g, tg) / (g.norm() * tg.norm()))
            bias = g - gj
            cos_q = float(torch.dot(bias, tq) / (bias.norm() * tq.norm())) if bias.norm() > 1e-6 * gj.norm() else 0.0
            print(f"  {label:16s} {cos_j:12.4f} {proj:13.4f} {cos_t:14.4f} {cos_q:21.4f}")


if __name__ == "__main__":
    main()
