"""Reproduction `python -m studies tangent` (docs/theory.md ¶8, docs/theory.md §5): gain = tangent + remainder, measured from the sampler.

Sections (each adds criteria and numbers to one ReproResult):

1. Exact enumeration on small autoregressive models (V = 3, 4; T ≤ 8): for random (sampler, trainer) pairs
   J(p) − J(q) = tangent + remainder to machine precision, |remainder| ≤ R_max·KL_seq(q‖p) on every pair, and
   the classical horizon-dependent trust-region bound (finite-horizon TRPO / Kakade–Langford form,
   ε·T(T−1)·KL_max) compared with R_max·KL_seq at T = 8.
2. Monotone improvement: with the sampler q fixed, a few gradient steps on M(p) = tangent(p) − R_max·KL_seq(q‖p)
   (exact enumeration), then sync q ← p. J(p) ≥ J(q) + M(p) says J cannot decrease whenever M(p) ≥ 0 at the
   end of the inner loop; the same step size on the tangent alone (no penalty) is run for comparison.
3. Drift vs IS vs masking on the tiny transformer (covrl's Trainer and HF sampler) with an injected per-token
   sampler bias: the sampler draws from q = softmax(z + b) (b a fixed random logit bias, N(0, σ²) per
   vocabulary entry) while the trainer has p = softmax(z). Arms: the covariance loss alone, + score centring,
   + token TIS, + sequence masking with the geometric criterion. The drift of each arm is measured exactly in
   expectation over the drawn token (see `arm_drift`).
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from studies.common import pyplot, save_figure, start_repro
from studies.stats import sorted_median

from covrl.config import load_preset
from covrl.diagnostics.tangent import (
    all_sequences,
    exact_from_tables,
    exact_tangent_remainder,
    perturb_tables,
    random_tables,
    tangent_remainder,
    token_logprobs_from_tables,
    trust_region_bounds,
)
from covrl.experiment import DRIVEN, ONE_DIGIT_ADDITION, Arm, ArmRunner, Step, pick
from covrl.math import compute_advantages, rollout_correction
from covrl.rollout import SamplerConfig, build_sampler
from covrl.train import evaluate

CLAIM = (
    "Measured from the sampler, the gain of a policy update is a tangent (a covariance loss whose gradient needs "
    "only the trainer) plus a remainder bounded by R_max·KL_seq(q‖p), with no horizon factor."
)

# A "decrease" of J must exceed floating-point noise of the fp64 enumeration.
DECREASE_TOLERANCE = 1e-12


@dataclass
class Settings:
    vocab_sizes: tuple[int, ...]
    horizons: tuple[int, ...]
    pairs_per_horizon: int
    scaling_horizon: int
    mono_rounds: int
    mono_inner_steps: int
    mono_lr: float
    tabular_seeds: int
    drift_train_steps: int  # 0: measure the drift of every arm on one batch only (no RL training)
    drift_seeds: int


FAST = Settings(vocab_sizes=(3,), horizons=(1, 2, 4, 8), pairs_per_horizon=100, scaling_horizon=6,
                mono_rounds=8, mono_inner_steps=10, mono_lr=3.0, tabular_seeds=1,
                drift_train_steps=0, drift_seeds=1)
FULL = Settings(vocab_sizes=(3, 4), horizons=(1, 2, 3, 4, 5, 6, 7, 8), pairs_per_horizon=200, scaling_horizon=8,
                mono_rounds=25, mono_inner_steps=10, mono_lr=3.0, tabular_seeds=8,
                drift_train_steps=30, drift_seeds=2)


def run(out_dir: Path, *, fast: bool = False, seed: int = 0):
    cfg = FAST if fast else FULL
    result = start_repro("tangent", CLAIM, out_dir)
    t0 = time.perf_counter()
    pairs = _random_pairs_section(result, cfg, seed)
    scaling = _second_order_section(result, cfg, seed)
    mono = _monotone_section(result, cfg, seed)
    result.numbers["seconds_exact_sections"] = time.perf_counter() - t0
    result.figures.append(_figure(out_dir, pairs, scaling, mono))
    t0 = time.perf_counter()
    drift = _drift_section(result, cfg, seed)
    result.numbers["seconds_drift_section"] = time.perf_counter() - t0
    result.figures.append(_drift_figure(out_dir, drift))
    result.notes = _notes(cfg)
    return result


# ------------------------------------------------------------------------------------------------ section 1


def _random_pair(vocab: int, horizon: int, gen):
    """A random (sampler, trainer, reward) triple of a random kind; returns tables, rewards and a description."""
    def uniform(lo, hi):
        return lo + (hi - lo) * float(torch.rand((), generator=gen, dtype=torch.float64))

    scale = math.exp(uniform(math.log(0.3), math.log(3.0)))
    eps = math.exp(uniform(math.log(1e-3), math.log(2.0)))
    sampler = random_tables(vocab, horizon, scale=scale, generator=gen)
    where = "all" if float(torch.rand((), generator=gen)) < 0.7 else int(torch.randint(horizon, (), generator=gen))
    if where == "all":
        trainer = perturb_tables(sampler, eps, generator=gen)
    else:  # perturb one depth only: then max and expected per-step KL are as close as they get
        direction = [torch.zeros_like(t) for t in sampler]
        direction[where] = torch.randn(sampler[where].shape, generator=gen, dtype=sampler[where].dtype)
        trainer = perturb_tables(sampler, eps, direction=direction)
    kind = ["uniform", "binary", "count"][int(torch.randint(3, (), generator=gen))]
    n = vocab**horizon
    if kind == "uniform":
        rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    elif kind == "binary":
        rewards = (torch.rand(n, generator=gen, dtype=torch.float64) < uniform(0.05, 0.5)).double()
    else:
        rewards = (all_sequences(vocab, horizon) == 0).double().mean(dim=1)
    return sampler, trainer, rewards, {"scale": scale, "eps": eps, "perturbed": where, "reward": kind}


def _random_pairs_section(result, cfg: Settings, seed: int) -> dict:

    gen = torch.Generator().manual_seed(1000 + seed)
    rows = []
    for vocab in cfg.vocab_sizes:
        for horizon in cfg.horizons:
            for _ in range(cfg.pairs_per_horizon):
                sampler, trainer, rewards, info = _random_pair(vocab, horizon, gen)
                ex = exact_from_tables(trainer, sampler, rewards).metrics
                tr = trust_region_bounds(trainer, sampler, rewards).metrics
                rows.append({"V": vocab, "T": horizon, **info, **ex,
                             **{k: tr[k] for k in ("surrogate_error", "bound_trpo_tv", "bound_trpo_kl",
                                                   "bound_cpo_tv", "kl_max", "tv_max", "adv_max")}})

    def rel_identity(r):
        return abs(r["identity_error"]) / max(abs(r["j_trainer"]), abs(r["j_sampler"]), 1e-300)

    identity_max = max(abs(r["identity_error"]) for r in rows)
    identity_rel_max = max(rel_identity(r) for r in rows)
    bound_ratios = [abs(r["remainder"]) / r["bound"] for r in rows if r["bound"] > 0]
    violations = sum(abs(r["remainder"]) > r["bound"] * (1 + 1e-9) + 1e-15 for r in rows)
    classical_violations = sum(abs(r["surrogate_error"]) > r[k] * (1 + 1e-9) + 1e-15
                               for r in rows for k in ("bound_trpo_tv", "bound_trpo_kl", "bound_cpo_tv"))
    per_t: dict[str, dict] = {}
    for vocab in cfg.vocab_sizes:
        for horizon in cfg.horizons:
            sel = [r for r in rows if r["V"] == vocab and r["T"] == horizon and r["bound"] > 0]
            entry = {"pairs": sum(1 for r in rows if r["V"] == vocab and r["T"] == horizon),
                     "remainder_over_bound_max": max(abs(r["remainder"]) / r["bound"] for r in sel),
                     "violations": sum(abs(r["remainder"]) > r["bound"] * (1 + 1e-9) + 1e-15 for r in sel)}
            for key in ("bound_trpo_kl", "bound_trpo_tv", "bound_cpo_tv"):
                ratios = sorted(r[key] / r["bound"] for r in sel)
                entry[f"{key}_over_ours_median"] = sorted_median(ratios)
                entry[f"{key}_over_ours_min"] = ratios[0]
                entry[f"{key}_over_ours_frac_ge_10"] = sum(x >= 10 for x in ratios) / len(ratios)
            per_t[f"V{vocab}_T{horizon}"] = entry

    n_pairs_min = min(v["pairs"] for v in per_t.values())
    result.check("gain identity J(p)−J(q) = tangent + remainder (max relative error)", identity_rel_max,
                 "≤ 1e-12 on every pair", identity_rel_max <= 1e-12)
    result.check("|remainder| ≤ R_max·KL_seq: violations / pairs",
                 f"{violations} / {len(rows)} (≥ {n_pairs_min} pairs per (V, T))",
                 "0 violations, ≥ 100 pairs per T", violations == 0 and n_pairs_min >= 100)
    t8 = [v for k, v in per_t.items() if k.endswith("_T8")]
    med8 = min(v["bound_trpo_kl_over_ours_median"] for v in t8)
    result.check("classical O(T²) bound ε·T(T−1)·KL_max over R_max·KL_seq at T = 8 (median over pairs)", med8,
                 "≥ 10", med8 >= 10)
    result.numbers.update({
        "pairs_total": len(rows),
        "identity_error_abs_max": identity_max,
        "identity_error_rel_max": identity_rel_max,
        "remainder_over_bound_max": max(bound_ratios),
        "remainder_over_bound_median": sorted_median(sorted(bound_ratios)),
        "classical_bound_violations": classical_violations,
        "per_V_T": per_t,
    })
    return {"rows": rows, "per_t": per_t}


def _second_order_section(result, cfg: Settings, seed: int) -> dict:
    """p = q + ε·d along one direction d: tangent ∝ ε, remainder and KL_seq ∝ ε² (fitted log-log slopes)."""
    gen = torch.Generator().manual_seed(2000 + seed)
    horizon = cfg.scaling_horizon
    sampler = random_tables(3, horizon, generator=gen)
    direction = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in sampler]
    rewards = torch.rand(3**horizon, generator=gen, dtype=torch.float64)
    eps = [10 ** (-3 + 0.25 * k) for k in range(13)]  # 1e-3 .. 1
    rows = [exact_from_tables(perturb_tables(sampler, e, direction=direction), sampler, rewards).metrics for e in eps]
    small = [i for i, e in enumerate(eps) if e <= 0.03]

    def slope(key):
        xs = [math.log(eps[i]) for i in small]
        ys = [math.log(abs(rows[i][key])) for i in small]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)

    slopes = {k: slope(k) for k in ("tangent", "remainder", "kl_seq")}
    result.check("remainder is second order: log-log slope of |remainder| vs ε (ε ≤ 0.03)", slopes["remainder"],
                 "in [1.9, 2.1]", 1.9 <= slopes["remainder"] <= 2.1)
    result.numbers["scaling_slopes"] = slopes
    result.numbers["scaling_horizon"] = horizon
    return {"eps": eps, "rows": rows, "slopes": slopes}


# ------------------------------------------------------------------------------------------------ section 2


def _positionwise_problem(horizon: int = 8, vocab: int = 3, target: int = 4):
    """Tokens drawn independently per position (logits θ[t], shared across prefixes: a tiny parametric model);
    reward 1 when exactly `target` of the T tokens are token 0. First-order ascent overshoots (all zeros)."""
    seqs = all_sequences(vocab, horizon)
    rewards = ((seqs == 0).sum(dim=1) == target).double()
    positions = torch.arange(horizon)[None, :].expand(len(seqs), horizon)

    def token_logprobs(theta):
        return torch.log_softmax(theta, dim=-1)[positions, seqs]

    theta0 = torch.zeros(horizon, vocab, dtype=torch.float64)
    return theta0, token_logprobs, rewards


def _tabular_problem(seed: int, horizon: int = 6, vocab: int = 3):
    """Per-prefix logits (tabular), random sampler, uniform random rewards."""
    gen = torch.Generator().manual_seed(3000 + seed)
    tables = random_tables(vocab, horizon, generator=gen)
    rewards = torch.rand(vocab**horizon, generator=gen, dtype=torch.float64)
    seqs = all_sequences(vocab, horizon)
    sizes = [t.numel() for t in tables]
    shapes = [t.shape for t in tables]
    theta0 = torch.cat([t.reshape(-1) for t in tables])

    def token_logprobs(theta):
        parts = torch.split(theta, sizes)
        return token_logprobs_from_tables([p.reshape(s) for p, s in zip(parts, shapes)], seqs)

    return theta0, token_logprobs, rewards


def mm_rounds(theta0, token_logprobs, rewards, *, penalty: bool, rounds: int, inner_steps: int, lr: float) -> dict:
    """Rounds of: fix q = p_θ; `inner_steps` SGD steps (step size `lr`) on M(θ) = tangent − R_max·KL_seq
    (penalty) or on the tangent alone; sync. Exact enumeration throughout. Returns J per round and M at the
    end of each inner loop."""
    theta = theta0.clone()
    j_values, surrogate_end = [], []
    for _ in range(rounds):
        sampler_lp = token_logprobs(theta).detach()
        param = theta.clone().requires_grad_(True)
        opt = torch.optim.SGD([param], lr=lr)
        for step in range(inner_steps + 1):
            ex = exact_tangent_remainder(token_logprobs(param), sampler_lp, rewards)
            # R_max is a property of q (fixed during the inner loop), so it carries no gradient
            objective = ex.tangent - ex.r_max.detach() * ex.kl_seq if penalty else ex.tangent
            if step == inner_steps:
                break
            opt.zero_grad()
            (-objective).backward()
            opt.step()
        j_values.append(float(ex.j_sampler))
        surrogate_end.append(float((ex.tangent - ex.r_max * ex.kl_seq).detach()))
        theta = param.detach()
    final = exact_tangent_remainder(token_logprobs(theta).detach(), token_logprobs(theta).detach(), rewards)
    j_values.append(float(final.j_trainer))
    deltas = [b - a for a, b in zip(j_values, j_values[1:])]
    return {"J": j_values, "delta_min": min(deltas), "decreases": sum(d < -DECREASE_TOLERANCE for d in deltas),
            "penalised_surrogate_end": surrogate_end}


def _monotone_section(result, cfg: Settings, seed: int) -> dict:
    kw = {"rounds": cfg.mono_rounds, "inner_steps": cfg.mono_inner_steps, "lr": cfg.mono_lr}
    theta0, token_logprobs, rewards = _positionwise_problem()
    pen = mm_rounds(theta0, token_logprobs, rewards, penalty=True, **kw)
    nopen = mm_rounds(theta0, token_logprobs, rewards, penalty=False, **kw)
    tab = {"penalised_decreases": 0, "tangent_only_decreases": 0, "penalised_surrogate_min": float("inf"),
           "penalised_J_final": [], "tangent_only_J_final": [], "J_initial": []}
    tab_curves = None
    for s in range(cfg.tabular_seeds):
        t_theta0, t_lp, t_rewards = _tabular_problem(seed * 100 + s)
        a = mm_rounds(t_theta0, t_lp, t_rewards, penalty=True, **kw)
        b = mm_rounds(t_theta0, t_lp, t_rewards, penalty=False, **kw)
        tab["penalised_decreases"] += a["decreases"]
        tab["tangent_only_decreases"] += b["decreases"]
        tab["penalised_surrogate_min"] = min(tab["penalised_surrogate_min"], min(a["penalised_surrogate_end"]))
        tab["J_initial"].append(a["J"][0])
        tab["penalised_J_final"].append(a["J"][-1])
        tab["tangent_only_J_final"].append(b["J"][-1])
        if tab_curves is None:
            tab_curves = (a["J"], b["J"])
    surrogate_min = min(pen["penalised_surrogate_end"])
    result.check(
        "monotone: J never decreases when maximising tangent − R_max·KL_seq, then syncing (position-wise model; "
        "decreases, min ΔJ, min end-of-loop surrogate)",
        {"decreases": pen["decreases"], "delta_J_min": pen["delta_min"], "surrogate_min": surrogate_min},
        "0 decreases (ΔJ ≥ −1e-12)", pen["decreases"] == 0)
    result.check(
        "same step size on the tangent alone decreases J at least once (position-wise model)",
        {"decreases": nopen["decreases"], "delta_J_min": nopen["delta_min"]},
        "≥ 1 decrease", nopen["decreases"] >= 1)
    result.check(
        "monotone with the penalty on random tabular problems (decreases over all seeds and rounds)",
        tab["penalised_decreases"], "0", tab["penalised_decreases"] == 0)
    result.numbers["monotone"] = {
        "settings": {**kw, "optimizer": "SGD", "problem": "V=3, T=8, position-wise logits, R = 1{#token0 == 4}"},
        "penalised_J": pen["J"], "tangent_only_J": nopen["J"],
        "penalised_surrogate_end": pen["penalised_surrogate_end"],
        "J_max_possible": math.comb(8, 4) * 0.5**8,
        "tabular_random": {**tab, "problems": cfg.tabular_seeds, "V": 3, "T": 6},
    }
    return {"pen": pen, "nopen": nopen, "tab_curves": tab_curves}


# ------------------------------------------------------------------------------------------------ section 3

DRIFT_BIAS_SIGMA = 1.0  # std of the sampler's fixed logit bias b (per vocabulary entry)
CENTRING_TOPK = 4  # sampler top-k returned for score centring
TIS_THRESHOLD = 2.0  # token IS truncation C
GEOMETRIC_BAND = 1.25  # sequence kept iff exp(mean_t lr_t) ∈ (1/1.25, 1.25)

# arm name -> dotted overrides on top of the tiny base config (each arm = covariance loss + one option)
ARMS: dict[str, dict] = {
    "covariance": {},
    "+score_centring": {"algorithm.score_centering": True, "sampler.return_topk": CENTRING_TOPK},
    "+token_tis": {"correction.is_level": "token", "correction.is_threshold": TIS_THRESHOLD},
    "+seq_mask_geometric": {"correction.rs": ["seq_mean_k1"], "correction.rs_threshold": [GEOMETRIC_BAND]},
}


def tiny_arm_config(arm: str, *, seed: int, steps: int):
    """The tiny preset on one-digit addition with the covariance loss on dr_grpo advantages A = R − group mean
    (exactly the tangent's gradient), plus the arm's option. The sampler keeps its own weight copy
    (share_weights=never) so that a bias can be attached to it."""
    return load_preset("tiny", {
        **ONE_DIGIT_ADDITION, **DRIVEN, "run.name": arm, "run.seed": seed, "sampler.share_weights": "never",
        "sft_warmup.steps": 60, "algorithm.advantage": "dr_grpo", "optim.lr": 1.0e-3, "loop.steps": max(1, steps),
        **ARMS[arm],
    })


def biased_sampler_builder(bias):
    """A `build_sampler_fn` for `prepare_run`: the configured sampler with `bias` added to its output logits
    (a forward hook on its own copy's output layer), so q = softmax((z + b)/τ) while the trainer has
    p = softmax(z/τ). The hook survives weight syncs (they load state dicts into the same modules)."""
    def build(cfg, model, tokenizer):
        if cfg.share_weights != "never":
            raise ValueError("a biased sampler needs sampler.share_weights='never' (its own weight copy)")
        sampler = build_sampler(cfg, model, tokenizer)
        sampler.module.get_output_embeddings().register_forward_hook(
            lambda module, inputs, output: output + bias.to(device=output.device, dtype=output.dtype))
        return sampler

    return build


def _response_logits(model, batch):
    """Trainer logits [B, T, V] (fp32, with grad) that predict the response tokens; same inputs and position ids
    as the Trainer's forward."""
    t = batch.response_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    attn = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False)
    return out.logits[:, -(t + 1):-1].float()


def expected_score_shift(p, q, *, centring_topk: int | None = None, tis_threshold: float | None = None):
    """u = E_{y∼q}[w(y)(e_y − p)] − Σ_{v∈H} c_v(e_v − p): the expected logit-space score of one token under
    the sampler for the covariance loss (w = 1), token TIS (w = min(p_y/q_y, C)) or score centring (top-k H of q,
    c_v = q_v − ρ_tail·p_v, docs/theory.md §4). p, q: [..., V] probabilities. Closed forms:
        covariance: q − p;   TIS: m − (Σ m)·p with m = min(p, C·q);   centring: 0 on H, q_v − ρ_tail·p_v off H.
    """
    if centring_topk is not None and tis_threshold is not None:
        raise ValueError("expected_score_shift: give centring_topk or tis_threshold, not both")
    if centring_topk is not None:
        in_h = torch.zeros_like(q, dtype=torch.bool).scatter(-1, q.topk(centring_topk, dim=-1).indices, True)
        tail_q = (1 - (q * in_h).sum(-1)).clamp_min(1e-6)
        tail_p = (1 - (p * in_h).sum(-1)).clamp_min(1e-6)
        return torch.where(in_h, torch.zeros_like(q), q - (tail_q / tail_p)[..., None] * p)
    if tis_threshold is not None:
        m = torch.minimum(p, tis_threshold * q)
        return m - m.sum(-1, keepdim=True) * p
    return q - p


def arm_drift(model, batch, bias, configs: dict) -> dict:
    """Drift of each arm's gradient on `batch` (temperature 1, no top-k/top-p in the sampler).

    For token t with context c_t, p_t = softmax(z_t) (trainer), q_t = softmax(z_t + b) (sampler). The logit-space
    score of the drawn token is e_y − p_t; the arm's estimator weights it by w(y) and (centring) subtracts
    Σ_{v∈H} c_v (e_v − p_t). Its expectation over y ∼ q_t is the per-token mean shift u_t (zero on-policy):
        covariance:     u = q − p
        score centring: u = 0 on the sampler's top-k H, q_v − ρ_tail·p_v off H  (ρ_tail = tail_q / tail_p)
        token TIS:      u = m − (Σ m)·p,  m = min(p, C·q)
        seq. masking:   u = keep_b·(q − p)  (keep from the arm's rejection criterion)
    drift_logit = sqrt(mean_t A_t²‖u_t‖²) and drift_norm = ‖∇_θ mean_t A_t⟨u_t, z_t⟩‖ (u detached): the
    parameter-space size of the drift part A_t·E_{q_t}[score] of the token-mean gradient, with A = dr_grpo.
    Also returns the kept-set KL for masking arms and `sampler_check` = max |log q_t(y_t) − sampler log-prob|.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    mask = batch.response_mask.float()
    z = _response_logits(model, batch)
    with torch.no_grad():
        logp_all = torch.log_softmax(z.detach(), dim=-1)
        logq_all = torch.log_softmax(z.detach() + bias, dim=-1)
        p, q = logp_all.exp(), logq_all.exp()
        index = batch.response_ids[..., None]
        lp = logp_all.gather(-1, index).squeeze(-1) * mask
        lq = logq_all.gather(-1, index).squeeze(-1) * mask
        sampler_check = float(((lq - batch.sampler_logprobs) * mask).abs().max())
        rewards = batch.rewards.float()
    out: dict = {"sampler_check": sampler_check}
    for i, (arm, cfg) in enumerate(configs.items()):
        with torch.no_grad():
            adv = compute_advantages(cfg.algorithm.advantage, rewards=rewards, mask=mask,
                                     group_ids=batch.group_ids).advantages
            u = expected_score_shift(
                p, q, centring_topk=int(cfg.sampler.return_topk) if cfg.algorithm.score_centering else None,
                tis_threshold=float(cfg.correction.is_threshold) if cfg.correction.is_level == "token" else None)
            entry: dict = {}
            if cfg.correction.rs:
                keep = rollout_correction(lp, batch.sampler_logprobs.float(), mask, cfg.correction).keep
                u = u * keep[..., None]
                kept_rows = keep.amax(dim=1) > 0
                everything = tangent_remainder(lp, batch.sampler_logprobs, rewards, mask, group_ids=batch.group_ids)
                entry.update({"kept_fraction": float(kept_rows.float().mean()),
                              "kl_seq_all": everything.metrics["kl_seq"],
                              "kl_seq_kept": float(everything.seq_kl[kept_rows].mean()) if kept_rows.any() else 0.0,
                              "bound_all": everything.metrics["bound"],
                              "bound_kept": everything.metrics["r_max"] * (
                                  float(everything.seq_kl[kept_rows].mean()) if kept_rows.any() else 0.0)})
            weight = mask * adv
            entry["drift_logit"] = float(((weight**2 * (u**2).sum(-1)).sum() / mask.sum()).sqrt())
        objective = (weight * (u * z).sum(-1)).sum() / mask.sum()
        grads = torch.autograd.grad(objective, params, retain_graph=i < len(configs) - 1, allow_unused=True)
        entry["drift_norm"] = float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)))
        out[arm] = entry
    return out


_TRAIN_KEYS = ("reward/mean", "mismatch/k3", "kl_seq", "tangent", "remainder", "bound", "grad_norm", "entropy",
               "correction/rejected_frac/seq_mean_k1", "correction/is_changed_frac", "skipped")


def _train_arm(arm: str, *, seed: int, steps: int, bias, run_root: Path) -> dict:
    """`steps` RL steps of covrl's Trainer on the tiny task with the biased sampler; before each update the
    drift of every arm is measured on the step's batch (same weights as the sampler)."""
    cfg = tiny_arm_config(arm, seed=seed, steps=steps)
    configs = {name: tiny_arm_config(name, seed=seed, steps=steps) for name in ARMS}
    with ArmRunner(Arm(cfg, run_root / f"{arm}-seed{seed}", build_sampler_fn=biased_sampler_builder(bias))) as runner:
        def drift_of_every_arm(step: int, batch) -> dict:
            return {"drift": arm_drift(runner.run.model, batch, bias, configs)}

        def record(step: Step) -> dict:
            return {"drift": step.extra["drift"], **pick(step.metrics, _TRAIN_KEYS)}

        records = runner.drive(steps, on_batch=drift_of_every_arm, record=record, log=False)
        # held-out accuracy of the trainer's own (unbiased) policy, greedy
        run = runner.run
        plain = build_sampler(SamplerConfig(max_new_tokens=cfg.sampler.max_new_tokens, share_weights="always"),
                              run.model, run.tokenizer)
        with torch.no_grad():
            held_out = evaluate(plain, run.task, run.tokenizer, run.task.eval[: cfg.eval.max_prompts or 50],
                                seed=seed + 17, greedy=True, sampled=False)
    return {"records": records, "eval_greedy_unbiased": float(held_out["greedy"]["accuracy"])}


def _drift_section(result, cfg: Settings, seed: int) -> dict:

    bias = DRIFT_BIAS_SIGMA * torch.randn(100, generator=torch.Generator().manual_seed(4000 + seed))
    arms = list(ARMS)
    base = arms[0]
    with tempfile.TemporaryDirectory(prefix="covrl-tangent-") as tmp:
        if cfg.drift_train_steps == 0:  # one batch from the SFT-warmed tiny model, every arm's drift on it
            run_cfg = tiny_arm_config(base, seed=seed, steps=1)
            configs = {name: tiny_arm_config(name, seed=seed, steps=1) for name in arms}
            one_batch = Arm(run_cfg, Path(tmp) / "one-batch", build_sampler_fn=biased_sampler_builder(bias))
            with ArmRunner(one_batch) as runner:
                batch, _ = runner.next_batch()
                drift = arm_drift(runner.run.model, batch, bias, configs)
            runs = {arm: [{"records": [{"drift": drift, "reward/mean": float(batch.rewards.mean())}]}]
                    for arm in arms}
        else:
            runs = {arm: [_train_arm(arm, seed=seed + s, steps=cfg.drift_train_steps, bias=bias,
                                     run_root=Path(tmp)) for s in range(cfg.drift_seeds)] for arm in arms}

    def ratio(arm):  # own-arm drift over the covariance arm's drift on the same batch, averaged over steps
        values = [r["drift"][arm]["drift_norm"] / r["drift"][base]["drift_norm"]
                  for run in runs[arm] for r in run["records"] if r["drift"][base]["drift_norm"] > 0]
        return sum(values) / len(values) if values else float("nan")

    ratios = {arm: ratio(arm) for arm in arms}
    mask_arm = "+seq_mask_geometric"
    mask_recs = [r["drift"][mask_arm] for run in runs[mask_arm] for r in run["records"]]
    kl_all = sum(e["kl_seq_all"] for e in mask_recs) / len(mask_recs)
    kl_kept = sum(e["kl_seq_kept"] for e in mask_recs) / len(mask_recs)
    kept = sum(e["kept_fraction"] for e in mask_recs) / len(mask_recs)
    checks = max(r["drift"]["sampler_check"] for arm in arms for run in runs[arm] for r in run["records"])
    where = "one batch" if cfg.drift_train_steps == 0 else f"mean over {cfg.drift_train_steps} steps × {cfg.drift_seeds} seeds"
    result.check(f"drift removed by score centring (top-{CENTRING_TOPK}): drift norm / covariance arm's ({where})",
                 ratios["+score_centring"], "≤ 0.25", ratios["+score_centring"] <= 0.25)
    result.check(f"drift removed by token TIS (C = {TIS_THRESHOLD}): drift norm / covariance arm's ({where})",
                 ratios["+token_tis"], "≤ 0.5", ratios["+token_tis"] <= 0.5)
    result.check(f"sequence masking (geometric band {GEOMETRIC_BAND}) lowers KL_seq on the kept set ({where}; "
                 "kept fraction, KL_seq all → kept)", {"kept_fraction": kept, "kl_seq_all": kl_all,
                                                       "kl_seq_kept": kl_kept},
                 "kl_seq_kept < kl_seq_all, 0 < kept < 1", kl_kept < kl_all and 0 < kept < 1)
    numbers = {"bias_sigma": DRIFT_BIAS_SIGMA, "centring_topk": CENTRING_TOPK, "tis_threshold": TIS_THRESHOLD,
               "geometric_band": GEOMETRIC_BAND, "drift_ratio_vs_covariance": ratios,
               "sequence_masking_drift_ratio_note": "masking does not centre the score; its ratio is reported only",
               "sampler_logprob_check_max_abs": checks, "train_steps": cfg.drift_train_steps,
               "seeds": cfg.drift_seeds}
    if cfg.drift_train_steps:
        final = {}
        for arm in arms:
            tails = [run["records"][-5:] for run in runs[arm]]

            def tail_mean(key, tails=tails):
                vals = [r[key] for tail in tails for r in tail if key in r]
                return sum(vals) / len(vals) if vals else None

            final[arm] = {
                "reward_last5": tail_mean("reward/mean"), "mismatch_k3_last5": tail_mean("mismatch/k3"),
                "kl_seq_last5": tail_mean("kl_seq"), "grad_norm_last5": tail_mean("grad_norm"),
                "drift_norm_last5": sum(r["drift"][arm]["drift_norm"] for t in tails for r in t) / sum(map(len, tails)),
                "rejected_frac_last5": tail_mean("correction/rejected_frac/seq_mean_k1"),
                "eval_greedy_unbiased": [run["eval_greedy_unbiased"] for run in runs[arm]],
                "reward_per_step": [[r.get("reward/mean") for r in run["records"]] for run in runs[arm]],
                "skipped_steps": sum(r.get("skipped", 0.0) for run in runs[arm] for r in run["records"]),
            }
        numbers["per_arm"] = final
    else:
        numbers["one_batch"] = {arm: runs[arm][0]["records"][0]["drift"][arm] for arm in arms}
    result.numbers["drift_vs_is_vs_masking"] = numbers
    return {"runs": runs, "ratios": ratios, "arms": arms, "train_steps": cfg.drift_train_steps}


# ------------------------------------------------------------------------------------------------ figure


def _figure(out_dir: Path, pairs: dict, scaling: dict, mono: dict) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    ax = axes[0, 0]
    rows = [r for r in pairs["rows"] if r["bound"] > 0 and abs(r["remainder"]) > 0]
    horizons = sorted({r["T"] for r in rows})
    cmap = plt.get_cmap("viridis")
    for i, horizon in enumerate(horizons):
        sel = [r for r in rows if r["T"] == horizon]
        ax.scatter([r["bound"] for r in sel], [abs(r["remainder"]) for r in sel], s=5, alpha=0.6,
                   color=cmap(i / max(1, len(horizons) - 1)), label=f"T={horizon}")
    lo = min(r["bound"] for r in rows)
    hi = max(r["bound"] for r in rows)
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="|remainder| = R_max·KL_seq")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("R_max · KL_seq(q‖p)")
    ax.set_ylabel("|remainder|")
    ax.set_title("Remainder below its bound (every random pair)")
    ax.legend(fontsize=7, markerscale=2)

    ax = axes[0, 1]
    per_t = pairs["per_t"]
    for vocab in sorted({r["V"] for r in pairs["rows"]}):
        ts = [t for t in horizons if f"V{vocab}_T{t}" in per_t and t >= 2]
        for key, style, label in (("bound_trpo_kl", "-o", "ε·T(T−1)·KL_max"), ("bound_trpo_tv", "-s", "2ε·T(T−1)·TV_max²"),
                                  ("bound_cpo_tv", "-^", "CPO-style 2ε'ΣΣ E[TV]")):
            ax.plot(ts, [per_t[f"V{vocab}_T{t}"][f"{key}_over_ours_median"] for t in ts], style, ms=4,
                    label=f"{label}, V={vocab}")
    ax.axhline(10, color="gray", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("horizon T")
    ax.set_ylabel("classical bound / (R_max·KL_seq), median")
    ax.set_title("Classical trust-region bounds grow with T")
    ax.legend(fontsize=7)

    ax = axes[1, 0]
    eps = scaling["eps"]
    for key, label in (("tangent", "|tangent|"), ("remainder", "|remainder|"), ("kl_seq", "KL_seq")):
        ax.loglog(eps, [abs(r[key]) for r in scaling["rows"]], "-o", ms=3,
                  label=f"{label} (slope {scaling['slopes'][key]:.2f})")
    ax.set_xlabel("perturbation ε (p = q + ε·d in logits)")
    ax.set_title("Tangent is first order, remainder second order")
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    ax.plot(mono["pen"]["J"], "-o", ms=3, label="tangent − R_max·KL_seq (position-wise)")
    ax.plot(mono["nopen"]["J"], "-s", ms=3, label="tangent only, same step (position-wise)")
    ax.axhline(math.comb(8, 4) * 0.5**8, color="gray", ls=":", lw=1, label="best J, position-wise model")
    if mono["tab_curves"] is not None:
        ax.plot(mono["tab_curves"][0], "--", lw=1, label="penalised (tabular, random R)")
        ax.plot(mono["tab_curves"][1], ":", lw=1, label="tangent only (tabular, random R)")
    ax.set_xlabel("sync round")
    ax.set_ylabel("J = E[R]")
    ax.set_title("Maximise the lower bound with q fixed, then sync")
    ax.legend(fontsize=7)
    return save_figure(fig, out_dir / "tangent.png", dpi=110)


def _drift_figure(out_dir: Path, drift: dict) -> str:
    plt = pyplot()
    arms, runs = drift["arms"], drift["runs"]
    name = "tangent_drift.png"
    if drift["train_steps"] == 0:
        fig, ax = plt.subplots(1, 1, figsize=(6, 4))
        one = runs[arms[0]][0]["records"][0]["drift"]
        ax.bar(arms, [one[a]["drift_norm"] for a in arms])
        ax.set_ylabel("‖drift part of the gradient‖ (one batch)")
        ax.set_title("Drift per arm, injected sampler bias")
        ax.tick_params(axis="x", labelsize=8)
    else:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for arm in arms:
            steps = len(runs[arm][0]["records"])

            def mean_over_seeds(get, arm=arm, steps=steps):
                return [sum(get(run["records"][i]) for run in runs[arm]) / len(runs[arm]) for i in range(steps)]

            axes[0].plot(mean_over_seeds(lambda r: r["reward/mean"]), label=arm)
            axes[1].plot(mean_over_seeds(lambda r, arm=arm: r["drift"][arm]["drift_norm"]), label=arm)
            axes[2].plot(mean_over_seeds(lambda r: r["mismatch/k3"]), label=arm)
        axes[0].set_ylabel("training reward (sampled from the biased q)")
        axes[1].set_ylabel("‖drift part of the gradient‖")
        axes[1].set_yscale("log")
        axes[2].set_ylabel("token k3 = KL(q‖p) estimate")
        for ax in axes:
            ax.set_xlabel("RL step")
            ax.legend(fontsize=7)
        fig.suptitle(f"Tiny transformer, sampler logit bias N(0, {DRIFT_BIAS_SIGMA}²): drift vs IS vs masking")
    return save_figure(fig, out_dir / name, dpi=110)


def _notes(cfg: Settings) -> str:
    return (
        "Exact enumeration in fp64. Random pairs: sampler logits N(0, s²) per prefix (s log-uniform in [0.3, 3]); "
        "trainer = sampler + ε·N(0, 1) on all prefixes (70%) or on one depth (30%), ε log-uniform in [1e-3, 2]; "
        "rewards uniform, Bernoulli or token-count. Classical bound (finite-horizon TRPO, Schulman et al. 2015 "
        "Thm. 1 / Kakade & Langford 2002): |J(p) − J(q) − L_q(p)| ≤ ε·T(T−1)·KL_max, ε = max|A_q|. "
        f"Monotone section: SGD, step {cfg.mono_lr}, {cfg.mono_inner_steps} inner steps per round."
    )
