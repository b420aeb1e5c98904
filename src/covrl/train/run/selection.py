"""Prompt selection: spend sampling on prompts whose groups are likely to carry contrast (docs/theory.md §13).

A group of n completions whose rewards are all equal gives a group baseline an advantage of exactly zero: it
costs a generation and a forward/backward and teaches nothing. The selector draws a pool of
`selection.pool_factor · k` candidates from the data stream and keeps k of them by its strategy:

    uniform        the stream's next k (no pool; the default)
    skip_constant  skip a candidate whose last group was constant, except with probability revisit_prob
    curriculum     the candidates whose estimated pass rate is nearest 1/2 (Beta posterior mean)
    thompson       a posterior sample p~ of each candidate's pass rate, the k with the largest
                   P(contrast | p~) = 1 − p~^n − (1 − p~)^n; the posterior is per prompt (Beta, `model=prompt`) or
                   Ensemble++ over the prompt's text features (`model=ensemble`: shared across prompts)

Group sizes (`selection.group_sizes`): `fixed` gives every prompt loop.group_size completions; `adaptive` keeps
the step's budget k·n and splits it by the expected signal of a group, which grows with n·p(1 − p) (the summed
variance of its binary rewards): every prompt gets `selection.min_group_size`, the rest goes to the prompts whose
estimated pass rate p̂ is nearest 1/2, in proportion to p̂(1 − p̂) (largest remainders, ties to stream order).

Every strategy returns k prompts whatever the history says (an all-constant stream cannot stall the run), is
deterministic at a seed and resumes exactly (its state is checkpointed with the stream). The selected stream
optimises the reward under the selected prompt distribution, not under the data's: held-out evaluation stays
on the task's uniform held-out set.
"""

from __future__ import annotations

import math
import random
import zlib
from typing import Any, Literal

import torch
from pydantic import Field

from covrl.settings import Section

__all__ = ["PromptSelector", "SelectionConfig"]


class SelectionConfig(Section):
    strategy: Literal["uniform", "skip_constant", "curriculum", "thompson"] = Field(
        "uniform", description="how the prompts of a step are chosen from a pool of candidates (sync loop): "
                               "uniform (the stream as it comes), skip_constant, curriculum, thompson "
                               "(docs/training.md, 'Prompt selection')")
    pool_factor: int = Field(4, ge=1, le=64, description="candidates drawn from the stream per prompt chosen")
    revisit_prob: float = Field(0.1, ge=0.0, le=1.0, description="skip_constant: probability that a prompt whose "
                                                                 "last group was constant is tried again")
    model: Literal["prompt", "ensemble"] = Field("prompt", description="thompson's posterior: per prompt (Beta) "
                                                                       "or Ensemble++ over text features")
    features: int = Field(64, ge=4, le=4096, description="ensemble: hashed character-trigram features of a prompt")
    particles: int = Field(8, ge=1, le=256, description="ensemble: Ensemble++ particles M")
    prior: tuple[float, float] = Field((1.0, 1.0), description="Beta(a, b) prior of a prompt's pass rate")
    group_sizes: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: loop.group_size completions per prompt; adaptive: the step's budget "
                             "(prompts_per_step x group_size) split by p(1 - p) of each prompt's estimated pass "
                             "rate, at least min_group_size each (single-turn tasks)")
    min_group_size: int = Field(2, ge=1, description="adaptive group sizes: the fewest completions of a prompt")


def contrast_probability(p: float, n: int) -> float:
    """P(a group of n independent completions does not have all-equal binary rewards)."""
    p = min(max(p, 0.0), 1.0)
    return 1.0 - p ** n - (1.0 - p) ** n


class PromptSelector:
    """`take(stream, k, n)` -> (examples, positions) of the chosen prompts; `observe(positions, correct, n)` after
    they are scored; `metrics()` for the step's record; `state_dict` / `load_state_dict`."""

    def __init__(self, cfg: SelectionConfig, seed: int, num_items: int):
        self.cfg = cfg
        self.rng = random.Random(seed * 7_919 + 17)
        self.successes = [0] * num_items
        self.trials = [0] * num_items
        self.last_constant = [False] * num_items
        self.shown = [False] * num_items
        self._predicted: dict[int, float] = {}   # position -> P(contrast) predicted when chosen
        self._step: dict[str, float] = {}
        self._agent = None
        if cfg.strategy == "thompson" and cfg.model == "ensemble":
            from covrl.explore import LinearEnsemblePP

            self._agent = LinearEnsemblePP(cfg.features, M=cfg.particles, prior_var=1.0, noise_var=0.25, seed=seed)

    # ------------------------------------------------------------------------------------------ choose
    def take(self, stream, k: int, n: int) -> tuple[list, list[int]]:
        if self.cfg.strategy == "uniform":
            examples, positions = stream.take(k)
            self._mark(stream, positions, [0.0] * len(positions))
            return examples, positions
        pool, positions = stream.take(k * self.cfg.pool_factor)
        items = [stream.index_at(p) for p in positions]
        scores = getattr(self, f"_score_{self.cfg.strategy}")(pool, items, n)
        order = sorted(range(len(pool)), key=lambda i: (-scores[i], i))[:k]
        order.sort()   # the chosen keep their stream order
        chosen = [positions[i] for i in order]
        self._mark(stream, chosen, [self._contrast_estimate(items[i], n) for i in order])
        return [pool[i] for i in order], chosen

    def group_sizes(self, stream, positions: list[int], n: int) -> list[int]:
        """Completions per chosen prompt: n each (fixed), or the budget len(positions)·n split by p̂(1 − p̂)
        (adaptive, module docstring). Deterministic given the selector's state."""
        k = len(positions)
        if self.cfg.group_sizes == "fixed" or k == 0:
            return [n] * k
        low = min(self.cfg.min_group_size, n)
        weights = [max(self._posterior_mean(stream.index_at(p)) * (1 - self._posterior_mean(stream.index_at(p))),
                       1e-6) for p in positions]
        spare = k * n - k * low
        shares = [spare * w / sum(weights) for w in weights]
        sizes = [low + int(s) for s in shares]
        left = k * n - sum(sizes)
        for i in sorted(range(k), key=lambda i: (-(shares[i] - int(shares[i])), i))[:left]:
            sizes[i] += 1
        self._step_sizes = sizes
        return sizes

    _step_sizes: list[int] | None = None

    def _mark(self, stream, positions: list[int], predicted: list[float]) -> None:
        for p, c in zip(positions, predicted):
            self.shown[stream.index_at(p)] = True
            self._predicted[p] = c

    def _posterior_mean(self, item: int) -> float:
        a, b = self.cfg.prior
        return (a + self.successes[item]) / (a + b + self.trials[item])

    def _contrast_estimate(self, item: int, n: int) -> float:
        return contrast_probability(self._posterior_mean(item), n)

    def _score_skip_constant(self, pool, items, n) -> list[float]:
        # 1 = try, 0 = skip this time (a skipped prompt still fills the step when too few remain)
        return [0.0 if self.last_constant[i] and self.rng.random() >= self.cfg.revisit_prob else 1.0 for i in items]

    def _score_curriculum(self, pool, items, n) -> list[float]:
        return [-abs(self._posterior_mean(i) - 0.5) for i in items]

    def _score_thompson(self, pool, items, n) -> list[float]:
        if self._agent is None:
            a, b = self.cfg.prior
            samples = [self.rng.betavariate(a + self.successes[i], b + self.trials[i] - self.successes[i])
                       for i in items]
        else:
            theta = self._agent.sample_theta()
            samples = [0.5 + float(_features(ex.prompt, self.cfg.features) @ theta) for ex in pool]
        return [contrast_probability(p, n) for p in samples]

    # --------------------------------------------------------------------------------------- feedback
    def observe(self, stream, positions: list[int], correct, n: int | list[int], examples=None) -> None:
        """The scored groups of `positions` (rows position-major, n each, or sizes[g] for group g): their pass
        counts."""
        if correct is None:
            return
        sizes = [n] * len(positions) if isinstance(n, int) else list(n)
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        contrast, brier = [], []
        for g, p in enumerate(positions):
            item = stream.index_at(p)
            rows = [bool(c) for c in correct[starts[g]:starts[g] + sizes[g]]]
            wins = sum(rows)
            self.successes[item] += wins
            self.trials[item] += len(rows)
            constant = wins in (0, len(rows))
            self.last_constant[item] = constant
            contrast.append(0.0 if constant else 1.0)
            predicted = self._predicted.pop(p, None)
            if predicted is not None:
                brier.append((predicted - contrast[-1]) ** 2)
            if self._agent is not None and examples is not None:
                x = _features(examples[g].prompt, self.cfg.features)
                self._agent.update(x, torch.tensor(wins / max(len(rows), 1) - 0.5, dtype=torch.float64))
        self._step = {"selection/contrast_frac": sum(contrast) / max(len(contrast), 1),
                      "selection/never_shown": float(self.shown.count(False))}
        if self.cfg.group_sizes == "adaptive":
            self._step.update({"selection/group_size_min": float(min(sizes, default=0)),
                               "selection/group_size_max": float(max(sizes, default=0))})
        if brier:
            self._step["selection/contrast_brier"] = sum(brier) / len(brier)

    def metrics(self) -> dict[str, float]:
        return dict(self._step)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": list(self.rng.getstate()[1]) + [self.rng.getstate()[0], self.rng.getstate()[2]],
                "successes": list(self.successes), "trials": list(self.trials),
                "last_constant": list(self.last_constant), "shown": list(self.shown),
                "predicted": {str(k): v for k, v in self._predicted.items()},
                "agent": None if self._agent is None else self._agent.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        r = state["rng"]
        self.rng.setstate((r[-2], tuple(r[:-2]), r[-1]))
        self.successes, self.trials = list(state["successes"]), list(state["trials"])
        self.last_constant, self.shown = list(state["last_constant"]), list(state["shown"])
        self._predicted = {int(k): float(v) for k, v in state["predicted"].items()}
        if self._agent is not None and state.get("agent") is not None:
            self._agent.load_state_dict(state["agent"])


def _features(text: str, d: int) -> torch.Tensor:
    """Unit-norm hashed bag of the prompt's character trigrams, [d] float64 (deterministic across processes)."""
    x = torch.zeros(d, dtype=torch.float64)
    for i in range(max(len(text) - 2, 1)):
        x[zlib.crc32(text[i:i + 3].encode()) % d] += 1.0
    return x / max(float(x.norm()), 1e-12) if math.isfinite(float(x.norm())) else x
