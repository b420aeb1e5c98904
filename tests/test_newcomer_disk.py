"""What a newcomer's first commands leave behind: benchmarks write under runs/ (the committed baselines change only
with --update-baseline), a run keeps one checkpoint and reports its disk use, a small data file keeps most of
its rows for training, and held-out prompts that repeat training prompts are counted and announced."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from covrl.bench import BENCHES
from covrl.bench.common import BASELINES, RESULTS, output_dir
from covrl.config import ConfigError, load_config
from covrl.tasks import TASKS, Example, Task, TaskConfig, build_task

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"
TIMES = ROOT / "examples" / "times_table.jsonl"


# ------------------------------------------------------------------------------------------------ benchmarks

def _parse(name: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    importlib.import_module(BENCHES[name]).configure(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_writes_under_runs_unless_asked_to_update_the_baseline(name):
    assert output_dir(_parse(name)) == RESULTS == Path("runs/bench")
    assert output_dir(_parse(name, "--update-baseline")) == BASELINES == Path("benchmarks")
    assert output_dir(_parse(name, "--out", "elsewhere")) == Path("elsewhere")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def test_a_bench_run_leaves_the_checkout_clean(tmp_path):
    """`covrl bench explore` (the cheapest) in a checkout holding the committed baselines: git status stays clean,
    the result lands in runs/bench/explore/ and the output says so; --update-baseline replaces the baseline."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "checkout"
    repo.mkdir()
    shutil.copytree(ROOT / "benchmarks", repo / "benchmarks")
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "baselines")
    argv = [sys.executable, "-m", "covrl", "bench", "explore", "--dims", "4", "--steps", "3", "--arms", "5"]
    done = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _git(repo, "status", "--porcelain") == "", "a bench run changed tracked files"
    written = sorted((repo / "runs" / "bench" / "explore").glob("*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["name"] == "explore"
    assert f"results: {Path('runs/bench/explore') / written[0].name}" in done.stdout, done.stdout
    assert "committed baseline" in done.stdout and "unchanged (--update-baseline replaces it)" in done.stdout
    assert (repo / "runs" / "bench" / "README.md").read_text().startswith("# Benchmark results")

    done = subprocess.run([*argv, "--update-baseline"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    changed = _git(repo, "status", "--porcelain").split()
    assert f"benchmarks/explore/{written[0].name}" in changed and "benchmarks/README.md" in changed, changed
    assert "baseline updated: benchmarks/explore/" in done.stdout


# ------------------------------------------------------------------------------------------- disk of a run

def _tiny(tmp_path: Path, **over):
    from covrl.config import load_preset

    overrides = {"run.output_dir": str(tmp_path), "model.tiny.hidden_size": 32, "model.tiny.num_layers": 1,
                 "model.tiny.num_heads": 2, "model.tiny.intermediate_size": 64, "model.tiny.max_positions": 48,
                 "task.arithmetic.num_terms": 2, "task.n_train": 64, "task.n_eval": 8, "sampler.max_batch": 64,
                 "sft_warmup.steps": 0, "optim.micro_batch_size": 32, "loop.steps": 3, "loop.prompts_per_step": 4,
                 "loop.group_size": 4, "eval.before": False, "eval.after": False, "logging.console": False,
                 "logging.curves": False}
    overrides.update(over)
    return load_preset("tiny", overrides)


def test_a_run_keeps_one_checkpoint_by_default_and_records_its_disk_use(tmp_path):
    from covrl.train.run import checkpoint as ckpt
    from covrl.train.run.driver import train_sync
    from covrl.train.run.folder import prepare_run

    torch.set_num_threads(1)
    cfg = _tiny(tmp_path, **{"run.name": "kept", "checkpoint.every_rollouts": 16})
    assert cfg.checkpoint.keep_last == 1 and cfg.checkpoint.final == "full"
    run = prepare_run(cfg, console=False)
    summary = train_sync(run)
    run.close()
    run_dir = tmp_path / "kept"
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [ckpt.checkpoint_name(48)]   # what resume needs
    saved = json.loads((run_dir / "summary.json").read_text())
    latest = run_dir / "checkpoints" / ckpt.checkpoint_name(48)
    assert saved["checkpoint"] == {"path": str(latest), "bytes": ckpt.folder_bytes(latest), "kind": "full",
                                   "resumable": True}
    assert saved["disk_bytes"] >= saved["checkpoint"]["bytes"] > 0 and summary["disk_bytes"] == saved["disk_bytes"]
    # the number is the folder's: within the summary file's own size of a fresh count
    assert abs(ckpt.folder_bytes(run_dir) - saved["disk_bytes"]) < (run_dir / "summary.json").stat().st_size
    # keep_last=2 keeps an older checkpoint to fall back on
    cfg = _tiny(tmp_path, **{"run.name": "two", "checkpoint.every_rollouts": 16, "checkpoint.keep_last": 2})
    run = prepare_run(cfg, console=False)
    train_sync(run)
    run.close()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "two")] == [ckpt.checkpoint_name(32),
                                                                          ckpt.checkpoint_name(48)]


def test_checkpoint_final_is_checked_at_load():
    with pytest.raises(ConfigError, match="checkpoint.final"):
        load_config(None, ["checkpoint.final=optimizer"])


# ---------------------------------------------------------------------------------------------- eval split

def _digest(examples) -> str:
    return hashlib.sha256(json.dumps([e.prompt for e in examples]).encode()).hexdigest()[:16]


def test_the_default_config_keeps_its_50_50_split_exactly():
    task = build_task(load_config(DEFAULT).task)
    # the split configs/default.yaml gave before the held-out share became a rule (n_eval: 50 set in the file)
    assert (len(task.eval), len({e.prompt for e in task.train})) == (50, 50)
    assert (_digest(task.eval), _digest(task.train)) == ("e2a61e1745bde42a", "48a8a567807b4fc7")
    assert task.eval_repeats == 0


def test_a_small_jsonl_holds_out_a_share_of_its_rows():
    over = ["task.name=jsonl", f"task.path={TIMES}"]
    rows = sum(1 for line in TIMES.read_text().splitlines() if line.strip())
    task = build_task(load_config(DEFAULT, over).task)        # the README's times-table recipe
    assert (len(task.eval), len({e.prompt for e in task.train})) == (round(0.2 * rows), rows - round(0.2 * rows))
    task = build_task(load_config(DEFAULT, [*over, "task.eval_fraction=0.5"]).task)
    assert (len(task.eval), len({e.prompt for e in task.train})) == (rows // 2, rows - rows // 2)
    task = build_task(load_config(DEFAULT, [*over, "task.n_eval=10"]).task)      # a count still works
    assert (len(task.eval), len({e.prompt for e in task.train})) == (10, rows - 10)
    with pytest.raises(ConfigError, match="task.n_eval=10 and task.eval_fraction=0.5: set one of them"):
        load_config(DEFAULT, [*over, "task.n_eval=10", "task.eval_fraction=0.5"])
    with pytest.raises(ConfigError, match="task.eval_fraction"):
        load_config(DEFAULT, [*over, "task.eval_fraction=1.5"])


def test_a_large_jsonl_still_holds_out_50_rows(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(1000)))
    task = build_task(TaskConfig(name="jsonl", path=str(path), chat_template=False))
    assert len(task.eval) == 50 and len({e.prompt for e in task.train}) == 950


def test_eval_fraction_needs_a_finite_problem_set(tmp_path):
    task = build_task(TaskConfig(name="arithmetic", eval_fraction=0.3))   # one-digit addition: 100 problems
    assert len(task.eval) == 30
    with pytest.raises(ValueError, match="task.eval_fraction=0.3 needs a finite problem set.*set task.n_eval"):
        build_task(TaskConfig(name="count_letters", eval_fraction=0.3))
    with pytest.raises(ValueError, match="task.eval_path=.*set task.n_eval"):
        build_task(TaskConfig(name="jsonl", path=str(TIMES), eval_path=str(TIMES), eval_fraction=0.3))


# ------------------------------------------------------------------------------ held-out prompts in training

WORDS = ["cat", "dog", "owl"]


def build_word_list(cfg: TaskConfig) -> Task:
    """A small word-list taskset whose tasks repeat: its first n_eval tasks are held out, the rest train."""
    tasks = [Example(prompt=f"Spell {w} backwards.", answer=w[::-1], meta={"plain_prompt": f"rev {w}="})
             for w in WORDS * 6]
    return Task(cfg, tasks[4:], tasks[:4], default_reward="exact_match", default_grader="exact_match")


def test_every_builtin_source_keeps_held_out_prompts_out_of_training():
    for name in ("arithmetic", "count_letters", "sort_letters", "fib_chain"):
        assert build_task(TaskConfig(name=name, n_train=200, n_eval=20)).eval_repeats == 0, name
    assert build_task(TaskConfig(name="jsonl", path=str(TIMES))).eval_repeats == 0


def test_held_out_prompts_repeating_training_prompts_are_counted_warned_and_recorded(tmp_path, monkeypatch, capsys):
    from covrl.train.run.driver import train_sync
    from covrl.train.run.folder import prepare_run

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setitem(TASKS, "word_list", f"{Path(__file__).stem}:build_word_list")
    torch.set_num_threads(1)
    cfg = _tiny(tmp_path, **{"run.name": "words", "task.name": "word_list", "task.chat_template": False,
                             "loop.steps": 1, "checkpoint.at_end": False})
    capsys.readouterr()
    run = prepare_run(cfg, console=False)
    err = capsys.readouterr().err
    assert err.count("4 of the 4 held-out prompts of task 'word_list' also occur among its training prompts") == 1, err
    train_sync(run)
    run.close()
    task = json.loads((tmp_path / "words" / "summary.json").read_text())["task"]
    assert task == {"train_examples": 14, "train_prompts": 3, "eval_prompts": 4, "eval_repeats_train": 4}
    # a clean split says nothing
    run = prepare_run(_tiny(tmp_path, **{"run.name": "clean", "loop.steps": 1}), console=False)
    run.close()
    assert "held-out prompts" not in capsys.readouterr().err
