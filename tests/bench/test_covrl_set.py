"""`covrl bench trl --covrl-set`: overrides reach the covrl side's config, and a bad one is refused by name
before anything loads."""

from __future__ import annotations

import argparse

import pytest

from covrl.bench import trl_bench
from covrl.bench.covrl_side import covrl_run_config
from covrl.settings import ConfigError


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    trl_bench.configure(parser)
    return parser.parse_args(["--model", "tiny", *extra])


def test_overrides_reach_the_covrl_config_and_nothing_else_moves():
    plain = covrl_run_config(trl_bench.settings_from_args(_args()))
    cfg = covrl_run_config(trl_bench.settings_from_args(
        _args("--covrl-set", "sampler.compile=true", "--covrl-set", "sampler.compile_bucket=32")))
    assert cfg.sampler.compile is True and cfg.sampler.compile_bucket == 32
    assert plain.sampler.compile is False
    # the GRPO step itself is unchanged
    assert cfg.algorithm == plain.algorithm and cfg.optim == plain.optim and cfg.loop == plain.loop


def test_a_misspelt_override_names_the_key_before_any_model_loads(tmp_path):
    args = _args("--covrl-set", "sampler.compil=true", "--out", str(tmp_path))
    with pytest.raises(ConfigError, match="sampler.compil"):
        trl_bench.run(args)
    assert not list(tmp_path.iterdir())
