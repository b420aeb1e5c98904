"""Ray backend smoke test: one sampler actor on a local 2-CPU Ray instance; the trainer side in the test
process. At staleness 0 it reproduces the sync loop exactly; at staleness 1 the bound holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

import train_helpers  # noqa: E402

from covrl.train.asyncrl.source import prepare_async_run  # noqa: E402
from covrl.train.run.driver import train_sync  # noqa: E402
from covrl.train.run.folder import prepare_run  # noqa: E402
from covrl.train.run.sinks import read_jsonl  # noqa: E402

pytestmark = pytest.mark.ray

SKIP_PREFIXES = ("time/", "async/", "gap/")
SKIP_KEYS = {"tokens_per_s", "generate_tokens_per_s", "train_tokens_per_s"}


def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(SKIP_PREFIXES) and k not in SKIP_KEYS}
            for r in records]


@pytest.fixture
def local_ray(tmp_path):
    with train_helpers.local_ray(tmp_path):
        yield


def test_ray_backend_smoke(tmp_path, local_ray):
    from covrl.train.asyncrl.ray_pool import start_sampler_actors, train_ray

    sys_path = Path(__file__).parent
    import sys

    sys.path.insert(0, str(sys_path))
    from test_async_loop import tiny_cfg

    torch.set_num_threads(1)
    base = {"sampler.share_weights": "never", "async_loop.trainer_actor": False, "async_loop.sampler_cpus": 1}
    cfg = tiny_cfg(tmp_path, steps=2, **base, **{"run.name": "sync", "eval.after": False})
    sync_run = prepare_run(cfg, console=False)
    train_sync(sync_run)
    sync_run.close()

    cfg0 = tiny_cfg(tmp_path, steps=2, **base, **{"run.name": "ray0", "eval.after": False, "loop.mode": "ray",
                                                   "async_loop.max_staleness_steps": 0})
    actors = start_sampler_actors(cfg0)          # one actor, reused by both runs (same model/task/sampler)
    run0 = prepare_async_run(cfg0, console=False)
    summary0 = train_ray(run0, actors=actors)
    run0.close()
    assert summary0["async"]["pool"] == "RayPool" and summary0["status"] == "completed"
    assert comparable(read_jsonl(run0.run_dir / "metrics.jsonl")) == \
        comparable(read_jsonl(sync_run.run_dir / "metrics.jsonl"))

    cfg1 = tiny_cfg(tmp_path, steps=3, **base, **{"run.name": "ray1", "loop.mode": "ray", "eval.after": False,
                                                   "async_loop.max_staleness_steps": 1,
                                                   "async_loop.chunk_prompts": 2,
                                                   "async_loop.floor_probe_every": 1})
    run1 = prepare_async_run(cfg1, console=False)
    summary1 = train_ray(run1, actors=actors)
    run1.close()
    records = read_jsonl(run1.run_dir / "metrics.jsonl")
    assert len(records) == 3 and max(r["async/staleness_max"] for r in records) <= 1
    assert summary1["async"]["rollouts_consumed"] == 3 * cfg1.loop.rollouts_per_step
    assert summary1["async"]["floor_kl_seq"] is not None and summary1["async"]["floor_kl_seq"] < 1e-6


@pytest.mark.slow
def test_covrl_train_in_ray_mode_goes_through_the_common_exit_table(tmp_path, local_ray):
    """`covrl train` with loop.mode=ray: with the trainer side in a Ray actor the run completes (exit 0, final
    summary); a reward error met mid-run ends with exit 2 and a 'failed' summary, as in the local loops."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_async_loop import tiny_cfg

    from covrl.train.launch.modes import train_from_config

    hostile = Path(__file__).parents[1] / "reliability" / "_hostile_rewards.py"
    base = {"loop.mode": "ray", "async_loop.sampler_cpus": 1, "async_loop.trainer_cpus": 1, "eval.after": False,
            "sampler.share_weights": "never"}
    cfg = tiny_cfg(tmp_path, steps=2, **base, **{"run.name": "in-actor", "async_loop.trainer_actor": True})
    assert train_from_config(cfg) == 0
    summary = json.loads((tmp_path / "in-actor" / "summary.json").read_text())
    records = read_jsonl(tmp_path / "in-actor" / "metrics.jsonl")
    assert summary["status"] == "completed" and [r["rollouts"] for r in records] == [16.0, 32.0]

    cfg = tiny_cfg(tmp_path, steps=2, **base, **{"run.name": "bad-reward", "async_loop.trainer_actor": False,
                                                  "task.reward": f"{hostile}:crash",
                                                  "task.reward_errors": "raise"})
    assert train_from_config(cfg) == 2
    summary = json.loads((tmp_path / "bad-reward" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 2, summary


# slow (~8-14 s): the Ray smoke test keeps the backend in the default suite
@pytest.mark.slow
def test_ray_backend_runs_episodes(tmp_path, local_ray):
    """A task with an environment (the tiny `add` tool preset) through a Ray sampler actor: the actor builds the
    task with its environment and generates episodes through generate_batch, so at staleness 0 the run equals
    the sync loop's episodes."""
    import sys

    from covrl.train.asyncrl.ray_pool import start_sampler_actors, train_ray

    sys.path.insert(0, str(Path(__file__).parent))
    from test_async_loop import tiny_cfg

    torch.set_num_threads(1)
    base = {"sampler.share_weights": "never", "async_loop.trainer_actor": False, "async_loop.sampler_cpus": 1,
            "task.env.name": "add", "task.env.max_turns": 2, "model.tiny.max_positions": 160,
            "sampler.max_new_tokens": 8, "sft_warmup.steps": 0, "eval.after": False}
    sync_run = prepare_run(tiny_cfg(tmp_path, steps=2, **base, **{"run.name": "sync-env"}), console=False)
    train_sync(sync_run)
    sync_run.close()
    cfg = tiny_cfg(tmp_path, steps=2, **base, **{"run.name": "ray-env", "loop.mode": "ray",
                                                  "async_loop.max_staleness_steps": 0})
    run = prepare_async_run(cfg, console=False)
    summary = train_ray(run, actors=start_sampler_actors(cfg))
    run.close()
    assert summary["status"] == "completed"
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    assert all("task/turns" in r for r in records)
    assert comparable(records) == comparable(read_jsonl(sync_run.run_dir / "metrics.jsonl"))


def test_actors_that_do_not_fit_the_cluster_are_refused_with_the_numbers(tmp_path, capsys):
    """The README's 2-rank Ray command on a 2-CPU machine: 2 trainer actors + 1 sampler actor at 1 CPU each need
    3 CPUs; Ray would wait for ever. covrl refuses at once (exit 2) and says what to change."""
    from covrl.train.launch.ray import resource_shortfall, train_from_config_ray

    cfg = train_helpers.tiny_cfg(tmp_path, **{"loop.mode": "ray", "trainer.parallel": "ddp",
                                              "trainer.world_size": 2, "async_loop.ray_temp_dir": str(tmp_path)})
    text = resource_shortfall(cfg, {"CPU": 2.0})
    assert "3 CPU needed, 2 in the cluster" in text and "Lower async_loop.trainer_cpus / sampler_cpus" in text
    fits = cfg.model_copy(update={"async_loop": cfg.async_loop.model_copy(update={"trainer_cpus": 0.5,
                                                                                   "sampler_cpus": 0.5})})
    assert resource_shortfall(fits, {"CPU": 2.0}) is None
    assert resource_shortfall(cfg, {"CPU": 8.0, "GPU": 0.0}) is None
    with train_helpers.local_ray(tmp_path):
        assert train_from_config_ray(cfg) == 2
    assert "the actors do not fit" in capsys.readouterr().err


AGENT = '''
import openai


async def run(base_url, api_key, example):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="covrl", messages=[{"role": "user", "content": example.prompt}])
    return None   # the task's reward of the answer
'''


# slow (~15-25 s): the process pool's agent tests keep the worker's player in the default suite
@pytest.mark.slow
def test_ray_sampler_actors_play_agent_episodes_like_the_sync_loop(tmp_path, local_ray):
    """task.agent through a Ray sampler actor: the actor loads the program and serves its own endpoint; one
    episode at a time (task.agent.concurrency=1) at staleness 0 the run equals the sync loop's, and the final
    evaluation plays the agent in the trainer's process."""
    import sys

    pytest.importorskip("openai")
    from covrl.train.asyncrl.ray_pool import start_sampler_actors, train_ray

    sys.path.insert(0, str(Path(__file__).parent))
    from test_async_loop import tiny_cfg

    torch.set_num_threads(1)
    (tmp_path / "toy_agent.py").write_text(AGENT)
    base = {"sampler.share_weights": "never", "async_loop.trainer_actor": False, "async_loop.sampler_cpus": 1,
            "task.agent.fn": f"{tmp_path / 'toy_agent.py'}:run", "task.agent.concurrency": 1,
            "model.tiny.max_positions": 64, "sft_warmup.steps": 0, "eval.before": False, "eval.sampled": False}
    sync_run = prepare_run(tiny_cfg(tmp_path, steps=2, **base, **{"run.name": "sync-agent"}), console=False)
    train_sync(sync_run)
    sync_run.close()
    cfg = tiny_cfg(tmp_path, steps=2, **base, **{"run.name": "ray-agent", "loop.mode": "ray",
                                                  "async_loop.max_staleness_steps": 0})
    run = prepare_async_run(cfg, console=False)
    summary = train_ray(run, actors=start_sampler_actors(cfg))
    run.close()
    assert summary["status"] == "completed" and summary["agent"]["failed_episodes"] == 0
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    assert all(r["task/agent_calls"] == 1.0 for r in records)
    assert comparable(records) == comparable(read_jsonl(sync_run.run_dir / "metrics.jsonl"))
    import json

    evals = json.loads((run.run_dir / "eval.json").read_text())["evals"]
    assert [e["label"] for e in evals] == ["after"] and evals[0]["greedy"]["agent_calls"] == 1.0
