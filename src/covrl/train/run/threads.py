"""torch's CPU thread count for a run: `run.num_threads` (an int, `"auto"`, or None: leave torch's count as
it is, one thread per core in a fresh process), resolved and applied in one place (`apply_num_threads`) by
every entry point that builds a model for a run (`prepare_run`, `TrainingClient.from_config`, `covrl eval`,
the follower ranks of a distributed run, the Ray trainer actors).

Why `auto` looks at the machine: torch's default is one intra-op thread per core, and each op waits for all of
its threads. When other processes keep the cores busy, one of those threads is often descheduled and the others
spin until it returns: SmolLM2's forward+backward of 16 rows took 23.0 s with 2 threads against 5.5 s with 1
on a 2-core machine at load 4.7 (4.2x slower), and 6-44x slower at load 4.9-24 (docs/performance.md, "Threads").
So `auto` gives a process only the cores that look free:

    threads = max(1, (cores - round(load1 * cores / cpu_count) - reserved) // local_processes)

- `cores`: the CPUs this process may run on (`os.sched_getaffinity`); `cpu_count`: the machine's. The 1-minute
  load average counts runnable threads of the whole machine, so the share that falls on our cores is taken
  (the load is assumed spread over all CPUs); with no affinity mask the two are equal.
- `reserved`: cores this run's own sampler processes will take (async `local_backend: process`, or Ray sampler
  actors of a local Ray instance: `num_samplers x (sampler_threads or sampler_cpus)`); they start after the
  trainer, so the load average cannot see them yet.
- `local_processes`: trainer ranks sharing the machine (`LOCAL_WORLD_SIZE`, set by torchrun and, for a Ray
  trainer group, by covrl for the actors on one node).

Processes the run starts: torch's count covers this process only. A child sizes its thread pools from its
environment when it starts (OpenMP, MKL, OpenBLAS, the tokenizers' Rayon pool), before any code of ours runs
there, and by default takes one thread per core. So a resolved count is also put into this process's
environment (`thread_env`), which every process started afterwards inherits: vLLM's engine process, the
environment servers and harnesses (OpenEnv, verifiers), Ray's local instance. Sampler processes and Ray sampler
actors get their own budget, `async_loop.sampler_threads` (or `sampler_cpus`), the same way
(`sampler_thread_count`, `limit_process_threads` in the worker). With `run.num_threads: null` nothing is set.

The load average is read once, at start-up: a load that appears later is not followed (a run keeps one count,
the one its record names). It includes this process's own recent work, which is
negligible at start-up. Results depend on the thread count (float summation order), so the run records the
resolved count and where it came from (summary.json `num_threads`); pin an int for reproducible runs, as the
shipped configs do (`run.num_threads: 1`)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from covrl.settings.quiet import apply_engine_logs

AUTO = "auto"


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count a run uses and what decided it (recorded in summary.json)."""

    threads: int
    setting: int | str | None       # run.num_threads as configured
    auto: bool
    cores: int | None = None         # auto's inputs (None for a pinned count)
    cpu_count: int | None = None
    load1: float | None = None
    reserved: int | None = None
    local_processes: int | None = None

    def record(self) -> dict[str, Any]:
        return asdict(self)


def check_num_threads(value: Any, field: str | None = "run.num_threads") -> int | str | None:
    """`value` if it is a valid `run.num_threads` (a positive int, "auto" or None); else a ValueError naming
    `field` (None: the caller names it, as pydantic's error does)."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1024:
        return value
    what = "must be a thread count 1..1024, 'auto' or null (torch's default)"
    raise ValueError(what if field is None else f"{field} {what}; got {value!r}")


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # macOS / Windows: no affinity masks
        return os.cpu_count() or 1


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):   # Windows
        return None


def local_processes() -> int:
    """Trainer processes on this host sharing its cores: torchrun's LOCAL_WORLD_SIZE (1 when unset)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    try:
        return max(1, int(raw))
    except ValueError:
        return 1


def auto_threads(cores: int, cpu_count: int, load1: float | None, reserved: int = 0, local: int = 1) -> int:
    """The `auto` rule (module docstring): the free cores shared among the local trainer processes, at least 1."""
    busy = 0 if load1 is None else round(load1 * cores / max(cpu_count, cores))
    free = cores - busy - reserved
    return max(1, free // max(1, local))


def reserved_cores(cfg) -> int:
    """Cores this run's own sampler processes take on this host (they start after the trainer side resolves
    its thread count). 0 for in-process samplers (a sampler thread shares the trainer's torch threads) and for
    Ray actors on a cluster joined by address (their node is not known here)."""
    acfg = cfg.async_loop
    per_sampler = sampler_thread_count(acfg)
    mode = cfg.loop.mode
    if mode == "async" and acfg.local_backend == "process" and not acfg.emulate:
        return acfg.num_samplers * per_sampler
    if mode == "ray" and acfg.ray_address is None:
        return acfg.num_samplers * per_sampler
    return 0


def resolve_num_threads(setting: int | str | None, *, reserved: int = 0) -> ThreadChoice:
    """What `run.num_threads = setting` means on this host now (see the module docstring)."""
    import torch

    check_num_threads(setting)
    if setting is None:
        return ThreadChoice(threads=torch.get_num_threads(), setting=None, auto=False)
    if setting != AUTO:
        return ThreadChoice(threads=int(setting), setting=setting, auto=False)
    cores, cpu_count, load1, local = usable_cores(), os.cpu_count() or 1, load_average(), local_processes()
    return ThreadChoice(threads=auto_threads(cores, cpu_count, load1, reserved, local), setting=AUTO, auto=True,
                        cores=cores, cpu_count=cpu_count, load1=load1, reserved=reserved, local_processes=local)


# the thread pools of native libraries that a process sizes from its environment when it starts
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                   "VECLIB_MAXIMUM_THREADS", "RAYON_NUM_THREADS")


def thread_env(threads: int) -> dict[str, str]:
    """The environment that caps a process started with it at `threads` compute threads: OpenMP (torch's
    intra-op pool), MKL, OpenBLAS, numexpr, Accelerate, and Rayon (the tokenizers' batch encoding); with one
    thread the tokenizers' parallelism is off altogether (TOKENIZERS_PARALLELISM=false)."""
    n = str(int(threads))
    env = {k: n for k in THREAD_ENV_VARS}
    if int(threads) == 1:
        env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def sampler_thread_count(acfg) -> int:
    """Threads of each sampler process or Ray sampler actor: `async_loop.sampler_threads`, else its CPUs."""
    return acfg.sampler_threads or max(1, int(acfg.sampler_cpus))


def limit_process_threads(threads: int) -> None:
    """This process computes with `threads` threads, and the processes it starts from now on too: torch's
    intra-op count, its inter-op count where torch still allows it (only before the first parallel work), and
    `thread_env` in the environment they inherit."""
    import torch

    os.environ.update(thread_env(threads))
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    if threads != torch.get_num_interop_threads():
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:   # set once per process, before any inter-op work: an existing pool stays
            pass


def apply_num_threads(cfg) -> ThreadChoice:
    """Resolve `cfg.run.num_threads` (cfg: a TrainConfig) and set this process's thread count to it (torch's,
    and the environment the processes it starts inherit: `limit_process_threads`); returns the choice for the
    run record. The one place a run sets its thread count. Every entry point that builds a run calls it
    first, so it also applies the run's `logging.engine_logs` (covrl.settings.quiet)."""
    apply_engine_logs(cfg.logging.engine_logs)
    choice = resolve_num_threads(cfg.run.num_threads, reserved=reserved_cores(cfg))
    if choice.setting is not None:
        limit_process_threads(choice.threads)
    return choice
