"""Tools for multi-turn episodes: Python callables with JSON-schema signatures, the tool-call format, and
isolated execution (the user-reward machinery of `covrl.tasks.rewards`: a worker thread and a timeout).

Tool-call format (Hermes / Qwen style, what chat templates with `tools=` teach): the model writes

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>

anywhere in its turn, one block per call. The environment answers each call with a message
`{"role": "tool", "name": ..., "content": <result as text>}`; a malformed block, an unknown tool, bad
arguments, an exception or a timeout become an error text in that message (the episode goes on)."""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from covrl.tasks.rewards import RewardRunner

__all__ = ["TOOL_CALL_PATTERN", "Tool", "ToolCall", "ToolExecutor", "parse_tool_calls", "tool_description"]

TOOL_CALL_PATTERN = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

_JSON_TYPES: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
                               dict: "object", tuple: "array"}
_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


def _json_type(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {"type": [_json_type(a).get("type", "string")
                                                                     for a in args]}
    if origin is typing.Literal:
        values = list(typing.get_args(hint))
        return {"type": _JSON_TYPES.get(type(values[0]), "string"), "enum": values}
    if origin in (list, tuple):
        args = typing.get_args(hint)
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    base = origin or hint
    return {"type": _JSON_TYPES.get(base, "string")}


def _doc_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    """(description, {argument: description}) from a Google-style docstring ("Args:" lines `name: text`)."""
    doc = inspect.getdoc(fn) or ""
    head, _, rest = doc.partition("\nArgs:")
    args: dict[str, str] = {}
    for line in rest.splitlines():
        if line.strip() and not line.startswith((" ", "\t")) and line.rstrip().endswith(":"):
            break   # the next section (Returns:)
        if m := _ARG_LINE.match(line):
            args[m.group(1)] = m.group(2).strip()
    return " ".join(head.split()), args


@dataclass(frozen=True)
class Tool:
    """A callable the model may call, with the JSON schema chat templates take (`tools=[tool.schema]`)."""

    name: str
    fn: Callable = field(repr=False)
    schema: dict[str, Any] = field(repr=False)

    @classmethod
    def from_function(cls, fn: Callable, name: str | None = None) -> Tool:
        """The schema from `fn`'s type hints (int -> integer, float -> number, str, bool, list, Literal -> enum;
        unannotated -> string) and its docstring (first paragraph; `Args:` lines describe the parameters).
        Parameters without a default are required."""
        name = name or fn.__name__
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 - unresolvable annotations: untyped parameters
            hints = {}
        description, arg_docs = _doc_parts(fn)
        props: dict[str, Any] = {}
        required: list[str] = []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "self":
                continue
            prop = _json_type(hints.get(p.name, str))
            if p.name in arg_docs:
                prop["description"] = arg_docs[p.name]
            props[p.name] = prop
            if p.default is p.empty:
                required.append(p.name)
        schema = {"type": "function", "function": {
            "name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": required}}}
        return cls(name=name, fn=fn, schema=schema)


def tool_description(tools: list[Tool]) -> str:
    """Plain-text instructions for templates without `tools=` support: the schemas and the call format."""
    lines = ["You can call these tools:"]
    lines += [json.dumps(t.schema["function"]) for t in tools]
    lines.append('To call a tool, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>; '
                 "the result comes back in the next message. Give the final answer without a tool call.")
    return "\n".join(lines)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `name` and `arguments`, or `error` (malformed JSON, missing name) and the raw text."""

    name: str | None
    arguments: dict[str, Any]
    raw: str
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{json}</tool_call>` block of `text`, in order (see the module docstring)."""
    calls = []
    for m in TOOL_CALL_PATTERN.finditer(text):
        raw = m.group(1)
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(None, {}, raw, f"invalid JSON in tool call: {err.msg}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, {}, raw, 'a tool call needs {"name": str, "arguments": object}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):   # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, raw, "tool call arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args, raw))
    return calls


class ToolExecutor:
    """Runs parsed calls against `tools` with the user-reward isolation (`RewardRunner`: a worker thread, at most
    `timeout_s` per call; a hang is abandoned, an exception is caught). Counts calls, errors and timeouts."""

    def __init__(self, tools: list[Tool], *, timeout_s: float | None = 5.0, failures=None):
        self.tools = {t.name: t for t in tools}
        self.failures = failures   # a FailureWatch shared by the run's episodes: user tools' first failure shown
        self._runners = {t.name: RewardRunner(t.fn, name=f"tool {t.name}", timeout_s=timeout_s, on_error="zero",
                                              isolate=True) for t in tools}
        self.calls = self.errors = self.timeouts = 0

    def execute(self, call: ToolCall) -> str:
        """The result text of one call (an `Error: ...` text when it failed)."""
        self.calls += 1
        if call.error is None and call.name not in self.tools:
            call = ToolCall(call.name, call.arguments, call.raw,
                            f"unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}")
        if call.error is not None:
            self.errors += 1
            return f"Error: {call.error}"
        try:
            result = self._runners[call.name].call(**call.arguments)
        except TimeoutError as err:
            self.errors += 1
            self.timeouts += 1
            return f"Error: {err}"
        except Exception as err:  # noqa: BLE001 - a tool's failure is the model's observation, not the run's
            self.errors += 1
            if self.failures is not None:
                self.failures.failed(err, f"a call of tool {call.name}", f"arguments {call.arguments!r:.80}")
            return f"Error: {type(err).__name__}: {err}"
        return result if isinstance(result, str) else json.dumps(result, default=str)
