"""Reproduction `python -m studies lr-surge-long-d`: design D of studies/lr_surge/README.md (registered after design C's
outcome, before its own run). Design C at peak lr 3e-4 did not reach the regime (the constant arm collapsed in 0 of 8
seeds and no run's length surged), so D is the same study at twice the lr, 6e-4 (between 3e-4, which degraded
without collapsing, and the pilot's 1e-3, which collapsed both pilot seeds within 10 steps), 16 steps, with rule 1
"the constant arm collapses in at least 3 of 8 seeds" (an all-collapse outcome still tests warning and prevention).
Everything else, including the rules and the statistics, is design C's (`studies.lr_surge.lr_surge_long`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from studies.lr_surge.lr_surge_long import FULL
from studies.lr_surge.lr_surge_long import run as run_design

DESIGN_D = replace(FULL, lr=6e-4, steps=16, regime_min_collapsed=3)


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):
    return run_design(out_dir, fast=fast, seed=seed, full=DESIGN_D, name="lr-surge-long-d")
