"""`covrl bench distributed`: the trainer's step time on 1 process vs 2 ranks (gloo, DDP and FSDP2) on the same
global batch, and where the 2-rank time goes.

Every setup steps a `Trainer` on one synthetic scored batch (covrl.bench.step_bench.synthetic_batch, the same on
every rank; lr 1e-9 so the weights do not drift), warm-up steps first, then the median of `--steps` timed steps
(a barrier before each; a step's time is the slowest rank's). Setups:

- 1 process with `--threads` threads (the per-rank budget) and with `world x threads` (the whole budget the
  2 ranks use: the fair baseline on a machine with that many cores);
- 2 ranks, `trainer.parallel=ddp` and `fsdp2`;
- the communication share of DDP: the same DDP step with gradient synchronisation off (every micro-batch under
  `no_sync`: the same compute, no gradient all-reduce; the weights then differ between ranks, harmless at lr
  1e-9), share = 1 - t(no sync) / t(ddp); plus a standalone all-reduce of a buffer the size of the trainable
  gradient and the leader's broadcast of the batch (what a run adds per step: `Channel`).

Timings go to runs/bench/distributed-<model>/<cpu>.json with the table beside it (`--update-baseline`: the
committed baseline under benchmarks/)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from covrl.bench.common import add_output_options, load1, output_dir, write_bench
from covrl.bench.models import DEFAULT_CACHE, cached_model
from covrl.bench.settings import StepSettings, bench_train_config, default_task_overrides
from covrl.bench.step_bench import synthetic_batch
from covrl.train import Channel, Trainer, free_port, git_state


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--rows", type=int, default=32, help="rows of the global batch")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=16, help="optim.micro_batch_size")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setup (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first wraps the model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--world", type=int, default=2, help="ranks of the distributed setups")
    parser.add_argument("--cache-dir", default=None, help="model folder cache (default runs/cache)")
    add_output_options(parser)   # --out, --update-baseline (covrl.bench.common)
    parser.add_argument("--whole-budget", action=argparse.BooleanOptionalAction, default=True,
                        help="also time 1 process with world x threads threads")
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 rows, 1+1 steps, no 1 x world*threads "
                                                             "setup (tests)")


def _config(opts: dict, parallel: str):
    settings = StepSettings(model=opts["model"], n_prompts=max(1, opts["rows"] // opts["group_size"]),
                            group_size=opts["group_size"], learning_rate=1e-9,
                            task=default_task_overrides(opts["model"]))
    return bench_train_config(
        settings, algorithm={"advantage": "grpo", "loss": "covariance"},
        optim={"lr": 1e-9, "micro_batch_size": opts["micro_batch"], "max_grad_norm": 1.0},
        loop={"steps": 1000, "prompts_per_step": settings.n_prompts, "group_size": opts["group_size"]},
        run={"seed": 0, "num_threads": opts["threads"]}, logging={"noise_scale": False},
        trainer={"parallel": parallel})


def _time_steps(trainer, batch, opts: dict, world: int) -> list[dict]:

    out = []
    for i in range(opts["warmup"] + opts["steps"]):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        m = trainer.step(batch)
        row = torch.tensor([time.perf_counter() - t0, m.get("time/forward_backward", 0.0),
                            m.get("time/optimizer", 0.0)], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(row, op=dist.ReduceOp.MAX)   # the step ends when the slowest rank ends
        if i >= opts["warmup"]:
            out.append({"step_s": float(row[0]), "forward_backward_s": float(row[1]), "optimizer_s": float(row[2]),
                        "load1": load1()})
    return out


def _setups(rank: int, world: int, opts: dict) -> dict:
    """Every setup of this world size on this rank (a collective sequence when world > 1)."""


    cache = opts["cache_dir"] or DEFAULT_CACHE
    results: dict = {}
    modes = ["none"] if world == 1 else ["ddp", "ddp-no-sync", "fsdp2"]
    for mode in modes:
        model, _ = cached_model(opts["model"], cache)
        model.train()
        batch = synthetic_batch(model, model.config.vocab_size, opts["rows"], opts["prompt_length"],
                                opts["response_length"], opts["group_size"])
        trainer = Trainer(model, _config(opts, "ddp" if mode == "ddp-no-sync" else mode))
        if mode == "ddp-no-sync":   # the same compute with no gradient all-reduce (see the module doc)
            trainer._distribute()
            par = trainer.parallel
            par.gradient_sync = lambda sync, par=par: par.module.no_sync()
        results[mode] = _time_steps(trainer, batch, opts, world)
        if mode == "ddp":
            numel = sum(p.numel() for p in trainer.params)
            buf = torch.zeros(numel, dtype=torch.float32)
            times = []
            for _ in range(opts["steps"]):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                times.append(time.perf_counter() - t0)
            results["allreduce_grad_s"] = statistics.median(times)
            results["grad_numel"] = numel
            times = []
            for _ in range(opts["steps"]):
                dist.barrier()
                t0 = time.perf_counter()
                Channel().send(("step", batch)) if rank == 0 else Channel().recv()
                times.append(time.perf_counter() - t0)
            results["batch_broadcast_s"] = statistics.median(times)
        del trainer, model
    return results


def _worker(rank: int, world: int, port: int, opts: dict, out: str) -> None:

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world)})
    torch.set_num_threads(opts["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = _setups(rank, world, opts)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.model, args.rows, args.steps, args.warmup, args.micro_batch = "tiny", 8, 1, 1, 8

    opts = {k: getattr(args, k) for k in ("model", "rows", "group_size", "prompt_length", "response_length",
                                          "micro_batch", "steps", "warmup", "threads", "cache_dir")}

    cached_model(args.model, args.cache_dir or DEFAULT_CACHE)   # build the cached model folder once, here
    setups: dict = {}
    budgets = sorted({args.threads, args.threads * args.world}) if args.whole_budget and not args.quick \
        else [args.threads]
    for threads in budgets:   # 1 process: the per-rank thread budget and the whole one
        torch.set_num_threads(threads)
        setups[f"1x{threads}"] = _setups(0, 1, {**opts, "threads": threads})["none"]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "world.pt")
        mp.spawn(_worker, args=(args.world, free_port(), opts, out), nprocs=args.world, join=True)
        dist_results = torch.load(out, weights_only=True)
    for mode in ("ddp", "ddp-no-sync", "fsdp2"):
        setups[f"{args.world}x{args.threads} {mode}"] = dist_results[mode]

    base = _median(setups[f"1x{args.threads}"], "step_s")
    rows = []
    for name, runs in setups.items():
        step = _median(runs, "step_s")
        rows.append({"setup": name, "step_s": step, "forward_backward_s": _median(runs, "forward_backward_s"),
                     "optimizer_s": _median(runs, "optimizer_s"), "speedup_vs_1x": base / step,
                     "load1": _median(runs, "load1"), "runs": runs})
    t_ddp = _median(setups[f"{args.world}x{args.threads} ddp"], "step_s")
    t_nosync = _median(setups[f"{args.world}x{args.threads} ddp-no-sync"], "step_s")
    comm = {"ddp_comm_share": 1.0 - t_nosync / t_ddp, "allreduce_grad_s": dist_results["allreduce_grad_s"],
            "grad_numel": dist_results["grad_numel"], "batch_broadcast_s": dist_results["batch_broadcast_s"]}
    results = {"source": git_state(), "options": opts, "setups": rows, "communication": comm,
               "cpu_count": os.cpu_count()}
    table = ["| setup (ranks x threads) | step s | fwd+bwd s | optimizer s | speed-up vs 1 process | load1 |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['setup']} | {r['step_s']:.4f} | {r['forward_backward_s']:.4f} | {r['optimizer_s']:.4f} | "
              f"{r['speedup_vs_1x']:.2f}x | {r['load1']:.1f} |" for r in rows]
    note = (f"\nmodel {args.model}, global batch {args.rows} rows x ({args.prompt_length} prompt + "
            f"{args.response_length} response) tokens, groups of {args.group_size}, micro-batch {args.micro_batch}, "
            f"median of {args.steps} steps after {args.warmup} warm-up, gloo on {os.cpu_count()} CPU cores. "
            f"DDP communication share (1 - no-sync / ddp step): {100 * comm['ddp_comm_share']:.0f}%; a standalone "
            f"all-reduce of the {comm['grad_numel'] / 1e6:.2f} M-float gradient: {1e3 * comm['allreduce_grad_s']:.1f} "
            f"ms; the leader's batch broadcast (per step in a run): {1e3 * comm['batch_broadcast_s']:.1f} ms.\n")
    ddp = next(r for r in rows if r["setup"].endswith(" ddp"))
    headline = (f"{args.world} ranks DDP {ddp['speedup_vs_1x']:.2f}x one process; communication "
                f"{100 * comm['ddp_comm_share']:.0f}%")
    write_bench(f"distributed-{args.model}" + ("-quick" if args.quick else ""), results,
                "\n".join(table) + "\n" + note, output_dir(args), headline=headline)
    return 0
