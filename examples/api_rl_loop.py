"""An RL loop written on covrl.api: sample groups -> score -> advantages -> forward_backward -> optim_step.

The loop is yours; covrl supplies the model (full fine-tune or LoRA from the config), the sampler, the losses,
the rollout correction's mismatch metrics, AdamW and checkpoints. On the tiny preset (configs/tiny.yaml: a
2-layer Llama with a character tokenizer, a short supervised warm-up, three-term one-digit addition) it is the
same computation as `covrl train -c configs/tiny.yaml`: same tokens, rewards and per-step metrics
(tests/api/test_api_loop.py compares them), and it lifts held-out greedy accuracy the same way.

    python examples/api_rl_loop.py                          # the preset: 400 steps, ~1 min on one core
    python examples/api_rl_loop.py --steps 50 --loss ppo_clip
    python examples/api_rl_loop.py --config default         # SmolLM2-135M-Instruct, one-digit addition, 30 steps
"""

from __future__ import annotations

import argparse
import time

import torch

from covrl.api import AdamParams, TrainBatch, TrainingClient
from covrl.math import compute_advantages
from covrl.models import decode_responses


def greedy_accuracy(sampling, task, tokenizer) -> float:
    """Held-out accuracy of greedy answers, one batched sample call over the eval prompts."""
    prompts = [task.encode(tokenizer, ex) for ex in task.eval]
    out = sampling.sample(prompts, 1, greedy=True)
    texts = decode_responses(tokenizer, out.batch.response_ids, out.batch.response_mask)
    return sum(map(bool, task.score(texts, task.eval).correct)) / len(task.eval)


def train(preset: str = "tiny", overrides: dict | None = None, *, steps: int | None = None,
          loss: str | None = None, log=print) -> dict:
    client = TrainingClient.from_config(preset, overrides)     # model, task, prompt stream, SFT warm-up
    cfg, task, tokenizer = client.config, client.task, client.tokenizer
    steps = steps or cfg.loop.steps
    loss = loss or cfg.algorithm.loss
    o = cfg.optim
    adam = AdamParams(learning_rate=o.lr, beta1=o.betas[0], beta2=o.betas[1], eps=o.eps,
                      weight_decay=o.weight_decay, grad_clip_norm=o.max_grad_norm or 0.0)
    n = cfg.loop.group_size
    # covrl train's gradient-noise monitor (logging.noise_scale, on in both presets' defaults) runs a step that
    # fits one micro-batch as two halves of whole groups; the same two micro-batches here sum the gradient in the
    # same order, so the run stays identical to `covrl train` (one micro-batch differs by float rounding)
    if cfg.logging.noise_scale and cfg.loop.prompts_per_step >= 2 \
            and cfg.loop.prompts_per_step * n <= cfg.optim.micro_batch_size:
        client.micro_batch_size = n * ((cfg.loop.prompts_per_step + 1) // 2)   # the trainer's first half

    sampling = client.save_weights_and_get_sampling_client()
    before = greedy_accuracy(sampling, task, tokenizer)
    log(f"held-out greedy accuracy before RL: {before:.1%}")
    history, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        # 1. a group of n answers to each prompt from the current weights (one batched generate call)
        examples, _ = client.stream.take(cfg.loop.prompts_per_step)
        out = sampling.sample([task.encode(tokenizer, ex) for ex in examples], n)
        texts = decode_responses(tokenizer, out.batch.response_ids, out.batch.response_mask)
        scored = task.score(texts, [ex for ex in examples for _ in range(n)])
        rewards = torch.tensor(scored.rewards, dtype=torch.float32)

        # 2. advantages against the group; OTB weighs tokens by the trainer's log-probs and Σπ² (no-grad pass)
        batch = TrainBatch.from_rollouts(out.batch)
        fwd = client.forward(batch)
        adv = compute_advantages(cfg.algorithm.advantage, rewards=rewards, mask=batch.response_mask,
                                 group_ids=out.batch.group_ids, logprobs=fwd.logprobs, sum_pi_sq=fwd.sum_pi_sq,
                                 **cfg.algorithm.advantage_options)

        # 3. loss and gradient (metrics: loss/*, mismatch/*, correction/*, entropy), then one AdamW step
        fb = client.forward_backward(TrainBatch.from_rollouts(out.batch, adv.advantages), loss_fn=loss,
                                     loss_options=cfg.algorithm.loss_options, agg_mode=cfg.algorithm.agg_mode)
        opt = client.optim_step(adam)
        sampling = client.save_weights_and_get_sampling_client()   # the next step samples the new weights

        correct = torch.tensor([float(bool(c)) for c in scored.correct])
        record = {"step": step, "reward/mean": float(rewards.mean()), "accuracy": float(correct.mean()),
                  **fb.metrics, **adv.metrics, **opt.metrics, "response_ids": out.batch.response_ids}
        history.append(record)
        if step % max(1, steps // 20) == 0 or step == steps:
            log(f"step {step:4d}/{steps}  reward {record['reward/mean']:.3f}  loss {record['loss']:+.4f}  "
                f"grad_norm {record['grad_norm']:.3f}  mismatch/k3 {record.get('mismatch/k3', 0.0):.2e}  "
                f"({time.perf_counter() - t0:.1f}s)")

    after = greedy_accuracy(sampling, task, tokenizer)
    log(f"held-out greedy accuracy: {before:.1%} before RL -> {after:.1%} after {steps} steps "
        f"({time.perf_counter() - t0:.1f}s)")
    return {"client": client, "history": history, "greedy_before": before, "greedy_after": after}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="an RL loop on covrl.api")
    parser.add_argument("--config", "--preset", dest="config", default="tiny",
                        help="a packaged preset (tiny, default = SmolLM2) or a YAML path")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--loss", default=None, help="any name of covrl.api.API_LOSSES")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train(args.config, {"run.seed": args.seed}, steps=args.steps, loss=args.loss)
