"""Reproduction `python -m studies output-rank` (docs/theory.md ¶1, docs/theory.md §1): at the output layer only competing rows move.

Sections:

1. Exact expected gradient. Contexts x_n feed a linear map M (h = M x), logits z = W_U h + c_n with K = 5
   competing tokens shared across contexts and tail mass ε on the other V − K. The expected policy gradient of M
   is Σ_n W_Uᵀ(π_n ⊙ (r_n − π_n·r_n)) x_nᵀ; its energy in the top K − 1 singular directions is measured as ε
   sweeps from 1e-3 to 0.6.
2. Many steps. M trained from 0 with sampled policy gradient (group-centred advantages), SGD vs Adam, in fp32:
   the update is numerically full rank yet its energy stays in the top K − 1 directions.
3. LoRA. Expected reward maximised (exact gradient, Adam) with full M and with M = BA of rank 1, 2, K − 1,
   where the reward asks each context for its own competing token (a K-class problem).
4. A tiny transformer (briefly SFT-trained on addition) sampled on its own prompts: the signal at the lm_head
   input, `output_layer_signal`, lies in the span of competing-row differences and has the rank of the union of
   competing sets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from studies.common import pyplot, save_figure, start_repro
from studies.toys import (
    ANSWER_LEN,
    PRETRAIN_STEPS,
    addition_prompts,
    addition_reward,
    pretrained_tiny,
    sample_fixed,
)

from covrl.diagnostics import output_layer_signal, update_spectrum

CLAIM = (
    "At the output layer only competing rows move: the backprop signal is the drawn row minus the sampler's "
    "average, so the expected update of a map feeding the unembedding has rank ≤ K−1 plus a leak set by the tail "
    "mass, a rank-(K−1) LoRA carries the main part, and measured updates are numerically full rank yet "
    "spectrally concentrated."
)


@dataclass
class Settings:
    vocab: int = 200
    dim: int = 32
    competing: int = 5
    contexts: int = 64
    tails: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.4, 0.6)
    tail_seeds: int = 5
    train_tail: float = 1.6e-2
    train_steps: int = 300
    group: int = 4
    sgd_lr: float = 2.0
    adam_lr: float = 3e-3
    lora_steps: int = 300
    lora_lr: float = 0.05
    lora_ranks: tuple[int, ...] = (1, 2, 4)
    lm_prompts: int = 48


FAST = Settings(tails=(1e-3, 2e-2, 0.4, 0.6), tail_seeds=2, train_steps=80, lora_steps=100, lm_prompts=24)
FULL = Settings()


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):


    cfg = FAST if fast else FULL
    result = start_repro("output-rank", CLAIM, out_dir)
    tails = _tail_sweep(result, cfg, seed)
    optim = _optimizer_section(result, cfg, seed)
    lora = _lora_section(result, cfg, seed)
    lm = _transformer_section(result, cfg, seed, fast)
    result.figures.append(_figure(out_dir, cfg, tails, optim, lora, lm))
    result.notes = (
        f"V={cfg.vocab}, d={cfg.dim}, K={cfg.competing}, {cfg.contexts} contexts; section 2: {cfg.train_steps} steps, "
        f"{cfg.group} samples per context, SGD lr {cfg.sgd_lr}, Adam lr {cfg.adam_lr}, fp32, numerical rank with "
        f"rtol = max(m,n)·eps(fp32); section 3: {cfg.lora_steps} Adam steps (lr {cfg.lora_lr}) on the exact expected "
        "reward. Section 4 uses a 2-layer, d=64 Llama trained by SFT on 'ab+cd=xyz' and tail_eps = 0.01."
    )
    return result


# ------------------------------------------------------------------------------------------------ toy model


def _toy(cfg: Settings, tail: float, gen, comp_scale: float = 1.0):
    """W_U [V, d], contexts X [N, d], context logits c [N, V] with K competing tokens (ids 0..K−1) and tail mass
    exactly `tail` on the others."""
    import torch

    V, d, K, N = cfg.vocab, cfg.dim, cfg.competing, cfg.contexts
    W = torch.randn(V, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
    X = torch.randn(N, d, generator=gen, dtype=torch.float64)
    comp = comp_scale * torch.randn(N, K, generator=gen, dtype=torch.float64)
    rest = torch.randn(N, V - K, generator=gen, dtype=torch.float64)
    # shift the tail logits so that its mass is exactly `tail` in every context
    offset = torch.log(tail * comp.exp().sum(1) / ((1 - tail) * rest.exp().sum(1)))
    c = torch.cat([comp, rest + offset[:, None]], dim=1)
    return W, X, c


def _tail_sweep(result, cfg: Settings, seed: int) -> dict:
    import torch


    K = cfg.competing
    energies = {}
    for tail in cfg.tails:
        vals = []
        for s in range(cfg.tail_seeds):
            gen = torch.Generator().manual_seed(seed * 1000 + s)
            W, X, c = _toy(cfg, tail, gen)
            r = torch.rand(cfg.contexts, cfg.vocab, generator=gen, dtype=torch.float64)
            pi = torch.softmax(c, -1)
            rbar = (pi * r).sum(1, keepdim=True)
            # expected signal at h: E_π[(r − r̄)(w_y − πᵀW)] = Σ_v π_v (r_v − r̄) w_v
            signal = (pi * (r - rbar)) @ W
            grad_M = signal.T @ X / cfg.contexts
            vals.append(update_spectrum(grad_M, K - 1).metrics["energy_top_k"])
        energies[tail] = min(vals)
    small = [energies[t] for t in cfg.tails if t <= 2e-2]
    large = [energies[t] for t in cfg.tails if t >= 0.4]
    result.numbers["expected_gradient_energy_top_K-1_by_tail"] = {str(t): e for t, e in energies.items()}
    result.check("expected gradient: energy in top K−1 when tail ≤ 2e-2 (min over tails and seeds)", min(small),
                 "≥ 0.999", min(small) >= 0.999)
    result.check("expected gradient: energy in top K−1 when tail ≥ 0.4 (max over tails)", max(large),
                 "< 0.99 (the rank bound is loose)", max(large) < 0.99)
    return energies


def _reward_table(cfg: Settings, X, gen):
    """r(n, v) = 1 if v is context n's own competing token (a linear K-class rule on x_n), else 0."""
    import torch

    U = torch.randn(cfg.competing, X.shape[1], generator=gen, dtype=torch.float64)
    target = (X @ U.T).argmax(1)
    r = torch.zeros(cfg.contexts, cfg.vocab, dtype=torch.float64)
    r[torch.arange(cfg.contexts), target] = 1.0
    return r


def _optimizer_section(result, cfg: Settings, seed: int) -> dict:
    import torch


    K, d = cfg.competing, cfg.dim
    out = {}
    for name in ("sgd", "adam"):
        gen = torch.Generator().manual_seed(seed * 1000 + 77)
        W, X, c = _toy(cfg, cfg.train_tail, gen, comp_scale=0.3)
        r = _reward_table(cfg, X, gen)
        W, X, c, r = W.float(), X.float(), c.float(), r.float()
        M = torch.zeros(d, d, requires_grad=True)
        opt = torch.optim.SGD([M], lr=cfg.sgd_lr) if name == "sgd" else torch.optim.Adam([M], lr=cfg.adam_lr)
        sample_gen = torch.Generator().manual_seed(seed * 1000 + 78)
        rewards = []
        for _ in range(cfg.train_steps):
            logits = (X @ M.T) @ W.T + c  # [N, V]
            logp = torch.log_softmax(logits, -1)
            y = torch.multinomial(logp.detach().exp(), cfg.group, replacement=True, generator=sample_gen)  # [N, G]
            rew = r.gather(1, y)
            adv = rew - rew.mean(1, keepdim=True)
            loss = -(adv * logp.gather(1, y)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rewards.append(float((logp.detach().exp() * r).sum(1).mean()))
        spec = update_spectrum(M.detach(), K - 1)
        out[name] = {"spectrum": spec, "reward": rewards}
        result.numbers[f"{name}_update"] = {k: spec.metrics[k] for k in
                                            ("energy_top_k", "numerical_rank", "stable_rank", "effective_rank")}
        result.numbers[f"{name}_expected_reward_first_last"] = [rewards[0], rewards[-1]]
    a = out["adam"]["spectrum"].metrics
    s = out["sgd"]["spectrum"].metrics
    result.check(f"Adam after {cfg.train_steps} steps: numerical rank of ΔM", a["numerical_rank"],
                 f"= {d} (numerically full rank)", a["numerical_rank"] == d)
    result.check("Adam: energy of ΔM in the top K−1 directions", a["energy_top_k"], "≥ 0.9", a["energy_top_k"] >= 0.9)
    result.check("SGD: energy of ΔM in the top K−1 directions", s["energy_top_k"], "≥ 0.9 (reported with its rank)",
                 s["energy_top_k"] >= 0.9)
    return out


def _lora_section(result, cfg: Settings, seed: int) -> dict:
    import torch

    d = cfg.dim
    gen = torch.Generator().manual_seed(seed * 1000 + 91)
    W, X, c = _toy(cfg, cfg.train_tail, gen, comp_scale=0.1)
    r = _reward_table(cfg, X, gen)

    def expected_reward(M):
        return (torch.softmax((X @ M.T) @ W.T + c, -1) * r).sum(1).mean()

    curves = {}
    for rank in ("full", *cfg.lora_ranks):
        init = torch.Generator().manual_seed(seed * 1000 + 92)
        if rank == "full":
            params = [torch.zeros(d, d, dtype=torch.float64, requires_grad=True)]
            build = lambda p: p[0]  # noqa: E731
        else:
            Bm = torch.zeros(d, rank, dtype=torch.float64, requires_grad=True)
            Am = (torch.randn(rank, d, generator=init, dtype=torch.float64) / math.sqrt(d)).requires_grad_()
            params = [Bm, Am]
            build = lambda p: p[0] @ p[1]  # noqa: E731
        opt = torch.optim.Adam(params, lr=cfg.lora_lr)
        curve = [float(expected_reward(build(params)).detach())]
        for _ in range(cfg.lora_steps):
            loss = -expected_reward(build(params))
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(float(expected_reward(build(params)).detach()))
        curves[str(rank)] = curve
    gain = {k: v[-1] - v[0] for k, v in curves.items()}
    K1 = str(cfg.competing - 1)
    result.numbers["lora_reward_gain"] = gain
    result.numbers["lora_final_reward"] = {k: v[-1] for k, v in curves.items()}
    rel = {k: gain[k] / gain["full"] for k in gain}
    result.check(f"LoRA rank K−1={K1}: share of full fine-tuning's reward gain", rel[K1], "≥ 0.9", rel[K1] >= 0.9)
    result.check("LoRA rank 1: share of full fine-tuning's reward gain", rel["1"], f"≤ 0.8 and below rank {K1}",
                 rel["1"] <= 0.8 and rel["1"] < rel[K1])
    return curves


def _transformer_section(result, cfg: Settings, seed: int, fast: bool) -> dict:
    import torch


    model, tok, sft_loss = pretrained_tiny(PRETRAIN_STEPS[fast], seed=seed)
    gen = torch.Generator().manual_seed(seed * 1000 + 5)
    pairs, prompts = addition_prompts(tok, cfg.lm_prompts, gen)
    ids, _ = sample_fixed(model, prompts, ANSWER_LEN, gen)
    adv = addition_reward(tok, ids, pairs)
    adv = adv - adv.mean()
    captured = {}
    hook = model.lm_head.register_forward_pre_hook(lambda _m, inp: captured.__setitem__("h", inp[0]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    hook.remove()
    P = prompts.shape[1]
    mask = torch.ones(ids.shape[0], ANSWER_LEN)
    z = logits[:, P - 1:-1]
    # "core" competing tokens: in the competing set (mass ≥ 0.99) of at least 5% of the positions
    pi = torch.softmax(z.double(), -1).reshape(-1, z.shape[-1])
    top_p, top_i = pi.sort(-1, descending=True)
    member = torch.zeros_like(pi).scatter_(1, top_i, ((top_p.cumsum(-1) - top_p) < 0.99).double())
    core = int((member.mean(0) >= 0.05).sum())
    sig = output_layer_signal(z, ids[:, P:], adv, model.lm_head.weight.detach(), mask, 0.01,
                              hidden=captured["h"][:, P - 1:-1], k=core - 1)
    m = sig.metrics
    result.numbers["tiny_transformer_signal"] = {**m, "sft_loss": sft_loss, "hidden_size": float(model.config.hidden_size)}
    result.check("tiny transformer: share of the lm_head-input signal in span{w_u − w_v : u, v competing}",
                 m["span_share"], "≥ 0.99", m["span_share"] >= 0.99)
    result.check("tiny transformer: share of the lm_head gradient in competing rows", m["lm_head_competing_share"],
                 "≥ 0.99", m["lm_head_competing_share"] >= 0.99)
    result.numbers["tiny_transformer_core_competing_tokens"] = core
    d = model.config.hidden_size
    result.check(f"tiny transformer: stacked signal energy in the top (core competing tokens − 1) = {core - 1} of "
                 f"d = {d} directions", m["energy_top_k"], "≥ 0.99 with core − 1 ≤ d/4",
                 m["energy_top_k"] >= 0.99 and core - 1 <= d // 4)
    return {"sigma": sig.spectrum.singular_values, "union": core, "metrics": m}


# ------------------------------------------------------------------------------------------------ figure


def _figure(out_dir: Path, cfg: Settings, tails, optim, lora, lm) -> str:

    plt = pyplot()
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    ts = sorted(tails)
    ax[0].semilogx(ts, [1 - tails[t] for t in ts], "o-")
    ax[0].set_yscale("log")
    ax[0].set_xlabel("tail mass ε outside the K competing tokens")
    ax[0].set_ylabel(f"1 − energy in top K−1={cfg.competing - 1}")
    ax[0].set_title("expected gradient of M: leak vs tail")
    for name, res in optim.items():
        s = res["spectrum"].singular_values
        e = (s ** 2 / (s ** 2).sum()).numpy()
        ax[1].semilogy(range(1, len(e) + 1), e, "o-", ms=3, label=f"{name}: top-{cfg.competing - 1} "
                       f"{res['spectrum'].metrics['energy_top_k']:.3f}, rank {int(res['spectrum'].metrics['numerical_rank'])}")
    ax[1].axvline(cfg.competing - 1, color="gray", ls=":")
    ax[1].set_xlabel("singular direction i")
    ax[1].set_ylabel("σ_i² / Σσ²")
    ax[1].set_title(f"ΔM after {cfg.train_steps} sampled PG steps")
    ax[1].legend(fontsize=8)
    for k, curve in lora.items():
        ax[2].plot(curve, label=("full" if k == "full" else f"LoRA rank {k}"))
    ax[2].set_xlabel("Adam step")
    ax[2].set_ylabel("expected reward")
    ax[2].set_title("full fine-tuning vs LoRA")
    ax[2].legend(fontsize=8)
    s = lm["sigma"]
    e = (s ** 2 / (s ** 2).sum()).numpy()
    ax[3].semilogy(range(1, len(e) + 1), e, "o-", ms=3)
    ax[3].axvline(lm["union"] - 1, color="gray", ls=":", label="core competing tokens − 1")
    ax[3].set_xlabel("singular direction i")
    ax[3].set_ylabel("σ_i² / Σσ²")
    ax[3].set_title("tiny transformer: signal at lm_head input")
    ax[3].legend(fontsize=8)
    return save_figure(fig, out_dir / "output_rank.png", dpi=110)
