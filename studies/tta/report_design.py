"""A registered design's tables and verdict (DESIGN_C.md to DESIGN_F.md: the same rules) from its
results: every `studies/tta/runs/<folder>/<task>-s<seed>/` that `run_design.sh` finished (`covrl bench tta` JSON),
read from the design's folders in order (design E reads its own, then design D's runs it reuses). Per task: each
arm's final greedy accuracy per seed and the median, covrl's gain over `trl` (median over seeds), covrl's fraction
of constant groups; then the verdict rules over the design's tasks that have all three seeds, and the tasks it
reports outside the verdict. Prints markdown; nothing is written.

    python -m studies.tta.report_design F
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "runs"
TASKS = ("add1", "add2", "mul1", "count_letters", "reverse_word", "rg_leg_counting", "rg_gcd", "rg_simple_equations",
         "rg_spell_backward", "rg_word_sorting", "rg_basic_arithmetic")
SEEDS = (0, 1, 2)
ARMS = ("covrl", "trl", "trl_sized")


@dataclasses.dataclass(frozen=True)
class Design:
    tasks: tuple[str, ...]             # the verdict's tasks
    folders: tuple[str, ...]           # run folders under runs/, read in order (the first run of a task x seed wins)
    reported: tuple[str, ...] = ()     # tasks reported outside the verdict ...
    reported_folders: tuple[str, ...] = ()   # ... from these folders

    def results(self, runs: Path) -> dict[tuple[str, int], dict]:
        verdict = load(*(runs / f for f in self.folders))
        outside = load(*(runs / f for f in self.reported_folders))
        return ({k: v for k, v in verdict.items() if k[0] in self.tasks}
                | {k: v for k, v in outside.items() if k[0] in self.reported})


# DESIGN_F.md's eleven tasks and the tasks it reports outside its verdict (design G keeps both)
F_TASKS = ("count_letters", "sub1", "rg_chain_sum_ln", "rg_basic_arithmetic_ln", "rg_gcd_ln", "rg_leg_counting_ln",
           "rg_simple_equations_ln", "rg_letter_counting_ln", "rg_lcm_ln", "rg_count_bits_ln", "rg_products_ln")
F_REPORTED = ("add2", "mul1", "reverse_word", "rg_spell_backward", "rg_word_sorting", "rg_basic_arithmetic", "rg_gcd",
              "rg_leg_counting", "rg_simple_equations")


DESIGNS = {
    "C": Design(TASKS, ("C",)),
    "D": Design(TASKS, ("D",)),
    # DESIGN_E.md: the tasks where the untrained model's probe saw a correct sample, add1 and the tasks without
    # one reported from designs D and C
    "E": Design(("add2", "mul1", "count_letters", "sub1", "rg_chain_sum_ln", "rg_basic_arithmetic_ln", "rg_gcd_ln",
                 "rg_leg_counting_ln", "rg_simple_equations_ln"), ("E", "D"),
                reported=("add1", "reverse_word", "rg_spell_backward", "rg_word_sorting", "rg_basic_arithmetic",
                          "rg_gcd", "rg_leg_counting", "rg_simple_equations"), reported_folders=("D", "C")),
    # DESIGN_F.md: lr 1e-5; the tasks with a probe signal that no default was chosen on; add2 and mul1 (the lr
    # was diagnosed on them) and the tasks without a signal reported, from F's runs first
    "F": Design(F_TASKS, ("F",), reported=F_REPORTED, reported_folders=("F", "D", "C")),
    # DESIGN_G.md: design F's tasks and rules; the budget grows only where the steps cut more than the probe saw
    "G": Design(F_TASKS, ("G",), reported=F_REPORTED, reported_folders=("G", "D", "C")),
}


def load(*folders: Path) -> dict[tuple[str, int], dict]:
    """(task, seed) -> that run's task result (arms, probe, ...), for every finished task x seed; a task x seed
    found in several folders is taken from the first."""
    out: dict[tuple[str, int], dict] = {}
    for runs in folders:
        for folder in sorted(runs.glob("*-s[0-9]")):
            for path in folder.glob("*/*.json"):
                for result in json.loads(path.read_text())["results"]["tasks"]:
                    out.setdefault((result["task"], int(result["seed"])), result | {"source": str(path)})
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _median_of(results, task, seeds, arm, value) -> float | None:
    known = [v for v in (value(results[(task, s)]["arms"].get(arm, {})) for s in seeds) if v is not None]
    return statistics.median(known) if known else None


def midway(results, task, seeds) -> str:
    """covrl's and trl's greedy accuracy at the middle evaluation (120 s of 240), median over seeds."""
    def at_middle(arm: dict):
        evals = arm.get("evals") or []
        return evals[len(evals) // 2]["accuracy"] if len(evals) >= 3 else None
    return " / ".join(pct(_median_of(results, task, seeds, arm, at_middle)) for arm in ("covrl", "trl"))


def steps(results, task, seeds) -> str:
    values = [_median_of(results, task, seeds, arm, lambda a: a.get("steps")) for arm in ("covrl", "trl")]
    return " / ".join("-" if v is None else f"{v:.0f}" for v in values)


def report(results: dict[tuple[str, int], dict], tasks: tuple[str, ...] = TASKS, reported: tuple[str, ...] = ()) -> str:
    header = ["| task | seeds | " + " | ".join(f"{arm} (per seed: median)" for arm in ARMS)
              + " | covrl - trl (median) | covrl constant groups (median) | at 120 s: covrl / trl (median) "
              "| steps: covrl / trl (median) |", "|---|---|---|---|---|---|---|---|---|"]
    rows = list(header)
    gains, constants, complete = {}, {}, []
    for task in (*tasks, *reported):
        if task == (reported or (None,))[0]:   # the tasks outside the verdict get a table of their own
            rows += ["", "Reported, not in the verdict:", "", *header]
        seeds = [s for s in SEEDS if (task, s) in results]
        if not seeds:
            continue
        cells = []
        finals = {}
        for arm in ARMS:
            per_seed = [results[(task, s)]["arms"].get(arm, {}).get("final_accuracy") for s in seeds]
            finals[arm] = per_seed
            known = [x for x in per_seed if x is not None]
            cells.append(" / ".join(pct(x) for x in per_seed) + (f": **{pct(statistics.median(known))}**"
                                                                  if known else ""))
        # in whole points: accuracies are k / 50, and 0.6 - 0.4 < 0.2 in floating point would fail rule 2 at +10
        diffs = [round(100 * (c - t)) / 100 for c, t in zip(finals["covrl"], finals["trl"])
                 if c is not None and t is not None]
        gains[task] = statistics.median(diffs) if diffs else None
        const = [results[(task, s)]["arms"]["covrl"].get("constant_groups") for s in seeds]
        const = [c for c in const if c is not None]
        constants[task] = statistics.median(const) if const else None
        if len(seeds) == len(SEEDS) and task in tasks:
            complete.append(task)
        gain = "-" if gains[task] is None else f"{100 * gains[task]:+.0f} pts"
        rows.append(f"| {task} | {', '.join(map(str, seeds))} | " + " | ".join(cells)
                    + f" | {gain} | {pct(constants[task])} | {midway(results, task, seeds)} | "
                    f"{steps(results, task, seeds)} |")
    lines = ["\n".join(rows), ""]
    done = [t for t in complete if gains[t] is not None]
    if len(done) < len(tasks):
        lines.append(f"Verdict: not yet: {len(done)} of {len(tasks)} tasks have all three seeds "
                     f"({', '.join(done) or 'none'}).")
    if done:
        every = all(gains[t] >= 0 for t in done)
        median_gain = statistics.median(gains[t] for t in done)
        known = [constants[t] for t in done if constants[t] is not None]
        lines.append(f"Rule 1 (covrl >= trl on every task, median over seeds) on the complete tasks: "
                     f"{'holds' if every else 'fails on ' + ', '.join(t for t in done if gains[t] < 0)}.")
        lines.append(f"Rule 2 (median gain over tasks >= 10 points) on the complete tasks: {100 * median_gain:+.0f} "
                     f"points, {'holds' if round(100 * median_gain) >= 10 else 'fails'}.")
        if known:
            lines.append(f"Reported: covrl's constant-group fraction, median over the complete tasks: "
                         f"{pct(statistics.median(known))}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="a registered design's tables and verdict")
    parser.add_argument("design", choices=sorted(DESIGNS))
    design = DESIGNS[parser.parse_args(argv).design]
    print(report(design.results(RUNS), design.tasks, design.reported))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
