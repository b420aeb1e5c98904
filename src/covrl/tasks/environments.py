"""Environments: multi-turn episodes, optionally with tools (docs/environments.md).

    messages = env.reset(example)                     # the opening messages (system / user)
    loop:  model writes an assistant message (one sampler turn, up to its end-of-turn token)
           out = env.step(assistant_text)             # EnvStep(messages, done, reward | None)
           until out.done (or task.env.max_turns)

`reward=None` on the final step means "score the final assistant message with the task's reward and grader"
(so `task.reward` and `task.rewards` keep working); a number is the episode's reward.

Built in (`ENVIRONMENTS`, chosen with `task.env.name`; a `module:Class` / `file.py:Class` spec loads a user
class: one with `step` is an Environment, one without is adapted as a TRL `environment_factory` object):
- single_turn: any task as a one-step environment (reset = the task's prompt, the first reply ends it);
- calculator: a `calculator(expression)` tool (+ - * / and parentheses), the final answer graded by the task;
- add: an `add(a, b)` tool (the toy for the tiny char model).
"""

from __future__ import annotations

import ast
import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from covrl.tasks.base import Example
from covrl.tasks.config import EnvironmentConfig
from covrl.tasks.failures import FailureWatch
from covrl.tasks.rewards import RewardRunner, load_user_reward
from covrl.tasks.task import Task
from covrl.tasks.tools import Tool, ToolExecutor, parse_tool_calls

__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "SingleTurnEnvironment", "TRLEnvironment", "ToolEnvironment",
           "build_environment", "calculator", "add"]


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one assistant message."""

    messages: list[dict] = field(default_factory=list)
    done: bool = False
    reward: float | None = None


@runtime_checkable
class Environment(Protocol):
    """One episode's state. `tools` may be empty; `metrics()` (optional) adds per-episode counters."""

    tools: list[Tool]

    def reset(self, example: Example) -> list[dict]: ...

    def step(self, assistant_message: str) -> EnvStep: ...


def _user_messages(task: Task, example: Example) -> list[dict]:
    """[system prompt], the demonstration's turns (task.env.demonstration), then the problem."""
    text = example.prompt if task.cfg.chat_template else example.plain_prompt
    system = task.cfg.system_prompt
    demo = [m.model_dump() for m in task.cfg.env.demonstration]
    return ([{"role": "system", "content": system}] if system is not None and task.cfg.chat_template else []) + \
        demo + [{"role": "user", "content": text}]


class SingleTurnEnvironment:
    """A task as a one-step environment: the first assistant message ends the episode, scored by the task."""

    tools: list[Tool] = []

    def __init__(self, task: Task):
        self.task = task

    def reset(self, example: Example) -> list[dict]:
        return _user_messages(self.task, example)

    def step(self, assistant_message: str) -> EnvStep:
        return EnvStep(done=True)

    def metrics(self) -> dict[str, float]:
        return {}


class ToolEnvironment:
    """The task's prompt with `tools`: each assistant message with tool calls gets one tool message per call
    (executed isolated, with `timeout_s`); the first message without a call (or after `max_tool_calls`) is
    the final answer, scored by the task."""

    def __init__(self, task: Task, tools: list[Tool], *, timeout_s: float | None = 5.0, max_tool_calls: int = 4,
                 failures=None):
        self.task, self.tools = task, tools
        self.executor = ToolExecutor(tools, timeout_s=timeout_s, failures=failures)
        self.max_tool_calls = max_tool_calls
        self.turns_with_calls = 0

    def reset(self, example: Example) -> list[dict]:
        return _user_messages(self.task, example)

    def step(self, assistant_message: str) -> EnvStep:
        calls = parse_tool_calls(assistant_message)
        if not calls or self.executor.calls >= self.max_tool_calls:
            return EnvStep(done=True)
        self.turns_with_calls += 1
        return EnvStep([{"role": "tool", "name": c.name or "", "content": self.executor.execute(c)} for c in calls])

    def metrics(self) -> dict[str, float]:
        ex = self.executor
        return {"tool_calls": float(ex.calls), "tool_errors": float(ex.errors), "tool_timeouts": float(ex.timeouts)}


class TRLEnvironment(ToolEnvironment):
    """A TRL `environment_factory`-style object as an Environment: `reset(**columns) -> str | None` (text
    appended to the user prompt), every public method other than reset / get_reward is a tool (schema from
    its hints and docstring), and `get_reward()` (or a `reward` attribute) is the episode's reward; without
    either the task scores the final answer. reset and get_reward run isolated like the tools."""

    _RESERVED = frozenset({"reset", "get_reward", "step", "close"})

    def __init__(self, task: Task, obj: Any, *, timeout_s: float | None = 5.0, max_tool_calls: int = 4,
                 failures=None):
        tools = [Tool.from_function(getattr(obj, name), name) for name, _ in inspect.getmembers(obj, callable)
                 if not name.startswith("_") and name not in self._RESERVED and not inspect.isclass(getattr(obj, name))]
        super().__init__(task, tools, timeout_s=timeout_s, max_tool_calls=max_tool_calls, failures=failures)
        self.obj = obj
        self._runner = RewardRunner(lambda fn, **kw: fn(**kw), name=f"environment {type(obj).__name__}",
                                    timeout_s=timeout_s, on_error="raise", isolate=True)

    def reset(self, example: Example) -> list[dict]:
        messages = super().reset(example)
        if hasattr(self.obj, "reset"):
            columns = {"prompt": example.prompt, self.task.cfg.answer_field: example.answer,
                       **{k: v for k, v in example.meta.items() if k != "plain_prompt"}}
            obs = self._runner.call(self.obj.reset, **columns)
            if obs:
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\n\n" + str(obs)}
        return messages

    def step(self, assistant_message: str) -> EnvStep:
        out = super().step(assistant_message)
        if not out.done:
            return out
        if hasattr(self.obj, "get_reward"):
            return EnvStep(done=True, reward=float(self._runner.call(self.obj.get_reward)))
        if hasattr(self.obj, "reward"):
            return EnvStep(done=True, reward=float(self.obj.reward))
        return out


# ------------------------------------------------------------------------------------------------ tools

_OPS: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                              ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_node(node.operand))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "12*34"
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _eval_node(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval"))
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return int(a) + int(b)


# ------------------------------------------------------------------------------------------------ registry

EnvFactory = Callable[[], Environment]


def _tools_env(*fns: Callable) -> Callable[[Task, EnvironmentConfig], EnvFactory]:
    tools = [Tool.from_function(f) for f in fns]
    return lambda task, cfg: lambda: ToolEnvironment(task, tools, timeout_s=cfg.tool_timeout_s,
                                                     max_tool_calls=cfg.max_tool_calls)


# name -> builder(task, cfg) -> factory() -> a fresh Environment (one per episode)
ENVIRONMENTS: dict[str, Callable[[Task, EnvironmentConfig], EnvFactory]] = {
    "single_turn": lambda task, cfg: lambda: SingleTurnEnvironment(task),
    "calculator": _tools_env(calculator),
    "add": _tools_env(add),
}


def build_environment(task: Task, cfg: EnvironmentConfig) -> EnvFactory:
    """The factory of episodes' environments named by `cfg.name`: a registry name, or a user class spec
    ('module:Class' / 'file.py:Class'): with `step` it is an Environment (built as cls(), or cls(task)),
    without it a TRL environment_factory object (see TRLEnvironment)."""
    if cfg.name in ENVIRONMENTS:
        return ENVIRONMENTS[cfg.name](task, cfg)
    if ":" not in cfg.name:
        raise ValueError(f"task.env.name={cfg.name!r}; allowed: {sorted(ENVIRONMENTS)} or a user class "
                         "'module:Class' / 'file.py:Class'")
    cls = load_user_reward(cfg.name, field="task.env.name", kind="class")
    if hasattr(cls, "step"):
        takes_task = len(inspect.signature(cls).parameters) > 0
        return lambda: cls(task) if takes_task else cls()
    # the user's tools: their first failure is shown once for the run (never a stop: the model's observation)
    tool_failures = FailureWatch(f"a tool of {cfg.name}", unit="tool calls", max_rate=None)
    return lambda: TRLEnvironment(task, cls(), timeout_s=cfg.tool_timeout_s, max_tool_calls=cfg.max_tool_calls,
                                  failures=tool_failures)
