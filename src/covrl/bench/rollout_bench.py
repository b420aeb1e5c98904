"""`covrl bench rollout`: sampler tokens/s by batch size, against plain `model.generate` and against the
machine's limits.

Limits, per decode step of a batch of B rows (one new token per row):
  bytes read    = weights read per step + B * KV-cache bytes per row (mean over the decode)
  bandwidth bound tokens/s = B * bandwidth / bytes read           (bandwidth from a large torch copy)
  compute bound tokens/s   = flops_per_s / (2 * matmul parameters)  (flops from a large fp32 matmul)
The roofline is the smaller of the two; `fraction` = measured / roofline. Weights read per step are all
parameters except an untied input embedding (a decode step gathers only B of its rows). The matmul floor is
measured, not derived: the step's linear layers alone at batch B through torch's own kernels (see
`decode_matmul_floor_s`); "% of matmul floor" says how much of a decode step is the weight products.

covrl's sampler, `generate` and (when vLLM is importable) covrl's vLLM sampler are timed alternately (the order
rotates every repeat) on the same rows of the arithmetic task, with sampling at temperature 1; tokens are the
generated tokens up to and including EOS. The vLLM side runs its engine in its own process by default, bound
to `--threads` cores, so that every side computes on the same number of threads (an in-process CPU engine
sets the process's torch thread count itself and makes `torch.set_num_threads` a no-op); without vLLM the
side is skipped and the results say why.

`--compile also|only` adds covrl's sampler with `sampler.compile` (the decode step behind torch.compile over a
static KV cache) as one more alternating side (`only`: just eager vs compiled covrl). Its first call per batch
size is timed apart (compile seconds and graphs compiled, 0 when an earlier shape's graph served), and compared
with the eager sampler on the same generator seed (rows with identical tokens and masks, max |Δ log q|); the
timed repeats then measure the steady state (their compile seconds are recorded; 0 = no re-compile).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from covrl.bench.common import (
    add_output_options,
    measure_bandwidth,
    measure_matmul_flops,
    output_dir,
    write_bench,
)
from covrl.bench.models import DEFAULT_CACHE, cached_model
from covrl.bench.settings import StepSettings, build_bench_task, default_task_overrides
from covrl.rollout import SamplerConfig, build_sampler
from covrl.train import git_state

DEFAULT_BATCH_SIZES = "1,4,16,64"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help="comma-separated rollout batch sizes")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--group-size", type=int, default=8, help="rows per prompt (RL groups); batches smaller "
                        "than this use one row per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per batch size and side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cache-dir", default=None, help="model folder cache (default runs/cache)")
    add_output_options(parser)   # --out, --update-baseline (covrl.bench.common)
    parser.add_argument("--vllm", default="auto", choices=["auto", "off"], help="auto: add the vLLM sampler "
                        "side when vllm is importable (skipped with a message otherwise)")
    parser.add_argument("--vllm-engine", default="process", choices=["process", "in-process"],
                        help="the vLLM engine in its own process (bound to --threads cores) or in this one")
    parser.add_argument("--compile", default="off", choices=["off", "also", "only"],
                        help="covrl's sampler with sampler.compile as one more side: off, also (beside the "
                        "others), only (eager vs compiled covrl, no generate / vLLM side)")
    parser.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                        help="torch.compile backend of --compile (sampler.compile_backend)")
    parser.add_argument("--compile-bucket", type=int, default=64, help="sampler.compile_bucket of --compile")
    parser.add_argument("--quick", action="store_true", help="tiny model, small batches: seconds, for tests")


def decode_costs(model) -> dict[str, float]:
    """Bytes of weights read and matmul parameters used per decode step, and KV bytes per cached position."""
    cfg = model.config
    params = {id(p): p for p in model.parameters()}.values()
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = emb.data_ptr() == head.data_ptr()
    weight_bytes = total_bytes - (0 if tied else emb.numel() * emb.element_size())
    matmul_params = sum(p.numel() for p in params if p.dim() == 2) - (0 if tied else emb.numel())
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    kv_bytes_per_position = 2 * cfg.num_hidden_layers * kv_heads * head_dim * emb.element_size()
    return {"weight_bytes": float(weight_bytes), "matmul_params": float(matmul_params),
            "kv_bytes_per_position": float(kv_bytes_per_position), "tied_embeddings": float(tied)}


def decode_matmul_floor_s(model, batch: int, repeats: int = 5) -> float:
    """Seconds of one decode step's weight products alone: every nn.Linear of the model (the LM head included)
    applied to a (batch, in) input in the weights' dtype, back to back, best of `repeats`. What a decode step
    could take with no other op and no dispatch overhead on the local CPU's matmul kernels: a floor measured
    with the same kernels, beside the copy-bandwidth bound (which no GEMV kernel reaches exactly)."""
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(batch, m.in_features, dtype=m.weight.dtype) for m in linears]
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats + 1):   # the first pass warms the caches and the allocator
            t0 = time.perf_counter()
            for m, x in zip(linears, inputs):
                torch.nn.functional.linear(x, m.weight)
            best = min(best, time.perf_counter() - t0)
    return best


def _generate_hf(model, tokenizer, prompts, max_new_tokens, seed):
    """Plain `model.generate` (sampling, KV cache); returns (seconds, generated tokens up to EOS)."""
    import torch

    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad)
    dt = time.perf_counter() - t0
    new = out[:, width:]
    eos = torch.as_tensor(tokenizer.eos_token_id)
    is_eos = new == eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], new.shape[1],
                                                                               dtype=torch.long))
    tokens = int(torch.clamp(first + 1, max=new.shape[1]).sum())
    return dt, tokens, int(new.shape[1]), None, 0.0


def _generate_covrl(sampler, prompts, n, seed):
    """covrl's sampler: `n` rows per prompt; returns (seconds, tokens, decode steps, prefill seconds, compile
    seconds)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    batch = sampler.generate(prompts, n, generator=gen)
    dt = time.perf_counter() - t0
    return (dt, int(batch.response_mask.sum()), int(batch.response_ids.shape[1]), batch.timing.prefill_s,
            batch.timing.compile_s)


def compile_first_call(eager, compiled, prompts, n, seed: int = 0) -> dict:
    """The compiled sampler's first call on these rows (compile time apart from the wall time of the call) and
    its agreement with the eager sampler on the same generator seed."""
    import torch

    a = eager.generate(prompts, n, generator=torch.Generator().manual_seed(seed))
    graphs = compiled.decode_graphs
    t0 = time.perf_counter()
    b = compiled.generate(prompts, n, generator=torch.Generator().manual_seed(seed))
    first = time.perf_counter() - t0
    T = max(a.response_ids.shape[1], b.response_ids.shape[1])   # right-pad both to one length (pad = mask 0)
    ids_a, ids_b, mask_a, mask_b, lq_a, lq_b = (torch.nn.functional.pad(x, (0, T - x.shape[1])) for x in (
        a.response_ids, b.response_ids, a.response_mask, b.response_mask, a.sampler_logprobs, b.sampler_logprobs))
    same = (ids_a == ids_b).all(1) & (mask_a == mask_b).all(1)
    diff = (lq_a - lq_b).abs()[same]
    return {"compile_s": b.timing.compile_s, "first_call_s": first, "graphs": compiled.decode_graphs - graphs,
            "rows_identical": int(same.sum()), "rows": len(same),
            "logprob_max_diff": float(diff.max()) if diff.numel() else float("nan")}


def _vllm_sampler(args, model, tokenizer, max_batch: int, cache: str):
    """covrl's vLLM sampler on the bench model's weights, or (None, why it was skipped)."""
    import os

    from covrl.rollout.vllm import VLLM_EXTRA_HINT, vllm_available

    if args.vllm == "off":
        return None, "skipped: --vllm off"
    if args.compile == "only":
        return None, "skipped: --compile only"
    if not vllm_available():
        return None, f"skipped: vllm is not importable ({VLLM_EXTRA_HINT})"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    vcfg = {"engine_process": args.vllm_engine == "process",
            "model_cache": str(Path(cache) / "vllm-models"),
            "omp_threads_bind": ",".join(map(str, cores[:args.threads])) if args.vllm_engine == "process" else None}
    cfg = SamplerConfig(backend="vllm", max_new_tokens=args.max_new_tokens, temperature=1.0, max_batch=max_batch,
                        dtype=args.dtype, vllm=vcfg)
    return build_sampler(cfg, model, tokenizer), None


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    if args.quick:
        args.model, args.max_new_tokens, args.repeats = "tiny", 8, 1
        if args.batch_sizes == DEFAULT_BATCH_SIZES:   # an explicit --batch-sizes is kept
            args.batch_sizes = "1,8"
    torch.set_num_threads(args.threads)
    cache = args.cache_dir or DEFAULT_CACHE
    bandwidth = measure_bandwidth(64 if args.quick else 512)
    flops = measure_matmul_flops(256 if args.quick else 1024, dtype=args.dtype)
    model, tokenizer = cached_model(args.model, cache, args.dtype)
    model.eval()
    costs = decode_costs(model)
    settings = StepSettings(model=args.model, max_new_tokens=args.max_new_tokens,
                                 task=default_task_overrides(args.model))
    _, prompts = build_bench_task(settings, tokenizer)

    max_batch = max(int(b) for b in args.batch_sizes.split(","))
    sampler = build_sampler(SamplerConfig(max_new_tokens=args.max_new_tokens, temperature=1.0,
                                          max_batch=max_batch), model, tokenizer)
    compiled = None if args.compile == "off" else build_sampler(
        SamplerConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, max_batch=max_batch, compile=True,
                      compile_backend=args.compile_backend, compile_bucket=args.compile_bucket), model, tokenizer)
    t0 = time.perf_counter()
    vllm_sampler, vllm_skipped = _vllm_sampler(args, model, tokenizer, max_batch, str(cache))
    vllm_info = {"skipped": vllm_skipped}
    if vllm_sampler is None:
        print(f"vLLM side {vllm_skipped}")
    else:
        vllm_info.update(engine=args.vllm_engine, start_s=time.perf_counter() - t0,
                         omp_threads_bind=vllm_sampler.cfg.vllm.omp_threads_bind)
    # an in-process CPU engine sets this process's thread count: record what the torch sides ran with
    vllm_info["torch_threads_after_engine_start"] = torch.get_num_threads()
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        n = args.group_size if b >= args.group_size and b % args.group_size == 0 else 1
        unique = [prompts[i % len(prompts)] for i in range(b // n)]
        batch_prompts = [p for p in unique for _ in range(n)]  # the same rows for both sides
        sides = {"covrl": lambda s, unique=unique, n=n: _generate_covrl(sampler, unique, n, s)}
        if args.compile != "only":
            sides["generate"] = lambda s, rows_=batch_prompts: _generate_hf(model, tokenizer, rows_,
                                                                             args.max_new_tokens, s)
        if vllm_sampler is not None:
            sides["vllm"] = lambda s, unique=unique, n=n: _generate_covrl(vllm_sampler, unique, n, s)
        first_call = None
        if compiled is not None:
            first_call = compile_first_call(sampler, compiled, unique, n)
            sides["compiled"] = lambda s, unique=unique, n=n: _generate_covrl(compiled, unique, n, s)
        for fn in sides.values():  # warm-up (allocator, first-call costs)
            fn(0)
        runs = {name: [] for name in sides}
        for rep in range(args.repeats):
            order = list(sides)[rep % len(sides):] + list(sides)[:rep % len(sides)]  # rotate the order
            for name in order:
                dt, tokens, steps, prefill, compile_s = sides[name](rep + 1)
                runs[name].append({"seconds": dt, "tokens": tokens, "decode_steps": steps, "prefill_s": prefill,
                                   "compile_s": compile_s, "load1": os.getloadavg()[0]})
        prompt_len = statistics.fmean(len(p) for p in batch_prompts)
        kv_positions = prompt_len + args.max_new_tokens / 2
        step_bytes = costs["weight_bytes"] + b * kv_positions * costs["kv_bytes_per_position"]
        bw_bound = b * bandwidth / step_bytes
        compute_bound = flops / (2 * costs["matmul_params"])
        roofline = min(bw_bound, compute_bound)
        floor_s = decode_matmul_floor_s(model, b, repeats=2 if args.quick else 5)
        row = {"batch": b, "rows_per_prompt": n, "bandwidth_bound_tok_s": bw_bound, "compute_bound_tok_s": compute_bound,
               "roofline_tok_s": roofline, "matmul_floor_step_s": floor_s, "matmul_floor_tok_s": b / floor_s,
               "runs": runs}
        for name, rs in runs.items():
            tok_s = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
            steps_s = sum(r["decode_steps"] for r in rs) / sum(r["seconds"] for r in rs)
            row[f"{name}_tok_s"] = tok_s
            row[f"{name}_decode_steps_s"] = steps_s
            # decode-step rate x B: the rate if every row were generating (padding after EOS included)
            row[f"{name}_fraction_of_roofline"] = steps_s * b / roofline
            # the same rate against the measured floor of the step's weight products
            row[f"{name}_fraction_of_matmul_floor"] = steps_s * floor_s
        if "generate" in runs:
            row["covrl_over_generate"] = row["covrl_tok_s"] / row["generate_tok_s"]
        if first_call is not None:
            # decode seconds per step without the (eager, identical) prefill: what compiling changes
            decode = {name: sum(r["seconds"] - r["prefill_s"] for r in runs[name])
                      / sum(r["decode_steps"] for r in runs[name]) for name in ("covrl", "compiled")}
            width = max(len(p) for p in batch_prompts) + args.max_new_tokens
            row["compile"] = {**first_call, "padded_rows": 1 << (b - 1).bit_length(),
                              "cache_len": -(-width // args.compile_bucket) * args.compile_bucket,
                              "eager_decode_step_s": decode["covrl"], "compiled_decode_step_s": decode["compiled"],
                              "decode_speedup": decode["covrl"] / decode["compiled"],
                              "compiled_over_covrl": row["compiled_tok_s"] / row["covrl_tok_s"],
                              "timed_compile_s": sum(r["compile_s"] for r in runs["compiled"])}
        if "vllm" in runs:
            row["vllm_over_generate"] = row["vllm_tok_s"] / row["generate_tok_s"]
            row["vllm_over_covrl"] = row["vllm_tok_s"] / row["covrl_tok_s"]
        # share of the sampler's time spent prefilling prompts; with n rows per prompt, (1 - 1/n) of it is
        # the same prompt computed again (what prefix sharing would save)
        row["covrl_prefill_share"] = (sum(r["prefill_s"] or 0.0 for r in runs["covrl"])
                                      / sum(r["seconds"] for r in runs["covrl"]))
        row["mean_load1"] = statistics.fmean(r["load1"] for rs in runs.values() for r in rs)
        rows.append(row)

    if vllm_sampler is not None:
        from covrl.rollout.vllm import shutdown_engines

        shutdown_engines()
    results = {"source": git_state(), "model": args.model, "dtype": args.dtype, "threads": args.threads,
               "max_new_tokens": args.max_new_tokens, "bandwidth_GB_s": bandwidth / 1e9,
               "matmul_GFLOP_s": flops / 1e9, **costs, "vllm": vllm_info, "rows": rows,
               "compile": None if compiled is None else {"mode": args.compile, "backend": args.compile_backend,
                                                         "bucket": args.compile_bucket,
                                                         "graphs": compiled.decode_graphs}}
    with_vllm = vllm_sampler is not None
    header = ("| B (rows/prompt) | covrl tok/s | generate tok/s | covrl/generate | "
              + ("vllm tok/s | vllm/generate | vllm/covrl | " if with_vllm else "")
              + "bandwidth bound | compute bound | covrl % of roofline | generate % of roofline | "
              + ("vllm % of roofline | " if with_vllm else "") + "matmul floor tok/s | covrl % of matmul floor | "
              + "covrl prefill share | load |\n"
              + "|---" * (16 if with_vllm else 12) + "|\n")

    def line(r):
        vllm_cols = (f"{r['vllm_tok_s']:.1f} | {r['vllm_over_generate']:.2f} | {r['vllm_over_covrl']:.2f} | "
                     if with_vllm else "")
        vllm_roof = f"{100 * r['vllm_fraction_of_roofline']:.0f}% | " if with_vllm else ""
        return (f"| {r['batch']} ({r['rows_per_prompt']}) | {r['covrl_tok_s']:.1f} | {r['generate_tok_s']:.1f} | "
                f"{r['covrl_over_generate']:.2f} | {vllm_cols}{r['bandwidth_bound_tok_s']:.0f} | "
                f"{r['compute_bound_tok_s']:.0f} | {100 * r['covrl_fraction_of_roofline']:.0f}% | "
                f"{100 * r['generate_fraction_of_roofline']:.0f}% | {vllm_roof}"
                f"{r['matmul_floor_tok_s']:.0f} | {100 * r['covrl_fraction_of_matmul_floor']:.0f}% | "
                f"{100 * r['covrl_prefill_share']:.0f}% | {r['mean_load1']:.1f} |")

    lines = [] if args.compile == "only" else [line(r) for r in rows]
    vllm_note = (f"vLLM side {vllm_skipped}. " if not with_vllm else
                 f"vLLM engine {args.vllm_engine} (bind {vllm_info['omp_threads_bind']}), started in "
                 f"{vllm_info['start_s']:.1f} s; torch threads after its start: "
                 f"{vllm_info['torch_threads_after_engine_start']}. ")
    note = (f"\nmodel {args.model} ({args.dtype}), {args.threads} thread(s), {args.max_new_tokens} new tokens; "
            f"bandwidth {bandwidth / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s, "
            f"weights read per step {costs['weight_bytes'] / 2**20:.0f} MiB. {vllm_note}"
            "% of roofline uses decode steps x B (padding rows after EOS count as work). Matmul floor: every "
            "linear layer's product at batch B alone, back to back (best of 5), i.e. the step's weight reads "
            "through the local CPU's own matmul kernels with no other op or dispatch cost.\n")
    table = "" if args.compile == "only" else header + "\n".join(lines)
    if compiled is not None:
        table += ("\n" if table else "") + compile_table(rows, args.compile_backend)
    write_bench(f"rollout-{args.model}" + ("" if args.dtype == "float32" else f"-{args.dtype}")
                + ("-compile" if args.compile == "only" else "") + ("-quick" if args.quick else ""), results,
                table + note, output_dir(args), headline=_headline(rows, args, with_vllm))
    return 0


def _headline(rows: list[dict], args, with_vllm: bool) -> str:
    """The largest batch's tokens/s per side (a compile-only run: compiled vs eager decode)."""
    r = rows[-1]
    if args.compile == "only":
        return f"{args.dtype}, {r['batch']} row(s): compiled decode {r['compile']['decode_speedup']:.2f}x eager"
    vllm = f", vLLM {r['vllm_tok_s']:.1f}" if with_vllm else ""
    return (f"{args.dtype}, {r['batch']} rows: covrl {r['covrl_tok_s']:.1f} tok/s, generate "
            f"{r['generate_tok_s']:.1f}{vllm} ({r['covrl_over_generate']:.2f}x)")


def compile_table(rows: list[dict], backend: str) -> str:
    """Eager vs compiled covrl sampler per batch size (decode steps only; the prefill is eager in both)."""
    t = [f"Eager vs compiled (sampler.compile, {backend}, static KV cache) covrl sampler; speed-up = eager decode "
         "s/step / compiled (> 1: compiled faster); compile s / graphs = the first call of that batch size (0: an "
         "earlier graph served it); identical = rows with the same tokens and masks on the same seed:", "",
         "| B (rows/prompt) | padded rows | cache len | compile s | graphs | first call s | eager tok/s | "
         "compiled tok/s | compiled/eager tok/s | eager ms/step | compiled ms/step | decode speed-up | identical | "
         "max abs dlogq | load |", "|---" * 15 + "|"]
    for r in rows:
        c = r["compile"]
        t.append(f"| {r['batch']} ({r['rows_per_prompt']}) | {c['padded_rows']} | {c['cache_len']} | "
                 f"{c['compile_s']:.1f} | {c['graphs']} | {c['first_call_s']:.1f} | {r['covrl_tok_s']:.1f} | "
                 f"{r['compiled_tok_s']:.1f} | {c['compiled_over_covrl']:.2f} | {1e3 * c['eager_decode_step_s']:.1f} | "
                 f"{1e3 * c['compiled_decode_step_s']:.1f} | {c['decode_speedup']:.2f}x | "
                 f"{c['rows_identical']}/{c['rows']} | {c['logprob_max_diff']:.1e} | {r['mean_load1']:.1f} |")
    return "\n".join(t) + "\n"
