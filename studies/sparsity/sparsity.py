"""Reproduction `python -m studies sparsity` (docs/theory.md ¶3, docs/theory.md §3): the sampler Fisher caps every coordinate of a
centred policy-gradient update; SFT is all mean shift and is not capped.

Sections:

1. Softmax-linear policy (logits W x_n, fp64, exact enumeration of tokens): the share of ‖ΔW‖² that falls in the
   top-20% Fisher coordinates after a few steps of centred policy gradient vs SFT on demonstrations.
2. The cap `|g_i| ≤ std(A)·sqrt(F_ii)` on the same model by exact enumeration (`covariance_split`): on-policy,
   and with a truncated top-k sampler, uncentred (A = R) vs centred (the score centred under the sampler).
3. The same on a tiny transformer's sampled batch with `fisher_cap` (empirical batch: the centred estimator
   satisfies the cap exactly).
4. A tiny transformer fine-tuned a few steps by PG and by SFT: `update_sparsity` in fp32 and in bf16 (the
   published |Δ| ≤ 1e-5 definition), the share that bf16 absorption explains, the scale-free relative sparsity,
   and the Fisher concentration of each update.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from studies.common import pyplot, save_figure, start_repro
from studies.toys import (
    ANSWER_LEN,
    PRETRAIN_STEPS,
    addition_prompts,
    addition_reward,
    addition_text,
    pretrained_tiny,
    sample_fixed,
    score_mask,
)

from covrl.diagnostics import covariance_split, fisher_cap, update_sparsity
from covrl.diagnostics.fisher import concentration, fisher_diagonal
from covrl.diagnostics.reach import as_sequences, sequence_logprobs

CLAIM = (
    "With the score centred under the sampler the sampler Fisher caps every coordinate of a policy-gradient "
    "update, so PG updates concentrate where the Fisher is large; without centring (off-policy, e.g. a truncated "
    "sampler) a mean shift escapes the cap, and SFT, all mean shift, is not concentrated."
)


@dataclass
class Settings:
    vocab: int = 50
    dim: int = 16
    contexts: int = 64
    logit_scale: float = 1.0
    popular: int = 5
    prior_gap: float = 4.0
    toy_steps: int = 10
    toy_lr: float = 0.5
    top_k: int = 3
    lm_batch: int = 32
    lm_steps: int = 8
    lm_sgd_lr: float = 0.05
    lm_adam_lr: float = 1e-5


FAST = Settings(lm_batch=12, lm_steps=4)
FULL = Settings()


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):


    cfg = FAST if fast else FULL
    result = start_repro("sparsity", CLAIM, out_dir)
    toy = _toy_sections(result, cfg, seed)
    lm_cap = _transformer_cap_section(result, cfg, seed, fast)
    lm = _transformer_sparsity_section(result, cfg, seed, fast)
    result.figures.append(_figure(out_dir, cfg, toy, lm_cap, lm))
    result.notes = (
        f"Toy: V={cfg.vocab} tokens, {cfg.contexts} contexts in R^{cfg.dim} (first feature constant 1), logits W x "
        f"with W0 ~ {cfg.logit_scale}·N(0, 1/d) plus a prior logit +{cfg.prior_gap / 2} on {cfg.popular} popular "
        f"tokens and −{cfg.prior_gap / 2} on the rest, rewards U(0, 1) per (context, token); "
        f"{cfg.toy_steps} exact-gradient steps of lr {cfg.toy_lr}; SFT demonstrations = each context's best token. "
        f"Top-k sampler k = {cfg.top_k}. Transformer: 2-layer d=64 Llama after a short SFT on addition; "
        f"{cfg.lm_batch} samples per step, {cfg.lm_steps} steps, SGD lr {cfg.lm_sgd_lr} / Adam lr {cfg.lm_adam_lr}."
    )
    return result


# ------------------------------------------------------------------------------------------------ toy model


def _toy(cfg: Settings, seed: int):
    import math

    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + 3)
    X = torch.randn(cfg.contexts, cfg.dim, generator=gen, dtype=torch.float64)
    X[:, 0] = 1.0  # a constant feature: W[:, 0] is a per-token prior logit
    W0 = cfg.logit_scale * torch.randn(cfg.vocab, cfg.dim, generator=gen, dtype=torch.float64) / math.sqrt(cfg.dim)
    # a few popular tokens hold most of the sampler's mass in every context
    W0[:, 0] = -cfg.prior_gap / 2
    W0[: cfg.popular, 0] = cfg.prior_gap / 2
    R = torch.rand(cfg.contexts, cfg.vocab, generator=gen, dtype=torch.float64)
    return X, W0, R


def _scores(X, pi):
    """All (context, token) score vectors of the trainer, s = (e_v − π_n) ⊗ x_n flattened: [N·V, V·d]."""
    import torch

    N, V = pi.shape
    eye = torch.eye(V, dtype=pi.dtype)
    resid = eye[None, :, :] - pi[:, None, :]  # [N, v drawn, V]
    return torch.einsum("nvu,nd->nvud", resid, X).reshape(N * V, -1)


def _toy_sections(result, cfg: Settings, seed: int) -> dict:
    import torch


    X, W0, R = _toy(cfg, seed)
    N, V = R.shape
    pi0 = torch.softmax(X @ W0.T, -1)
    on_policy = covariance_split(_scores(X, pi0), R.flatten(), (pi0 / N).flatten())
    fisher0 = on_policy.fisher

    # PG: exact expected gradient of E[R] with A centred per context; SFT: demonstrations = best token per context
    best = R.argmax(1)

    def pg_grad(W):
        pi = torch.softmax(X @ W.T, -1)
        adv = pi * (R - (pi * R).sum(1, keepdim=True))
        return adv.T @ X / N

    def sft_grad(W):
        pi = torch.softmax(X @ W.T, -1)
        return (torch.nn.functional.one_hot(best, V).double() - pi).T @ X / N

    deltas = {}
    for name, grad in (("pg", pg_grad), ("sft", sft_grad)):
        W = W0.clone()
        for _ in range(cfg.toy_steps):
            W += cfg.toy_lr * grad(W)
        deltas[name] = W - W0
    share = {k: concentration(fisher0, v.flatten() ** 2, 0.2) for k, v in deltas.items()}
    result.numbers["toy_top20_fisher_share_of_update"] = share
    result.numbers["toy_fisher_top20_share_of_fisher"] = concentration(fisher0, fisher0, 0.2)
    result.check("softmax-linear, fp64: share of ‖ΔW‖² in the top-20% Fisher coordinates, centred PG",
                 share["pg"], "≥ 0.9", share["pg"] >= 0.9)
    result.check("softmax-linear, fp64: same share for SFT", share["sft"], "≤ 0.6 and below PG's",
                 share["sft"] <= 0.6 and share["sft"] < share["pg"])

    # the cap, exact enumeration: on-policy and with a top-k sampler, uncentred (A = R) vs centred
    kth = pi0.topk(cfg.top_k, -1).values[:, -1:]
    q = torch.where(pi0 >= kth, pi0, torch.zeros_like(pi0))
    q = q / q.sum(1, keepdim=True)
    truncated = covariance_split(_scores(X, pi0), R.flatten(), (q / N).flatten())
    caps = {
        "on_policy_uncentred": on_policy.metrics["grad_over_cap_frac"],
        "on_policy_centred": on_policy.metrics["signal_over_cap_frac"],
        "topk_uncentred": truncated.metrics["grad_over_cap_frac"],
        "topk_centred": truncated.metrics["signal_over_cap_frac"],
    }
    result.numbers["toy_over_cap_fraction"] = caps
    result.numbers["toy_drift_share"] = {"on_policy": on_policy.metrics["drift_share"],
                                         "topk": truncated.metrics["drift_share"]}
    result.numbers["toy_mean_score_norm"] = {"on_policy": on_policy.metrics["mean_score_norm"],
                                             "topk": truncated.metrics["mean_score_norm"]}
    result.check(f"exact, top-{cfg.top_k} sampler, uncentred: fraction of coordinates over the cap",
                 caps["topk_uncentred"], "> 0.01 (the mean shift escapes)", caps["topk_uncentred"] > 0.01)
    result.check("exact, centred (on-policy and top-k): fraction over the cap",
                 max(caps["on_policy_centred"], caps["topk_centred"]), "= 0",
                 caps["on_policy_centred"] == 0 and caps["topk_centred"] == 0)
    result.check("exact, on-policy, uncentred: fraction over the cap (E_p[s] = 0)", caps["on_policy_uncentred"],
                 "= 0", caps["on_policy_uncentred"] == 0)
    return {"fisher": fisher0, "deltas": deltas, "share": share, "caps": caps,
            "topk_ratio": (truncated.grad.abs() / truncated.cap.clamp_min(1e-300)),
            "topk_cap": truncated.cap, "topk_grad": truncated.grad, "topk_signal": truncated.signal}


# ------------------------------------------------------------------------------------------------ transformer


def _lm_batch(model, tok, n: int, gen, top_k: int = 0):

    pairs, prompts = addition_prompts(tok, n, gen)
    ids, lq = sample_fixed(model, prompts, ANSWER_LEN, gen, top_k=top_k)
    reward = addition_reward(tok, ids, pairs)
    P = prompts.shape[1]
    return {"input_ids": ids, "score_mask": score_mask(len(ids), ids.shape[1], P)}, reward, lq, pairs, prompts


def _transformer_cap_section(result, cfg: Settings, seed: int, fast: bool) -> dict:
    import torch


    model, tok, _ = pretrained_tiny(PRETRAIN_STEPS[fast], seed=seed, dtype=torch.float64)
    out = {}
    for sampler, k in (("on_policy", 0), ("topk", cfg.top_k)):
        gen = torch.Generator().manual_seed(seed * 1000 + 23)
        batch, reward, lq, _, _ = _lm_batch(model, tok, cfg.lm_batch, gen, top_k=k)
        for center in ("none", "score"):
            fc = fisher_cap(model, batch, reward, lq, center=center, keep_tensors=False)
            out[f"{sampler}_{center}"] = fc.metrics
    result.numbers["tiny_transformer_fisher_cap"] = out
    result.check("tiny transformer, empirical batch, score-centred: fraction over the cap (on-policy and top-k)",
                 max(out["on_policy_score"]["over_cap_frac"], out["topk_score"]["over_cap_frac"]), "= 0",
                 out["on_policy_score"]["over_cap_frac"] == 0 and out["topk_score"]["over_cap_frac"] == 0)
    result.check(f"tiny transformer, top-{cfg.top_k} sampler, uncentred (A = R): fraction over the cap",
                 out["topk_none"]["over_cap_frac"], "> 0.01", out["topk_none"]["over_cap_frac"] > 0.01)
    return out


def _transformer_sparsity_section(result, cfg: Settings, seed: int, fast: bool) -> dict:
    import torch


    base, tok, _ = pretrained_tiny(PRETRAIN_STEPS[fast], seed=seed)
    gen = torch.Generator().manual_seed(seed * 1000 + 29)
    batch, _, _, _, _ = _lm_batch(base, tok, cfg.lm_batch, gen)
    fisher = fisher_diagonal(base, batch)
    theta0 = {k: v.clone() for k, v in base.state_dict().items()}
    out = {}
    for opt_name in ("sgd", "adam"):
        for algo in ("pg", "sft"):
            model, _, _ = pretrained_tiny(PRETRAIN_STEPS[fast], seed=seed)
            model.train()
            opt = (torch.optim.SGD(model.parameters(), lr=cfg.lm_sgd_lr) if opt_name == "sgd"
                   else torch.optim.Adam(model.parameters(), lr=cfg.lm_adam_lr))
            step_gen = torch.Generator().manual_seed(seed * 1000 + 31)
            for _ in range(cfg.lm_steps):
                b, reward, _, pairs, prompts = _lm_batch(model, tok, cfg.lm_batch, step_gen)
                if algo == "pg":
                    seqs = as_sequences(b)
                    adv = reward - reward.mean()
                    loss = -(adv.float() * sequence_logprobs(model, seqs)).mean()
                else:
                    answers = torch.tensor([tok.encode(addition_text(a, c)[1], add_special_tokens=False)
                                            for a, c in pairs])
                    ids = torch.cat([prompts, answers], dim=1)
                    seqs = as_sequences({"input_ids": ids,
                                         "score_mask": score_mask(len(ids), ids.shape[1], prompts.shape[1])})
                    loss = -sequence_logprobs(model, seqs).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            theta1 = {k: v.detach().clone() for k, v in model.state_dict().items()}
            sp = update_sparsity(theta0, theta1, atol=1e-5, dtype=torch.bfloat16)
            delta_sq = {n: (theta1[n] - theta0[n]).double() ** 2 for n in fisher}
            conc = concentration(fisher, delta_sq, 0.2)
            out[f"{opt_name}_{algo}"] = {**{k: sp.metrics[k] for k in (
                "sparsity", "sparsity_full", "absorbed", "amplified", "absorbed_share", "sparsity_relative",
                "unchanged_exact", "rank_ratio")}, "top20_fisher_share": conc}
    result.numbers["tiny_transformer_sparsity"] = out
    result.numbers["tiny_transformer_fisher_top20_share_of_fisher"] = concentration(fisher, fisher, 0.2)
    s_pg, s_sft = out["sgd_pg"]["top20_fisher_share"], out["sgd_sft"]["top20_fisher_share"]
    result.check("tiny transformer, SGD, fp32: share of ‖Δθ‖² in the top-20% Fisher coordinates, PG vs SFT",
                 {"pg": s_pg, "sft": s_sft}, "PG > SFT", s_pg > s_sft)
    absorbed = min(v["absorbed_share"] for v in out.values())
    result.check("bf16 (|Δ| ≤ 1e-5): share of the published sparsity explained by bf16 absorption (min over PG/SFT × "
                 "SGD/Adam)", absorbed, "≥ 0.1 (precision inflates the published number)", absorbed >= 0.1)
    ident = max(abs(v["sparsity"] - (v["sparsity_full"] + v["absorbed"] - v["amplified"])) for v in out.values())
    result.check("bf16 sparsity = fp32 sparsity + absorbed − amplified (absorption reported separately)", ident,
                 "≤ 1e-9", ident <= 1e-9)
    return out


# ------------------------------------------------------------------------------------------------ figure


def _figure(out_dir: Path, cfg: Settings, toy, lm_cap, lm) -> str:
    import torch


    plt = pyplot()
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    f = toy["fisher"]
    order = torch.argsort(f, descending=True)
    x = torch.arange(1, f.numel() + 1) / f.numel()
    for name, d in toy["deltas"].items():
        e = d.flatten()[order] ** 2
        ax[0].plot(x, (e.cumsum(0) / e.sum()).numpy(), label=f"{name.upper()} (top 20%: {toy['share'][name]:.2f})")
    ax[0].plot([0, 1], [0, 1], ":", color="gray", label="uniform")
    ax[0].axvline(0.2, color="gray", lw=0.5)
    ax[0].set_xlabel("coordinates by decreasing Fisher (fraction)")
    ax[0].set_ylabel("cumulative share of ‖ΔW‖²")
    ax[0].set_title("softmax-linear: where the update goes")
    ax[0].legend(fontsize=8)
    cap, grad, sig = toy["topk_cap"], toy["topk_grad"], toy["topk_signal"]
    keep = cap > 1e-12
    ax[1].loglog(cap[keep].numpy(), grad[keep].abs().numpy(), ".", ms=2, label="uncentred |E_q[A s_i]|")
    ax[1].loglog(cap[keep].numpy(), sig[keep].abs().clamp_min(1e-18).numpy(), ".", ms=2,
                 label="centred |Cov_q(A, s_i)|")
    lim = [float(cap[keep].min()), float(cap[keep].max())]
    ax[1].plot(lim, lim, color="k", lw=1, label="cap std(A)·sqrt(F_ii)")
    ax[1].set_xlabel("cap")
    ax[1].set_ylabel("|gradient coordinate|")
    ax[1].set_title(f"top-{cfg.top_k} sampler, exact: {toy['caps']['topk_uncentred']:.1%} of uncentred coords "
                    "over the cap", fontsize=9)
    ax[1].legend(fontsize=7)
    labels = list(lm_cap)
    ax[2].bar(range(len(labels)), [lm_cap[k]["over_cap_frac"] for k in labels])
    ax[2].set_xticks(range(len(labels)))
    ax[2].set_xticklabels([k.replace("_", "\n") for k in labels], fontsize=8)
    ax[2].set_ylabel("fraction of coordinates over the cap")
    ax[2].set_title("tiny transformer, sampled batch")
    names = list(lm)
    width = 0.25
    for i, key in enumerate(("sparsity_full", "absorbed", "sparsity_relative")):
        ax[3].bar([j + i * width for j in range(len(names))], [lm[n][key] for n in names], width, label=key)
    ax[3].set_xticks([j + width for j in range(len(names))])
    ax[3].set_xticklabels(names, fontsize=8)
    ax[3].set_ylabel("fraction of parameters")
    ax[3].set_title("tiny transformer: fp32 sparsity + bf16 absorption")
    ax[3].legend(fontsize=7)
    return save_figure(fig, out_dir / "sparsity.png", dpi=110)
