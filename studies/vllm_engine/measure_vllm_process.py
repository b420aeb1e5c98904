"""Measurements of docs/engines.md ("The engine in its own process"): engine start and weight-sync seconds of
the vLLM sampler with the engine in the trainer's process or in its own (`sampler.vllm.engine_process`), the
log-prob floor at equal fp32 weights, and whether torch.set_num_threads still works in this process. One mode
per invocation (an in-process CPU engine changes this process for good):

    .venv-vllm/bin/python -m studies vllm-engine-process [--engine-process] [--tiny] [--syncs 5]
        [--lora-rank R --lora-sync merged|adapter]

With --lora-rank the model gets LoRA adapters on every linear layer (alpha = 2 R, a random B so the adapters
matter) and sync_s is the time per sync of `sampler.vllm.lora_sync` (merged weights or a vLLM LoRA adapter);
B is changed before every sync, as a training step would.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from covrl.config import load_config
from covrl.models import load_model
from covrl.rollout import build_sampler, filtered_logprobs, truncation_rule
from covrl.tasks import build_task
from covrl.train.run.sizing import fixed_sizes

TINY = ["model.source=tiny", "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=128", "model.tiny.max_positions=256"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-process", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="the tiny test model instead of SmolLM2")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--lora-sync", choices=["merged", "adapter"], default="merged")
    args = ap.parse_args()
    over = ["sampler.backend=vllm", "sampler.max_new_tokens=16", "task.chat_template=false",
            f"sampler.vllm.engine_process={str(args.engine_process).lower()}"] + (TINY if args.tiny else [])
    if args.lora_rank:
        over += [f"model.lora.rank={args.lora_rank}", f"model.lora.alpha={2 * args.lora_rank}",
                 f"sampler.vllm.lora_sync={args.lora_sync}"]
    cfg = fixed_sizes(load_config("configs/default.yaml", over))
    task = build_task(cfg.task)
    model, tok = load_model(cfg.model, seed=0)
    model.eval()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    gen = torch.Generator().manual_seed(1)

    def move_adapters():   # what a training step does to a LoRA model: only A and B change
        with torch.no_grad():
            for p in lora_b:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))

    move_adapters()
    prompts = [task.encode(tok, ex) for ex in task.train[: args.prompts]]
    t0 = time.perf_counter()
    sampler = build_sampler(cfg.sampler, model, tok)
    out = {"model": "tiny" if args.tiny else cfg.model.source, "engine_process": args.engine_process,
           "lora_rank": args.lora_rank, "lora_sync": args.lora_sync if args.lora_rank else None,
           "params": sum(p.numel() for p in model.parameters()),
           "import_and_start_s": time.perf_counter() - t0, "engine_start_s": sampler._entry["start_s"],
           "first_sync_s": sampler.last_sync_s}
    batch = sampler.generate(prompts, 4, generator=torch.Generator().manual_seed(0))
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logq = filtered_logprobs(logits[:, batch.prompt_ids.shape[1] - 1: -1], cfg.sampler.temperature,
                             truncation_rule(cfg.sampler))[0]
    logq = logq.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    m = batch.response_mask.bool()
    out["max_abs_dlogp_equal_weights"] = float((logq - batch.sampler_logprobs)[m].abs().max())
    syncs = []
    for v in range(1, args.syncs + 1):
        move_adapters()
        sampler.load_weights(model, v)
        syncs.append(round(sampler.last_sync_s, 3))
    out["sync_s"] = syncs
    want = 2 if torch.get_num_threads() == 1 else 1
    torch.set_num_threads(want)
    out["set_num_threads_works"] = torch.get_num_threads() == want
    print(json.dumps(out))


if __name__ == "__main__":
    main()
