"""Reproduction `python -m studies otb-long-d`: design D of studies/otb/README.md (registered after design C's outcome,
before its own run). Design C at lr 3e-4 did not reach the regime (GRPO N=4 collapsed in 0 of 8 seeds), so D is the
same study at lr 6e-4, where lr-surge design D's constant-lr GRPO (N = 8) lost most of its reward within 3-6 steps
in its first seeds, with half the token budget (150k, for compute) and rule 1 "GRPO N=4 collapses in at least 3 of
8 seeds". Everything else, including the rules and the statistics, is design C's (`studies.otb.otb_long`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from studies.otb.otb_long import FULL
from studies.otb.otb_long import run as run_design

DESIGN_D = replace(FULL, lr=6e-4, token_budget=150_000, regime_min_collapsed=3)


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):
    return run_design(out_dir, fast=fast, seed=seed, full=DESIGN_D, name="otb-long-d")
