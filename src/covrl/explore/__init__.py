"""Ensemble++ (docs/theory.md §10): scalable Thompson sampling with index-input models, baselines, bandit
environments, the agent loop and the sequential-JL covariance diagnostic.

Names are resolved lazily so that `covrl bandit --help` (covrl.explore.cli) does not import torch."""

from __future__ import annotations

from covrl._lazy import lazy_exports

_EXPORTS = {
    "LinearEnsemblePP": "covrl.explore.linear",
    "LinearTS": "covrl.explore.linear",
    "EnsembleSampling": "covrl.explore.linear",
    "LinearGreedy": "covrl.explore.linear",
    "NeuralEnsemblePP": "covrl.explore.neural",
    "EnsemblePlus": "covrl.explore.neural",
    "EpiNet": "covrl.explore.neural",
    "Greedy": "covrl.explore.neural",
    "NeuralConfig": "covrl.explore.neural",
    "MLP": "covrl.explore.neural",
    "ensemble_pp_loss": "covrl.explore.neural",
    "REFERENCES": "covrl.explore.distributions",
    "PERTURBATIONS": "covrl.explore.distributions",
    "ENVS": "covrl.explore.envs",
    "make_env": "covrl.explore.envs",
    "AGENTS": "covrl.explore.loop",
    "make_agent": "covrl.explore.loop",
    "run_bandit": "covrl.explore.loop",
    "BanditResult": "covrl.explore.loop",
    "covariance_tracking": "covrl.explore.tracking",
    "BandTracker": "covrl.explore.tracking",
    "save_agent": "covrl.explore.base",
    "load_agent": "covrl.explore.base",
    "LMFeatures": "covrl.explore.lm",
}

__all__ = list(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
