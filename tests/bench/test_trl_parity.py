"""covrl's GRPO step computes what TRL's `GRPOTrainer` computes: on one batch that TRL generates and scores,
covrl's `compute_advantages('grpo')` + `policy_loss('ppo_clip', agg_mode='token-mean')` give TRL's loss, its
advantages and its gradient (`covrl bench trl` then times the two sides; the timings are never asserted)."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from covrl.bench.models import cached_model  # noqa: E402
from covrl.bench.settings import StepSettings, build_bench_task, default_task_overrides  # noqa: E402
from covrl.bench.trl_side import grpo_config  # noqa: E402
from covrl.math import compute_advantages, policy_loss, token_logprobs  # noqa: E402


def loss_agreement(settings: StepSettings) -> dict[str, float]:
    """The per-step math of both sides on one shared batch.

    TRL generates and scores one batch (`_generate_and_score_completions`) and computes its loss with its own
    `compute_loss` (+ backward). covrl recomputes the same log-probs from a forward on the same ids, the
    rewards with the same grader, GRPO advantages (eps = TRL's 1e-4) and `policy_loss('ppo_clip',
    agg_mode='token-mean')` with the current log-probs as the sampler's (on-policy, as TRL without vLLM).
    Returns both losses, |difference|, the gradients' relative L2 difference and the advantages' max diff."""
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    model, tokenizer = cached_model(settings.model, settings.cache_dir, settings.dtype)
    task, prompt_ids = build_bench_task(settings, tokenizer)
    texts = [tokenizer.decode(prompt_ids[i]) for i in range(settings.n_prompts)]

    def spread_reward(completions: list[str], examples) -> list[float]:
        # the task reward plus 0.01 per character: a random tiny model scores 0 everywhere, which would make
        # every advantage 0 and the check vacuous; both sides use this same function
        base = task.score(list(completions), examples).rewards
        return [r + 0.01 * len(c) for r, c in zip(base, completions)]

    def reward(prompts, completions, example_index, **_):
        return spread_reward(list(completions), [task.train[i] for i in example_index])

    out_dir = tempfile.mkdtemp(prefix="covrl-bench-agree-")
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward, args=grpo_config(trl, settings, out_dir, max_steps=1),
        train_dataset=datasets.Dataset.from_list([{"prompt": t, "example_index": i} for i, t in enumerate(texts)]),
        processing_class=tokenizer)
    trainer.model.train()
    batch = [{"prompt": texts[i], "example_index": i} for i in range(settings.n_prompts)
             for _ in range(settings.group_size)]
    inputs = trainer._generate_and_score_completions(batch)
    trainer.current_gradient_accumulation_steps = 1
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trl_grad = torch.cat([p.grad.flatten() for p in params])
    trainer.model.zero_grad()

    prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
    mask = inputs["completion_mask"].float()
    ids = torch.cat([prompt, completion], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    # the forward TRL makes (no position_ids): this check is about the loss math, not positions
    logits = trainer.model(input_ids=ids, attention_mask=attention).logits[:, prompt.shape[1] - 1:-1]
    logprobs = token_logprobs(logits, completion)
    texts_out = tokenizer.batch_decode([c[m.bool()] for c, m in zip(completion, mask)], skip_special_tokens=True)
    examples = [task.train[b["example_index"]] for b in batch]
    rewards = torch.tensor(spread_reward(texts_out, examples), dtype=torch.float32)
    group_ids = torch.arange(settings.n_prompts).repeat_interleave(settings.group_size)
    adv = compute_advantages("grpo", rewards=rewards, mask=mask, group_ids=group_ids, eps=1e-4).advantages
    covrl_loss = policy_loss("ppo_clip", logprobs=logprobs, sampler_logprobs=logprobs.detach(), advantages=adv,
                             mask=mask, agg_mode="token-mean", clip_low=settings.clip_low,
                             clip_high=settings.clip_high).loss
    covrl_loss.backward()
    covrl_grad = torch.cat([p.grad.flatten() for p in params])
    shutil.rmtree(out_dir, ignore_errors=True)
    trl_adv = inputs["advantages"].float()[:, None] * mask
    grad_norm = float(trl_grad.norm())
    trl_value, covrl_value = trl_loss.item(), covrl_loss.item()
    return {
        "trl_loss": trl_value, "covrl_loss": covrl_value, "loss_abs_diff": abs(trl_value - covrl_value),
        "grad_norm_trl": grad_norm,
        "grad_rel_diff": float((trl_grad - covrl_grad).norm()) / max(grad_norm, 1e-30),
        "advantage_max_diff": float((adv - trl_adv).abs().max()),
        "reward_mean": float(rewards.mean()), "completion_tokens": float(mask.sum()),
    }


def test_grpo_loss_advantages_and_gradient_match_trl(tmp_path):
    # the settings of `covrl bench trl --quick`, whose TRL worker used to run this check before timing
    settings = StepSettings(model="tiny", cache_dir=str(tmp_path / "cache"), n_prompts=2, group_size=2,
                            max_new_tokens=6, warmup_steps=1, steps=2, task=default_task_overrides("tiny"))
    agree = loss_agreement(settings)
    assert agree["grad_norm_trl"] > 0
    assert agree["grad_rel_diff"] < 1e-5
    assert agree["advantage_max_diff"] < 1e-5
    assert agree["loss_abs_diff"] < 1e-6
