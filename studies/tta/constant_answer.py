"""The accuracy of the best constant answer on each suite task's held-out prompts: the answer a policy that ignores
the question would settle on, and so the floor that RL on a small model can reach by a shortcut.

    python -m studies.tta.constant_answer --out studies/tta/constant_answer.json [TASK ...]

The held-out prompts are the ones `covrl bench tta` evaluates: the task's first 50 (configs/default.yaml with the
suite task's overrides)."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

from covrl.bench.tta_suite import TASKS, materialise
from covrl.config import load_config
from covrl.tasks import build_task

EVAL_PROMPTS = 50
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


def overrides(name: str, data_dir: Path) -> list[str]:
    return [f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}"
            for k, v in materialise(name, data_dir).items()]


def constant_answer(name: str) -> dict:
    with tempfile.TemporaryDirectory() as data_dir:
        cfg = load_config(DEFAULT_CONFIG, overrides(name, Path(data_dir)))
        held_out = build_task(cfg.task).eval[:EVAL_PROMPTS]
    answers = Counter(str(e.answer).strip() for e in held_out)
    best, count = answers.most_common(1)[0]
    return {"answer": best, "accuracy": count / len(held_out), "distinct_answers": len(answers),
            "prompts": len(held_out)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", nargs="*", default=[t for t in TASKS if t != "reverse_word"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    out = {}
    for name in args.tasks:
        out[name] = constant_answer(name)
        print(f"{name}: {out[name]['answer']!r} on {out[name]['accuracy']:.0%} of {out[name]['prompts']} held-out "
              f"prompts ({out[name]['distinct_answers']} distinct answers)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
