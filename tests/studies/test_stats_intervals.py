"""The interval helpers of studies.stats used by the pre-registered long-response designs: hand cases."""

import pytest

from studies import stats


def test_stats_wilson_and_paired_mean_hand_cases():
    lo, hi = stats.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-3)
    lo, hi = stats.wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-3), pytest.approx(0.7634, abs=1e-3))
    assert stats.wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes"):
        stats.wilson_interval(3, 2)
    assert stats.paired_mean_ci([0.5] * 6) == (0.5, 0.5)
    lo, hi = stats.paired_mean_ci([0.0, 1.0, 0.0, 1.0, None, float("nan")])
    assert 0.0 <= lo < 0.5 < hi <= 1.0
    assert all(x != x for x in stats.paired_mean_ci([None]))
