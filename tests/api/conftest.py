"""A small tiny-model client for the covrl.api tests (no warm-up: they check computations, not learning)."""

from __future__ import annotations

import logging

import pytest
from api_helpers import SMALL

from covrl.api import TrainingClient


@pytest.fixture
def client(tmp_path):
    return TrainingClient.from_config("tiny", SMALL, state_dir=tmp_path)


class _NoHeartbeatAfterTheServer(logging.Filter):
    """The SDK's sessions keep a heartbeat thread that outlives each test's server and, minutes later, warns
    that Tinker is down; the tests end their servers on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Session heartbeat failed" not in record.getMessage()


logging.getLogger("tinker.lib.internal_client_holder").addFilter(_NoHeartbeatAfterTheServer())
