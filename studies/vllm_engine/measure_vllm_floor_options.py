"""Engine floor of a real hybrid engine vs engine options (docs/engines.md): for fp32 and bf16 vLLM
engines with prefix caching and chunked prefill on and off, the sampler's log-probs against the fp32 trainer's
forward on the same rows (token k3, kl_seq as the summed k3 per sequence, chi^2 = E_q[(p/q - 1)^2] per token,
max |d log p|). Short prompts (the demo task, < one 128-token KV block, so never prefix-cached on the CPU build)
and long prompts (the same problems after a ~300-token instruction, which the cache does reuse across the 8
samples of a prompt).

    .venv-vllm/bin/python -m studies vllm-floor-options [--prompts 4] [--out runs/engine_floor_options.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from covrl.config import load_config
from covrl.models import load_model
from covrl.rollout import build_sampler
from covrl.tasks import build_task
from covrl.train.run.sizing import fixed_sizes

LONG_INSTRUCTION = ("You are a careful arithmetic assistant. Read the problem, compute the result exactly, and "
                    "answer with just the number, with no words, units or punctuation. ") * 8


def floor(model, batch, temperature: float) -> dict[str, float]:
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logits = logits[:, batch.prompt_ids.shape[1] - 1: -1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    m = batch.response_mask.bool()
    # float64: at the fp32 floor (|d log p| ~ 1e-5) exp(lr) - 1 - lr in float32 is rounding noise
    lr = ((logp - batch.sampler_logprobs) * batch.response_mask).double()   # log p_trainer - log q_sampler
    k3 = (lr.exp() - 1 - lr) * batch.response_mask
    chi2 = ((lr.exp() - 1) ** 2) * batch.response_mask
    return {"max_abs_dlogp": float(lr[m].abs().max()), "mean_abs_dlogp": float(lr[m].abs().mean()),
            "k3_token_mean": float(k3[m].mean()), "kl_seq_k3": float(k3.sum(1).mean()),
            "chi2_token_mean": float(chi2[m].mean()), "tokens": int(m.sum()),
            "prompt_tokens_max": int(batch.prompt_mask.sum(1).max())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--out", default="runs/engine_floor_options.json")
    args = ap.parse_args()
    cfg = fixed_sizes(load_config("configs/default.yaml", []))
    task = build_task(cfg.task)
    model, tok = load_model(cfg.model, seed=0)
    model.eval()
    examples = task.train[: args.prompts]
    short = [task.encode(tok, ex) for ex in examples]
    long = [tok(LONG_INSTRUCTION, add_special_tokens=False)["input_ids"] + p for p in short]
    rows = []
    for dtype, prefix, chunked in itertools.product(("float32", "bfloat16"), (True, False), (True, False)):
        sampler_cfg = cfg.sampler.model_copy(deep=True, update={"backend": "vllm", "dtype": dtype})
        sampler_cfg.vllm = sampler_cfg.vllm.model_copy(update={"enable_prefix_caching": prefix,
                                                               "enable_chunked_prefill": chunked})
        t0 = time.perf_counter()
        sampler = build_sampler(sampler_cfg, model, tok)
        start_s = time.perf_counter() - t0
        for name, prompts in (("short", short), ("long", long)):
            batch = sampler.generate(prompts, args.samples, generator=torch.Generator().manual_seed(11))
            row = {"dtype": dtype, "prefix_caching": prefix, "chunked_prefill": chunked, "prompts": name,
                   "engine_start_s": start_s, **floor(model, batch, cfg.sampler.temperature)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
