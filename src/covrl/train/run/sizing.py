"""Sizing a run from the sampler (docs/theory.md §15, docs/training.md "Sizing a run from the sampler").

`sampler.max_new_tokens`, `loop.group_size` and `loop.prompts_per_step` accept `auto`. Before step 1 of a fresh
run, a probe samples the model RL starts from (after the SFT warm-up) on `sizing.probe_prompts` training prompts x
`sizing.probe_samples` completions at a generous budget `sizing.probe_max_new_tokens`, with the run's sampler
settings, and a rule turns what it measured into numbers:

    max_new_tokens  the smallest budget B whose reward signal per unit of step cost is within one standard error
                    of the best (`signal_per_cost`). A sample truncated to its first B tokens is exactly a sample of
                    the sampler at budget B, so the probe re-scores every sample at each candidate B of
                    `budget_grid` (8, 16, 24, 32, 48, 64, 96, 128, ... up to the probe's budget): the signal at B
                    is the mean over prompts of the rewards' unbiased within-prompt variance; the cost is
                    `step_overhead_tokens` + the expected longest response of a step's rollouts (batched
                    generation runs to it). When no B shows any variance, or with `budget_rule=lengths`: the
                    `length_quantile` of the response lengths x `length_headroom`, rounded up to a multiple of 8
    group_size      the smallest G of `group_sizes` (<= `largest_group`: rollouts_per_step // min_prompts_per_step)
                    whose predicted fraction of failing groups (constant, no answer right) is <= `constant_target`,
                    else the G that minimises it (a warning); the smallest G (a warning) when no probe sample was
                    correct, or every one was
    prompts_per_step  max(1, rollouts_per_step // group_size)

The predicted fraction of failing groups of G is the posterior predictive probability that G new samples of a
prompt all get the same reward below 1 (a group whose answers are all right is a solved prompt, not one a larger
G would help), averaged over the probed prompts: binary rewards under a Beta prior on the
prompt's pass rate (at the chosen budget) with `prior`'s strength and the task's pooled probe pass rate as its
mean (`pooled_prior`), other rewards under a Dirichlet process with concentration sum(`prior`) over the rewards
seen.

The run folder keeps the evidence and the choices (`sizing.json`) and the resolved config (config.yaml, numbers
only); `--resume` takes the numbers from sizing.json and never probes again. With `sizing.adapt`, an `auto`
max_new_tokens grows by `adapt_factor` (up to the probe's cap) after `adapt_steps` steps in a row that cut more
than `adapt_cut_rate` of their responses short of a correct answer, more than the probe's samples were cut short of
one at that budget (by `adapt_cut_z` standard errors: `cuts_more_than_probe`), and left more than
`constant_target` of their groups without one; the current value is checkpointed with the run (exact resume) and logged as
`sizing/max_new_tokens`, and evaluations stay at the probe's budget. With auto loop.group_size and
loop.prompts_per_step, every `adapt_group_steps` steps the group-size rule is applied again to the rewards of those
steps' groups, and a new G keeps the rollouts per step (`sizing/group_size`, `sizing/prompts_per_step`). A value
the user typed is never changed.

The rule is a set of pure functions of the evidence (`choose_max_new_tokens`, `length_budget`,
`choose_group_size`, `predicted_constant_fraction`); `size_run` is the part that samples and writes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from covrl.settings import Section, dump_config
from covrl.train.run.sources import score_rollouts

if TYPE_CHECKING:   # the run's config composes this section: imported for types only
    from covrl.train.config import TrainConfig

__all__ = ["AUTO", "AUTO_FIELDS", "ProbeEvidence", "SizingAdapter", "SizingConfig", "SizingDecision",
           "auto_fields", "budget_grid", "choose_group_size", "choose_max_new_tokens", "cuts_more_than_probe",
           "decide", "expected_longest", "fallback_sizes", "fixed_sizes", "length_budget", "reward_signal",
           "unsizable_reason", "pooled_prior", "predicted_constant_fraction", "probe_cut_and_wrong", "probe_record",
           "prompt_constant_probability", "size_run"]

AUTO = "auto"
# the fields the probe can size: (section, field)
AUTO_FIELDS = (("sampler", "max_new_tokens"), ("loop", "group_size"), ("loop", "prompts_per_step"))
SIZING_FILE = "sizing.json"
PROBE_SEED_OFFSET = 7_919   # the probe's own generator: the run's generator and stream stay untouched
ROUND_TO = 8
MIN_TOKENS = 8


class SizingConfig(Section):
    """How a run sizes the fields set to `auto` (sampler.max_new_tokens, loop.group_size, loop.prompts_per_step)
    from a probe of its sampler before step 1 (docs/training.md, 'Sizing a run from the sampler')."""

    rollouts_per_step: int = Field(16, ge=1, le=1_000_000, description="rollouts per step when loop.group_size "
                                   "or loop.prompts_per_step is auto: group_size <= this // min_prompts_per_step, "
                                   "prompts_per_step = max(1, this // group_size)")
    probe_prompts: int = Field(16, ge=1, le=4096, description="training prompts the probe samples (the stream's "
                               "first ones; the stream does not advance)")
    probe_samples: int = Field(4, ge=2, le=256, description="completions per probed prompt")
    probe_max_new_tokens: int = Field(128, ge=MIN_TOKENS, le=65536, description="the probe's budget (the cap of "
                                      "an auto max_new_tokens; lowered to fit the model's context)")
    budget_rule: Literal["signal_per_cost", "lengths"] = Field("signal_per_cost", description="how an auto "
                                                               "max_new_tokens is chosen: the budget with the most "
                                                               "reward variance per unit of step cost, or the "
                                                               "length_quantile of the probed lengths")
    step_overhead_tokens: float = Field(24.0, ge=0.0, le=1e6, description="signal_per_cost: the part of a step's "
                                        "cost that does not grow with the budget (optimizer, prompts, scoring), in "
                                        "generated-token units (SmolLM2 on one CPU thread: 7.0 s + 0.28 s per token "
                                        "of the longest response, so about 25)")
    length_quantile: float = Field(0.95, gt=0.0, le=1.0, description="quantile of the probed response lengths "
                                   "that max_new_tokens covers (a cut sample counts as the cap)")
    length_headroom: float = Field(1.25, ge=1.0, le=10.0, description="max_new_tokens = quantile x this, rounded "
                                   "up to a multiple of 8")
    min_prompts_per_step: int = Field(2, ge=1, le=1_000_000, description="an auto loop.group_size leaves at least "
                                      "this many prompts a step (G <= rollouts_per_step // this; the smallest of "
                                      "group_sizes if none fits): a step of one prompt pushes the whole model "
                                      "towards that prompt's answer (docs/theory.md §15)")
    group_sizes: list[int] = Field(default_factory=lambda: [4, 8, 16], min_length=1, description="candidate "
                                   "group sizes, the smallest whose predicted fraction of failing groups (constant, "
                                   "no answer right) is <= constant_target wins")
    constant_target: float = Field(0.5, gt=0.0, lt=1.0, description="the predicted fraction of failing groups "
                                   "(equal rewards, no answer right: no gradient, and no prompt solved) a group "
                                   "size must reach")
    prior: tuple[float, float] = Field((0.5, 0.5), description="Beta prior of a prompt's pass rate (binary "
                                       "rewards): strength a + b, mean (S + a) / (N + a + b) over the probe's N "
                                       "samples, S correct; other rewards: a Dirichlet process of concentration a + b")
    cut_warning: float = Field(0.5, gt=0.0, le=1.0, description="warn when this fraction of the probe's samples "
                               "reaches the probe's budget")
    fallback_max_new_tokens: int = Field(16, ge=1, le=1_000_000, description="an auto max_new_tokens where no "
                                         "probe runs (async or Ray loops, vLLM, several trainers, multi-turn, "
                                         "verifiers, agents; the API's clients, covrl eval)")
    fallback_group_size: int = Field(4, ge=1, le=65536, description="an auto loop.group_size where no probe runs")
    fallback_prompts_per_step: int = Field(4, ge=1, le=1_000_000, description="an auto loop.prompts_per_step where "
                                           "no probe runs")
    adapt: bool = Field(True, description="while the run goes: raise an auto max_new_tokens when steps keep "
                        "cutting answers (up to the probe's budget), and re-choose an auto group_size from the "
                        "recent steps' groups; a typed value is never changed")
    adapt_cut_rate: float = Field(0.5, gt=0.0, le=1.0, description="a step in which more than this fraction of "
                                  "the responses reached the budget and are not correct, and more than "
                                  "constant_target of the groups are constant, counts towards growing "
                                  "max_new_tokens")
    adapt_cut_z: float = Field(2.0, ge=0.0, le=100.0, description="such a step must also cut more of its "
                               "responses short of a correct answer than the probe's samples were at the same "
                               "budget, by at least this many standard errors of the difference (two-proportion "
                               "z): the probe chose the budget knowing how much it cuts, so only a policy that "
                               "cuts more than it did asks for more tokens")
    adapt_steps: int = Field(2, ge=1, le=1000, description="consecutive such steps before max_new_tokens grows")
    adapt_factor: float = Field(1.5, gt=1.0, le=16.0, description="max_new_tokens grows by this factor (rounded "
                                "up to a multiple of 8)")
    adapt_group_steps: int = Field(3, ge=1, le=1000, description="auto loop.group_size and prompts_per_step: "
                                   "every this many steps, group_sizes' rule applied to those steps' groups")

    @field_validator("group_sizes")
    @classmethod
    def _sizes(cls, v: list[int]) -> list[int]:
        if any(g < 2 for g in v) or len(set(v)) != len(v) or v != sorted(v):
            raise ValueError(f"sizing.group_sizes must be distinct, increasing and >= 2 (a group of 1 has no "
                             f"baseline), got {v}")
        return v

    @field_validator("prior")
    @classmethod
    def _prior(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(x > 0 and math.isfinite(x) for x in v):
            raise ValueError(f"sizing.prior must be two positive numbers, got {v}")
        return v

    @model_validator(mode="after")
    def _budget(self):
        if self.rollouts_per_step < self.group_sizes[0]:
            raise ValueError(f"sizing.rollouts_per_step={self.rollouts_per_step} is below the smallest of "
                             f"sizing.group_sizes={self.group_sizes}")
        return self


# ------------------------------------------------------------------------------------------- the rule


def prompt_constant_probability(rewards: Sequence[float], group_size: int, prior: tuple[float, float],
                                binary: bool, *, failing_only: bool = False) -> float:
    """P(group_size new samples of a prompt all get the same reward | the probe's `rewards` of that prompt), the
    posterior predictive. Binary rewards: p ~ Beta(a + s, b + m - s) and E[p^G + (1 - p)^G], a product of Pólya-urn
    ratios. Other rewards: a Dirichlet process of concentration a + b over the values seen (a value seen c times,
    of m, repeats G times with probability prod_t (c + t) / (m + α + t); one new value G times with
    α / (m + α) · prod_{t>=1} t / (m + α + t)). `failing_only`: only the groups whose common reward is below 1
    (every answer wrong; a new value counts as failing): a group that is constant because every answer is right
    is a solved prompt, not a group that a larger G would give contrast."""
    m, G = len(rewards), int(group_size)
    if binary:
        a, b = prior
        s = sum(1 for r in rewards if r >= 1.0)
        both = (b + m - s,) if failing_only else (a + s, b + m - s)
        return sum(math.prod((c + t) / (a + b + m + t) for t in range(G)) for c in both)
    alpha = prior[0] + prior[1]
    seen = sum(math.prod((c + t) / (m + alpha + t) for t in range(G)) for value, c in Counter(rewards).items()
               if not (failing_only and value >= 1.0))
    new = alpha / (m + alpha) * math.prod(t / (m + alpha + t) for t in range(1, G))
    return seen + new


def rewards_are_binary(groups: Sequence[Sequence[float]]) -> bool:
    return all(r in (0.0, 1.0) for g in groups for r in g)


def pooled_prior(groups: Sequence[Sequence[float]], prior: tuple[float, float]) -> tuple[float, float]:
    """The Beta prior of one prompt's pass rate (binary rewards): the strength a + b of `prior`, its mean the
    task's pooled pass rate (S + a) / (N + a + b) over all N probe samples, S of them correct. The prompts are
    drawn from one task: a prompt never solved where no other prompt was solved either is unlikely to be solved
    (with `prior` itself, 16 prompts x 0 of 4 predict 46% constant groups of 16; pooled, 99%). At a pooled rate of
    one half it is `prior`."""
    n = sum(len(g) for g in groups)
    if not n:
        return prior
    a, b = prior
    mean = (sum(1 for g in groups for r in g if r >= 1.0) + a) / (n + a + b)
    return (a + b) * mean, (a + b) * (1.0 - mean)


def predicted_constant_fraction(groups: Sequence[Sequence[float]], group_size: int,
                                prior: tuple[float, float] = (0.5, 0.5), *, failing_only: bool = False) -> float:
    """The expected fraction of constant groups of `group_size` over the probed prompts (`groups`: each prompt's
    probe rewards); binary rewards under the pooled prior (`pooled_prior`). `failing_only`: only the constant
    groups without a correct answer (`prompt_constant_probability`)."""
    binary = rewards_are_binary(groups)
    if binary:
        prior = pooled_prior(groups, prior)
    return sum(prompt_constant_probability(g, group_size, prior, binary, failing_only=failing_only)
               for g in groups) / max(len(groups), 1)


def choose_group_size(groups: Sequence[Sequence[float]], candidates: Sequence[int], budget: int, target: float,
                      prior: tuple[float, float] = (0.5, 0.5)) -> tuple[int, dict[int, float], str | None]:
    """(G, the predicted fraction of failing groups -- constant, no answer right -- of each candidate <= budget,
    warning or None): the smallest candidate whose prediction is <= target, else the one that minimises it (the
    largest on ties) with a warning. Groups that are constant because every answer is right do not count: a
    solved prompt needs no larger group, and a larger G would only take prompts from the step. Binary rewards all
    wrong (or all right) in the probe: the smallest candidate with a warning, since at a pass rate p near 0 a step
    of R rollouts has about R·p groups with contrast whatever G is."""
    allowed = [g for g in candidates if g <= budget] or [min(candidates)]
    predicted = {g: predicted_constant_fraction(groups, g, prior, failing_only=True) for g in allowed}
    binary = rewards_are_binary(groups)
    why = ""
    if binary and all(r < 1.0 for g in groups for r in g):
        why = "no probe sample was correct"
    elif binary and all(r >= 1.0 for g in groups for r in g):
        why = "every probe sample was correct"
    if why:
        best = allowed[0]
        return best, predicted, (f"{why}: no group size gives contrast (loop.group_size={best}, the smallest, keeps "
                                 f"the most prompts per step; an expected {predicted[best]:.1%} of the groups "
                                 "without a correct answer); an easier task, an SFT warm-up or a prompt that asks "
                                 "for the bare answer would help")
    for g in allowed:
        if predicted[g] <= target:
            return g, predicted, None
    best = min(allowed, key=lambda g: (predicted[g], -g))
    # one decimal where whole percents would print the prediction equal to the target it missed
    digits = 1 if round(100 * predicted[best]) == round(100 * target) else 0
    return best, predicted, (f"even loop.group_size={best} leaves an expected {predicted[best]:.{digits}%} of the "
                             f"groups without a correct answer (target {target:.0%}): most steps will carry little "
                             "gradient; an easier task, an SFT warm-up or a larger sizing.rollouts_per_step would "
                             "help")


def largest_group(scfg: SizingConfig) -> int:
    """The largest group an auto loop.group_size may take: one that leaves `min_prompts_per_step` prompts in a step
    of `rollouts_per_step` rollouts."""
    return max(1, scfg.rollouts_per_step // scfg.min_prompts_per_step)


def nearest_rank(values: Sequence[int], q: float) -> int:
    """The q-quantile by nearest rank: the smallest value with at least a fraction q of `values` at or below."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def round_up(n: float, multiple: int = ROUND_TO) -> int:
    return int(math.ceil(n / multiple) * multiple)


def length_budget(lengths: Sequence[int], cap: int, *, quantile: float = 0.95, headroom: float = 1.25,
                  floor: int = MIN_TOKENS) -> int:
    """The budget that covers the `quantile` of the probe's response lengths x `headroom`, rounded up to a multiple
    of 8, within [floor, cap]. A sample of length >= cap was cut: it counts as cap (a censored length), so more
    cut samples never give a smaller budget."""
    if not lengths:
        raise ValueError("length_budget: no probe lengths")
    q = nearest_rank([min(int(n), cap) for n in lengths], quantile)
    tokens = cap if q >= cap else min(cap, round_up(max(floor, MIN_TOKENS, q * headroom)))
    return max(min(tokens, cap), 1)


def cut_fraction(lengths: Sequence[int], cap: int) -> float:
    return sum(1 for n in lengths if n >= cap) / max(len(lengths), 1)


def cut_wrong_share(lengths: Sequence[int], correct: Sequence[Sequence[bool]], budget: int) -> float:
    """The fraction of the probe's samples (`lengths`, and each prompt's verdicts at `budget`, prompt-major) that
    reach `budget` tokens and are not correct there."""
    flat = [bool(c) for group in correct for c in group]
    return sum(1 for n, ok in zip(lengths, flat) if n >= budget and not ok) / max(len(lengths), 1)


def cut_warning_text(cut: float, cap: int) -> str:
    return (f"{cut:.0%} of the probe's samples reached its budget of {cap} tokens: answers may be longer still "
            "(raise sizing.probe_max_new_tokens, or set sampler.max_new_tokens)")


def budget_grid(cap: int, floor: int = MIN_TOKENS) -> list[int]:
    """The candidate budgets: 8, 16, 24, 32, 48, 64, 96, 128, 192, ... (multiples of 8 that are a power of two or
    1.5 times one) from `floor` up to `cap`, and `cap` itself; `floor` rounded up to 8 is the first."""
    first = min(cap, round_up(max(floor, MIN_TOKENS)))
    grid, k = {first, cap}, MIN_TOKENS
    while k < cap:
        grid.update(b for b in (k, k * 3 // 2) if first <= b < cap and b % ROUND_TO == 0)
        k *= 2
    return sorted(grid)


def within_prompt_variances(groups: Sequence[Sequence[float]]) -> list[float]:
    """Each prompt's unbiased within-prompt variance of its rewards (0 for a prompt with one sample)."""
    out = []
    for g in groups:
        m = len(g)
        mean = sum(g) / m if m else 0.0
        out.append(sum((r - mean) ** 2 for r in g) / (m - 1) if m > 1 else 0.0)
    return out


def reward_signal(groups: Sequence[Sequence[float]]) -> float:
    """The mean over prompts of the rewards' unbiased within-prompt variance: the expected policy gradient is a
    covariance with the reward (theory §4), which a group can only estimate where its rewards vary."""
    per_prompt = within_prompt_variances(groups)
    return sum(per_prompt) / max(len(per_prompt), 1)


def standard_error(values: Sequence[float]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def expected_longest(lengths: Sequence[int], budget: int, rollouts: int) -> float:
    """E[max of `rollouts` independent min(L, budget)] under the probe's empirical distribution of lengths L: the
    tokens a step's batched generation runs for (it stops when the longest response stops)."""
    values = sorted(min(int(n), budget) for n in lengths)
    n, total, below = len(values), 0.0, 0
    for v, count in sorted(Counter(values).items()):
        total += v * (((below + count) / n) ** rollouts - (below / n) ** rollouts)
        below += count
    return total


def choose_max_new_tokens(lengths: Sequence[int], rewards_at: dict[int, Sequence[Sequence[float]]], *,
                          rollouts: int, overhead: float) -> tuple[int | None, dict[int, dict[str, float]]]:
    """(the budget of `rewards_at` to train at, or None when no budget shows any reward variance; the table of
    every candidate). `rewards_at[B]`: each prompt's probe rewards with every sample truncated to B tokens; the
    signal at B is their mean within-prompt variance, cost(B) = overhead + the expected longest of `rollouts`
    responses at B. The budget is the smallest whose signal per cost is within one standard error (over the
    probed prompts) of the best one's: a few dozen samples cannot tell nearer budgets apart, and the smaller
    one is cheaper and can still grow while the run goes (`sizing.adapt`), where a larger one never shrinks."""
    table = {}
    for budget in sorted(rewards_at):
        per_prompt = within_prompt_variances(rewards_at[budget])
        signal = sum(per_prompt) / max(len(per_prompt), 1)
        cost = overhead + expected_longest(lengths, budget, rollouts)
        table[budget] = {"signal": signal, "signal_se": standard_error(per_prompt), "cost": cost,
                         "signal_per_cost": signal / cost if cost > 0 else 0.0}
    live = [b for b in table if table[b]["signal"] > 0]
    if not live:
        return None, table
    best = max(live, key=lambda b: (table[b]["signal_per_cost"], -b))
    floor = (table[best]["signal"] - table[best]["signal_se"]) / table[best]["cost"]
    return min(b for b in live if table[b]["signal_per_cost"] >= floor), table


# ---------------------------------------------------------------------------------------- evidence


@dataclass(frozen=True)
class ProbeEvidence:
    """What the probe measured: each sample's response length (tokens, `cap` = cut), each prompt's rewards and
    verdicts (correct = reward >= 1 or the task's grader) at the probe's budget `cap`, and at each smaller
    candidate budget B the same samples truncated to B tokens and scored again (`rewards_at`, `correct_at`)."""

    lengths: list[int]
    cap: int
    rewards: list[list[float]]
    correct: list[list[bool]]
    rewards_at: dict[int, list[list[float]]] = field(default_factory=dict)
    correct_at: dict[int, list[list[bool]]] = field(default_factory=dict)

    def rewards_by_budget(self) -> dict[int, list[list[float]]]:
        return {**self.rewards_at, self.cap: self.rewards}

    def correct_by_budget(self) -> dict[int, list[list[bool]]]:
        return {**self.correct_at, self.cap: self.correct}

    def summary(self, quantile: float) -> dict[str, Any]:
        finished = [n for n in self.lengths if n < self.cap]
        right = [n for n, ok in zip(self.lengths, (c for g in self.correct for c in g)) if ok and n < self.cap]
        pass_rates = [sum(c) / len(c) for c in self.correct]
        variances = [sum((r - sum(g) / len(g)) ** 2 for r in g) / len(g) for g in self.rewards]
        samples = max(len(self.lengths), 1)
        return {
            "prompts": len(self.rewards), "samples_per_prompt": len(self.rewards[0]) if self.rewards else 0,
            "cap": self.cap, "cut_frac": cut_fraction(self.lengths, self.cap),
            "length_to_eos": ({"mean": sum(finished) / len(finished), "p50": nearest_rank(finished, 0.5),
                               f"p{round(100 * quantile)}": nearest_rank(finished, quantile), "max": max(finished)}
                              if finished else None),
            # the lengths that earned a correct verdict: how much of the budget the answers that count need
            "length_correct": ({"p50": nearest_rank(right, 0.5), f"p{round(100 * quantile)}":
                                nearest_rank(right, quantile), "max": max(right), "samples": len(right)}
                               if right else None),
            "pass_rate_mean": sum(pass_rates) / max(len(pass_rates), 1),
            "prompts_all_wrong": sum(1 for p in pass_rates if p == 0.0),
            "prompts_all_right": sum(1 for p in pass_rates if p == 1.0),
            "reward_variance_within_mean": sum(variances) / max(len(variances), 1),
            "rewards_binary": rewards_are_binary(self.rewards),
            # each candidate budget: the probe's samples truncated there
            "by_budget": {str(b): {"pass_rate": sum(c for g in correct for c in g) / samples,
                                   "cut_frac": cut_fraction(self.lengths, b),
                                   "cut_wrong_frac": cut_wrong_share(self.lengths, correct, b)}
                          for b, correct in sorted(self.correct_by_budget().items())},
        }


@dataclass(frozen=True)
class SizingDecision:
    resolved: dict[str, int]                     # "sampler.max_new_tokens" -> 24, ... (the auto fields only)
    predicted_failing: dict[int, float]         # the group rule's prediction for each candidate G
    cut_frac: float
    warnings: list[str]
    budgets: dict[int, dict[str, float]] = field(default_factory=dict)   # signal_per_cost's table, when it ran


def auto_fields(cfg: TrainConfig) -> list[str]:
    """The dotted names of the fields set to auto."""
    return [f"{s}.{f}" for s, f in AUTO_FIELDS if getattr(getattr(cfg, s), f) == AUTO]


def decide(evidence: ProbeEvidence, cfg: TrainConfig) -> SizingDecision:
    """The rule applied to the probe's evidence, for the fields of `cfg` that are auto: the budget first, then the
    group shape from the rewards at that budget."""
    scfg, auto = cfg.sizing, auto_fields(cfg)
    resolved: dict[str, int] = {}
    warnings: list[str] = []
    budgets: dict[int, dict[str, float]] = {}
    cut = cut_fraction(evidence.lengths, evidence.cap)
    by_budget = evidence.rewards_by_budget()
    tokens = evidence.cap   # a typed max_new_tokens: the probe sampled at it
    if "sampler.max_new_tokens" in auto:
        floor = _overlong_floor(cfg)
        allowed = {b: r for b, r in by_budget.items() if b >= floor} or {evidence.cap: evidence.rewards}
        chosen = None
        if scfg.budget_rule == "signal_per_cost":
            rollouts = scfg.rollouts_per_step if {"loop.group_size", "loop.prompts_per_step"} & set(auto) \
                else cfg.loop.rollouts_per_step
            chosen, budgets = choose_max_new_tokens(evidence.lengths, allowed, rollouts=rollouts,
                                                    overhead=scfg.step_overhead_tokens)
            if chosen is None:
                warnings.append(f"no budget up to {evidence.cap} tokens gave the rewards any variance within a "
                                "prompt: max_new_tokens covers the probed lengths instead (sizing.length_quantile)")
        if chosen is None:   # the length rule, on the grid the probe scored
            covered = length_budget(evidence.lengths, evidence.cap, quantile=scfg.length_quantile,
                                    headroom=scfg.length_headroom, floor=floor)
            chosen = min((b for b in allowed if b >= covered), default=evidence.cap)
        tokens = chosen
        resolved["sampler.max_new_tokens"] = tokens
        if cut >= scfg.cut_warning:
            warnings.append(cut_warning_text(cut, evidence.cap))
    rewards, correct = by_budget[tokens], evidence.correct_by_budget()[tokens]
    group = cfg.loop.group_size
    predicted: dict[int, float] = {}
    if "loop.group_size" in auto:
        group, predicted, warning = choose_group_size(rewards, scfg.group_sizes, largest_group(scfg),
                                                      scfg.constant_target, scfg.prior)
        resolved["loop.group_size"] = group
        warnings += [warning] if warning else []
        if not rewards_are_binary(rewards) and not any(c for g in correct for c in g):
            # graded rewards vary between wrong answers of different forms: the prediction counts that contrast
            warnings.append("no probe sample was correct (the task's grader): the groups' contrast is between "
                            "partial-credit rewards of wrong answers, not between right and wrong; an SFT warm-up "
                            "or a prompt that asks for the bare answer would help")
    else:
        predicted = {group: predicted_constant_fraction(rewards, group, scfg.prior, failing_only=True)}
    if "loop.prompts_per_step" in auto:
        resolved["loop.prompts_per_step"] = max(1, scfg.rollouts_per_step // group)
    return SizingDecision(resolved, predicted, cut, warnings, budgets)


def _overlong_floor(cfg: TrainConfig) -> int:
    """A budget below the overlong penalty's buffer (which counts towards max_new_tokens when its own
    max_tokens is unset) would be refused: the floor of an auto max_new_tokens."""
    overlong = cfg.task.overlong_reward
    return overlong.buffer + 1 if overlong.buffer > 0 and overlong.max_tokens is None else MIN_TOKENS


# ------------------------------------------------------------------------------------- the config side


def unsizable_reason(cfg: TrainConfig) -> str | None:
    """Why this run's `auto` fields cannot be probed (the probe runs in the sync loop's process, single-turn, on
    the hf sampler, one trainer), or None."""
    return ("loop.mode=" + cfg.loop.mode if cfg.loop.mode != "sync" else
            "trainer.parallel=" + cfg.trainer.parallel if cfg.trainer.parallel != "none" else
            "sampler.backend=" + cfg.sampler.backend if cfg.sampler.backend != "hf" else
            "task.env.name=" + cfg.task.env.name if cfg.task.env.name else
            "task.name=verifiers" if cfg.task.name == "verifiers" else
            "task.agent" if cfg.task.agent.enabled else None)


def fallback_sizes(cfg: TrainConfig) -> dict[str, int]:
    """The numbers an `auto` field takes where no probe sizes it (`sizing.fallback_*`), for the auto fields."""
    scfg = cfg.sizing
    numbers = {"sampler.max_new_tokens": scfg.fallback_max_new_tokens, "loop.group_size": scfg.fallback_group_size,
               "loop.prompts_per_step": scfg.fallback_prompts_per_step}
    return {k: numbers[k] for k in auto_fields(cfg)}


def fixed_sizes(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its `auto` fields at the fallback numbers: for what builds a sampler or a trainer from a config
    without a run around it (the API's clients, `covrl eval`)."""
    return resolve_config(cfg, fallback_sizes(cfg)) if auto_fields(cfg) else cfg


def resolve_config(cfg: TrainConfig, resolved: dict[str, int]) -> TrainConfig:
    """`cfg` with the dotted fields of `resolved` set, validated whole again (the checks that skipped auto run)."""
    data = cfg.model_dump()
    for dotted, value in resolved.items():
        section, name = dotted.split(".")
        data[section][name] = int(value)
    return type(cfg).model_validate(data)


# ------------------------------------------------------------------------------------------- the probe


def _probe(cfg: TrainConfig, c, build_sampler_fn) -> ProbeEvidence:
    """Sample the model RL starts from on the stream's next `probe_prompts` prompts (the stream does not advance),
    `probe_samples` each, with the run's sampler settings at the probe's budget (a typed max_new_tokens: that
    budget), and score them; with an auto max_new_tokens, score them again truncated to each smaller budget of
    `budget_grid`."""
    scfg, stream, task, tokenizer = cfg.sizing, c.stream, c.task, c.tokenizer
    k = min(scfg.probe_prompts, len(stream.items))
    examples = [stream.items[stream.index_at(p)] for p in range(stream.position, stream.position + k)]
    prompts = [task.encode(tokenizer, ex) for ex in examples]
    sized = cfg.sampler.max_new_tokens == AUTO
    cap = scfg.probe_max_new_tokens if sized else int(cfg.sampler.max_new_tokens)
    context = getattr(getattr(c.model, "config", None), "max_position_embeddings", None)
    if context and sized:   # the prompt and the response fit the model's positions
        cap = min(cap, int(context) - max(len(p) for p in prompts))
        if cap < MIN_TOKENS:
            raise ValueError(f"sizing: the model's context ({context} positions) leaves {cap} tokens after the "
                             "longest probed prompt; set sampler.max_new_tokens to a number")
    sampler = build_sampler_fn(cfg.sampler.model_copy(update={"max_new_tokens": cap}), c.model, tokenizer)
    m = scfg.probe_samples
    budget = task.response_budget
    try:
        generator = torch.Generator().manual_seed(cfg.run.seed + PROBE_SEED_OFFSET)
        batch = sampler.generate(prompts, m, generator=generator, policy_version=0)
    finally:
        del sampler
    lengths = [int(n) for n in batch.response_mask.sum(1).tolist()]
    rewards_at, correct_at = {}, {}
    try:
        for b in (budget_grid(cap, _overlong_floor(cfg)) if sized else [cap]):
            # the overlong penalty (if any) counts towards the budget being scored
            task.response_budget = b
            mask = batch.response_mask.clone()
            mask[:, b:] = 0   # the first b tokens of each sample: a sample of the sampler at budget b
            cut = replace(batch, response_mask=mask)
            scored = score_rollouts(task, tokenizer, cut, examples, m)
            rewards = scored.sequence_rewards.tolist()
            correct = [bool(x) for x in (scored.correct if scored.correct is not None else [r >= 1.0 for r in rewards])]
            rewards_at[b] = [rewards[i * m:(i + 1) * m] for i in range(k)]
            correct_at[b] = [correct[i * m:(i + 1) * m] for i in range(k)]
    finally:
        task.response_budget = budget
    return ProbeEvidence(lengths=lengths, cap=cap, rewards=rewards_at.pop(cap), correct=correct_at.pop(cap),
                         rewards_at=rewards_at, correct_at=correct_at)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def describe(record: dict[str, Any]) -> str:
    """The compact block printed at the start of a sized run."""
    ev, pred, config = record["evidence"], record["predicted_failing"], record["config"]
    lengths = ev["length_to_eos"]
    q = f"p{round(100 * record['rule']['length_quantile'])}"
    tokens = config["sampler.max_new_tokens"]
    at = ev.get("by_budget", {}).get(str(tokens), {"pass_rate": ev["pass_rate_mean"], "cut_frac": ev["cut_frac"]})
    lines = [f"sizing: probe of {ev['prompts']} prompts x {ev['samples_per_prompt']} samples at up to {ev['cap']} "
             f"tokens ({record['time/probe_s']:.1f} s)"]
    length = (f"lengths to EOS p50 {lengths['p50']} / {q} {lengths[q]} / max {lengths['max']}" if lengths
              else "no sample ended before the budget")
    lines.append(f"  {length}, {ev['cut_frac']:.0%} cut at {ev['cap']}")
    if record.get("budgets"):
        table = ", ".join(f"{b}: {1000 * row['signal_per_cost']:.2f}" for b, row in record["budgets"].items())
        lines.append(f"  reward variance per 1000 tokens of step cost, by budget: {table}")
    chosen = "" if "sampler.max_new_tokens" in record["auto"] else " (as set)"
    lines.append(f"  -> sampler.max_new_tokens={tokens}{chosen}: pass rate {at['pass_rate']:.0%}, {at['cut_frac']:.0%} "
                 "cut")
    constant = ", ".join(f"G={g} {p:.0%}" for g, p in pred.items())
    lines.append(f"  groups without a correct answer predicted there: {constant} -> "
                 f"loop.group_size={config['loop.group_size']}, "
                 f"loop.prompts_per_step={config['loop.prompts_per_step']}")
    return "\n".join(lines)


def probe_record(cfg: TrainConfig, c, build_sampler_fn) -> tuple[dict[str, Any], SizingDecision]:
    """The probe and the rule, nothing written and nothing trained: (the sizing record as sizing.json holds it,
    less the resolved config, and the decision). `c`: the run's components (build_components(cfg), after any SFT
    warm-up). Studies call it to see what `auto` would choose without a run."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    evidence = _probe(cfg, c, build_sampler_fn)
    decision = decide(evidence, cfg)
    record = {"auto": auto_fields(cfg), "resolved": decision.resolved,
              "evidence": evidence.summary(cfg.sizing.length_quantile),
              "predicted_failing": {str(g): p for g, p in decision.predicted_failing.items()},
              "budgets": {str(b): row for b, row in decision.budgets.items()},
              "warnings": decision.warnings, "time/probe_s": time.perf_counter() - t0,
              "time/probe_cpu_s": time.process_time() - cpu0, "rule": cfg.sizing.model_dump(mode="json"),
              # what the rule saw, sample by sample (prompt-major), so that another rule can be applied to it
              "samples": {"lengths": evidence.lengths, "rewards": evidence.rewards, "correct": evidence.correct,
                          "rewards_at": {str(b): r for b, r in evidence.rewards_at.items()},
                          "correct_at": {str(b): c for b, c in evidence.correct_at.items()}}}
    return record, decision


def size_run(cfg: TrainConfig, c, run_dir: Path, *, resumed: bool, build_sampler_fn,
             console: bool = True) -> tuple[TrainConfig, dict[str, Any] | None, float]:
    """(the resolved config, the sizing record or None, probe seconds). A config without `auto` comes back as it
    is; one the probe cannot size (`unsizable_reason`) gets the fallback numbers, with a warning. Resumed (a checkpoint loaded): the numbers of the run folder's sizing.json, no probe. Fresh: the probe,
    the rule, sizing.json and the block on the console. Either way config.yaml is rewritten with the numbers and
    the task's overlong budget follows the resolved max_new_tokens."""
    auto = auto_fields(cfg)
    if not auto:
        return cfg, None, 0.0
    why = unsizable_reason(cfg)
    if why:   # no probe here: the fallback numbers, the same on a resume
        fallback = fallback_sizes(cfg)
        out = resolve_config(cfg, fallback)
        if not resumed:
            print(f"warning: sizing: {', '.join(auto)}=auto is sized by a probe of the sync loop's hf sampler on "
                  f"single-turn completions, with one trainer; this run has {why}: "
                  f"{', '.join(f'{k}={v}' for k, v in fallback.items())} (sizing.fallback_*)",
                  file=sys.stderr, flush=True)
        (Path(run_dir) / "config.yaml").write_text(dump_config(out))
        if c.task.cfg.overlong_reward.max_tokens is None:
            c.task.response_budget = out.sampler.max_new_tokens
        return out, None, 0.0
    path = Path(run_dir) / SIZING_FILE
    probe_s = 0.0
    if resumed:
        try:
            record = json.loads(path.read_text())
            recorded = record["resolved_all"]
        except (OSError, ValueError, KeyError) as err:
            raise FileNotFoundError(f"--resume: {', '.join(auto)} are auto and {path} does not hold the numbers "
                                    f"the run was sized with ({type(err).__name__}); set them to the run's "
                                    "values (its config.yaml)") from None
        resolved = {k: int(recorded[k]) for k in auto}
        record = {**record, "auto": auto}   # what this attempt resolved from the file (an adapter reads it)
    else:
        record, decision = probe_record(cfg, c, build_sampler_fn)
        resolved, probe_s = decision.resolved, record["time/probe_s"]
    out = resolve_config(cfg, resolved)
    if not resumed:
        record["config"] = {f"{s}.{f}": getattr(getattr(out, s), f) for s, f in AUTO_FIELDS}
        record["resolved_all"] = record["config"]
        _write_json(path, record)
        if console and cfg.logging.console:
            print(describe(record | {"predicted_failing": decision.predicted_failing}), flush=True)
        for warning in decision.warnings:
            print(f"warning: sizing: {warning}", file=sys.stderr, flush=True)
    (Path(run_dir) / "config.yaml").write_text(dump_config(out))
    if c.task.cfg.overlong_reward.max_tokens is None:
        c.task.response_budget = out.sampler.max_new_tokens
    return out, record, probe_s


# ------------------------------------------------------------------------------------ while it runs


def groups_of(batch) -> list[list[float]]:
    """Each group's rewards in a step's scored rollouts, by group id."""
    by_group: dict[int, list[float]] = {}
    for g, r in zip(batch.group_ids.tolist(), batch.sequence_rewards.tolist()):
        by_group.setdefault(int(g), []).append(float(r))
    return [by_group[g] for g in sorted(by_group)]


def failing_fraction(groups: Sequence[Sequence[float]]) -> float:
    """The fraction of `groups` (each one's rewards) that are constant below 1: no answer right, no contrast."""
    return sum(1 for g in groups if len(set(g)) == 1 and g[0] < 1.0) / max(len(groups), 1)


def solved_fraction(groups: Sequence[Sequence[float]]) -> float:
    """The fraction of `groups` that are constant at 1 or more: every answer right (a solved prompt)."""
    return sum(1 for g in groups if len(set(g)) == 1 and g[0] >= 1.0) / max(len(groups), 1)


def probe_cut_and_wrong(samples: dict[str, Any] | None, cap: int) -> dict[int, float]:
    """For each budget the probe scored (sizing.json's `samples`: lengths, and verdicts at each budget and at the
    cap), the fraction of its samples that reached that budget and were not correct there; {} without samples."""
    if not samples or not samples.get("lengths"):
        return {}
    lengths = [int(n) for n in samples["lengths"]]
    verdicts = {int(b): c for b, c in samples.get("correct_at", {}).items()} | {int(cap): samples["correct"]}
    return {budget: cut_wrong_share(lengths, correct, budget) for budget, correct in verdicts.items()}


def cuts_more_than_probe(step_frac: float, step_n: int, probe_frac: float, probe_n: int, z: float) -> bool:
    """Whether a step's fraction of responses cut short of a correct answer (`step_frac` of `step_n`) exceeds the
    probe's at the same budget (`probe_frac` of `probe_n` samples) by at least `z` standard errors of the
    difference (two-proportion z with the pooled fraction). Equal fractions never do; with no variance at all
    (both 0 or both 1) only a strictly larger step fraction does."""
    diff = step_frac - probe_frac
    if diff <= 0:
        return False
    pooled = (step_frac * step_n + probe_frac * probe_n) / max(step_n + probe_n, 1)
    se = math.sqrt(max(pooled * (1 - pooled), 0.0) * (1 / max(step_n, 1) + 1 / max(probe_n, 1)))
    return se == 0 or diff / se >= z


def cut_and_wrong_fraction(batch, max_new_tokens: int) -> float:
    """The fraction of a step's responses that reached the budget and are not correct (the grader's verdict, else
    a reward below 1)."""
    cut = (batch.response_mask.sum(1) >= max_new_tokens).tolist()
    correct = batch.correct if getattr(batch, "correct", None) is not None else \
        [r >= 1.0 for r in batch.sequence_rewards.tolist()]
    return sum(1 for c, ok in zip(cut, correct) if c and not ok) / max(len(cut), 1)


class SizingAdapter:
    """`sizing.adapt` while the run goes, for the fields the probe sized (a typed value is never changed):

    budget  an auto max_new_tokens x `adapt_factor` (rounded up to a multiple of 8, at most `cap`, the probe's
            budget) after `adapt_steps` steps in a row in which more than `adapt_cut_rate` of the responses
            were cut and not correct, more of them than of the probe's samples at that budget
            (`cuts_more_than_probe`, `probe_cut_wrong`: the probe's fraction at each budget it scored; the largest
            such budget at or below the current one is compared), and more than `constant_target` of the groups had
            no correct answer. Cutting is the probe's choice where the cut answers still score, where the steps
            still carry contrast, or where the probe saw as many answers cut: on a task the model mostly fails,
            most answers are cut and wrong at any budget the probe could choose, and growing it only makes steps
            longer and teaches longer answers
    groups  with auto loop.group_size and loop.prompts_per_step: after every `adapt_group_steps` steps, the
            probe's group-size rule (`choose_group_size`) applied to the rewards of those steps' groups; a new G
            keeps sizing.rollouts_per_step (prompts_per_step = rollouts // G), and the window starts again

    Checkpointed with the run (`run.register("sizing", ...)`): a resumed run samples with the sizes the
    uninterrupted one had. Each step's record gets the sizes of the next step (`sizing/max_new_tokens`,
    `sizing/group_size`, `sizing/prompts_per_step`)."""

    def __init__(self, run, cap: int, *, tokens: bool = True, groups: bool = False,
                 probe_cut_wrong: dict[int, float] | None = None, probe_samples: int = 0):
        self.run = run
        self.cap = int(cap)
        self.probe_cut_wrong = dict(probe_cut_wrong or {})
        self.probe_samples = int(probe_samples)
        self.sized_max_new_tokens = int(run.cfg.sampler.max_new_tokens)   # the probe's choice: evaluations use it
        self.tokens, self.groups = tokens, groups
        self.streak = 0
        self.changes: list[dict[str, int]] = []         # the budget's
        self.group_changes: list[dict[str, Any]] = []
        self.window: list[list[float]] = []              # rewards of each group of the current window's steps
        self.window_steps = 0
        self.warned = False
        self.warned_groups = False

    @property
    def max_new_tokens(self) -> int:
        return int(self.run.cfg.sampler.max_new_tokens)

    @property
    def group_size(self) -> int:
        return int(self.run.cfg.loop.group_size)

    def _set(self, tokens: int) -> None:
        run = self.run
        run.cfg.sampler.max_new_tokens = tokens   # validate_assignment checks it
        if getattr(run.sampler, "cfg", None) is not None and run.sampler.cfg is not run.cfg.sampler:
            run.sampler.cfg = run.sampler.cfg.model_copy(update={"max_new_tokens": tokens})
        if run.task.cfg.overlong_reward.max_tokens is None:
            run.task.response_budget = tokens

    def _set_group(self, group: int) -> None:
        loop = self.run.cfg.loop
        prompts = max(1, self.run.cfg.sizing.rollouts_per_step // group)
        # one validated copy: the two fields change together (each assignment alone would be checked alone)
        self.run.cfg.loop = type(loop).model_validate({**loop.model_dump(), "group_size": group,
                                                       "prompts_per_step": prompts})

    @contextlib.contextmanager
    def evaluation_budget(self):
        """Evaluate at the budget the probe chose, so that evaluations before and after a change compare; the
        training budget is restored after."""
        current = self.max_new_tokens
        if not self.tokens or current == self.sized_max_new_tokens:
            yield
            return
        self._set(self.sized_max_new_tokens)
        try:
            yield
        finally:
            self._set(current)

    def observe(self, record: dict[str, Any], batch=None) -> None:
        """After a step's record is made (its cut rate at the budget it sampled with) and before it is logged:
        change the sizes when due. `batch`: the step's scored rollouts (rewards and group ids), for the groups."""
        if self.tokens:
            self._observe_cut(record, batch)
            record["sizing/max_new_tokens"] = float(self.max_new_tokens)
        if self.groups:
            if batch is not None:
                self._observe_groups(batch)
            record["sizing/group_size"] = float(self.group_size)
            record["sizing/prompts_per_step"] = float(self.run.cfg.loop.prompts_per_step)

    def _observe_cut(self, record: dict[str, Any], batch) -> None:
        scfg = self.run.cfg.sizing
        # a cut answer costs something only where it failed and its step lacks contrast: the probe chose a budget
        # that cuts, and a group that is constant because every answer is right needs no more tokens
        cut_wrong = cut_and_wrong_fraction(batch, self.max_new_tokens) if batch is not None else \
            record.get("response/at_max_frac", 0.0)
        failing = failing_fraction(groups_of(batch)) if batch is not None else 1.0
        cutting = cut_wrong > scfg.adapt_cut_rate and failing > scfg.constant_target and self._cuts_more(
            cut_wrong, len(batch.sequence_rewards) if batch is not None else 1)
        self.streak = self.streak + 1 if cutting else 0
        if self.streak >= scfg.adapt_steps and self.max_new_tokens < self.cap:
            old, new = self.max_new_tokens, min(self.cap, round_up(self.max_new_tokens * scfg.adapt_factor))
            self._set(new)
            self.streak = 0
            self._record(self.changes, {"step": int(self.run.step), "from": old, "to": new}, "warned",
                         f"step {self.run.step}: {scfg.adapt_steps} steps in a row cut more than "
                         f"{scfg.adapt_cut_rate:.0%} of the responses short of a correct answer (more than the "
                         f"probe did at {old} tokens), with more than {scfg.constant_target:.0%} of their groups "
                         f"without one: sampler.max_new_tokens {old} -> "
                         f"{new} (sizing.adapt; at most {self.cap}; each change: sizing/max_new_tokens in "
                         "metrics.jsonl)")

    def _cuts_more(self, cut_wrong: float, responses: int) -> bool:
        """Whether the step cut more answers short than the probe did at the current budget (True without the
        probe's samples: a sizing.json written before they were kept)."""
        scored = [b for b in self.probe_cut_wrong if b <= self.max_new_tokens]
        if not scored or not self.probe_samples:
            return True
        return cuts_more_than_probe(cut_wrong, responses, self.probe_cut_wrong[max(scored)], self.probe_samples,
                                    self.run.cfg.sizing.adapt_cut_z)

    def _record(self, changes: list, change: dict[str, Any], announced: str, text: str) -> None:
        """Keep `change` in `changes`; say `text` on the run's console for the first change of its kind."""
        changes.append(change)
        if not getattr(self, announced):
            setattr(self, announced, True)
            self.run.message(text)

    def _observe_groups(self, batch) -> None:
        scfg = self.run.cfg.sizing
        self.window.extend(groups_of(batch))
        self.window_steps += 1
        if self.window_steps < scfg.adapt_group_steps:
            return
        old = self.group_size
        new, predicted, _ = choose_group_size(self.window, scfg.group_sizes, largest_group(scfg),
                                              scfg.constant_target, scfg.prior)
        seen = failing_fraction(self.window)
        self.window, self.window_steps = [], 0
        if new == old:
            return
        self._set_group(new)
        self._record(self.group_changes, {"step": int(self.run.step), "from": old, "to": new, "failing_seen": seen,
                                          "predicted_failing": predicted.get(new)}, "warned_groups",
                     f"step {self.run.step}: {seen:.0%} of the last {scfg.adapt_group_steps} steps' groups had no "
                     f"correct answer; by the probe's rule loop.group_size {old} -> {new}, loop.prompts_per_step "
                     f"{self.run.cfg.loop.prompts_per_step} (sizing.adapt; each change: sizing/group_size in "
                     "metrics.jsonl)")

    def state_dict(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, "streak": self.streak, "changes": list(self.changes),
                "warned": self.warned, "group_size": self.group_size, "group_changes": list(self.group_changes),
                "window": [list(g) for g in self.window], "window_steps": self.window_steps,
                "warned_groups": self.warned_groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state["streak"])
        self.changes = list(state.get("changes", []))
        self.warned = bool(state.get("warned", False))
        self.group_changes = list(state.get("group_changes", []))
        self.window = [list(map(float, g)) for g in state.get("window", [])]
        self.window_steps = int(state.get("window_steps", 0))
        self.warned_groups = bool(state.get("warned_groups", False))
        if int(state["max_new_tokens"]) != self.max_new_tokens:
            self._set(int(state["max_new_tokens"]))
        if "group_size" in state and int(state["group_size"]) != self.group_size:
            self._set_group(int(state["group_size"]))


def attach_adapter(run, record: dict[str, Any] | None) -> SizingAdapter | None:
    """The SizingAdapter of a sized run with `sizing.adapt` on and an auto max_new_tokens, or auto group_size and
    prompts_per_step (registered with the run's checkpointer), else None."""
    if record is None or not run.cfg.sizing.adapt:
        return None
    auto = record.get("auto", [])
    tokens = "sampler.max_new_tokens" in auto
    groups = "loop.group_size" in auto and "loop.prompts_per_step" in auto and len(run.cfg.sizing.group_sizes) > 1
    if not (tokens or groups):
        return None
    samples = record.get("samples")
    adapter = SizingAdapter(run, cap=int(record["evidence"]["cap"]), tokens=tokens, groups=groups,
                            probe_cut_wrong=probe_cut_and_wrong(samples, int(record["evidence"]["cap"])),
                            probe_samples=len(samples["lengths"]) if samples else 0)
    run.register("sizing", adapter)
    return adapter
