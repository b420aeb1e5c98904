"""The sampler registry: backend name -> builder(cfg, model, tokenizer) -> Sampler. Each backend registers itself
where it is defined (covrl.rollout.hf, covrl.rollout.vllm); `covrl.rollout` imports both, so the registry is full
whenever anything of covrl.rollout is in use. SamplerConfig checks `sampler.backend` against it at load."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["SAMPLER_BACKENDS", "build_sampler", "register_sampler", "unknown_backend"]

# name -> builder(cfg, model, tokenizer) -> Sampler
SAMPLER_BACKENDS: dict[str, Callable] = {}


def register_sampler(name: str) -> Callable[[Callable], Callable]:
    def register(builder: Callable) -> Callable:
        SAMPLER_BACKENDS[name] = builder
        return builder
    return register


def unknown_backend(name: str) -> str:
    return f"unknown sampler backend {name!r}; allowed: {', '.join(sorted(SAMPLER_BACKENDS))}"


def build_sampler(cfg, model, tokenizer):
    """The sampler backend `cfg.backend` (see SAMPLER_BACKENDS) around `model` / `tokenizer`."""
    if cfg.backend not in SAMPLER_BACKENDS:  # a config built without validation (model_construct)
        raise ValueError(f"sampler.backend: {unknown_backend(cfg.backend)}")
    if cfg.max_new_tokens == "auto":   # the run's probe resolves it before a sampler is built
        raise ValueError("sampler.max_new_tokens=auto is not resolved yet: covrl train sizes it by a probe "
                         "before step 1 (covrl.train.run.sizing); elsewhere give it a number")
    return SAMPLER_BACKENDS[cfg.backend](cfg, model, tokenizer)
