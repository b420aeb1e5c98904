"""Eager vs compiled (sampler.compile, inductor) hf sampler on SmolLM2 over several seeds: rows with identical
tokens and masks, max |d log q| on those rows, and where the first row diverges (row, step, log q eager /
compiled of the drawn tokens, max |d log q| before it). studies/sampler_compile/README.md.

    OMP_NUM_THREADS=1 python -m studies sampler-compile [--seeds 8] [--rows 16]
"""

from __future__ import annotations

import argparse
import json

import torch

from covrl.bench.models import DEFAULT_CACHE, cached_model
from covrl.bench.rollout_bench import compile_first_call
from covrl.bench.settings import StepSettings, build_bench_task, default_task_overrides
from covrl.rollout import SamplerConfig, build_sampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16, help="rows = 4 prompts x rows/4")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = cached_model("smollm2", args.cache_dir, "float32")
    model.eval()
    settings = StepSettings(model="smollm2", max_new_tokens=args.max_new_tokens,
                            task=default_task_overrides("smollm2"))
    _, prompts = build_bench_task(settings, tok)
    base = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "max_batch": args.rows}
    eager = build_sampler(SamplerConfig(**base), model, tok)
    compiled = build_sampler(SamplerConfig(**base, compile=True), model, tok)
    unique, n = prompts[:4], args.rows // 4
    for seed in range(args.seeds):
        row = compile_first_call(eager, compiled, unique, n, seed=seed)
        a, b = (s.generate(unique, n, generator=torch.Generator().manual_seed(seed)) for s in (eager, compiled))
        T = min(a.response_ids.shape[1], b.response_ids.shape[1])
        first = None
        for i in range(len(a.response_ids)):
            d = (a.response_ids[i, :T] != b.response_ids[i, :T]).nonzero()
            if len(d) and (first is None or int(d[0]) < first[1]):
                t = int(d[0])
                before = (a.sampler_logprobs[i, :t] - b.sampler_logprobs[i, :t]).abs()
                first = (i, t, float(a.sampler_logprobs[i, t]), float(b.sampler_logprobs[i, t]),
                         float(before.max()) if t else 0.0)
        print(seed, json.dumps({**row, "first_divergence": first}), flush=True)


if __name__ == "__main__":
    main()
