"""The sampler–trainer gap under truncated sampling on SmolLM2-135M-Instruct: for one engine (vLLM fp32, vLLM
bf16 or covrl's hf sampler) at top-p 0.9 and top-k 20, the fp32 trainer's ratios on the drawn tokens with the
full softmax and with the kept sets replayed (docs/theory.md §12): mean ratio, the fraction of tokens outside
[0.9, 1.1], the effective sample size of the token weights, kl_seq, and the truncation term.

    .venv-vllm/bin/python -m studies truncation-gap --engine vllm --dtype float32
    .venv-vllm/bin/python -m studies truncation-gap --engine vllm --dtype bfloat16
    .venv/bin/python -m studies truncation-gap --engine hf

Each invocation adds its rows to `--out` (default studies/truncation/gap.json) and prints them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from covrl.math.truncation import TruncationRule
from covrl.models import ModelConfig, load_model
from covrl.models.forward import forward_response
from covrl.rollout import SamplerConfig, build_sampler
from covrl.tasks import TaskConfig, build_task
from covrl.train import versions

OUT = Path(__file__).resolve().parent / "gap.json"


def measure(batch, model, temperature: float, rule: TruncationRule) -> dict[str, dict[str, float]]:
    m = batch.response_mask.bool()
    out = {}
    for name, replay in (("full", False), ("replay", True)):
        with torch.no_grad():
            fwd = forward_response(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask,
                                   temperature, with_stats=False, truncation=rule, replay=replay,
                                   kept_counts=batch.sampler_kept)
        lr = (fwd.logprobs - batch.sampler_logprobs).clamp(-20, 20)
        w = lr.exp()[m]
        k3 = (torch.expm1(lr) - lr) * batch.response_mask
        out[name] = {"ratio_mean": float(w.mean()), "outside_0.9_1.1": float(((w < 0.9) | (w > 1.1)).float().mean()),
                     "ess_frac": float(w.sum() ** 2 / (w.numel() * (w ** 2).sum())),
                     "kl_seq": float(k3.sum(1).mean()), "token_k3": float(k3[m].mean()),
                     "kept_mass_mean": float(fwd.truncation.log_kept_mass.exp()[m].mean()),
                     "kl_term": float((-fwd.truncation.log_kept_mass * batch.response_mask).sum(1).mean()),
                     "count_mismatch_frac": float(fwd.truncation.count_mismatch[m].float().mean()),
                     "sampled_outside_frac": float(fwd.truncation.sampled_outside[m].float().mean())}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m studies truncation-gap")
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(ModelConfig(source="smollm2"), seed=0)
    model.eval()
    task = build_task(TaskConfig(name="arithmetic", n_eval=50))
    prompts = [task.encode(tok, ex) for ex in task.train[: args.prompts]]
    rule = TruncationRule(top_k=args.top_k, top_p=args.top_p)
    scfg = SamplerConfig(backend=args.engine, temperature=1.0, top_p=args.top_p, top_k=args.top_k,
                         max_new_tokens=args.max_new_tokens, dtype=args.dtype, share_weights="never",
                         max_batch=args.prompts * args.samples)
    t0 = time.perf_counter()
    sampler = build_sampler(scfg, model, tok)
    sampler.load_weights(model, 0)
    batch = sampler.generate(prompts, args.samples, generator=torch.Generator().manual_seed(0), policy_version=0)
    result = {"engine": args.engine, "dtype": args.dtype, "top_p": args.top_p, "top_k": args.top_k,
              "rows": len(batch), "tokens": int(batch.response_mask.sum()), "kept_sizes_recorded":
              batch.sampler_kept is not None, "seconds": time.perf_counter() - t0,
              "cpu_model": versions()["cpu_model"], "date": time.strftime("%Y-%m-%d"),
              **measure(batch, model, 1.0, rule)}
    rows = json.loads(args.out.read_text()) if args.out.is_file() else []
    rows = [r for r in rows if (r["engine"], r["dtype"]) != (args.engine, args.dtype)] + [result]
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0
