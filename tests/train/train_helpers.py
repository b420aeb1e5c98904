"""Shared helpers for the trainer/loop tests: a tiny config and synthetic rollout batches."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from covrl.config import load_preset
from covrl.rollout.types import RolloutBatch

# metrics that measure wall time (differ between identical runs)
TIME_PREFIXES = ("time/",)
TIME_KEYS = {"tokens_per_s", "generate_tokens_per_s", "train_tokens_per_s"}


def tiny_cfg(tmp_path=None, **over):
    """A TrainConfig for a 1-layer tiny Llama on one-digit addition (seconds per run): configs/tiny.yaml made
    smaller and shorter, evaluations before and after, a checkpoint at the end."""
    overrides = {
        "run.name": None, "model.tiny.hidden_size": 32, "model.tiny.num_layers": 1, "model.tiny.num_heads": 2,
        "model.tiny.intermediate_size": 64, "model.tiny.max_positions": 48,
        "task.arithmetic.num_terms": 2, "task.n_train": 64, "task.n_eval": 8,
        "sampler.max_batch": 64, "sft_warmup.steps": 3, "sft_warmup.lr": 1e-3, "sft_warmup.batch_size": 16,
        "optim.lr": 3e-3, "optim.micro_batch_size": 32, "loop.steps": 3, "loop.prompts_per_step": 4,
        "loop.group_size": 4, "eval.max_prompts": 4, "logging.console": False, "logging.curves": False,
    }
    if tmp_path is not None:
        overrides["run.output_dir"] = str(tmp_path)
    overrides.update(over)
    return load_preset("tiny", overrides)


def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIME_PREFIXES) and k not in TIME_KEYS}
            for r in records]


def synthetic_batch(model, *, groups=3, group_size=4, prompt_len=5, max_len=6, vocab=None, seed=0,
                    topk=0, noise=0.05, temperature=1.0, shared_prompts=True) -> RolloutBatch:
    """A scored batch with random prompts (one per group unless shared_prompts=False) and responses of varying
    lengths (left-padded prompts, right-padded responses), sampler log-probs = the model's own log-probs +
    noise, binary rewards."""
    from covrl.train.step.trainer import forward_batch

    g = torch.Generator().manual_seed(seed)
    vocab = vocab or model.config.vocab_size
    rows = groups * group_size
    prompt_ids = torch.randint(4, vocab, (rows, prompt_len), generator=g)
    prompt_mask = torch.ones(rows, prompt_len)
    for i in range(rows):  # some left padding
        pad = int(torch.randint(0, 2, (1,), generator=g))
        prompt_ids[i, :pad] = 0
        prompt_mask[i, :pad] = 0
    if shared_prompts:  # every row of a group answers the same prompt, as a sampler produces them
        first = torch.arange(groups).repeat_interleave(group_size) * group_size
        prompt_ids, prompt_mask = prompt_ids[first], prompt_mask[first]
    lengths = torch.randint(1, max_len + 1, (rows,), generator=g)
    lengths[0] = max_len
    response_mask = (torch.arange(max_len)[None] < lengths[:, None]).float()
    response_ids = torch.randint(4, vocab, (rows, max_len), generator=g) * response_mask.long()
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                         response_mask=response_mask, sampler_logprobs=torch.zeros(rows, max_len),
                         group_ids=torch.arange(groups).repeat_interleave(group_size),
                         policy_version=torch.zeros(rows, dtype=torch.long))
    with torch.no_grad():
        lp = forward_batch(model, batch, temperature, with_stats=False).logprobs
        batch = replace(batch, sampler_logprobs=(lp + noise * torch.randn(lp.shape, generator=g)) * response_mask)
        if topk:
            ids = torch.cat([batch.response_ids[..., None],
                             torch.randint(4, vocab, (rows, max_len, topk - 1), generator=g)], -1)
            batch = replace(batch, sampler_topk_ids=ids)
            out = forward_batch(model, batch, temperature, with_stats=False, topk_ids=ids)
            batch = replace(batch, sampler_topk_logprobs=out.topk_logprobs + noise * torch.randn(
                out.topk_logprobs.shape, generator=g))
    rewards = torch.randint(0, 2, (rows,), generator=g).float()
    rewards[:group_size] = torch.tensor([1.0, 0.0] * (group_size // 2) + [1.0] * (group_size % 2))
    return batch.scored(rewards)


@contextlib.contextmanager
def local_ray(tmp_path):
    """A local 2-CPU Ray instance for one test (its session folder short: Ray's socket paths must stay under ~107
    characters), always shut down. Workers inherit this process's environment (PYTHONPATH included)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tmp_path / "r" if len(str(tmp_path)) <= 40 else Path(tempfile.mkdtemp(prefix="covrl-ray-"))
    temp.mkdir(exist_ok=True)
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
