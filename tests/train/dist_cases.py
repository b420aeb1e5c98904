"""The cases of the 2-process trainer tests and the code both sides run: `run_case` steps a Trainer 3 times on
fixed synthetic batches (the same full batch on every rank) and returns its metrics and final weights;
`spawn_worker` is the torch.multiprocessing entry of one rank, which runs every case and saves rank 0's (and
rank 1's weights) for the test module to compare with one process."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist
from train_helpers import synthetic_batch, tiny_cfg

from covrl.models import frozen_copy, tiny_llama
from covrl.models.loading import apply_lora
from covrl.train.step.trainer import Trainer

STEPS = 3
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# name -> (config overrides, synthetic batch options)
CASES: dict[str, tuple[dict, dict]] = {
    **{f"otb-{m}": ({"algorithm.agg_mode": m}, {}) for m in AGG_MODES},
    "rloo": ({"algorithm.advantage": "rloo"}, {}),
    "grpo": ({"algorithm.advantage": "grpo", "algorithm.agg_mode": "seq-mean-token-mean"}, {}),
    # rank 0 holds 1 group (1 micro-batch), rank 1 two (2 micro-batches): rank 0 runs an idle micro-batch
    "micro-batches": ({"optim.micro_batch_size": 4}, {}),
    # groups larger than a micro-batch: the no-grad pre-pass path (log-probs summed over ranks)
    "prepass": ({"optim.micro_batch_size": 3, "correction.is_level": "token"}, {}),
    "ppo-seq-is": ({"algorithm.loss": "ppo_clip", "correction.is_level": "sequence"}, {}),
    # 9 rows on 2 ranks (3 + 6)
    "uneven-rows": ({"algorithm.agg_mode": "seq-mean-token-mean"}, {"groups": 3, "group_size": 3}),
    # rank 0's group has no response tokens at all
    "rank-without-tokens": ({}, {"groups": 2, "empty_group": 0}),
    # one group: rank 0 gets no rows
    "rank-without-rows": ({"algorithm.agg_mode": "seq-mean-token-sum"}, {"groups": 1}),
    # peft LoRA adapters on q/v (frozen base weights beside trainable adapters in the wrapped module)
    "lora": ({"model.lora": "{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}"}, {}),
    # a KL reference (replicated; rank 0's broadcast at the first step): in the loss (k3, straight-through) and
    # as a reward penalty (k1: the full batch's reference log-probs, assembled from the ranks' shards)
    "kl-loss": ({"kl.coef": 0.5, "kl.kind": "k3", "kl.straight_through": True}, {}),
    "kl-reward": ({"kl.coef": 0.5, "kl.kind": "k1", "kl.mode": "reward"}, {}),
    # the gradient-noise split (ddp: from each rank's gradient before the all-reduce; fsdp2 runs it without). One
    # micro-batch per group: the ranks' micro-batches [g0] | [g1] [g2] are one process's, the same estimate
    "noise-micro": ({"logging.noise_scale": True, "optim.micro_batch_size": 4, "optim.max_grad_norm": None}, {}),
    # one micro-batch per rank: one process halves the batch [g0 g1] | [g2], the ranks split it [g0] | [g1 g2]
    "noise-shards": ({"logging.noise_scale": True, "optim.max_grad_norm": None}, {}),
    # measured every 2nd step: the ranks agree on which (the unmeasured step runs no gather collective)
    "noise-every": ({"logging.noise_scale": True, "logging.noise_scale_every": 2, "optim.micro_batch_size": 4,
                     "optim.max_grad_norm": None}, {}),
    # on-policy distillation: every rank holds the same frozen teacher and scores its shard (a full-batch metric)
    "distill": ({"distill.teacher": {"source": "tiny"}, "algorithm.loss": "reinforce"}, {}),
    # sequence packing: each rank packs its shard's groups into token-budget micro-batches
    "packing": ({"trainer.packing": True, "trainer.packing_tokens": 40}, {}),
}
NOISE_SAME_SPLIT = {"noise-micro", "noise-every"}   # cases whose noise/* metrics equal one process's


def make_model(seed=0):
    return tiny_llama(40, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=32,
                      seed=seed)


def case_batches(batch_opts: dict) -> list:
    opts = dict(batch_opts)
    empty = opts.pop("empty_group", None)
    model = make_model(seed=1)   # the "sampler": not the model being trained
    out = []
    for step in range(STEPS):
        b = synthetic_batch(model, seed=step, **{"groups": 3, "group_size": 4, **opts})
        if empty is not None:
            rows = b.group_ids == empty
            b = replace(b, response_mask=b.response_mask * (~rows)[:, None].float(),
                        response_ids=b.response_ids * (~rows)[:, None].long())
        out.append(b)
    return out


def run_case(name: str, parallel: str = "none") -> dict:
    over, batch_opts = CASES[name]
    over = {**over, "logging.noise_scale": False} if parallel == "fsdp2" else over   # refused there (config)
    cfg = tiny_cfg(**{"logging.noise_scale": False, "trainer.parallel": parallel, **over})
    model = make_model(seed=0)
    if cfg.model.lora is not None:
        with torch.random.fork_rng():   # the same adapter init in every process
            torch.manual_seed(0)
            model = apply_lora(model, cfg.model.lora)
    ref = None
    if cfg.kl.coef > 0:   # another model than the trained one; rank k > 0 starts from another one still, so the
        # equality with one process shows that rank 0's reference reached every rank
        rank = dist.get_rank() if parallel != "none" else 0
        ref = frozen_copy(make_model(seed=2 + rank))
    teacher = frozen_copy(make_model(seed=3)) if cfg.distill.teacher is not None else None
    trainer = Trainer(model, cfg, ref_model=ref, teacher=teacher)
    metrics = [dict(trainer.step(b).metrics) for b in case_batches(batch_opts)]
    return {"metrics": metrics, "weights": {k: v.detach().clone() for k, v in _full_state(trainer).items()}}


def _full_state(trainer: Trainer) -> dict:
    if trainer.parallel is not None and trainer.parallel.mode == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return trainer.model.state_dict()


def spawn_worker(rank: int, world: int, port: int, out_dir: str, modes: list[str], names: list[str]) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for parallel in modes:
            results = {name: run_case(name, parallel) for name in names}
            torch.save(results, os.path.join(out_dir, f"{parallel}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
