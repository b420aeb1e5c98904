"""The geometry of an update between two models (what `covrl diagnose` reports): the spectrum of every matrix's
update (energy in the top k directions, numerical / stable / effective rank), update sparsity (the published
bf16 |Δ| ≤ atol definition, the fp32 one, the absorbed share, a relative version) and how much of the update sits
in high-Fisher coordinates, with the Fisher estimated from responses that the 'before' model samples itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = [
    "What is 17 + 25?",
    "Name a prime number larger than 10.",
    "Write one sentence about the sea.",
    "Complete the sequence: 2, 4, 8,",
]


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


def update_report(m0, m1, tokenizer, args, *, before: str, after: str, tokenizer_from: str | None = None
                  ) -> dict[str, Any]:
    """The report (a JSON-ready dict) on the update from model `m0` to model `m1` (same architecture); `args`
    holds the settings (k, atol, dtype, rtol, no_fisher, prompt, samples, max_new_tokens, temperature,
    fisher_params, top_frac, seed); `before` / `after` name the two models in the report. `tokenizer` (or None:
    BOS-only prompts) encodes the Fisher batch's prompts."""
    import torch

    from covrl.diagnostics.fisher import concentration, fisher_diagonal
    from covrl.diagnostics.sparsity import update_sparsity
    from covrl.diagnostics.spectrum import update_spectrum

    torch.manual_seed(args.seed)
    s0 = dict(m0.named_parameters())
    s1 = dict(m1.named_parameters())
    names = [n for n, p in s0.items() if p.is_floating_point()]
    missing = [n for n in names if n not in s1 or s1[n].shape != s0[n].shape]
    if missing:
        raise ValueError(f"the two models differ in {missing[:3]} (not the same architecture)")
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
        "before": before,
        "after": after,
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
        batch = fisher_batch(m0, tokenizer, args.prompt, args.samples, args.max_new_tokens, args.temperature, args.seed)
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
                            "tokenizer": tokenizer_from or "none (BOS-only prompts)",
                            "parameters": int(sum(f.numel() for f in fisher.values()))}
    report["summary"] = summary
    return report


def _escape(name: str) -> str:
    import re

    return re.escape(name)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def write_figure(report: dict, path: Path) -> None:
    """diagnose.png: spectrum, sparsity and (when measured) Fisher concentration per matrix."""
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
