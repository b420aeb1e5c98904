"""Held-out evaluation: fixed prompts, greedy and sampled decoding, accuracy by the task's grader, and pass@k
(`eval.pass_at_k`) with the unbiased estimator."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from covrl.rollout.episodes import generate_episodes, score_episodes
from covrl.rollout.text import decode_responses
from covrl.rollout.types import RolloutBatch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021):

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that k of the n samples drawn without replacement hold a correct one; computed as
    1 - prod_{i=n-c+1}^{n} (1 - k / i) (no big binomials). Needs 1 <= k <= n and 0 <= c <= n."""
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _score(task, tokenizer, batch: RolloutBatch, examples: list) -> dict[str, Any]:
    texts = decode_responses(tokenizer, batch)
    scored = task.score(texts, examples, lengths=batch.response_mask.sum(1).long().tolist())
    lengths = batch.response_mask.sum(1)
    n = max(len(texts), 1)
    return {
        "accuracy": sum(bool(c) for c in scored.correct) / n,
        "reward_mean": sum(scored.rewards) / n,
        "length_mean": float(lengths.float().mean()) if len(texts) else 0.0,
        "n": len(texts),
        "examples": [{"prompt": ex.prompt, "answer": ex.answer, "completion": t, "correct": bool(c)}
                     for ex, t, c in list(zip(examples, texts, scored.correct))[:5]],
    }


def _score_episodes(sampler, task, tokenizer, examples: list, gen: torch.Generator, greedy: bool) -> dict[str, Any]:
    """Held-out episodes (one per prompt): accuracy plus the tool-call rate, tool errors per episode and turns."""
    episodes = generate_episodes(sampler, tokenizer, task.environment, examples, 1, generator=gen, greedy=greedy,
                                 chat_template=task.cfg.chat_template, max_turns=task.cfg.env.max_turns)
    scored = score_episodes(task, tokenizer, episodes, examples, 1)
    n = max(len(examples), 1)
    m = scored.task_metrics
    return {
        "accuracy": sum(bool(c) for c in scored.correct) / n,
        "reward_mean": float(scored.rewards.mean()),
        "length_mean": float(scored.train_mask.sum(1).float().mean()),
        "tool_call_rate": m["task/tool_call_rate"], "tool_calls": m["task/tool_calls"],
        "tool_errors": m["task/tool_errors"], "turns": m["task/turns"],
        "n": len(examples),
        "examples": [{"prompt": ex.prompt, "answer": ex.answer, "episode": t, "correct": bool(c)}
                     for ex, t, c in list(zip(examples, scored.texts, scored.correct))[:5]],
    }


def evaluate(sampler, task, tokenizer, examples: list, *, seed: int, greedy: bool = True,
             sampled: bool = True, pass_k: int | None = None, pass_samples: int | None = None,
             agent: Callable[..., dict[str, Any]] | None = None) -> dict[str, Any]:
    """Accuracy on `examples` (the task's held-out prompts): greedy decoding and/or one sample per prompt at
    the sampler's temperature (its own generator seeded with `seed`, so evaluation never moves the training
    RNG). With `pass_k`: `pass_samples` (default k) samples per prompt at the sampler's temperature, graded, and
    out["pass@k"] = {k, n, "pass@k" (mean over prompts of the unbiased estimator), "pass@1", per-prompt correct
    counts}. Settings are recorded with the results. `agent` (task.agent): `agent(examples, generator, greedy, n)`
    plays n episodes per prompt through the agent program and scores them (covrl.train.run.agent_source), in
    place of the task's single-turn prompts."""
    if not examples:
        raise ValueError("evaluation needs held-out prompts: task.n_eval is 0 or the eval file is empty")
    env = getattr(task, "environment", None)
    prompts = [task.encode(tokenizer, ex) for ex in examples] if env is None and agent is None else []
    scfg = getattr(sampler, "cfg", None)
    out: dict[str, Any] = {"settings": {
        "n_prompts": len(examples),
        "max_new_tokens": getattr(scfg, "max_new_tokens", None),
        "temperature": getattr(scfg, "temperature", None),
        "top_p": getattr(scfg, "top_p", None), "top_k": getattr(scfg, "top_k", None),
        "sampler_dtype": getattr(scfg, "dtype", None), "seed": seed,
    }}
    t0 = time.perf_counter()
    modes = [("greedy", True)] if greedy else []
    if sampled:
        modes.append(("sampled", False))
    for name, is_greedy in modes:
        gen = torch.Generator().manual_seed(int(seed))
        if agent is not None:
            out[name] = agent(examples, gen, is_greedy, 1)
            out[name].pop("correct_counts", None)
            continue
        if env is not None:
            out[name] = _score_episodes(sampler, task, tokenizer, examples, gen, is_greedy)
            continue
        batch = sampler.generate(prompts, 1, generator=gen, greedy=is_greedy)
        out[name] = _score(task, tokenizer, batch, examples)
    if pass_k:
        out["pass@k"] = _pass_at_k(sampler, task, tokenizer, prompts, examples, pass_k, pass_samples or pass_k,
                                   seed=seed, agent=agent)
    out["seconds"] = time.perf_counter() - t0
    return out



def _pass_at_k(sampler, task, tokenizer, prompts, examples, k: int, n: int, *, seed: int,
               agent: Callable[..., dict[str, Any]] | None = None) -> dict[str, Any]:
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    gen = torch.Generator().manual_seed(int(seed) + 1)   # not the sampled pass's stream
    if agent is not None:
        counts = agent(examples, gen, False, n)["correct_counts"]
        m = max(len(examples), 1)
        return {"k": k, "n": n, "pass@k": sum(pass_at_k(n, c, k) for c in counts) / m,
                "pass@1": sum(c / n for c in counts) / m, "correct_counts": counts}
    batch = sampler.generate(prompts, n, generator=gen)
    texts = decode_responses(tokenizer, batch)
    scored = task.score(texts, [ex for ex in examples for _ in range(n)],
                        lengths=batch.response_mask.sum(1).long().tolist())
    counts = [sum(bool(c) for c in scored.correct[i * n:(i + 1) * n]) for i in range(len(examples))]
    m = max(len(examples), 1)
    return {"k": k, "n": n, "pass@k": sum(pass_at_k(n, c, k) for c in counts) / m,
            "pass@1": sum(c / n for c in counts) / m, "correct_counts": counts}
