"""A small tiny-model client shared by the covrl.api tests (no warm-up: the tests check computations, not
learning). The Tinker SDK's own types are used where the `tinker` package is importable; set COVRL_TINKER_SITE
to the site-packages of a venv that has it (e.g. /tmp/tinker-venv/lib/python3.11/site-packages)."""

from __future__ import annotations

import os
import sys

import pytest

from covrl.api import TrainingClient

SMALL = {"sft_warmup.steps": 0, "task.n_train": 40, "task.n_eval": 8, "run.num_threads": 1}


@pytest.fixture
def client(tmp_path):
    return TrainingClient.from_config("tiny", SMALL, state_dir=tmp_path)


def tinker_sdk():
    site = os.environ.get("COVRL_TINKER_SITE")
    if site and site not in sys.path:
        sys.path.append(site)   # after covrl's own packages: the SDK's dependencies only fill gaps
    try:
        import tinker
    except ImportError:
        return None
    return tinker
