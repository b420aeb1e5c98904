"""Designs D of lr-surge-long and otb-long (studies/lr_surge/README.md, otb.md) are design C with only the
registered changes: a test that fails if a later edit moves anything else."""

from dataclasses import asdict

import pytest
from studies.lr_surge import lr_surge_long, lr_surge_long_d
from studies.otb import otb_long, otb_long_d

from studies import STUDIES


def _changed(a, b) -> dict:
    da, db = asdict(a), asdict(b)
    return {k: db[k] for k in da if da[k] != db[k]}


def test_lr_surge_design_d_changes_only_lr_steps_and_rule_1():
    assert _changed(lr_surge_long.FULL, lr_surge_long_d.DESIGN_D) == {"lr": 6e-4, "steps": 16,
                                                                       "regime_min_collapsed": 3}
    assert STUDIES["lr-surge-long-d"] == "studies.lr_surge.lr_surge_long_d"


def test_otb_design_d_changes_only_lr_tokens_and_rule_1():
    assert _changed(otb_long.FULL, otb_long_d.DESIGN_D) == {"lr": 6e-4, "token_budget": 150_000,
                                                             "regime_min_collapsed": 3}
    assert STUDIES["otb-long-d"] == "studies.otb.otb_long_d"


def test_design_c_keeps_its_registered_rule_1():
    assert lr_surge_long.FULL.regime_min_collapsed is None
    assert otb_long.FULL.regime_min_collapsed is None


@pytest.mark.slow
def test_run_uses_the_settings_it_is_given(tmp_path):
    """`run(full=...)` must run those settings, not FULL: a design D run once silently ran design C's."""
    from dataclasses import replace

    small = replace(otb_long.FAST, token_budget=900, regime_min_collapsed=1)
    result = otb_long.run(tmp_path / "otb", full=small, name="otb-long-small")
    assert result.name == "otb-long-small"
    assert result.numbers["settings"]["token_budget"] == 900
    assert any("at least 1 seeds" in c.name for c in result.criteria)
    small = replace(lr_surge_long.FAST, steps=4, force_surge_step=None,
                    arms=lr_surge_long.ARMS, regime_min_collapsed=1)
    result = lr_surge_long.run(tmp_path / "lr", full=small, name="lr-surge-long-small")
    assert result.numbers["settings"]["steps"] == 4
    assert any("at least 1 seeds" in c.name for c in result.criteria)
