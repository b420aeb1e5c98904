"""The override sets experiments start from: an experiment's config reads as "preset + these overrides"
(`covrl.config.load_preset("tiny", {**ONE_DIGIT_ADDITION, **DRIVEN, ...})`)."""

from __future__ import annotations

# configs/tiny.yaml trains on three-term addition; the reproductions use one-digit addition (100 problems).
ONE_DIGIT_ADDITION = {"task.arithmetic.num_terms": 2, "task.n_train": 1000, "task.n_eval": 50}
# a run driven by an experiment: it evaluates and reports itself, so the run's own evals, checkpoints, console
# and curve plots are off
DRIVEN = {"eval.before": False, "eval.after": False, "checkpoint.at_end": False, "logging.console": False,
          "logging.curves": False}
