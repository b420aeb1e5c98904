"""Sparsity of a fine-tuning update, with the share that storage precision explains (docs/theory.md §3, seed ¶3).

The published measurement (Mukherjee et al. 2025, "RL finetunes small subnetworks") counts a parameter as
not updated when `|bf16(θ1) − bf16(θ0)| ≤ 1e-5`. A bf16 number has 8 significant bits, so a change smaller than
about |θ|·2⁻⁹ vanishes in the cast ("absorption") whatever its cause. This diagnostic reports that
definition, the same threshold in full precision, the absorbed share, a scale-free relative version and the
numerical rank of every matrix's update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from covrl.diagnostics.spectrum import default_rtol, update_spectrum


@dataclass
class SparsityReport:
    """`tensors`: per parameter name a dict of the metrics below; `metrics`: the numel-weighted pool.

    sparsity          fraction with |cast(θ1) − cast(θ0)| ≤ atol (the published definition; cast = `dtype`)
    sparsity_full     fraction with |θ1 − θ0| ≤ atol in the tensors' own precision
    absorbed          fraction with |θ1 − θ0| > atol whose change the cast removes (|Δ_cast| ≤ atol)
    amplified         fraction with |θ1 − θ0| ≤ atol that the cast turns into a change > atol (rounding flips)
                      (identity: sparsity = sparsity_full + absorbed − amplified)
    absorbed_share    absorbed / sparsity: the part of the published sparsity that precision explains
    sparsity_relative fraction with |θ1 − θ0| ≤ rtol·max|θ1 − θ0| (scale-free, full precision)
    unchanged_exact   fraction with θ1 == θ0 exactly
    rank_ratio, numerical_rank, stable_rank (2-D tensors only): of the full-precision update matrix
    """

    tensors: dict[str, dict[str, float]]
    metrics: dict[str, float] = field(default_factory=dict)


def _state(theta) -> dict[str, torch.Tensor]:
    if isinstance(theta, nn.Module):
        return {k: v.detach() for k, v in theta.state_dict().items()}
    if isinstance(theta, Mapping):
        return {k: torch.as_tensor(v).detach() for k, v in theta.items()}
    raise TypeError(f"theta must be an nn.Module or a mapping name -> tensor; got {type(theta).__name__}")


def update_sparsity(
    theta0,
    theta1,
    atol: float = 1e-5,
    dtype: torch.dtype = torch.bfloat16,
    *,
    rtol: float = 1e-3,
    params: str | None = None,
    compute_rank: bool = True,
) -> SparsityReport:
    """How many parameters a fine-tuning run left unchanged, and why (see `SparsityReport` for the fields).

    theta0, theta1: models or state dicts with the same floating-point tensors (non-float entries are skipped;
    tied tensors count once per state-dict name). `atol` absolute threshold, `dtype` the storage precision of the
    published measurement (bfloat16), `rtol` relative threshold of the scale-free variant, `params` an optional
    regular expression on names. Differences are taken in fp64 after casting both ends to `dtype`.
    When θ is already stored in `dtype` (or coarser) the absorbed share cannot be separated: the metric
    `precision_separable` is 0 then.
    """
    import re

    if atol < 0 or rtol < 0:
        raise ValueError(f"atol and rtol must be >= 0; got atol={atol}, rtol={rtol}")
    s0, s1 = _state(theta0), _state(theta1)
    names = [n for n in s0 if s0[n].is_floating_point()]
    if params is not None:
        rx = re.compile(params)
        names = [n for n in names if rx.search(n)]
    missing = [n for n in names if n not in s1]
    if missing:
        raise ValueError(f"theta1 lacks tensor(s) {missing[:3]} present in theta0")
    if not names:
        raise ValueError("no floating-point tensors to compare")
    tensors: dict[str, dict[str, float]] = {}
    sums = {k: 0.0 for k in ("sparsity", "sparsity_full", "absorbed", "amplified", "sparsity_relative",
                             "unchanged_exact")}
    total = 0
    rank_num = rank_den = 0.0
    separable = True
    for name in names:
        a, b = s0[name], s1[name]
        if a.shape != b.shape:
            raise ValueError(f"tensor {name!r} has shape {list(a.shape)} in theta0 but {list(b.shape)} in theta1")
        if torch.finfo(a.dtype).bits <= torch.finfo(dtype).bits:
            separable = False
        full = b.double() - a.double()
        cast = b.to(dtype).double() - a.to(dtype).double()
        small_full = full.abs() <= atol
        small_cast = cast.abs() <= atol
        max_abs = float(full.abs().max()) if full.numel() else 0.0
        n = full.numel()
        row = {
            "numel": float(n),
            "sparsity": float(small_cast.double().mean()),
            "sparsity_full": float(small_full.double().mean()),
            "absorbed": float((~small_full & small_cast).double().mean()),
            "amplified": float((small_full & ~small_cast).double().mean()),
            "sparsity_relative": float((full.abs() <= rtol * max_abs).double().mean()),
            "unchanged_exact": float((full == 0).double().mean()),
            "max_abs_update": max_abs,
        }
        row["absorbed_share"] = row["absorbed"] / row["sparsity"] if row["sparsity"] > 0 else 0.0
        if compute_rank and full.dim() == 2 and min(full.shape) > 1:
            # the rank cut-off follows the stored precision, but never coarser than fp32's (a bf16 Δ is exact)
            ref = a.dtype if torch.finfo(a.dtype).bits >= 32 else torch.float32
            spec = update_spectrum(full, 1, rtol=default_rtol(tuple(full.shape), ref))
            row["numerical_rank"] = spec.metrics["numerical_rank"]
            row["rank_ratio"] = spec.metrics["rank_ratio"]
            row["stable_rank"] = spec.metrics["stable_rank"]
            rank_num += spec.metrics["numerical_rank"]
            rank_den += spec.metrics["full_rank"]
        tensors[name] = row
        for k in sums:
            sums[k] += row[k] * n
        total += n
    metrics = {k: v / total for k, v in sums.items()}
    metrics["absorbed_share"] = metrics["absorbed"] / metrics["sparsity"] if metrics["sparsity"] > 0 else 0.0
    metrics["numel"] = float(total)
    metrics["rank_ratio"] = rank_num / rank_den if rank_den else float("nan")
    metrics["precision_separable"] = 1.0 if separable else 0.0
    metrics["atol"] = float(atol)
    metrics["rtol"] = float(rtol)
    return SparsityReport(tensors=tensors, metrics=metrics)
