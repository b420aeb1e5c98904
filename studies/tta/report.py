"""The tables of studies/tta/README.md from the run JSONs (`runs/<task>/<arm>-seed<k>.json`) and base.json.

    python -m studies.tta.report            # prints markdown tables
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def base_table(path: Path = HERE / "base.json") -> str:
    rows = ["| task | family | budget | answer tokens (mean / max) | greedy | greedy length | greedy cut | "
            "sampled (4 per prompt) | prompts with a correct sample | constant groups of 4 |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in json.loads(path.read_text()).items():
        if "error" in r:
            rows.append(f"| {name} | error: {r['error']} |||||||||")
            continue
        rows.append(f"| {name} | {r['family']} | {r['max_new_tokens']} | {r['answer_tokens_mean']:.1f} / "
                    f"{r['answer_tokens_max']} | {_pct(r['greedy_accuracy'])} | {r['greedy_length_mean']:.1f} | "
                    f"{_pct(r.get('greedy_cut_rate'))} | {_pct(r.get('sampled_accuracy'))} | "
                    f"{_pct(r.get('prompts_any_correct'))} | {_pct(r.get('constant_group_frac'))} |")
    return "\n".join(rows)


def runs_table(root: Path = HERE / "runs") -> str:
    rows = ["| task | arm | seed | before | evaluations (CPU s: greedy) | final | steps | CPU s / step | reward | "
            "constant groups | within-group reward var | cut | grad norm | skipped | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(root.glob("*/*.json")):
        d = json.loads(path.read_text())
        s = d["summary"]
        evals = ", ".join(f"{e['train_clock_s']:.0f}: {e['accuracy']:.0%}" for e in d["evals"][1:])
        load = statistics.fmean([d["load_before"][0], d["load_after"][0]])
        rows.append(f"| {d['task']} | {d['arm']} | {d['seed']} | {_pct(d['accuracy_before'])} | {evals} | "
                    f"**{_pct(s['final_accuracy'])}** | {s['steps']} | {_num(s.get('mean_step_cpu_s'), '{:.1f}')} | "
                    f"{_num(s['reward_mean'])} | {_pct(s['constant_groups'])} | {_num(s['reward_var_within'], '{:.3f}')} | "
                    f"{_pct(s['cut_rate'])} | {_num(s['grad_norm'])} | {s['skipped_steps'] if s['grad_norm'] is not None else '-'} | "
                    f"{load:.1f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(base_table(), "\n")
    print(runs_table())
