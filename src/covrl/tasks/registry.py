"""name -> builder(cfg: TaskConfig) -> Task. Builders are imported lazily so the config can validate names
without importing every task module."""

from __future__ import annotations

import importlib

# name -> "module:function"
TASKS: dict[str, str] = {
    "arithmetic": "covrl.tasks.builtin:build_arithmetic",
    "count_letters": "covrl.tasks.builtin:build_count_letters",
    "sort_letters": "covrl.tasks.builtin:build_sort_letters",
    "fib_chain": "covrl.tasks.builtin:build_fib_chain",
    "jsonl": "covrl.tasks.datasets:build_jsonl",
    "hf_dataset": "covrl.tasks.datasets:build_hf_dataset",
    "reasoning_gym": "covrl.tasks.procedural:build_reasoning_gym",   # extra covrl[reasoning]
    "verifiers": "covrl.tasks.verifiers_env:build_verifiers",         # extra covrl[envs]
}


def get_builder(name: str):
    if name not in TASKS:
        raise ValueError(f"task.name={name!r}; allowed: {sorted(TASKS)}")
    module, func = TASKS[name].split(":")
    return getattr(importlib.import_module(module), func)
