"""Helpers shared by the covrl.api tests: a small tiny-model config, a batch with moved sampler log-probs,
and the Tinker SDK when it is importable (COVRL_TINKER_SITE: the site-packages of a venv that has it, e.g.
/tmp/tinker-venv/lib/python3.11/site-packages; appended after covrl's own packages, so the SDK's dependencies
only fill gaps)."""

from __future__ import annotations

import os
import sys

import torch

from covrl.api import TrainBatch

SMALL = {"sft_warmup.steps": 0, "task.n_train": 40, "task.n_eval": 8, "run.num_threads": 1}


def make_batch(client, *, seed=0):
    """Rollouts of 4 prompts x 4 answers from the client's sampler, with made-up advantages and sampler
    log-probs moved off the trainer's so the ratios are not all 1."""
    sampling = client.save_weights_and_get_sampling_client()
    examples, _ = client.stream.take(4)
    out = sampling.sample([client.task.encode(client.tokenizer, ex) for ex in examples], 4)
    g = torch.Generator().manual_seed(seed)
    mask = out.batch.response_mask
    adv = torch.randn(len(out.batch), generator=g)[:, None] * mask
    q = (out.batch.sampler_logprobs + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    return TrainBatch(out.batch.prompt_ids, out.batch.prompt_mask, out.batch.response_ids, mask,
                      sampler_logprobs=q, advantages=adv)



def tinker_sdk():
    site = os.environ.get("COVRL_TINKER_SITE")
    if site and site not in sys.path:
        sys.path.append(site)
    try:
        import tinker
    except ImportError:
        return None
    return tinker
