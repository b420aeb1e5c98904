"""The data types every task shares: one example, the scored result of a batch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Example:
    """One problem.

    prompt  natural-language prompt (what a chat model sees inside its chat template)
    answer  the reference answer; also the demonstration completion for supervised warm-up
    meta    task-specific data; `meta["plain_prompt"]` is the prompt used when the chat template is off
            (e.g. "7+5=" for a character-level model trained from scratch)
    """

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)

    @property
    def plain_prompt(self) -> str:
        return self.meta.get("plain_prompt", self.prompt)

    def __getitem__(self, key: str):
        """`example["answer"]`, `example["prompt"]` and a data row's other fields (`meta`), as TRL-style code
        reads a dataset row."""
        if key in ("prompt", "answer"):
            return getattr(self, key)
        if key in self.meta:
            return self.meta[key]
        raise KeyError(f"{key!r}: this example has 'prompt', 'answer'"
                       + (", " + ", ".join(repr(k) for k in self.meta) if self.meta else "")
                       + " (covrl's Example: example.answer, example.prompt, example.meta)")


@dataclass
class RewardOutput:
    """Scores of a batch of completions.

    rewards  the optimised reward per completion (0.0 where the reward function failed)
    correct  the task's grader verdict per completion (what accuracy means)
    errors   completions whose reward function raised or timed out (summed over the terms of `task.rewards`)
    metrics  reward/mean, reward/accuracy, reward/errors, reward/timeouts, reward/empty (and with `task.rewards`
             reward/reward/<name>, reward/errors/<name> per term; the trainer logs them as task/...)
    terms    each term's unweighted value per completion, name -> list (the one reward when `task.rewards` is
             unset; `overlong_penalty` when the penalty applies): rewards = Σ term_weights[name]·terms[name]
    term_weights  name -> weight of each term
    """

    rewards: list[float]
    correct: list[bool]
    errors: int
    metrics: dict[str, float] = field(default_factory=dict)
    terms: dict[str, list[float]] = field(default_factory=dict)
    term_weights: dict[str, float] = field(default_factory=dict)


def cycle_epochs(pool: list, n: int, rng) -> list:
    """`n` items drawn from `pool` in epochs: each epoch a fresh shuffle of the whole pool by `rng` (a
    random.Random), so every item appears once per epoch before any repeats."""
    out: list = []
    while len(out) < n:
        epoch = pool[:]
        rng.shuffle(epoch)
        out.extend(epoch[: n - len(out)])
    return out
