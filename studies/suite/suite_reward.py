"""The user reward file of the suite's JSONL task (`python -m studies suite`, task `larger`), loaded by path as any
user's `task.reward_fn: file.py:function` is. It imports nothing from covrl: a user file sees only the
completion and the example (prompt, answer, meta)."""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def first_number(completion: str, example) -> float:
    """1.0 if the first integer in the completion is the answer (the larger of the two), else 0.0: unlike the
    built-in last_number, restating both numbers before answering earns nothing."""
    found = _INT.search(completion)
    return 1.0 if found is not None and int(found.group()) == int(example.answer) else 0.0
