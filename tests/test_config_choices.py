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
