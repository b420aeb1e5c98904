"""Prompt selection (selection.strategy): deterministic at a seed, exact on resume, never stalls on an
all-constant stream, and each strategy prefers what it says; end to end on the tiny model with a resume."""

from __future__ import annotations

import pytest
import torch
from train_helpers import comparable, tiny_cfg

from covrl.tasks.base import Example
from covrl.train import DataStream, prepare_run, read_jsonl, train_sync
from covrl.train.run.selection import PromptSelector, SelectionConfig, contrast_probability

torch.set_num_threads(1)
ITEMS = [Example(prompt=f"Compute {a}+{b}.", answer=str(a + b)) for a in range(6) for b in range(6)]


def _selector(strategy, seed=0, **kw):
    return PromptSelector(SelectionConfig(strategy=strategy, **kw), seed=seed, num_items=len(ITEMS))


def _rounds(selector, stream, rounds=6, k=4, n=4, outcome=lambda item: item % 3 == 0):
    picked = []
    for _ in range(rounds):
        examples, positions = selector.take(stream, k, n)
        correct = [outcome(stream.index_at(p)) if j % 2 else True for p in positions for j in range(n)]
        selector.observe(stream, positions, correct, n, examples)
        picked.append(positions)
    return picked


@pytest.mark.parametrize("strategy,extra", [("uniform", {}), ("skip_constant", {}), ("curriculum", {}),
                                            ("thompson", {}), ("thompson", {"model": "ensemble"})])
def test_deterministic_at_a_seed_and_exact_on_resume(strategy, extra):
    a = _rounds(_selector(strategy, **extra), DataStream(ITEMS, seed=1))
    assert a == _rounds(_selector(strategy, **extra), DataStream(ITEMS, seed=1))
    first, stream = _selector(strategy, **extra), DataStream(ITEMS, seed=1)
    head = _rounds(first, stream, rounds=3)
    resumed, stream2 = _selector(strategy, **extra), DataStream(ITEMS, seed=1)
    resumed.load_state_dict(first.state_dict())
    stream2.load_state_dict(stream.state_dict())
    assert head + _rounds(resumed, stream2, rounds=3) == a


def test_an_all_constant_stream_still_fills_every_step():
    sel, stream = _selector("skip_constant", revisit_prob=0.0), DataStream(ITEMS, seed=0)
    for _ in range(10):
        examples, positions = sel.take(stream, 4, 4)
        assert len(examples) == 4
        sel.observe(stream, positions, [True] * 16, 4)   # every group all-correct
    assert sel.metrics()["selection/contrast_frac"] == 0.0


def test_skip_constant_skips_prompts_whose_last_group_was_constant():
    sel, stream = _selector("skip_constant", revisit_prob=0.0, pool_factor=4), DataStream(ITEMS, seed=0)
    for i in range(len(ITEMS)):   # item i: constant last time when i is even
        sel.last_constant[i] = i % 2 == 0
    _, positions = sel.take(stream, 4, 4)
    assert all(stream.index_at(p) % 2 == 1 for p in positions)


def test_curriculum_and_thompson_prefer_pass_rates_near_one_half():
    for strategy in ("curriculum", "thompson"):
        sel, stream = _selector(strategy, pool_factor=9), DataStream(ITEMS, seed=0)
        for i in range(len(ITEMS)):   # item i passes with rate i/35, seen 40 times
            sel.trials[i], sel.successes[i] = 40, round(40 * i / 35)
        _, positions = sel.take(stream, 4, 8)
        rates = [stream.index_at(p) / 35 for p in positions]
        assert max(abs(r - 0.5) for r in rates) < 0.25, (strategy, rates)
    assert contrast_probability(0.5, 4) == pytest.approx(1 - 2 / 16) and contrast_probability(1.0, 4) == 0.0


def _cut_and_resumed(tmp_path, over):
    """The metrics of a run stopped after 2 steps and resumed to the end (comparable keys)."""
    cfg = tiny_cfg(tmp_path, **{"run.name": "cut", **over})
    run = prepare_run(cfg, console=False)
    train_sync(run, stop_after=2)
    run.close()
    run = prepare_run(cfg, resume=True, console=False)
    train_sync(run)
    run.close()
    return comparable(read_jsonl(tmp_path / "cut" / "metrics.jsonl"))


def test_a_selected_run_logs_its_contrast_and_resumes_exactly(tmp_path):
    over = {"selection.strategy": "thompson", "eval.before": False, "eval.after": False, "loop.steps": 4,
            "checkpoint.every_rollouts": 32}
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "full", **over}), console=False)
    train_sync(run)
    run.close()
    full = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    assert all("selection/contrast_frac" in r and "selection/never_shown" in r for r in full)
    assert _cut_and_resumed(tmp_path, over) == comparable(full)


def test_selection_outside_the_sync_loop_is_refused():
    from covrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="sync loop"):
        load_config(None, ["selection.strategy=thompson", "loop.mode=async"])


def test_adaptive_group_sizes_keep_the_budget_and_favour_pass_rates_near_one_half():
    stream = DataStream(ITEMS, shuffle=False, seed=0)
    selector = _selector("uniform", group_sizes="adaptive", min_group_size=2)
    examples, positions = selector.take(stream, 4, 4)
    assert selector.group_sizes(stream, positions, 4) == [4, 4, 4, 4]          # no history: equal shares
    items = [stream.index_at(p) for p in positions]
    for item, wins in zip(items, (8, 4, 1, 0)):                                  # p̂ = 0.9, 0.5, 0.2, 0.1 (Beta(1,1))
        selector.successes[item], selector.trials[item] = wins, 8
    sizes = selector.group_sizes(stream, positions, 4)
    assert sum(sizes) == 16 and min(sizes) >= 2
    assert sizes[1] == max(sizes) and sizes[1] > sizes[0] and sizes[2] >= sizes[3]
    correct = [True] * sum(sizes)
    selector.observe(stream, positions, correct, sizes, examples)      # rows by each group's own size
    assert [selector.trials[i] for i in items] == [8 + s for s in sizes]


def test_an_adaptive_run_keeps_its_budget_and_resumes_exactly(tmp_path):
    # 8 prompts revisited every other step, a warm-up that leaves their pass rates apart
    over = {"selection.group_sizes": "adaptive", "eval.before": False, "eval.after": False, "loop.steps": 5,
            "checkpoint.every_rollouts": 32, "task.n_train": 8, "sft_warmup.steps": 40, "sft_warmup.lr": 3e-3}
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "full", **over}), console=False)
    batches = []
    step = run.trainer.step
    run.trainer.step = lambda b: (batches.append(b), step(b))[1]
    train_sync(run)
    run.close()
    full = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    assert all(len(b) == 16 for b in batches)
    assert any(len(set(torch.bincount(b.group_ids).tolist())) > 1 for b in batches)   # sizes did vary
    assert all("selection/group_size_max" in r for r in full)
    assert _cut_and_resumed(tmp_path, over) == comparable(full)
