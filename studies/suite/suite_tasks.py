"""The tasks of `python -m studies suite`: covrl task-config overrides on top of configs/default.yaml, none of them the
one-digit addition the defaults were chosen on, and the deterministic JSONL data of the one read from a file.

Each entry is dotted `task.*` overrides (covrl.config.override_strings form); everything else of the
default run stays as shipped. Base accuracies: SmolLM2-135M-Instruct greedy, 24 new tokens, covrl's evaluator
on the task's first 20 held-out prompts (docs/performance.md, "Suite")."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
LARGER_JSONL = _HERE / "data" / "suite_larger.jsonl"   # the study's own data
LARGER_REWARD = f"{_HERE / 'suite_reward.py'}:first_number"


@dataclasses.dataclass(frozen=True)
class SuiteTask:
    overrides: dict[str, Any]   # dotted task.* overrides on configs/default.yaml
    description: str
    base_accuracy: float        # SmolLM2-135M-Instruct greedy on the first 20 held-out prompts (measured)
    default: bool = True        # in the default suite (off: base accuracy ~0, both sides would likely stay there)


SUITE_TASKS: dict[str, SuiteTask] = {
    "mul1": SuiteTask({"task.arithmetic.ops": ["*"]}, "one-digit multiplication 'Compute 7*5.' (last_number)",
                      0.25),
    "sub1": SuiteTask({"task.arithmetic.ops": ["-"]}, "one-digit subtraction, negatives kept (last_number)", 0.10),
    "mix1": SuiteTask({"task.arithmetic.ops": ["+", "-", "*"]}, "one-digit +, - or * (last_number)", 0.25),
    "count_letters": SuiteTask({"task.name": "count_letters"},
                               "count a letter in a 3-6 letter word over a-h (last_number)", 0.35),
    "larger": SuiteTask({"task.name": "jsonl", "task.path": str(LARGER_JSONL), "task.reward_fn": LARGER_REWARD},
                        "JSONL: 'Which number is larger, 47 or 74?' (user reward file first_number; graded "
                        "last_number)", 0.10),
    # greedy 0/20 at 24 new tokens: SmolLM2 starts "To compute 25+60, we need to add ..." and runs out of tokens
    "add2": SuiteTask({"task.arithmetic.digits": 2}, "two-digit addition 'Compute 47+38.' (last_number)", 0.0,
                      default=False),
    # greedy 0/20: SmolLM2 lists the letters with commas and capitals, exact_match never holds
    "sort_letters": SuiteTask({"task.name": "sort_letters"}, "sort a 3-6 letter word's letters (exact_match)", 0.0,
                              default=False),
}
DEFAULT_TASKS = tuple(name for name, t in SUITE_TASKS.items() if t.default)


def larger_records(n: int = 300, seed: int = 0) -> list[dict]:
    """`n` distinct "which of two two-digit numbers is larger" problems, seeded (the shipped JSONL)."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n:
        a, b = rng.sample(range(10, 100), 2)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"prompt": f"Which number is larger, {a} or {b}? Reply with that number only.",
                     "answer": str(max(a, b))})
    return rows


def write_larger_jsonl(path: Path = LARGER_JSONL) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in larger_records()))
    return path


if __name__ == "__main__":  # python -m studies.suite.suite_tasks: regenerate the shipped JSONL
    print(write_larger_jsonl())
