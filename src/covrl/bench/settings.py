"""The GRPO step both sides of the covrl-vs-TRL benchmarks run (`StepSettings`), the task they share, and covrl's
TrainConfig for that step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from covrl.bench.models import DEFAULT_CACHE
from covrl.settings import apply_overrides, build_section
from covrl.tasks import TaskConfig, build_task
from covrl.train import TrainConfig


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
    # time-to-accuracy: evaluate greedy held-out accuracy whenever `eval_interval_s` of training time has
    # passed (0: never); a side is finished at `target_accuracy` or after `budget_s` of training time
    eval_interval_s: float = 0.0
    eval_prompts: int = 50
    target_accuracy: float = 0.9
    budget_s: float = 0.0
    stop_at_target: bool = True  # False: train on to the budget after reaching the target (the suite's equal time)
    covrl_config: str | None = None  # YAML config for the covrl side (None: the GRPO step of these settings)
    vllm: bool = False  # both sides sample with vLLM: covrl sampler.backend=vllm, TRL use_vllm (colocate)
    # dotted `section.key=value` overrides of the covrl side's config (e.g. sampler.compile=true), applied last
    covrl_overrides: tuple[str, ...] = ()

    @property
    def batch_size(self) -> int:
        return self.n_prompts * self.group_size


def default_task_overrides(model: str) -> dict:
    """Task options per model: the char-level tiny model has no chat template, so it sees plain prompts."""
    return {"chat_template": False} if model == "tiny" else {}


def build_bench_task(settings: StepSettings, tokenizer):
    """covrl's arithmetic task (eval set and grader shared by both sides) and the encoded training prompts
    (`n_prompts` per step, in order, cycling)."""
    task = build_task(TaskConfig(**settings.task))
    prompts = [task.encode(tokenizer, ex) for ex in task.train]
    return task, prompts


def bench_train_config(settings: StepSettings, **sections):
    """covrl's TrainConfig for the GRPO step of `settings` (the same step TRL runs): GRPO advantages with
    TRL's eps 1e-4, ppo_clip with the same clip range, token-mean aggregation, one micro-batch per step
    (TRL also makes one forward over the batch), constant lr, grad-norm clipping. `sections` override whole
    config sections (dicts)."""
    sampler = {"temperature": settings.temperature, "max_new_tokens": settings.max_new_tokens,
               "max_batch": settings.batch_size}
    if settings.vllm:   # the engine's copy of a model that is not a folder goes beside the bench's model folders
        sampler.update(backend="vllm", vllm={"model_cache": str(Path(settings.cache_dir) / "vllm-models")})
    data = {
        "run": {"seed": settings.seed, "num_threads": settings.threads},
        "task": settings.task,
        "sampler": sampler,
        "algorithm": {"advantage": "grpo", "advantage_options": {"eps": 1e-4}, "loss": "ppo_clip",
                      "loss_options": {"clip_low": settings.clip_low, "clip_high": settings.clip_high},
                      "agg_mode": "token-mean"},
        "optim": {"lr": settings.learning_rate, "max_grad_norm": settings.max_grad_norm,
                  "micro_batch_size": settings.batch_size, "weight_decay": 0.0},
        "loop": {"steps": settings.warmup_steps + settings.steps, "prompts_per_step": settings.n_prompts,
                 "group_size": settings.group_size},
    }
    data.update(sections)
    data, sources = apply_overrides(data, list(settings.covrl_overrides))
    return build_section(TrainConfig, data, source="the benchmark's covrl step", lines={}, overrides=sources)
