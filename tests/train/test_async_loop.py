"""The async loop on a tiny model (CPU): staleness 0 reproduces the sync loop exactly; the queue survives a
resume (no rollout lost or trained twice); the staleness bound holds in a real threaded run."""

from __future__ import annotations

import math

import pytest
import torch

from covrl.config import load_config
from covrl.rollout.types import concat_batches
from covrl.train.asyncrl.config import AsyncLoopConfig
from covrl.train.asyncrl.source import prepare_async_run, train_async
from covrl.train.run.driver import train_sync
from covrl.train.run.folder import prepare_run
from covrl.train.run.sinks import read_jsonl

# keys that measure wall time or only exist in the async loop
SKIP_PREFIXES = ("time/", "async/", "gap/")
SKIP_KEYS = {"tokens_per_s", "generate_tokens_per_s", "train_tokens_per_s"}


def tiny_cfg(tmp_path, steps=3, **over):
    overrides = {
        "run.output_dir": str(tmp_path), "run.num_threads": 1, "model.source": "tiny",
        "model.tiny.hidden_size": 32, "model.tiny.num_layers": 1, "model.tiny.num_heads": 2,
        "model.tiny.intermediate_size": 64, "model.tiny.max_positions": 48,
        "task.name": "arithmetic", "task.chat_template": False, "task.n_train": 64, "task.n_eval": 8,
        "sampler.max_new_tokens": 4, "sft_warmup.steps": 3, "sft_warmup.batch_size": 16,
        "optim.lr": 3e-3, "optim.micro_batch_size": 32, "loop.steps": steps, "loop.prompts_per_step": 4,
        "loop.group_size": 4, "eval.max_prompts": 4, "eval.before": False, "eval.after": True,
        "logging.console": False, "logging.curves": False, "checkpoint.at_end": True,
    }
    overrides.update(over)
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(SKIP_PREFIXES) and k not in SKIP_KEYS}
            for r in records]


def run_sync(cfg, name):
    run = prepare_run(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name})}), console=False)
    try:
        summary = train_sync(run)
    finally:
        run.close()
    return run, summary


def run_async(cfg, name, acfg, **kw):
    run = prepare_async_run(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name})}),
                            console=False)
    try:
        summary = train_async(run, acfg=acfg, **kw)
    finally:
        run.close()
    return run, summary


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory):
    """The sync loop with a sampler that holds its own copy of the weights (as the async sampler does)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("sync")
    cfg = tiny_cfg(tmp, **{"sampler.share_weights": "never"})
    run, summary = run_sync(cfg, "sync")
    return cfg, read_jsonl(run.run_dir / "metrics.jsonl"), summary


@pytest.mark.parametrize("backend", ["thread", "serial", "process"])
def test_staleness_zero_equals_sync(sync_reference, backend):
    cfg, sync_records, sync_summary = sync_reference
    acfg = AsyncLoopConfig(max_staleness_steps=0, emulate=backend == "serial",
                           local_backend="process" if backend == "process" else "thread")
    run, summary = run_async(cfg, f"async0-{backend}", acfg)
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    assert len(records) == len(sync_records) == cfg.loop.steps
    assert comparable(records) == comparable(sync_records)
    assert all(r["async/staleness_max"] == 0 for r in records)
    assert summary["eval_after"] == sync_summary["eval_after"]


# Metrics built from the sampler's log-probs (engine mismatch at ~1e-14): they carry the last-bit differences.
MISMATCH_KEYS = ("mismatch/", "loss/approx_kl", "loss/ratio", "kl_seq", "bound", "remainder", "gain", "correction/")


def test_staleness_zero_matches_default_sync(sync_reference, tmp_path):
    """Against the default sync loop, whose sampler runs the trainer's own module (parameters with
    requires_grad=True take a different CPU kernel path, ~6e-8 apart in the logits): every metric is identical
    except the mismatch family, which agrees to 1e-6."""
    cfg = tiny_cfg(tmp_path)
    run, _ = run_sync(cfg, "shared")
    sync_records = comparable(read_jsonl(run.run_dir / "metrics.jsonl"))
    async_run, _ = run_async(sync_reference[0], "async-vs-shared", AsyncLoopConfig(max_staleness_steps=0))
    async_records = comparable(read_jsonl(async_run.run_dir / "metrics.jsonl"))
    for a, b in zip(sync_records, async_records):
        assert a.keys() == b.keys()
        for k in a:
            if any(k.startswith(p) for p in MISMATCH_KEYS):
                assert a[k] == pytest.approx(b[k], abs=1e-6), k
            else:
                assert a[k] == b[k], k


def test_concat_batches_keeps_rows_and_groups():
    from covrl.models import char_tokenizer, tiny_llama
    from covrl.rollout import SamplerConfig, build_sampler

    tok = char_tokenizer()
    model = tiny_llama(tok.vocab_size if hasattr(tok, "vocab_size") else 100, hidden_size=16, num_layers=1,
                       num_heads=2, intermediate_size=32, max_positions=48)
    sampler = build_sampler(SamplerConfig(max_new_tokens=5), model, tok)
    g = torch.Generator().manual_seed(0)
    a = sampler.generate([[5, 6, 7], [8, 9]], 2, generator=g, policy_version=3)
    b = sampler.generate([[10, 11, 12, 13, 14]], 3, generator=g, policy_version=4)
    a, b = a.scored(torch.ones(len(a))), b.scored(torch.zeros(len(b)))
    c = concat_batches([a, b], pad_id=tok.pad_token_id)
    assert len(c) == 7 and c.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 2]
    assert c.policy_version.tolist() == [3] * 4 + [4] * 3
    for src, rows in ((a, range(0, 4)), (b, range(4, 7))):
        for i, r in enumerate(rows):
            n_p = int(src.prompt_mask[i].sum())
            assert c.prompt_ids[r][c.prompt_mask[r] > 0].tolist() == src.prompt_ids[i][-n_p:].tolist()
            t = int(src.response_mask[i].sum())
            assert c.response_ids[r, :t].tolist() == src.response_ids[i, :t].tolist()
            assert torch.equal(c.sampler_logprobs[r, :t], src.sampler_logprobs[i, :t])
            assert float(c.response_mask[r].sum()) == t
    assert c.rewards.tolist() == [1.0] * 4 + [0.0] * 3


def test_queue_survives_resume(tmp_path):
    """Stop after 2 steps (checkpoint holds queued rollouts), resume, finish: the prompts trained are the stream
    in order, each once; in the deterministic (serial) schedule the resumed run equals the uninterrupted one."""
    emulate = True
    torch.set_num_threads(1)
    cfg = tiny_cfg(tmp_path, steps=4, **{"checkpoint.every_rollouts": 16})
    acfg = AsyncLoopConfig(max_staleness_steps=1, emulate=emulate, chunk_prompts=2)
    trained: list[list[int]] = []

    def spy(run):
        step = run.trainer.step

        def wrapped(batch):
            trained.append(batch.prompt_index.tolist())
            return step(batch)

        run.trainer.step = wrapped

    full_run = prepare_async_run(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": "full"})}),
                                 console=False)
    spy(full_run)
    train_async(full_run, acfg=acfg)
    full_run.close()
    full_trained, trained[:] = list(trained), []

    name_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": "cut"})})
    first = prepare_async_run(name_cfg, console=False)
    spy(first)
    summary = train_async(first, acfg=acfg, stop_after=2)
    first.close()
    assert summary["status"] == "stopped"
    from covrl.train.run import checkpoint as ckpt

    saved = ckpt.load_state(ckpt.latest_checkpoint(first.run_dir))["async"]
    queued = [c for c in saved["manager"]["chunks"]]
    assert queued, "the checkpoint should hold the queue (the sampler runs one step ahead)"
    second = prepare_async_run(name_cfg, resume=True, run_dir=first.run_dir, console=False)
    spy(second)
    train_async(second, acfg=acfg)
    second.close()

    B = cfg.loop.rollouts_per_step
    flat = [p for step in trained for p in step]
    expected = [p for p in range(cfg.loop.steps * cfg.loop.prompts_per_step) for _ in range(cfg.loop.group_size)]
    assert flat == expected == [p for step in full_trained for p in step]
    assert len(trained) == cfg.loop.steps and all(len(s) == B for s in trained)
    if emulate:
        a = comparable(read_jsonl(full_run.run_dir / "metrics.jsonl"))
        b = comparable(read_jsonl(second.run_dir / "metrics.jsonl"))
        assert a == b


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial_rollouts"])
def test_resume_regenerates_the_chunk_in_flight(tmp_path, partial):
    """Threaded run: the checkpoint after step 1 is taken while the sampler is generating a chunk (the test
    holds that chunk until the checkpoint is written). Resuming from it generates the chunk again; the prompts
    trained over both sessions are the stream in order, each once (also when weights reach chunks in flight)."""
    import threading

    from covrl.train.run import checkpoint as ckpt

    torch.set_num_threads(1)
    cfg = tiny_cfg(tmp_path, steps=3, **{"checkpoint.every_rollouts": 16, "checkpoint.keep_last": 5,
                                          "run.name": "inflight"})
    acfg = AsyncLoopConfig(max_staleness_steps=1, chunk_prompts=2,   # B = 16, chunks of 8 rollouts, Q = 16
                           partial_rollouts=partial)
    run = prepare_async_run(cfg, console=False)
    started, saved = threading.Event(), threading.Event()
    generate, save = run.sampler.generate, run.save_checkpoint
    calls = []

    def held_generate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:              # chunk 4: the first one generated with the weights of step 1
            started.set()
            saved.wait(timeout=60)
        return generate(*args, **kwargs)

    def first_save_waits():
        if not saved.is_set():
            assert started.wait(timeout=60)
            path = save()
            saved.set()
            return path
        return save()

    run.sampler.generate, run.save_checkpoint = held_generate, first_save_waits
    trained: list[list[int]] = []
    step = run.trainer.step
    run.trainer.step = lambda b: (trained.append(b.prompt_index.tolist()), step(b))[1]
    train_async(run, acfg=acfg)
    run.close()
    first = ckpt.list_checkpoints(run.run_dir)[0]
    state = ckpt.load_state(first)["async"]
    running = [c for c in state["manager"]["chunks"] if not c["done"]]
    assert [c["ticket"] for c in running] == [32] and state["manager"]["consumed"] == 16
    for later in ckpt.list_checkpoints(run.run_dir)[1:]:
        import shutil

        shutil.rmtree(later)
    resumed = prepare_async_run(cfg, resume=True, run_dir=run.run_dir, console=False)
    again: list[list[int]] = []
    step2 = resumed.trainer.step
    resumed.trainer.step = lambda b: (again.append(b.prompt_index.tolist()), step2(b))[1]
    train_async(resumed, acfg=acfg)
    resumed.close()
    flat = [p for s in trained[:1] + again for p in s]
    assert flat == [p for p in range(12) for _ in range(4)]
    assert len(read_jsonl(run.run_dir / "metrics.jsonl")) == 3


def test_threaded_run_respects_the_bound(tmp_path):
    """A real two-thread run with Q = 2 steps and chunks of 1 prompt: every step's staleness <= 2."""
    torch.set_num_threads(1)
    cfg = tiny_cfg(tmp_path, steps=5, **{"eval.every_rollouts": 32})
    acfg = AsyncLoopConfig(max_staleness_rollouts=2 * cfg.loop.rollouts_per_step, chunk_prompts=1,
                           floor_probe_every=2)
    run, summary = run_async(cfg, "bound", acfg)
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    # periodic evaluation (sampler paused and synced) at 32 and 64 rollouts, plus the final one
    assert [e["label"] for e in summary_evals(run)] == ["rollouts-32", "rollouts-64", "after"]
    assert len(records) == 5 and max(r["async/staleness_max"] for r in records) <= 2
    assert all(r["async/outstanding"] <= 3 * cfg.loop.rollouts_per_step for r in records)
    assert summary["async"]["rollouts_consumed"] == 5 * cfg.loop.rollouts_per_step
    # fp32 sampler against an fp32 trainer at equal weights: the engine floor is ~0
    assert summary["async"]["floor_kl_seq"] is not None and summary["async"]["floor_kl_seq"] < 1e-6
    assert all(math.isfinite(r["gap/total"]) for r in records)


def summary_evals(run):
    import json

    return json.loads((run.run_dir / "eval.json").read_text())["evals"]


def test_config_checks():
    with pytest.raises(ValueError, match="chunk_prompts"):
        AsyncLoopConfig(chunk_prompts=3).check_against(prompts_per_step=4, group_size=2, sync_every=1)
    with pytest.raises(ValueError, match="sync_every"):
        AsyncLoopConfig(max_staleness_steps=0).check_against(prompts_per_step=4, group_size=2, sync_every=2)
    assert AsyncLoopConfig(max_staleness_steps=2).queue_rollouts(8) == 16
    assert AsyncLoopConfig(max_staleness_rollouts=5, max_staleness_steps=2).queue_rollouts(8) == 5
