"""The trainer's gradient-noise metrics (docs/theory.md §7 split in parameter units) against brute force: the gradient
of each micro-batch computed on its own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_trainer import assert_grads_close, grads_of_step, make_model
from train_helpers import synthetic_batch, tiny_cfg

from covrl.diagnostics.noise import micro_batch_noise_scale
from covrl.train.step.micro import halves as split_in_halves
from covrl.train.step.trainer import Trainer

torch.set_num_threads(1)


def norm_sq(grads) -> float:
    return float(sum(g.double().square().sum() for g in grads))


def brute_force(cfg, batch, parts, agg_mode):
    """Noise estimate from each part's own mean gradient (a separate step on that part alone)."""
    own, sizes = [], []
    for rows in parts:
        sub = batch.select(torch.as_tensor(rows))
        own.append(norm_sq(grads_of_step(cfg, sub)[0]))
        m = sub.response_mask
        sizes.append(float(m.sum()) if agg_mode == "token-mean" else float((m.sum(1) > 0).sum()))
    full, metrics = grads_of_step(cfg, batch)
    return micro_batch_noise_scale(own, sizes, norm_sq(full)), metrics


@pytest.mark.parametrize("agg_mode", ["seq-mean-token-sum", "token-mean"])
def test_noise_from_whole_group_micro_batches_matches_brute_force(agg_mode):
    model = make_model()
    batch = synthetic_batch(model, groups=4, group_size=3, max_len=6, seed=3)
    cfg = tiny_cfg(**{"algorithm.agg_mode": agg_mode, "optim.max_grad_norm": None, "optim.micro_batch_size": 3,
                      "algorithm.advantage": "rloo"})
    parts = [list(range(3 * g, 3 * g + 3)) for g in range(4)]
    expected, metrics = brute_force(cfg, batch, parts, agg_mode)
    assert abs(expected.trace_sigma) > 1e-6   # a real, non-degenerate case
    for key in ("trace_sigma", "grad_sq", "signal", "power", "noise"):
        assert metrics[f"noise/{key}"] == pytest.approx(getattr(expected, key), rel=1e-3, abs=1e-9), key
    # §7 identity in parameter units: noise = (P − S)/(N − 1), N = batch size in the loss's unit
    n = float(batch.response_mask.sum()) if agg_mode == "token-mean" else len(batch)
    assert metrics["noise/noise"] == pytest.approx(
        max(0.0, (metrics["noise/power"] - metrics["noise/signal"]) / (n - 1)), rel=1e-9)


def test_one_micro_batch_is_split_into_halves_without_changing_the_gradient():
    model = make_model()
    batch = synthetic_batch(model, groups=3, group_size=4, seed=5)
    base = {"optim.max_grad_norm": None, "optim.micro_batch_size": 32}
    cfg = tiny_cfg(**base)
    halves = split_in_halves([list(range(4 * g, 4 * g + 4)) for g in range(3)])
    assert sorted(len(h) for h in halves) == [4, 8]
    expected, metrics = brute_force(cfg, batch, halves, cfg.algorithm.agg_mode)
    assert metrics["noise/trace_sigma"] == pytest.approx(expected.trace_sigma, rel=1e-3)
    assert metrics["noise/noise_ema"] == pytest.approx(metrics["noise/noise"])   # first step: EMA = value
    with_split, _ = grads_of_step(cfg, batch)
    without, plain = grads_of_step(tiny_cfg(**base, **{"logging.noise_scale": False}), batch)
    assert_grads_close(with_split, without, rtol=1e-5, atol=1e-7)
    assert not any(k.startswith("noise/") for k in plain)


def test_single_group_logs_only_the_signal():
    model = make_model()
    batch = synthetic_batch(model, groups=1, group_size=4)
    metrics = Trainer(model, tiny_cfg(**{"optim.max_grad_norm": None})).step(batch)
    assert metrics["noise/signal"] == pytest.approx(metrics["grad_norm"] ** 2, rel=1e-6)
    assert "noise/trace_sigma" not in metrics


def test_noise_triggered_lr_decay_follows_the_logged_noise_ema():
    """lr_surge.trigger=noise: the Trainer feeds the schedule noise/noise_ema after each step; replaying an
    independent LengthSurgeSchedule on the logged values gives the same ratio, decays and scale, and each step's
    lr is the base lr times the scale left by the step before."""
    from covrl.train.step.lr_surge import LengthSurgeSchedule

    model = make_model()
    cfg = tiny_cfg(**{"optim.max_grad_norm": None, "optim.micro_batch_size": 32, "algorithm.advantage": "rloo",
                      "lr_surge.enabled": True, "lr_surge.trigger": "noise", "lr_surge.ratio": 1.05,
                      "lr_surge.warmup": 0, "lr_surge.cooldown": 0, "lr_surge.max_decays": 10,
                      "lr_surge.floor": 0.01})
    trainer = Trainer(model, cfg)
    replay = LengthSurgeSchedule(cfg.lr_surge, rollouts_per_step=cfg.loop.rollouts_per_step)
    scale_before, fired = 1.0, 0
    for seed in range(6):
        batch = synthetic_batch(model, groups=4, group_size=3, max_len=6, seed=seed)
        # RLOO does not normalise advantages: scaling the rewards up scales the gradient noise (tr Σ ∝ scale²)
        batch = replace(batch, rewards=batch.rewards * (1.0 + seed))
        m = trainer.step(batch)
        assert m["lr"] == pytest.approx(cfg.optim.lr * scale_before)
        expected = replay.update(m["noise/noise_ema"], int(m["rollouts"]))
        for key in ("lr_surge/ratio", "lr_surge/scale", "lr_surge/triggered", "lr_surge/ema"):
            assert m[key] == pytest.approx(expected[key]), key
        fired += int(m["lr_surge/triggered"])
        scale_before = m["lr_surge/scale"]
    assert fired >= 1 and trainer.surge.scale < 1.0   # the trigger fired on the noise signal


def test_noise_scale_every_measures_only_every_kth_step_and_leaves_the_rest_unsplit():
    """logging.noise_scale_every=2: versions 0, 2 measure (split into halves, noise/* logged), version 1 runs
    unsplit with noise/signal only, its gradient bit-identical to a step with the monitor off; every=1 is the
    default and measures every step."""
    model = make_model()
    batch = synthetic_batch(model, groups=3, group_size=4, seed=5)
    base = {"optim.max_grad_norm": None, "optim.micro_batch_size": 32}
    assert tiny_cfg(**base).logging.noise_scale_every == 1
    trainer = Trainer(make_model(), tiny_cfg(**base, **{"logging.noise_scale_every": 2}))
    seen = []
    for _ in range(3):
        metrics = trainer.step(batch)
        seen.append(("noise/trace_sigma" in metrics, "noise/signal" in metrics))
    assert seen == [(True, True), (False, True), (True, True)]
    # an unmeasured step is the monitor-off step, bit for bit (one pass, no halves)
    def grads_at_version_1(cfg):
        t = Trainer(make_model(), cfg)
        t.version = 1
        captured = []
        t.optimizer.step = lambda *a, **k: captured.append([p.grad.detach().clone() for p in t.params])
        t.step(batch)
        return captured[0]

    every = grads_at_version_1(tiny_cfg(**base, **{"logging.noise_scale_every": 2}))
    off = grads_at_version_1(tiny_cfg(**base, **{"logging.noise_scale": False}))
    measured = grads_at_version_1(tiny_cfg(**base))   # split in halves: equal up to rounding, not bitwise
    assert all(torch.equal(a, b) for a, b in zip(every, off))
    assert_grads_close(measured, off, rtol=1e-5, atol=1e-7)


def test_noise_trigger_refuses_a_sparse_noise_measurement():
    with pytest.raises(ValueError, match="noise_scale_every=1"):
        tiny_cfg(**{"lr_surge.enabled": True, "lr_surge.trigger": "noise", "logging.noise_scale_every": 3})
