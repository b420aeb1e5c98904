"""FSDP2 checkpoints through torch.distributed.checkpoint inside the atomic checkpoint folder: a 2-rank fsdp2
trainer saves after 2 steps (shards in dcp/, full weights in model/, COMPLETE last); the state is then
resumed on 2 ranks (2 -> 2), on one process (2 -> 1), by DDP's rank 0, and a one-process checkpoint on 2 fsdp2
ranks (1 -> 2).
Resumed weights and Adam moments equal the saved ones exactly (0.0); one more step after a 2 -> 2 resume is
bit-identical to the straight run, after 2 -> 1 / 1 -> 2 equal to the straight run of the other world size to
the 2-rank-vs-1 rounding (WEIGHT_ATOL of test_distributed.py)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_cases import case_batches, make_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from train_helpers import tiny_cfg

from covrl.train.parallel.wrappers import DCP_DIR, Channel
from covrl.train.run import checkpoint as ckpt
from covrl.train.step.trainer import Trainer

torch.set_num_threads(1)

WEIGHT_ATOL = 5e-6   # 2 ranks vs one process, 3 Adam steps at lr 3e-3 (test_distributed.py)


def _cfg(parallel: str):
    return tiny_cfg(**{"logging.noise_scale": False, "trainer.parallel": parallel})


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Weights and optimizer state, by parameter name, full tensors (flattened to one level)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(trainer.model, trainer.optimizer, options=opts)
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for name, entry in osd["state"].items():
        out.update({f"optim.{name}.{k}": torch.as_tensor(v).detach().clone() for k, v in entry.items()})
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _checkpoint(trainer: Trainer, out: str, name: str, rank: int) -> None:
    """What Run.save_checkpoint does on rank 0 and distributed_run.follow on the others."""
    if rank == 0:
        trainer.leader = Channel()
        ckpt.save_checkpoint(out, name, model=trainer.model, state={"trainer": trainer.state_dict()},
                             sharded=trainer.save_sharded if trainer.sharded else None)
        trainer.leader = None
    else:
        kind, folder = Channel().recv()
        assert kind == "checkpoint"
        trainer.save_sharded(folder)
    dist.barrier()   # rank 0 has renamed the folder into place


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batches = case_batches({})
        results = {}
        straight = Trainer(make_model(seed=0), _cfg("fsdp2"))
        for b in batches[:2]:
            straight.step(b)
        _checkpoint(straight, out, ckpt.checkpoint_name(24), rank)
        results["saved"] = full_state(straight)
        straight.step(batches[2])
        results["straight"] = full_state(straight)

        path = ckpt.latest_checkpoint(out)   # 2 -> 2: shards loaded by each rank after the wrap
        resumed = Trainer(make_model(seed=5), _cfg("fsdp2"))   # other init: everything must come from the shards
        resumed.load_state_dict(ckpt.load_state(path)["trainer"])
        resumed._distribute()
        results["resumed"] = full_state(resumed)
        resumed.step(batches[2])
        results["resumed_step"] = full_state(resumed)

        if rank == 0:   # fsdp2 -> ddp: DDP's rank 0 reads the full tensors alone (no collective), as a resume does
            ddp = Trainer(make_model(seed=5), _cfg("ddp"))
            ddp.load_state_dict(ckpt.load_state(path)["trainer"])
            results["ddp_rank0"] = full_state(ddp)
        dist.barrier()

        one = os.path.join(out, "one")   # 1 -> 2: a one-process checkpoint (single-file optimizer state)
        model = make_model(seed=5)
        ckpt.load_model_weights(model, ckpt.latest_checkpoint(one) / ckpt.MODEL_DIR)
        from_one = Trainer(model, _cfg("fsdp2"))
        from_one.load_state_dict(ckpt.load_state(ckpt.latest_checkpoint(one))["trainer"])
        from_one._distribute()
        results["from_one"] = full_state(from_one)
        from_one.step(batches[2])
        results["from_one_step"] = full_state(from_one)
        if rank == 0:
            torch.save(results, os.path.join(out, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_checkpoint_resumes_on_any_world_size(tmp_path):
    batches = case_batches({})
    single = Trainer(make_model(seed=0), _cfg("none"))   # the one-process run and its checkpoint after 2 steps
    for b in batches[:2]:
        single.step(b)
    ckpt.save_checkpoint(tmp_path / "one", ckpt.checkpoint_name(24), model=single.model, state={"trainer": single.state_dict()})
    single_saved = full_state(single)
    single.step(batches[2])
    single_straight = full_state(single)

    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r = torch.load(tmp_path / "rank0.pt", weights_only=True)
    path = ckpt.latest_checkpoint(tmp_path)
    assert path.name == ckpt.checkpoint_name(24) and ckpt.is_complete(path)
    assert (path / DCP_DIR / ".metadata").is_file() and (path / ckpt.MODEL_DIR / "model.safetensors").is_file()
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))

    assert max_diff(r["resumed"], r["saved"]) == 0.0            # 2 -> 2: the state exactly
    assert max_diff(r["resumed_step"], r["straight"]) == 0.0    # and the next step bit-identical
    assert max_diff(r["from_one"], single_saved) == 0.0        # 1 -> 2: the state exactly
    assert max_diff(r["ddp_rank0"], r["saved"]) == 0.0         # fsdp2 -> ddp (rank 0 loads, the wrap broadcasts)
    assert max_diff(r["from_one_step"], r["straight"]) <= WEIGHT_ATOL

    # 2 -> 1: model/ (the export) and the shards, read by one process without a process group
    model = make_model(seed=5)
    ckpt.load_model_weights(model, path / ckpt.MODEL_DIR)
    alone = Trainer(model, _cfg("none"))
    alone.load_state_dict(ckpt.load_state(path)["trainer"])
    assert max_diff(full_state(alone), r["saved"]) == 0.0
    alone.step(batches[2])
    after = full_state(alone)
    print("2->1 then a step vs straight 1 process:", max_diff(after, single_straight),
          " 1->2 then a step vs straight 2 ranks:", max_diff(r["from_one_step"], r["straight"]))
    assert max_diff(after, single_straight) <= WEIGHT_ATOL
