"""Reproduction `python -m studies covariance` (docs/theory.md ¶4, docs/theory.md §4): on the model's own samples the policy gradient
is the covariance between the learning signal and the score, and the Fisher is the score's variance.

Sections:

1. Exact enumeration on a tiny transformer (all 3-token responses over a 6-token vocabulary, fp64): with an
   uncentred learning signal A = R, E_p[s] = 0, so g = E_p[A s] equals Cov_p(A, s) to rounding; every coordinate
   satisfies |g_i| ≤ std(A)·sqrt(F_ii) (`covariance_split` with the exact probabilities as weights).
2. Fisher decides whether a parameter can move, the reward whether it does: a two-token policy whose two logit
   tables have identical Fisher; the reward depends on the first token only. Exact and sampled policy gradient.
3. Drift compounding with a biased sampler: two engines synced every step (the sampler computes the trainer's
   logits plus a fixed engine bias b). With advantages centred per prompt the per-token score still has a mean
   under the sampler; the uncentred estimator moves the second-token logits, which the reward ignores, a little
   more every step; centring the score under the sampler (docs/theory.md §4) leaves them exactly in place. The library's
   `covrl.math.score_centering_term` is checked against the closed form on the enumerated batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from studies.common import pyplot, save_figure, start_repro
from studies.toys import full_precision_norms

from covrl.diagnostics import covariance_split
from covrl.diagnostics.reach import as_sequences, per_sample_scores, select_params
from covrl.math import policy_loss, score_centering_term
from covrl.models import tiny_llama

CLAIM = (
    "On the model's own samples the expected policy gradient is Cov(A, s) and the Fisher is Var(s): a parameter "
    "can move only if its Fisher is large, and whether it does is up to the reward; off-policy the same holds once "
    "the score is centred under the sampler, and without centring a drift compounds when engines are synced."
)


@dataclass
class Settings:
    vocab: int = 6
    length: int = 3
    factor_vocab: int = 4
    factor_steps: int = 60
    factor_lr: float = 1.0
    factor_batch: int = 64
    drift_vocab: int = 8
    drift_steps: int = 400
    drift_lr: float = 1.0
    engine_bias: float = 0.3


FAST = Settings(length=2, factor_steps=30, drift_steps=200)
FULL = Settings()


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):


    cfg = FAST if fast else FULL
    result = start_repro("covariance", CLAIM, out_dir)
    ident = _identity_section(result, cfg, seed)
    factor = _factor_section(result, cfg, seed)
    drift = _drift_section(result, cfg, seed)
    result.figures.append(_figure(out_dir, cfg, ident, factor, drift))
    result.notes = (
        f"Section 1: tiny Llama (1 layer, d=16) with vocab {cfg.vocab}, all {cfg.vocab ** cfg.length} responses of "
        f"length {cfg.length} after BOS, reward U(0, 1) per response, fp64 (the Llama RMSNorm computes in fp32). "
        f"Section 2: two independent {cfg.factor_vocab}-way tokens, equal initial logits in both tables, reward = "
        f"value of the first token; {cfg.factor_steps} steps of lr {cfg.factor_lr}, sampled batches of "
        f"{cfg.factor_batch}. Section 3: two-token tabular policy over {cfg.drift_vocab} tokens, reward on the first "
        f"token only, engine bias ~ N(0, {cfg.engine_bias}²) on every logit, advantages centred per prompt under the "
        f"sampler, exact expectations, {cfg.drift_steps} steps of lr {cfg.drift_lr}."
    )
    return result


# ------------------------------------------------------------------------------------------------ section 1


def _identity_section(result, cfg: Settings, seed: int) -> dict:
    import itertools

    import torch


    model = tiny_llama(cfg.vocab, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                       max_positions=8, seed=seed).double()
    full_precision_norms(model)
    model.eval()
    V, L = cfg.vocab, cfg.length
    responses = torch.tensor(list(itertools.product(range(V), repeat=L)))
    ids = torch.cat([torch.ones(len(responses), 1, dtype=torch.long), responses], dim=1)
    score = torch.zeros(ids.shape, dtype=torch.bool)
    score[:, 1:] = True

    seqs = as_sequences({"input_ids": ids, "score_mask": score})
    params = select_params(model)
    rows, logps = [], []
    for _, lp, s in per_sample_scores(model, seqs, params):
        logps.append(lp)
        rows.append(torch.cat([g.flatten() for g in s]))
    scores = torch.stack(rows)
    probs = torch.tensor(logps, dtype=torch.float64).exp()
    gen = torch.Generator().manual_seed(seed + 5)
    reward = torch.rand(len(responses), generator=gen, dtype=torch.float64)
    split = covariance_split(scores, reward, probs)  # A = R: uncentred on purpose
    m = split.metrics
    rel = float((split.grad - split.signal).norm() / split.grad.norm())
    result.numbers["enumeration"] = {"responses": len(responses), "parameters": scores.shape[1],
                                     "total_probability": float(probs.sum()), **m,
                                     "relative_gap_grad_vs_cov": rel}
    result.check("on-policy, exact: ‖E_p[A s] − Cov_p(A, s)‖ / ‖E_p[A s]‖ with uncentred A = R", rel, "≤ 1e-10",
                 rel <= 1e-10)
    result.check("on-policy, exact: fraction of coordinates with |g_i| > std(A)·sqrt(F_ii)",
                 m["grad_over_cap_frac"], "= 0", m["grad_over_cap_frac"] == 0)
    ratio = (split.signal.abs() / split.cap.clamp_min(1e-300))[split.cap > 0]
    result.numbers["enumeration_max_cap_ratio"] = float(ratio.max())
    return {"split": split}


# ------------------------------------------------------------------------------------------------ section 2


def _factor_section(result, cfg: Settings, seed: int) -> dict:
    import torch


    K = cfg.factor_vocab
    value = torch.linspace(0.0, 1.0, K, dtype=torch.float64)  # reward = value of the first token

    def scores(theta, phi):
        """All K² responses (a, b): scores for [theta, phi] concatenated, probabilities, rewards."""
        pa, pb = torch.softmax(theta, 0), torch.softmax(phi, 0)
        eye = torch.eye(K, dtype=torch.float64)
        rows, probs, rew = [], [], []
        for a in range(K):
            for b in range(K):
                rows.append(torch.cat([eye[a] - pa, eye[b] - pb]))
                probs.append(pa[a] * pb[b])
                rew.append(value[a])
        return torch.stack(rows), torch.stack(probs), torch.stack(rew)

    start = torch.zeros(K, dtype=torch.float64)
    s0, p0, r0 = scores(start, start)
    split0 = covariance_split(s0, r0, p0)
    f_theta, f_phi = split0.fisher[:K], split0.fisher[K:]
    # exact policy gradient
    theta, phi = start.clone(), start.clone()
    traj_exact = []
    for _ in range(cfg.factor_steps):
        s, p, r = scores(theta, phi)
        g = covariance_split(s, r, p).signal
        theta, phi = theta + cfg.factor_lr * g[:K], phi + cfg.factor_lr * g[K:]
        traj_exact.append((float((theta - start).norm()), float((phi - start).norm())))
    # sampled policy gradient (group-centred advantages)
    gen = torch.Generator().manual_seed(seed + 7)
    theta_s, phi_s = start.clone(), start.clone()
    traj_sampled = []
    for _ in range(cfg.factor_steps):
        pa, pb = torch.softmax(theta_s, 0), torch.softmax(phi_s, 0)
        a = torch.multinomial(pa, cfg.factor_batch, replacement=True, generator=gen)
        b = torch.multinomial(pb, cfg.factor_batch, replacement=True, generator=gen)
        adv = value[a] - value[a].mean()
        eye = torch.eye(K, dtype=torch.float64)
        theta_s = theta_s + cfg.factor_lr * (adv[:, None] * (eye[a] - pa)).mean(0)
        phi_s = phi_s + cfg.factor_lr * (adv[:, None] * (eye[b] - pb)).mean(0)
        traj_sampled.append((float((theta_s - start).norm()), float((phi_s - start).norm())))
    fisher_ratio = float(f_theta.sum() / f_phi.sum())
    corr = {"theta_max_abs": float(split0.corr[:K].abs().max()), "phi_max_abs": float(split0.corr[K:].abs().max())}
    result.numbers["equal_fisher"] = {"fisher_theta": f_theta.tolist(), "fisher_phi": f_phi.tolist(),
                                      "corr_with_reward": corr, "exact_final_move": traj_exact[-1],
                                      "sampled_final_move": traj_sampled[-1]}
    result.check("equal Fisher: Σ F(first-token logits) / Σ F(second-token logits)", fisher_ratio, "= 1",
                 abs(fisher_ratio - 1) < 1e-12)
    moved, still = traj_exact[-1]
    result.check(f"exact PG, {cfg.factor_steps} steps: movement of the reward-correlated vs the uncorrelated "
                 "equal-Fisher logits", {"correlated": moved, "uncorrelated": still},
                 "correlated > 1, uncorrelated ≤ 1e-12", moved > 1 and still <= 1e-12)
    moved_s, still_s = traj_sampled[-1]
    result.check("sampled PG: uncorrelated movement (noise only) / correlated movement", still_s / moved_s, "≤ 0.3",
                 still_s <= 0.3 * moved_s)
    return {"exact": traj_exact, "sampled": traj_sampled}


# ------------------------------------------------------------------------------------------------ section 3


def _drift_section(result, cfg: Settings, seed: int) -> dict:
    import torch

    V = cfg.drift_vocab
    gen = torch.Generator().manual_seed(seed + 13)
    reward = torch.rand(V, generator=gen, dtype=torch.float64)  # depends on the first token only
    b1 = cfg.engine_bias * torch.randn(V, generator=gen, dtype=torch.float64)
    b2 = cfg.engine_bias * torch.randn(V, V, generator=gen, dtype=torch.float64)

    def grads(t1, t2, centred: bool):
        p1, p2 = torch.softmax(t1, 0), torch.softmax(t2, 1)
        q1, q2 = torch.softmax(t1 + b1, 0), torch.softmax(t2 + b2, 1)  # the sampler engine, synced
        adv = reward - q1 @ reward  # centred per prompt under the sampler
        # E_q[A ∇ log p(y1)] and E_q[A ∇ log p(y2 | y1)] in closed form; score centring replaces p by q
        g1 = q1 * adv - (q1 @ adv) * (q1 if centred else p1)
        g2 = (q1 * adv)[:, None] * ((q2 - q2) if centred else (q2 - p2))
        return g1, g2

    out = {}
    for name, centred in (("uncentred", False), ("score_centred", True)):
        t1 = torch.zeros(V, dtype=torch.float64)
        t2 = torch.zeros(V, V, dtype=torch.float64)
        moves, rewards, kl = [], [], []
        path = 0.0
        for _ in range(cfg.drift_steps):
            g1, g2 = grads(t1, t2, centred)
            t1, t2 = t1 + cfg.drift_lr * g1, t2 + cfg.drift_lr * g2
            path += cfg.drift_lr * float(g2.norm())
            moves.append(float(t2.norm()))
            p1 = torch.softmax(t1, 0)
            rewards.append(float(p1 @ reward))
            p2 = torch.softmax(t2, 1)
            kl.append(float((p1[:, None] * p2 * (p2.log() + math.log(V))).sum()))
        out[name] = {"second_token_move": moves, "reward": rewards, "kl_second_token_from_uniform": kl,
                     "path_length": path}
    T = cfg.drift_steps
    unc = out["uncentred"]["second_token_move"]
    cen = out["score_centred"]["second_token_move"]
    growth = unc[-1] / unc[T // 2 - 1]
    # coherence: the per-step drifts point the same way, so they add up instead of cancelling like noise
    coherence = unc[-1] / out["uncentred"]["path_length"]
    monotone = all(b >= a for a, b in zip(unc, unc[1:]))
    result.numbers["drift"] = {"uncentred_move_at": {str(t): unc[t - 1] for t in (T // 4, T // 2, T)},
                               "uncentred_coherence": coherence, "uncentred_growth_half_to_end": growth,
                               "centred_move_final": cen[-1],
                               "final_reward": {k: v["reward"][-1] for k, v in out.items()},
                               "final_kl_second_token": {k: v["kl_second_token_from_uniform"][-1]
                                                         for k, v in out.items()}}
    result.check(f"biased sampler, uncentred: ‖Δ second-token logits‖ after {T} steps (the reward ignores them), "
                 "and ‖Σ_t Δ_t‖ / Σ_t ‖Δ_t‖", {"move": unc[-1], "coherence": coherence, "monotone": monotone},
                 "move > 0.1, coherence ≥ 0.9 and growing every step (the drift compounds)",
                 unc[-1] > 0.1 and coherence >= 0.9 and monotone)
    result.check("biased sampler, score-centred: ‖Δ second-token logits‖", cen[-1], "= 0 (≤ 1e-12)", cen[-1] <= 1e-12)
    out["library"] = _library_check(result, cfg, reward, b1, b2)
    return out


def _library_check(result, cfg: Settings, reward, b1, b2) -> dict:
    """covrl.math's covariance loss + score_centering_term on the enumerated batch (weights = sampler
    probabilities) must give the closed-form centred gradient: 0 on the second-token logits."""
    import torch

    V = cfg.drift_vocab
    gen = torch.Generator().manual_seed(99)
    t1 = (0.5 * torch.randn(V, generator=gen, dtype=torch.float64)).requires_grad_()
    t2 = (0.5 * torch.randn(V, V, generator=gen, dtype=torch.float64)).requires_grad_()
    y1 = torch.arange(V).repeat_interleave(V)
    y2 = torch.arange(V).repeat(V)
    logp_full = torch.stack([torch.log_softmax(t1, 0).expand(V * V, V), torch.log_softmax(t2, 1)[y1]], dim=1)
    with torch.no_grad():
        logq_full = torch.stack([torch.log_softmax(t1 + b1, 0).expand(V * V, V),
                                 torch.log_softmax(t2 + b2, 1)[y1]], dim=1)
        q1 = logq_full[:, 0].exp()
        weight = q1[torch.arange(V * V), y1] * logq_full[:, 1].exp()[torch.arange(V * V), y2]
        adv = (reward[y1] - torch.softmax(t1 + b1, 0) @ reward)[:, None].expand(V * V, 2)
    tokens = torch.stack([y1, y2], dim=1)
    logp = logp_full.gather(-1, tokens[..., None]).squeeze(-1)
    logq = logq_full.gather(-1, tokens[..., None]).squeeze(-1)
    mask = torch.ones(V * V, 2)
    main = policy_loss("covariance", logprobs=logp, sampler_logprobs=logq, advantages=adv, mask=mask)
    centre = score_centering_term(logp_full, logq_full, adv, mask)
    per_row = (main.token_loss + centre.token_loss).double().sum(1)
    g1, g2 = torch.autograd.grad(-(weight * per_row).sum(), [t1, t2], retain_graph=True)
    g2_plain = torch.autograd.grad(-(weight * main.token_loss.double().sum(1)).sum(), [t2])[0]
    rel = float(g2.norm() / g1.norm())
    rel_plain = float(g2_plain.norm() / g1.norm())
    result.numbers["library_score_centering"] = {"second_token_grad_over_first_centred": rel,
                                                 "second_token_grad_over_first_uncentred": rel_plain}
    result.check("covrl.math covariance loss + score_centering_term, enumerated: ‖g(second-token)‖ / ‖g(first)‖",
                 {"centred": rel, "uncentred": rel_plain}, "centred ≤ 1e-5 (fp32 losses), uncentred > 1e-2",
                 rel <= 1e-5 and rel_plain > 1e-2)
    return {"centred": rel, "uncentred": rel_plain}


# ------------------------------------------------------------------------------------------------ figure


def _figure(out_dir: Path, cfg: Settings, ident, factor, drift) -> str:

    plt = pyplot()
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    sp = ident["split"]
    ax[0].plot(sp.signal.numpy(), sp.grad.numpy(), ".", ms=3)
    lim = float(sp.grad.abs().max())
    ax[0].plot([-lim, lim], [-lim, lim], color="gray", lw=0.8)
    ax[0].set_xlabel("Cov_p(A, s_i)")
    ax[0].set_ylabel("E_p[A s_i], A = R uncentred")
    ax[0].set_title(f"exact enumeration: identical (rel. gap {float((sp.grad - sp.signal).norm() / sp.grad.norm()):.1e})")
    keep = sp.cap > 0
    ax[1].loglog(sp.cap[keep].numpy(), sp.signal[keep].abs().clamp_min(1e-20).numpy(), ".", ms=3)
    c = [float(sp.cap[keep].min()), float(sp.cap[keep].max())]
    ax[1].plot(c, c, color="k", lw=1, label="cap std(A)·sqrt(F_ii)")
    ax[1].set_xlabel("cap")
    ax[1].set_ylabel("|g_i|")
    ax[1].set_title("every coordinate under its cap")
    ax[1].legend(fontsize=8)
    ex, sa = factor["exact"], factor["sampled"]
    ax[2].plot([m[0] for m in ex], label="reward-correlated (exact)")
    ax[2].plot([m[1] for m in ex], label="uncorrelated, equal Fisher (exact)")
    ax[2].plot([m[0] for m in sa], "--", label="correlated (sampled)")
    ax[2].plot([m[1] for m in sa], "--", label="uncorrelated (sampled)")
    ax[2].set_xlabel("step")
    ax[2].set_ylabel("‖Δ logits‖")
    ax[2].set_title("Fisher allows, reward decides")
    ax[2].legend(fontsize=7)
    ax[3].plot(drift["uncentred"]["second_token_move"], label="uncentred score")
    ax[3].plot(drift["score_centred"]["second_token_move"], label="score centred under the sampler")
    ax[3].set_xlabel("step (engines synced each step)")
    ax[3].set_ylabel("‖Δ second-token logits‖ (reward ignores them)")
    ax[3].set_title("drift compounds with a biased sampler")
    ax[3].legend(fontsize=8)
    return save_figure(fig, out_dir / "covariance.png", dpi=110)
