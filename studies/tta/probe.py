"""Base accuracy and answer lengths of SmolLM2-135M-Instruct on the tasks of studies/tta/tasks.py, before any
training: on each task's first `--prompts` held-out prompts, greedy decoding at the task's token budget (accuracy,
response length, cut rate = responses that used the whole budget without an end token), the reference answer's
length in tokens, and `--samples` completions per prompt at T = 1 (sampled accuracy, and the fraction of prompts
whose samples are all equal in reward: the constant-group fraction the default run's group of 4 meets at the
start). Multi-turn tasks (an environment) report covrl's episode evaluation (greedy and one sample per prompt).

    python -m studies.tta.probe --out studies/tta/base.json            # every task, 50 prompts
    python -m studies.tta.probe --tasks rg_gcd,mul1 --prompts 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from covrl.bench.models import DEFAULT_CACHE, cached_model
from covrl.config import load_preset
from covrl.rollout import SamplerConfig, build_sampler
from covrl.rollout.text import decode_responses
from covrl.tasks import build_task
from covrl.train import evaluate
from studies.common import TYPED_DEFAULT_SIZES
from studies.tta.tasks import TTA_TASKS, task_overrides


def cut_flags(batch, eos_id: int | None, budget: int) -> list[bool]:
    """A response is cut when it used the whole budget and its last token is not the end token."""
    lengths = batch.response_mask.sum(1).long().tolist()
    out = []
    for row, n in enumerate(lengths):
        last = int(batch.response_ids[row, n - 1]) if n > 0 else None
        out.append(n >= budget and last != eos_id)
    return out


def probe_single_turn(sampler, task, tokenizer, examples, budget: int, samples: int, seed: int) -> dict:
    prompts = [task.encode(tokenizer, ex) for ex in examples]
    eos = tokenizer.eos_token_id
    greedy = sampler.generate(prompts, 1, generator=torch.Generator().manual_seed(seed), greedy=True)
    texts = decode_responses(tokenizer, greedy)
    lengths = greedy.response_mask.sum(1).long().tolist()
    scored = task.score(texts, examples, lengths=lengths)
    cut = cut_flags(greedy, eos, budget)
    out = {"greedy_accuracy": sum(map(bool, scored.correct)) / len(examples),
           "greedy_length_mean": statistics.fmean(lengths), "greedy_cut_rate": sum(cut) / len(cut),
           "greedy_examples": [{"answer": ex.answer, "completion": t, "correct": bool(c)}
                               for ex, t, c in list(zip(examples, texts, scored.correct))[:4]]}
    if samples:
        batch = sampler.generate(prompts, samples, generator=torch.Generator().manual_seed(seed + 1))
        texts = decode_responses(tokenizer, batch)
        lengths = batch.response_mask.sum(1).long().tolist()
        rows = [ex for ex in examples for _ in range(samples)]
        s = task.score(texts, rows, lengths=lengths)
        rewards = list(map(float, s.rewards))
        groups = [rewards[i * samples:(i + 1) * samples] for i in range(len(examples))]
        cut = cut_flags(batch, eos, budget)
        out.update(sampled_accuracy=sum(map(bool, s.correct)) / len(rows),
                   sampled_length_mean=statistics.fmean(lengths), sampled_cut_rate=sum(cut) / len(cut),
                   constant_group_frac=sum(len(set(g)) == 1 for g in groups) / len(groups),
                   reward_within_group_var=statistics.fmean(statistics.pvariance(g) for g in groups),
                   prompts_any_correct=sum(any(c for c in s.correct[i * samples:(i + 1) * samples])
                                           for i in range(len(examples))) / len(examples))
    return out


def probe_task(name: str, model, tokenizer, prompts: int, samples: int, seed: int = 17) -> dict:
    t0 = time.perf_counter()
    budget = TTA_TASKS[name].max_new_tokens
    cfg = load_preset("default", {**TYPED_DEFAULT_SIZES, **task_overrides(name)})
    task = build_task(cfg.task)
    examples = task.eval[:prompts]
    answer_tokens = [len(tokenizer(ex.answer, add_special_tokens=False)["input_ids"]) for ex in examples]
    sampler = build_sampler(SamplerConfig(max_new_tokens=budget, temperature=1.0, max_batch=64,
                                          share_weights="always"), model, tokenizer)
    out = {"family": TTA_TASKS[name].family, "description": TTA_TASKS[name].description,
           "max_new_tokens": budget, "prompts": len(examples), "train_examples": len(task.train),
           "answer_tokens_mean": statistics.fmean(answer_tokens), "answer_tokens_max": max(answer_tokens)}
    if getattr(task, "environment", None) is not None:
        ev = evaluate(sampler, task, tokenizer, examples, seed=seed, greedy=True, sampled=True)
        out.update(greedy_accuracy=ev["greedy"]["accuracy"], greedy_length_mean=ev["greedy"]["length_mean"],
                   sampled_accuracy=ev["sampled"]["accuracy"], sampled_length_mean=ev["sampled"]["length_mean"],
                   greedy_tool_call_rate=ev["greedy"].get("tool_call_rate"),
                   greedy_examples=ev["greedy"]["examples"][:2])
    else:
        out.update(probe_single_turn(sampler, task, tokenizer, examples, budget, samples, seed))
    out["seconds"] = time.perf_counter() - t0
    task.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TTA_TASKS))
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--samples", type=int, default=4, help="T=1 completions per prompt (0: greedy only)")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    parser.add_argument("--out", default=None, help="JSON file; tasks already in it are kept, others added")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = cached_model("smollm2", args.cache_dir)
    path = Path(args.out) if args.out else None
    results = json.loads(path.read_text()) if path and path.exists() else {}
    for name in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        try:
            results[name] = probe_task(name, model, tokenizer, args.prompts, args.samples)
        except Exception as err:   # one task failing to build is recorded, the others still run
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        r = results[name]
        print(f"{name}: " + ("ERROR " + r["error"] if "error" in r else
                             f"greedy {r['greedy_accuracy']:.0%}, len {r['greedy_length_mean']:.1f}/"
                             f"{r['max_new_tokens']}, cut {r.get('greedy_cut_rate', float('nan')):.0%}, answer "
                             f"{r['answer_tokens_mean']:.1f} tok, sampled {r.get('sampled_accuracy', 0):.0%}, "
                             f"constant groups {r.get('constant_group_frac', float('nan')):.0%}, "
                             f"{r['seconds']:.0f} s"), flush=True)
        if path:
            path.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
