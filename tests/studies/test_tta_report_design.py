"""A design's verdict (studies/tta/report_design.py) on hand-made results: the medians over seeds, the gain over TRL
per task, the two rules and an incomplete study reported as such."""

from __future__ import annotations

import json

from studies.tta.report_design import load, report


def _write(root, task, seed, covrl, trl, constant=0.3):
    folder = root / f"{task}-s{seed}" / "tta-smollm2"
    folder.mkdir(parents=True)
    evals = [{"accuracy": 0.1}, {"accuracy": covrl / 2}, {"accuracy": covrl}]   # before, 120 s, 240 s
    arms = {"covrl": {"final_accuracy": covrl, "constant_groups": constant, "evals": evals, "steps": 30 + seed},
            "trl": {"final_accuracy": trl, "steps": 14}, "trl_sized": {"final_accuracy": trl}}
    (folder / "cpu.json").write_text(json.dumps({"results": {"tasks": [{"task": task, "seed": seed, "arms": arms}]}}))


def test_medians_gains_and_the_rules(tmp_path):
    for seed, (c, t) in enumerate([(0.6, 0.4), (0.5, 0.5), (0.9, 0.2)]):   # gains +20, 0, +70: median +20
        _write(tmp_path, "add2", seed, c, t)
    for seed, (c, t) in enumerate([(0.1, 0.3), (0.2, 0.2), (0.0, 0.1)]):   # gains -20, 0, -10: median -10
        _write(tmp_path, "mul1", seed, c, t, constant=0.6)
    results = load(tmp_path)
    assert len(results) == 6
    text = report(results)
    assert "| add2 | 0, 1, 2 | 60% / 50% / 90%: **60%**" in text and "+20 pts | 30% | 30% / - | 31 / 14 |" in text
    assert "| mul1 | 0, 1, 2 | 10% / 20% / 0%: **10%**" in text and "-10 pts | 60% |" in text
    assert "Verdict: not yet: 2 of 11 tasks" in text
    assert "Rule 1 (covrl >= trl on every task, median over seeds) on the complete tasks: fails on mul1." in text
    assert "Rule 2 (median gain over tasks >= 10 points) on the complete tasks: +5 points, fails." in text
    assert "median over the complete tasks: 45%." in text


def test_a_gain_of_ten_points_holds_in_whole_points(tmp_path):
    # 0.6 - 0.4 is 0.19999... in floating point: accuracies are counts out of 50, compared in whole points
    for task, (c, t) in {"add1": (0.96, 0.96), "add2": (0.6, 0.4)}.items():
        for seed in range(3):
            _write(tmp_path, task, seed, c, t)
    assert "on the complete tasks: +10 points, holds." in report(load(tmp_path))


def test_a_design_reads_its_folders_in_order_and_reports_tasks_outside_its_verdict(tmp_path):
    from studies.tta.report_design import Design

    for seed in range(3):
        _write(tmp_path / "E", "sub1", seed, 0.5, 0.3)           # the design's own runs
        _write(tmp_path / "D", "add2", seed, 0.6, 0.4)           # reused from another design
        _write(tmp_path / "D", "add1", seed, 0.98, 0.96)         # reported, outside the verdict
        _write(tmp_path / "C", "add2", seed, 0.1, 0.9)           # an older rule's run: not read for the verdict
        _write(tmp_path / "C", "rg_gcd", seed, 0.0, 0.0)
    design = Design(("sub1", "add2"), ("E", "D"), reported=("add1", "rg_gcd"), reported_folders=("D", "C"))
    text = report(design.results(tmp_path), design.tasks, design.reported)
    verdict, outside = text.split("Reported, not in the verdict:")
    assert "| sub1 | 0, 1, 2 | 50% / 50% / 50%: **50%**" in verdict and "| add2 | 0, 1, 2 | 60%" in verdict
    assert "| add1 |" in outside and "| rg_gcd | 0, 1, 2 | 0%" in outside and "| add1 |" not in verdict
    assert "on the complete tasks: +20 points, holds." in text      # over sub1 and add2 only
