"""Graders from the ecosystem (extra `covrl[reasoning]`, imported lazily): `math_verify` and `reasoning_gym`.

`math_verify`: math answers graded by HuggingFace's math-verify (extra `covrl[reasoning]`): `\\boxed{}`, LaTeX,
fractions, decimals and plain expressions compared as values ("\\boxed{1/2}" = "0.5" = "$\\frac{1}{2}$").

The reward is 1.0 when an answer extracted from the completion equals the reference answer, else 0.0; a
completion with nothing to parse scores 0.0. A reference answer math-verify cannot parse (also wrapped in `$..$`)
raises: it is a dataset error, counted in task/errors, never a silent 0.

Timeout: math-verify's own timeout is a SIGALRM, which only works on the main thread, so it is switched off here
and the call runs isolated like a user reward instead (covrl.tasks.rewards.ISOLATED_REWARDS): at most
`task.reward_timeout_s` per completion on a worker thread, or in a worker process that is killed on overrun
with `task.reward_isolation: process`. A timeout scores 0 and counts in task/timeouts.

`reasoning_gym`: the procedural dataset's own scorer (`dataset.score_answer(answer, entry)`, in [0, 1]; some give
partial credit) on the text inside the completion's last `<answer>...</answer>` tag, or on the whole stripped
completion when it has no such tag. The scorer is rebuilt from the dataset name and options the example carries
(`meta["rg_dataset"]`, `meta["rg_options"]`), so a reward worker process needs nothing but the example."""

from __future__ import annotations

import functools
import json
import logging
import re

from covrl._lazy import require
from covrl.tasks.base import Example

EXTRA = "reasoning"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@functools.cache
def _math_verify():
    mv = require("math_verify", EXTRA)
    # it warns on every call that its own timeout is off; covrl's isolation provides the timeout
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return mv


def check_available() -> None:
    """Import math-verify now (start-up), so a missing extra fails before the run, naming `covrl[reasoning]`."""
    _math_verify()


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str):
    mv = _math_verify()
    def parsed(text):   # a value only counts when it holds a sympy object, not just the matched string
        found = mv.parse(text, parsing_timeout=None)
        return found if any(not isinstance(g, str) for g in found) else None

    # a bare LaTeX answer ("\frac{1}{2}") has no delimiters for the LaTeX extractor: wrap it in $..$
    gold = parsed(answer) or parsed(f"${answer}$")
    if not gold:
        raise ValueError(f"math_verify cannot parse the reference answer {answer!r}")
    return gold


def math_equal(reference: str, completion: str) -> bool:
    """Whether an answer in `completion` (\\boxed{}, $..$, or a plain number / expression) equals `reference`."""
    mv = _math_verify()
    gold = _parse_gold(str(reference).strip())
    pred = mv.parse(completion, parsing_timeout=None)
    if not pred:
        return False
    return bool(mv.verify(gold, pred, timeout_seconds=None))


def math_verify_reward(completion: str, example: Example) -> float:
    """1.0 if math-verify finds the completion's answer equal to `example.answer`, else 0.0."""
    return 1.0 if math_equal(example.answer, completion) else 0.0


@functools.cache
def reasoning_gym():
    """The reasoning_gym package (its import builds every generator: a few seconds, once)."""
    return require("reasoning_gym", EXTRA)


@functools.cache
def _scorer(dataset: str, options_json: str):
    # scoring never depends on the seed; size 1 keeps construction cheap
    return reasoning_gym().create_dataset(dataset, seed=0, size=1, **json.loads(options_json)).score_answer


def extract_tagged_answer(completion: str) -> str:
    """The text of the last <answer>...</answer> (stripped), else the whole stripped completion."""
    found = _ANSWER_TAG.findall(completion)
    return (found[-1] if found else completion).strip()


def reasoning_gym_reward(completion: str, example: Example) -> float:
    """The reasoning-gym dataset's own score of the completion's answer (see the module docstring)."""
    meta = example.meta
    if "rg_entry" not in meta:
        raise ValueError("the reasoning_gym reward needs an example of task.name=reasoning_gym")
    score = _scorer(meta["rg_dataset"], meta["rg_options"])(extract_tagged_answer(completion), meta["rg_entry"])
    return float(score)
