"""Config loading: YAML + dotted overrides -> TrainConfig; every error names the field, file/line or override,
and the allowed keys/values."""

from __future__ import annotations

from pathlib import Path

import pytest

from covrl.config import ConfigError, dump_config, load_config, parse_overrides

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_unknown_key_names_field_file_line_and_allowed_keys(tmp_path):
    p = write(tmp_path, "run:\n  seed: 1\noptim:\n  lr: 1e-5\n  lrr: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert f"{p}:5" in msg and "optim.lrr" in msg and "unknown key" in msg
    assert "allowed keys: lr, betas" in msg


def test_unknown_section_lists_the_sections(tmp_path):
    p = write(tmp_path, "optimizer:\n  lr: 1\n")
    with pytest.raises(ConfigError, match=r"c.yaml:1: optimizer: unknown key in top level; allowed keys: run, "):
        load_config(p)


def test_bad_value_names_field_line_and_allowed_values(tmp_path):
    p = write(tmp_path, "loop:\n  steps: 3\n  mode: asynch\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert f"{p}:3" in msg and "loop.mode" in msg and "'sync'" in msg and "asynch" in msg


def test_registry_name_error_lists_registered_names(tmp_path):
    p = write(tmp_path, "algorithm:\n  advantage: gae\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert f"{p}:2" in str(err.value) and "grpo" in str(err.value) and "otb" in str(err.value)


def test_out_of_range_and_unknown_loss_option(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'optim.lr=-1': optim.lr: Input should be greater than 0"):
        load_config(None, ["optim.lr=-1"])
    with pytest.raises(ConfigError, match=r"loss_options.clip is not an option of ppo_clip.*clip_high"):
        load_config(None, ["algorithm.loss=ppo_clip", "algorithm.loss_options.clip=0.2"])


def test_bad_yaml_names_file_and_line(tmp_path):
    p = write(tmp_path, "run:\n  seed: 1\n optim: [\n")
    with pytest.raises(ConfigError, match=r"c.yaml:3: invalid YAML"):
        load_config(p)
    p = write(tmp_path, "run:\n  seed: 1\n  seed: 2\n", "dup.yaml")
    with pytest.raises(ConfigError, match=r"dup.yaml:3: invalid YAML: duplicate key 'seed'"):
        load_config(p)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n", "list.yaml"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_overrides_parse_yaml_values_and_create_sections(tmp_path):
    p = write(tmp_path, "optim:\n  lr: 1e-5\n")
    cfg = load_config(p, ["optim.lr=2e-5", "sampler.temperature=0.7", "correction.rs=[seq_mean_k3]",
                          "correction.rs_threshold=[0.001]", "optim.max_grad_norm=None", "run.name=x"])
    assert cfg.optim.lr == 2e-5 and cfg.sampler.temperature == 0.7 and cfg.optim.max_grad_norm is None
    assert cfg.correction.rs == ["seq_mean_k3"] and cfg.run.name == "x"
    assert load_config(p).optim.lr == 1e-5  # YAML 1.1 would read 1e-5 as a string
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["optim.lr"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["optim.lr=1", "optim.lr.x=2"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["optim.lr=3e-4", "correction.is_threshold=[0.5,2.0]", "model.source=tiny"])
    p = write(tmp_path, dump_config(cfg), "resolved.yaml")
    assert load_config(p) == cfg


@pytest.mark.parametrize("name", ["default.yaml", "tiny.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.algorithm.advantage == "otb" and cfg.algorithm.loss == "covariance"
