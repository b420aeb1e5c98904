"""Data-parallel and sharded training on torch.distributed: the trainer's `trainer` config section, the process
group from the torchrun environment, whole-group shards of a batch, the model wrappers (DDP, FSDP2) and the
leader → follower channel.

The contract (docs/distributed.md): every rank calls `Trainer.step` with the SAME full ScoredBatch (in a run,
rank 0 generates it and broadcasts it over `Channel`); each rank forwards and backwards only its shard of whole
groups, while the normaliser, the group statistics and the metrics are those of the full batch.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field, field_validator, model_validator
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from covrl.models.compiled import CompileBackend
from covrl.models.precision import AUTOCAST_MODES
from covrl.settings import Section, known_name
from covrl.train.parallel import shards

__all__ = ["DCP_DIR", "DCP_KEY", "Channel", "Parallel", "TrainerConfig", "carry_optimizer_state", "free_port", "full_model_state",
           "init_process_group", "apply_optimizer_state", "load_sharded", "save_sharded", "shard_rows"]


class TrainerConfig(Section):
    parallel: Literal["none", "ddp", "fsdp2"] = Field(
        "none", description="data-parallel trainer over torch.distributed (launch with torchrun): none (one "
                            "process), ddp (DistributedDataParallel), fsdp2 (fully_shard); docs/distributed.md")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="process-group backend (auto: nccl on "
                                                                         "cuda, gloo on cpu)")
    timeout_s: float = Field(1800.0, gt=0, description="collective timeout: a rank waits this long for the "
                                                       "others (rank 0's eval and checkpoints included)")
    world_size: int | None = Field(
        None, ge=1, description="trainer ranks: under loop.mode=ray the number of trainer actors Ray starts (None: "
                                "1); under torchrun its --nproc-per-node x --nnodes (None: take it; a number must "
                                "match)")

    autocast: Annotated[str, known_name(AUTOCAST_MODES, "autocast mode")] = Field(
        "none", description="mixed precision of the trainer's forward+backward (covrl.models.precision): none "
                            "(the model's dtype), bf16 (torch.autocast to bfloat16 with fp32 master weights and "
                            "AdamW; log-probs, entropy and Σπ² in fp32 from the upcast logits), bf16_fp32_head "
                            "(the same with the LM head in fp32: logits not rounded to bf16). Also the KL "
                            "reference's forward; not the sampler, eval or SFT warm-up; docs/performance.md")

    truncation: Literal["auto", "full", "replay"] = Field(
        "auto", description="the trainer's distribution on rollouts of a truncating sampler (sampler.top_k / "
                            "top_p / min_p): replay (π restricted to the sampler's kept set and renormalised: "
                            "exact ratios, docs/theory.md §12), full (the full softmax: every ratio biased by "
                            "the kept mass; warned at start-up), auto (replay when the sampler truncates)")

    packing: bool = Field(
        False, description="sequence packing: each micro-batch's rows run as one sequence without padding "
                           "(block attention mask, per-segment positions; a group's prompt once when "
                           "optim.share_prompts), micro-batches chosen by trainer.packing_tokens instead of "
                           "optim.micro_batch_size")
    packing_tokens: int = Field(4096, ge=1, description="token budget of a packed micro-batch (prompt and response "
                                                        "tokens; whole groups, a larger group goes alone)")

    compile: bool = Field(
        False, description="torch.compile (dynamic shapes) of the trainer's forward+backward; one process only "
                           "(trainer.parallel=none); runs the per-row pass (prompts not shared); the first steps pay "
                           "the compile, logged as time/compile_s (docs/performance.md)")
    compile_backend: CompileBackend = Field(
        "inductor", description="torch.compile backend with trainer.compile: inductor (kernels; needs a C++ "
                                "compiler on CPU), aot_eager / eager (capture only, eager kernels: tests, debugging)")

    @field_validator("parallel", "autocast", mode="before")
    @classmethod
    def _none_is_a_name(cls, v):
        return "none" if v is None else v   # YAML reads `parallel: none` as null

    @model_validator(mode="after")
    def _compile_alone(self):
        if self.compile and self.packing:
            raise ValueError("trainer.compile=true and trainer.packing=true together are not supported: the "
                             "packed sequence changes length every step (compile the padded per-row pass)")
        if self.compile and self.parallel != "none":
            raise ValueError(f"trainer.compile=true runs with trainer.parallel=none only (got "
                             f"{self.parallel!r}): the DDP / FSDP2 wrappers are not compiled")
        return self


def init_process_group(cfg: TrainerConfig, device: str = "cpu") -> tuple[int, int]:
    """Join (or create) the default process group: torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR/PORT) when
    set, else a group of one on a free loopback port. Returns (rank, world size)."""
    if not dist.is_initialized():
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        if "WORLD_SIZE" in os.environ:
            if cfg.world_size is not None and cfg.world_size != int(os.environ["WORLD_SIZE"]):
                raise ValueError(f"trainer.world_size={cfg.world_size} but the launcher started "
                                 f"{os.environ['WORLD_SIZE']} ranks (WORLD_SIZE)")
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            _rendezvous(lambda: dist.init_process_group(backend, timeout=timeout), cfg.timeout_s)
        else:
            if (cfg.world_size or 1) > 1:
                raise ValueError(f"trainer.world_size={cfg.world_size} needs a launcher that starts the ranks: "
                                 "torchrun --nproc-per-node N, or loop.mode=ray (docs/distributed.md)")
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


class RendezvousError(RuntimeError):
    """The ranks of a launch did not all arrive at the process group's rendezvous."""


def _rendezvous(join, timeout_s: float) -> None:
    """`join()` the launcher's process group; while it waits, say so once (after a third of the timeout, at
    most 30 s), and when it gives up, say what it waited for and what to check."""
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    done = threading.Event()

    def notice() -> None:
        if not done.wait(min(30.0, timeout_s / 3)):
            print(f"warning: rank {rank} of {world} is waiting at {where} for the other ranks to join (gives up "
                  f"after trainer.timeout_s={timeout_s:g} s)", file=sys.stderr, flush=True)
    threading.Thread(target=notice, name="covrl-rendezvous", daemon=True).start()
    try:
        join()
    except Exception as err:  # noqa: BLE001 - torch's store errors name neither the ranks nor the cause
        raise RendezvousError(
            f"rank {rank} of {world}: the other ranks did not join at {where} within trainer.timeout_s="
            f"{timeout_s:g} s ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Check that "
            "the launcher started every rank (torchrun --nproc-per-node / --nnodes), that MASTER_ADDR is "
            "reachable from every node and MASTER_PORT is free there") from err
    finally:
        done.set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a process group's rendezvous: MASTER_PORT)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def shard_rows(group_ids: torch.Tensor, world: int, rank: int) -> list[int]:
    """The rows of `rank`'s shard: whole groups (every group statistic is then computed on one rank, no
    all-reduce), contiguous in order of first appearance, balanced by rows (a group goes to the rank whose
    share of the rows holds its midpoint). A rank may get none (fewer groups than ranks)."""
    groups: dict[int, list[int]] = {}
    for row, gid in enumerate(group_ids.tolist()):
        groups.setdefault(int(gid), []).append(row)
    total = len(group_ids)
    out: list[int] = []
    before = 0
    for rows in groups.values():
        if min(world - 1, (world * (2 * before + len(rows))) // (2 * total)) == rank:
            out += rows
        before += len(rows)
    return out


@dataclass
class Parallel:
    """The trainer's view of the group: rank, world size, mode and the module that runs forward (the DDP
    wrapper, or the fully_shard-ed model itself)."""

    mode: str
    rank: int
    world: int
    module: Any
    _local_gradients: Any = field(default=None, repr=False)   # read by DDP's comm hook during a backward

    @classmethod
    def wrap(cls, model, mode: str) -> Parallel:
        """Wrap `model` (a collective: every rank calls it; rank 0's weights are broadcast to the others)."""
        if not dist.is_initialized():
            raise RuntimeError(f"trainer.parallel={mode} needs a torch.distributed process group: launch with "
                               "`torchrun --nproc-per-node N -m covrl train ...` (docs/distributed.md)")
        device = next(model.parameters()).device
        if mode == "ddp":
            # forward_sync_buffers=False: no collective per forward, so ranks may run different numbers of forwards
            # (a shared-prompt micro-batch runs two); the buffers (rotary tables) are constants
            module = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False)
        elif mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            cls.broadcast_module(model)   # fully_shard does not broadcast: start every rank from rank 0's weights
            base = model.get_base_model() if hasattr(model, "get_base_model") else model   # under peft's wrapper
            layers = getattr(getattr(base, "model", None), "layers", None)
            for layer in layers if layers is not None else []:
                fully_shard(layer)
            module = fully_shard(model)
        else:
            raise ValueError(f"trainer.parallel={mode!r}; allowed: none, ddp, fsdp2")
        return cls(mode, dist.get_rank(), dist.get_world_size(), module)

    @staticmethod
    def broadcast_module(module) -> None:
        """Rank 0's parameters into every rank's `module`, in place (a collective)."""
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool):
        """Accumulate locally (no communication) unless `sync`: the last micro-batch reduces the sum."""
        if self.mode == "ddp":
            with contextlib.nullcontext() if sync else self.module.no_sync():
                yield
        else:
            self.module.set_requires_gradient_sync(sync)
            yield

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        dist.all_reduce(x, op=op)
        return x

    def max_count(self, n: int) -> int:
        return int(self.all_reduce(torch.tensor([n], dtype=torch.long), dist.ReduceOp.MAX)[0])

    def pad_plan(self, plan: list) -> list:
        """Every rank runs as many micro-batches (DDP / FSDP2 need the same sequence of synced backward passes):
        a rank with fewer gets idle ones (None) at the end."""
        return plan + [None] * (self.max_count(len(plan)) - len(plan))

    def gather_objects(self, obj: Any) -> list[Any]:
        """`obj` of every rank, in rank order (a collective)."""
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, obj)
        return parts

    def watch_local_gradients(self) -> None:
        """DDP: in a `backward(loss, local_gradients=reader)`, give `reader.from_bucket(bucket)` each bucket's
        local (not yet averaged) gradients before DDP's own averaging all-reduce: what a rank contributed,
        without an extra backward."""
        def hook(_state, bucket):
            if self._local_gradients is not None:
                self._local_gradients.from_bucket(bucket)
            return allreduce_hook(None, bucket)

        self.module.register_comm_hook(None, hook)

    def backward(self, loss: torch.Tensor, *, local_gradients: Any = None) -> None:
        """Backward of a rank's loss share times the world size: DDP / FSDP2 average the ranks' gradients, and the
        shares must add up. `local_gradients` (with `watch_local_gradients`): reads this rank's own gradients in
        the comm hook of a synced backward."""
        self._local_gradients = local_gradients
        try:
            (loss * self.world).backward()
        finally:
            self._local_gradients = None

    def reduce_step_pieces(self, tensors: list[torch.Tensor], loss_total: float, bad: str | None,
                           loss_metrics: dict[str, float]) -> tuple[float, str | None, dict[str, float]]:
        """Sum over ranks (in place) the per-row tensors that each rank filled for its rows only (zeros
        elsewhere, so the sum is exact), the loss and its share-weighted metrics (extremes: max / min), and
        whether any rank met a non-finite loss."""
        stacked = self.all_reduce(torch.stack(tensors))
        for t, total in zip(tensors, stacked):
            t.copy_(total)
        keys = sorted(k for k in loss_metrics if not k.endswith(("_max", "_min")))   # the same on every rank:
        extreme = sorted(k for k in loss_metrics if k.endswith(("_max", "_min")))   # idle ranks compute them too
        sums = self.all_reduce(torch.tensor([loss_total, float(bad is not None)] + [loss_metrics[k] for k in keys],
                                            dtype=torch.float64))
        sign = [1.0 if k.endswith("_max") else -1.0 for k in extreme]   # a min is minus the max of minus
        maxes = self.all_reduce(torch.tensor([s * loss_metrics[k] for s, k in zip(sign, extreme)] or [0.0],
                                             dtype=torch.float64), dist.ReduceOp.MAX)
        if sums[1] > 0 and bad is None:
            bad = "non-finite loss in a micro-batch of another rank"
        out = dict(zip(keys, sums[2:].tolist()))
        out.update({k: s * float(v) for s, k, v in zip(sign, extreme, maxes)})
        return float(sums[0]), bad, out


def full_model_state(model) -> dict[str, torch.Tensor]:
    """The whole model's weights from a fully_shard-ed model, on rank 0's CPU (a collective: every rank calls it;
    the other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# a checkpoint's sharded state: the folder in it, and trainer_state's {"dcp": folder} in place of an optimizer state
# kept in the shards
DCP_DIR = "dcp"
DCP_KEY = "dcp"


def save_sharded(model, optimizer, directory) -> None:
    """Weights and optimizer state as torch.distributed.checkpoint shards in `directory` (a collective: every
    rank writes its own shards; rank 0 the metadata, last). FQN-keyed, so any world size can load them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": msd, "optim": osd}, storage_writer=shards.writer(str(directory)))
    except dcp.api.CheckpointException as err:   # a BaseException, raised on every rank, with every rank's failure
        raise shards.failure(err) from None   # an OSError for a full disk / read-only folder: exit 4


def load_sharded(model, optimizer, directory, *, alone: bool) -> None:
    """Load `save_sharded`'s folder into `model` and `optimizer` as they are now: fully_shard-ed (a collective,
    each rank reads its shards) or plain (`alone`: this process reads the full tensors, no collective).
    DCP reshards, so the saving world size does not matter; values are copied exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    own = _kernel_flags(optimizer)
    msd, osd = get_state_dict(model, optimizer)   # (creates the optimizer state to load into)
    with warnings.catch_warnings():   # `alone` is meant: not DCP's "assuming a single process" warning
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        try:
            dcp.load({"model": msd, "optim": osd}, storage_reader=shards.reader(str(directory)), no_dist=alone)
        except dcp.api.CheckpointException as err:   # a BaseException: would pass every handler of the run
            raise shards.failure(err, f"read from {directory}") from None
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    _set_kernel_flags(optimizer, own)


def carry_optimizer_state(model, optimizer):
    """The plain optimizer's state, FQN-keyed and full, to move onto the optimizer of the model once
    fully_shard-ed (`apply_optimizer_state`): a resume from a one-process or DDP checkpoint (1 -> N)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def apply_optimizer_state(model, optimizer, state) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    own = _kernel_flags(optimizer)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    _set_kernel_flags(optimizer, own)


_KERNEL_FLAGS = ("fused", "foreach")


def _kernel_flags(optimizer) -> list[dict]:
    return [{k: g.get(k) for k in _KERNEL_FLAGS} for g in optimizer.param_groups]


def _set_kernel_flags(optimizer, flags: list[dict]) -> None:
    # a loaded param group brings the saver's kernel choice (FSDP2's DTensors: not fused); keep this one's
    for group, own in zip(optimizer.param_groups, flags):
        group.update(own)


class Channel:
    """Rank 0 → every other rank: pickled commands over the default group (broadcast_object_list). In a run
    the leader sends ("start", trainer state), then ("step", batch) per step, ("gather", _) / ("checkpoint",
    folder) for FSDP2's weights and shards, and ("stop", exit code); it calls `close()` when it has done its
    part of a step / gather / checkpoint (`open` names the command until then)."""

    def __init__(self) -> None:
        self.open: str | None = None   # (leader) the command whose collectives every rank is in now
        self.deferred: Any = None      # (leader) a call postponed until they end (a SIGTERM: launch.ranks)

    def send(self, message: Any) -> None:
        if dist.get_world_size() > 1:
            self.open = message[0]   # (the broadcast itself is two collectives)
            dist.broadcast_object_list([message], src=0)
            if message[0] in ("start", "stop"):   # no collective follows them
                self.close()

    def close(self) -> None:
        """The leader finished the collectives of the command it sent last: run what was postponed meanwhile.
        A leader that left them midway (an exception) would leave the others waiting inside them, where no
        later message can reach them."""
        self.open = None
        if self.deferred is not None:
            deferred, self.deferred = self.deferred, None
            deferred()

    def recv(self) -> Any:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
