"""`covrl bench async`: rollouts per second of the async loops (local sampler thread or process, Ray sampler actor) against
the sync loop, on the same model, task, batch and number of steps, in one process, with staleness statistics.

Each mode trains from the same initial weights for the same number of steps; the clock runs over the training
loop only (model loading, Ray start-up and actor start are excluded). Reported per mode: rollouts/s, the ratio to
sync, staleness mean/max, sampler and trainer idle fractions, and the time split of the sync loop. The ideal
overlap ratio of a two-stage pipeline, (t_generate + t_train) / max(t_generate, t_train), computed from the sync
run's own split, is the upper bound the async loop can reach when generation and training each get a core.

On a small CPU machine the ratio is limited by (1) cores: sampler and trainer share the machine's cores with
everything else, and torch ops of the two threads compete for them; (2) the GIL: the sampler's decode loop is
Python code between small torch ops, so with a tiny model the two threads mostly take turns; (3) weight sync:
each step clones the weights for the sampler. Larger models spend more time inside torch kernels (GIL released)
and overlap better; Ray actors avoid the GIL entirely but pay process start-up and object-store copies.

Mode `partial` is `async` with `async_loop.partial_rollouts`: weights reach the chunk in flight. It is measured
beside `async` for throughput and for the token lag (trainer version − the version that drew each token).
`--repeats N` runs the modes N times, alternating their order, and reports each mode's median.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from covrl.bench.common import add_output_options, output_dir, write_bench
from covrl.config import load_config, load_preset, override_strings
from covrl.train import (
    ensure_ray,
    prepare_async_run,
    prepare_run,
    read_jsonl,
    start_sampler_actors,
    train_async,
    train_ray,
    train_sync,
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per mode")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--staleness", type=int, default=1, help="async staleness bound in steps")
    parser.add_argument("--chunk-prompts", type=int, default=None, help="prompts per generate call (async)")
    parser.add_argument("--modes", default="sync,async,process,ray",
                        help="comma-separated subset of sync, async (sampler thread), partial (async with "
                             "partial rollouts), process (sampler process), ray")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating the order; medians")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--sft-steps", type=int, default=20, help="supervised warm-up (tiny model) so rewards vary")
    add_output_options(parser)   # --out, --update-baseline (covrl.bench.common)
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps, no Ray: seconds, for tests")


def _config(args, mode: str, run_root: Path):
    over = {
        "run.output_dir": str(run_root), "run.name": f"bench-{mode}", "run.num_threads": args.threads,
        "loop.mode": "async" if mode in ("process", "partial") else mode, "loop.steps": args.steps,
        "async_loop.partial_rollouts": mode == "partial",
        "async_loop.local_backend": "process" if mode == "process" else "thread", "loop.prompts_per_step": args.prompts_per_step,
        "loop.group_size": args.group_size, "sampler.max_new_tokens": args.max_new_tokens,
        "sampler.max_batch": args.prompts_per_step * args.group_size, "sampler.share_weights": "never",
        "eval.before": False, "eval.after": False, "checkpoint.at_end": False, "logging.console": False,
        "logging.curves": False, "logging.diagnostics": True,
        "async_loop.max_staleness_steps": args.staleness, "async_loop.trainer_actor": False,
        "async_loop.sampler_cpus": 1, "async_loop.sampler_threads": args.threads,
    }
    if args.chunk_prompts:
        over["async_loop.chunk_prompts"] = args.chunk_prompts
    if args.model == "smollm2":
        over.update({"model.source": "smollm2", "optim.lr": 2e-5, "optim.micro_batch_size": 16})
        return load_config(None, override_strings(over))
    # the tiny preset with a 4-layer, 128-wide model on one-digit addition, a short warm-up so rewards vary
    over.update({"model.tiny.hidden_size": 128, "model.tiny.num_layers": 4, "model.tiny.intermediate_size": 256,
                 "task.arithmetic.num_terms": 2, "task.n_train": 1000, "task.n_eval": 50,
                 "sft_warmup.steps": args.sft_steps, "sft_warmup.lr": 1e-3, "sft_warmup.batch_size": 32,
                 "optim.lr": 1e-3, "optim.micro_batch_size": 64})
    return load_preset("tiny", over)


def _measure(mode: str, cfg, records_key: str = "metrics.jsonl") -> dict:
    """Train `cfg` in `mode`; returns rollouts/s over the loop and the staleness/idle statistics."""

    out: dict = {"mode": mode}
    if mode == "sync":
        run = prepare_run(cfg, console=False)
        t0 = time.perf_counter()
        summary = train_sync(run)
        wall = time.perf_counter() - t0
        run.close()
    elif mode in ("async", "process", "partial"):
        run = prepare_async_run(cfg, console=False)
        t0 = time.perf_counter()
        summary = train_async(run)
        wall = time.perf_counter() - t0
        run.close()
    else:

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        started = ensure_ray(cfg.async_loop)
        try:
            actors = start_sampler_actors(cfg)
            run = prepare_async_run(cfg, console=False)
            t0 = time.perf_counter()
            summary = train_ray(run, actors=actors)
            wall = time.perf_counter() - t0
            run.close()
        finally:
            if started:
                import ray

                ray.shutdown()
    import gc

    records = read_jsonl(run.run_dir / records_key)
    del run
    gc.collect()        # free this mode's model, optimizer state and sampler copy before the next mode
    rollouts = sum(int(r.get("batch_rows", 0)) for r in records)
    if mode != "sync":   # the loop's own clock: worker start-up (processes, actors) is excluded
        wall = summary["async"]["wall_s"]
    # the trainer's own step time shows CPU contention: with no idle core, a sampler running beside the trainer
    # slows every step down even though the trainer never waits for data
    step_ms = 1e3 * sum(r.get("time/trainer_step", 0.0) for r in records) / max(1, len(records))
    out.update({"steps": len(records), "rollouts": rollouts, "loop_s": wall, "rollouts_per_s": rollouts / wall,
                "trainer_step_ms": step_ms, "load1": os.getloadavg()[0]})
    if mode == "sync":
        out["generate_s"] = sum(r.get("time/generate", 0.0) + r.get("time/score", 0.0) for r in records)
        out["train_s"] = sum(r.get("time/trainer_step", 0.0) for r in records)
        out["sync_s"] = sum(r.get("time/sync", 0.0) for r in records)
    else:
        a = summary["async"]
        n = max(1, len(records))
        out.update({"staleness_mean": sum(r["async/staleness_mean"] for r in records) / n,
                    "token_lag_mean": sum(r.get("async/token_lag_mean", 0.0) for r in records) / n,
                    "mixed_rows_frac": sum(r.get("async/mixed_rows_frac", 0.0) for r in records) / n,
                    "response_length_mean": sum(r.get("response/length_mean", 0.0) for r in records) / n,
                    "staleness_max": max((r["async/staleness_max"] for r in records), default=0.0),
                    "sampler_idle_frac": a["sampler_idle_frac"], "trainer_idle_frac": a["trainer_idle_frac"],
                    "kl_seq_mean": sum(r.get("kl_seq", 0.0) for r in records) / max(1, len(records))})
    return out


MODES = ("sync", "async", "partial", "process", "ray")


def _median_run(runs: list[dict]) -> dict:
    """The run of median rollouts/s (an actual run, so its statistics belong together)."""
    ordered = sorted(runs, key=lambda x: x["rollouts_per_s"])
    return dict(ordered[(len(ordered) - 1) // 2])


def run(args: argparse.Namespace) -> int:
    import tempfile

    import torch


    if args.quick:
        args.model, args.steps, args.prompts_per_step, args.group_size = "tiny", 3, 4, 4
        args.max_new_tokens, args.sft_steps = 4, 5
        args.modes = ",".join(m for m in args.modes.split(",") if m not in ("ray", "process"))
    torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    if "ray" in modes:
        try:
            import ray  # noqa: F401
        except ImportError:
            print("ray is not installed (pip install 'covrl[ray]'): skipping the ray mode")
            modes.remove("ray")
    results: dict = {"settings": vars(args).copy(), "cpu_count": os.cpu_count(), "modes": {}}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="covrl-bench-async-") as tmp:
        for r in range(max(1, args.repeats)):    # alternate the order: the shared cores' drift hits both sides
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                runs[mode].append(_measure(mode, _config(args, mode, Path(tmp) / f"r{r}")))
    for mode in modes:
        results["modes"][mode] = _median_run(runs[mode])
        if len(runs[mode]) > 1:
            results["modes"][mode]["rollouts_per_s_runs"] = [x["rollouts_per_s"] for x in runs[mode]]
    sync = results["modes"].get("sync")
    if sync:
        gen, train = sync["generate_s"], sync["train_s"]
        results["ideal_overlap_ratio"] = (gen + train) / max(gen, train, 1e-9)
        results["sync_generate_fraction"] = gen / max(gen + train, 1e-9)
    lines = ["| mode | rollouts/s | vs sync | staleness mean / max | token lag mean | mixed rows | sampler idle "
             "| trainer idle | trainer step ms | loop s |", "|---|---|---|---|---|---|---|---|---|---|"]
    reference = "sync" if sync else modes[0]
    base = results["modes"][reference]["rollouts_per_s"]
    lines[0] = lines[0].replace("vs sync", f"vs {reference}")
    for mode, r in results["modes"].items():
        ratio = r["rollouts_per_s"] / base
        r["ratio_to_sync" if sync else f"ratio_to_{reference}"] = ratio
        st = "-" if mode == "sync" else f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f}"
        idle_s = "-" if mode == "sync" else f"{r['sampler_idle_frac']:.0%}"
        idle_t = "-" if mode == "sync" else f"{r['trainer_idle_frac']:.0%}"
        lag = "- | -" if mode == "sync" else f"{r['token_lag_mean']:.2f} | {r['mixed_rows_frac']:.0%}"
        lines.append(f"| {mode} | {r['rollouts_per_s']:.1f} | {ratio:.2f}x | {st} | {lag} | {idle_s} | {idle_t} | "
                     f"{r['trainer_step_ms']:.0f} | {r['loop_s']:.1f} |")
    note = ""
    if sync:
        note = (f"\n\nSync time split: generate+score {sync['generate_s']:.1f} s, train {sync['train_s']:.1f} s "
                f"({results['sync_generate_fraction']:.0%} generation): a perfect two-stage overlap would give "
                f"{results['ideal_overlap_ratio']:.2f}x. Machine: {os.cpu_count()} CPUs, load average "
                f"{os.getloadavg()[0]:.1f}; model {args.model}, B = {args.prompts_per_step * args.group_size} "
                f"rollouts/step, {args.steps} steps, staleness bound {args.staleness}, "
                f"{max(1, args.repeats)} run(s) per mode (medians).")
    name = "async" + ("-quick" if args.quick else f"-{args.model}") + ("-partial" if "partial" in modes else "")
    headline = ", ".join(f"{mode} {r['rollouts_per_s'] / base:.2f}x" for mode, r in results["modes"].items()
                         if mode != reference) + f" {reference} rollouts/s"
    write_bench(name, results, "\n".join(lines) + note, output_dir(args), headline=headline)
    return 0
