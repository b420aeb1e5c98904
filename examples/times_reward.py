"""A user reward for examples/times_table.jsonl: 1.0 when the last integer of the completion is the answer.

    covrl train --config configs/default.yaml task.name=jsonl task.path=examples/times_table.jsonl \
        task.reward=examples/times_reward.py:last_int --name times

`example` is the JSONL row: its `answer` field is `example.answer` (TRL-style functions with the signature
`fn(completions, answer, **kwargs)` work too, see docs/training.md)."""

import re


def last_int(completion: str, example) -> float:
    found = re.findall(r"-?\d+", completion)
    return float(bool(found) and found[-1] == str(example.answer))
