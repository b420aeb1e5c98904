"""Numerical faults through a whole `Trainer.step` (covrl.math + the trainer), for every advantage estimator
and every policy loss: NaN / +inf logits, masked (-inf) vocabulary, zero-variance groups, all-masked batches,
empty rows, extreme log-ratios (±1e4) and huge rewards never leave a non-finite weight. A step that cannot be
taken is skipped with a reason; a persistent NaN stops the run (`TrainingDivergedError`, `covrl train` exit 3)
with a usable last checkpoint."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from _reliability_tiny import TINY, metrics, tiny_overrides

from covrl.config import load_config
from covrl.math import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from covrl.models import tiny_llama
from covrl.rollout.types import RolloutBatch, ScoredBatch
from covrl.train.run import checkpoint as ckpt
from covrl.train.step import trainer as trainer_module
from covrl.train.step.trainer import Trainer, TrainingDivergedError, forward_batch

VOCAB, GROUPS, N, P, T = 100, 2, 4, 3, 5
COMBOS = sorted({(a, "covariance") for a in ADVANTAGE_ESTIMATORS} | {("otb", loss) for loss in POLICY_LOSSES}
                | {("grpo", loss) for loss in POLICY_LOSSES})


@pytest.fixture(scope="module")
def initial_state():
    torch.manual_seed(0)
    model = tiny_llama(VOCAB, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=32)
    return {k: v.clone() for k, v in model.state_dict().items()}


def fresh_model(initial_state):
    model = tiny_llama(VOCAB, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=32)
    model.load_state_dict(initial_state)
    return model


def scored_batch(model, seed: int = 0) -> ScoredBatch:
    """GROUPS x N rows of random prompts/responses (varied lengths), sampler log-probs = the model's own,
    binary rewards with variance in every group."""
    g = torch.Generator().manual_seed(seed)
    rows = GROUPS * N
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    batch = RolloutBatch(prompt_ids=torch.randint(3, VOCAB, (rows, P), generator=g), prompt_mask=torch.ones(rows, P),
                         response_ids=torch.randint(3, VOCAB, (rows, T), generator=g) * mask.long(),
                         response_mask=mask, sampler_logprobs=torch.zeros(rows, T),
                         group_ids=torch.arange(GROUPS).repeat_interleave(N),
                         policy_version=torch.zeros(rows, dtype=torch.long))
    with torch.no_grad():
        lp = forward_batch(model, batch, 1.0, with_stats=False).logprobs * mask
    return replace(batch, sampler_logprobs=lp).scored(torch.tensor([1.0, 0.0] * (rows // 2)))


def corrupt_logits(model, how: str):
    """Make the model's forward return corrupted logits at positions the trainer reads."""
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        logits = out.logits.clone()
        if how == "nan":
            logits[0, -2, 7] = math.nan        # one logit, predicting a response token of row 0
        elif how == "+inf":
            logits[0, -2, 7] = math.inf
        elif how == "-inf":
            logits[..., VOCAB // 2:] = -math.inf  # half the vocabulary masked, sampled tokens included
        out.logits = logits
        return out

    model.forward = forward


def apply_fault(model, batch: ScoredBatch, fault: str) -> ScoredBatch:
    """`batch` with the fault applied (a new batch; a corrupted model is changed in place)."""
    if fault in ("nan_logit", "+inf_logit", "masked_vocab"):
        corrupt_logits(model, {"nan_logit": "nan", "+inf_logit": "+inf", "masked_vocab": "-inf"}[fault])
        return batch
    elif fault == "zero_variance_groups":
        return replace(batch, rewards=torch.zeros_like(batch.rewards))
    elif fault == "all_masked":
        return replace(batch, response_mask=torch.zeros_like(batch.response_mask))
    elif fault == "empty_rows":
        mask = batch.response_mask.clone()
        mask[2:5] = 0.0
        return replace(batch, response_mask=mask)
    elif fault == "log_ratio+1e4":
        return replace(batch, sampler_logprobs=batch.sampler_logprobs + 1e4 * batch.response_mask)
    elif fault == "log_ratio-1e4":
        return replace(batch, sampler_logprobs=batch.sampler_logprobs - 1e4 * batch.response_mask)
    elif fault == "huge_rewards":
        return replace(batch, rewards=batch.rewards * 1e30)
    elif fault == "nan_sampler_logprob":
        lp = batch.sampler_logprobs.clone()
        lp[0, 0] = math.nan
        return replace(batch, sampler_logprobs=lp)
    else:  # pragma: no cover
        raise ValueError(fault)


FAULTS = ["nan_logit", "+inf_logit", "masked_vocab", "zero_variance_groups", "all_masked", "empty_rows",
          "log_ratio+1e4", "log_ratio-1e4", "huge_rewards", "nan_sampler_logprob"]
MUST_SKIP = {"nan_logit": "non-finite", "+inf_logit": "non-finite", "all_masked": "empty generations"}
MUST_STEP = {"zero_variance_groups", "empty_rows", "log_ratio+1e4", "log_ratio-1e4"}


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_goes_through_a_step_without_non_finite_weights(initial_state, fault):
    torch.set_num_threads(1)
    problems = []
    for advantage, loss in COMBOS:
        extra = ["correction.is_level=token", "correction.is_threshold=2.0"] if advantage == "otb" else []
        cfg = load_config(None, ["model.source=tiny", f"algorithm.advantage={advantage}", f"algorithm.loss={loss}",
                                 "optim.micro_batch_size=4", "optim.lr=1e-2", *extra])
        model = fresh_model(initial_state)
        batch = scored_batch(model)
        batch = apply_fault(model, batch, fault)
        trainer = Trainer(model, cfg)
        label = f"{advantage}+{loss}"
        try:
            m = trainer.step(batch)
        except Exception as err:  # noqa: BLE001 - the point of the test
            problems.append(f"{label}: {type(err).__name__}: {err}")
            continue
        state = model.state_dict()
        if not all(torch.isfinite(v).all() for v in state.values()):
            problems.append(f"{label}: non-finite weights after the step")
        unchanged = all(torch.equal(v, initial_state[k]) for k, v in state.items())
        nan_metrics = [k for k, v in m.items() if isinstance(v, float) and math.isnan(v)]
        if fault in MUST_SKIP:
            if m["skipped"] != 1.0 or not unchanged or MUST_SKIP[fault] not in (m.skip_reason or ""):
                problems.append(f"{label}: expected a skipped step, got skipped={m['skipped']} "
                                f"reason={m.skip_reason!r} unchanged={unchanged}")
        elif fault in MUST_STEP and m["skipped"] != 0.0:
            problems.append(f"{label}: step skipped ({m.skip_reason})")
        # a NaN sampler log-prob is reported as it is (mismatch metrics NaN) when the loss does not use it
        if m["skipped"] == 0.0 and nan_metrics and fault != "nan_sampler_logprob":
            problems.append(f"{label}: NaN metrics {nan_metrics}")
        if m["rollouts"] != GROUPS * N:
            problems.append(f"{label}: data clock {m['rollouts']} != {GROUPS * N} (skipped steps consume too)")
    assert not problems, "\n".join(problems)


def test_persistent_nan_raises_after_max_bad_steps_with_weights_intact(initial_state):
    cfg = load_config(None, ["model.source=tiny", "optim.micro_batch_size=4", "optim.max_bad_steps=3"])
    model = fresh_model(initial_state)
    batch = scored_batch(model)
    corrupt_logits(model, "nan")
    trainer = Trainer(model, cfg)
    for _ in range(2):
        assert trainer.step(batch)["skipped"] == 1.0
    with pytest.raises(TrainingDivergedError, match=r"3 steps in a row skipped \(optim.max_bad_steps=3\); "
                                                     r"last reason: non-finite loss"):
        trainer.step(batch)
    assert all(torch.equal(v, initial_state[k]) for k, v in model.state_dict().items())
    assert trainer.version == 0 and trainer.rollouts == 3 * GROUPS * N


def test_one_bad_step_between_good_ones_does_not_stop_the_run(initial_state):
    cfg = load_config(None, ["model.source=tiny", "optim.micro_batch_size=4", "optim.max_bad_steps=2"])
    model = fresh_model(initial_state)
    trainer = Trainer(model, cfg)
    good = scored_batch(model)
    bad = scored_batch(model)
    bad = replace(bad, rewards=bad.rewards * math.nan)  # rewards that bypassed the reward runner's finiteness check
    for batch in (good, bad, good, bad, good):
        trainer.step(batch)
    assert trainer.version == 3 and trainer.bad_steps == 0
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_persistent_nan_in_a_run_stops_with_exit_3_and_a_usable_checkpoint(tmp_path, monkeypatch, capsys, mode):
    """Trainer log-probs turn NaN from step 3 on: steps 3-4 are skipped (weights untouched, still
    checkpointed on the data clock), step 5 stops the run. The last checkpoint holds the step-2 weights,
    loads, and a resume without the fault completes the run."""
    from covrl.train.launch.modes import train_from_config

    torch.set_num_threads(1)
    calls = {"n": 0}
    real_forward = trainer_module.forward_batch
    per_step = 16 // 8  # rows per step / micro-batch size: forward calls per step

    def poisoned(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] > 2 * per_step:
            out.logprobs = out.logprobs * math.nan
        return out

    overrides = tiny_overrides(tmp_path, "nan", "logging.console=false", "sft_warmup.steps=0", "loop.steps=6",
                               "optim.max_bad_steps=3", "logging.diagnostics=false", f"loop.mode={mode}")
    monkeypatch.setattr(trainer_module, "forward_batch", poisoned)
    assert train_from_config(load_config(TINY, overrides)) == 3
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert "3 steps in a row skipped (optim.max_bad_steps=3)" in err and "Traceback" not in err
    run_dir = tmp_path / "nan"
    records = metrics(run_dir)
    # the step that raises is logged too (its metrics travel on the exception), with its reason
    assert [r["skipped"] for r in records] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all("non-finite" in r["skip_reason"] for r in records[2:])
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "diverged"
    ckpts = ckpt.list_checkpoints(run_dir)
    from safetensors.torch import load_file

    after_step2 = load_file(str(run_dir / "checkpoints" / ckpt.checkpoint_name(32) / "model" / "model.safetensors")) \
        if (run_dir / "checkpoints" / ckpt.checkpoint_name(32)).is_dir() else None
    latest = load_file(str(ckpts[-1] / "model" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in latest.values())
    if after_step2 is not None:
        assert all(torch.equal(latest[k], after_step2[k]) for k in latest)
    # usable: the run resumes from it and completes once the fault is gone
    assert train_from_config(load_config(TINY, overrides), resume=True) == 0
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
