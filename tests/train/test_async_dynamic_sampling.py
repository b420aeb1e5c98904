"""Dynamic sampling in the async loop: chunks keep only their groups with reward contrast, filtered rows free
queue capacity, each step still trains B rollouts in stream order, a resume repeats the uninterrupted run, and
a stream without contrast stops the run instead of stalling it."""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import tiny_cfg

from covrl.train.asyncrl.config import AsyncLoopConfig
from covrl.train.asyncrl.source import prepare_async_run, train_async
from covrl.train.run.sinks import read_jsonl
from covrl.train.run.sources import DynamicSamplingError

torch.set_num_threads(1)
# a longer warm-up than the helper's: the tiny model then answers some problems, so more groups carry contrast
DYN = {"loop.mode": "async", "loop.dynamic_sampling": True, "sampler.temperature": 1.0, "eval.sampled": False,
       "eval.before": False, "sft_warmup.steps": 12, "loop.dynamic_sampling_max_rounds": 64}


def comparable(records):   # without the wall-clock keys (rates, the async loop's timings)
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/")) and not k.endswith("tokens_per_s")}
            for r in records]


def _spy(run, trained: list):
    step = run.trainer.step

    def wrapped(batch):
        trained.append(batch.prompt_index.tolist())
        return step(batch)

    run.trainer.step = wrapped


def _run(tmp_path, name, acfg, pool=None, **over):
    run = prepare_async_run(tiny_cfg(tmp_path, **{"run.name": name, **DYN, **over}), console=False)
    trained: list = []
    _spy(run, trained)
    try:
        summary = train_async(run, acfg=acfg, pool=pool)
    finally:
        run.close()
    return run, summary, trained, read_jsonl(tmp_path / name / "metrics.jsonl")


# the process pool's case is slow (~12 s): the serial and thread cases keep the rule in the default suite
@pytest.mark.parametrize("pool", ["serial", "thread", pytest.param("process", marks=pytest.mark.slow)])
def test_async_dynamic_sampling_trains_only_groups_with_contrast(tmp_path, pool):
    acfg = AsyncLoopConfig(max_staleness_steps=1, emulate=pool == "serial", chunk_prompts=2)
    run, summary, trained, records = _run(tmp_path, "dyn", acfg, pool=pool, **{"loop.steps": 4})
    B = run.cfg.loop.rollouts_per_step
    assert summary["status"] == "completed" and len(records) == 4
    for i, r in enumerate(records):
        assert r["zero_variance_groups"] == 0.0          # the trainer never sees a constant group
        assert r["rollouts"] == (i + 1) * B == r["dynamic/trained_rollouts"]   # full batches: the data clock
        assert r["dynamic/generated_rollouts"] >= r["dynamic/trained_rollouts"]
        assert 0 < r["dynamic/keep_rate"] <= 1
    assert records[-1]["dynamic/dropped_groups"] > 0, "the tiny task should give some constant groups"
    # each prompt trained at most once, in stream order; the skipped ones were filtered
    prompts = [p for step in trained for p in step[::run.cfg.loop.group_size]]
    assert prompts == sorted(set(prompts)) and len(prompts) == 4 * run.cfg.loop.prompts_per_step
    assert max(prompts) + 1 > len(prompts)


def test_async_dynamic_sampling_resumes_exactly(tmp_path):
    acfg = AsyncLoopConfig(max_staleness_steps=1, emulate=True, chunk_prompts=2)
    over = {"loop.steps": 4, "checkpoint.every_rollouts": 16}
    straight, _, trained_straight, a = _run(tmp_path, "straight", acfg, **over)
    cfg = tiny_cfg(tmp_path, **{"run.name": "cut", **DYN, **over})
    first = prepare_async_run(cfg, console=False)
    trained: list = []
    _spy(first, trained)
    assert train_async(first, acfg=acfg, stop_after=2)["status"] == "stopped"
    first.close()
    second = prepare_async_run(cfg, resume=True, run_dir=first.run_dir, console=False)
    _spy(second, trained)
    train_async(second, acfg=acfg)
    second.close()
    b = read_jsonl(tmp_path / "cut" / "metrics.jsonl")
    assert trained == trained_straight
    assert comparable(a) == comparable(b)
    for (ka, va), (kb, vb) in zip(straight.model.state_dict().items(), second.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


@pytest.mark.timeout(120)
@pytest.mark.parametrize("emulate", [True, False], ids=["serial", "thread"])
def test_async_dynamic_sampling_cap_stops_a_constant_task(tmp_path, emulate):
    """Every reward 0 (weight 0): no group is ever kept; the run stops with the cap's error (exit code 2)."""
    from covrl.train.launch.modes import train_from_config

    over = {"loop.dynamic_sampling_max_rounds": 2, "task.rewards": [{"fn": "last_number", "weight": 0.0}],
            "async_loop.emulate": emulate, "async_loop.chunk_prompts": 2}
    cfg = tiny_cfg(tmp_path, **{"run.name": "const", **DYN, **over})
    run = prepare_async_run(cfg, console=False)
    with pytest.raises(DynamicSamplingError, match="without filling the next batch"):
        train_async(run)
    run.close()
    cfg = tiny_cfg(tmp_path, **{"run.name": "const-cli", **DYN, **over})
    assert train_from_config(cfg) == 2
    summary = json.loads((tmp_path / "const-cli" / "summary.json").read_text())
    assert summary["status"] == "failed" and "dynamic sampling filtered" in summary["reason"]


def test_dynamic_sampling_refuses_data_parallel_ranks():
    with pytest.raises(Exception, match="dynamic_sampling"):
        tiny_cfg(None, **{"loop.dynamic_sampling": True, "trainer.parallel": "ddp", "trainer.world_size": 2})
