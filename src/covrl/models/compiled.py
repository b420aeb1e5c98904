"""torch.compile of a causal LM's forward (the trainer's log-prob pass), of the hf sampler's decode step over a
static KV cache, and the compile-time clock.

`compile_module` wraps a module with `torch.compile(dynamic=True)`: the wrapper shares the module's parameters,
and symbolic batch and length dimensions let one graph serve every micro-batch shape of the full
[prompt | response] pass (the shared-prompt pass through a DynamicCache re-compiles at every new shape, so
the compiled trainer runs the per-row pass; docs/performance.md). AOTAutograd compiles the backward with the
forward, so `loss.backward()` runs compiled code as well.
"""

from __future__ import annotations

from typing import Literal

import torch

# inductor: real kernels (C++ on CPU, needs a compiler); aot_eager / eager: the same capture (dynamo, plus
# AOTAutograd's joint graph for aot_eager) run by eager kernels -- cheap to compile, for tests and debugging
CompileBackend = Literal["inductor", "aot_eager", "eager"]
COMPILE_BACKENDS: tuple[str, ...] = ("inductor", "aot_eager", "eager")


def compile_module(module: torch.nn.Module, backend: str = "inductor") -> torch.nn.Module:
    """`module` behind torch.compile with dynamic shapes (lazy: the first call compiles)."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"trainer.compile_backend={backend!r}; allowed: {', '.join(COMPILE_BACKENDS)}")
    return torch.compile(module, backend=backend, dynamic=True)


def compile_seconds() -> float:
    """Wall seconds torch.compile has spent compiling in this process so far (dynamo frame compiles, which
    include AOTAutograd's backward and inductor's code generation). A difference of two readings is the
    compile time of what ran in between."""
    try:
        from torch._dynamo.utils import calculate_time_spent
    except ImportError:   # a private helper: without it compile time is reported as 0
        return 0.0
    return float(calculate_time_spent().get("total_wall_time", 0.0))


def compiled_graphs() -> int:
    """Graphs torch.compile has captured in this process so far (dynamo's unique_graphs counter): a difference of
    two readings is the number of (re-)compiles in between."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


# a bound per region: each (rows, cache length) bucket and sampler module is one graph; past it fullgraph raises
DECODE_RECOMPILE_LIMIT = 64


def compile_decode_step(backend: str = "inductor", cache_kwarg: str = "cache"):
    """`step(module, input_ids [R, 1], position_ids [R, 1], attention_mask [R, L], cache) -> logits [R, V]`: one
    decode step over a preallocated StaticCache of L slots, behind torch.compile with static shapes and one graph
    (fullgraph: a graph break raises instead of silently running part of the step eagerly). Shapes are fixed per
    (R, L), so the caller buckets both; the StaticCache object may be new at every call (no re-compile)."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"sampler.compile_backend={backend!r}; allowed: {', '.join(COMPILE_BACKENDS)}")

    def step(module, input_ids, position_ids, attention_mask, cache):
        out = module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=True, **{cache_kwarg: cache})
        return out.logits[:, -1, :]

    return torch.compile(step, backend=backend, dynamic=False, fullgraph=True,
                         recompile_limit=DECODE_RECOMPILE_LIMIT)
