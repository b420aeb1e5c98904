"""`covrl bench throughput`: trainer tokens/s and MFU on a randomly initialised model of a named shape — no
weights, no network — the trainer's whole `Trainer.step` (forward over the sequence, log-probs, entropy and
Σπ² statistics, the policy loss, backward, AdamW) on one synthetic row per sequence length.

Shapes (`--shape`): `qwen3-0.6b` (Qwen3-0.6B's config: 28 layers, hidden 1024, 16 query / 8 KV heads of 128,
MLP 3072, vocabulary 151,936, tied embeddings) for a GPU, and `qwen3-mini` (the same architecture at 4 layers,
hidden 256, vocabulary 8,192) that a CPU runs in seconds. `--device auto` takes CUDA where there is one;
`--autocast bf16` (the default on CUDA) is trainer.autocast.

FLOPs per trained token, as the peers count them (PaLM, appendix B): 6·N (N = parameters without the
embedding table; a tied table still costs its 2·V·d per token as the LM head, counted in) plus the attention's
12·L·d_attn·T for a sequence of T tokens (L layers, d_attn = heads × head_dim; causal masking not discounted).
MFU = those FLOPs per second over the device's peak: `--peak-tflops`, else the known bf16 dense peak of the
GPU by name (H100 / H200: 989), else, on a CPU, a measured fp32 matmul rate (so the CPU's "MFU" is relative to
what its matmul reaches, not to a datasheet)."""

from __future__ import annotations

import argparse
import statistics
import time

from covrl.bench.common import add_output_options, output_dir

SHAPES = {
    "qwen3-0.6b": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
                   "tie_word_embeddings": True, "max_position_embeddings": 40960, "rope_theta": 1_000_000.0},
    "qwen3-mini": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768, "vocab_size": 8192,
                   "tie_word_embeddings": True, "max_position_embeddings": 40960, "rope_theta": 1_000_000.0},
}
# bf16 dense tensor-core peaks (TFLOP/s) by device name
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
# the peer's published fake-data baseline the GPU numbers are set beside
PEER_BASELINE = {"who": "prime-rl fake-data trainer benchmark", "model": "Qwen3-0.6B", "seq_len": 16384,
                 "device": "1x H100", "tokens_per_s": 11_900, "mfu": 0.11}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="model shape (default: qwen3-0.6b on CUDA, qwen3-mini on a CPU)")
    parser.add_argument("--seq-lens", default=None, help="comma-separated sequence lengths (default: 2048,16384 "
                        "on CUDA, 256,1024 on a CPU)")
    parser.add_argument("--steps", type=int, default=3, help="timed Trainer.step calls per length")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--autocast", default=None, choices=["none", "bf16", "bf16_fp32_head"],
                        help="trainer.autocast (default: bf16 on CUDA, none on a CPU)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, for MFU")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_output_options(parser)   # --out, --update-baseline (covrl.bench.common)


def flops_per_token(cfg: dict, seq_len: int) -> float:
    """6·N + 12·L·d_attn·T (docstring); N counts the LM head, not the embedding lookup."""
    d, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * cfg["intermediate_size"]
    n = L * per_layer + V * d
    return 6.0 * n + 12.0 * L * q * seq_len


def _peak_flops(device, override: float | None) -> tuple[float, str]:
    import torch

    from covrl.bench.common import measure_matmul_flops

    if override:
        return override * 1e12, "given"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{name} bf16 dense peak"
        return float("nan"), f"{name}: unknown peak (give --peak-tflops)"
    return measure_matmul_flops(1024), "measured fp32 matmul of this CPU"


def _row(vocab: int, seq_len: int, device, seed: int):
    """One synthetic scored row: a 1-token prompt and seq_len − 1 response tokens, sampler log-probs 0 (their
    value changes nothing in the cost), group of one."""
    import torch

    from covrl.rollout.types import ScoredBatch

    g = torch.Generator().manual_seed(seed)
    T = seq_len - 1
    ids = torch.randint(4, vocab, (1, seq_len), generator=g)
    return ScoredBatch(prompt_ids=ids[:, :1], prompt_mask=torch.ones(1, 1), response_ids=ids[:, 1:],
                       response_mask=torch.ones(1, T), sampler_logprobs=torch.zeros(1, T),
                       group_ids=torch.zeros(1, dtype=torch.long), policy_version=torch.zeros(1, dtype=torch.long),
                       rewards=torch.ones(1), correct=(True,))


def measure(args: argparse.Namespace) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from covrl.config import load_config
    from covrl.train import Trainer

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = device.type == "cuda"
    shape = args.shape or ("qwen3-0.6b" if gpu else "qwen3-mini")
    seq_lens = [int(x) for x in (args.seq_lens or ("2048,16384" if gpu else "256,1024")).split(",")]
    autocast = args.autocast or ("bf16" if gpu else "none")
    cfg_shape = SHAPES[shape]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg_shape, attn_implementation="sdpa")).to(device)
    params = sum(p.numel() for p in model.parameters())
    # plain REINFORCE-style covariance loss, one micro-batch per sequence: the trainer's own step
    tcfg = load_config(None, [f"trainer.autocast={autocast}", "algorithm.advantage=grpo", "optim.lr=1e-6",
                              "optim.micro_batch_size=1", "loop.prompts_per_step=1", "loop.group_size=1",
                              "optim.skip_zero_gradient=false", "logging.diagnostics=false",
                              f"run.device={'cuda' if gpu else 'cpu'}"])
    trainer = Trainer(model, tcfg)
    peak, peak_source = _peak_flops(device, args.peak_tflops)
    rows = []
    for seq_len in seq_lens:
        batch = _row(cfg_shape["vocab_size"], seq_len, device, seed=seq_len)
        times = []
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(args.warmup + args.steps):
            if gpu:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            trainer.step(batch)
            if gpu:
                torch.cuda.synchronize(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        tokens_per_s = (seq_len - 1) / step_s
        mfu = tokens_per_s * flops_per_token(cfg_shape, seq_len) / peak
        rows.append({"seq_len": seq_len, "step_s": step_s, "steps_s": times, "tokens_per_s": tokens_per_s,
                     "mfu": mfu, "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if gpu else None})
    return {"shape": shape, "shape_config": cfg_shape, "parameters": params, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if gpu else "cpu", "autocast": autocast,
            "peak_flops": peak, "peak_source": peak_source, "rows": rows, "peer_baseline": PEER_BASELINE}


def run(args: argparse.Namespace) -> int:
    from covrl.bench.common import write_bench

    res = measure(args)
    lines = [f"Trainer.step on a randomly initialised {res['shape']} ({res['parameters'] / 1e6:.0f}M parameters), "
             f"{res['device_name']}, trainer.autocast={res['autocast']}; MFU against {res['peak_source']} "
             f"({res['peak_flops'] / 1e12:.1f} TFLOP/s).", "",
             "| sequence tokens | step s (median) | tokens/s | MFU | peak memory GiB |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        lines.append(f"| {r['seq_len']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {mem} |")
    p = PEER_BASELINE
    lines += ["", f"Peer baseline: {p['who']}, {p['model']} at {p['seq_len']} tokens on {p['device']}: "
              f"~{p['tokens_per_s']:,} tokens/s, MFU ~{p['mfu']:.0%}."]
    name = f"throughput-{res['shape']}-{'cuda' if res['device'].startswith('cuda') else 'cpu'}"
    headline = ", ".join(f"{r['seq_len']} tokens {r['tokens_per_s']:,.0f} tok/s MFU {r['mfu']:.1%}"
                         for r in res["rows"])
    write_bench(name, res, "\n".join(lines), output_dir(args), headline=headline)
    return 0
