"""One base model, many LoRA adapters: the LoRA training clients of one base model share its weights in memory.

A `SharedBase` is the base model of a config (built and warmed up as `covrl.api.TrainingClient.from_config`
builds it), frozen. Each LoRA client gets a module tree of its own whose base parameters and buffers ARE the
shared ones (the same tensors, not copies) with its own peft adapters on top, so K LoRA clients of one base
hold one copy of the base weights plus K adapter sets. A full fine-tune trains every weight and keeps a copy of
its own (it never comes here).

Each client computes on its own rows (its forward, backward and sampling run through its own module tree), so
its results are those of the same client alone, bit for bit: the arithmetic is the same, only the memory is
shared. No matmul is fused across adapters: with torch's CPU (MKL) kernels, a matmul's rows depend on how many
rows it is given (measured: `scripts/tinker_load_test.py exactness`; docs/api.md "Serving a team").
"""

from __future__ import annotations

import copy
import itertools
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from covrl.api.client import TrainingClient
from covrl.models import LoraConfig
from covrl.models.loading import apply_lora
from covrl.train import DataStream, TrainConfig, build_components
from covrl.train.run.components import seed_everything
from covrl.train.run.sizing import fixed_sizes
from covrl.train.run.threads import apply_num_threads


@dataclass(eq=False)
class SharedBase:
    """A frozen base model and what a client of it needs: `cfg` (its config, without LoRA), the tokenizer,
    the task and the warm-up's metrics."""
    cfg: TrainConfig
    model: Any
    tokenizer: Any
    task: Any
    sft_metrics: dict[str, float]
    clients: int = field(default=0)   # clients built on it so far (a metric)

    @property
    def base_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in itertools.chain(self.model.parameters(),
                                                                          self.model.buffers()))


def build_shared_base(cfg: TrainConfig, *, warmup: bool) -> SharedBase:
    """The base model of `cfg` (its `model.lora` ignored), built and warmed up as `from_config(cfg, warmup=warmup,
    lora_after_warmup=True)` does, with every parameter frozen."""
    plain = fixed_sizes(cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": None})}))
    c = build_components(plain)
    sft = c.warm_up() if warmup else {}
    for p in c.model.parameters():
        p.requires_grad_(False)
    return SharedBase(plain, c.model, c.tokenizer, c.task, sft)


def share_modules(model) -> Any:
    """A copy of `model`'s module tree whose parameters and buffers are `model`'s own tensors (shared, not
    copied): adapters added to the copy leave `model` and its other copies untouched."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def lora_client(base: SharedBase, lora: LoraConfig, *, state_dir: Path) -> TrainingClient:
    """A covrl.api TrainingClient of LoRA adapters `lora` on `base`'s shared weights; equal, bit for bit, to
    `TrainingClient.from_config(cfg with lora, warmup, lora_after_warmup=True)` (tests/api/test_tinker_multilora.py)."""
    cfg = base.cfg
    apply_num_threads(cfg)      # as build_components does for every client
    seed_everything(cfg.run.seed)
    model = share_modules(base.model)
    with torch.random.fork_rng():
        # the adapters' draws, as from_config makes them: from manual_seed(seed), right after the loader (whose
        # draws never reach the global RNG: tested for every model source) or after the warm-up
        torch.manual_seed(cfg.run.seed)
        model = apply_lora(model, lora)
    if cfg.model.gradient_checkpointing:
        model.enable_input_require_grads()   # as load_model: frozen embeddings would cut the gradient path
    full = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": lora})})
    client = TrainingClient(model, base.tokenizer, temperature=cfg.sampler.temperature, correction=cfg.correction,
                            micro_batch_size=cfg.optim.micro_batch_size, share_prompts=cfg.optim.share_prompts,
                            sampler_config=cfg.sampler, seed=cfg.run.seed, state_dir=state_dir,
                            truncation=cfg.trainer.truncation)
    client.sft_metrics = dict(base.sft_metrics)
    client.config, client.task, client.stream = full, base.task, DataStream(base.task.train, seed=cfg.run.seed)
    client._shared_base = base   # keeps the base alive while the client is
    base.clients += 1
    return client


class SharedBases:
    """The shared bases of one server (all its tenants), by config: a base lives while a client of it does."""

    def __init__(self):
        self._bases: weakref.WeakValueDictionary[str, SharedBase] = weakref.WeakValueDictionary()

    @staticmethod
    def key(cfg: TrainConfig, warmup: bool) -> str:
        plain = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": None})})
        return f"{warmup}|{plain.model_dump_json()}"

    def get(self, cfg: TrainConfig, *, warmup: bool) -> SharedBase:
        key = self.key(cfg, warmup)
        base = self._bases.get(key)
        if base is None:
            base = build_shared_base(cfg, warmup=warmup)
            self._bases[key] = base
        return base

    def __len__(self) -> int:
        return len(self._bases)


__all__ = ["SharedBase", "SharedBases", "build_shared_base", "lora_client", "share_modules"]
