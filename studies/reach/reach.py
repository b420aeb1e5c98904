"""Reproduction `python -m studies reach` (docs/theory.md ¶2, docs/theory.md §2): a response moves only as far as it resembles what
the sampler produces.

Sections:

1. Tabular softmax (one logit per response, exact expected gradients, step η = 1): reward 1 on a rare response
   of initial probability p0. Steps until it has probability ≥ 1/2: policy gradient needs ∝ 1/p0 (T·p0 about
   constant over p0 ∈ {1e-2, 1e-3, 1e-4}), SFT on the demonstration ∝ log(1/p0).
2. The one-step bound `⟨d, g⟩ ≤ std(A)·‖d‖_F` evaluated by `reach_bound` on the tabular policy by exact
   enumeration: tight (ratio 1) with two responses, loose with many.
3. Shared structure: the same rare, best response under a reward that is linear in response features. With
   feature-based logits the common responses carry the direction of the rare one, and policy gradient reaches it
   far faster than with one logit per response.
4. A tiny transformer (briefly SFT-trained on addition, fp64) and its own samples: for every pair of six (fast: four)
   responses the realised rate is within the bound, and the predicted log-odds change η·⟨d, g⟩ matches one
   small SGD step θ ← θ + η g.
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
    addition_text,
    pretrained_tiny,
    sample_fixed,
    score_mask,
)

from covrl.diagnostics import reach_bound
from covrl.diagnostics.reach import as_sequences, select_params, sequence_logprobs

CLAIM = (
    "Per unit step of policy gradient the log-odds of two responses change by at most std(A)·‖s(y1) − s(y2)‖ in "
    "the sampler's Fisher; with one logit per response a rare response takes time ∝ 1/p0 while a demonstration "
    "takes ∝ log(1/p0); shared structure widens what policy gradient reaches."
)


@dataclass
class Settings:
    responses: int = 10
    p0s: tuple[float, ...] = (1e-2, 1e-3, 1e-4)
    feature_dim: int = 8
    feature_responses: int = 50
    feature_p0: float = 1e-3
    max_steps: int = 50_000
    lm_batch: int = 32
    lm_candidates: int = 6
    sgd_target: float = 0.01


FAST = Settings(max_steps=20_000, lm_batch=12, lm_candidates=4)
FULL = Settings()


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):


    cfg = FAST if fast else FULL
    result = start_repro("reach", CLAIM, out_dir)
    tab = _tabular_section(result, cfg)
    _bound_section(result, cfg, seed)
    feat = _feature_section(result, cfg, seed)
    lm = _transformer_section(result, cfg, seed, fast)
    result.figures.append(_figure(out_dir, cfg, tab, feat, lm))
    result.notes = (
        f"Tabular: {cfg.responses} responses, the rare one rewarded 1, the rest share 1 − p0 equally; exact "
        "expected gradients with step 1 (policy gradient ∇J = π ⊙ (r − J); SFT ∇ log π(y*) = e* − π). Features: "
        f"{cfg.feature_responses} responses with N(0, I_{cfg.feature_dim}) features, reward linear in the features "
        f"scaled to [0, 1], the best response given p0 = {cfg.feature_p0}. Transformer: a 2-layer d=64 Llama after a "
        f"short SFT on addition, in fp64; one prompt, {cfg.lm_batch} samples, A = reward − mean."
    )
    return result


# ------------------------------------------------------------------------------------------------ section 1


def _steps_to_half(theta, grad_fn, target: int, max_steps: int):
    """Gradient ascent θ += ∇ until π(target) ≥ 1/2; returns (steps, trajectory of π(target))."""
    import numpy as np

    theta = theta.copy()
    traj = []
    for step in range(max_steps):
        pi = np.exp(theta - theta.max())
        pi /= pi.sum()
        traj.append(pi[target])
        if pi[target] >= 0.5:
            return step, traj
        theta += grad_fn(pi)
    return max_steps, traj


def _tabular_init(n: int, p0: float):
    import numpy as np

    theta = np.full(n, math.log((1 - p0) / (n - 1)))
    theta[0] = math.log(p0)
    return theta


def _tabular_section(result, cfg: Settings) -> dict:
    import numpy as np

    n = cfg.responses
    r = np.zeros(n)
    r[0] = 1.0
    e = np.zeros(n)
    e[0] = 1.0
    out = {}
    for p0 in cfg.p0s:
        theta = _tabular_init(n, p0)
        t_pg, traj_pg = _steps_to_half(theta, lambda pi: pi * (r - pi @ r), 0, cfg.max_steps)
        t_sft, traj_sft = _steps_to_half(theta, lambda pi: e - pi, 0, cfg.max_steps)
        out[p0] = {"pg": t_pg, "sft": t_sft, "traj_pg": traj_pg, "traj_sft": traj_sft}
    pg_scaled = [out[p]["pg"] * p for p in cfg.p0s]
    sft_scaled = [out[p]["sft"] / math.log(1 / p) for p in cfg.p0s]
    result.numbers["tabular_steps"] = {str(p): {"pg": out[p]["pg"], "sft": out[p]["sft"]} for p in cfg.p0s}
    result.numbers["tabular_T_pg_times_p0"] = pg_scaled
    result.numbers["tabular_T_sft_over_log_inv_p0"] = sft_scaled
    spread_pg = max(pg_scaled) / min(pg_scaled)
    spread_sft = max(sft_scaled) / min(sft_scaled)
    result.check("policy gradient: T·p0 over p0 ∈ {1e-2, 1e-3, 1e-4} (max/min)", spread_pg,
                 "≤ 1.25 (time ∝ 1/p0)", spread_pg <= 1.25)
    result.check("SFT: T / log(1/p0) over the same p0 (max/min)", spread_sft, "≤ 1.25 (time ∝ log 1/p0)",
                 spread_sft <= 1.25)
    ratio = out[min(cfg.p0s)]["pg"] / out[min(cfg.p0s)]["sft"]
    result.check(f"T_PG / T_SFT at p0 = {min(cfg.p0s):g}", ratio, "≥ 100", ratio >= 100)
    return out


# ------------------------------------------------------------------------------------------------ section 2


class TabularPolicy:
    """Built lazily (torch import inside run): one logit per response, same at every position."""
    @staticmethod
    def make(theta):
        import torch
        from torch import nn

        class _Tab(nn.Module):
            def __init__(self):
                super().__init__()
                self.theta = nn.Parameter(torch.as_tensor(theta, dtype=torch.float64).clone())

            def forward(self, input_ids, attention_mask=None):
                return self.theta.expand(*input_ids.shape, -1)

        return _Tab()


def _enumeration(n: int):
    """All one-token responses after a prompt token 0: Sequences rows [0, y] for y in 0..n−1."""
    import torch

    ids = torch.stack([torch.zeros(n, dtype=torch.long), torch.arange(n)], dim=1)
    score = torch.zeros(n, 2, dtype=torch.bool)
    score[:, 1] = True
    return {"input_ids": ids, "score_mask": score}


def _bound_section(result, cfg: Settings, seed: int) -> None:
    import torch


    ratios = {}
    for n in (2, cfg.responses):
        gen = torch.Generator().manual_seed(seed + n)
        theta = torch.randn(n, generator=gen, dtype=torch.float64)
        model = TabularPolicy.make(theta)
        batch = _enumeration(n)
        probs = torch.softmax(theta, 0)
        reward = torch.zeros(n, dtype=torch.float64)
        reward[0] = 1.0
        one = lambda y: {"input_ids": torch.tensor([[0, y]]), "score_mask": torch.tensor([[False, True]])}  # noqa: E731
        rb = reach_bound(model, batch, reward, one(0), one(1), weights=probs, method="backward")
        ratios[n] = rb.metrics
    result.numbers["tabular_one_step_bound"] = {str(n): m for n, m in ratios.items()}
    r2 = ratios[2]["ratio"]
    result.check("one-step bound with two responses: rate / (std(A)·‖d‖_F)", r2, "= 1 within 1e-9",
                 abs(r2 - 1.0) <= 1e-9)
    rn = ratios[cfg.responses]["ratio"]
    result.check(f"one-step bound with {cfg.responses} responses: rate / bound", rn, "in (0, 1)", 0 < rn < 1)


# ------------------------------------------------------------------------------------------------ section 3


def _feature_section(result, cfg: Settings, seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed + 11)
    n, m = cfg.feature_responses, cfg.feature_dim
    phi = rng.standard_normal((n, m))
    u = rng.standard_normal(m)
    score = phi @ u
    r = (score - score.min()) / (score.max() - score.min())
    best = int(np.argmax(r))
    # base logits: the best response at p0, the others equal
    base = np.full(n, math.log((1 - cfg.feature_p0) / (n - 1)))
    base[best] = math.log(cfg.feature_p0)

    def tab_grad(pi):
        return pi * (r - pi @ r)

    t_tab, traj_tab = _steps_to_half(base, tab_grad, best, cfg.max_steps)

    # feature logits z = base + φ w: gradient in w is φᵀ(π ⊙ (r − J)); step 1 on w
    w = np.zeros(m)
    traj_feat = []
    t_feat = cfg.max_steps
    for step in range(cfg.max_steps):
        z = base + phi @ w
        pi = np.exp(z - z.max())
        pi /= pi.sum()
        traj_feat.append(pi[best])
        if pi[best] >= 0.5:
            t_feat = step
            break
        w += phi.T @ (pi * (r - pi @ r))
    # one-step reach of the best response over the most likely one at the start
    pi0 = np.exp(base - base.max())
    pi0 /= pi0.sum()
    ref = int(np.argmax(np.where(np.arange(n) == best, -1, pi0)))
    adv = r - pi0 @ r
    std_a = math.sqrt(pi0 @ adv ** 2)

    def reach(jac):  # jac [n, P]: scores s(y) = jac[y] − π jac
        s = jac - pi0 @ jac
        d = s[best] - s[ref]
        x = s @ d
        return float(pi0 @ (adv * x)), std_a * math.sqrt(float(pi0 @ (x - pi0 @ x) ** 2))

    rate_tab, bound_tab = reach(np.eye(n))
    rate_feat, bound_feat = reach(phi)
    capped = t_tab >= cfg.max_steps
    result.numbers["features"] = {"steps_tabular": t_tab, "tabular_capped_at_max_steps": capped,
                                  "steps_features": t_feat, "best_response": best,
                                  "one_step_rate_tabular": rate_tab, "one_step_bound_tabular": bound_tab,
                                  "one_step_rate_features": rate_feat, "one_step_bound_features": bound_feat}
    result.check(f"shared features: steps to make the best response likely (p0 = {cfg.feature_p0:g}), features / "
                 "tabular" + (f" (tabular did not get there in {cfg.max_steps} steps: an upper bound)" if capped else ""),
                 t_feat / t_tab, "≤ 0.1", t_feat <= 0.1 * t_tab)
    result.check("shared features: one-step log-odds rate of the rare best response, features / tabular",
                 rate_feat / rate_tab, "≥ 10", rate_feat >= 10 * rate_tab)
    return {"traj_tab": traj_tab, "traj_feat": traj_feat, "t_tab": t_tab, "t_feat": t_feat}


# ------------------------------------------------------------------------------------------------ section 4


def _transformer_section(result, cfg: Settings, seed: int, fast: bool) -> dict:
    import itertools

    import torch


    model, tok, _ = pretrained_tiny(PRETRAIN_STEPS[fast], seed=seed, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed * 1000 + 17)
    pairs, prompt = addition_prompts(tok, 1, gen)
    prompts = prompt.expand(cfg.lm_batch, -1)
    ids, _ = sample_fixed(model, prompts, ANSWER_LEN, gen)
    reward = addition_reward(tok, ids, pairs * cfg.lm_batch)
    adv = reward - reward.mean()
    P = prompts.shape[1]
    batch = {"input_ids": ids, "score_mask": score_mask(len(ids), ids.shape[1], P)}

    # candidate responses: half sampled, half built (the right answer, a wrong one, a format break)
    a, b = pairs[0]
    built = [addition_text(a, b)[1], f"{(a + b + 37) % 1000:03d}\n", "+=+="][: cfg.lm_candidates // 2]
    cands = [ids[i, P:] for i in range(cfg.lm_candidates - len(built))]
    cands += [torch.tensor(tok.encode(t, add_special_tokens=False)) for t in built]
    seqs = []
    for c in cands:
        full = torch.cat([prompt[0], c])
        sm = torch.zeros(full.numel(), dtype=torch.bool)
        sm[P:] = True
        seqs.append((full, sm))

    rows = []
    for i, j in itertools.combinations(range(len(seqs)), 2):
        rb = reach_bound(model, batch, adv, seqs[i], seqs[j])
        rows.append({"pair": (i, j), **rb.metrics, "method": rb.method})

    # one small SGD step on the batch's policy-gradient surrogate, then the measured log-odds changes
    params = [p for _, p in select_params(model)]
    logp = sequence_logprobs(model, _rows_of(batch))
    grads = torch.autograd.grad((adv / len(adv) * logp).sum(), params)
    max_rate = max(abs(r["rate"]) for r in rows)
    eta = cfg.sgd_target / max_rate
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.add_(g, alpha=eta)
    errors = []
    for r in rows:
        i, j = r["pair"]
        after = float((sequence_logprobs(model, _rows_of(seqs[i])) - sequence_logprobs(model, _rows_of(seqs[j]))).detach())
        r["predicted_change"] = eta * r["rate"]
        r["actual_change"] = after - r["logodds"]
        if abs(r["predicted_change"]) >= 0.1 * cfg.sgd_target:
            errors.append(abs(r["actual_change"] - r["predicted_change"]) / abs(r["predicted_change"]))
    worst = max(abs(r["ratio"]) for r in rows)
    result.numbers["tiny_transformer_pairs"] = [{k: (list(v) if k == "pair" else v) for k, v in r.items()} for r in rows]
    result.numbers["tiny_transformer_sgd_eta"] = eta
    result.check(f"tiny transformer: |rate| / bound over all {len(rows)} pairs (max)", worst, "≤ 1",
                 worst <= 1.0 + 1e-9)
    result.check("tiny transformer: |actual − predicted| / |predicted| log-odds change after one SGD step (max over "
                 "pairs with |predicted| ≥ 10% of the largest)", max(errors), "≤ 0.05", max(errors) <= 0.05)
    return {"rows": rows}


def _rows_of(x):

    return as_sequences(x)


# ------------------------------------------------------------------------------------------------ figure


def _figure(out_dir: Path, cfg: Settings, tab, feat, lm) -> str:

    plt = pyplot()
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    for p0 in cfg.p0s:
        ax[0].semilogx(range(1, len(tab[p0]["traj_pg"]) + 1), tab[p0]["traj_pg"], label=f"PG p0={p0:g}")
        ax[0].semilogx(range(1, len(tab[p0]["traj_sft"]) + 1), tab[p0]["traj_sft"], "--", label=f"SFT p0={p0:g}")
    ax[0].axhline(0.5, color="gray", ls=":")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("π(rewarded response)")
    ax[0].set_title("tabular softmax: time to make it likely")
    ax[0].legend(fontsize=7)
    p0s = list(cfg.p0s)
    ax[1].loglog(p0s, [tab[p]["pg"] for p in p0s], "o-", label="PG steps")
    ax[1].loglog(p0s, [tab[p]["sft"] for p in p0s], "s-", label="SFT steps")
    ax[1].loglog(p0s, [1 / p for p in p0s], ":", color="gray", label="1/p0")
    ax[1].set_xlabel("p0")
    ax[1].set_ylabel("steps to π ≥ 1/2")
    ax[1].legend(fontsize=8)
    ax[1].set_title("PG ∝ 1/p0, SFT ∝ log(1/p0)")
    ax[2].semilogx(range(1, len(feat["traj_tab"]) + 1), feat["traj_tab"], label="one logit per response")
    ax[2].semilogx(range(1, len(feat["traj_feat"]) + 1), feat["traj_feat"], label="shared features")
    ax[2].set_xlabel("step")
    ax[2].set_ylabel("π(best response)")
    ax[2].set_title(f"shared structure widens reach (p0={cfg.feature_p0:g})")
    ax[2].legend(fontsize=8)
    rows = lm["rows"]
    bounds = [r["bound"] for r in rows]
    ax[3].scatter(bounds, [abs(r["rate"]) for r in rows], label="|rate| per pair")
    lim = max(bounds) * 1.1
    ax[3].plot([0, lim], [0, lim], color="gray", ls=":", label="bound")
    ax[3].set_xlabel("std(A)·‖d‖_F")
    ax[3].set_ylabel("|⟨d, g⟩|")
    ax[3].set_title("tiny transformer: every pair under the bound")
    ax[3].legend(fontsize=8)
    return save_figure(fig, out_dir / "reach.png", dpi=110)
