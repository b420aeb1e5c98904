"""GSPO, GSPO-token, GMPO, CISPO and SAPO: hand cases, brute force (a direct per-row / per-token loop, autograd for
the gradients), identities between them, the pairing rule, and booleans refused as numbers."""

import math

import pytest
import torch

from covrl.math import LOSS_SPECS, CorrectionConfig, compute_advantages, policy_loss, token_logprobs

torch.set_num_threads(1)

NEW = ["gspo", "gspo_token", "gmpo", "cispo", "sapo"]


def _policy(B=5, T=4, d=3, V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, d, generator=g, dtype=torch.float64).float()
    W = torch.randn(d, V, generator=g, dtype=torch.float64).float().requires_grad_(True)
    y = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([4, 2, 3, 4, 1])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    shift = 0.3 * torch.randn(B, T, generator=g)   # sampler log-probs = trainer's + shift: ratios around 1
    return h, W, y, mask, shift


def _logp_rows(h, W, y):
    """Per-token log-probs computed row by row with log_softmax (no covrl code)."""
    return [torch.log_softmax(h[b] @ W, -1).gather(-1, y[b][:, None])[:, 0] for b in range(h.shape[0])]


def _val(x):
    return float(x.detach())


def _brute(name, rows, q, adv, mask, opts):
    """The loss of `name` as a direct loop over rows and tokens, averaged like seq-mean-token-mean."""
    total, n = 0.0, 0
    for b, lp in enumerate(rows):
        idx = [t for t in range(lp.shape[0]) if mask[b, t] > 0]
        if not idx:
            continue
        n += 1
        lrs = [lp[t] - q[b, t] for t in idx]
        a_row = sum(float(adv[b, t]) for t in idx) / len(idx)
        if name == "gspo":
            s = torch.exp(sum(lrs) / len(idx))
            lo, hi = 1 - opts["clip_low"], 1 + opts["clip_high"]
            total = total + max(-a_row * s, -a_row * s.clamp(lo, hi), key=_val)
        elif name == "gmpo":
            sign = math.copysign(1.0, a_row) if a_row != 0 else 0.0
            clipped = [sign * min(sign * lr, sign * lr.clamp(-opts["clip_low"], opts["clip_high"]), key=_val)
                       for lr in lrs]
            total = total + (-a_row * torch.exp(sum(clipped) / len(idx)))
        else:
            row = 0.0
            for t, lr in zip(idx, lrs):
                a = float(adv[b, t])
                if name == "gspo_token":
                    s_val = math.exp(_val(sum(lrs)) / len(idx))
                    s = s_val * torch.exp(lp[t] - lp[t].detach())
                    lo, hi = 1 - opts["clip_low"], 1 + opts["clip_high"]
                    row = row + max(-a * s, -a * s.clamp(lo, hi), key=_val)
                elif name == "cispo":
                    r = math.exp(_val(lr))
                    w = min(r, 1 + opts["clip_high"])
                    if opts.get("clip_low") is not None:
                        w = max(w, 1 - opts["clip_low"])
                    row = row - a * w * lp[t]
                elif name == "sapo":
                    tau = opts["tau_pos"] if a > 0 else opts["tau_neg"]
                    row = row - a * torch.sigmoid(tau * (torch.exp(lr) - 1)) * 4 / tau
            total = total + row / len(idx)
    return total / max(n, 1)


OPTS = {"gspo": {"clip_low": 0.05, "clip_high": 0.08}, "gspo_token": {"clip_low": 0.05, "clip_high": 0.08},
        "gmpo": {"clip_low": 0.2, "clip_high": 0.25}, "cispo": {"clip_low": 0.3, "clip_high": 0.2},
        "sapo": {"tau_pos": 1.0, "tau_neg": 1.5}}


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("token_adv", [False, True], ids=["outcome_adv", "token_adv"])
def test_loss_and_gradient_equal_a_direct_loop(name, token_adv):
    h, W, y, mask, shift = _policy(seed=3)
    g = torch.Generator().manual_seed(11)
    adv = torch.randn(mask.shape, generator=g) if token_adv else torch.randn(mask.shape[0], 1, generator=g).expand_as(mask)
    lp = token_logprobs(h @ W, y)
    q = lp.detach() + shift
    out = policy_loss(name, logprobs=lp, sampler_logprobs=q, advantages=adv, mask=mask,
                      agg_mode="seq-mean-token-mean", **OPTS[name])
    (got,) = torch.autograd.grad(out.loss, W)
    want = _brute(name, _logp_rows(h, W, y), q, adv, mask, OPTS[name])
    (want_g,) = torch.autograd.grad(want, W)
    torch.testing.assert_close(out.loss, want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want_g, atol=1e-5, rtol=1e-5)
    assert (out.token_loss[mask == 0] == 0).all()


def test_gspo_hand_case_sequence_ratio_and_clip():
    # one row, two tokens with log-ratios 0.2 and 0.0: s = exp(0.1) = 1.10517; A = 1 -> clipped at 1 + 0.08
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    q = torch.tensor([[-1.2, -2.0]])
    mask = torch.ones(1, 2)
    kw = dict(logprobs=lp, sampler_logprobs=q, mask=mask, agg_mode="seq-mean-token-mean", clip_low=0.05,
              clip_high=0.08)
    out = policy_loss("gspo", advantages=torch.ones(1, 2), **kw)
    assert out.loss.item() == pytest.approx(-1.08)
    (g,) = torch.autograd.grad(out.loss, lp)
    assert torch.all(g == 0)  # clipped: no gradient
    # A = -1: max(s, clip(s)) = s (unclipped, pessimistic) -> loss = s, dL/dlp_t = s / 2
    out = policy_loss("gspo", advantages=-torch.ones(1, 2), **kw)
    s = math.exp(0.1)
    assert out.loss.item() == pytest.approx(s, rel=1e-6)
    (g,) = torch.autograd.grad(out.loss, lp)
    torch.testing.assert_close(g, torch.full((1, 2), s / 2))


def test_gspo_token_equals_gspo_for_row_constant_advantages():
    h, W, y, mask, shift = _policy(seed=5)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3])[:, None].expand_as(mask)
    results = []
    for name in ("gspo", "gspo_token"):
        lp = token_logprobs(h @ W, y)
        out = policy_loss(name, logprobs=lp, sampler_logprobs=lp.detach() + shift, advantages=adv, mask=mask,
                          agg_mode="seq-mean-token-mean", clip_low=0.05, clip_high=0.08)
        results.append((out.loss, torch.autograd.grad(out.loss, W)[0]))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-6, rtol=1e-5)


def test_gmpo_hand_case_log_space_clip():
    # log-ratios 0.5, -0.1 with A = +1: 0.5 clipped to 0.4 (min), -0.1 kept -> R = exp(0.15)
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    q = torch.tensor([[-1.5, -0.9]])
    out = policy_loss("gmpo", logprobs=lp, sampler_logprobs=q, advantages=torch.ones(1, 2), mask=torch.ones(1, 2),
                      agg_mode="seq-mean-token-mean")
    assert out.loss.item() == pytest.approx(-math.exp(0.15), rel=1e-6)
    (g,) = torch.autograd.grad(out.loss, lp)
    torch.testing.assert_close(g, torch.tensor([[0.0, -math.exp(0.15) / 2]]))
    # A = -1: pessimistic side is the max -> 0.5 kept, -0.1 kept (clip only raises it to... nothing) -> exp(0.2)
    out = policy_loss("gmpo", logprobs=lp, sampler_logprobs=q, advantages=-torch.ones(1, 2), mask=torch.ones(1, 2),
                      agg_mode="seq-mean-token-mean")
    assert out.loss.item() == pytest.approx(math.exp(0.2), rel=1e-6)


def test_cispo_hand_case_keeps_the_gradient_of_clipped_tokens():
    # ρ = e^{0.5} > 1.28 -> weight 1.28 (PPO would give no gradient here); ρ = e^{-1}: no lower bound by default
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    q = torch.tensor([[-1.5, -1.0]])
    out = policy_loss("cispo", logprobs=lp, sampler_logprobs=q, advantages=torch.ones(1, 2), mask=torch.ones(1, 2),
                      agg_mode="seq-mean-token-sum")
    (g,) = torch.autograd.grad(out.loss, lp)
    torch.testing.assert_close(g, torch.tensor([[-1.28, -math.exp(-1.0)]]))
    assert out.loss.item() == pytest.approx(1.28 * 1.0 + math.exp(-1.0) * 2.0, rel=1e-6)
    assert out.metrics["loss/clip_frac_high"] == 0.5 and out.metrics["loss/clip_frac_low"] == 0.0


def test_sapo_hand_case_gate_and_on_policy_gradient():
    # at ρ = 1 the gate's gradient is exactly −A·∇log p (like REINFORCE); value −A·2/τ
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0]])
    out = policy_loss("sapo", logprobs=lp, sampler_logprobs=lp.detach(), advantages=adv, mask=torch.ones(1, 2),
                      agg_mode="seq-mean-token-sum")
    assert out.loss.item() == pytest.approx(-2.0 / 1.0 + 2.0 * 2.0 / 1.05, rel=1e-6)
    (g,) = torch.autograd.grad(out.loss, lp)
    torch.testing.assert_close(g, -adv)
    # off-policy: ρ = e, τ = 1 -> gradient weight 4σ(1−σ)·ρ at σ = sigmoid(e − 1)
    out = policy_loss("sapo", logprobs=lp, sampler_logprobs=lp.detach() - 1.0, advantages=torch.ones(1, 2),
                      mask=torch.ones(1, 2), agg_mode="seq-mean-token-sum")
    (g,) = torch.autograd.grad(out.loss, lp)
    sig = 1 / (1 + math.exp(-(math.e - 1)))
    torch.testing.assert_close(g, torch.full((1, 2), -4 * sig * (1 - sig) * math.e))


@pytest.mark.parametrize("name", NEW)
def test_on_policy_gradient_equals_reinforce(name):
    """At p = q every new loss has the policy-gradient direction of −A·∇log p (per token for the token losses,
    the row mean for gspo / gmpo whose A is the row's mean advantage)."""
    h, W, y, mask, _ = _policy(seed=7)
    R = torch.tensor([1.0, 0.0, 2.0, 0.5, -1.0])
    adv = compute_advantages("dr_grpo", rewards=R, mask=mask, group_ids=torch.zeros(5, dtype=torch.long)).advantages
    lp = token_logprobs(h @ W, y)
    opts = {"clip_low": 0.2, "clip_high": 0.2} if name != "sapo" else {}
    out = policy_loss(name, logprobs=lp, sampler_logprobs=lp.detach(), advantages=adv, mask=mask,
                      agg_mode="seq-mean-token-mean", **opts)
    lp = token_logprobs(h @ W, y)
    ref = policy_loss("covariance", logprobs=lp, sampler_logprobs=lp.detach(), advantages=adv, mask=mask,
                      agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(torch.autograd.grad(out.loss, W)[0], torch.autograd.grad(ref.loss, W)[0],
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", NEW)
def test_pairing_rule_ratio_against_the_sampler_takes_no_is_weights(name):
    spec = LOSS_SPECS[name]
    assert spec.ratio_vs_sampler and not spec.takes_is_weights


@pytest.mark.parametrize("name", NEW)
def test_bound_algorithm_drops_is_weights_for_the_new_losses(name):
    from covrl.config import load_config
    from covrl.train.step.algorithm import bind_algorithm

    cfg = load_config(None, [f"algorithm.loss={name}", "correction.is_level=token"])
    alg = bind_algorithm(cfg)
    assert not alg.loss_takes_is_weights
    h, W, y, mask, shift = _policy(seed=9)
    lp = token_logprobs(h @ W, y)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    weights = torch.full(mask.shape, 0.5)
    got = alg.policy_loss(logprobs=lp, sampler_logprobs=lp.detach() + shift, advantages=adv, mask=mask,
                          is_weights=weights)
    want = policy_loss(name, logprobs=lp, sampler_logprobs=lp.detach() + shift, advantages=adv, mask=mask,
                       agg_mode=cfg.algorithm.agg_mode)
    assert torch.equal(got.loss, want.loss)


@pytest.mark.parametrize("name, bad", [("gspo", {"clip_low": 1.0}), ("gspo_token", {"clip_high": -0.1}),
                                       ("gmpo", {"clip_low": -0.1}), ("cispo", {"clip_high": -1.0}),
                                       ("sapo", {"tau_pos": 0.0})])
def test_invalid_options_raise(name, bad):
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=name):
        policy_loss(name, logprobs=lp, sampler_logprobs=lp, advantages=lp, mask=torch.ones(1, 2), **bad)


# --------------------------------------------------------------------------------- booleans are not numbers

@pytest.mark.parametrize("fields", [{"is_threshold": True}, {"is_threshold": False}, {"is_threshold": (True, 2.0)},
                                    {"rs": ["token_k2"], "rs_threshold": [True]}])
def test_correction_config_refuses_booleans_naming_the_field(fields):
    with pytest.raises(ValueError, match=next(iter(fields)) if "rs" not in fields else "rs_threshold"):
        CorrectionConfig(**fields)
    cfg = CorrectionConfig()
    with pytest.raises(ValueError, match="is_threshold"):
        cfg.is_threshold = True   # assignment is validated too
    assert CorrectionConfig(is_threshold=1).is_threshold == 1.0   # an integer still is a number


def test_registry_options_refuse_booleans():
    with pytest.raises(ValueError, match="boolean"):
        LOSS_SPECS["ppo_clip"].validate_options({"clip_high": True})
    with pytest.raises(TypeError, match="clip_high"):
        lp = torch.zeros(1, 2)
        policy_loss("ppo_clip", logprobs=lp, sampler_logprobs=lp, advantages=lp, mask=torch.ones(1, 2),
                    clip_high=True)
    with pytest.raises(TypeError, match="eps"):
        compute_advantages("grpo", rewards=torch.ones(2), mask=torch.ones(2, 1), group_ids=torch.zeros(2), eps=True)
    assert LOSS_SPECS["ppo_clip"].validate_options({"dual_clip": None}) == {"dual_clip": None}
    assert LOSS_SPECS["ppo_clip"].validate_options({"clip_low": 0}) == {"clip_low": 0.0}


def test_config_refuses_boolean_thresholds_and_options():
    from covrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="correction.is_threshold"):
        load_config(None, ["correction.is_threshold=true"])
    with pytest.raises(ConfigError, match=r"algorithm\.loss_options\.clip_high"):
        load_config(None, ["algorithm.loss=ppo_clip", "algorithm.loss_options.clip_high=true"])
