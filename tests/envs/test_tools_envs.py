"""Tools (schemas from hints/docstrings, the call format, isolated execution), rendering, and the environments
(tool env, TRL adapter, single-turn)."""

from __future__ import annotations

import time

from covrl.models.tiny import char_tokenizer
from covrl.tasks import TaskConfig, build_task
from covrl.tasks.base import Example
from covrl.tasks.environments import ENVIRONMENTS, EnvStep, TRLEnvironment, calculator
from covrl.tasks.render import delta_ids, prompt_ids
from covrl.tasks.tools import Tool, ToolCall, ToolExecutor, parse_tool_calls


def mul(a: int, b: float, mode: str = "x") -> float:
    """Multiply two numbers.

    Args:
        a: the first factor
        b (float): the second factor

    Returns:
        the product
    """
    return a * b


def test_schema_from_hints_and_docstring():
    s = Tool.from_function(mul).schema["function"]
    assert s["name"] == "mul" and s["description"] == "Multiply two numbers."
    props = s["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "the first factor"}
    assert props["b"]["type"] == "number" and props["mode"]["type"] == "string"
    assert s["parameters"]["required"] == ["a", "b"]


def test_parse_tool_calls_and_errors():
    text = ('x <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> y '
            '<tool_call>{bad json}</tool_call><tool_call>{"name": "f", "arguments": "{\\"k\\": 3}"}</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("add", {"a": 1, "b": 2}, calls[0].raw)
    assert calls[1].error and calls[1].name is None
    assert calls[2].arguments == {"k": 3}
    assert parse_tool_calls("no calls here") == []


def test_executor_isolates_errors_and_timeouts():
    def boom(x: int) -> int:
        raise RuntimeError("kaput")

    def slow() -> str:
        time.sleep(5)
        return "late"

    ex = ToolExecutor([Tool.from_function(f) for f in (calculator, boom, slow)], timeout_s=0.2)
    assert ex.execute(ToolCall("calculator", {"expression": "12*34"}, "")) == "408"
    assert "kaput" in ex.execute(ToolCall("boom", {"x": 1}, ""))
    assert "unknown tool" in ex.execute(ToolCall("nope", {}, ""))
    assert "TypeError" in ex.execute(ToolCall("calculator", {"bad": 1}, ""))
    t0 = time.perf_counter()
    assert "longer than" in ex.execute(ToolCall("slow", {}, ""))
    assert time.perf_counter() - t0 < 2.0
    assert "only numbers" in ex.execute(ToolCall("calculator", {"expression": "__import__('os')"}, ""))
    assert ex.calls == 6 and ex.timeouts == 1 and ex.errors == 5


def _task(**over):
    return build_task(TaskConfig(**{"name": "arithmetic", "chat_template": False, "n_train": 8, "n_eval": 2,
                                    **over}))


def test_tool_environment_episode_logic():
    task = _task(env={"name": "calculator", "max_tool_calls": 2})
    env = task.environment()
    ex = task.train[0]
    assert env.reset(ex) == [{"role": "user", "content": ex.plain_prompt}]
    out = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    assert out == EnvStep([{"role": "tool", "name": "calculator", "content": "5"}], done=False)
    assert env.step("the answer is 5").done
    assert env.metrics()["tool_calls"] == 1.0


def test_demonstration_turns_come_before_the_problem():
    demo = [{"role": "user", "content": "2*3="},
            {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}'
                                             "</tool_call>"},
            {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}]
    task = _task(env={"name": "calculator", "demonstration": demo}, chat_template=True, system_prompt="S")
    ex = task.train[0]
    assert task.environment().reset(ex) == [{"role": "system", "content": "S"}, *demo,
                                            {"role": "user", "content": ex.prompt}]
    # the demonstration is part of the opening prompt, rendered by the chat template like any earlier turns
    tok = char_tokenizer()
    tok.chat_template = CHATML
    env = task.environment()
    text = tok.decode(prompt_ids(tok, env.reset(ex), env.tools, chat_template=True))
    assert text.index("<|im_start|>tool\n6<|im_end|>") < text.index(ex.prompt)
    assert "You can call these tools" in text.split("<|im_end|>")[0]   # appended to the system prompt


def test_single_turn_environment_is_the_task():
    task = _task(env={"name": "single_turn"})
    env = task.environment()
    assert env.step("anything").done and env.tools == []


class Counter:
    """A TRL environment_factory-style object: reset + tool methods + get_reward."""

    def reset(self, **columns):
        self.target = int(columns["answer"])
        self.total = 0
        return f"reach {self.target}"

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much
        """
        self.total += by
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total == self.target)


def test_trl_adapter():
    task = _task()
    env = TRLEnvironment(task, Counter())
    assert [t.name for t in env.tools] == ["increment"]
    ex = Example(prompt="p", answer="3", meta={"plain_prompt": "p"})
    assert env.reset(ex)[-1]["content"] == "p\n\nreach 3"
    out = env.step('<tool_call>{"name": "increment", "arguments": {"by": 3}}</tool_call>')
    assert out.messages[0]["content"] == "3" and not out.done
    assert env.step("done") == EnvStep(done=True, reward=1.0)


def test_user_environment_spec(tmp_path):
    f = tmp_path / "myenv.py"
    f.write_text("class Env:\n    def reset(self, **kw):\n        return None\n"
                 "    def ping(self) -> str:\n        '''Ping.'''\n        return 'pong'\n")
    task = _task(env={"name": f"{f}:Env"})
    env = task.environment()
    assert isinstance(env, TRLEnvironment) and env.tools[0].name == "ping"
    assert "calculator" in ENVIRONMENTS and "add" in ENVIRONMENTS


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_render_plain_and_chat_delta():
    tok = char_tokenizer()
    tools = [Tool.from_function(calculator)]
    ids = prompt_ids(tok, [{"role": "user", "content": "2*3="}], tools, chat_template=False)
    assert tok.decode(ids) == "tools: calculator(expression)\n2*3="
    d = delta_ids(tok, [{"role": "tool", "content": "6"}], chat_template=False)
    assert tok.decode(d) == "\n<tool_response>6</tool_response>\n"
    # a chat template: the delta starts after the assistant's end-of-turn token and opens the next turn
    tok.chat_template = CHATML.replace("<|im_end|>", "<eos>")   # the end-of-turn token is the eos
    d = delta_ids(tok, [{"role": "tool", "content": "6"}], chat_template=True)
    assert tok.decode(d) == "\n<|im_start|>tool\n6<eos>\n<|im_start|>assistant\n"
    p = prompt_ids(tok, [{"role": "user", "content": "hi"}], tools, chat_template=True)
    text = tok.decode(p)
    assert "You can call these tools" in text and text.endswith("<|im_start|>assistant\n")


def test_a_user_tools_first_failure_is_shown_once_for_the_run(tmp_path, capsys):
    """A TRL environment's tool that raises: the model gets the error text, the first failure's traceback is
    shown once across every episode's environment, and it never stops the run (the model's observation)."""
    f = tmp_path / "badtool.py"
    f.write_text("class Env:\n    def reset(self, **kw):\n        return None\n"
                 "    def lookup(self, key: str) -> str:\n        '''Look up.\n\n        Args:\n"
                 "            key: the key\n        '''\n        return {}[key]\n")
    task = _task(env={"name": f"{f}:Env"})
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>'
    replies = [task.environment().step(call) for _ in range(3)]
    assert all(r.messages[0]["content"].startswith("Error: KeyError") for r in replies)
    err = capsys.readouterr().err
    assert err.count("(the first failure") == 1 and "a call of tool lookup" in err and "badtool.py" in err
