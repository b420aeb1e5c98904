"""Training-time clock and held-out evaluation of one side of the covrl-vs-TRL benchmarks (time to accuracy)."""

from __future__ import annotations

import time

from covrl.bench.settings import StepSettings
from covrl.rollout import SamplerConfig, build_sampler
from covrl.train import evaluate


class Clock:
    """Training-time clock of one side, and the held-out evaluation that pauses it.

    `after_step(seconds)` adds a step's time; when `eval_interval_s` of training time has passed since the
    last evaluation it evaluates greedy accuracy (covrl's evaluator and grader, on both sides) and returns the
    extra record fields, including `finished` (target reached unless `stop_at_target` is off, budget spent, or
    the last planned step)."""

    def __init__(self, settings: StepSettings, evaluate_fn, total_steps: int):
        self.settings, self.evaluate_fn, self.total_steps = settings, evaluate_fn, total_steps
        self.train_s = 0.0
        self.steps = 0
        self.last_eval_s = 0.0
        self.reached_at: float | None = None

    def evaluate(self) -> dict:
        t0 = time.perf_counter()
        acc = self.evaluate_fn()
        return {"accuracy": acc, "eval_s": time.perf_counter() - t0, "train_clock_s": self.train_s}

    def after_step(self, seconds: float) -> dict:
        s = self.settings
        self.train_s += seconds
        self.steps += 1
        out: dict = {"train_clock_s": self.train_s}
        if s.eval_interval_s > 0 and (self.train_s - self.last_eval_s >= s.eval_interval_s
                                      or (s.budget_s and self.train_s >= s.budget_s)):
            out.update(self.evaluate())
            self.last_eval_s = self.train_s
            if out["accuracy"] >= s.target_accuracy and self.reached_at is None:
                self.reached_at = self.train_s
        out["finished"] = bool((s.stop_at_target and self.reached_at is not None)
                               or (s.budget_s and self.train_s >= s.budget_s)
                               or self.steps >= self.total_steps)
        return out


def make_evaluator(settings: StepSettings, model, tokenizer, task):
    """Greedy accuracy on the task's first `eval_prompts` held-out prompts, decoded by covrl's HF sampler
    sharing `model`'s weights (so both sides are graded by the same decoder and grader)."""
    sampler = build_sampler(SamplerConfig(max_new_tokens=settings.max_new_tokens, temperature=1.0,
                                          max_batch=64, share_weights="always"), model, tokenizer)
    examples = task.eval[: settings.eval_prompts]

    def accuracy() -> float:
        return float(evaluate(sampler, task, tokenizer, examples, seed=settings.seed + 17, greedy=True,
                              sampled=False)["greedy"]["accuracy"])

    return accuracy
