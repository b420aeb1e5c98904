"""`covrl diagnose --run DIR` or `covrl diagnose --before DIR --after DIR`: the geometry of a training run's update.

Writes `diagnose.json` and `diagnose.png` into `--out` (default: `<run>/diagnose/`, or `./diagnose/` with
--before/--after): the spectrum of every matrix's update (energy in the top k directions, numerical / stable /
effective rank), update sparsity (the published bf16 |Δ| ≤ atol definition, the fp32 one, the absorbed share, a
relative version) and how much of the update sits in high-Fisher coordinates, with the Fisher estimated from
responses that the 'before' model samples itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_PROMPTS = [
    "What is 17 + 25?",
    "Name a prime number larger than 10.",
    "Write one sentence about the sea.",
    "Complete the sequence: 2, 4, 8,",
]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", type=Path, help="a covrl run folder: compares checkpoints/initial/model with the "
                        "latest complete checkpoints/ckpt-*/model")
    parser.add_argument("--before", type=Path, help="HF model folder before training (with --after)")
    parser.add_argument("--after", type=Path, help="HF model folder after training (with --before)")
    parser.add_argument("--out", type=Path, help="output folder (default: <run>/diagnose or ./diagnose)")
    parser.add_argument("--k", type=int, default=8, help="top-k directions for the update energy (default 8)")
    parser.add_argument("--atol", type=float, default=1e-5, help="sparsity threshold |Δ| ≤ atol (default 1e-5)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="precision of the published sparsity measurement (default bfloat16)")
    parser.add_argument("--rtol", type=float, default=1e-3, help="relative sparsity threshold (× max |Δ| per tensor)")
    parser.add_argument("--no-fisher", action="store_true", help="skip the Fisher-vs-update concentration")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: the model folders, then the run)")
    parser.add_argument("--prompt", action="append", help="prompt for the Fisher samples (repeatable; default: 4 "
                        "generic prompts; BOS only when no tokenizer is found)")
    parser.add_argument("--samples", type=int, default=4, help="sampled responses per prompt (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="length of each sampled response")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for the Fisher batch")
    parser.add_argument("--fisher-params", default=None, help="regular expression selecting parameters for the "
                        "Fisher (default: every 2-D weight matrix)")
    parser.add_argument("--top-frac", type=float, default=0.2, help="'high-Fisher' = this top fraction (default 0.2)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    try:
        before, after, out = _resolve(args)
    except ValueError as err:
        print(f"covrl diagnose: {err}", file=sys.stderr)
        return 2
    if args.k < 1 or args.samples < 1 or args.max_new_tokens < 1 or not (0 < args.top_frac <= 1):
        print("covrl diagnose: --k, --samples and --max-new-tokens must be >= 1 and --top-frac in (0, 1]",
              file=sys.stderr)
        return 2
    report = diagnose(before, after, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnose.json").write_text(json.dumps(report, indent=2))
    _figure(report, out / "diagnose.png")
    s = report["summary"]
    print(f"before: {before}\nafter:  {after}")
    print(f"matrices: {s['matrices']}, mean energy in top {args.k}: {s['energy_top_k_mean']:.3f}, "
          f"mean rank ratio: {s['rank_ratio_mean']:.3f}")
    print(f"sparsity ({args.dtype}, |Δ| ≤ {args.atol:g}): {s['sparsity']:.3f}; full precision: "
          f"{s['sparsity_full']:.3f}; absorbed share: {s['absorbed_share']:.3f}")
    if "update_top_fisher_share" in s:
        print(f"share of ‖Δ‖² in the top {args.top_frac:.0%} Fisher coordinates: {s['update_top_fisher_share']:.3f} "
              f"(uniform would be {args.top_frac:.2f}; Fisher's own top share {s['fisher_top_share']:.3f})")
    print(f"wrote {out / 'diagnose.json'} and {out / 'diagnose.png'}")
    return 0


def _resolve(args) -> tuple[Path, Path, Path]:
    if args.run is not None:
        if args.before is not None or args.after is not None:
            raise ValueError("use either --run or --before/--after, not both")
        root = args.run
        before = root / "checkpoints" / "initial" / "model"
        if not before.is_dir():
            raise ValueError(f"{before} not found: the run did not save its initial weights (run.save_initial=true)")
        ckpts = sorted((p for p in (root / "checkpoints").glob("ckpt-*") if (p / "COMPLETE").is_file()),
                       key=lambda p: p.name)
        if not ckpts:
            raise ValueError(f"no complete checkpoint (checkpoints/ckpt-*/COMPLETE) in {root}")
        after = ckpts[-1] / "model"
        out = args.out or root / "diagnose"
    else:
        if args.before is None or args.after is None:
            raise ValueError("give --run DIR, or both --before DIR and --after DIR")
        before, after = args.before, args.after
        out = args.out or Path("diagnose")
    for p in (before, after):
        if not p.is_dir():
            raise ValueError(f"model folder {p} does not exist")
    return before, after, out


def load_model(folder: Path):
    """AutoModelForCausalLM from an HF folder in its stored dtype; a LoRA adapter folder is merged into its base."""
    import torch

    folder = Path(folder)
    if (folder / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(str(folder)).merge_and_unload()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
    model.eval()
    torch.set_grad_enabled(True)
    return model


def _tokenizer(args, before: Path, after: Path):
    from transformers import AutoTokenizer

    candidates = [args.tokenizer] if args.tokenizer else [after, before]
    if args.run is not None and not args.tokenizer:
        candidates.append(args.run)
    for c in candidates:
        if c is not None and ((Path(c) / "tokenizer.json").is_file() or (Path(c) / "tokenizer_config.json").is_file()):
            try:
                return AutoTokenizer.from_pretrained(str(c)), str(c)
            except Exception:  # noqa: BLE001 - try the next folder
                continue
    return None, None


def fisher_batch(model, tokenizer, prompts: list[str] | None, samples: int, max_new_tokens: int, temperature: float,
                 seed: int):
    """Responses sampled from `model` itself (the sampler whose Fisher we want), as a dict batch for
    `covrl.diagnostics.reach.as_sequences`: prompt tokens + response up to and including EOS; scored = response."""
    import torch

    config = model.config
    bos = getattr(config, "bos_token_id", None)
    eos = getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    if tokenizer is not None:
        texts = prompts or DEFAULT_PROMPTS
        encoded = [tokenizer.encode(t) for t in texts]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    else:
        if bos is None:
            raise ValueError("no tokenizer found and the model has no bos_token_id: pass --tokenizer")
        encoded = [[bos]]
        pad = eos if eos is not None else 0
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # transformers >= 5.2x names the KV-cache argument `cache` (older: `past_key_values`)
    cache_kwarg = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    rows, scores = [], []
    gen = torch.Generator().manual_seed(seed)
    for ids in encoded:
        prompt = torch.tensor([ids] * samples)
        cur = prompt
        done = torch.zeros(samples, dtype=torch.bool)
        lengths = torch.full((samples,), max_new_tokens)
        past = None
        step_input = cur
        with torch.no_grad():
            for t in range(max_new_tokens):
                out = model(input_ids=step_input, use_cache=True, **({cache_kwarg: past} if past is not None else {}))
                past = getattr(out, "cache", None)
                past = out.past_key_values if past is None else past
                z = out.logits[:, -1].float() / temperature
                nxt = torch.multinomial(torch.softmax(z, -1), 1, generator=gen)
                nxt[done] = pad
                cur = torch.cat([cur, nxt], dim=1)
                if eos is not None:
                    newly = (nxt[:, 0] == eos) & ~done
                    lengths[newly] = t + 1
                    done |= newly
                if bool(done.all()):
                    break
                step_input = nxt
        for b in range(samples):
            n = len(ids) + int(lengths[b])
            row = cur[b, :n]
            sm = torch.zeros(n, dtype=torch.bool)
            sm[len(ids):] = True
            rows.append(row)
            scores.append(sm)
    width = max(r.numel() for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    score_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (r, s) in enumerate(zip(rows, scores)):
        input_ids[i, :r.numel()] = r
        attention[i, :r.numel()] = 1
        score_mask[i, :r.numel()] = s
    return {"input_ids": input_ids, "attention_mask": attention, "score_mask": score_mask}


def diagnose(before: Path, after: Path, args) -> dict:
    """Compute the report (a JSON-ready dict) comparing two model folders; see the module docstring."""
    import torch

    from covrl.diagnostics.fisher import concentration, fisher_diagonal
    from covrl.diagnostics.sparsity import update_sparsity
    from covrl.diagnostics.spectrum import update_spectrum

    torch.manual_seed(args.seed)
    m0, m1 = load_model(before), load_model(after)
    s0 = dict(m0.named_parameters())
    s1 = dict(m1.named_parameters())
    names = [n for n, p in s0.items() if p.is_floating_point()]
    missing = [n for n in names if n not in s1 or s1[n].shape != s0[n].shape]
    if missing:
        raise SystemExit(f"covrl diagnose: the two models differ in {missing[:3]} (not the same architecture)")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    sparsity = update_sparsity({n: s0[n].detach() for n in names}, {n: s1[n].detach() for n in names},
                               atol=args.atol, dtype=dtype, rtol=args.rtol, compute_rank=False)
    matrices = {}
    for n in names:
        if s0[n].dim() != 2:
            continue
        delta = s1[n].detach().float() - s0[n].detach().float()
        spec = update_spectrum(delta, args.k)
        matrices[n] = {**spec.metrics, **{k: sparsity.tensors[n][k] for k in
                                          ("sparsity", "sparsity_full", "absorbed", "absorbed_share",
                                           "sparsity_relative", "max_abs_update")}}
    report = {
        "before": str(before),
        "after": str(after),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if not k.startswith("_") and k != "command"},
        "sparsity": sparsity.metrics,
        "matrices": matrices,
    }
    summary = {
        "matrices": len(matrices),
        "energy_top_k_mean": _mean([m["energy_top_k"] for m in matrices.values()]),
        "rank_ratio_mean": _mean([m["rank_ratio"] for m in matrices.values()]),
        "stable_rank_mean": _mean([m["stable_rank"] for m in matrices.values()]),
        "sparsity": sparsity.metrics["sparsity"],
        "sparsity_full": sparsity.metrics["sparsity_full"],
        "absorbed_share": sparsity.metrics["absorbed_share"],
        "sparsity_relative": sparsity.metrics["sparsity_relative"],
    }
    if not args.no_fisher:
        tok, tok_from = _tokenizer(args, before, after)
        batch = fisher_batch(m0, tok, args.prompt, args.samples, args.max_new_tokens, args.temperature, args.seed)
        selection = args.fisher_params or "^(" + "|".join(_escape(n) for n in matrices) + ")$"
        m0.float()
        fisher = fisher_diagonal(m0, batch, params=selection, temperature=args.temperature)
        deltas = {n: (s1[n].detach().double() - s0[n].detach().double()) ** 2 for n in fisher}
        for n, f in fisher.items():
            if n in matrices:
                matrices[n]["update_top_fisher_share"] = concentration(f, deltas[n], args.top_frac)
                matrices[n]["fisher_top_share"] = concentration(f, f, args.top_frac)
        summary["update_top_fisher_share"] = concentration(fisher, deltas, args.top_frac)
        summary["fisher_top_share"] = concentration(fisher, fisher, args.top_frac)
        report["fisher"] = {"sequences": int(batch["input_ids"].shape[0]),
                            "response_tokens": int(batch["score_mask"].sum()),
                            "tokenizer": tok_from or "none (BOS-only prompts)",
                            "parameters": int(sum(f.numel() for f in fisher.values()))}
    report["summary"] = summary
    return report


def _escape(name: str) -> str:
    import re

    return re.escape(name)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def _figure(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mats = report["matrices"]
    names = list(mats)
    x = list(range(len(names)))
    has_fisher = any("update_top_fisher_share" in m for m in mats.values())
    fig, ax = plt.subplots(1, 3 if has_fisher else 2, figsize=(16 if has_fisher else 11, 4))
    k = int(report["settings"]["k"])
    ax[0].plot(x, [mats[n]["energy_top_k"] for n in names], "o", ms=3, label=f"energy in top {k}")
    ax[0].plot(x, [mats[n]["rank_ratio"] for n in names], "s", ms=3, label="numerical rank / full rank")
    ax[0].set_xlabel("weight matrix (model order)")
    ax[0].set_ylim(-0.02, 1.02)
    ax[0].set_title("update spectrum per matrix")
    ax[0].legend(fontsize=8)
    ax[1].plot(x, [mats[n]["sparsity"] for n in names], "o", ms=3, label=f"|Δ| ≤ atol after {report['settings']['dtype']}")
    ax[1].plot(x, [mats[n]["sparsity_full"] for n in names], "s", ms=3, label="|Δ| ≤ atol, full precision")
    ax[1].plot(x, [mats[n]["absorbed"] for n in names], "^", ms=3, label="absorbed by the cast")
    ax[1].set_xlabel("weight matrix (model order)")
    ax[1].set_ylim(-0.02, 1.02)
    ax[1].set_title("update sparsity")
    ax[1].legend(fontsize=8)
    if has_fisher:
        frac = float(report["settings"]["top_frac"])
        ax[2].plot(x, [mats[n].get("update_top_fisher_share", float("nan")) for n in names], "o", ms=3,
                   label="share of ‖Δ‖² in top-Fisher coords")
        ax[2].plot(x, [mats[n].get("fisher_top_share", float("nan")) for n in names], "s", ms=3,
                   label="share of Fisher in its top coords")
        ax[2].axhline(frac, color="gray", ls=":", label="uniform")
        ax[2].set_xlabel("weight matrix (model order)")
        ax[2].set_ylim(-0.02, 1.02)
        ax[2].set_title(f"Fisher vs update (top {frac:.0%})")
        ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
