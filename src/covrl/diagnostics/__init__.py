"""The seed's theory as measurements on tensors and nn.Modules (docs/theory.md §1–§5, §7).

Names are resolved lazily so that importing one diagnostic does not import them all."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "update_spectrum": "covrl.diagnostics.spectrum",
    "output_layer_signal": "covrl.diagnostics.output_layer",
    "reach_bound": "covrl.diagnostics.reach",
    "fisher_cap": "covrl.diagnostics.fisher",
    "covariance_split": "covrl.diagnostics.fisher",
    "fisher_diagonal": "covrl.diagnostics.fisher",
    "concentration": "covrl.diagnostics.fisher",
    "update_sparsity": "covrl.diagnostics.sparsity",
    "tangent_remainder": "covrl.diagnostics.tangent",
    "GradientNoiseMonitor": "covrl.diagnostics.noise",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'covrl.diagnostics' has no attribute {name!r}")
