"""rollout_correction: identities, hand-computed IS weights and rejection criteria, config validation."""

import math

import pydantic
import pytest
import torch

from covrl.math import REJECTION_CRITERIA, CorrectionConfig, rollout_correction

torch.set_num_threads(1)

MASK = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
LOGQ = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -7.0, -7.0]])
# log-ratios lr = log p − log q per token (padding entries are ignored)
LR = torch.tensor([[0.0, math.log(3.0), -0.2, 0.1], [math.log(0.25), 0.0, 9.0, 9.0]])


def _run(**cfg):
    return rollout_correction(LOGQ + LR, LOGQ, MASK, CorrectionConfig(**cfg))


def test_p_equals_q_gives_unit_weights_nothing_masked_zero_divergence():
    g = torch.Generator().manual_seed(0)
    logp = -3 * torch.rand(3, 5, generator=g)
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    for level in (None, "token", "sequence"):
        cfg = CorrectionConfig(is_level=level, is_batch_normalize=True, rs=list(REJECTION_CRITERIA),
                               rs_threshold=[1.01 if n.endswith("k1") else 1e-6 for n in REJECTION_CRITERIA])
        out = rollout_correction(logp, logp.clone(), mask, cfg)
        torch.testing.assert_close(out.weights, mask)
        torch.testing.assert_close(out.keep, mask)
        assert out.metrics["mismatch/k1"] == 0 and out.metrics["mismatch/k3"] == 0
        assert out.metrics["correction/masked_frac"] == 0 and out.metrics["mismatch/chi2_token"] == 0
    assert out.metrics["correction/ess_frac"] == pytest.approx(1.0)


def test_token_is_truncation_hand_case():
    out = _run(is_level="token", is_threshold=2.0)
    expected = torch.tensor([[1.0, 2.0, math.exp(-0.2), math.exp(0.1)], [0.25, 1.0, 0.0, 0.0]])
    torch.testing.assert_close(out.weights, expected)
    torch.testing.assert_close(out.keep, MASK)
    assert out.metrics["correction/is_changed_frac"] == pytest.approx(1 / 6)


def test_icepop_band_zeroes_weights_outside():
    out = _run(is_level="token", is_threshold=(0.5, 2.0))
    expected = torch.tensor([[1.0, 0.0, math.exp(-0.2), math.exp(0.1)], [0.0, 1.0, 0.0, 0.0]])
    torch.testing.assert_close(out.weights, expected)
    assert out.metrics["correction/is_changed_frac"] == pytest.approx(2 / 6)


def test_sequence_is_hand_case_and_batch_normalisation():
    # row sums of lr: log(3) − 0.2 + 0.1 and log(0.25)
    rho = torch.tensor([3.0 * math.exp(-0.1), 0.25])
    out = _run(is_level="sequence", is_threshold=10.0)
    torch.testing.assert_close(out.weights, rho[:, None] * MASK)
    capped = _run(is_level="sequence", is_threshold=2.0)
    torch.testing.assert_close(capped.weights, torch.tensor([2.0, 0.25])[:, None] * MASK)
    normed = _run(is_level="sequence", is_threshold=2.0, is_batch_normalize=True)
    torch.testing.assert_close(normed.weights, torch.tensor([2.0, 0.25])[:, None] / 1.125 * MASK)
    assert capped.metrics["correction/ess"] == pytest.approx(2.25**2 / (4 + 0.0625), rel=1e-5)
    tok_norm = _run(is_level="token", is_threshold=2.0, is_batch_normalize=True)
    assert (tok_norm.weights * MASK).sum().item() == pytest.approx(6.0, rel=1e-5)


K1 = -LR
K2 = 0.5 * LR**2
K3 = torch.expm1(LR) - LR


def _valid(x, mask=MASK):
    return [[v for v, m in zip(row, mrow) if m > 0] for row, mrow in zip(x.tolist(), mask.tolist())]


@pytest.mark.parametrize("name,threshold,expected_keep", [
    # token criteria: reject the ratio-3 token (k2 = 0.603, k3 = 0.901) and the ratio-0.25 token (k2 = 0.961,
    # k3 = 0.636) depending on the bound
    ("token_k1", (0.3, 2.5), [[1, 0, 1, 1], [0, 1, 0, 0]]),
    ("token_k1", 2.0, [[1, 0, 1, 1], [0, 1, 0, 0]]),  # t = 2 means the band (0.5, 2)
    ("token_k2", 0.7, [[1, 1, 1, 1], [0, 1, 0, 0]]),
    ("token_k3", 0.7, [[1, 0, 1, 1], [1, 1, 0, 0]]),
    # sequence criteria on row statistics (valid tokens only)
    ("seq_sum_k1", (0.2, 2.0), [[0, 0, 0, 0], [1, 1, 0, 0]]),  # row ratios 2.71 and 0.25
    ("seq_mean_k1", (0.55, 1.5), [[1, 1, 1, 1], [0, 0, 0, 0]]),  # geometric: 2.71^(1/4) = 1.28, 0.25^(1/2) = 0.5
    ("seq_sum_k2", 0.7, [[1, 1, 1, 1], [0, 0, 0, 0]]),  # sums 0.628 and 0.961
    ("seq_sum_k3", 0.7, [[0, 0, 0, 0], [1, 1, 0, 0]]),
    ("seq_mean_k2", 0.3, [[1, 1, 1, 1], [0, 0, 0, 0]]),
    ("seq_mean_k3", 0.3, [[1, 1, 1, 1], [0, 0, 0, 0]]),
    ("seq_max_k2", 0.7, [[1, 1, 1, 1], [0, 0, 0, 0]]),
    ("seq_max_k3", 0.7, [[0, 0, 0, 0], [1, 1, 0, 0]]),
])
def test_each_rejection_criterion_hand_case(name, threshold, expected_keep):
    out = _run(rs=[name], rs_threshold=[threshold])
    torch.testing.assert_close(out.keep, torch.tensor(expected_keep, dtype=torch.float32))
    torch.testing.assert_close(out.weights, MASK)  # no IS level: rejection does not touch the weights


def test_rejection_statistics_used_by_the_hand_cases():
    # the numbers the parametrised thresholds above rely on, from their definitions
    sums = [sum(r) for r in _valid(K2)]
    assert sums[0] == pytest.approx(0.5 * (math.log(3) ** 2 + 0.04 + 0.01)) and sums[0] < 0.7 < sums[1]
    assert max(_valid(K3)[0]) > 0.7 > max(_valid(K3)[1])
    means3 = [sum(r) / len(r) for r in _valid(K3)]
    assert means3[0] < 0.3 < means3[1]


def test_criteria_combine_and_metrics():
    out = _run(is_level="token", rs=["token_k3", "seq_max_k2"], rs_threshold=[0.7, 0.7])
    # token_k3 drops the ratio-3 token; seq_max_k2 drops row 1
    torch.testing.assert_close(out.keep, torch.tensor([[1.0, 0, 1, 1], [0, 0, 0, 0]]))
    assert out.metrics["correction/masked_frac"] == pytest.approx(3 / 6)
    assert out.metrics["correction/seq_masked_frac"] == pytest.approx(1 / 2)
    assert out.metrics["correction/rejected_frac/token_k3"] == pytest.approx(1 / 6)
    lr = _valid(LR)
    flat = [v for r in lr for v in r]
    assert out.metrics["mismatch/k1"] == pytest.approx(sum(-v for v in flat) / 6, rel=1e-5)
    assert out.metrics["mismatch/k3"] == pytest.approx(sum(math.expm1(v) - v for v in flat) / 6, rel=1e-5)
    assert out.metrics["mismatch/max_abs_lr"] == pytest.approx(math.log(4), rel=1e-5)
    assert out.metrics["mismatch/chi2_token"] == pytest.approx(sum(math.exp(2 * v) for v in flat) / 6 - 1, rel=1e-5)
    seq = [sum(r) for r in lr]
    assert out.metrics["mismatch/chi2_seq"] == pytest.approx(sum(math.exp(2 * s) for s in seq) / 2 - 1, rel=1e-5)
    # log_ppl_abs_diff = mean_b |mean_t log q − mean_t log p| = mean_b |mean_t lr|
    assert out.metrics["mismatch/log_ppl_abs_diff"] == pytest.approx(
        sum(abs(sum(r) / len(r)) for r in lr) / 2, rel=1e-5)


def test_log_ratios_are_clamped():
    logp = torch.tensor([[0.0, -1e4]])
    logq = torch.tensor([[-1e4, 0.0]])
    out = rollout_correction(logp, logq, torch.ones(1, 2), CorrectionConfig(is_level="token", is_threshold=1e9))
    assert out.metrics["mismatch/max_abs_lr"] == 20.0
    torch.testing.assert_close(out.weights, torch.tensor([[math.exp(20.0), math.exp(-20.0)]]))
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_config_validation_names_field_and_allowed_values():
    with pytest.raises(pydantic.ValidationError, match="is_level"):
        CorrectionConfig(is_level="batch")
    with pytest.raises(pydantic.ValidationError, match="allowed: .*seq_mean_k3"):
        CorrectionConfig(rs=["seq_max_k1"], rs_threshold=[2.0])
    with pytest.raises(pydantic.ValidationError, match="one threshold per rs criterion"):
        CorrectionConfig(rs=["token_k3"], rs_threshold=[])
    with pytest.raises(pydantic.ValidationError, match="not a band"):
        CorrectionConfig(rs=["token_k3"], rs_threshold=[(0.1, 0.2)])
    with pytest.raises(pydantic.ValidationError, match="must be > 1"):
        CorrectionConfig(rs=["token_k1"], rs_threshold=[0.5])
    with pytest.raises(pydantic.ValidationError, match="is_threshold"):
        CorrectionConfig(is_threshold=(2.0, 1.0))
    with pytest.raises(pydantic.ValidationError, match="extra"):
        CorrectionConfig(threshold=2.0)
    assert CorrectionConfig(is_threshold=[0.5, 2.0]).is_threshold == (0.5, 2.0)  # YAML lists become bands
    verl_style = CorrectionConfig(is_threshold="0.5_2.0", rs=["seq_mean_k1", "token_k3"],
                                  rs_threshold=["0.999_1.001", "0.5"])
    assert verl_style.is_threshold == (0.5, 2.0) and verl_style.rs_threshold == [(0.999, 1.001), 0.5]
    with pytest.raises(pydantic.ValidationError, match="lo_hi"):
        CorrectionConfig(is_threshold="a_b")
    with pytest.raises(ValueError, match="shape mismatch"):
        rollout_correction(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))
