"""Every experiment's tiny config is "configs/tiny.yaml + overrides" (covrl.experiment.presets). The hand-written
configs they replaced are kept here as the reference: the resolved TrainConfig must be the same, field by
field, so the move to the preset changes no experiment."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
from studies.async_gap import async_gap
from studies.lr_surge import lr_surge
from studies.otb import otb
from studies.tangent import tangent

from covrl.config import build_config, load_config, load_preset, preset_path

_TINY_MODEL = {"source": "tiny", "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4,
                                          "intermediate_size": 128, "max_positions": 64}}


def old_otb_config(arm, *, seed, s, sft_steps=None, steps=1):
    advantage, n = otb.ARMS[arm]
    return build_config({
        "run": {"name": f"{arm}-seed{seed}", "seed": seed, "num_threads": 1},
        "model": _TINY_MODEL,
        "task": {"name": "arithmetic", "chat_template": False, "n_train": 1000, "n_eval": 50},
        "sampler": {"temperature": 1.0, "max_new_tokens": s.max_new_tokens, "max_batch": 512,
                    "share_weights": "always"},
        "sft_warmup": {"steps": s.sft_steps if sft_steps is None else sft_steps, "lr": 3.0e-3, "batch_size": 64},
        "algorithm": {"advantage": advantage, "loss": "covariance"},
        "optim": {"lr": s.lr, "micro_batch_size": 512},
        "loop": {"steps": max(1, steps), "prompts_per_step": s.prompts_per_step, "group_size": n},
        "eval": {"before": False, "after": False},
        "checkpoint": {"at_end": False},
        "logging": {"console": False, "curves": False, "diagnostics": False},
    })


def old_surge_config(arm, *, seed, s, sft_steps=None):
    return build_config({
        "run": {"name": f"{arm}-seed{seed}", "seed": seed, "num_threads": 1},
        "model": _TINY_MODEL,
        "task": {"name": "arithmetic", "chat_template": False, "n_train": 1000, "n_eval": 50},
        "sampler": {"temperature": 1.0, "max_new_tokens": s.max_new_tokens, "max_batch": 128,
                    "dtype": "bfloat16", "share_weights": "never"},
        "sft_warmup": {"steps": s.sft_steps if sft_steps is None else sft_steps, "lr": 3.0e-3, "batch_size": 64},
        "algorithm": {"advantage": "grpo", "loss": "covariance"},
        "optim": {"lr": s.lr * (lr_surge.FLOOR if arm == "constant_floor" else 1.0), "micro_batch_size": 64},
        "loop": {"steps": s.steps, "prompts_per_step": s.prompts_per_step, "group_size": s.group_size},
        "lr_surge": {"enabled": arm == "surge", "trigger": "length", "warmup_steps": s.surge_warmup_steps,
                     "cooldown_steps": s.surge_cooldown_steps},
        "eval": {"before": False, "after": False},
        "checkpoint": {"at_end": False},
        "logging": {"console": False, "curves": False, "diagnostics": True},
    })


OLD_TANGENT_ARMS = {
    "covariance": {},
    "+score_centring": {"algorithm": {"score_centering": True}, "sampler": {"return_topk": tangent.CENTRING_TOPK}},
    "+token_tis": {"correction": {"is_level": "token", "is_threshold": tangent.TIS_THRESHOLD}},
    "+seq_mask_geometric": {"correction": {"rs": ["seq_mean_k1"], "rs_threshold": [tangent.GEOMETRIC_BAND]}},
}


def old_tangent_config(arm, *, seed, steps):
    data = {
        "run": {"name": arm, "seed": seed, "num_threads": 1},
        "model": _TINY_MODEL,
        "task": {"name": "arithmetic", "chat_template": False, "n_train": 1000, "n_eval": 50},
        "sampler": {"temperature": 1.0, "max_new_tokens": 4, "max_batch": 128, "share_weights": "never"},
        "sft_warmup": {"steps": 60, "lr": 3.0e-3, "batch_size": 64},
        "algorithm": {"advantage": "dr_grpo", "loss": "covariance"},
        "optim": {"lr": 1.0e-3, "micro_batch_size": 64},
        "loop": {"steps": max(1, steps), "prompts_per_step": 16, "group_size": 8},
        "eval": {"before": False, "after": False},
        "checkpoint": {"at_end": False},
        "logging": {"console": False, "curves": False},
    }
    for section, values in OLD_TANGENT_ARMS[arm].items():
        data.setdefault(section, {}).update(values)
    return build_config(data)


def old_async_gap_config(t, seed):
    overrides = {
        "run.seed": seed, "run.num_threads": 1, "model.source": "tiny", "model.tiny.hidden_size": t.hidden,
        "model.tiny.num_layers": t.layers, "model.tiny.num_heads": 4, "model.tiny.intermediate_size": 2 * t.hidden,
        "model.tiny.max_positions": 64, "task.name": "arithmetic", "task.chat_template": False,
        "task.n_train": 1000, "task.n_eval": 8, "sampler.max_new_tokens": 4, "sampler.max_batch": 128,
        "sft_warmup.steps": t.sft_steps, "sft_warmup.lr": 3e-3, "sft_warmup.batch_size": 64,
        "optim.micro_batch_size": 128, "eval.before": False, "eval.after": False, "logging.console": False,
        "logging.curves": False, "checkpoint.at_end": False, "loop.group_size": t.group_size,
        "algorithm.advantage": "grpo", "algorithm.loss": "covariance", "optim.max_grad_norm": None,
    }
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def old_async_bench_config(args, mode, run_root):
    over = {
        "run.output_dir": str(run_root), "run.name": f"bench-{mode}", "run.num_threads": args.threads,
        "loop.mode": "async" if mode == "process" else mode, "loop.steps": args.steps,
        "async_loop.local_backend": "process" if mode == "process" else "thread",
        "loop.prompts_per_step": args.prompts_per_step,
        "loop.group_size": args.group_size, "sampler.max_new_tokens": args.max_new_tokens,
        "sampler.max_batch": args.prompts_per_step * args.group_size, "sampler.share_weights": "never",
        "eval.before": False, "eval.after": False, "checkpoint.at_end": False, "logging.console": False,
        "logging.curves": False, "logging.diagnostics": True,
        "async_loop.max_staleness_steps": args.staleness, "async_loop.trainer_actor": False,
        "async_loop.sampler_cpus": 1, "async_loop.sampler_threads": args.threads,
        "task.n_eval": 50,   # task.n_eval's default then (now None: a generated task still holds out 50)
    }
    if args.chunk_prompts:
        over["async_loop.chunk_prompts"] = args.chunk_prompts
    over.update({"model.source": "tiny", "model.tiny.hidden_size": 128, "model.tiny.num_layers": 4,
                 "model.tiny.max_positions": 64, "task.chat_template": False, "sft_warmup.steps": args.sft_steps,
                 "optim.lr": 1e-3, "optim.micro_batch_size": 64})
    return load_config(None, [f"{k}={v}" for k, v in over.items()])


def old_train_helpers_config(tmp_path=None, **over):
    overrides = {
        "run.num_threads": 1, "model.source": "tiny",
        "model.tiny.hidden_size": 32, "model.tiny.num_layers": 1, "model.tiny.num_heads": 2,
        "model.tiny.intermediate_size": 64, "model.tiny.max_positions": 48,
        "task.name": "arithmetic", "task.chat_template": False, "task.n_train": 64, "task.n_eval": 8,
        "sampler.max_new_tokens": 4, "sft_warmup.steps": 3, "sft_warmup.batch_size": 16,
        "optim.lr": 3e-3, "optim.micro_batch_size": 32, "loop.steps": 3, "loop.prompts_per_step": 4,
        "loop.group_size": 4, "eval.max_prompts": 4, "eval.before": True, "eval.after": True,
        "logging.console": False, "logging.curves": False, "checkpoint.at_end": True,
    }
    if tmp_path is not None:
        overrides["run.output_dir"] = str(tmp_path)
    overrides.update(over)
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def old_time_to_accuracy_quick(model_folder: str, tmp_path: Path):
    import yaml

    base = yaml.safe_load(preset_path("tiny").read_text())
    base.update({"model": {"source": "hf", "path": model_folder},
                 "sft_warmup": {"steps": 0}, "loop": {"steps": 2, "prompts_per_step": 2, "group_size": 2},
                 "sampler": {"max_new_tokens": 4, "max_batch": 8}, "optim": {"micro_batch_size": 4}})
    base["task"] = {**base.get("task", {}), "chat_template": False, "n_train": 20, "n_eval": 4}
    path = tmp_path / "tiny-quick.yaml"
    path.write_text(yaml.safe_dump(base))
    return load_config(path)


def same(new, old) -> None:
    a, b = new.model_dump(), old.model_dump()
    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    assert not diff, diff
    assert a == b


def test_preset_path_finds_the_checkout_configs():
    assert preset_path("tiny").name == "tiny.yaml" and preset_path("tiny").is_file()
    assert preset_path("default").is_file()
    with pytest.raises(FileNotFoundError, match="no config preset 'nope'"):
        preset_path("nope")


def test_load_preset_without_overrides_is_the_yaml():
    same(load_preset("tiny"), load_config(preset_path("tiny")))


@pytest.mark.parametrize("settings", ["FAST", "FULL"])
def test_otb_arms(settings):
    s = getattr(otb, settings)
    for arm in otb.ARMS:
        for sft_steps, steps in ((None, 1), (0, s.token_budget)):
            same(otb.otb_config(arm, seed=3, s=s, sft_steps=sft_steps, steps=steps),
                 old_otb_config(arm, seed=3, s=s, sft_steps=sft_steps, steps=steps))


@pytest.mark.parametrize("settings", ["FAST", "FULL"])
def test_lr_surge_arms(settings):
    s = getattr(lr_surge, settings)
    for arm in lr_surge.ARMS:
        for sft_steps in (None, 0):
            same(lr_surge.surge_config(arm, seed=1, s=s, sft_steps=sft_steps),
                 old_surge_config(arm, seed=1, s=s, sft_steps=sft_steps))


def test_tangent_arms():
    for arm in tangent.ARMS:
        for steps in (1, 30):
            same(tangent.tiny_arm_config(arm, seed=2, steps=steps), old_tangent_config(arm, seed=2, steps=steps))


def test_async_gap_base():
    for t in (async_gap.TINY_FAST, async_gap.TINY_FULL):
        same(async_gap.tiny_base_config(t, seed=5), old_async_gap_config(t, seed=5))


def test_async_bench_tiny(tmp_path):
    from covrl.bench import async_bench

    parser = argparse.ArgumentParser()
    async_bench.configure(parser)
    for extra in ([], ["--chunk-prompts", "2"]):
        args = parser.parse_args(["--model", "tiny", *extra])
        for mode in ("sync", "async", "process"):
            same(async_bench._config(args, mode, tmp_path), old_async_bench_config(args, mode, tmp_path))


def test_train_helpers_tiny_cfg(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
    try:
        from train_helpers import tiny_cfg
    finally:
        sys.path.pop(0)
    same(tiny_cfg(), old_train_helpers_config())
    same(tiny_cfg(tmp_path, **{"loop.steps": 5, "algorithm.advantage": "grpo"}),
         old_train_helpers_config(tmp_path, **{"loop.steps": 5, "algorithm.advantage": "grpo"}))


def test_time_to_accuracy_quick(tmp_path):
    from studies.time_to_accuracy import time_to_accuracy

    same(time_to_accuracy.quick_config("/some/tiny-hf"), old_time_to_accuracy_quick("/some/tiny-hf", tmp_path))
