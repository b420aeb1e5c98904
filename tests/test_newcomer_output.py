"""What a run prints: the engines' own logs quiet by default and shown with `logging.engine_logs` (errors always),
progress bars only on a terminal, and plain step lines (no terminal) at most one per `logging.plain_every_s`
plus the first and the last step."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from covrl.config import ConfigError, load_config
from covrl.settings import quiet
from covrl.train.run.sinks import ConsoleSink

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^step \d+/\d+ ", re.M)


@pytest.fixture(autouse=True)
def _restore_output_rules(monkeypatch):
    """apply_engine_logs changes this process's loggers, variables and tqdm's default: all put back after."""
    for key in (*quiet.engine_log_env("debug", bars=False), "TORCH_DISTRIBUTED_DEBUG"):
        monkeypatch.setenv(key, os.environ.get(key, "")) if key in os.environ else monkeypatch.delenv(key, raising=False)
    levels = {name: logging.getLogger(name).level for name in quiet.ENGINE_LOGGERS}
    bars = quiet.progress_bars_enabled()
    yield
    quiet.set_progress_bars(bars)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


# ------------------------------------------------------------------------------------------- engine logs

@pytest.mark.parametrize(("setting", "level"), [("quiet", logging.ERROR), ("info", logging.INFO),
                                                ("debug", logging.DEBUG)])
def test_the_setting_maps_to_the_engines_levels(setting, level):
    env = quiet.apply_engine_logs(setting, bars=False)
    for name in ("vllm", "ray", "transformers", "huggingface_hub", "datasets", "torch.distributed"):
        assert logging.getLogger(name).getEffectiveLevel() == level, name
    # what a module imported later, and a child process, reads
    name = logging.getLevelName(level)
    assert os.environ["VLLM_LOGGING_LEVEL"] == env["VLLM_LOGGING_LEVEL"] == name
    assert os.environ["TRANSFORMERS_VERBOSITY"] == os.environ["HF_HUB_VERBOSITY"] == name.lower()
    import transformers.utils.logging as hf_logging

    assert hf_logging.get_verbosity() == level


def test_quiet_hides_warnings_and_shows_errors():
    quiet.apply_engine_logs("quiet", bars=False)
    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    engine = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    engine.addHandler(handler)
    try:
        engine.warning("RotaryEmbedding: Failed to load weights")
        engine.error("the engine failed")
        quiet.apply_engine_logs("info", bars=False)
        engine.info("shown with info")
    finally:
        engine.removeHandler(handler)
    assert seen.getvalue().splitlines() == ["the engine failed", "shown with info"]


def test_the_config_field_and_its_error():
    assert load_config(None, []).logging.engine_logs == "quiet"
    assert load_config(None, ["logging.engine_logs=debug"]).logging.engine_logs == "debug"
    with pytest.raises(ConfigError, match="logging.engine_logs"):
        load_config(None, ["logging.engine_logs=loud"])
    with pytest.raises(ValueError, match="logging.engine_logs"):
        quiet.engine_log_level("loud")


# ---------------------------------------------------------------------------------------- progress bars

def test_progress_bars_off_without_a_terminal_and_back():
    from tqdm import tqdm
    from tqdm.auto import tqdm as auto_tqdm  # what transformers' GGUF conversion draws with

    quiet.apply_engine_logs("quiet", bars=False)
    assert tqdm(range(2)).disable and auto_tqdm(range(2)).disable and not quiet.progress_bars_enabled()
    assert os.environ["TQDM_DISABLE"] == os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"   # for children
    assert not tqdm(range(2), disable=False).disable   # a caller's explicit choice stays
    quiet.apply_engine_logs("quiet", bars=True)
    assert quiet.progress_bars_enabled() and "TQDM_DISABLE" not in os.environ
    assert not tqdm(range(2), file=io.StringIO()).disable


def test_a_model_load_without_a_terminal_draws_no_bar(monkeypatch):
    from tqdm.auto import tqdm as auto_tqdm

    quiet.apply_engine_logs("quiet", bars=True)
    monkeypatch.setattr(sys, "stdout", io.StringIO())   # not a terminal
    with quiet.progress_bars_for_stdout():
        assert auto_tqdm(range(2)).disable
    assert quiet.progress_bars_enabled()   # the process's rule afterwards is unchanged


# ------------------------------------------------------------------------------------- plain step lines

class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _lines(sink_out: io.StringIO) -> list[int]:
    return [int(m) for m in re.findall(r"^step (\d+)/", sink_out.getvalue(), re.M)]


def test_plain_lines_first_last_and_one_per_period():
    out, clock = io.StringIO(), FakeClock()
    sink = ConsoleSink(400, stream=out, every_s=10.0, clock=clock)
    for step in range(1, 401):   # 0.1 s per step: 40 s in all
        clock.now += 0.1
        sink.write({"step": step, "reward/mean": 0.5})
    sink.close()
    steps = _lines(out)
    assert steps[0] == 1 and steps[-1] == 400
    assert len(steps) <= 2 + 40 / 10, steps
    gaps = [b - a for a, b in zip(steps[1:-2], steps[2:-1])]
    assert all(g >= 99 for g in gaps), steps   # 10 s apart = 100 steps


def test_every_step_with_zero_and_a_stopped_run_shows_where_it_stopped():
    out = io.StringIO()
    sink = ConsoleSink(5, stream=out, every_s=0.0, clock=FakeClock())
    for step in range(1, 6):
        sink.write({"step": step})
    assert _lines(out) == [1, 2, 3, 4, 5]
    out, clock = io.StringIO(), FakeClock()
    sink = ConsoleSink(400, stream=out, every_s=10.0, clock=clock)
    for step in range(1, 8):
        sink.write({"step": step})
    sink.message("eval at step 7")   # a message follows the step it is about
    sink.write({"step": 8})
    sink.close()   # stopped early: the last step is printed at close
    assert _lines(out) == [1, 7, 8]
    assert out.getvalue().splitlines()[2] == "eval at step 7"


def test_a_piped_run_prints_a_bounded_number_of_step_lines(tmp_path):
    """A tiny `covrl train` of 40 steps with stdout to a pipe (CI, nohup): a few step lines, not 40."""
    cmd = [sys.executable, "-m", "covrl", "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
           f"run.output_dir={tmp_path}", "loop.steps=40", "sft_warmup.steps=0", "eval.max_prompts=8",
           "eval.before=false", "logging.curves=false", "checkpoint.at_end=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = STEP_LINE.findall(done.stdout)
    assert 2 <= len(steps) <= 8, done.stdout   # first, last, one per 10 s of a run of a few seconds
    assert "step 1/40" in done.stdout and "step 40/40" in done.stdout and "done: 40 steps" in done.stdout
    assert "Traceback" not in done.stderr and "it/s]" not in done.stderr


@pytest.mark.slow   # a long end-to-end run: make test-slow (the default suite stays near 10 minutes)
@pytest.mark.ray
def test_a_ray_trainer_actor_run_ends_with_its_summary_on_the_drivers_screen(tmp_path):
    """The trainer side in a Ray actor: its last lines can be lost as Ray shuts down, so the driver prints the
    final summary itself, once."""
    pytest.importorskip("ray")
    cmd = [sys.executable, "-m", "covrl", "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
           f"run.output_dir={tmp_path}", "loop.steps=2", "sft_warmup.steps=0", "eval.max_prompts=4",
           "loop.mode=ray", "async_loop.trainer_actor=true", "async_loop.sampler_cpus=1",
           "async_loop.trainer_cpus=1", "logging.curves=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("done: 2 steps") == 1, done.stdout
    assert "held-out accuracy  after" in done.stdout and "Traceback" not in done.stderr


# ------------------------------------------------------------------------------------------ vLLM's own logs

def _vllm_python() -> Path | None:
    py = ROOT / ".venv-vllm" / "bin" / "python"
    return py if py.is_file() and (ROOT / ".venv-vllm" / ".covrl-installed").is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_vllm_python() is None, reason="needs .venv-vllm (scripts/setup_vllm_env.sh)")
def test_a_vllm_run_is_quiet_by_default_and_verbose_on_request(tmp_path):
    """sampler.backend=vllm (the CPU build): by default nothing of vLLM's start-up and weight-push warnings (the
    chat-template warm-up traceback, 'Failed to load weights'); with logging.engine_logs=info they show. About
    20-40 s per run on a 2-core machine."""
    base = [str(_vllm_python()), "-m", "covrl", "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
            f"run.output_dir={tmp_path}", "model.tiny.num_heads=2", "model.tiny.max_positions=256",
            "task.n_train=64", "task.n_eval=8", "sampler.backend=vllm", f"sampler.vllm.model_cache={tmp_path}/cache",
            "sft_warmup.steps=0", "loop.steps=3", "loop.prompts_per_step=4", "loop.group_size=4",
            "eval.max_prompts=4", "logging.curves=false", "checkpoint.at_end=false"]
    runs = {}
    for setting in ("quiet", "info"):
        done = subprocess.run([*base, f"run.name={setting}", f"logging.engine_logs={setting}"], capture_output=True,
                              text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[setting] = done.stdout + done.stderr
    assert "Traceback" not in runs["quiet"] and "Failed to load weights" not in runs["quiet"], runs["quiet"]
    assert "done: 3 steps" in runs["quiet"]
    assert "Failed to load weights" in runs["info"]   # the same run shows vLLM's own lines when asked
