"""The task suite of the time-to-accuracy diagnosis (studies/tta/DESIGN.md): twelve tasks of different families,
each a set of dotted `task.*` overrides on configs/default.yaml plus the token budget it is probed and trained at.

Nothing is downloaded: arithmetic and count_letters are covrl's generated tasks, the reasoning-gym ones are
generated locally by reasoning_gym (extra covrl[reasoning]), `reverse_word` reads the shipped
examples/tasks/reverse_word.jsonl (regenerate: `python -m studies.tta.tasks`), `calculator` is the multi-turn
tool task of configs/calculator.yaml with one worked episode, `verifiers_sum` the taskset of
examples/verifiers_sum. Base accuracies and lengths: studies/tta/base.json (`python -m studies.tta.probe`)."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REVERSE_JSONL = ROOT / "examples" / "tasks" / "reverse_word.jsonl"

# configs/calculator.yaml's task section with its first worked episode only (two make greedy 100% at the start)
CALCULATOR_DEMO = [
    {"role": "user", "content": "Compute 12*34. Answer with just the number."},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}'
                                     '</tool_call>'},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "408"},
]


@dataclasses.dataclass(frozen=True)
class SuiteTask:
    family: str
    overrides: dict[str, Any]   # dotted task.* overrides on configs/default.yaml
    max_new_tokens: int         # the budget it is probed, evaluated and trained at
    description: str


def _rg(dataset: str, options: dict | None = None) -> dict[str, Any]:
    return {"task.name": "reasoning_gym", "task.reasoning_gym.dataset": dataset,
            "task.reasoning_gym.options": options or {}, "task.reasoning_gym.size": 2000, "task.n_eval": 50}


TTA_TASKS: dict[str, SuiteTask] = {
    "add2": SuiteTask("arithmetic", {"task.arithmetic.digits": 2}, 32, "two-digit addition 'Compute 47+38.'"),
    "mul1": SuiteTask("arithmetic", {"task.arithmetic.ops": ["*"]}, 24, "one-digit multiplication 'Compute 7*5.'"),
    "count_letters": SuiteTask("string", {"task.name": "count_letters", "task.n_eval": 50}, 24,
                               "count a letter in a 3-6 letter word over a-h"),
    "reverse_word": SuiteTask("string", {"task.name": "jsonl", "task.path": str(REVERSE_JSONL),
                                         "task.reward": "exact_match", "task.grader": "exact_match"}, 24,
                              "reverse a 4-6 letter word over a-z (exact match; shipped JSONL)"),
    "rg_leg_counting": SuiteTask("reasoning_gym", _rg("leg_counting", {"min_animals": 1, "max_animals": 3}), 64,
                                 "reasoning-gym leg_counting, 1-3 kinds of animals (a number)"),
    "rg_gcd": SuiteTask("reasoning_gym", _rg("gcd", {"min_value": 1, "max_value": 60}), 24,
                        "reasoning-gym gcd of two numbers <= 60 (a number)"),
    "rg_simple_equations": SuiteTask("reasoning_gym", _rg("simple_equations"), 32,
                                     "reasoning-gym simple_equations 'Solve for m: 20592*m = 1276704' (a number)"),
    "rg_spell_backward": SuiteTask("reasoning_gym", _rg("spell_backward"), 24,
                                   "reasoning-gym spell_backward (a word, exact)"),
    "rg_word_sorting": SuiteTask("reasoning_gym", _rg("word_sorting", {"min_words": 3, "max_words": 5}), 48,
                                 "reasoning-gym word_sorting, 3-5 words (a comma-separated list)"),
    "rg_basic_arithmetic": SuiteTask("reasoning_gym", _rg("basic_arithmetic", {"min_terms": 2, "max_terms": 2,
                                                                                "min_digits": 1, "max_digits": 2}),
                                     32, "reasoning-gym basic_arithmetic, two terms of 1-2 digits (a number)"),
    "calculator": SuiteTask("tool", {"task.arithmetic.ops": ["*"], "task.arithmetic.digits": 2, "task.n_eval": 50,
                                     "task.env.name": "calculator", "task.env.max_turns": 2,
                                     "task.env.max_tool_calls": 1, "task.env.demonstration": CALCULATOR_DEMO}, 32,
                            "two-digit multiplication with a calculator tool, one worked episode (multi-turn)"),
    "verifiers_sum": SuiteTask("verifiers", {"task.name": "verifiers",
                                             "task.verifiers.taskset": str(ROOT / "examples" / "verifiers_sum"),
                                             "task.n_eval": 50}, 16,
                               "the verifiers taskset of examples/verifiers_sum (one-digit addition)"),
}


def task_overrides(name: str) -> dict[str, Any]:
    """The task's overrides plus its token budget, as load_preset("default", ...) takes them."""
    t = TTA_TASKS[name]
    return {**t.overrides, "sampler.max_new_tokens": t.max_new_tokens}


def reverse_records(n: int = 300, seed: int = 0) -> list[dict]:
    """`n` distinct seeded "reverse this word" problems over a-z, 4-6 letters (the shipped JSONL)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < n:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 6)))
        if word in seen or word == word[::-1]:
            continue
        seen.add(word)
        rows.append({"prompt": f"Write the word '{word}' backwards. Answer with just the reversed word.",
                     "answer": word[::-1]})
    return rows


def write_reverse_jsonl(path: Path = REVERSE_JSONL) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in reverse_records()))
    return path


if __name__ == "__main__":  # python -m studies.tta.tasks: regenerate the shipped JSONL
    print(write_reverse_jsonl())
