"""Base accuracy of SmolLM2-135M-Instruct on the tasks of `python -m studies suite` (before any training): greedy,
the suite's evaluator (covrl's HF sampler, `--max-new-tokens`, the task's grader) on each task's first
`--prompts` held-out prompts. One model load, tasks in turn. A task near 0% or 100% tells the suite nothing.

    python -m studies suite-base-accuracy            # every registered task, 20 prompts
    python -m studies suite-base-accuracy --tasks add2 --prompts 50
"""

from __future__ import annotations

import argparse
import json

import torch
from studies.suite.suite import task_config
from studies.suite.suite_tasks import SUITE_TASKS

from covrl.bench.clock import make_evaluator
from covrl.bench.models import DEFAULT_CACHE, cached_model
from covrl.bench.settings import StepSettings
from covrl.tasks import build_task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", default=",".join(SUITE_TASKS))
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = cached_model("smollm2", args.cache_dir)
    settings = StepSettings(model="smollm2", max_new_tokens=args.max_new_tokens, eval_prompts=args.prompts)
    out = {}
    for name in args.tasks.split(","):
        task = build_task(task_config(name, 0, quick=False, cache=args.cache_dir).task)
        out[name] = make_evaluator(settings, model, tokenizer, task)()
        print(f"{name}: {out[name]:.0%}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
