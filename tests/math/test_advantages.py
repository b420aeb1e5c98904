"""Advantage estimators against plain-Python loops over groups and positions, identities and hand cases."""

import math
import statistics

import pytest
import torch

from covrl.math import compute_advantages, variance_proxies

torch.set_num_threads(1)


def _batch(seed=0, B=7, T=6, groups=(0, 0, 0, 5, 5, 9, 2)):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = torch.randint(0, 3, (B,), generator=g).float()
    logprobs = -3 * torch.rand(B, T, generator=g)
    pi_y = logprobs.exp()
    # a consistent Σπ² lies in [π_y² + (1 − π_y)²/(V − 1), π_y² + (1 − π_y)²]
    sum_pi_sq = pi_y**2 + (1 - pi_y) ** 2 * (0.05 + 0.95 * torch.rand(B, T, generator=g))
    is_w = 0.5 + torch.rand(B, T, generator=g)
    return rewards, mask, torch.tensor(groups), logprobs, sum_pi_sq, is_w


def _groups(group_ids):
    out = {}
    for i, gid in enumerate(group_ids.tolist()):
        out.setdefault(gid, []).append(i)
    return out


def test_grpo_dr_grpo_rloo_reinforce_match_loops():
    rewards, mask, gids, *_ = _batch()
    R = rewards.tolist()
    exp = {k: [0.0] * len(R) for k in ("grpo", "dr_grpo", "rloo", "reinforce")}
    for rows in _groups(gids).values():
        vals = [R[i] for i in rows]
        n = len(vals)
        mean = sum(vals) / n
        std = statistics.stdev(vals) if n > 1 else None
        for i in rows:
            exp["grpo"][i] = R[i] if n == 1 else (R[i] - mean) / (std + 1e-6)
            exp["dr_grpo"][i] = R[i] if n == 1 else R[i] - mean
            exp["rloo"][i] = 0.0 if n == 1 else R[i] - (sum(vals) - R[i]) / (n - 1)
            exp["reinforce"][i] = R[i]
    for name, per_seq in exp.items():
        out = compute_advantages(name, rewards=rewards, mask=mask, group_ids=gids)
        torch.testing.assert_close(out.advantages, torch.tensor(per_seq)[:, None] * mask, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.returns, rewards[:, None] * mask)


def _otb_loop(rewards_tok, mask, gids, w, handle_zero_tail):
    """Plain-Python OTB (docs/theory.md §7 steps 2–5)."""
    B, T = len(mask), len(mask[0])
    G = [[sum(rewards_tok[b][k] * mask[b][k] for k in range(t, T)) for t in range(T)] for b in range(B)]
    W = [[sum(w[b][j] * mask[b][j] for j in range(t + 1)) for t in range(T)] for b in range(B)]
    A = [[0.0] * T for _ in range(B)]
    for rows in _groups(torch.tensor(gids)).values():
        for t in range(T):
            num = sum(G[i][t] * W[i][t] * mask[i][t] for i in rows)
            den = sum(W[i][t] * mask[i][t] for i in rows)
            valid = sum(1 for i in rows if mask[i][t] > 0)
            base = num / (den + 1e-8)
            if len(rows) == 1 or (handle_zero_tail and valid == 1):
                base = 0.0
            for i in rows:
                A[i][t] = (G[i][t] - base) * mask[i][t]
    return torch.tensor(A)


@pytest.mark.parametrize("handle_zero_tail", [True, False])
@pytest.mark.parametrize("use_is", [False, True])
@pytest.mark.parametrize("token_rewards", [False, True])
def test_otb_matches_python_loop(handle_zero_tail, use_is, token_rewards):
    rewards, mask, gids, lp, sps, is_w = _batch(seed=1)
    if token_rewards:
        rewards = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5)) * mask
        rt = rewards.tolist()
    else:
        last = mask.sum(1).long() - 1
        rt = torch.zeros(mask.shape).index_put_((torch.arange(len(last)), last), rewards).tolist()
    w = (1 - 2 * lp.exp() + sps) * (is_w**2 if use_is else 1.0)
    expected = _otb_loop(rt, mask.tolist(), gids.tolist(), w.tolist(), handle_zero_tail)
    out = compute_advantages("otb", rewards=rewards, mask=mask, group_ids=gids, logprobs=lp, sum_pi_sq=sps,
                             is_weights=is_w if use_is else None, handle_zero_tail=handle_zero_tail)
    torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=1e-5)


def test_otb_with_equal_proxies_and_lengths_equals_dr_grpo():
    B, T = 8, 5
    mask = torch.ones(B, T)
    gids = torch.tensor([0, 0, 0, 0, 1, 1, 3, 3])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, -1.0, 0.5, 0.5])
    lp = torch.full((B, T), -1.2)
    sps = torch.full((B, T), 0.4)
    otb = compute_advantages("otb", rewards=rewards, mask=mask, group_ids=gids, logprobs=lp, sum_pi_sq=sps)
    dr = compute_advantages("dr_grpo", rewards=rewards, mask=mask, group_ids=gids)
    torch.testing.assert_close(otb.advantages, dr.advantages, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("handle_zero_tail", [True, False])
def test_group_of_one_gets_reward_to_go(handle_zero_tail):
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.5, 0.0, 2.0, 0.0]])
    lp, sps = torch.full((1, 4), -0.5), torch.full((1, 4), 0.5)
    out = compute_advantages("otb", rewards=rewards, mask=mask, group_ids=torch.tensor([3]), logprobs=lp,
                             sum_pi_sq=sps, handle_zero_tail=handle_zero_tail)
    torch.testing.assert_close(out.advantages, torch.tensor([[2.5, 2.0, 2.0, 0.0]]))
    torch.testing.assert_close(out.returns, torch.tensor([[2.5, 2.0, 2.0, 0.0]]))


def test_handle_zero_tail_gives_longest_row_its_return():
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    rewards = torch.tensor([1.0, 0.0, 0.0])
    lp, sps = torch.full((3, 5), -1.0), torch.full((3, 5), 0.3)
    kw = dict(rewards=rewards, mask=mask, group_ids=torch.zeros(3, dtype=torch.long), logprobs=lp, sum_pi_sq=sps)
    on = compute_advantages("otb", handle_zero_tail=True, **kw).advantages
    off = compute_advantages("otb", handle_zero_tail=False, **kw).advantages
    torch.testing.assert_close(on[0, 3:], torch.ones(2))  # past the second-longest length: baseline 0
    assert off[0, 3:].abs().max() < 1e-6  # otherwise the baseline equals G and the tail learns nothing
    torch.testing.assert_close(on[:, :3], off[:, :3])


def _all_correct_group():
    # one group of three, every reward 1; row 0 uniquely longest; confident first tokens (w = (1 - π)² tiny)
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    lp = torch.tensor([[-1e-4, -0.5, -0.5, -0.5, -0.5]]).expand(3, 5).clone()
    sps = lp.exp().square() + 1e-9
    return dict(rewards=torch.ones(3), mask=mask, logprobs=lp, sum_pi_sq=sps)


def test_otb_leaves_residue_on_a_constant_group_by_its_formula():
    from covrl.math.logprobs import logit_grad_proxy

    kw = _all_correct_group()
    adv = compute_advantages("otb", group_ids=torch.zeros(3, dtype=torch.long), **kw).advantages
    w = logit_grad_proxy(kw["logprobs"], kw["sum_pi_sq"])
    assert torch.all(w[:, 0] == 0)   # 1 − 2π + Σπ² cancels to 0 in fp32 for π = 1 − 1e-4
    # by hand: zero energy gives B_0 = 0 / (0 + 1e-8) = 0, so A_0 = G = 1 on every row of an all-correct group
    torch.testing.assert_close(adv[:, 0], torch.ones(3))
    assert torch.all(adv[:, 1:3] == 0)   # positive energy: B = G (3 W + 1e-8 rounds to 3 W in fp32)
    torch.testing.assert_close(adv[0, 3:], torch.ones(2))   # handle_zero_tail: the longest row's tail gets G


@pytest.mark.parametrize("name", ["otb", "otb_tir"])
def test_zero_constant_groups_zeroes_exactly_those_groups(name):
    kw = _all_correct_group()
    mask = torch.cat([kw["mask"], kw["mask"]])
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])   # group 0 constant, group 1 not
    lp, sps = torch.cat([kw["logprobs"]] * 2), torch.cat([kw["sum_pi_sq"]] * 2)
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    common = dict(rewards=rewards, mask=mask, group_ids=gids, logprobs=lp, sum_pi_sq=sps)
    off = compute_advantages(name, **common).advantages
    on = compute_advantages(name, zero_constant_groups=True, **common).advantages
    assert torch.equal(on[:3], torch.zeros(3, 5))          # exactly zero, not ~1e-8
    assert off[:3].abs().max() > 0.5                       # what the formula gives there
    assert torch.equal(on[3:], off[3:])                    # other groups untouched


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce"])
def test_zero_constant_groups_for_every_estimator(name):
    mask = torch.ones(6, 3)
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0])   # group 0 constant (0.1: float means leave residue)
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    off = compute_advantages(name, rewards=rewards, mask=mask, group_ids=gids).advantages
    on = compute_advantages(name, rewards=rewards, mask=mask, group_ids=gids, zero_constant_groups=True).advantages
    assert torch.equal(on[:3], torch.zeros(3, 3)) and torch.equal(on[3:], off[3:])
    if name == "reinforce":
        torch.testing.assert_close(off[:3], torch.full((3, 3), 0.1))   # no baseline: the option is what zeroes it


def test_zero_constant_groups_keeps_a_group_of_one():
    mask, lp, sps = torch.ones(1, 3), torch.full((1, 3), -0.5), torch.full((1, 3), 0.5)
    out = compute_advantages("otb", rewards=torch.tensor([2.0]), mask=mask, group_ids=torch.tensor([7]),
                             logprobs=lp, sum_pi_sq=sps, zero_constant_groups=True)
    torch.testing.assert_close(out.advantages, torch.full((1, 3), 2.0))   # A = G, as without the option


def test_otb_tir_skips_tool_tokens_and_aligns_on_generated_index():
    # row 0: gen gen TOOL TOOL gen gen ; row 1: gen gen gen gen pad pad (same group)
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    generated = torch.tensor([[1.0, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]])
    rewards = torch.tensor([1.0, 0.0])
    g = torch.Generator().manual_seed(2)
    lp, sps = -2 * torch.rand(2, 6, generator=g), 0.1 + 0.8 * torch.rand(2, 6, generator=g)
    out = compute_advantages("otb_tir", rewards=rewards, mask=mask, group_ids=torch.tensor([0, 0]), logprobs=lp,
                             sum_pi_sq=sps, generated_mask=generated)
    assert out.advantages[0, 2] == 0 and out.advantages[0, 3] == 0
    # brute force: drop the tool tokens, then plain OTB on the compacted rows
    keep0 = [0, 1, 4, 5]
    lp_c = torch.stack([lp[0, keep0], lp[1, :4]])
    sps_c = torch.stack([sps[0, keep0], sps[1, :4]])
    ref = compute_advantages("otb", rewards=rewards, mask=torch.ones(2, 4), group_ids=torch.tensor([0, 0]),
                             logprobs=lp_c, sum_pi_sq=sps_c).advantages
    torch.testing.assert_close(out.advantages[0, keep0], ref[0])
    torch.testing.assert_close(out.advantages[1, :4], ref[1])
    # tool tokens change nothing for the other row, unlike plain otb which aligns on absolute positions
    plain = compute_advantages("otb", rewards=rewards, mask=mask * generated, group_ids=torch.tensor([0, 0]),
                               logprobs=lp, sum_pi_sq=sps).advantages
    assert not torch.allclose(plain[1, :4], ref[1])


def test_otb_tir_defaults_to_mask_as_generated_mask():
    mask = torch.tensor([[1.0, 0, 1, 1], [1, 1, 1, 0]])
    lp, sps = torch.full((2, 4), -1.0), torch.full((2, 4), 0.3)
    kw = dict(rewards=torch.tensor([1.0, 0.0]), mask=mask, group_ids=torch.tensor([0, 0]), logprobs=lp, sum_pi_sq=sps)
    a = compute_advantages("otb_tir", **kw).advantages
    b = compute_advantages("otb_tir", generated_mask=torch.ones(2, 4), **kw).advantages
    torch.testing.assert_close(a, b)
    assert a[0, 1] == 0


def test_outcome_rewards_equal_token_rewards_on_last_token():
    rewards, mask, gids, lp, sps, _ = _batch(seed=4)
    last = mask.sum(1).long() - 1
    tok = torch.zeros(mask.shape).index_put_((torch.arange(len(last)), last), rewards)
    for name in ("grpo", "rloo", "otb"):
        a = compute_advantages(name, rewards=rewards, mask=mask, group_ids=gids, logprobs=lp, sum_pi_sq=sps)
        b = compute_advantages(name, rewards=tok, mask=mask, group_ids=gids, logprobs=lp, sum_pi_sq=sps)
        torch.testing.assert_close(a.advantages, b.advantages)


def test_metrics_frac_zero_std_groups_hand_case():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 3.0])  # groups: {1,1} zero std, {0,1} not, {3} singleton
    out = compute_advantages("grpo", rewards=rewards, mask=torch.ones(5, 2), group_ids=torch.tensor([4, 4, 7, 7, 1]))
    assert out.metrics["adv/frac_zero_std_groups"] == pytest.approx(2 / 3)
    assert out.metrics["adv/frac_singleton_groups"] == pytest.approx(1 / 3)
    assert out.metrics["adv/num_groups"] == 3
    expected_grpo = torch.tensor([0.0, 0.0, -0.5 / (math.sqrt(0.5) + 1e-6), 0.5 / (math.sqrt(0.5) + 1e-6), 3.0])
    torch.testing.assert_close(out.advantages[:, 0], expected_grpo)


def test_variance_proxies_hand_case():
    adv = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    proxy = torch.tensor([[0.5, 0.25], [2.0, 9.0]])
    m = variance_proxies(adv, mask, proxy)
    # Â = [1, −2], Ŵ = [0.75, 2.0], P = (1·0.75 + 4·2)/2 = 4.375, mean Ŵ = 1.375
    assert m["adv/var_power"] == pytest.approx(4.375)
    assert m["adv/var_proxy_mean"] == pytest.approx(1.375)


def test_errors_name_choices_and_shapes():
    mask = torch.ones(2, 3)
    choices = r"\['dr_grpo', 'gdpo', 'grpo', 'maxrl', 'otb', 'otb_tir', 'reinforce', 'rloo'\]"
    with pytest.raises(ValueError, match=r"valid choices: " + choices):
        compute_advantages("gae", rewards=torch.zeros(2), mask=mask, group_ids=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"rewards must be \[B\] or \[B, T\]"):
        compute_advantages("grpo", rewards=torch.zeros(2, 4), mask=mask, group_ids=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", rewards=torch.zeros(2), mask=mask, group_ids=torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="unknown inputs \\['gamma'\\]"):
        compute_advantages("grpo", rewards=torch.zeros(2), mask=mask, group_ids=torch.zeros(2, dtype=torch.long),
                           gamma=0.9)
    with pytest.raises(ValueError, match="otb needs"):
        compute_advantages("otb", rewards=torch.zeros(2), mask=mask, group_ids=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"sum_pi_sq must have the shape of mask \[2, 3\]"):
        compute_advantages("otb", rewards=torch.zeros(2), mask=mask, group_ids=torch.zeros(2, dtype=torch.long),
                           logprobs=torch.zeros(2, 3), sum_pi_sq=torch.zeros(3, 2))
