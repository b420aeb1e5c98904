"""Built-in generated tasks: arithmetic, count_letters, sort_letters, fib_chain.

Each problem space is split once, seeded: the eval set is drawn first and no train example repeats an eval
prompt. Small spaces (e.g. one-digit addition: 100 problems) are enumerated and shuffled; large ones are
sampled with rejection of eval prompts."""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Callable, Iterator

from covrl.tasks.base import Example, cycle_epochs
from covrl.tasks.config import TaskConfig
from covrl.tasks.task import Task, held_out_count

ENUMERATE_LIMIT = 200_000


def split_train_eval(enumerate_space: Callable[[], Iterator[Example]] | None, space_size: int,
                     sample: Callable[[random.Random], Example], cfg: TaskConfig) -> tuple[list[Example], list[Example]]:
    """(train, eval): distinct eval examples (how many: `held_out_count`; task.eval_fraction takes its share of an
    enumerated space), and `task.n_train` train examples whose prompts are not in eval. An enumerable space is
    shuffled; train then cycles through the rest in reshuffled epochs."""
    n_train = cfg.n_train
    rng = random.Random(cfg.seed)
    if enumerate_space is not None and space_size <= ENUMERATE_LIMIT:
        space = list(enumerate_space())
        rng.shuffle(space)
        n_eval = held_out_count(cfg, len(space))
        if n_eval >= len(space):
            setting = f"task.n_eval={n_eval}" if cfg.eval_fraction is None else \
                f"task.eval_fraction={cfg.eval_fraction} ({n_eval} problems)"
            raise ValueError(f"{setting} leaves no training problems: the problem space has only "
                             f"{len(space)} distinct problems; hold out fewer or widen the task")
        eval_set, pool = space[:n_eval], space[n_eval:]
        return cycle_epochs(pool, n_train, rng), eval_set
    n_eval = held_out_count(cfg, None)
    eval_set, seen = [], set()
    for _ in range(50 * n_eval + 100):
        if len(eval_set) >= n_eval:
            break
        ex = sample(rng)
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            eval_set.append(ex)
    train = []
    for _ in range(50 * n_train + 100):
        if len(train) >= n_train:
            break
        ex = sample(rng)
        if ex.prompt not in seen:
            train.append(ex)
    if len(eval_set) < n_eval or len(train) < n_train:
        raise ValueError(f"could not draw {n_eval} distinct eval and {n_train} train problems; widen the task")
    return train, eval_set


# ---------------------------------------------------------------- arithmetic


def evaluate_expression(operands: list[int], ops: list[str]) -> int:
    """Value of operands[0] ops[0] operands[1] ... with the usual precedence (* before + and -)."""
    terms, signs = [operands[0]], [1]
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def arithmetic_example(operands: list[int], ops: list[str]) -> Example:
    expr = "".join(str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:])))
    value = evaluate_expression(operands, ops)
    return Example(prompt=f"Compute {expr}. Answer with just the number.", answer=str(value),
                   meta={"plain_prompt": f"{expr}=", "expression": expr, "value": value})


def build_arithmetic(cfg: TaskConfig) -> Task:
    """One-digit addition by default: chat prompt "Compute 7+5. Answer with just the number.",
    plain prompt "7+5=", answer "12"; graded by the last number in the completion."""
    a = cfg.arithmetic
    low = 0 if a.digits == 1 else 10 ** (a.digits - 1)
    high = 10 ** a.digits - 1
    ops_list = list(dict.fromkeys(a.ops))
    keep = (lambda ex: True) if a.allow_negative else (lambda ex: ex.meta["value"] >= 0)

    def enumerate_space():
        for operands in itertools.product(range(low, high + 1), repeat=a.num_terms):
            for ops in itertools.product(ops_list, repeat=a.num_terms - 1):
                ex = arithmetic_example(list(operands), list(ops))
                if keep(ex):
                    yield ex

    def sample(rng: random.Random) -> Example:
        while True:
            ex = arithmetic_example([rng.randint(low, high) for _ in range(a.num_terms)],
                                    [rng.choice(ops_list) for _ in range(a.num_terms - 1)])
            if keep(ex):
                return ex

    size = (high - low + 1) ** a.num_terms * len(ops_list) ** (a.num_terms - 1)
    train, eval_set = split_train_eval(enumerate_space, size, sample, cfg)
    return Task(cfg, train, eval_set, default_reward="last_number", default_grader="last_number")


# ---------------------------------------------------------------- letters


def _random_word(rng: random.Random, cfg: TaskConfig) -> str:
    o = cfg.letters
    return "".join(rng.choice(o.alphabet) for _ in range(rng.randint(o.min_length, o.max_length)))


def build_count_letters(cfg: TaskConfig) -> Task:
    """"How many times does the letter 'a' appear in 'abcab'?" -> "2"; plain prompt "count a abcab="."""

    def sample(rng: random.Random) -> Example:
        word = _random_word(rng, cfg)
        # Half the time ask about a letter of the word, so counts of 0 do not dominate.
        letter = rng.choice(word) if rng.random() < 0.5 else rng.choice(cfg.letters.alphabet)
        return Example(prompt=f"How many times does the letter '{letter}' appear in '{word}'? "
                              "Answer with just the number.",
                       answer=str(word.count(letter)),
                       meta={"plain_prompt": f"count {letter} {word}=", "word": word, "letter": letter})

    train, eval_set = split_train_eval(None, 0, sample, cfg)
    return Task(cfg, train, eval_set, default_reward="last_number", default_grader="last_number")


def build_sort_letters(cfg: TaskConfig) -> Task:
    """"Sort the letters of 'dcab' in alphabetical order." -> "abcd"; plain prompt "sort dcab="."""

    def sample(rng: random.Random) -> Example:
        word = _random_word(rng, cfg)
        return Example(prompt=f"Sort the letters of '{word}' in alphabetical order. "
                              "Answer with just the sorted letters.",
                       answer="".join(sorted(word)), meta={"plain_prompt": f"sort {word}=", "word": word})

    train, eval_set = split_train_eval(None, 0, sample, cfg)
    return Task(cfg, train, eval_set, default_reward="exact_match", default_grader="exact_match")


# ---------------------------------------------------------------- fib_chain

CHAIN_LABELS = string.ascii_lowercase + string.ascii_uppercase


def fib_chain_example(first: int, second: int, steps: int, modulus: int = 100) -> Example:
    """The worked recurrence v_{i+1} = v_{i-1} + v_i (mod `modulus`) from seeds (first, second), `steps` steps:
    prompt "03,05:", answer (the demonstration) "a:03+05=08;b:05+08=13;c:08+13=21;#21". Each step restates the two
    values it adds (copied from the step before) under its label, so the model reads only local context."""
    if not 1 <= steps <= len(CHAIN_LABELS):
        raise ValueError(f"fib_chain: 1..{len(CHAIN_LABELS)} steps, got {steps}")
    if not (0 <= first < modulus and 0 <= second < modulus):
        raise ValueError(f"fib_chain: seeds must be in [0, {modulus}), got {first}, {second}")
    width = len(str(modulus - 1))
    a, b, lines = first, second, []
    for label in CHAIN_LABELS[:steps]:
        c = (a + b) % modulus
        lines.append(f"{label}:{a:0{width}d}+{b:0{width}d}={c:0{width}d};")
        a, b = b, c
    seeds = f"{first:0{width}d},{second:0{width}d}"
    return Example(prompt=f"Start from {seeds}; add the last two values mod {modulus}, {steps} times, writing "
                          "every step; end with #result.",
                   answer="".join(lines) + f"#{b:0{width}d}",
                   meta={"plain_prompt": f"{seeds}:", "seeds": [first, second], "steps": steps, "value": b})


def build_fib_chain(cfg: TaskConfig) -> Task:
    """A long multi-step task for the tiny model: the SFT demonstration is the whole worked solution
    (11 tokens a step), the reward checks only the result after '#' (`final_answer`). modulus² seed pairs ×
    the step counts: enumerated and split like one-digit addition when small."""
    c = cfg.fib_chain
    counts = range(c.min_steps, c.max_steps + 1)

    def enumerate_space():
        for k in counts:
            for first in range(c.modulus):
                for second in range(c.modulus):
                    yield fib_chain_example(first, second, k, c.modulus)

    def sample(rng: random.Random) -> Example:
        return fib_chain_example(rng.randrange(c.modulus), rng.randrange(c.modulus), rng.choice(counts), c.modulus)

    size = c.modulus ** 2 * len(counts)
    train, eval_set = split_train_eval(enumerate_space, size, sample, cfg)
    return Task(cfg, train, eval_set, default_reward="final_answer", default_grader="final_answer")
