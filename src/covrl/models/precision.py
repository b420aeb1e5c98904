"""Mixed precision of the trainer's forward passes: `trainer.autocast` names a mode of `AUTOCAST_MODES`.

`bf16` runs the model (its linear layers, attention) under `torch.autocast(device, dtype=bfloat16)` while the
parameters, their gradients and AdamW stay fp32 (master weights). The logits come out of autocast in bf16
(`bf16`) or fp32 (`bf16_fp32_head`: the LM head in fp32 on the upcast hidden states); covrl.math's log-probs,
entropy and Σπ² upcast them to fp32 block by block before any softmax, outside autocast, so the log-softmax
itself is never bf16 (covrl.models.forward.forward_tokens). docs/performance.md
and docs/engines.md have the measured speed and the mismatch it adds against an fp32 sampler.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AutocastMode:
    """`dtype`: what torch.autocast computes in (None: no autocast). `fp32_head`: the output projection (LM
    head) runs in fp32 on the upcast hidden states, so the logits are not rounded to bf16 (how much of the
    log-prob gap against an fp32 sampler that removes: docs/engines.md)."""

    dtype: torch.dtype | None
    fp32_head: bool = False


AUTOCAST_MODES: dict[str, AutocastMode] = {
    "none": AutocastMode(None),
    "bf16": AutocastMode(torch.bfloat16),
    "bf16_fp32_head": AutocastMode(torch.bfloat16, fp32_head=True),
}


@functools.cache
def cpu_bf16_support() -> dict[str, bool]:
    """Which bf16 instructions this CPU has (torch's own detection): avx512_bf16 and AMX (amx_bf16 tiles).
    Without either, CPU bf16 matmuls are emulated in fp32 and slower than fp32."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return {"avx512_bf16": bool(caps.get("avx512_bf16", False)), "amx_bf16": bool(caps.get("amx_bf16", False))}


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo), None where it cannot be read. Results at a fixed thread count are
    bit-identical on one CPU model but not across models (their BLAS kernels round differently), so run records
    carry it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def check_autocast(mode: str, device: str | torch.device = "cpu") -> None:
    """Raise for an unknown mode (naming trainer.autocast); warn when bf16 autocast would be emulated: a CPU
    without avx512_bf16 / amx_bf16, or a GPU without bf16 support."""
    if mode not in AUTOCAST_MODES:
        raise ValueError(f"trainer.autocast={mode!r}: choose one of {sorted(AUTOCAST_MODES)}")
    if AUTOCAST_MODES[mode].dtype is not torch.bfloat16:
        return
    kind = torch.device(device).type
    if kind == "cpu" and not any(cpu_bf16_support().values()):
        warnings.warn("trainer.autocast=bf16 on a CPU without avx512_bf16 or amx_bf16: bf16 matmuls are "
                      "emulated and usually slower than fp32 (trainer.autocast=none)", stacklevel=2)
    elif kind == "cuda" and not torch.cuda.is_bf16_supported():
        warnings.warn("trainer.autocast=bf16 on a GPU without bf16 support", stacklevel=2)


def output_layer(model) -> torch.nn.Linear:
    """The LM head of `model` (through a DDP wrapper), which fp32_head modes run in fp32; a clear error when it
    is not a plain Linear (an adapter on it would be bypassed)."""
    inner = getattr(model, "module", model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"trainer.autocast with an fp32 head needs the model's output layer to be a plain "
                         f"torch.nn.Linear (got {type(head).__name__}); use trainer.autocast=bf16")
    return head


@contextlib.contextmanager
def _fp32_head(model, device_type: str):
    head = output_layer(model)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, enabled=False):
            return torch.nn.functional.linear(x.float(), head.weight, head.bias)

    # an instance attribute shadows Linear.forward (module hooks still run); on fp32 input it computes the
    # same as Linear.forward, so a sampler sharing the module meanwhile is unaffected
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


@contextlib.contextmanager
def autocast(mode: str, device: str | torch.device, model=None):
    """The context the model's forward runs in: torch.autocast for a mixed-precision mode (with `model`'s LM head
    in fp32 for the fp32_head modes), else nothing."""
    spec = AUTOCAST_MODES[mode]
    if spec.dtype is None:
        yield
        return
    device_type = torch.device(device).type
    with torch.autocast(device_type, dtype=spec.dtype):
        if spec.fp32_head and model is not None:
            with _fp32_head(model, device_type):
                yield
        else:
            yield
