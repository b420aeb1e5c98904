"""A run's components, built one way for every entry point that sets up a model to train: `covrl train`
(`covrl.train.run.folder.prepare_run`), covrl.api's `TrainingClient.from_config` (and the Tinker server through
it), `covrl diagnose`'s rebuild of a run's initial weights and the benches that prepare runs.

    c = build_components(cfg)   # threads, seed, device, task + prompt stream, model + tokenizer, in this order
    c.warm_up()                 # the supervised warm-up of `sft_warmup` (no-op at 0 steps)

The order is part of what reproduces a run: every entry point draws the same weights and the same prompts from
the same seed. The distillation teacher (`build_teacher`) is built here as well.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from covrl.models import frozen_copy, load_model
from covrl.rollout import SamplerConfig, truncation_rule
from covrl.rollout.vllm import build_vllm_sampler
from covrl.tasks import build_task
from covrl.train.run.stream import DataStream
from covrl.train.run.threads import ThreadChoice, apply_num_threads
from covrl.train.step.self_teacher import SelfTeacher
from covrl.train.step.sft import sft_warmup

if TYPE_CHECKING:   # the run's config composes this room's sections: imported for types only
    from covrl.train.config import TrainConfig

__all__ = ["Components", "build_components", "build_teacher", "rebuild_initial_model", "resolve_device",
           "seed_everything"]


def seed_everything(seed: int) -> None:
    """One seed for python, numpy and torch (the sampler's generator is seeded separately from it)."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("run.device='cuda' but torch sees no CUDA device; use run.device=cpu or auto")
    return torch.device(name)


@dataclass
class Components:
    """What a run trains: the task and its prompt stream, the model (on `device`) and its tokenizer, built from
    `cfg` under the thread count `threads`; `load_s`: the seconds the model took to load."""

    cfg: TrainConfig
    threads: ThreadChoice
    device: torch.device
    task: Any
    stream: DataStream
    model: Any
    tokenizer: Any
    load_s: float = 0.0

    def warm_up(self, log=None) -> dict[str, float]:
        """The supervised warm-up of `sft_warmup` on the model (its metrics; {} at 0 steps)."""
        cfg = self.cfg
        return sft_warmup(self.model, self.tokenizer, self.task, cfg.sft_warmup, seed=cfg.run.seed,
                          micro_batch_size=cfg.optim.micro_batch_size * 4, log=log)


def build_components(cfg: TrainConfig) -> Components:
    """The threads of `run.num_threads`, one seed for everything, the device, the task with its prompt stream
    (data first: bad input fails before a model is loaded) and the model of `model` on the device."""
    threads = apply_num_threads(cfg)
    seed_everything(cfg.run.seed)
    device = resolve_device(cfg.run.device)
    task = build_task(cfg.task, response_budget=cfg.sampler.max_new_tokens)
    stream = DataStream(task.train, seed=cfg.run.seed)
    t0 = time.perf_counter()
    model, tokenizer = load_model(cfg.model, seed=cfg.run.seed)
    model.to(device)
    return Components(cfg, threads, device, task, stream, model, tokenizer, load_s=time.perf_counter() - t0)


def rebuild_initial_model(cfg: TrainConfig):
    """(model, tokenizer) with the weights a fresh run of `cfg` starts RL from, built as prepare_run builds them:
    the run's components and the supervised warm-up of `sft_warmup`. Deterministic at a fixed thread count on
    one CPU model; compare `weights_fingerprint` with the run's record before trusting it."""
    c = build_components(cfg)
    c.warm_up()
    return c.model, c.tokenizer


def build_teacher(cfg: TrainConfig, tokenizer, device, task=None, stream: DataStream | None = None):
    """The frozen distillation teacher of `distill.teacher` (None without), on `device`. A teacher must use the
    student's tokenizer: the signal compares log-probs of the same token ids. `distill.teacher: self`: the
    privileged prompts of the run's `task`, each row's example found at its position of `stream`."""
    if cfg.distill.teacher is None:
        return None
    if cfg.distill.teacher == "self":
        return _self_teacher(cfg, tokenizer, task, stream)
    teacher, teacher_tok = load_model(cfg.distill.teacher, seed=cfg.run.seed)
    if teacher_tok.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"distill.teacher ({cfg.distill.teacher.source} {cfg.distill.teacher.path or ''}) has "
                         "another tokenizer than the student: on-policy distillation compares the log-probs of the "
                         "same token ids, so teacher and student must share one vocabulary")
    if cfg.distill.engine == "vllm":
        return _vllm_teacher(cfg, teacher, teacher_tok)
    return frozen_copy(teacher.to(device))


def _self_teacher(cfg: TrainConfig, tokenizer, task, stream: DataStream | None) -> SelfTeacher:
    if task is None or stream is None:
        raise ValueError("distill.teacher=self: build_teacher needs the run's task and prompt stream")
    # a copy of the stream's order of its own: the lookups run on the trainer's thread, beside a sampler thread
    # that advances the stream (whose one-epoch cache is not thread-safe); made at the first lookup, after a
    # resume restored the stream's seed
    copies: dict[int, DataStream] = {}

    def example_at(position: int):
        order = copies.get(stream.seed)
        if order is None:
            order = copies.setdefault(stream.seed, DataStream(stream.items, seed=stream.seed, shuffle=stream.shuffle))
        return order.items[order.index_at(position)]

    teacher = SelfTeacher(cfg.distill.self_teacher, task, tokenizer, example_at)
    teacher.check_answers(task.train, cfg.task.name, cfg.task.answer_field)
    return teacher


def _vllm_teacher(cfg: TrainConfig, teacher, tokenizer):
    """The teacher in its own vLLM engine (distill.engine=vllm): it scores with vLLM's prompt log-probs, the
    model's distribution at temperature 1 over the whole vocabulary, so the settings that would score another
    distribution are refused."""
    if cfg.sampler.temperature != 1.0 or truncation_rule(cfg.sampler).active:
        raise ValueError(f"distill.engine=vllm scores the teacher at temperature 1 over the whole vocabulary; "
                         f"sampler.temperature={cfg.sampler.temperature}, top_k={cfg.sampler.top_k}, "
                         f"top_p={cfg.sampler.top_p}, min_p={cfg.sampler.min_p} need distill.engine=trainer")
    if cfg.trainer.parallel != "none":
        raise ValueError(f"distill.engine=vllm serves one trainer process; under trainer.parallel="
                         f"{cfg.trainer.parallel} use distill.engine=trainer (each rank scores its rows)")
    scfg = SamplerConfig(backend="vllm", vllm=cfg.sampler.vllm, max_new_tokens=1)
    return build_vllm_sampler(scfg, teacher, tokenizer, role="teacher")
