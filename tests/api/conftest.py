"""A small tiny-model client for the covrl.api tests (no warm-up: they check computations, not learning)."""

from __future__ import annotations

import pytest
from api_helpers import SMALL

from covrl.api import TrainingClient


@pytest.fixture
def client(tmp_path):
    return TrainingClient.from_config("tiny", SMALL, state_dir=tmp_path)
