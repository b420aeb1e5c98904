"""Built-in tasks, the train/eval split, prompt encoding and the JSONL loader."""

import json

import pytest
from pydantic import ValidationError

from covrl.models import char_tokenizer
from covrl.tasks import PromptTooLongError, TaskConfig, build_task
from covrl.tasks.builtin import evaluate_expression
from covrl.tasks.datasets import DatasetError


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_default_arithmetic_is_one_digit_addition_with_disjoint_eval():
    task = build_task(TaskConfig())
    assert len(task.train) == 1000 and len(task.eval) == 50
    eval_prompts = {e.prompt for e in task.eval}
    assert len(eval_prompts) == 50
    assert not eval_prompts & {e.prompt for e in task.train}
    # 100 one-digit sums: the 50 not held out all appear in train
    assert len({e.prompt for e in task.train}) == 50
    for e in task.train[:20] + task.eval:
        a, b = e.meta["expression"].split("+")
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9 and int(e.answer) == int(a) + int(b)
        assert e.prompt == f"Compute {a}+{b}. Answer with just the number."
        assert e.plain_prompt == f"{a}+{b}="


def test_split_is_seeded():
    a, b, c = (build_task(TaskConfig(seed=s)) for s in (0, 0, 1))
    assert [e.prompt for e in a.eval] == [e.prompt for e in b.eval]
    assert [e.prompt for e in a.train] == [e.prompt for e in b.train]
    assert [e.prompt for e in a.eval] != [e.prompt for e in c.eval]


def test_eval_larger_than_space_is_an_error():
    with pytest.raises(ValueError, match="only 100 distinct"):
        build_task(TaskConfig(n_eval=100))


@pytest.mark.parametrize("operands,ops,value", [
    ([7, 5], ["+"], 12), ([3, 7], ["-"], -4), ([6, 7], ["*"], 42), ([2, 3, 4], ["+", "*"], 14),
    ([2, 3, 4], ["*", "-"], 2), ([9, 2, 3, 4], ["-", "*", "+"], 7),
])
def test_expression_precedence(operands, ops, value):
    assert evaluate_expression(operands, ops) == value


def test_sampled_arithmetic_space_keeps_eval_disjoint():
    task = build_task(TaskConfig(arithmetic={"ops": ["+", "-", "*"], "digits": 2, "num_terms": 3},
                                 n_train=300, n_eval=40))
    assert not {e.prompt for e in task.eval} & {e.prompt for e in task.train}
    for e in task.train[:50]:
        assert int(e.answer) == eval(e.meta["expression"])  # test-only cross-check of the answers
    nonneg = build_task(TaskConfig(arithmetic={"ops": ["-"], "allow_negative": False}, n_eval=10))
    assert all(int(e.answer) >= 0 for e in nonneg.train + nonneg.eval)


def test_letter_tasks():
    count = build_task(TaskConfig(name="count_letters", n_train=50, n_eval=20))
    for e in count.train + count.eval:
        assert int(e.answer) == e.meta["word"].count(e.meta["letter"])
        assert e.plain_prompt == f"count {e.meta['letter']} {e.meta['word']}="
    srt = build_task(TaskConfig(name="sort_letters", n_train=50, n_eval=20))
    assert srt.reward_name == "exact_match"
    e = srt.train[0]
    assert e.answer == "".join(sorted(e.meta["word"]))
    out = srt.score([e.answer, e.meta["word"][::-1] + "x"], [e, e])
    assert out.rewards == [1.0, 0.0]


def test_plain_encoding_and_demonstrations(tok):
    task = build_task(TaskConfig(chat_template=False))
    e = task.train[0]
    assert tok.decode(task.encode(tok, e)) == e.plain_prompt
    demo = task.encode_answer(tok, e)
    assert demo[-1] == tok.eos_token_id and tok.decode(demo[:-1]) == e.answer


def test_chat_template_required_when_asked(tok):
    task = build_task(TaskConfig())
    with pytest.raises(ValueError, match="chat_template=false"):
        task.encode(tok, task.train[0])


def test_chat_template_and_system_prompt(tok):
    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    task = build_task(TaskConfig(system_prompt="Be brief."))
    e = task.train[0]
    assert tok.decode(task.encode(tok, e)) == f"[system]Be brief.[user]{e.prompt}[assistant]"
    plain = build_task(TaskConfig())
    assert tok.decode(plain.encode(tok, e)) == f"[user]{e.prompt}[assistant]"


def test_overlong_prompts(tok):
    trunc = build_task(TaskConfig(chat_template=False, max_prompt_tokens=3, arithmetic={"digits": 2}))
    e = trunc.train[0]
    ids = trunc.encode(tok, e)
    assert len(ids) == 3 and tok.decode(ids) == e.plain_prompt[-3:]  # the end of the prompt is kept
    assert trunc.num_truncated == 1
    strict = build_task(TaskConfig(chat_template=False, max_prompt_tokens=3, overlong="error",
                                   arithmetic={"digits": 2}))
    with pytest.raises(PromptTooLongError, match="max_prompt_tokens=3"):
        strict.encode(tok, strict.train[0])


def test_config_errors_name_fields():
    with pytest.raises(ValidationError, match="unknown task 'nope'"):
        TaskConfig(name="nope")
    with pytest.raises(ValidationError, match="task.path is required"):
        TaskConfig(name="jsonl")
    with pytest.raises(ValidationError, match="overlong"):
        TaskConfig(overlong="drop")
    with pytest.raises(ValidationError, match="extra"):
        TaskConfig(n_trian=3)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_loader(tmp_path):
    rows = [json.dumps({"prompt": f"What is {i}+1?", "answer": i + 1, "source": "x"}) for i in range(30)]
    path = _write(tmp_path / "d.jsonl", rows[:15] + [""] + rows[15:])
    task = build_task(TaskConfig(name="jsonl", path=str(path), n_train=40, n_eval=10))
    assert len(task.eval) == 10 and len(task.train) == 40
    assert not {e.prompt for e in task.eval} & {e.prompt for e in task.train}
    assert task.reward_name == "last_number"  # numeric answers
    assert task.train[0].meta == {"source": "x"} and task.train[0].plain_prompt == task.train[0].prompt
    eval_path = _write(tmp_path / "e.jsonl", [json.dumps({"q": "say hi", "a": "hi"})])
    text = _write(tmp_path / "t.jsonl", [json.dumps({"q": "say yo", "a": "yo"}), json.dumps({"q": "say hi", "a": "hi"})])
    task = build_task(TaskConfig(name="jsonl", path=str(text), eval_path=str(eval_path), prompt_field="q",
                                 answer_field="a", n_train=3, n_eval=5))
    assert task.reward_name == "exact_match"
    assert [e.prompt for e in task.eval] == ["say hi"] and {e.prompt for e in task.train} == {"say yo"}


@pytest.mark.parametrize("lines,match", [
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b"}'], r"d\.jsonl:2: missing field 'answer'"),
    (['{"prompt": "a", "answer": "1"}', "", '{"answer": "2"}'], r"d\.jsonl:3: missing field 'prompt'"),
    (['{"prompt": "a", "answer": "1"}', "{not json"], r"d\.jsonl:2: invalid JSON"),
    (['["prompt", "answer"]'], r"d\.jsonl:1: expected a JSON object"),
    (["", "  "], "empty"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, lines, match):
    path = _write(tmp_path / "d.jsonl", lines)
    with pytest.raises(DatasetError, match=match):
        build_task(TaskConfig(name="jsonl", path=str(path), n_eval=0))


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        build_task(TaskConfig(name="jsonl", path=str(tmp_path / "nope.jsonl")))


def test_hf_dataset_from_local_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": f"p{i}", "answer": str(i)} for i in range(12)])
    ds.save_to_disk(str(tmp_path / "ds"))
    task = build_task(TaskConfig(name="hf_dataset", path=str(tmp_path / "ds"), n_train=8, n_eval=4))
    assert len(task.eval) == 4 and not {e.prompt for e in task.eval} & {e.prompt for e in task.train}
    with pytest.raises(FileNotFoundError, match="never downloads"):
        build_task(TaskConfig(name="hf_dataset", path="someone/some-dataset"))
