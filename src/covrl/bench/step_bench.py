"""`covrl bench step`: the trainer's cost, without generation.

1. Forward+backward grid: `forward_batch` (one forward over [prompt | response], prompts shared within
   groups as by default, log-probs of the response tokens) + a token-mean policy-gradient loss + backward,
   by micro-batch rows and response length, with and without the detached per-token statistics (entropy,
   Σπ²) the Trainer computes for OTB and the metrics. tokens/s counts response tokens (those with a gradient).
2. Prompt sharing (`optim.share_prompts`): the rows of a group share their prompt, which the Trainer runs
   once per group; timed on vs off on the same batch, with the log-prob and gradient differences.
3. (`--compile also|only`) Eager vs `torch.compile`d forward+backward (`trainer.compile`, covrl.models.compiled):
   on the grid, the eager pass with shared prompts (the default), the eager per-row pass and the compiled
   per-row pass (what `trainer.compile` runs), alternating; the compile time of each cell in its own column
   (0 where one dynamic-shape graph served a new shape) and the compiled-vs-eager log-prob and gradient
   differences.
4. Variants: a full `Trainer.step` on one synthetic scored batch for the plain loss (GRPO advantages +
   covariance loss, no correction) and for OTB and each correction / extra term switched on alone; reported
   as median step time and overhead over the plain step. All variants run round-robin on one Trainer (its
   config swapped between steps, lr 1e-9 so the weights do not drift), so load changes hit all alike.
4. `--autocast none,bf16` (trainer.autocast modes): the grid and the variants run once per mode, alternating
   within each repeat; the grid reports each mode's time as a ratio to the first mode's, and the mismatch the
   mixed precision adds against the first mode's log-probs on the same tokens (max / mean |Δ log p|, and
   mismatch/k3, kl_seq = mean_b Σ_t k3 as the run's metrics compute them, covrl.math).

The synthetic batch: random prompt and response ids, full masks, sampler log-probs = the model's own
log-probs plus N(0, 0.05²) noise (so IS weights and rejection are not trivially 1), the model's top-K for
score centring, Bernoulli(0.5) rewards in groups of `group_size`.

Threads (`--threads 1,2,auto`): every timed call of 1. and 3. runs once per thread count, the counts
alternating (reversed every repeat) so that load changes hit all alike; `auto` is `run.num_threads: auto`
resolved once at start (covrl.train.run.threads). `--load N` starts N busy-loop processes, waits `--load-warmup`
seconds so that the 1-minute load average (which auto reads) sees them, measures, and kills them; the tables
state the load average."""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import replace

from covrl.bench.common import add_output_options, count_flops, measure_matmul_flops, output_dir, write_bench
from covrl.bench.models import DEFAULT_CACHE, cached_model
from covrl.bench.settings import StepSettings, bench_train_config, default_task_overrides
from covrl.math import kl_estimate, rollout_correction, token_logprobs
from covrl.models import frozen_copy
from covrl.models.precision import AUTOCAST_MODES, check_autocast, cpu_bf16_support
from covrl.rollout import ScoredBatch
from covrl.train import Trainer, forward_batch, git_state

# name -> config sections (dicts) merged over the plain step; "needs" lists extra inputs
VARIANTS: dict[str, dict] = {
    "plain (grpo + covariance)": {},
    "otb advantage": {"algorithm": {"advantage": "otb"}},
    "ppo_clip loss": {"algorithm": {"loss": "ppo_clip"}},
    "token IS (C=2)": {"correction": {"is_level": "token"}},
    "sequence IS (C=2)": {"correction": {"is_level": "sequence"}},
    "token IS batch-normalised": {"correction": {"is_level": "token", "is_batch_normalize": True}},
    "rejection seq_mean_k3": {"correction": {"rs": ["seq_mean_k3"], "rs_threshold": [0.01]}},
    "score centring (K=8)": {"algorithm": {"score_centering": True}},
    "KL loss k3 (ref model)": {"kl": {"coef": 0.01}},
    "no tangent diagnostics": {"logging": {"diagnostics": False}},
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--micro-batches", default="4,16", help="rows per forward/backward (grid)")
    parser.add_argument("--lengths", default="16,64", help="response tokens per row (grid)")
    parser.add_argument("--prompt-length", type=int, default=42, help="prompt tokens (the default task: 42)")
    parser.add_argument("--rows", type=int, default=16, help="rows of the batch for the variants")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=16,
                        help="response tokens in the variants' batch (default run: max_new_tokens 16)")
    parser.add_argument("--micro-batch", type=int, default=16, help="optim.micro_batch_size of the variants")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1",
                        help="torch thread counts to compare, alternating: comma-separated ints and/or 'auto'")
    parser.add_argument("--load", type=int, default=0,
                        help="busy-loop processes to run during the measurement (an artificial load)")
    parser.add_argument("--load-warmup", type=float, default=60.0,
                        help="seconds to let the load average rise after starting --load before measuring")
    parser.add_argument("--autocast", default="none",
                        help="comma-separated trainer.autocast modes to time side by side, e.g. none,bf16 (the "
                             "first is the baseline of the ratios and of the log-prob mismatch)")
    parser.add_argument("--variants", default="all", help="comma-separated variant names or 'all'")
    parser.add_argument("--cache-dir", default=None, help="model folder cache (default runs/cache)")
    add_output_options(parser)   # --out, --update-baseline (covrl.bench.common)
    parser.add_argument("--quick", action="store_true", help="tiny model, small grid, 1 repeat (tests)")
    parser.add_argument("--compile", default="off", choices=["off", "also", "only"],
                        help="eager vs torch.compile'd forward+backward on the grid: off, also (after the other "
                             "sections), only (that comparison alone)")
    parser.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                        help="torch.compile backend of --compile (trainer.compile_backend)")
    parser.add_argument("--packing", action="store_true",
                        help="only: padded vs packed forward+backward (trainer.packing) on --rows rows whose "
                             "responses spread over --spread tokens, alternating")
    parser.add_argument("--spread", default="8,256", help="min,max response tokens of --packing's rows (uniform)")


def synthetic_batch(model, vocab: int, rows: int, prompt_len: int, resp_len: int, group_size: int,
                    topk: int = 8, seed: int = 0):
    """A scored RolloutBatch of random tokens whose sampler log-probs are the model's own plus small noise."""
    import torch


    g = torch.Generator().manual_seed(seed)
    low = 4 if vocab > 8 else 0  # keep clear of special ids
    groups = -(-rows // group_size)
    # the rows of a group answer the same prompt, as in RL
    prompt = torch.randint(low, vocab, (groups, prompt_len), generator=g).repeat_interleave(group_size, 0)[:rows]
    resp = torch.randint(low, vocab, (rows, resp_len), generator=g)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, resp], 1)).logits[:, prompt_len - 1:-1].float()
        lp = token_logprobs(logits, resp)
        top = torch.log_softmax(logits, -1).topk(topk, dim=-1)
    noise = 0.05 * torch.randn(lp.shape, generator=g)
    return ScoredBatch(
        prompt_ids=prompt, prompt_mask=torch.ones(rows, prompt_len), response_ids=resp,
        response_mask=torch.ones(rows, resp_len), sampler_logprobs=lp + noise,
        group_ids=torch.arange(rows) // group_size, policy_version=torch.zeros(rows, dtype=torch.long),
        rewards=(torch.rand(rows, generator=g) < 0.5).float(), sampler_topk_ids=top.indices,
        sampler_topk_logprobs=top.values, correct=(False,) * rows,
    )


def _gradient_difference(model, batch, arms) -> dict[str, float]:
    """Log-prob and parameter-gradient differences between two ways of computing the same forward+backward on
    `batch`: `arms` is two (module, share_prompts) pairs whose gradients land in `model`'s parameters; the loss is
    the masked sum of the response log-probs."""
    import torch

    mask = batch.response_mask
    lps, grads = [], []
    for module, share in arms:
        model.zero_grad(set_to_none=True)
        lp = forward_batch(module, batch, 1.0, with_stats=False, share_prompts=share).logprobs
        (lp * mask).sum().backward()
        lps.append(lp.detach() * mask)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    return {"logprob_max_diff": float((lps[0] - lps[1]).abs().max()),
            "grad_max_diff": float((grads[0] - grads[1]).abs().max()),
            "grad_rel_diff": float((grads[0] - grads[1]).norm() / grads[0].norm().clamp_min(1e-30))}


def prompt_sharing_check(model, batch) -> dict[str, float]:
    """Max |log-prob difference| and relative L2 difference of the parameter gradients between
    `forward_batch` with and without `share_prompts` on the same batch and loss."""
    diff = _gradient_difference(model, batch, ((model, False), (model, True)))
    return {k: diff[k] for k in ("logprob_max_diff", "grad_rel_diff")}


def autocast_mismatch(base_lp, mixed_lp, mask) -> dict[str, float]:
    """The gap a mixed-precision trainer adds against a sampler at the base precision on the same tokens, as
    the run's metrics compute it: the mixed log-probs in the trainer's place, the base ones in the sampler's."""
    m = rollout_correction(mixed_lp, base_lp, mask).metrics
    diff = ((mixed_lp - base_lp) * mask).abs()
    return {"logprob_max_abs_diff": float(diff.max()), "logprob_mean_abs_diff": float(diff.sum() / mask.sum()),
            "mismatch/k3": float(m["mismatch/k3"]), "mismatch/max_abs_lr": float(m["mismatch/max_abs_lr"]),
            "kl_seq": float((kl_estimate(base_lp, mixed_lp, "k3") * mask).sum(1).mean())}


def _fwd_bwd(model, batch, with_stats: bool, share_prompts: bool = True, autocast: str = "none",
             packing: bool = False) -> float:
    import torch


    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    fwd = forward_batch(model, batch, 1.0, with_stats=with_stats, share_prompts=share_prompts,
                           autocast=autocast, packing=packing)
    mask = batch.response_mask
    adv = torch.where(batch.rewards > 0.5, 1.0, -1.0)[:, None]
    loss = -(fwd.logprobs * adv * mask).sum() / mask.sum()
    loss.backward()
    return time.perf_counter() - t0


def packing_compare(model, vocab: int, args) -> dict:
    """Padded vs packed forward+backward of one batch whose response lengths spread uniformly over
    `args.spread` (prompts shared within groups on both sides), alternating, median of `args.repeats`."""
    import torch

    low, high = (int(x) for x in args.spread.split(","))
    batch = synthetic_batch(model, vocab, args.rows, args.prompt_length, high, args.group_size, topk=1)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(low, high + 1, (args.rows,), generator=g)
    mask = (torch.arange(high)[None] < lengths[:, None]).float()
    batch = replace(batch, response_mask=mask, response_ids=batch.response_ids * mask.long())
    tokens = float(mask.sum())
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    for rep in range(args.repeats + 1):
        for arm in (["padded", "packed"] if rep % 2 == 0 else ["packed", "padded"]):
            dt = _fwd_bwd(model, batch, False, packing=arm == "packed")
            if rep:
                times[arm].append(dt)
    with torch.no_grad():
        a = forward_batch(model, batch, 1.0, with_stats=False).logprobs
        b = forward_batch(model, batch, 1.0, with_stats=False, packing=True).logprobs
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rows": args.rows, "spread": [low, high], "response_tokens": tokens,
            "padded_tokens": float(args.rows * high), "prompt_length": args.prompt_length,
            "padded_s": med["padded"], "packed_s": med["packed"], "speedup": med["padded"] / med["packed"],
            "padded_tokens_per_s": tokens / med["padded"], "packed_tokens_per_s": tokens / med["packed"],
            "logprob_max_diff": float(((a - b) * mask).abs().max()), "runs": times}


def packing_table(p: dict) -> str:
    return ("| side | fwd+bwd s | response tokens/s |\n|---|---|---|\n"
            f"| padded | {p['padded_s']:.3f} | {p['padded_tokens_per_s']:.1f} |\n"
            f"| packed | {p['packed_s']:.3f} | {p['packed_tokens_per_s']:.1f} |\n\n"
            f"{p['rows']} rows, responses {p['spread'][0]}-{p['spread'][1]} tokens ({p['response_tokens']:.0f} of "
            f"{p['padded_tokens']:.0f} padded positions), prompt {p['prompt_length']}; packed/padded speed-up "
            f"**{p['speedup']:.2f}x**; max |d log p| {p['logprob_max_diff']:.1e}.\n")


def parse_threads(spec: str) -> list[int | str]:
    """`--threads`: comma-separated positive ints and/or 'auto', each at most once."""
    from covrl.train import check_num_threads

    arms: list[int | str] = []
    for part in (p.strip() for p in str(spec).split(",")):
        try:
            value = check_num_threads(int(part) if part.isdigit() else part, field="--threads: each count")
        except ValueError as err:
            raise SystemExit(str(err)) from None
        if value is None or value in arms:
            raise SystemExit(f"--threads: {part!r} is empty or repeated in {spec!r}")
        arms.append(value)
    return arms


class BusyLoad:
    """`n` busy-loop processes (an artificial load), started on enter and killed on exit."""

    def __init__(self, n: int, warmup_s: float):
        self.n, self.warmup_s, self.procs = n, warmup_s, []

    def __enter__(self):
        import subprocess
        import sys

        # each loop ends by itself once this process is gone (killed without running __exit__)
        spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(self.n)]
        if self.n and self.warmup_s > 0:
            time.sleep(self.warmup_s)   # the 1-minute load average (which auto reads) rises to the new load
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        return False


def compile_numerics(model, compiled, batch) -> dict[str, float]:
    """Max |log-prob difference| and max |gradient difference| (and the relative L2 gradient difference) of the
    compiled per-row forward+backward against the eager one, same batch and loss."""
    return _gradient_difference(model, batch, ((model, False), (compiled, False)))


def compile_grid(model, vocab: int, args) -> list[dict]:
    """Section 3: per grid cell the first compiled call (compile time apart), the numerics, then eager shared /
    eager per-row / compiled per-row forward+backward alternating (order flipped each repeat)."""
    import os

    from covrl.models.compiled import compile_module, compile_seconds

    compiled = compile_module(model, args.compile_backend)
    arms = {"eager": (model, True), "eager_rows": (model, False), "compiled": (compiled, False)}
    out = []
    for mb in (int(x) for x in args.micro_batches.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            batch = synthetic_batch(model, vocab, mb, args.prompt_length, length, min(args.group_size, mb))
            c0 = compile_seconds()
            first_s = _fwd_bwd(compiled, batch, False, share_prompts=False)
            compile_s = compile_seconds() - c0
            numerics = compile_numerics(model, compiled, batch)
            _fwd_bwd(model, batch, False)  # eager warm-up
            times: dict[str, list[float]] = {k: [] for k in arms}
            loads = []
            for rep in range(args.repeats):
                for arm in (list(arms) if rep % 2 == 0 else list(reversed(arms))):
                    module, share = arms[arm]
                    times[arm].append(_fwd_bwd(module, batch, False, share_prompts=share))
                loads.append(os.getloadavg()[0])
            med = {k: statistics.median(v) for k, v in times.items()}
            out.append({"micro_batch": mb, "response_length": length, "prompt_length": args.prompt_length,
                        "compile_s": compile_s, "first_call_s": first_s, **{f"{k}_s": v for k, v in med.items()},
                        "compiled_vs_eager_rows": med["eager_rows"] / med["compiled"],
                        "compiled_vs_eager": med["eager"] / med["compiled"], **numerics,
                        "load1": statistics.fmean(loads), "runs": times})
    model.zero_grad(set_to_none=True)
    return out


def compile_table(rows: list[dict], backend: str) -> str:
    t = [f"Eager vs torch.compile ({backend}, dynamic shapes) forward+backward; speed-up = eager s / compiled s "
         "(> 1: compiled faster); compile s = compile time of the cell's first call (0: no re-compile):",
         "", "| micro-batch | response len | compile s | eager shared s | eager per-row s | compiled per-row s | "
         "speed-up vs per-row | speed-up vs shared | max abs dlogp | max abs dgrad | grad rel. diff | load |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    t += [f"| {r['micro_batch']} | {r['response_length']} | {r['compile_s']:.1f} | {r['eager_s']:.3f} | "
          f"{r['eager_rows_s']:.3f} | {r['compiled_s']:.3f} | {r['compiled_vs_eager_rows']:.2f}x | "
          f"{r['compiled_vs_eager']:.2f}x | {r['logprob_max_diff']:.1e} | {r['grad_max_diff']:.1e} | "
          f"{r['grad_rel_diff']:.1e} | {r['load1']:.1f} |" for r in rows]
    return "\n".join(t) + "\n"


def run(args: argparse.Namespace) -> int:
    import os

    if args.quick:
        args.model, args.micro_batches, args.lengths, args.rows, args.repeats = "tiny", "4", "8", 8, 1
        args.group_size, args.micro_batch, args.response_length, args.prompt_length = 4, 8, 8, 8
    arms = parse_threads(args.threads)
    if args.load < 0:
        raise SystemExit("--load: the number of busy-loop processes must be >= 0")
    with BusyLoad(args.load, args.load_warmup):
        return _measure(args, arms, os.getloadavg()[0])


def _measure(args: argparse.Namespace, arm_specs: list[int | str], load_start: float) -> int:
    import os

    import torch

    from covrl.train import resolve_num_threads

    modes = [m.strip() for m in args.autocast.split(",")]
    for mode in modes:
        if mode not in AUTOCAST_MODES:
            raise SystemExit(f"--autocast: unknown mode {mode!r}; allowed: {sorted(AUTOCAST_MODES)}")
        check_autocast(mode, "cpu")
    choices = {arm: resolve_num_threads(arm) for arm in arm_specs}   # auto: resolved once, before any work
    arms = [str(a) for a in arm_specs]
    count = {str(a): c.threads for a, c in choices.items()}

    def order(rep: int) -> list[str]:
        return arms if rep % 2 == 0 else list(reversed(arms))

    def use(arm: str) -> None:
        torch.set_num_threads(count[arm])

    use(arms[0])
    model, tokenizer = cached_model(args.model, args.cache_dir or DEFAULT_CACHE)
    model.train()
    vocab = model.config.vocab_size
    if args.packing:
        results = {"source": git_state(), "model": args.model, "threads": count[arms[0]],
                   "packing": packing_compare(model, vocab, args)}
        p = results["packing"]
        write_bench(f"step-packing-{args.model}" + ("-quick" if args.quick else ""), results, packing_table(p),
                    output_dir(args), headline=f"packed fwd+bwd {p['speedup']:.2f}x padded ({p['rows']} rows, "
                                             f"responses {p['spread'][0]}-{p['spread'][1]} tokens)")
        return 0
    if args.compile == "only":
        rows = compile_grid(model, vocab, args)
        results = {"source": git_state(), "model": args.model, "threads": count[arms[0]],
                   "compile_backend": args.compile_backend, "compile": rows}
        note = (f"\nmodel {args.model}, {count[arms[0]]} thread(s), prompt {args.prompt_length} tokens, groups of "
                f"{args.group_size}, {args.repeats} alternating repeats (median).\n")
        write_bench(f"step-compile-{args.model}" + ("-quick" if args.quick else ""), results,
                    compile_table(rows, args.compile_backend) + note, output_dir(args),
                    headline=f"compiled fwd+bwd {rows[-1]['compiled_vs_eager']:.2f}x eager "
                             f"({rows[-1]['micro_batch']} rows x {rows[-1]['response_length']} tokens)")
        return 0

    # the matmul roof per thread count and compute dtype (the bf16 modes share one), for the share-of-bound column
    dtypes = {mode: "float32" if mode == "none" else "bfloat16" for mode in modes}
    roof = {}
    for arm in arms:
        use(arm)
        for dtype in dict.fromkeys(dtypes.values()):   # each once, in mode order
            roof[arm, dtype] = measure_matmul_flops(256 if args.quick else 1024, dtype=dtype)
    use(arms[0])

    # 1. forward+backward grid, with/without the per-token statistics, alternating over the thread counts and
    #    the autocast modes
    grid = []
    combos = [(mode, stats) for mode in modes for stats in (True, False)]
    for mb in (int(x) for x in args.micro_batches.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            batch = synthetic_batch(model, vocab, mb, args.prompt_length, length, min(args.group_size, mb))
            flops = count_flops(functools.partial(_fwd_bwd, model, batch, False))   # untimed: one plain pass
            times = {(arm, mode, stats): [] for arm in arms for mode, stats in combos}
            loads = {arm: [] for arm in arms}
            for arm in arms:   # warm-up at every thread count and mode
                use(arm)
                for mode in modes:
                    _fwd_bwd(model, batch, True, autocast=mode)
            for rep in range(args.repeats):
                for arm in order(rep):
                    use(arm)
                    for mode, stats in (combos if rep % 2 == 0 else combos[::-1]):
                        times[arm, mode, stats].append(_fwd_bwd(model, batch, stats, autocast=mode))
                    loads[arm].append(os.getloadavg()[0])
            use(arms[0])
            with torch.no_grad():
                lps = {mode: forward_batch(model, batch, 1.0, with_stats=False, autocast=mode).logprobs
                       for mode in modes}
            for arm in arms:
                base_s = statistics.median(times[arm, modes[0], False])
                for mode in modes:
                    plain = statistics.median(times[arm, mode, False])
                    full = statistics.median(times[arm, mode, True])
                    row = {"threads": count[arm], "threads_arm": arm, "micro_batch": mb, "response_length": length,
                           "prompt_length": args.prompt_length, "autocast": mode, "fwd_bwd_s": plain,
                           "fwd_bwd_stats_s": full, "tokens_per_s": mb * length / plain,
                           "tokens_per_s_stats": mb * length / full,
                           "all_tokens_per_s": mb * (length + args.prompt_length) / plain,
                           "stats_overhead": full / plain - 1.0, "speedup_vs_first_mode": base_s / plain,
                           "matmul_flops": flops, "matmul_roof_flop_s": roof[arm, dtypes[mode]],
                           "share_of_matmul_bound": flops / plain / roof[arm, dtypes[mode]],
                           "load1": statistics.median(loads[arm])}
                    if mode != modes[0]:
                        row["mismatch_vs_first_mode"] = autocast_mismatch(lps[modes[0]], lps[mode],
                                                                          batch.response_mask)
                    grid.append(row)
    model.zero_grad(set_to_none=True)

    # 2. the Trainer's prompt sharing (optim.share_prompts): exactness, then timed on vs off (first thread count)
    use(arms[0])
    pbatch = synthetic_batch(model, vocab, args.rows, args.prompt_length, args.response_length, args.group_size)
    prefix = prompt_sharing_check(model, pbatch)
    _fwd_bwd(model, pbatch, False, share_prompts=True)
    times = {False: [], True: []}
    for rep in range(args.repeats):
        for share in ((False, True) if rep % 2 == 0 else (True, False)):
            times[share].append(_fwd_bwd(model, pbatch, False, share_prompts=share))
    prefix.update({"per_row_prompts_s": statistics.median(times[False]),
                   "shared_prompts_s": statistics.median(times[True]), "threads": count[arms[0]]})
    prefix["speedup"] = prefix["per_row_prompts_s"] / prefix["shared_prompts_s"]
    model.zero_grad(set_to_none=True)

    # 3. Trainer.step variants round-robin (and over the thread counts)
    names = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)}")
    settings = StepSettings(model=args.model, n_prompts=max(1, args.rows // args.group_size),
                                 group_size=args.group_size, learning_rate=1e-9,
                                 task=default_task_overrides(args.model))
    base = {"algorithm": {"advantage": "grpo", "loss": "covariance"},
            "optim": {"lr": 1e-9, "micro_batch_size": args.micro_batch, "max_grad_norm": 1.0},
            "loop": {"steps": 1000, "prompts_per_step": settings.n_prompts, "group_size": args.group_size},
            "sampler": {"return_topk": 8}}
    cfgs = {}
    for name in names:
        for mode in modes:
            sections = {k: dict(v) for k, v in base.items()}
            for key, val in VARIANTS[name].items():
                sections[key] = {**sections.get(key, {}), **val}
            sections["trainer"] = {"autocast": mode}
            cfgs[name if mode == modes[0] else f"{name} [{mode}]"] = bench_train_config(settings, **sections)
    names = list(cfgs)
    ref = frozen_copy(model) if any(c.kl.coef > 0 for c in cfgs.values()) else None
    # one Trainer per variant over the same model (lr 1e-9: the weights barely move between variants)
    trainers = {name: Trainer(model, cfgs[name], ref_model=ref if cfgs[name].kl.coef > 0 else None)
                for name in names}
    batch = synthetic_batch(model, vocab, args.rows, args.prompt_length, args.response_length, args.group_size)
    runs = {(arm, name): [] for arm in arms for name in names}
    for rep in range(args.repeats + 1):  # first round = warm-up
        for arm in order(rep):
            use(arm)
            for name in (names if rep % 2 == 0 else list(reversed(names))):
                t0 = time.perf_counter()
                m = trainers[name].step(batch)
                dt = time.perf_counter() - t0
                if rep:
                    runs[arm, name].append({"step_s": dt, "forward_backward_s": m.get("time/forward_backward", 0.0),
                                            "optimizer_s": m.get("time/optimizer", 0.0),
                                            "load1": os.getloadavg()[0]})
    variants = []
    for arm in arms:
        plain_s = statistics.median(r["step_s"] for r in runs[arm, names[0]])
        for name in names:
            rs = runs[arm, name]
            med = statistics.median(r["step_s"] for r in rs)
            fb = statistics.median(r["forward_backward_s"] for r in rs)
            opt = statistics.median(r["optimizer_s"] for r in rs)
            variants.append({"variant": name, "threads": count[arm], "threads_arm": arm, "step_s": med,
                             "forward_backward_s": fb, "optimizer_s": opt, "other_s": med - fb - opt,
                             "overhead_vs_plain": med / plain_s - 1.0, "runs": rs})

    use(arms[0])
    compile_rows = compile_grid(model, vocab, args) if args.compile == "also" else None
    # the thread counts side by side: each grid cell's fwd+bwd and the first variant's step, relative to arm 1
    comparison = []
    for arm in arms:
        cells = [g for g in grid if g["threads_arm"] == arm]
        ref_cells = [g for g in grid if g["threads_arm"] == arms[0]]
        step = next(v for v in variants if v["threads_arm"] == arm and v["variant"] == names[0])
        ref_step = next(v for v in variants if v["threads_arm"] == arms[0] and v["variant"] == names[0])
        comparison.append({"threads_arm": arm, "threads": count[arm], "choice": choices[_spec(arm)].record(),
                           "fwd_bwd_s": [g["fwd_bwd_s"] for g in cells],
                           "fwd_bwd_vs_first": [g["fwd_bwd_s"] / r["fwd_bwd_s"] for g, r in zip(cells, ref_cells)],
                           "step_s": step["step_s"], "step_vs_first": step["step_s"] / ref_step["step_s"]})

    results = {"source": git_state(), "model": args.model, "threads": [count[a] for a in arms],
               "matmul_roof_flop_s": {f"{a}/{d}": v for (a, d), v in roof.items()},
               "autocast": modes, "cpu_bf16": cpu_bf16_support(), "compile": compile_rows,
               "threads_arms": arms, "load_processes": args.load, "load1_at_start": load_start,
               "load1_at_end": os.getloadavg()[0], "threads_comparison": comparison, "grid": grid,
               "variants": variants, "prompt_sharing": prefix,
               "variant_batch": {"rows": args.rows, "prompt_length": args.prompt_length,
                                 "response_length": args.response_length, "micro_batch": args.micro_batch,
                                 "group_size": args.group_size}}
    t1 = ["| threads | micro-batch | response len | autocast | fwd+bwd s | resp tok/s | GFLOP | % of matmul bound | "
          f"+ entropy/Σπ² s | stats overhead | speed-up vs {modes[0]} | max / mean abs dlogp vs {modes[0]} | k3 | "
          "kl_seq | load |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in grid:
        mm = g.get("mismatch_vs_first_mode")
        gap = ("- | - | -" if mm is None else f"{mm['logprob_max_abs_diff']:.2e} / {mm['logprob_mean_abs_diff']:.2e}"
               f" | {mm['mismatch/k3']:.2e} | {mm['kl_seq']:.2e}")
        t1.append(f"| {g['threads_arm']} ({g['threads']}) | {g['micro_batch']} | {g['response_length']} | "
                  f"{g['autocast']} | {g['fwd_bwd_s']:.3f} | {g['tokens_per_s']:.0f} | {g['matmul_flops'] / 1e9:.1f} | "
                  f"{100 * g['share_of_matmul_bound']:.0f}% | {g['fwd_bwd_stats_s']:.3f} | "
                  f"{100 * g['stats_overhead']:+.1f}% | {g['speedup_vs_first_mode']:.2f}x | {gap} | "
                  f"{g['load1']:.1f} |")
    t2 = ["| threads | variant | step s | fwd+bwd s | optimizer s | other s | overhead vs plain |",
          "|---|---|---|---|---|---|---|"]
    t2 += [f"| {v['threads_arm']} ({v['threads']}) | {v['variant']} | {v['step_s']:.3f} | "
           f"{v['forward_backward_s']:.3f} | {v['optimizer_s']:.3f} | {v['other_s']:.3f} | "
           f"{100 * v['overhead_vs_plain']:+.1f}% |" for v in variants]
    t3 = (f"Prompt sharing (optim.share_prompts; groups of {args.group_size}, fwd+bwd of {args.rows} rows, "
          f"{count[arms[0]]} thread(s)): per-row prompts {prefix['per_row_prompts_s']:.3f} s, shared "
          f"{prefix['shared_prompts_s']:.3f} s, speedup **{prefix['speedup']:.2f}x**; max |dlogp| "
          f"{prefix['logprob_max_diff']:.1e}, grad rel. diff {prefix['grad_rel_diff']:.1e}.\n")
    t4 = ""
    if len(arms) > 1:
        t4 = (f"\n| threads | fwd+bwd s (grid cells) | vs {arms[0]} | {names[0]} step s | vs {arms[0]} |\n"
              "|---|---|---|---|---|\n")
        t4 += "".join(f"| {c['threads_arm']} ({c['threads']}) | {', '.join(f'{x:.3f}' for x in c['fwd_bwd_s'])} | "
                      f"{', '.join(f'{x:.2f}x' for x in c['fwd_bwd_vs_first'])} | {c['step_s']:.3f} | "
                      f"{c['step_vs_first']:.2f}x |\n" for c in comparison)
    bf16 = ", ".join(k for k, v in cpu_bf16_support().items() if v) or "none"
    roofs = ", ".join(f"{a} thread(s) {d}: {v / 1e9:.0f}" for (a, d), v in roof.items())
    note = (f"\nmodel {args.model}, CPU bf16 instructions: {bf16}, threads {', '.join(f'{a}={count[a]}' for a in arms)}; "
            f"matmul roof (1024^3, best of 5) GFLOP/s {roofs}; GFLOP = matmul/attention FLOPs of one plain "
            "fwd+bwd (torch FlopCounterMode), % of matmul bound = GFLOP / fwd+bwd s / roof; artificial load "
            f"{args.load} busy process(es); load average {load_start:.2f} at start, {results['load1_at_end']:.2f} "
            f"at end ({os.cpu_count()} CPUs); variants: {args.rows} rows x ({args.prompt_length} prompt + "
            f"{args.response_length} response) tokens, micro-batch {args.micro_batch}, {args.repeats} round-robin "
            f"repeats (median).\n")
    tag = "" if modes == ["none"] else "-autocast-" + "-".join(modes)
    write_bench(f"step-{args.model}{tag}" + ("-quick" if args.quick else ""), results,
                "\n".join(t1) + "\n\n" + "\n".join(t2) + "\n\n" + t3 + t4
                + ("" if compile_rows is None else "\n" + compile_table(compile_rows, args.compile_backend)) + note,
                output_dir(args), headline=_headline(results))
    return 0


def _headline(results: dict) -> str:
    """The largest grid cell's fwd+bwd time per autocast mode, and prompt sharing's speed-up."""
    cell = results["grid"][-1]
    same = [g for g in results["grid"] if g["micro_batch"] == cell["micro_batch"]
            and g["response_length"] == cell["response_length"] and g["threads_arm"] == cell["threads_arm"]]
    modes = "; ".join(f"{g['autocast']} {g['fwd_bwd_s']:.2f} s ({100 * g['share_of_matmul_bound']:.0f}% of the "
                      f"matmul bound)" for g in same)
    return (f"fwd+bwd {cell['micro_batch']} rows x {cell['response_length']} tokens: {modes}; prompt sharing "
            f"{results['prompt_sharing']['speedup']:.2f}x")


def _spec(arm: str) -> int | str:
    return int(arm) if arm.isdigit() else arm
