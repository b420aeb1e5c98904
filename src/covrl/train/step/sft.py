"""Supervised warm-up on the task's demonstrations (prompt -> answer + EOS) before RL.

Used to give a model trained from scratch (the tiny config) a non-zero reward to start RL from. The loss is
the mean negative log-likelihood of the demonstration tokens, computed with the same forward as the trainer
(left-padded prompt, right-padded response, positions from the attention mask)."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

import torch

from covrl.rollout.types import RolloutBatch
from covrl.train.step.micro_step import forward_batch
from covrl.train.step.optimizer import build_adamw

if TYPE_CHECKING:   # the run's config composes this room's sections: imported for types only
    from covrl.train.config import SFTWarmupConfig


def demonstration_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> RolloutBatch:
    """A RolloutBatch (one group per row, no sampler log-probs) holding prompts and demonstration responses."""
    rows = len(prompts)
    p_len = max(len(p) for p in prompts)
    t_len = max(max(len(r) for r in responses), 1)
    prompt_ids = torch.full((rows, p_len), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, p_len))
    response_ids = torch.full((rows, t_len), pad_id, dtype=torch.long)
    response_mask = torch.zeros((rows, t_len))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[i, p_len - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, p_len - len(p):] = 1.0
        response_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, :len(r)] = 1.0
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, sampler_logprobs=torch.zeros((rows, t_len)),
                        group_ids=torch.arange(rows), policy_version=torch.zeros(rows, dtype=torch.long))


def sft_warmup(model, tokenizer, task, cfg: SFTWarmupConfig, *, seed: int, micro_batch_size: int = 64,
               log=None) -> dict[str, float]:
    """`cfg.steps` AdamW steps of NLL on (prompt, answer + EOS) pairs drawn from `task.train` with
    random.Random(seed) (no global RNG is used). Returns the first/last losses and the time taken."""
    if cfg.steps <= 0:
        return {}
    if not task.train:
        raise ValueError("sft_warmup needs training examples, but the task has none")
    rng = random.Random(seed + 7919)
    params = [p for p in model.parameters() if p.requires_grad]
    # torch's for-each kernel: the warm-up's weights are a run's recorded starting point (initial_weights)
    opt = build_adamw(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = params[0].device
    model.train()
    t0 = time.perf_counter()
    losses = []
    for step in range(cfg.steps):
        examples = [task.train[rng.randrange(len(task.train))] for _ in range(cfg.batch_size)]
        prompts = [task.encode(tokenizer, ex) for ex in examples]
        answers = [task.encode_answer(tokenizer, ex) for ex in examples]
        opt.zero_grad(set_to_none=True)
        total_tokens = float(sum(len(a) for a in answers))
        step_loss = 0.0
        for s in range(0, len(examples), micro_batch_size):
            batch = demonstration_batch(prompts[s:s + micro_batch_size], answers[s:s + micro_batch_size], pad)
            batch = RolloutBatch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                    for k, v in batch.__dict__.items()})
            fwd = forward_batch(model, batch, 1.0, with_stats=False)
            loss = -(fwd.logprobs * batch.response_mask).sum() / total_tokens
            loss.backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(step_loss)
        if log is not None and (step + 1) % max(1, cfg.steps // 5) == 0:
            log(f"sft warm-up step {step + 1}/{cfg.steps}: loss {step_loss:.3f}")
    opt.zero_grad(set_to_none=True)
    return {"sft/steps": float(cfg.steps), "sft/loss_first": losses[0], "sft/loss_last": losses[-1],
            "sft/seconds": time.perf_counter() - t0}
