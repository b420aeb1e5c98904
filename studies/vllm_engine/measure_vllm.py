"""Measurements of docs/engines.md: vLLM vs the hf sampler on SmolLM2 (tokens/s, alternating), the log-prob
floor of fp32 / bf16 engines vs the fp32 trainer forward, and weight-sync seconds.

    .venv-vllm/bin/python -m studies vllm-engine [--sizes 1,8,32] [--reps 2] [--out runs/engines.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from covrl.config import load_config
from covrl.models import load_model
from covrl.rollout import build_sampler
from covrl.tasks import build_task
from covrl.train.run.sizing import fixed_sizes


def recompute(model, batch, temperature):
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logits = logits[:, batch.prompt_ids.shape[1] - 1: -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask


def floor(model, batch, temperature):
    m = batch.response_mask.bool()
    lr = recompute(model, batch, temperature) - batch.sampler_logprobs   # log p_trainer - log q_sampler
    k3 = (lr.exp() - 1 - lr) * batch.response_mask
    return {"max_abs_dlogp": float(lr[m].abs().max()), "mean_abs_dlogp": float(lr[m].abs().mean()),
            "k3_token_mean": float(k3[m].mean()), "kl_seq_k1": float((-lr).sum(1).mean()),
            "kl_seq_k3": float(k3.sum(1).mean()), "tokens": int(m.sum())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,8,32")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--floor-prompts", type=int, default=8)
    ap.add_argument("--bf16", action="store_true", help="also start a bf16 engine (5-10x slower on a CPU)")
    ap.add_argument("--out", default="runs/engines.json")
    args = ap.parse_args()
    cfg = fixed_sizes(load_config("configs/default.yaml", [f"sampler.max_new_tokens={args.new_tokens}"]))
    task = build_task(cfg.task)
    model, tok = load_model(cfg.model, seed=0)
    model.eval()
    prompts = [task.encode(tok, ex) for ex in task.train]
    out = {"threads": torch.get_num_threads()}
    hf = build_sampler(cfg.sampler, model, tok)
    t0 = time.perf_counter()
    vl = build_sampler(cfg.sampler.model_copy(update={"backend": "vllm"}), model, tok)
    out["engine_start_s_incl_import"] = time.perf_counter() - t0
    speed = []
    for size in map(int, args.sizes.split(",")):
        for rep in range(args.reps):
            for name, s in (("hf", hf), ("vllm", vl)) if rep % 2 == 0 else (("vllm", vl), ("hf", hf)):
                b = s.generate(prompts[:size], 8, generator=torch.Generator().manual_seed(rep))
                speed.append({"backend": name, "prompts": size, "samples": 8, "rep": rep,
                              "tokens": b.num_response_tokens, "seconds": b.timing.generate_s,
                              "tokens_per_s": b.num_response_tokens / b.timing.generate_s})
                print(speed[-1], flush=True)
    out["speed"] = speed
    batch = vl.generate(prompts[: args.floor_prompts], 8, generator=torch.Generator().manual_seed(11))
    out["floor_fp32_engine"] = floor(model, batch, cfg.sampler.temperature)
    print(out["floor_fp32_engine"], flush=True)
    syncs = []
    for v in range(1, 4):
        vl.load_weights(model, v)
        syncs.append(vl.last_sync_s)
    out["sync_s"] = syncs
    print("sync", syncs, flush=True)
    if not args.bf16:
        json.dump(out, open(args.out, "w"), indent=2)
        return
    bf = build_sampler(cfg.sampler.model_copy(update={"backend": "vllm", "dtype": "bfloat16"}), model, tok)
    b16 = bf.generate(prompts[: args.floor_prompts], 8, generator=torch.Generator().manual_seed(11))
    out["floor_bf16_engine"] = floor(model, b16, cfg.sampler.temperature)
    out["bf16_tokens_per_s"] = b16.num_response_tokens / b16.timing.generate_s
    print(out["floor_bf16_engine"], out["bf16_tokens_per_s"], flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
