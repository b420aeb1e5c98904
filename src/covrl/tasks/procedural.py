"""`task.name: reasoning_gym`: a reasoning-gym procedural dataset as a task (extra `covrl[reasoning]`).

reasoning-gym generates item i of a dataset from `Random(seed + i)`, locally (no download). One dataset of
n_eval + size items is generated with `task.seed`: items [0, n_eval) are the held-out set and items
[n_eval, n_eval + size) the training pool, so the two come from disjoint generator seeds; a training item whose
question equals a held-out one (small problem spaces) is dropped as well. `task.n_train` examples cycle through
the pool in seeded epochs, like a JSONL task. Prompt = the item's question (chat template or plain, as every
task); answer = its reference answer (the SFT demonstration); reward and grader = the dataset's own scorer
(`covrl.tasks.graders.reasoning_gym_reward`; correct = score 1)."""

from __future__ import annotations

import json
import random

from covrl.tasks.base import Example, cycle_epochs
from covrl.tasks.config import TaskConfig
from covrl.tasks.graders import reasoning_gym
from covrl.tasks.task import Task, held_out_count


def reasoning_gym_examples(cfg: TaskConfig) -> tuple[list[Example], list[Example]]:
    """(train pool, eval set) of the configured dataset; see the module docstring."""
    rcfg = cfg.reasoning_gym
    rg = reasoning_gym()
    size = rcfg.size or cfg.n_train
    n_eval = held_out_count(cfg, None)   # task.n_eval, else the default count
    try:
        data = rg.create_dataset(rcfg.dataset, seed=cfg.seed, size=n_eval + size, **rcfg.options)
    except (ValueError, TypeError, AssertionError) as err:   # unknown name or option, or an option out of range
        raise ValueError(f"task.reasoning_gym: cannot create dataset {rcfg.dataset!r} with options "
                         f"{rcfg.options}: {type(err).__name__}: {err}") from None
    options_json = json.dumps(rcfg.options, sort_keys=True)

    def example(i: int) -> Example:
        entry = data[i]
        return Example(prompt=entry["question"], answer=str(entry["answer"]),
                       meta={"rg_dataset": rcfg.dataset, "rg_options": options_json, "rg_entry": entry,
                             "rg_index": i})

    eval_set = [example(i) for i in range(n_eval)]
    held_out = {e.prompt for e in eval_set}
    pool = [ex for ex in (example(i) for i in range(n_eval, n_eval + size)) if ex.prompt not in held_out]
    if not pool:
        raise ValueError(f"task.reasoning_gym: every training problem of {rcfg.dataset!r} also occurs in the "
                         "eval set; raise task.reasoning_gym.size or widen the dataset's options")
    return pool, eval_set


def build_reasoning_gym(cfg: TaskConfig) -> Task:
    pool, eval_set = reasoning_gym_examples(cfg)
    train = cycle_epochs(pool, cfg.n_train, random.Random(cfg.seed))
    return Task(cfg, train, eval_set, default_reward="reasoning_gym", default_grader="reasoning_gym")
