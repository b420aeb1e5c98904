"""Sizing a run from the sampler (covrl.train.run.sizing): the rule on hand-made evidence, the predicted fraction of
constant groups against brute-force enumeration of the Pólya urn, monotonicity of the token budget, the config's
`auto` values, and tiny sync runs: sizing.json and a resolved config.yaml, typed values never changed, the budget
and the group shape adapting while the run goes, and a resume that does not probe again and repeats the
uninterrupted run exactly."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from train_helpers import comparable, tiny_cfg

from covrl.config import ConfigError, load_config
from covrl.train.run import sizing
from covrl.train.run.driver import train_sync
from covrl.train.run.folder import prepare_run
from covrl.train.run.sinks import read_jsonl
from covrl.train.run.sizing import (
    ProbeEvidence,
    SizingAdapter,
    budget_grid,
    choose_group_size,
    choose_max_new_tokens,
    decide,
    expected_longest,
    length_budget,
    pooled_prior,
    predicted_constant_fraction,
    prompt_constant_probability,
    reward_signal,
)

torch.set_num_threads(1)
AUTO = {"sampler.max_new_tokens": "auto", "loop.group_size": "auto", "loop.prompts_per_step": "auto",
        "sizing.probe_max_new_tokens": 24}


# ------------------------------------------------------------------------------------------ the rule


def test_all_prompts_wrong_take_the_smallest_group_and_warn():
    """No probe sample correct: the pooled prior's mean is (0 + 1/2) / (64 + 1), so a prompt's posterior is
    Beta(μ, 1 - μ + 4) and G = 16 leaves ~99% of the groups constant (each prompt under Jeffreys' prior alone
    would predict 46% and take G = 16 without a warning); no G gives contrast, the smallest keeps the prompts."""
    groups = [[0.0] * 4 for _ in range(16)]
    g, predicted, warning = choose_group_size(groups, [4, 8, 16], budget=16, target=0.5)
    mu = 0.5 / 65
    assert predicted[4] == pytest.approx(math.prod((1 - mu + 4 + t) / (5 + t) for t in range(4)))
    assert predicted[4] > predicted[8] > predicted[16] > 0.98
    assert g == 4 and "no probe sample was correct" in warning
    g, predicted, warning = choose_group_size([[1.0] * 4] * 3, [4, 8, 16], budget=8, target=0.5)
    assert g == 4 and set(predicted) == {4, 8} and "every probe sample was correct" in warning


def test_the_prior_is_pooled_over_the_task_s_prompts():
    assert pooled_prior([[1.0, 0.0]] * 8, (0.5, 0.5)) == pytest.approx((0.5, 0.5))   # a pooled rate of 1/2
    assert pooled_prior([[1.0, 0.0, 0.0, 0.0]] * 4, (1.0, 3.0)) == pytest.approx((4 * 5 / 20, 4 * 15 / 20))
    # one correct sample in 64: the prompt that had it is likely to contrast again, the other 15 are not; no G
    # reaches 1/2 and the largest is taken with a warning (Jeffreys' prior per prompt predicted 43% at G = 16)
    groups = [[0.0] * 4 for _ in range(15)] + [[1.0, 0.0, 0.0, 0.0]]
    g, predicted, warning = choose_group_size(groups, [4, 8, 16], budget=16, target=0.5)
    a, b = pooled_prior(groups, (0.5, 0.5))
    by_hand = (15 * prompt_constant_probability([0.0] * 4, 16, (a, b), True, failing_only=True)
               + prompt_constant_probability([1.0, 0.0, 0.0, 0.0], 16, (a, b), True, failing_only=True)) / 16
    assert predicted[16] == pytest.approx(by_hand) and predicted[16] > 0.9
    assert g == 16 and "even loop.group_size=16" in warning


def test_a_prediction_just_above_the_target_is_not_printed_equal_to_it():
    # a target a hair below the prediction: whole percents would print the two equal
    groups = [[1.0, 0.0, 0.0, 0.0]] * 16
    g, predicted, warning = choose_group_size(groups, [4], budget=4, target=predicted_constant_fraction(
        groups, 4, failing_only=True) - 1e-4)
    assert g == 4 and f"an expected {predicted[4]:.1%} of the groups" in warning


def test_half_right_prompts_take_groups_of_four():
    groups = [[1.0, 0.0, 1.0, 0.0] for _ in range(16)]
    g, predicted, warning = choose_group_size(groups, [4, 8, 16], budget=16, target=0.5)
    assert g == 4 and warning is None
    assert predicted[4] == pytest.approx(math.prod((2.5 + t) / (5 + t) for t in range(4)))   # all four wrong


def test_solved_prompts_do_not_grow_the_group():
    """A nearly solved task: 12 prompts right 4 of 4, 4 prompts right 3 of 4. Most groups of 4 are constant (the
    solved ones), but none predicts failing: G = 4 keeps the most prompts per step. Counting every constant group,
    as a rule that sees only contrast would, asks for the largest G and one prompt a step."""
    groups = [[1.0] * 4] * 12 + [[1.0, 1.0, 1.0, 0.0]] * 4
    g, predicted, warning = choose_group_size(groups, [4, 8, 16], budget=16, target=0.5)
    assert g == 4 and warning is None and predicted[4] < 0.01
    assert predicted_constant_fraction(groups, 16) > 0.5   # constant, solved
    assert sizing.failing_fraction(groups) == 0.0 and sizing.failing_fraction([[0.0] * 4, [1.0] * 4]) == 0.5


def test_lengths_all_ten_give_sixteen_tokens():
    assert length_budget([10] * 64, cap=128) == 16   # 10 x 1.25 = 12.5 -> a multiple of 8


def test_short_answers_get_the_floor_and_censored_lengths_the_cap():
    assert length_budget([1, 2, 3], cap=128) == 8
    assert length_budget([1, 2, 3], cap=128, floor=33) == 40   # overlong buffer + 1, rounded up
    assert length_budget([128] * 40 + [20] * 24, cap=128) == 128
    # more than 5% cut: the 95th percentile is censored at the cap
    assert length_budget([128] * 8 + [20] * 56, cap=128) == 128


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=40), st.integers(8, 160), st.data())
def test_more_cut_samples_never_give_a_smaller_length_budget(lengths, cap, data):
    before = length_budget(lengths, cap)
    i = data.draw(st.integers(0, len(lengths) - 1))
    longer = list(lengths)
    longer[i] = cap   # one more sample reaches the cap (or one got longer)
    after = length_budget(longer, cap)
    assert after >= before and sizing.cut_fraction(longer, cap) >= sizing.cut_fraction(lengths, cap)
    assert 1 <= after <= cap and (after % 8 == 0 or after == cap)


def test_budget_grid():
    assert budget_grid(128) == [8, 16, 24, 32, 48, 64, 96, 128]
    assert budget_grid(100, floor=33) == [40, 48, 64, 96, 100]
    assert budget_grid(8) == [8] and budget_grid(5) == [5]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=30), st.integers(1, 70), st.integers(1, 8))
def test_expected_longest_matches_enumeration(lengths, budget, rollouts):
    """E[max of R draws of min(L, B)] under the empirical distribution, against the exact sum over every ordered
    R-tuple of samples (R <= 3) or the one-draw mean."""
    got = expected_longest(lengths, budget, rollouts)
    if rollouts == 1:
        assert got == pytest.approx(sum(min(n, budget) for n in lengths) / len(lengths))
    if rollouts <= 3 and len(lengths) ** rollouts <= 30_000:
        tuples = list(itertools.product(lengths, repeat=rollouts))
        assert got == pytest.approx(sum(min(max(t), budget) for t in tuples) / len(tuples))
    assert min(min(lengths), budget) - 1e-9 <= got <= min(max(lengths), budget) + 1e-9


def test_reward_signal_is_the_mean_unbiased_within_prompt_variance():
    assert reward_signal([[1.0, 0.0, 1.0, 0.0], [0.0] * 4]) == pytest.approx((4 * 0.25 / 3) / 2)
    assert reward_signal([[0.5] * 4] * 3) == 0.0 and reward_signal([[1.0]]) == 0.0


def test_the_budget_where_answers_fit_wins_over_a_longer_one_with_the_same_contrast():
    """Correct answers are short (the samples that score do so within 16 tokens), the wrong ones ramble to the cap:
    16 and 128 tokens give the same contrast, 16 costs an eighth of it; at 8 tokens no answer is complete."""
    lengths = [12, 128, 12, 128] * 16
    rewards_at = {8: [[0.0] * 4] * 16, 16: [[1.0, 0.0, 1.0, 0.0]] * 16, 128: [[1.0, 0.0, 1.0, 0.0]] * 16}
    tokens, table = choose_max_new_tokens(lengths, rewards_at, rollouts=16, overhead=8.0)
    assert tokens == 16 and table[8]["signal"] == 0.0
    assert table[16]["cost"] == pytest.approx(8 + 16 - 4 * 0.5 ** 16) and table[128]["cost"] > 130
    # a budget that adds contrast in proportion to its cost is not worse: ties go to the smaller one
    rewards_at[128] = [[1.0, 0.0, 1.0, 0.0]] * 16
    tokens, _ = choose_max_new_tokens([16] * 64, {16: rewards_at[16], 24: rewards_at[128]}, rollouts=4,
                                      overhead=0.0)
    assert tokens == 16
    # no variance at any budget: no choice (decide falls back to the length rule)
    assert choose_max_new_tokens(lengths, {8: [[0.0] * 4], 16: [[1.0] * 4]}, rollouts=4, overhead=8)[0] is None


def test_a_smaller_budget_within_one_standard_error_of_the_best_wins():
    """Every sample runs past 32 tokens (cost 16 + 8 against 16 + 32). At 32 tokens 12 prompts of 16 have 2 of 4
    right and 4 have none: signal 1/4, its standard error over the prompts ~0.037, so 8 tokens (signal 0.120, a
    slightly lower signal per cost) is within one standard error and wins. The same mean signal at 32 with no
    spread (every prompt 1 of 4 right) is a clear best and wins."""
    lengths = [200] * 64
    two, one, none = [1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0] * 4
    short = [two] * 5 + [one] + [none] * 10
    noisy = [two] * 12 + [none] * 4
    tokens, table = choose_max_new_tokens(lengths, {8: short, 32: noisy}, rollouts=16, overhead=16.0)
    assert table[8]["signal"] == pytest.approx((5 / 3 + 1 / 4) / 16) and table[32]["signal"] == pytest.approx(0.25)
    assert table[32]["signal_se"] == pytest.approx(sizing.standard_error([1 / 3] * 12 + [0.0] * 4))
    assert table[8]["signal_per_cost"] < table[32]["signal_per_cost"] and tokens == 8
    assert choose_max_new_tokens(lengths, {8: short, 32: [one] * 16}, rollouts=16, overhead=16.0)[0] == 32


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=4, max_size=24), st.data())
def test_budget_choice_properties(lengths, data):
    """The chosen budget is one of the candidates, no larger than the one with the best signal per cost, and
    within one standard error of it; scaling every reward by c > 0 (every signal and its error by c^2) does not
    change it."""
    budgets = [8, 16, 32, 64]
    rewards_at = {b: [[float(data.draw(st.integers(0, 1))) for _ in range(4)] for _ in range(3)] for b in budgets}
    tokens, table = choose_max_new_tokens(lengths, rewards_at, rollouts=4, overhead=4.0)
    if tokens is None:
        assert all(row["signal"] == 0 for row in table.values())
        return
    best = max(table, key=lambda b: (table[b]["signal_per_cost"], -b))
    assert tokens in budgets and tokens <= best
    assert table[tokens]["signal_per_cost"] >= (table[best]["signal"] - table[best]["signal_se"]) / table[best][
        "cost"] - 1e-12
    scaled = {b: [[3.0 * r for r in g] for g in groups] for b, groups in rewards_at.items()}
    assert choose_max_new_tokens(lengths, scaled, rollouts=4, overhead=4.0)[0] == tokens


def _urn_constant(counts: dict, g: int, alpha: float | None, prior=(0.5, 0.5)) -> float:
    """Brute force: enumerate every sequence of g draws from the Pólya urn (binary: colours 0/1 with weights prior +
    counts; alpha: a Dirichlet process over the seen values plus new ones) and add the probability of those whose
    g draws are all equal."""
    total = 0.0
    if alpha is None:
        for seq in itertools.product((0.0, 1.0), repeat=g):
            w = {0.0: prior[1] + counts.get(0.0, 0), 1.0: prior[0] + counts.get(1.0, 0)}
            p = 1.0
            for x in seq:
                p *= w[x] / (w[0.0] + w[1.0])
                w[x] += 1
            total += p if len(set(seq)) == 1 else 0.0
        return total

    def walk(weights: dict, drawn: list, p: float):
        nonlocal total
        if len(drawn) == g:
            total += p if len(set(drawn)) == 1 else 0.0
            return
        n = sum(weights.values()) + alpha
        for v, c in weights.items():
            walk({**weights, v: c + 1}, drawn + [v], p * c / n)
        new = ("new", len(drawn))
        walk({**weights, new: 1}, drawn + [new], p * alpha / n)

    walk(dict(counts), [], 1.0)
    return total


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.data(), st.integers(1, 6))
def test_constant_probability_matches_the_enumerated_urn(m, data, g):
    s = data.draw(st.integers(0, m))
    rewards = [1.0] * s + [0.0] * (m - s)
    exact = prompt_constant_probability(rewards, g, (0.5, 0.5), binary=True)
    assert exact == pytest.approx(_urn_constant({1.0: s, 0.0: m - s}, g, None), rel=1e-9)
    values = data.draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 2.0]), min_size=m, max_size=m))
    if g <= 5:
        exact = prompt_constant_probability(values, g, (0.5, 0.5), binary=False)
        counts = {v: values.count(v) for v in set(values)}
        assert exact == pytest.approx(_urn_constant(counts, g, alpha=1.0), rel=1e-9)


def test_constant_fraction_goes_down_with_the_group_and_non_binary_rewards_use_the_values():
    groups = [[1.0, 0.0, 0.0, 0.0], [0.0] * 4, [1.0] * 4]
    fractions = [predicted_constant_fraction(groups, g) for g in (2, 4, 8, 16)]
    assert fractions == sorted(fractions, reverse=True)
    # graded rewards, a Dirichlet process of concentration 1 (m = 4): four distinct values 4 x 4!/(5·6·7·8), plus
    # a new value 1/5 · 3!/(6·7·8); one value seen 4 times 4·5·6·7/(5·6·7·8) = 1/2, plus the same new value
    assert predicted_constant_fraction([[0.2, 0.7, 0.4, 0.9]], 4) == pytest.approx(16 / 280 + 1 / 280)
    assert predicted_constant_fraction([[0.5] * 4], 4) == pytest.approx(1 / 2 + 1 / 280)


def test_a_step_keeps_two_prompts_where_no_group_size_reaches_the_target():
    """One correct sample in 64 (a suite task's probe): every G leaves over 90% of the groups failing, and the
    largest G minimises that. With 16 rollouts a step the rule stops at G = 8, two prompts, where it took one prompt
    of 16 before: a step of one prompt moves the whole model towards that prompt's answer (docs/theory.md §15)."""
    groups = [[0.0] * 4 for _ in range(15)] + [[1.0, 0.0, 0.0, 0.0]]
    correct = [[r == 1.0 for r in g] for g in groups]
    evidence = ProbeEvidence(lengths=[10] * 64, cap=16, rewards=groups, correct=correct, rewards_at={},
                             correct_at={})
    auto = ["loop.group_size=auto", "loop.prompts_per_step=auto"]
    decision = decide(evidence, load_config(None, auto))
    assert decision.resolved == {"loop.group_size": 8, "loop.prompts_per_step": 2}
    assert set(decision.predicted_failing) == {4, 8} and "even loop.group_size=8" in decision.warnings[0]
    one = decide(evidence, load_config(None, auto + ["sizing.min_prompts_per_step=1"]))
    assert one.resolved == {"loop.group_size": 16, "loop.prompts_per_step": 1}
    more = decide(evidence, load_config(None, auto + ["sizing.rollouts_per_step=32"]))
    assert more.resolved == {"loop.group_size": 16, "loop.prompts_per_step": 2}
    # no group fits (rollouts 4, at least 2 prompts): the smallest candidate, as many prompts as the rollouts allow
    few = decide(evidence, load_config(None, auto + ["sizing.rollouts_per_step=4"]))
    assert few.resolved == {"loop.group_size": 4, "loop.prompts_per_step": 1}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=4, max_size=4), min_size=1, max_size=16),
       st.sampled_from([8, 16, 32, 64]), st.integers(1, 4))
def test_an_auto_group_leaves_min_prompts_per_step_whenever_one_fits(groups, rollouts, min_prompts):
    evidence = ProbeEvidence(lengths=[10] * (4 * len(groups)), cap=16, rewards=groups,
                             correct=[[r == 1.0 for r in g] for g in groups], rewards_at={}, correct_at={})
    cfg = load_config(None, ["loop.group_size=auto", "loop.prompts_per_step=auto",
                             f"sizing.rollouts_per_step={rollouts}", f"sizing.min_prompts_per_step={min_prompts}"])
    resolved = decide(evidence, cfg).resolved
    g, p = resolved["loop.group_size"], resolved["loop.prompts_per_step"]
    assert g in (4, 8, 16) and g * p <= rollouts
    if rollouts // min_prompts >= 4:   # some candidate leaves min_prompts prompts
        assert p >= min_prompts and g <= rollouts // min_prompts


def test_decide_fills_only_the_auto_fields():
    # every answer ends at 10 tokens: 16 and 128 tokens give the same samples at the same cost, 8 cuts them all
    half = [[1.0, 0.0, 1.0, 0.0]] * 16
    evidence = ProbeEvidence(lengths=[10] * 64, cap=128, rewards=half, correct=[[True, False, True, False]] * 16,
                             rewards_at={8: [[0.0] * 4] * 16, 16: half}, correct_at={8: [[False] * 4] * 16,
                                                                                       16: [[True, False] * 2] * 16})
    cfg = load_config(None, ["sampler.max_new_tokens=auto", "loop.group_size=auto", "loop.prompts_per_step=auto",
                             "sizing.rollouts_per_step=32"])
    assert decide(evidence, cfg).resolved == {"sampler.max_new_tokens": 16, "loop.group_size": 4,
                                              "loop.prompts_per_step": 8}
    typed = load_config(None, ["loop.group_size=8", "loop.prompts_per_step=auto"])
    assert decide(evidence, typed).resolved == {"loop.prompts_per_step": 2}


def test_graded_rewards_without_a_correct_sample_are_sized_with_a_warning():
    """Partial credit (a wrong answer of the right form scores 0.08): the groups have contrast, so G = 4 meets the
    target, but no sample was correct by the grader, which the warning says; one correct sample silences it."""
    rewards = [[0.08, 0.0, 0.08, 0.0]] * 16
    cfg = load_config(None, ["loop.group_size=auto", "loop.prompts_per_step=auto"])
    wrong = ProbeEvidence(lengths=[10] * 64, cap=128, rewards=rewards, correct=[[False] * 4] * 16)
    decision = decide(wrong, cfg)
    assert decision.resolved["loop.group_size"] == 4
    assert len(decision.warnings) == 1 and "no probe sample was correct" in decision.warnings[0]
    one = ProbeEvidence(lengths=[10] * 64, cap=128, rewards=[[1.0, 0.0, 0.08, 0.0]] + rewards[1:],
                        correct=[[True, False, False, False]] + [[False] * 4] * 15)
    assert decide(one, cfg).warnings == []


# ---------------------------------------------------------------------------------------- the config


def test_auto_config_loads_and_is_resolved_later():
    cfg = load_config(None, ["loop.group_size=auto", "sampler.max_new_tokens=auto"])
    assert cfg.loop.group_size == "auto" and cfg.sampler.max_new_tokens == "auto" and cfg.loop.prompts_per_step == 8
    with pytest.raises(ValueError, match="loop.group_size=auto is not resolved yet"):
        _ = cfg.loop.rollouts_per_step
    # where no probe runs (here the async loop), auto takes the fallback numbers: the config loads, checked with them
    unsized = load_config(None, ["loop.group_size=auto", "loop.mode=async"])
    assert sizing.unsizable_reason(unsized) == "loop.mode=async"
    assert sizing.fallback_sizes(unsized) == {"loop.group_size": 4}
    assert sizing.fixed_sizes(unsized).loop.rollouts_per_step == 32 and sizing.unsizable_reason(cfg) is None
    with pytest.raises(ConfigError, match="sampler.max_new_tokens"):
        load_config(None, ["sampler.max_new_tokens=automatic"])
    with pytest.raises(ConfigError, match="sizing.group_sizes must be distinct"):
        load_config(None, ["loop.group_size=auto", "sizing.group_sizes=[8,4]"])
    # overlong buffer against an auto budget: checked after the probe (the budget's floor is buffer + 1)
    load_config(None, ["sampler.max_new_tokens=auto", "task.overlong_reward.buffer=40"])


# ---------------------------------------------------------------------------------------- tiny runs


def test_auto_run_writes_sizing_json_and_a_resolved_config(tmp_path):
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": "auto", **AUTO}), console=False)
    summary = train_sync(run)
    run.close()
    folder = tmp_path / "auto"
    record = json.loads((folder / "sizing.json").read_text())
    resolved = load_config(folder / "config.yaml")   # numbers, loadable as a config of its own
    assert record["auto"] == ["sampler.max_new_tokens", "loop.group_size", "loop.prompts_per_step"]
    assert record["resolved"] == {"sampler.max_new_tokens": resolved.sampler.max_new_tokens,
                                  "loop.group_size": resolved.loop.group_size,
                                  "loop.prompts_per_step": resolved.loop.prompts_per_step}
    assert resolved.loop.group_size in (4, 8) and resolved.loop.rollouts_per_step <= 16
    assert 8 <= resolved.sampler.max_new_tokens <= record["evidence"]["cap"] <= 24
    assert record["evidence"]["prompts"] == 16 and record["evidence"]["samples_per_prompt"] == 4
    assert set(record["predicted_failing"]) == {"4", "8"}   # 16 of 16 rollouts would leave one prompt a step
    assert summary["sizing"]["config"] == record["config"]
    assert summary["session_time_split_s"]["probe"] == pytest.approx(record["time/probe_s"])
    assert record["time/probe_s"] > 0
    records = read_jsonl(folder / "metrics.jsonl")
    assert len(records) == 3 and all(r["rollouts"] == (i + 1) * resolved.loop.rollouts_per_step
                                     for i, r in enumerate(records))
    assert all("sizing/max_new_tokens" in r for r in records)


def test_typed_values_are_never_changed(tmp_path):
    over = {"run.name": "typed", "sampler.max_new_tokens": 4, "loop.group_size": 4, "loop.prompts_per_step": "auto",
            "sizing.rollouts_per_step": 8, "sizing.probe_max_new_tokens": 24, "sizing.adapt_cut_rate": 0.01,
            "sizing.adapt_steps": 1}
    run = prepare_run(tiny_cfg(tmp_path, **over), console=False)
    train_sync(run)
    run.close()
    record = json.loads((tmp_path / "typed" / "sizing.json").read_text())
    resolved = load_config(tmp_path / "typed" / "config.yaml")
    assert record["resolved"] == {"loop.prompts_per_step": 2}
    assert (resolved.sampler.max_new_tokens, resolved.loop.group_size) == (4, 4)
    records = read_jsonl(tmp_path / "typed" / "metrics.jsonl")
    assert run.sizing_adapter is None and not any("sizing/max_new_tokens" in r for r in records)
    assert all(r["response/at_max_frac"] > 0.01 for r in records)   # would have adapted an auto budget


def test_a_run_without_a_probe_takes_the_fallback_sizes_and_says_so(tmp_path, capsys):
    from covrl.train.asyncrl.source import prepare_async_run

    cfg = tiny_cfg(tmp_path, **{"run.name": "unsized", **AUTO, "loop.mode": "async"})
    run = prepare_async_run(cfg, console=False)
    try:
        assert (run.cfg.sampler.max_new_tokens, run.cfg.loop.group_size, run.cfg.loop.prompts_per_step) == (16, 4, 4)
        assert run.sizing_adapter is None and not (tmp_path / "unsized" / "sizing.json").exists()
        assert load_config(tmp_path / "unsized" / "config.yaml").loop.rollouts_per_step == 16
    finally:
        run.close()
    err = capsys.readouterr().err
    assert "this run has loop.mode=async: sampler.max_new_tokens=16, loop.group_size=4, loop.prompts_per_step=4" in err


def _adapter(max_new_tokens=16, cap=64, **sizing_over):
    over = ["sampler.max_new_tokens=auto"] + [f"sizing.{k}={v}" for k, v in sizing_over.items()]
    cfg = sizing.resolve_config(load_config(None, over), {"sampler.max_new_tokens": max_new_tokens})
    messages = []
    run = SimpleNamespace(cfg=cfg, sampler=SimpleNamespace(cfg=cfg.sampler), step=0,
                          task=SimpleNamespace(cfg=cfg.task, response_budget=max_new_tokens),
                          message=lambda text, **kw: messages.append(text))
    return SizingAdapter(run, cap=cap), run, messages


def test_adapter_grows_the_budget_after_k_cut_steps_without_contrast_up_to_the_cap_and_says_so_once():
    adapter, run, messages = _adapter(adapt_steps=2, adapt_cut_rate=0.5)
    seen = []
    for step, cut in enumerate([1, 0, 1, 1, 1, 1, 1, 1, 1, 1], start=1):
        run.step = step
        record = {}
        # every answer wrong, no contrast: the cut answers cost the step its signal
        adapter.observe(record, _groups_batch([[0.0] * 4] * 4, cut=bool(cut)))
        seen.append(record["sizing/max_new_tokens"])
    assert seen == [16, 16, 16, 24, 24, 40, 40, 64, 64, 64]   # x1.5 rounded up to 8, capped at 64
    assert run.cfg.sampler.max_new_tokens == run.task.response_budget == 64
    assert [c["to"] for c in adapter.changes] == [24, 40, 64] and len(messages) == 1
    fresh, fresh_run, _ = _adapter(adapt_steps=2, adapt_cut_rate=0.5)
    fresh.load_state_dict(adapter.state_dict())
    assert fresh_run.cfg.sampler.max_new_tokens == 64 and fresh.state_dict() == adapter.state_dict()
    # cut steps whose groups still carry contrast (half constant, target 50%): the budget the probe chose stays
    adapter, run, messages = _adapter(adapt_steps=2, adapt_cut_rate=0.5)
    mixed = _groups_batch([[1.0, 0.0, 0.0, 0.0], [0.0] * 4, [1.0, 1.0, 0.0, 0.0], [0.0] * 4], cut=True)
    # or cut steps whose groups are constant because every answer is right: the budget is enough to score
    solved = _groups_batch([[1.0] * 4] * 4, cut=True)
    for step in range(1, 7):
        run.step = step
        adapter.observe({}, mixed if step % 2 else solved)
    assert run.cfg.sampler.max_new_tokens == 16 and adapter.changes == [] and messages == []


def test_cuts_more_than_probe_hand_cases():
    # the chain_sum case: the probe cut 84% of its 64 samples short of a correct answer at 8 tokens; a step that
    # cuts all 16 is within two standard errors of it (pooled 0.87, se 0.093, z 1.7): the probe knew
    assert not sizing.cuts_more_than_probe(1.0, 16, 0.84, 64, 2.0)
    assert sizing.cuts_more_than_probe(1.0, 16, 0.84, 64, 1.5)
    # a policy that now cuts most answers where the probe cut a third: it has grown longer than the budget
    assert sizing.cuts_more_than_probe(0.9, 16, 0.3, 64, 2.0)
    # equal or smaller fractions never count, whatever z; no variance: only a strictly larger fraction
    assert not sizing.cuts_more_than_probe(0.5, 16, 0.5, 64, 0.0)
    assert not sizing.cuts_more_than_probe(1.0, 16, 1.0, 64, 0.0)
    assert not sizing.cuts_more_than_probe(0.2, 16, 0.6, 64, 0.0)
    assert sizing.cuts_more_than_probe(1.0, 16, 0.0, 64, 2.0)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 32), st.integers(1, 32), st.integers(0, 64), st.integers(1, 64), st.floats(0, 5))
def test_cuts_more_than_probe_is_monotone_in_the_step_and_in_z(k, n, j, m, z):
    k, j = min(k, n), min(j, m)
    fires = sizing.cuts_more_than_probe(k / n, n, j / m, m, z)
    if fires and k < n:   # one more cut answer in the step still fires
        assert sizing.cuts_more_than_probe((k + 1) / n, n, j / m, m, z)
    if fires:             # a looser threshold still fires
        assert sizing.cuts_more_than_probe(k / n, n, j / m, m, z / 2)
    if k / n <= j / m:
        assert not fires


def test_probe_cut_and_wrong_counts_samples_that_reach_each_budget_and_fail_there():
    samples = {"lengths": [5, 20, 40, 40],   # prompt-major: two prompts x two samples
               "correct": [[True, True], [False, True]],
               "correct_at": {"8": [[True, False], [False, False]], "16": [[True, False], [False, True]]}}
    # at 8: samples 2, 3, 4 reach it, all wrong there; at 16: 2 and 3 (4 is right); at the cap 40: 3 only
    assert sizing.probe_cut_and_wrong(samples, 40) == {8: 0.75, 16: 0.5, 40: 0.25}
    assert sizing.probe_cut_and_wrong(None, 40) == {} and sizing.probe_cut_and_wrong({"lengths": []}, 40) == {}


def test_adapter_keeps_the_budget_where_the_probe_saw_as_many_answers_cut():
    # every answer of every step cut and wrong, groups without contrast: the old rule grew the budget at step 2;
    # the probe had cut 90% of its 64 samples at 16 tokens, so 100% is no news (z 1.3) and 16 stays
    adapter, run, messages = _adapter(adapt_steps=2, adapt_cut_rate=0.5)
    adapter.probe_cut_wrong, adapter.probe_samples = {16: 0.9, 24: 0.2, 64: 0.1}, 64
    for step in range(1, 7):
        run.step = step
        adapter.observe({}, _groups_batch([[0.0] * 4] * 4, cut=True))
    assert run.cfg.sampler.max_new_tokens == 16 and adapter.changes == [] and messages == []
    # where the probe cut a fifth at 16, the same steps grow it; at 24 the probe's 24-token fraction (0.2) is the
    # reference, at 40 the largest budget it scored at or below 40 (24)
    adapter, run, messages = _adapter(adapt_steps=2, adapt_cut_rate=0.5)
    adapter.probe_cut_wrong, adapter.probe_samples = {16: 0.2, 24: 0.2, 64: 0.1}, 64
    for step in range(1, 7):
        run.step = step
        adapter.observe({}, _groups_batch([[0.0] * 4] * 4, cut=True))
    assert [c["to"] for c in adapter.changes] == [24, 40, 64] and len(messages) == 1
    assert "more than the probe did at 16 tokens" in messages[0]


def _group_adapter(group_size=4, **sizing_over):
    over = ["loop.group_size=auto", "loop.prompts_per_step=auto"] + [f"sizing.{k}={v}" for k, v in sizing_over.items()]
    cfg = sizing.resolve_config(load_config(None, over), {"loop.group_size": group_size,
                                                          "loop.prompts_per_step": 16 // group_size})
    messages = []
    run = SimpleNamespace(cfg=cfg, step=0, message=lambda text, **kw: messages.append(text))
    return SizingAdapter(run, cap=64, tokens=False, groups=True), run, messages


def _groups_batch(groups, cut: bool = False):
    """A step's scored rollouts as the adapter reads them: one reward per rollout, the group of each, responses of
    one token or (cut) of 200, beyond any budget of these tests."""
    rewards = [r for g in groups for r in g]
    ids = [i for i, g in enumerate(groups) for _ in g]
    mask = torch.zeros(len(rewards), 200)
    mask[:, : 200 if cut else 1] = 1
    return SimpleNamespace(sequence_rewards=torch.tensor(rewards), group_ids=torch.tensor(ids), response_mask=mask,
                           correct=None)


def test_group_adapter_applies_the_probe_rule_to_each_window_of_steps_and_keeps_the_rollouts():
    # pass rate ~1/8, groups of 4: most groups constant, the rule (target 50%) asks for larger groups
    sparse = [[1.0, 0.0, 0.0, 0.0]] + [[0.0] * 4] * 3
    adapter, run, messages = _group_adapter(adapt_group_steps=2)
    expected = predicted_constant_fraction(sparse * 2, 8, failing_only=True)
    seen = []
    for step in range(1, 5):
        run.step = step
        record = {}
        adapter.observe(record, _groups_batch(sparse))
        seen.append((record["sizing/group_size"], record["sizing/prompts_per_step"]))
    g1, _, _ = choose_group_size(sparse * 2, [4, 8, 16], sizing.largest_group(run.cfg.sizing), 0.5)
    assert seen[0] == (4.0, 4.0) and seen[1] == (float(g1), 16.0 / g1) and g1 == 8   # 16 would leave one prompt
    assert run.cfg.loop.rollouts_per_step == 16 and run.cfg.loop.group_size * run.cfg.loop.prompts_per_step == 16
    assert adapter.group_changes[0] == {"step": 2, "from": 4, "to": g1, "failing_seen": 0.75,
                                        "predicted_failing": pytest.approx(predicted_constant_fraction(
                                            sparse * 2, g1, failing_only=True))}
    assert expected > 0 and len(messages) == 1 and "loop.group_size 4 -> " in messages[0]
    # contrast in every group of 16: the rule goes back to the smallest G that meets the target
    adapter, run, _ = _group_adapter(group_size=16, adapt_group_steps=1)
    run.step = 1
    adapter.observe({}, _groups_batch([[1.0] * 8 + [0.0] * 8]))
    assert (run.cfg.loop.group_size, run.cfg.loop.prompts_per_step) == (4, 4)
    # exact state: a fresh adapter loaded from the state dict has the sizes and the half-filled window
    adapter, run, _ = _group_adapter(adapt_group_steps=3)
    for step in (1, 2):
        run.step = step
        adapter.observe({}, _groups_batch(sparse))
    fresh, fresh_run, _ = _group_adapter(group_size=8, adapt_group_steps=3)
    fresh.load_state_dict(json.loads(json.dumps(adapter.state_dict())))
    assert fresh.state_dict() == adapter.state_dict() and fresh_run.cfg.loop.group_size == 4


def test_a_typed_group_shape_is_never_adapted(tmp_path):
    cfg = sizing.resolve_config(load_config(None, ["sampler.max_new_tokens=auto"]), {"sampler.max_new_tokens": 16})
    run = SimpleNamespace(cfg=cfg, register=lambda *a: None)
    adapter = sizing.attach_adapter(run, {"auto": ["sampler.max_new_tokens"], "evidence": {"cap": 64}})
    assert adapter.tokens and not adapter.groups
    record = {}
    adapter.observe(record, _groups_batch([[0.0] * 4] * 4))
    assert "sizing/group_size" not in record and cfg.loop.group_size == 8


def test_resume_after_the_probe_does_not_probe_again_and_is_exact(tmp_path, monkeypatch):
    # a budget below the probe's cap (the 10th percentile, no headroom) and a low adapt threshold: the budget
    # grows by a multiple of 8 after every step, so the checkpoint at step 2 must carry it
    over = {"loop.steps": 4, "eval.before": False, **AUTO, "sizing.probe_max_new_tokens": 40,
            "sizing.length_quantile": 0.1, "sizing.length_headroom": 1.0, "sizing.adapt_cut_rate": 0.01,
            "sizing.adapt_steps": 1, "sizing.adapt_factor": 1.1, "sizing.adapt_group_steps": 1,
            "sizing.rollouts_per_step": 8, "sizing.group_sizes": [2, 4, 8]}
    # the tiny model cuts every answer, in the probe and in every step alike, so the comparison with the probe
    # would hold the budget: without the probe's fractions the adapter grows on the cut rate alone
    monkeypatch.setattr(sizing, "probe_cut_and_wrong", lambda samples, cap: {})
    straight = prepare_run(tiny_cfg(tmp_path, **{"run.name": "straight", **over}), console=False)
    train_sync(straight)
    straight.close()
    first = prepare_run(tiny_cfg(tmp_path, **{"run.name": "split", **over}), console=False)
    train_sync(first, stop_after=2)
    first.close()

    def no_probe(*args, **kwargs):
        raise AssertionError("a resumed run probed again")

    monkeypatch.setattr(sizing, "_probe", no_probe)
    resumed = prepare_run(tiny_cfg(tmp_path, **{"run.name": "split", **over}), resume=True, console=False)
    assert resumed.cfg.loop.group_size == first.cfg.loop.group_size
    train_sync(resumed)
    resumed.close()
    a = comparable(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))
    b = comparable(read_jsonl(tmp_path / "split" / "metrics.jsonl"))
    assert len(a) == len(b) == 4 and a == b
    start = json.loads((tmp_path / "split" / "sizing.json").read_text())["resolved"]["sampler.max_new_tokens"]
    budgets = [r["sizing/max_new_tokens"] for r in a]
    assert start < budgets[0] < budgets[1]   # both changes before the checkpoint the run resumes from
    # evaluations stay at the budget the probe chose (before and after compare), training goes on at its own
    evals = json.loads((tmp_path / "split" / "eval.json").read_text())["evals"]
    assert evals and all(e["settings"]["max_new_tokens"] == start for e in evals)
    assert resumed.cfg.sampler.max_new_tokens == budgets[-1] > start
    assert resumed.sizing_adapter.changes == straight.sizing_adapter.changes
    assert resumed.sizing_adapter.group_changes == straight.sizing_adapter.group_changes
    shapes = [(r["sizing/group_size"], r["sizing/prompts_per_step"]) for r in a]
    assert all(g * p == 8 for g, p in shapes)
    print("group shapes of the 4 steps:", shapes)
    for (ka, va), (kb, vb) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


def test_the_experiment_harness_adapts_an_auto_run_as_the_loop_does(tmp_path):
    """An auto-sized arm stepped by covrl.experiment (the benches' and studies' driver) feeds each step's groups
    to the sizing adapter: with a window of one step, the group shape is re-chosen after every step."""
    from covrl.experiment import Arm, ArmRunner

    over = {"run.name": "arm", **AUTO, "sizing.adapt_group_steps": 1, "sizing.rollouts_per_step": 8,
            "sizing.group_sizes": [2, 4, 8], "eval.before": False, "eval.after": False}
    with ArmRunner(Arm(tiny_cfg(tmp_path, **over), tmp_path / "arm")) as runner:
        adapter = runner.run.sizing_adapter
        assert adapter is not None and adapter.groups
        for _ in range(2):
            step = runner.step()
            assert len(step.batch) == 8
        assert adapter.window == [] and adapter.window_steps == 0   # each step's window was decided on
        assert runner.run.cfg.loop.group_size * runner.run.cfg.loop.prompts_per_step == 8
