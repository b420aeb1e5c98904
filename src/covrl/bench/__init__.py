"""Benchmarks. Each module exposes `configure(parser)` and `run(args) -> dict`; results land as JSON + a table
with the machine description under `runs/bench/`, or as the committed baselines under `benchmarks/` with
`--update-baseline` (covrl.bench.common.output_dir). Timings live here, never in test assertions."""

BENCHES: dict[str, str] = {
    "trl": "covrl.bench.trl_bench",
    "rollout": "covrl.bench.rollout_bench",
    "step": "covrl.bench.step_bench",
    "async": "covrl.bench.async_bench",
    "explore": "covrl.bench.explore_bench",
    "distributed": "covrl.bench.distributed_bench",
    "throughput": "covrl.bench.throughput_bench",
    "tta": "covrl.bench.tta_bench",
}
