"""Config loading: YAML + dotted overrides -> TrainConfig; every error names the field, file/line or override,
and the allowed keys/values."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

import covrl.config as public
from covrl import settings
from covrl.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    config_reference,
    dump_config,
    load_config,
    parse_overrides,
)
from covrl.explore.config import BanditConfig
from covrl.math import CorrectionConfig
from covrl.rollout.vllm import vllm_available
from covrl.settings import SECTION_POLICY, Section

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
    with pytest.raises(ConfigError, match=r"override 'algorithm.clip_cov=1': algorithm.clip_cov: Input should be less than 1"):
        load_config(None, ["algorithm.clip_cov=1"])
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


def _sections(cls: type[BaseModel], seen: dict | None = None) -> dict[str, type[BaseModel]]:
    """Every pydantic model class reachable from `cls` through its fields (unions and lists included)."""
    seen = {} if seen is None else seen
    seen[cls.__qualname__] = cls
    for field in cls.model_fields.values():
        stack = [field.annotation]
        while stack:
            ann = stack.pop()
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                if ann.__qualname__ not in seen:
                    _sections(ann, seen)
            else:
                stack.extend(typing.get_args(ann))
    return seen


def test_every_section_has_the_one_policy():
    sections = _sections(TrainConfig) | {"BanditConfig": BanditConfig}
    assert {"RunConfig", "ModelConfig", "TinyModelConfig", "LoraConfig", "TaskConfig", "ArithmeticConfig",
            "LettersConfig", "SamplerConfig", "CorrectionConfig", "AsyncLoopConfig", "BatchScalingConfig",
            "LengthSurgeConfig", "OptimConfig"} <= set(sections)
    policy = {k: SECTION_POLICY[k] for k in ("extra", "validate_assignment", "allow_inf_nan")}
    assert policy == {"extra": "forbid", "validate_assignment": True, "allow_inf_nan": False}
    for name, cls in sections.items():
        assert name.endswith("Config"), f"{name}: section classes are called XConfig"
        assert {k: cls.model_config.get(k) for k in policy} == policy, name
        # covrl.math imports nothing from covrl, so CorrectionConfig repeats the policy instead of inheriting it
        assert issubclass(cls, Section) or cls is CorrectionConfig, f"{name} does not derive from Section"


def test_assignment_is_validated_like_a_file_value():
    cfg = load_config(None)
    for section, key in (("optim", "lr"), ("task", "n_eval"), ("sampler", "temperature")):
        with pytest.raises(ValidationError, match=key):
            setattr(getattr(cfg, section), key, -1)
    with pytest.raises(ValidationError, match="finite"):
        cfg.kl.coef = float("inf")
    cfg.sampler.temperature = 0.5  # a valid assignment still works
    assert cfg.sampler.temperature == 0.5


def test_inf_is_a_setting_only_where_it_means_something():
    cfg = load_config(None, ["correction.is_threshold=.inf", "lr_surge.ratio=.inf"])
    assert cfg.correction.is_threshold == float("inf") and cfg.lr_surge.ratio == float("inf")
    for key in ("correction.is_threshold", "lr_surge.ratio"):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [f"{key}=.nan"])
    with pytest.raises(ConfigError, match="sampler.max_new_tokens"):
        load_config(None, ["sampler.max_new_tokens=.inf"])


@pytest.mark.skipif(vllm_available(), reason="vllm is installed here")
def test_vllm_backend_without_the_extra_fails_at_config_load_naming_it():
    with pytest.raises(ConfigError, match=r"override 'sampler.backend=vllm': sampler.backend: sampler.backend=vllm "
                                          r"needs vLLM: pip install 'covrl\[vllm\]'"):
        load_config(None, ["sampler.backend=vllm"])


def test_public_names_and_the_low_package():
    for name in ("load_config", "ConfigError", "TrainConfig", "apply_overrides", "dump_config", "parse_overrides"):
        assert hasattr(public, name), name
    assert public.ConfigError is settings.ConfigError and public.TrainConfig is TrainConfig
    data, sources = apply_overrides({}, ["optim.lr=2e-5"])
    assert data == {"optim": {"lr": 2e-5}} and sources == {("optim", "lr"): "optim.lr=2e-5"}
    # the generic loader takes any root model
    assert settings.load_section(TrainConfig, None, ["run.seed=3"]) == load_config(None, ["run.seed=3"])


def test_docs_configuration_is_the_generated_reference():
    text = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert text[text.index("| key | type | default | description |"):] == config_reference()
