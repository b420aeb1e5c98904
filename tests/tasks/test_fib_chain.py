"""The long-response built-in task fib_chain and its `final_answer` reward: worked solutions checked by brute
force, the split, the token length on the char tokenizer, and hand cases of the marker parsing."""

import pytest
from pydantic import ValidationError

from covrl.models import char_tokenizer
from covrl.tasks import TaskConfig, build_task
from covrl.tasks.builtin import fib_chain_example
from covrl.tasks.rewards import final_answer, marked_number


def test_worked_solution_hand_case():
    ex = fib_chain_example(3, 5, 3)
    assert ex.plain_prompt == "03,05:"
    assert ex.answer == "a:03+05=08;b:05+08=13;c:08+13=21;#21"
    assert ex.meta["value"] == 21
    wrap = fib_chain_example(60, 70, 2)   # mod 100, always two digits
    assert wrap.answer == "a:60+70=30;b:70+30=00;#00"
    with pytest.raises(ValueError, match="steps"):
        fib_chain_example(1, 2, 53)
    with pytest.raises(ValueError, match="seeds"):
        fib_chain_example(100, 2, 3)


def test_every_step_is_the_recurrence_brute_force():
    task = build_task(TaskConfig(name="fib_chain", n_train=300, n_eval=50, chat_template=False))
    assert not {e.plain_prompt for e in task.eval} & {e.plain_prompt for e in task.train}
    for e in task.train[:100] + task.eval:
        a, b = e.meta["seeds"]
        seq = [a, b]
        for _ in range(24):
            seq.append((seq[-2] + seq[-1]) % 100)
        steps = e.answer.split(";")
        assert len(steps) == 25 and steps[-1] == f"#{seq[-1]:02d}"
        for i, step in enumerate(steps[:-1]):
            label, body = step.split(":")
            x, rest = body.split("+")
            y, z = rest.split("=")
            assert (int(x), int(y), int(z)) == (seq[i], seq[i + 1], seq[i + 2])
            assert label == "abcdefghijklmnopqrstuvwx"[i]
    out = task.score([task.train[0].answer, task.train[0].answer[:-2] + "xx", ""], [task.train[0]] * 3)
    assert out.rewards == [1.0, 0.0, 0.0] and out.correct == [True, False, False]


def test_default_response_is_at_least_256_tokens_and_fits_the_preset():
    from covrl.config import load_preset

    cfg = load_preset("tiny_chain")
    tok = char_tokenizer()
    task = build_task(cfg.task)
    e = task.train[0]
    n_answer = len(task.encode_answer(tok, e))
    c = cfg.task.fib_chain
    width = len(str(c.modulus - 1))
    # steps of "x:a+b=c;" (5 + 3·width chars), "#N", EOS
    assert n_answer == c.min_steps * (5 + 3 * width) + 1 + width + 1 >= 256
    assert cfg.sampler.max_new_tokens > n_answer
    assert len(task.encode(tok, e)) + cfg.sampler.max_new_tokens <= cfg.model.tiny.max_positions


def test_marked_number_and_final_answer_hand_cases():
    assert marked_number("a:00+7=07;#07") == 7
    assert marked_number("#1 then #23") == 23
    assert marked_number("# 42") == 42
    assert marked_number("no marker 5") is None and marked_number("ends #") is None and marked_number("#x") is None
    ex = fib_chain_example(3, 5, 3)
    assert final_answer("anything at all;#21", ex) == 1.0
    assert final_answer("a:03+05=08;#08", ex) == 0.0
    assert final_answer("21", ex) == 0.0        # the result must be marked


def test_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="max_steps"):
        TaskConfig(name="fib_chain", fib_chain={"min_steps": 5, "max_steps": 4})
    with pytest.raises(ValidationError, match="max_steps"):
        TaskConfig(name="fib_chain", fib_chain={"max_steps": 60})
