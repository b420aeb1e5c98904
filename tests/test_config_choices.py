"""Options of a choice not taken are refused, naming the active choice: `sampler.vllm` under the hf backend
would otherwise be ignored without a word. A resolved config (every section at its value, as a run folder's
config.yaml holds it) still loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from covrl.config import load_config
from covrl.settings import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def test_engine_options_under_another_backend_are_refused():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["sampler.vllm.kv_cache_gib=4"])
    text = str(err.value)
    assert "sampler.vllm" in text and "sampler.backend='hf'" in text


def test_a_resolved_config_loads_again(tmp_path):
    cfg = load_config(TINY)
    resolved = tmp_path / "config.yaml"   # what a run folder keeps: every section, defaults included
    resolved.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert load_config(resolved).model_dump() == cfg.model_dump()


def test_options_of_a_task_not_chosen_are_refused_in_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task:\n  name: count_letters\n  arithmetic:\n    digits: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert f"{path}:4" in text and "task.arithmetic is read by task.name=arithmetic only" in text
    assert "task.name='count_letters'" in text


def test_options_of_a_task_not_chosen_are_refused_in_overrides():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["task.name=count_letters", "task.arithmetic.digits=2"])
    assert "override 'task.arithmetic.digits=2'" in str(err.value)


def test_a_preset_options_of_the_old_choice_are_dropped_with_a_note(capsys):
    assert yaml.safe_load(TINY.read_text())["task"]["arithmetic"]   # the preset sets its own arithmetic
    cfg = load_config(TINY, ["task.name=sort_letters"])
    assert cfg.task.name == "sort_letters" and cfg.task.arithmetic == type(cfg.task.arithmetic)()
    assert "task.arithmetic from" in capsys.readouterr().err


def test_two_staleness_bounds_are_refused():
    with pytest.raises(ConfigError, match="both bound the queue"):
        load_config(TINY, ["loop.mode=async", "async_loop.max_staleness_rollouts=64",
                           "async_loop.max_staleness_steps=3"])


def test_one_way_to_give_rewards(capsys):
    old = load_config(TINY, ["task.reward_fn=examples/times_reward.py:last_int"])
    assert old.task.reward == "examples/times_reward.py:last_int"   # the old key reads as task.reward
    assert "task.reward_fn is now task.reward" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="keep one"):
        load_config(TINY, ["task.reward_fn=a.py:f", "task.reward=exact_match"])
    with pytest.raises(ConfigError, match="both set"):
        load_config(TINY, ["task.reward=exact_match", 'task.rewards=[{"fn": "last_number"}]'])


def test_validators_check_and_never_fill_values_in():
    cfg = load_config(TINY, ["task.overlong_reward.buffer=2"])
    assert cfg.logging.noise_scale is None and cfg.noise_scale_on is True   # resolved where it is read
    assert cfg.task.overlong_reward.max_tokens is None
    dumped = cfg.model_dump(mode="json")
    assert type(cfg).model_validate(dumped).model_dump(mode="json") == dumped
