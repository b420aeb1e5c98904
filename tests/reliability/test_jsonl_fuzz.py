"""Hostile task data: a JSONL file with any mix of broken lines ends in a `DatasetError` naming the file and
the FIRST bad line, or loads into examples every tokenizer can encode; prompts over the context are truncated
or rejected as configured (also mid-run, through the CLI)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from covrl.models import char_tokenizer
from covrl.tasks import PromptTooLongError, TaskConfig, build_task
from covrl.tasks.base import Example
from covrl.tasks.datasets import DatasetError

HERE = Path(__file__).resolve().parent
TOKENIZER = char_tokenizer()
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
good_records = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=60).filter(str.strip), "answer": json_values.filter(lambda v: v is not None)},
    optional={"meta": json_values})
bad_records = st.one_of(
    st.fixed_dictionaries({"answer": json_values}),                                   # no prompt
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20)}),              # no answer
    st.fixed_dictionaries({"prompt": json_scalars.filter(lambda v: not isinstance(v, str)), "answer": json_values}),
    st.fixed_dictionaries({"prompt": st.sampled_from(["", "   ", "\n\t"]), "answer": st.just("1")}),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=9), "answer": st.none()}),
)
lines = st.one_of(
    good_records.map(lambda r: json.dumps(r, ensure_ascii=False)),
    good_records.map(json.dumps),                                   # \uXXXX escapes
    bad_records.map(json.dumps),
    json_values.filter(lambda v: not isinstance(v, dict)).map(json.dumps),           # not an object
    st.text(max_size=30).filter(lambda t: "\n" not in t and "\r" not in t),         # maybe not JSON at all
    st.sampled_from(["", "   ", "{", "[" * 5000, '{"prompt": "x", "answer": 1', "NaN", '{"prompt": "\\ud800", "answer": 1}',
                     '{"prompt": "a", "answer": ' + "9" * 5000 + "}"]),
)


def first_bad_line(text_lines: list[str]) -> int | None:
    """The loader's rules, line by line: blank lines skipped; the line must be a JSON object with a non-empty
    string prompt, a non-null answer, and valid Unicode in both."""
    for number, line in enumerate(text_lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            return number
        if not isinstance(record, dict) or record.get("prompt") is None or record.get("answer") is None:
            return number
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            return number
        try:
            (prompt + str(record["answer"])).encode("utf-8")
        except UnicodeEncodeError:
            return number
    return None


def load(path: Path, **options) -> object:
    cfg = TaskConfig(name="jsonl", path=str(path), n_train=options.pop("n_train", 5),
                     n_eval=options.pop("n_eval", 1), chat_template=False, **options)
    return build_task(cfg)


@FUZZ
@given(text_lines=st.lists(lines, min_size=0, max_size=8))
def test_fuzzed_jsonl_names_the_first_bad_line_or_loads(tmp_path, text_lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(text_lines) + "\n", encoding="utf-8", errors="surrogatepass")
    bad = first_bad_line(text_lines)
    good = sum(1 for line in text_lines if line.strip())
    try:
        task = load(path)
    except DatasetError as err:
        text = str(err)
        if bad is not None:
            assert text.startswith(f"{path}:{bad}: "), text
        else:  # every line is fine: only "empty" or "too few rows for the eval split" may be refused
            assert str(path) in text and ("empty" in text or "n_eval" in text or "eval set" in text), text
        return
    assert bad is None and good >= 2
    for example in task.train + task.eval:
        assert isinstance(example.prompt, str) and example.prompt.strip()
        ids = task.encode(TOKENIZER, example)
        assert 0 < len(ids) <= task.cfg.max_prompt_tokens


@FUZZ
@given(blob=st.binary(max_size=300))
def test_random_bytes_never_escape_as_another_exception(tmp_path, blob):
    path = tmp_path / "blob.jsonl"
    path.write_bytes(blob)
    try:
        load(path)
    except DatasetError as err:
        assert str(path) in str(err)


@pytest.mark.parametrize("content, needle", [
    (b'{"prompt": "a", "answer": 1}\n{"prompt": "caf\xe9", "answer": 2}\n', ":2: not UTF-8 text"),
    (b'{"prompt": "a", "answer": 1}\n' + b"[" * 100_000 + b"\n", ":2: unreadable JSON (RecursionError"),
    (b'{"prompt": "a", "answer": ' + b"9" * 5000 + b"}\n", ":1: unreadable JSON (ValueError"),
    (b'{"prompt": "a\\ud800", "answer": 1}\n', ":1: field 'prompt' is not valid Unicode"),
    (b'{"prompt": "a", "answer": 1}\n\n\n{"answer": 2}\n', ":4: missing field 'prompt'"),
    (b'{"prompt": 7, "answer": 1}\n', ":1: field 'prompt' must be a non-empty string"),
    (b'["prompt", "answer"]\n', ":1: expected a JSON object"),
    (b"\n\n  \n", ": the dataset is empty"),
])
def test_each_malformed_file_names_file_and_line(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DatasetError) as info:
        load(path)
    assert str(info.value).startswith(str(path)) and needle in str(info.value)


def test_missing_file_folder_and_bom(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path)
    bom = tmp_path / "bom.jsonl"  # files saved by Windows editors start with a UTF-8 byte order mark
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": 1}\r\n{"prompt": "b", "answer": 2}\r\n')
    task = load(bom, n_train=2)
    assert {e.prompt for e in task.train + task.eval} == {"a", "b"}


def test_huge_and_odd_answers_are_text(tmp_path):
    path = tmp_path / "odd.jsonl"
    rows = [{"prompt": "p1", "answer": 1e308}, {"prompt": "p2", "answer": [1, 2]}, {"prompt": "p3", "answer": "ü"}]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\nNaN\n")
    with pytest.raises(DatasetError, match=r"odd.jsonl:4: expected a JSON object"):
        load(path)
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    task = load(path, n_train=3, n_eval=0)
    answers = {e.prompt: e.answer for e in task.train}
    assert answers["p1"] == str(1e308) and answers["p2"] == "[1, 2]" and answers["p3"] == "ü"
    out = task.score(["1e308", "12", "ü"], [Example("p1", answers["p1"])] * 3)
    assert all(math.isfinite(r) for r in out.rewards) and out.errors == 0


# ------------------------------------------------------------------------- prompts longer than the context

def long_task(tmp_path: Path, **options):
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=" + "x" * 300, "answer": str(i + 1)}) + "\n"
                            for i in range(10)))
    return load(path, n_train=8, n_eval=1, **options)


def test_overlong_prompts_are_truncated_keeping_the_end(tmp_path):
    task = long_task(tmp_path, max_prompt_tokens=16)
    example = task.train[0]
    full = list(TOKENIZER(example.plain_prompt, add_special_tokens=False)["input_ids"])
    ids = task.encode(TOKENIZER, example)
    assert len(full) > 16 and ids == full[-16:]
    assert task.num_truncated == 1


def test_overlong_prompts_are_rejected_when_configured(tmp_path):
    task = long_task(tmp_path, max_prompt_tokens=16, overlong="error")
    with pytest.raises(PromptTooLongError, match=r"exceeds task.max_prompt_tokens=16 .*overlong='truncate'"):
        task.encode(TOKENIZER, task.train[0])


def tiny_overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [f"run.output_dir={tmp_path / 'runs'}", f"run.name={name}", "loop.steps=2", "loop.prompts_per_step=2",
            "loop.group_size=2", "sft_warmup.steps=0", "eval.before=false", "eval.after=false",
            "logging.curves=false", "logging.console=false", "logging.diagnostics=false",
            "checkpoint.at_end=false", *extra]


def test_overlong_prompt_met_mid_run_stops_with_a_clear_message(tmp_path, capsys):
    """Prompts are encoded lazily by the loop: with overlong=error the first long prompt used to escape
    `covrl train` as a traceback; it now ends the command with exit code 2 and the message."""
    import torch

    from covrl.config import load_config
    from covrl.train.launch.modes import train_from_config

    torch.set_num_threads(1)
    long_task(tmp_path)  # writes long.jsonl
    cfg = load_config(HERE.parents[1] / "configs" / "tiny.yaml", tiny_overrides(
        tmp_path, "overlong", "task.name=jsonl", f"task.path={tmp_path / 'long.jsonl'}", "task.n_eval=1",
        "task.n_train=8", "task.max_prompt_tokens=100", "task.overlong=error"))
    assert train_from_config(cfg) == 2
    err = capsys.readouterr().err
    assert "exceeds task.max_prompt_tokens=100" in err and "Traceback" not in err


def test_prompts_beyond_the_model_context_are_rejected_with_a_clear_message(tmp_path, capsys):
    """task.max_prompt_tokens (default 512) above the model's context (tiny: 64 positions): a 304-token prompt
    used to run through RoPE extrapolation silently; the sampler now refuses it, naming both limits."""
    import torch

    from covrl.config import load_config
    from covrl.train.launch.modes import train_from_config

    torch.set_num_threads(1)
    long_task(tmp_path)
    cfg = load_config(HERE.parents[1] / "configs" / "tiny.yaml", tiny_overrides(
        tmp_path, "context", "task.name=jsonl", f"task.path={tmp_path / 'long.jsonl'}", "task.n_eval=1",
        "task.n_train=8"))
    assert train_from_config(cfg) == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings=64" in err and "task.max_prompt_tokens" in err and "Traceback" not in err
