"""DDP and FSDP2 with world size 2 (gloo, two processes, one spawn for the module) against one process on the same
global batches: weights after 3 optimizer steps and the step metrics, for every aggregation mode, OTB / RLOO /
GRPO, micro-batching, the pre-pass path, uneven shards and ranks without tokens or rows."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from dist_cases import CASES, NOISE_SAME_SPLIT, case_batches, run_case, spawn_worker
from test_trainer_noise import brute_force
from train_helpers import TIME_KEYS, TIME_PREFIXES, tiny_cfg

from covrl.train.parallel.wrappers import shard_rows

torch.set_num_threads(1)
# the world-2 spawn is a session fixture of one xdist group: under `make test` (--dist loadgroup) one worker runs
# it once (a module fixture was set up again whenever that worker's tests of other modules came in between)
pytestmark = pytest.mark.xdist_group("world2")

# fp32; the ranks' gradients are summed in another order than one process accumulates them, and a forward over
# a rank's rows rounds differently from one over the whole batch: a few ulps that 3 Adam steps carry along
# (measured worst: 1.3e-6, fsdp2 on the pre-pass path)
WEIGHT_ATOL = 5e-6   # one Adam step at lr 3e-3 moves a weight by up to ~3e-3: this is < 0.2% of a step
METRIC_RTOL, METRIC_ATOL = 1e-4, 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODES = ("ddp", "fsdp2")


@pytest.fixture(scope="session")
def world2(tmp_path_factory):
    """Every case under every mode, in one spawn of two ranks: {mode: [rank 0's results, rank 1's]}."""
    out = tmp_path_factory.mktemp("world2")
    mp.spawn(spawn_worker, args=(2, _free_port(), str(out), list(MODES), list(CASES)), nprocs=2, join=True)
    return {m: [torch.load(out / f"{m}-rank{r}.pt", weights_only=True) for r in (0, 1)] for m in MODES}


@pytest.fixture(scope="session")
def one_process():
    return {}


def max_abs_diffs(a: dict, b: dict) -> dict[str, float]:
    return {k: float((a[k] - b[k]).abs().max()) for k in a}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_world2_equals_one_process(world2, one_process, mode, name):
    if name not in one_process:
        one_process[name] = run_case(name)
    single = one_process[name]
    dist0, dist1 = world2[mode][0][name], world2[mode][1][name]
    diffs = max_abs_diffs(single["weights"], dist0["weights"])
    worst = max(diffs.values())
    print(f"{mode} {name}: max |w1 - w2| = {worst:.3g}")
    assert worst <= WEIGHT_ATOL, f"{mode} {name}: per-parameter max |w1 - w2| {diffs}"
    assert max(max_abs_diffs(dist0["weights"], dist1["weights"]).values()) == 0.0   # ranks agree exactly
    for step, (ms, md) in enumerate(zip(single["metrics"], dist0["metrics"])):
        assert md["skipped"] == ms["skipped"] == 0.0, (step, md.get("skipped"))
        keys, dkeys = ({k for k in m if not k.startswith(TIME_PREFIXES) and k not in TIME_KEYS and (
            not k.startswith("noise/") or (mode == "ddp" and (name in NOISE_SAME_SPLIT or k.startswith(
                "noise/signal"))))} for m in (ms, md))
        # fsdp2 logs no noise split; another split of the batch shares only the full gradient's norm (signal)
        assert keys == dkeys, sorted(keys ^ dkeys)
        assert mode == "fsdp2" or not name.startswith("noise") or "noise/signal" in dkeys
        for k in sorted(keys):
            assert md[k] == pytest.approx(ms[k], rel=METRIC_RTOL, abs=METRIC_ATOL), (name, step, k, ms[k], md[k])


def test_fsdp2_refuses_the_noise_split_and_turns_the_default_off():
    with pytest.raises(ValueError, match="logging.noise_scale=true cannot be measured under trainer.parallel=fsdp2"):
        tiny_cfg(**{"trainer.parallel": "fsdp2", "logging.noise_scale": True})
    assert tiny_cfg(**{"trainer.parallel": "fsdp2"}).noise_scale_on is False   # the default: off there
    assert tiny_cfg(**{"trainer.parallel": "ddp"}).noise_scale_on is True      # on elsewhere
    assert tiny_cfg().noise_scale_on is True


def test_world_size_must_match_the_launcher(monkeypatch):
    from covrl.train.parallel.wrappers import init_process_group

    cfg = tiny_cfg(**{"trainer.parallel": "ddp", "trainer.world_size": 2})
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)   # both checks come before joining
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="needs a launcher that starts the ranks"):
        init_process_group(cfg.trainer)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="the launcher started 3 ranks"):
        init_process_group(cfg.trainer)
    with pytest.raises(ValueError, match="async_loop.trainer_actor=false is for one trainer"):
        tiny_cfg(**{"trainer.parallel": "ddp", "loop.mode": "ray", "async_loop.trainer_actor": False})


def test_shards_are_whole_groups_balanced_by_rows():
    gids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    assert shard_rows(gids, 2, 0) == [0, 1, 2]
    assert shard_rows(gids, 2, 1) == [3, 4, 5, 6, 7, 8]
    assert shard_rows(torch.tensor([5, 5, 5, 5]), 2, 0) == []
    assert shard_rows(torch.tensor([5, 5, 5, 5]), 2, 1) == [0, 1, 2, 3]
    gids = torch.arange(8).repeat_interleave(4)
    shards = [shard_rows(gids, 4, r) for r in range(4)]
    assert sorted(sum(shards, [])) == list(range(32)) and all(len(s) == 8 for s in shards)


def test_ddp_noise_split_is_the_estimate_on_the_ranks_shards(world2):
    """noise-shards: one process halves its single micro-batch as [g0 g1] | [g2]; under ddp the small batches
    are the ranks' micro-batches [g0] | [g1 g2], each rank's gradient read in DDP's comm hook before the
    all-reduce. Its first-step split equals brute force (each part's own gradient, one process) on that
    partition; with the same partition it equals one process (`noise-micro` in the test above)."""
    over, opts = CASES["noise-shards"]
    cfg = tiny_cfg(**over)
    batch = case_batches(opts)[0]
    expected, _ = brute_force(cfg, batch, [shard_rows(batch.group_ids, 2, r) for r in (0, 1)],
                              cfg.algorithm.agg_mode)
    got = world2["ddp"][0]["noise-shards"]["metrics"][0]
    assert abs(expected.trace_sigma) > 1e-6
    for key in ("trace_sigma", "grad_sq", "signal", "power", "noise"):
        assert got[f"noise/{key}"] == pytest.approx(getattr(expected, key), rel=1e-3, abs=1e-9), key
