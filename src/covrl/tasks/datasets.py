"""Tasks from data: JSONL files and local HF `datasets` folders, records with `prompt` and `answer` fields
(names configurable). Nothing is downloaded: a hub id is refused, only local paths are read."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from covrl.tasks.base import Example, cycle_epochs
from covrl.tasks.config import TaskConfig
from covrl.tasks.rewards import _as_number
from covrl.tasks.task import DEFAULT_N_EVAL, Task, held_out_count


class DatasetError(ValueError):
    pass


def _record_to_example(record, cfg: TaskConfig, where: str) -> Example:
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object with fields {cfg.prompt_field!r} and "
                           f"{cfg.answer_field!r}, got {type(record).__name__}")
    for name in (cfg.prompt_field, cfg.answer_field):
        if name not in record or record[name] is None:
            raise DatasetError(f"{where}: missing field {name!r} (fields present: {sorted(record)})")
    prompt = record[cfg.prompt_field]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"{where}: field {cfg.prompt_field!r} must be a non-empty string")
    meta = {k: v for k, v in record.items() if k not in (cfg.prompt_field, cfg.answer_field)}
    for name, text in ((cfg.prompt_field, prompt), (cfg.answer_field, str(record[cfg.answer_field]))):
        try:  # JSON may escape a lone surrogate (\ud800); the tokenizer would fail on it deep inside, mid-run
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DatasetError(f"{where}: field {name!r} is not valid Unicode ({err.reason} at character "
                               f"{err.start})") from None
    return Example(prompt=prompt, answer=str(record[cfg.answer_field]), meta=meta)


def read_jsonl(path: str | Path, cfg: TaskConfig) -> list[Example]:
    """Examples from a JSONL file, one object per line (blank lines skipped). Errors name file and line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"task data file {path.resolve()} does not exist")
    examples = []
    with path.open("rb") as f:  # decoded per line so an encoding error names its line (BOM allowed)
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from err
            except (RecursionError, ValueError) as err:  # nesting too deep; integer over Python's digit limit
                raise DatasetError(f"{where}: unreadable JSON ({type(err).__name__}: {err})") from None
            examples.append(_record_to_example(record, cfg, where))
    if not examples:
        raise DatasetError(f"{path}: the dataset is empty (no JSON lines)")
    return examples


def read_hf_dataset(path: str | Path, cfg: TaskConfig, split: str) -> list[Example]:
    """Examples from a local HF datasets folder: a `save_to_disk` folder, or a folder of data files that
    `datasets.load_dataset` understands. `datasets` is imported only here, with hub access switched off."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"task.path={str(path)!r}: no such local folder (covrl never downloads "
                                "datasets from the hub; save it locally first)")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from covrl._lazy import require

    datasets = require("datasets", "datasets")
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() \
            or (path / "state.json").exists():
        data = datasets.load_from_disk(str(path))
    else:
        data = datasets.load_dataset(str(path))
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DatasetError(f"{path}: split {split!r} not found; splits: {sorted(data)}")
        data = data[split]
    examples = [_record_to_example(dict(row), cfg, f"{path}[{split}] row {i}") for i, row in enumerate(data)]
    if not examples:
        raise DatasetError(f"{path}[{split}]: the dataset is empty")
    return examples


def _task_from_records(cfg: TaskConfig, rows: list[Example], eval_rows: list[Example] | None) -> Task:
    rng = random.Random(cfg.seed)
    if eval_rows is None:
        rows = rows[:]
        rng.shuffle(rows)
        n_eval = held_out_count(cfg, len(rows), data_file=True)
        if n_eval >= len(rows):
            setting = (f"task.n_eval={cfg.n_eval}" if cfg.n_eval is not None else
                       f"task.eval_fraction={cfg.eval_fraction} ({n_eval} rows)" if cfg.eval_fraction is not None
                       else f"holding out {n_eval} row (the default of task.n_eval / task.eval_fraction)")
            raise DatasetError(f"{cfg.path}: {setting} leaves no training rows out of {len(rows)}; hold out "
                               "fewer rows or give task.eval_path")
        eval_rows, rows = rows[:n_eval], rows[n_eval:]
    else:
        if cfg.eval_fraction is not None:
            raise DatasetError(f"task.eval_fraction={cfg.eval_fraction} splits task.path's rows, but "
                               f"task.eval_path={cfg.eval_path} gives the held-out rows: set task.n_eval (how many "
                               "of its rows to use) or neither")
        eval_rows = eval_rows[: cfg.n_eval if cfg.n_eval is not None else DEFAULT_N_EVAL]
    held_out = {e.prompt for e in eval_rows}
    pool = [e for e in rows if e.prompt not in held_out]
    if not pool:
        raise DatasetError(f"{cfg.path}: every training prompt also occurs in the eval set")
    train = cycle_epochs(pool, cfg.n_train, rng)
    numeric = all(_as_number(e.answer) is not None for e in pool + eval_rows)
    default = "last_number" if numeric else "exact_match"
    return Task(cfg, train, eval_rows, default_reward=default, default_grader=default)


def build_jsonl(cfg: TaskConfig) -> Task:
    """Train pool from `path`; eval from `eval_path` or rows split off (seeded; how many: `held_out_count`:
    task.n_eval, task.eval_fraction, or by default 20% of the rows, at most 50). Numeric answers
    are graded by last_number, others by exact_match (unless reward/grader say otherwise)."""
    rows = read_jsonl(cfg.path, cfg)
    eval_rows = read_jsonl(cfg.eval_path, cfg) if cfg.eval_path else None
    return _task_from_records(cfg, rows, eval_rows)


def build_hf_dataset(cfg: TaskConfig) -> Task:
    """Like jsonl, from a local HF datasets folder (`split`; eval from `eval_path` or split off)."""
    rows = read_hf_dataset(cfg.path, cfg, cfg.split)
    eval_rows = read_hf_dataset(cfg.eval_path, cfg, cfg.split) if cfg.eval_path else None
    return _task_from_records(cfg, rows, eval_rows)
