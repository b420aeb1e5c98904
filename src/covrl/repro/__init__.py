"""Reproductions of the seed results. Each module exposes `run(out_dir: Path, *, fast: bool = False,
seed: int = 0) -> ReproResult` (see `covrl.repro.common`). Register new ones in REPROS."""

from __future__ import annotations

# name -> module path; imported lazily by `covrl repro NAME`.
REPROS: dict[str, str] = {
    "output-rank": "covrl.repro.output_rank",
    "reach": "covrl.repro.reach",
    "sparsity": "covrl.repro.sparsity",
    "covariance": "covrl.repro.covariance",
    "tangent": "covrl.repro.tangent",
    "async-gap": "covrl.repro.async_gap",
    "async-momentum": "covrl.repro.async_momentum",
    "lr-surge": "covrl.repro.lr_surge",
    "otb": "covrl.repro.otb",
    "lr-surge-long": "covrl.repro.lr_surge_long",
    "lr-surge-long-d": "covrl.repro.lr_surge_long_d",
    "otb-long": "covrl.repro.otb_long",
    "otb-long-d": "covrl.repro.otb_long_d",
    "ensemble-linear": "covrl.repro.ensemble_linear",
    "seq-jl": "covrl.repro.seq_jl",
    "ensemble-neural": "covrl.repro.ensemble_neural",
    "ensemble-neural-paper": "covrl.repro.ensemble_neural_paper",
}
