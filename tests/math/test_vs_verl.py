"""covrl.math against verl's own code (verl.trainer.ppo.core_algos / rollout_corr_helper) on random inputs.

Runs when verl is importable: COVRL_VERL_SITE = the site-packages of a throwaway venv that holds verl and the few
packages its import needs (`scripts/setup_verl_site.sh` makes one; it is appended after covrl's own packages, so
verl's dependencies only fill gaps). Without it every test here is skipped.

Each case returns (label, covrl value, verl value) pairs that must agree to TOL. Where the two libraries follow
different documented conventions (docs/math.md, "Porting a verl config"), the case applies the documented
conversion to covrl's value and so asserts the difference itself, e.g. verl's `seq-mean-token-sum` equals covrl's
times B / (rows with a valid token). `python tests/math/test_vs_verl.py` prints the max |Δ| of every case over all
seeds and shapes (the table in docs/math.md).
"""

from __future__ import annotations

import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from covrl.math import (
    CorrectionConfig,
    aggregate,
    compute_advantages,
    kl_estimate,
    policy_loss,
    rollout_correction,
)

torch.set_num_threads(1)


def _verl():
    site = os.environ.get("COVRL_VERL_SITE")
    if site and site not in sys.path:
        sys.path.append(site)
    try:
        import verl
        from verl.trainer.ppo import core_algos, rollout_corr_helper
        from verl.workers.config import ActorConfig
    except ImportError:
        return None
    return SimpleNamespace(version=verl.__version__, core=core_algos, corr=rollout_corr_helper, ActorConfig=ActorConfig)


VERL = _verl()
pytestmark = pytest.mark.skipif(VERL is None, reason="verl is not importable (set COVRL_VERL_SITE, see "
                                                     "scripts/setup_verl_site.sh)")

SEEDS = (0, 1, 2)
SHAPES = ((9, 7), (16, 12), (5, 1))   # B, T: a singleton group, a one-token width
TOL = 1e-6                            # on max |Δ| / max(1, max |verl value|)


def batch(seed: int, B: int, T: int, noise: float = 0.5) -> SimpleNamespace:
    """Random rows of lengths 0..T (row 0 full, row 1 empty when B > 2), groups of 4 in shuffled order (the last
    one smaller, a singleton for B = 9), sampler log-probs q, trainer log-probs p = q + noise·N(0, 1)."""
    g = torch.Generator().manual_seed(1000 * seed + 10 * B + T)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    if B > 2:
        lengths[1] = 0
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    group_ids = (torch.arange(B) // 4)[torch.randperm(B, generator=g)]
    q = -3.0 * torch.rand(B, T, generator=g)
    p = q + noise * torch.randn(B, T, generator=g)
    return SimpleNamespace(mask=mask, group_ids=group_ids, index=group_ids.numpy(), q=q, p=p,
                           token_rewards=torch.randn(B, T, generator=g) * mask,
                           outcome=torch.randint(0, 3, (B,), generator=g).float(),
                           token_adv=torch.randn(B, T, generator=g) * mask,
                           row_adv=torch.randn(B, 1, generator=g).expand(B, T) * mask,
                           loss_mat=torch.randn(B, T, generator=g))


def nonempty_rows(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(1) > 0).float().sum()


def actor_config(**kw):
    base = dict(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, clip_ratio=0.2)
    return VERL.ActorConfig(**{**base, **kw})


def grads(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss, x)[0]


# ------------------------------------------------------------------------------------------------ advantages

def case_grpo(b):
    """GRPO (std n−1, eps 1e-6, a group of one: mean 0, std 1) on per-token rewards and on outcome rewards."""
    # verl reads outcome rewards from the token rewards: the reward on each row's last valid token. An empty row
    # has no token, so its reward is 0 there, while covrl counts an empty row's outcome reward in its group
    # (docs/math.md): the outcome comparison gives empty rows reward 0 on both sides.
    outcome = b.outcome * (b.mask.sum(1) > 0)
    out = []
    for label, rewards, tok in (("token rewards", b.token_rewards, b.token_rewards),
                                ("outcome", outcome, _outcome_on_last_token(outcome, b.mask))):
        for name, by_std in (("grpo", True), ("dr_grpo", False)):
            ours = compute_advantages(name, rewards=rewards, mask=b.mask, group_ids=b.group_ids,
                                      **({"eps": 1e-6} if by_std else {})).advantages
            theirs, _ = VERL.core.compute_grpo_outcome_advantage(tok, b.mask, b.index, epsilon=1e-6,
                                                                 norm_adv_by_std_in_grpo=by_std)
            out.append((f"{name} ({label})", ours, theirs))
    return out


def _outcome_on_last_token(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    last = (mask.sum(1).long() - 1).clamp_min(0)
    tok = torch.zeros_like(mask)
    tok[torch.arange(len(rewards)), last] = rewards
    return tok * mask


def case_rloo(b):
    """RLOO: N/(N−1)·(R − mean_g). A group of one: covrl gives 0, verl leaves the raw score R."""
    ours = compute_advantages("rloo", rewards=b.token_rewards, mask=b.mask, group_ids=b.group_ids).advantages
    theirs, _ = VERL.core.compute_rloo_outcome_advantage(b.token_rewards, b.mask, b.index)
    sizes = torch.bincount(b.group_ids)[b.group_ids]
    score = b.token_rewards.sum(1, keepdim=True) * b.mask
    return [("rloo (verl = covrl + R on groups of one)", ours + (sizes[:, None] == 1) * score, theirs)]


def _whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten written out: (x − mean)/sqrt(var_unbiased + 1e-8) over the mask, then masked."""
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / n * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def case_reinforce_pp(b):
    """REINFORCE++ (γ = 1): verl's returns are covrl's `reinforce` returns G_t (= its advantages); verl's
    advantages whiten them over the batch, which covrl leaves out. REINFORCE++-baseline = whitened dr_grpo."""
    ours = compute_advantages("reinforce", rewards=b.token_rewards, mask=b.mask, group_ids=b.group_ids)
    adv, ret = VERL.core.compute_reinforce_plus_plus_outcome_advantage(b.token_rewards, b.mask,
                                                                       config=SimpleNamespace(gamma=1.0))
    dr = compute_advantages("dr_grpo", rewards=b.token_rewards, mask=b.mask, group_ids=b.group_ids).advantages
    base, _ = VERL.core.compute_reinforce_plus_plus_baseline_outcome_advantage(b.token_rewards, b.mask, b.index)
    return [("reinforce returns", ours.returns, ret), ("reinforce advantages = returns", ours.advantages, ret),
            ("reinforce++ = whitened covrl reinforce", _whiten(ours.advantages, b.mask), adv),
            ("reinforce++_baseline = whitened covrl dr_grpo", _whiten(dr, b.mask), base)]


# ------------------------------------------------------------------------------------------------ aggregation

# verl divides the sequence-sum modes by the rows that have a valid token, covrl by all B rows
_ROWS_FACTOR = {"token-mean": False, "seq-mean-token-mean": False, "seq-mean-token-sum": True,
                "seq-mean-token-sum-norm": True}


def case_agg_loss(b):
    out = []
    factor = b.mask.shape[0] / nonempty_rows(b.mask)
    for mode, by_rows in _ROWS_FACTOR.items():
        ours = aggregate(b.loss_mat, b.mask, mode) * (factor if by_rows else 1.0)
        out.append((f"agg {mode}", ours, VERL.core.agg_loss(b.loss_mat, b.mask, mode)))
    ours = aggregate(b.loss_mat, b.mask, "seq-mean-token-sum-norm", norm_constant=64.0) * factor
    theirs = VERL.core.agg_loss(b.loss_mat, b.mask, "seq-mean-token-sum-norm", loss_scale_factor=64)
    out.append(("agg seq-mean-token-sum-norm, N = 64", ours, theirs))
    return out


# --------------------------------------------------------------------------------------------- policy losses

def _loss_pair(b, ours_name, ours_options, verl_name, verl_config, adv, mode, *, factor=1.0):
    """(value, d value / d logprobs) of both losses on the same inputs."""
    lp = b.p.clone().requires_grad_(True)
    ours = policy_loss(ours_name, logprobs=lp, sampler_logprobs=b.q, advantages=adv, mask=b.mask, agg_mode=mode,
                       **ours_options).loss * factor
    lp2 = b.p.clone().requires_grad_(True)
    fn = VERL.core.get_policy_loss_fn(verl_name)
    theirs, _ = fn(old_log_prob=b.q, log_prob=lp2, advantages=adv, response_mask=b.mask, loss_agg_mode=mode,
                   config=verl_config)
    return [(f"{ours_name} {mode}", ours, theirs), (f"{ours_name} {mode} grad", grads(ours, lp), grads(theirs, lp2))]


def case_ppo_clip(b):
    """PPO clip with clip-higher and dual clip (verl `vanilla`, clip_ratio_c)."""
    cfg = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    opts = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    return [pair for mode in ("token-mean", "seq-mean-token-mean")
            for pair in _loss_pair(b, "ppo_clip", opts, "vanilla", cfg, b.token_adv, mode)]


def case_gspo(b):
    """verl's `gspo` is covrl's `gspo_token` (s_t = sg(s)·p_t/sg(p_t), per-token A); with a row-constant A it is
    also covrl's `gspo`."""
    cfg = actor_config(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    opts = {"clip_low": 3e-4, "clip_high": 4e-4}
    out = []
    for mode in ("token-mean", "seq-mean-token-mean"):
        out += _loss_pair(b, "gspo_token", opts, "gspo", cfg, b.token_adv, mode)
        out += _loss_pair(b, "gspo", opts, "gspo", cfg, b.row_adv, mode)
    return out


def case_cispo(b):
    """CISPO with both bounds set; covrl's default (no lower bound) is verl with clip_ratio_low = 1 (ratio ≥ 0)."""
    out = []
    for mode in ("token-mean", "seq-mean-token-mean"):
        out += _loss_pair(b, "cispo", {"clip_low": 0.2, "clip_high": 0.28}, "cispo",
                          actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28), b.token_adv, mode)
        out += [(f"{label} (no lower bound)", x, y) for label, x, y in
                _loss_pair(b, "cispo", {"clip_high": 0.28}, "cispo",
                           actor_config(clip_ratio_low=1.0, clip_ratio_high=0.28), b.token_adv, mode)]
    return out


def case_sapo(b):
    """SAPO (τ_pos 1.0, τ_neg 1.05); verl always aggregates seq-mean-token-mean."""
    return _loss_pair(b, "sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, "sapo", actor_config(tau_pos=1.0, tau_neg=1.05),
                      b.token_adv, "seq-mean-token-mean")


def case_gmpo(b):
    """GMPO (verl `geo_mean`): verl takes the mean over all B rows, covrl's seq-mean-token-mean over non-empty rows,
    so verl = covrl · (non-empty rows) / B."""
    factor = nonempty_rows(b.mask) / b.mask.shape[0]
    return _loss_pair(b, "gmpo", {"clip_low": 0.4, "clip_high": 0.4}, "geo_mean",
                      actor_config(clip_ratio_low=0.4, clip_ratio_high=0.4), b.row_adv, "seq-mean-token-mean",
                      factor=factor)


# ----------------------------------------------------------------------------------------------- KL estimators

_KL_NAMES = {"k1": "k1", "k2": "mse", "k3": "low_var_kl", "abs": "abs"}


def case_kl(b):
    """kl_estimate(sample, other, kind) = verl kl_penalty(logprob=sample, ref_logprob=other, name); straight-through
    = verl's "k3+" / "k1+". (verl clamps k3 at 10; the random log-ratios here stay below that.)"""
    out = []
    for kind, name in _KL_NAMES.items():
        out.append((f"kl {kind} = verl {name}", kl_estimate(b.p, b.q, kind), VERL.core.kl_penalty(b.p, b.q, name)))
    for kind in ("k1", "k3"):
        x = b.p.clone().requires_grad_(True)
        y = b.p.clone().requires_grad_(True)
        ours = kl_estimate(x, b.q, kind, straight_through=True)
        theirs = VERL.core.kl_penalty(y, b.q, f"{kind}+")
        out += [(f"kl {kind} straight-through", ours, theirs),
                (f"kl {kind} straight-through grad", grads((ours * b.mask).sum(), x), grads((theirs * b.mask).sum(), y))]
    return out


# ------------------------------------------------------------------------------------------ rollout correction

def _verl_correction(b, **kw):
    proto, keep, _ = VERL.corr.compute_rollout_correction_and_rejection_mask(b.p, b.q, b.mask, **kw)
    return (None if proto is None else proto.batch["rollout_is_weights"]), keep


_IS_CASES = [  # (covrl CorrectionConfig fields, verl arguments)
    ({"is_level": "token", "is_threshold": 2.0}, {"rollout_is": "token", "rollout_is_threshold": 2.0}),
    ({"is_level": "sequence", "is_threshold": 2.0}, {"rollout_is": "sequence", "rollout_is_threshold": 2.0}),
    ({"is_level": "token", "is_threshold": "0.5_1.5"}, {"rollout_is": "token", "rollout_is_threshold": "0.5_1.5"}),
    ({"is_level": "sequence", "is_threshold": "0.5_3.0"},
     {"rollout_is": "sequence", "rollout_is_threshold": "0.5_3.0"}),
    ({"is_level": "token", "is_batch_normalize": True},
     {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True}),
    ({"is_level": "sequence", "is_batch_normalize": True},
     {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True}),
]

# (criterion, covrl threshold, verl threshold): thresholds that reject some rows or tokens of these inputs
_RS_CASES = [
    ("token_k1", 1.5, "1.5"), ("token_k1", (0.5, 2.0), "0.5_2.0"), ("token_k2", 0.05, "0.05"),
    ("token_k3", 0.05, "0.05"), ("seq_sum_k1", 3.0, "3.0"), ("seq_sum_k2", 0.5, "0.5"), ("seq_sum_k3", 0.5, "0.5"),
    ("seq_mean_k1", 1.2, "1.2"), ("seq_mean_k2", 0.1, "0.1"), ("seq_mean_k3", 0.1, "0.1"),
    ("seq_max_k2", 0.5, "0.5"), ("seq_max_k3", 0.5, "0.5"),
    # an asymmetric k1 band: verl keeps lo ≤ 1/ρ ≤ hi, so verl's "0.8_1.5" is covrl's (1/1.5, 1/0.8)
    ("token_k1", (1 / 1.5, 1 / 0.8), "0.8_1.5"), ("seq_mean_k1", (1 / 1.3, 1 / 0.9), "0.9_1.3"),
]


def case_rollout_is(b):
    out = []
    for ours_cfg, verl_kw in _IS_CASES:
        corr = rollout_correction(b.p, b.q, b.mask, CorrectionConfig(**ours_cfg))
        weights, _ = _verl_correction(b, **verl_kw)
        out.append((f"IS {verl_kw}", corr.weights, weights * b.mask))
    return out


def case_rollout_rs(b):
    out = []
    for name, ours_t, verl_t in _RS_CASES:
        corr = rollout_correction(b.p, b.q, b.mask, CorrectionConfig(rs=[name], rs_threshold=[ours_t]))
        _, keep = _verl_correction(b, rollout_rs=name, rollout_rs_threshold=verl_t)
        out.append((f"RS {name} {verl_t}", corr.keep, keep.float()))
    # all criteria of a TRM-style chain must pass, on both sides
    corr = rollout_correction(b.p, b.q, b.mask, CorrectionConfig(rs=["seq_max_k2", "seq_mean_k3"],
                                                                  rs_threshold=[0.5, 0.1]))
    _, keep = _verl_correction(b, rollout_rs="seq_max_k2,seq_mean_k3", rollout_rs_threshold="0.5,0.1")
    out.append(("RS seq_max_k2,seq_mean_k3", corr.keep, keep.float()))
    return out


def case_batch_normalize_after_rejection(b):
    """Batch-normalised token IS with rejection: covrl divides the weights by their mean over the kept tokens,
    verl by their mean over all valid tokens (before rejection); the unnormalised weights agree."""
    rs = {"rs": ["token_k2"], "rs_threshold": [0.05]}
    raw = rollout_correction(b.p, b.q, b.mask, CorrectionConfig(is_level="token", **rs))
    ours = rollout_correction(b.p, b.q, b.mask, CorrectionConfig(is_level="token", is_batch_normalize=True, **rs))
    theirs, keep = _verl_correction(b, rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                                    rollout_rs="token_k2", rollout_rs_threshold=0.05)
    mean_kept = (raw.weights * raw.keep).sum() / raw.keep.sum()
    mean_valid = (raw.weights * b.mask).sum() / b.mask.sum()
    return [("IS batch-normalised + RS: verl = covrl · mean_kept / mean_valid", ours.weights * mean_kept / mean_valid,
             theirs * b.mask), ("... and the keep-masks agree", ours.keep, keep.float())]


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


def deltas(case: str, seed: int, shape: tuple[int, int]) -> list[tuple[str, float, float]]:
    """(label, max |Δ|, max |verl value|) of every pair of `case` on one random batch."""
    b = batch(seed, *shape)
    return [(label, float((ours.detach().double() - theirs.detach().double()).abs().max()),
             float(theirs.detach().double().abs().max())) for label, ours, theirs in CASES[case](b)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_covrl_agrees_with_verl(case, seed, shape):
    if shape[0] < 3 and case == "rloo":
        pytest.skip("no group of one")
    for label, delta, scale in deltas(case, seed, shape):
        assert delta <= TOL * max(1.0, scale), f"{label}: max |Δ| = {delta:.3g} (scale {scale:.3g})"


def test_the_random_inputs_reach_every_branch():
    """Agreement means something only where the branches are taken: every rejection criterion rejects some valid
    tokens and keeps others, PPO's clip and dual clip are hit, IcePop zeroes some weights, TIS truncates some."""
    b = batch(0, 16, 12)
    valid = b.mask.sum()
    for name, ours_t, _ in _RS_CASES:
        kept = rollout_correction(b.p, b.q, b.mask, CorrectionConfig(rs=[name], rs_threshold=[ours_t])).keep.sum()
        assert 0 < kept < valid, name
    m = policy_loss("ppo_clip", logprobs=b.p, sampler_logprobs=b.q, advantages=b.token_adv, mask=b.mask,
                    clip_low=0.2, clip_high=0.28, dual_clip=3.0).metrics
    assert m["loss/clip_frac_low"] > 0 and m["loss/clip_frac_high"] > 0 and m["loss/dual_clip_frac"] > 0
    band = rollout_correction(b.p, b.q, b.mask, CorrectionConfig(is_level="token", is_threshold=(0.5, 1.5)))
    assert bool(((band.weights == 0) & (b.mask > 0)).any())
    tis = rollout_correction(b.p, b.q, b.mask, CorrectionConfig(is_level="token", is_threshold=2.0))
    assert float(tis.weights.max()) == 2.0


def test_the_documented_differences_are_real():
    """The conversions applied above are not identities on these inputs: without them the values differ."""
    b = batch(0, 9, 7)
    assert nonempty_rows(b.mask) < b.mask.shape[0]
    assert not torch.isclose(aggregate(b.loss_mat, b.mask, "seq-mean-token-sum"),
                             VERL.core.agg_loss(b.loss_mat, b.mask, "seq-mean-token-sum"))
    ours = compute_advantages("rloo", rewards=b.token_rewards, mask=b.mask, group_ids=b.group_ids).advantages
    theirs, _ = VERL.core.compute_rloo_outcome_advantage(b.token_rewards, b.mask, b.index)
    assert not torch.allclose(ours, theirs)
    # the asymmetric band read covrl's way rejects other rows than verl's reading
    flips = 0
    for seed in SEEDS:
        b = batch(seed, 16, 12)
        corr = rollout_correction(b.p, b.q, b.mask, CorrectionConfig(rs=["token_k1"], rs_threshold=[(0.8, 1.5)]))
        _, keep = _verl_correction(b, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.5")
        flips += int((corr.keep != keep.float()).sum())
    assert flips > 0
    # verl clamps k3 at 10; covrl does not (its log-ratio clamp is ±20)
    big = torch.tensor([[0.0]]), torch.tensor([[-12.0]])
    assert float(kl_estimate(*big, "k3")) == pytest.approx(math.exp(-12) - 1 + 12)
    assert float(VERL.core.kl_penalty(*big, "low_var_kl")) == 10.0


def main() -> None:
    if VERL is None:
        raise SystemExit("verl is not importable: set COVRL_VERL_SITE (scripts/setup_verl_site.sh)")
    print(f"covrl.math vs verl {VERL.version}: max |Δ| over seeds {SEEDS} and shapes {SHAPES}")
    for case in sorted(CASES):
        worst: dict[str, float] = {}
        for seed in SEEDS:
            for shape in SHAPES:
                if shape[0] < 3 and case == "rloo":
                    continue
                for label, delta, _ in deltas(case, seed, shape):
                    worst[label] = max(worst.get(label, 0.0), delta)
        for label, delta in worst.items():
            print(f"{case:34s} {label:60s} {delta:.2e}")


if __name__ == "__main__":
    main()
