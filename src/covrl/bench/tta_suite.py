"""The single-turn tasks of `covrl bench tta`: each a set of dotted `task.*` overrides of configs/default.yaml and
the token budget covrl's default run is given on it. Nothing is downloaded: arithmetic and count_letters are
covrl's generated tasks, the reasoning-gym ones are generated locally (extra covrl[reasoning]), `reverse_word` is
a seeded list of words written to a JSONL when the suite is used (`materialise`).

Multi-turn (environment) and verifiers tasks are not in it: TRL's GRPOTrainer side of the bench and the sampler
probe that sizes a run both take single-turn completions."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

REVERSE_PATH = "@reverse_word.jsonl"   # replaced by the written file's path (materialise)


@dataclasses.dataclass(frozen=True)
class SuiteTask:
    overrides: dict[str, Any]   # dotted task.* overrides of configs/default.yaml
    max_new_tokens: int         # covrl's default run's budget on it
    description: str
    needs: str | None = None    # the module the task imports (an optional extra)


def _rg(dataset: str, options: dict | None = None) -> dict[str, Any]:
    return {"task.name": "reasoning_gym", "task.reasoning_gym.dataset": dataset,
            "task.reasoning_gym.options": options or {}, "task.reasoning_gym.size": 2000, "task.n_eval": 50}


def _rg_task(dataset: str, options: dict | None, tokens: int, description: str, *,
             graded_by: str | None = None) -> SuiteTask:
    """`graded_by`: a covrl reward used as both reward and grader instead of the dataset's own scorer."""
    overrides = _rg(dataset, options) | ({"task.reward": graded_by, "task.grader": graded_by} if graded_by else {})
    return SuiteTask(overrides, tokens, description, needs="reasoning_gym")


TASKS: dict[str, SuiteTask] = {
    "add1": SuiteTask({}, 16, "one-digit addition, configs/default.yaml's own task"),
    "add2": SuiteTask({"task.arithmetic.digits": 2}, 32, "two-digit addition 'Compute 47+38.'"),
    "mul1": SuiteTask({"task.arithmetic.ops": ["*"]}, 24, "one-digit multiplication 'Compute 7*5.'"),
    "count_letters": SuiteTask({"task.name": "count_letters", "task.n_eval": 50}, 24,
                               "count a letter in a 3-6 letter word over a-h"),
    "reverse_word": SuiteTask({"task.name": "jsonl", "task.path": REVERSE_PATH, "task.reward": "exact_match",
                               "task.grader": "exact_match"}, 24,
                              "reverse a 4-6 letter word over a-z (exact match)"),
    "rg_leg_counting": _rg_task("leg_counting", {"min_animals": 1, "max_animals": 3}, 64,
                                "reasoning-gym leg_counting, 1-3 kinds of animals (a number)"),
    "rg_gcd": _rg_task("gcd", {"min_value": 1, "max_value": 60}, 24, "reasoning-gym gcd of two numbers <= 60"),
    "rg_simple_equations": _rg_task("simple_equations", None, 32, "reasoning-gym simple_equations (a number)"),
    "rg_spell_backward": _rg_task("spell_backward", None, 24, "reasoning-gym spell_backward (a word, exact)"),
    "rg_word_sorting": _rg_task("word_sorting", {"min_words": 3, "max_words": 5}, 48,
                                "reasoning-gym word_sorting, 3-5 words (a comma-separated list)"),
    "rg_basic_arithmetic": _rg_task("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                         "max_digits": 2}, 32,
                                    "reasoning-gym basic_arithmetic, two terms of 1-2 digits (a number)"),
    "sub1": SuiteTask({"task.arithmetic.ops": ["-"]}, 16, "one-digit subtraction 'Compute 1-8.' (answers -9..9)"),
    # The same reasoning-gym problems graded by the completion's last number. The dataset's own scorer compares
    # the whole answer with the reference, and SmolLM2 explains before it answers, so none of its samples scores
    # 1 there (studies/tta/README.md, section 1); graded by the last number, some do, and RL has a signal.
    "rg_leg_counting_ln": _rg_task("leg_counting", {"min_animals": 1, "max_animals": 3}, 64,
                                   "rg_leg_counting graded by the last number", graded_by="last_number"),
    "rg_gcd_ln": _rg_task("gcd", {"min_value": 1, "max_value": 60}, 24, "rg_gcd graded by the last number",
                          graded_by="last_number"),
    "rg_simple_equations_ln": _rg_task("simple_equations", None, 32,
                                       "rg_simple_equations graded by the last number", graded_by="last_number"),
    "rg_basic_arithmetic_ln": _rg_task("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                            "max_digits": 2}, 32,
                                       "rg_basic_arithmetic graded by the last number", graded_by="last_number"),
    "rg_chain_sum_ln": _rg_task("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}, 24,
                                "reasoning-gym chain_sum, 2-3 one-digit terms, graded by the last number",
                                graded_by="last_number"),
    "rg_letter_counting_ln": _rg_task("letter_counting", {"min_words": 3, "max_words": 5}, 24,
                                      "reasoning-gym letter_counting, 3-5 words, graded by the last number",
                                      graded_by="last_number"),
    "rg_lcm_ln": _rg_task("lcm", {"min_value": 1, "max_value": 20}, 32,
                          "reasoning-gym lcm of two numbers <= 20, graded by the last number", graded_by="last_number"),
    "rg_count_bits_ln": _rg_task("count_bits", {"max_n": 64}, 32,
                                 "reasoning-gym count_bits, n < 64, graded by the last number", graded_by="last_number"),
    "rg_products_ln": _rg_task("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, 24,
                               "reasoning-gym products, two terms of 1-2 digits, graded by the last number",
                               graded_by="last_number"),
}


def reverse_records(n: int = 300, seed: int = 0) -> list[dict]:
    """`n` distinct seeded "reverse this word" problems over a-z, 4-6 letters (no palindromes)."""
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


def materialise(name: str, data_dir: Path) -> dict[str, Any]:
    """The task's overrides with any data file it reads written under `data_dir`."""
    if name not in TASKS:
        raise ValueError(f"unknown suite task {name!r}; choose from: {', '.join(TASKS)}")
    out = dict(TASKS[name].overrides)
    if out.get("task.path") == REVERSE_PATH:
        path = Path(data_dir) / "reverse_word.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in reverse_records()))
        out["task.path"] = str(path)
    return out
