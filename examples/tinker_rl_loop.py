"""A tinker-cookbook-style RL loop (sample groups -> advantages -> forward_backward(importance_sampling) ->
optim_step) written against Tinker's SDK names, running locally on covrl through `covrl.api.tinker`.

Swap the two imports for `import tinker` / `from tinker import types` (and drop ServiceClient's `config=`) and
the loop body is a Tinker program; here it trains LoRA adapters on this CPU. The sizes come from the covrl config
(`loop.steps`, `loop.prompts_per_step` prompts x `loop.group_size` samples, `sampler.max_new_tokens`, the base
model of `model.source`), and the learning rate is 10x the config's full fine-tune `optim.lr`: Tinker's guidance
for LoRA ("LoRA Without Regret": the best LoRA lr is about 10x the full fine-tune's). Any of them can be given.

    python examples/tinker_rl_loop.py                       # tiny preset, LoRA rank 32, 400 steps, lr 3e-3
    python examples/tinker_rl_loop.py --config default      # SmolLM2-135M-Instruct, 30 steps of 4 x 4, lr 2e-4
"""

from __future__ import annotations

import argparse
import time

import covrl.api.tinker as tinker
from covrl.api.tinker import types


def greedy_accuracy(sampling_client, task, tokenizer, max_tokens) -> float:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1e-4)   # ~argmax (Tinker has no greedy flag)
    correct = 0
    for ex in task.eval:
        seq = sampling_client.sample(prompt=types.ModelInput.from_ints(task.encode(tokenizer, ex)), num_samples=1,
                                     sampling_params=params).result().sequences[0]
        correct += bool(task.score([tokenizer.decode(seq.tokens, skip_special_tokens=True)], [ex]).correct[0])
    return correct / len(task.eval)


def main(config="tiny", base_model=None, rank=32, steps=None, batch_size=None, group_size=None, lr=None,
         max_tokens=None, overrides=None, log=print) -> dict:
    service_client = tinker.ServiceClient(config=config, overrides=overrides)
    cfg = service_client.config            # covrl addition: the config behind the models, for the loop's sizes
    base_model = base_model or cfg.model.source
    steps, batch_size = steps or cfg.loop.steps, batch_size or cfg.loop.prompts_per_step
    group_size, max_tokens = group_size or cfg.loop.group_size, max_tokens or cfg.sampler.max_new_tokens
    lr = lr or 10 * cfg.optim.lr           # LoRA: ~10x the full fine-tune's learning rate
    training_client = service_client.create_lora_training_client(base_model=base_model, rank=rank)
    tokenizer = training_client.get_tokenizer()
    task, stream = training_client.api.task, training_client.api.stream    # covrl's task = the environment
    sampling_params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    adam_params = types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8)

    sampling_client = training_client.save_weights_and_get_sampling_client(name="000000")
    before = greedy_accuracy(sampling_client, task, tokenizer, max_tokens)
    log(f"held-out greedy accuracy before RL: {before:.1%}")
    history, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        examples, _ = stream.take(batch_size)
        datums, rewards_all = [], []
        for ex in examples:
            prompt_tokens = task.encode(tokenizer, ex)
            result = sampling_client.sample(prompt=types.ModelInput.from_ints(prompt_tokens), num_samples=group_size,
                                            sampling_params=sampling_params).result()
            texts = [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in result.sequences]
            rewards = task.score(texts, [ex] * group_size).rewards
            rewards_all += rewards
            mean = sum(rewards) / len(rewards)
            advantages = [r - mean for r in rewards]
            if all(a == 0 for a in advantages):
                continue                       # no contrast in the group: no signal
            for seq, adv in zip(result.sequences, advantages):
                tokens = prompt_tokens + seq.tokens
                ob = len(prompt_tokens) - 1    # input positions that predict prompt tokens
                datums.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:],
                                    "logprobs": [0.0] * ob + list(seq.logprobs),
                                    "advantages": [0.0] * ob + [adv] * len(seq.tokens)}))
        metrics = {}
        if datums:
            fwd_bwd = training_client.forward_backward(datums, loss_fn="importance_sampling")
            optim = training_client.optim_step(adam_params)
            metrics = {**fwd_bwd.result().metrics, **optim.result().metrics}
        sampling_client = training_client.save_weights_and_get_sampling_client(name=f"{step:06d}")
        record = {"step": step, "reward": sum(rewards_all) / len(rewards_all), "datums": len(datums), **metrics}
        history.append(record)
        if step % max(1, steps // 10) == 0 or step == steps:
            log(f"step {step:4d}/{steps}  reward {record['reward']:.3f}  datums {len(datums):3d}  "
                f"loss:sum {metrics.get('loss:sum', 0.0):+.3f}  mismatch/k3 {metrics.get('mismatch/k3', 0.0):.1e}"
                f"  ({time.perf_counter() - t0:.1f}s)")
    after = greedy_accuracy(sampling_client, task, tokenizer, max_tokens)
    log(f"held-out greedy accuracy: {before:.1%} before RL -> {after:.1%} after {steps} steps "
        f"({time.perf_counter() - t0:.1f}s)")
    return {"training_client": training_client, "history": history, "greedy_before": before,
            "greedy_after": after}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a tinker-cookbook-style RL loop on covrl")
    parser.add_argument("--config", "--preset", dest="config", default="tiny",
                        help="a packaged preset (tiny, default = SmolLM2) or a YAML path")
    parser.add_argument("--base-model", default=None, help="default: the config's model.source")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None, help="default: 10x the config's optim.lr")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    main(a.config, a.base_model, a.rank, a.steps, lr=a.lr, max_tokens=a.max_tokens, overrides={"run.seed": a.seed})
