"""covrl's studies: reproductions of the ten results covrl is built on (docs/theory.md ¶1-¶10) and the studies
that measured its defaults against peers. Each folder holds one study: its README (question, registered designs,
command, results, verdict), its code and its recorded runs. Run one with `python -m studies NAME` from the
repository root; the package `covrl` never imports this folder.

Two kinds of entry:
- a reproduction exposes `run(out_dir: Path, *, fast: bool = False, seed: int = 0) -> ReproResult`
  (studies.common): `python -m studies NAME [--fast] [--out DIR] [--seed N]`;
- a study command has its own options: `configure(parser)` + `run(args) -> int`, or a `main()` that reads
  sys.argv: `python -m studies NAME [its options]`.
"""

from __future__ import annotations

# name -> module; imported when the study runs.
STUDIES: dict[str, str] = {
    "output-rank": "studies.output_rank.output_rank",
    "reach": "studies.reach.reach",
    "sparsity": "studies.sparsity.sparsity",
    "covariance": "studies.covariance.covariance",
    "tangent": "studies.tangent.tangent",
    "async-gap": "studies.async_gap.async_gap",
    "async-momentum": "studies.async_gap.async_momentum",
    "lr-surge": "studies.lr_surge.lr_surge",
    "otb": "studies.otb.otb",
    "lr-surge-long": "studies.lr_surge.lr_surge_long",
    "lr-surge-long-d": "studies.lr_surge.lr_surge_long_d",
    "otb-long": "studies.otb.otb_long",
    "otb-long-d": "studies.otb.otb_long_d",
    "ensemble-linear": "studies.ensemble_linear.ensemble_linear",
    "seq-jl": "studies.seq_jl.seq_jl",
    "ensemble-neural": "studies.ensemble_neural.ensemble_neural",
    "ensemble-neural-paper": "studies.ensemble_neural.ensemble_neural_paper",
}

COMMANDS: dict[str, str] = {
    "suite": "studies.suite.suite",
    "suite-base-accuracy": "studies.suite.suite_base_accuracy",
    "time-to-accuracy": "studies.time_to_accuracy.time_to_accuracy",
    "gap-study": "studies.gap_study.gap_study",
    "vllm-gap-study": "studies.gap_study.vllm_gap_study",
    "smollm2-stability": "studies.smollm2_stability.smollm2_stability",
    "sampler-compile": "studies.sampler_compile.sampler_compile_numerics",
    "vllm-engine": "studies.vllm_engine.measure_vllm",
    "vllm-floor-options": "studies.vllm_engine.measure_vllm_floor_options",
    "vllm-engine-process": "studies.vllm_engine.measure_vllm_process",
    "truncation-gap": "studies.truncation.measure_gap",
}
