"""Truncated sampling end to end on the tiny model (docs/theory.md §12): the hf sampler records the size of each
kept set; at equal weights the replaying trainer's ratios are 1 and the mismatch returns to the engine floor,
while the full softmax reports the kept mass as mismatch; min-p; and the start-up warning of trainer.truncation=full."""

from __future__ import annotations

import pytest
import torch
from train_helpers import tiny_cfg

from covrl.math.truncation import kept_mask
from covrl.rollout import truncation_rule
from covrl.train import prepare_run, read_jsonl, train_sync

torch.set_num_threads(1)
TRUNCATE = {"sampler.top_p": 0.9, "sampler.top_k": 20, "loop.steps": 2, "eval.before": False, "eval.after": False}


def _run(tmp_path, name, **extra):
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": name, **TRUNCATE, **extra}), console=False)
    train_sync(run)
    run.close()
    return read_jsonl(tmp_path / name / "metrics.jsonl")


def test_the_sampler_records_the_kept_sets_it_drew_from(tmp_path):
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "rec", **TRUNCATE, "sampler.min_p": 0.05}), console=False)
    examples, _ = run.stream.take(2)
    prompts = [run.task.encode(run.tokenizer, ex) for ex in examples]
    batch = run.sampler.generate(prompts, 3, generator=torch.Generator().manual_seed(0))
    run.close()
    assert batch.sampler_kept is not None and batch.sampler_kept.shape == batch.response_ids.shape
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
    with torch.no_grad():
        logits = run.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logits = logits[:, batch.prompt_ids.shape[1] - 1:-1]
    kept = kept_mask(logits, run.cfg.sampler.temperature, truncation_rule(run.cfg.sampler))
    m = batch.response_mask.bool()
    assert (batch.sampler_kept[m] >= 1).all() and (batch.sampler_kept[~m] == 0).all()
    agree = (kept.sum(-1)[m] == batch.sampler_kept[m]).float().mean()
    assert agree > 0.95, agree        # the cached decode and this forward agree but for rounding at a boundary
    assert kept.gather(-1, batch.response_ids[..., None]).squeeze(-1)[m].float().mean() > 0.99


def test_replay_makes_the_ratio_exact_and_the_full_softmax_reports_the_kept_mass(tmp_path):
    with pytest.warns(UserWarning, match="trainer.truncation=full"):
        full = _run(tmp_path, "full", **{"trainer.truncation": "full"})
    replay = _run(tmp_path, "replay", **{"trainer.truncation": "replay"})
    for r in full:   # the sampler and the trainer hold the same weights: all of the gap is the kept mass
        assert r["truncation/replay"] == 0.0 and r["truncation/kept_mass_mean"] < 0.99
        assert r["loss/ratio_mean"] == pytest.approx(r["truncation/kept_mass_mean"], rel=1e-4)
        assert r["mismatch/k3"] > 1e-3
    for r in replay:
        assert r["truncation/replay"] == 1.0 and r["truncation/kl_term"] > 0.0
        assert r["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert r["mismatch/k3"] < 1e-8 and r["kl_seq"] < 1e-6        # the fp32 floor of the tiny model
        assert r["truncation/count_mismatch_frac"] < 0.05 and r["truncation/sampled_outside_frac"] < 0.05
    # the same first batch (same seed, same weights before the first update): the same kept mass either way
    assert full[0]["truncation/kept_mass_mean"] == pytest.approx(replay[0]["truncation/kept_mass_mean"], rel=1e-6)


def test_without_truncation_nothing_changes(tmp_path):
    records = _run(tmp_path, "plain", **{"sampler.top_p": 1.0, "sampler.top_k": 0})
    assert not any(k.startswith("truncation/") for k in records[0])


def test_the_async_loop_replays_too_and_its_floor_probe_scores_the_kept_sets(tmp_path):
    """The async loop at staleness 0 (a sampler thread with its own copy of the weights): ratios exact on the
    sampler's kept sets, and the engine-floor probe measures the same distribution (0, not the kept mass)."""
    from covrl.train import AsyncLoopConfig, prepare_async_run, train_async

    cfg = tiny_cfg(tmp_path, **{"run.name": "async", **TRUNCATE, "sampler.share_weights": "never"})
    run = prepare_async_run(cfg, console=False)
    summary = train_async(run, acfg=AsyncLoopConfig(max_staleness_steps=0, floor_probe_every=1))
    run.close()
    records = read_jsonl(tmp_path / "async" / "metrics.jsonl")
    assert all(abs(r["loss/ratio_mean"] - 1.0) < 1e-5 and r["truncation/replay"] == 1.0 for r in records)
    assert summary["async"]["floor_kl_seq"] < 1e-8 and summary["async"]["floor_probes"] >= 1
