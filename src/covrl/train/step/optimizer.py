"""AdamW as covrl builds it, in one place: the Trainer (`optim` section), covrl.api's `TrainingClient.optim_step`
(the call's AdamParams) and the supervised warm-up (`sft_warmup` section)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def build_adamw(params: Iterable[torch.Tensor], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                eps: float = 1e-8, weight_decay: float = 0.01, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over `params` (torch's defaults for what is not given). `fused=None`: the fused kernel (one pass
    over each tensor) when every parameter is a float tensor on CPU or CUDA; `fused=False`: torch's for-each
    kernel (sharded DTensor parameters; weights a recorded run was made with)."""
    params = list(params)
    if fused is None:
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps,
                             weight_decay=weight_decay, **({"fused": True} if fused else {}))
