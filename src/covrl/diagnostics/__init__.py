"""The seed's theory as measurements on tensors and nn.Modules (docs/theory.md §1–§5, §7).

Names are resolved lazily so that importing one diagnostic does not import them all."""

from __future__ import annotations

from covrl._lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _EXPORTS)
