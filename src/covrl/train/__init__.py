"""covrl.train: training runs, in rooms that each do one job.

    launch/   how `covrl train` runs a config: loop modes, exit codes, torchrun ranks, Ray, the CLI commands
    config    the run's config (TrainConfig), composing every room's section
    asyncrl/  the asynchronous sampler side: staleness queue, thread / process / Ray pools
    run/      everything around the loop: the driver, rollout sources, the prompt stream, evaluation, the run
              folder, checkpoints, sinks, plots, threads
    step/     one optimisation step (Trainer), the algorithm bound once, lr rules, the supervised warm-up
    parallel/ rank mechanics on torch.distributed: shards of a batch, DDP / FSDP2 wrappers, sharded state
    faults    fault points for the reliability tests

Other layers import what they need from `covrl.train` (the names below), not from its rooms. The names resolve
on first use, so `covrl --help` and the config loader do not import torch.
"""

from __future__ import annotations

from covrl._lazy import lazy_exports

# public name -> the room's module that defines it
_PUBLIC: dict[str, str] = {
    # the step
    "Trainer": "covrl.train.step.trainer",
    "TrainingDivergedError": "covrl.train.step.trainer",
    "forward_batch": "covrl.train.step.micro_step",
    "micro_step": "covrl.train.step.micro_step",
    "collect": "covrl.train.step.micro_step",
    "LossTerms": "covrl.train.step.micro_step",
    "Prepared": "covrl.train.step.micro_step",
    "truncation_replay": "covrl.train.step.micro_step",
    "build_adamw": "covrl.train.step.optimizer",
    "batch_metrics": "covrl.train.step.trainer",
    "StepResult": "covrl.train.step.results",
    "fold_micro_metrics": "covrl.train.step.micro",
    "mean_over": "covrl.train.step.micro",
    "micro_batch_share": "covrl.train.step.micro",
    "pad_cols": "covrl.train.step.micro",
    "sft_warmup": "covrl.train.step.sft",
    "LagContext": "covrl.train.step.batch_scaling",
    "lr_for_batch": "covrl.train.step.batch_scaling",
    "momentum_drift_factor": "covrl.train.step.batch_scaling",
    # the config
    "TrainConfig": "covrl.train.config",
    "build_config": "covrl.train.config",
    "load_config": "covrl.train.config",
    # the run
    "Run": "covrl.train.run.folder",
    "prepare_run": "covrl.train.run.folder",
    "seed_everything": "covrl.train.run.components",
    "resolve_device": "covrl.train.run.components",
    "Components": "covrl.train.run.components",
    "build_components": "covrl.train.run.components",
    "versions": "covrl.train.run.provenance",
    "git_state": "covrl.train.run.provenance",
    "run_loop": "covrl.train.run.driver",
    "train_sync": "covrl.train.run.driver",
    "RolloutSource": "covrl.train.run.sources",
    "SourceBatch": "covrl.train.run.sources",
    "score_rollouts": "covrl.train.run.sources",
    "by_group_sizes": "covrl.train.run.sources",
    "choose_prompts": "covrl.train.run.sources",
    "observe_selection": "covrl.train.run.sources",
    "DataStream": "covrl.train.run.stream",
    "evaluate": "covrl.train.run.evaluate",
    "JsonlSink": "covrl.train.run.sinks",
    "read_jsonl": "covrl.train.run.sinks",
    "apply_num_threads": "covrl.train.run.threads",
    "check_num_threads": "covrl.train.run.threads",
    "resolve_num_threads": "covrl.train.run.threads",
    "CheckpointError": "covrl.train.run.checkpoint",
    "MODEL_DIR": "covrl.train.run.checkpoint",
    "save_checkpoint": "covrl.train.run.checkpoint",
    "load_state": "covrl.train.run.checkpoint",
    "latest_checkpoint": "covrl.train.run.checkpoint",
    "read_model_weights": "covrl.train.run.checkpoint",
    "apply_model_weights": "covrl.train.run.checkpoint",
    "load_model_weights": "covrl.train.run.checkpoint",
    # the asynchronous loops
    "AsyncLoopConfig": "covrl.train.asyncrl.config",
    "prepare_async_run": "covrl.train.asyncrl.source",
    "train_async": "covrl.train.asyncrl.source",
    "build_async_sampler": "covrl.train.asyncrl.source",
    "ensure_ray": "covrl.train.asyncrl.ray_pool",
    "start_sampler_actors": "covrl.train.asyncrl.ray_pool",
    "train_ray": "covrl.train.asyncrl.ray_pool",
    # ranks
    "Channel": "covrl.train.parallel.wrappers",
    "free_port": "covrl.train.parallel.wrappers",
    # launch
    "train_from_config": "covrl.train.launch.modes",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_exports(__name__, _PUBLIC)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])

