"""An agent written with the `openai` package, trained as it is by covrl (docs/environments.md, "Training an agent
program you already have"): it solves multi-step arithmetic ("Compute 23*41+17. Answer with just the number.")
with a calculator tool, through plain chat completions.

    covrl train --config configs/default.yaml task.agent.fn=examples/agent_calculator.py:run \\
        task.arithmetic.ops='["*","+"]' task.arithmetic.digits=2 task.arithmetic.num_terms=3 ...

The loop: the model answers; a `<tool_call>{"name": "calculator", "arguments": {"expression": ...}}</tool_call>`
in its reply is run and the result goes back as a `tool` message; a reply without a call is the final answer
(covrl grades its last number: `run` returns None). SmolLM2's chat template renders neither `tools=` nor an
assistant message's `tool_calls`, so the tool is described in the system message, two worked episodes show
the call format (without them the 135M model never writes a call), and the reply's text goes back unchanged
as the assistant message: the next prompt then extends the last one token for token and covrl merges the
episode's calls into one training row. Outside covrl, `run` works against any OpenAI-compatible server.
"""

from __future__ import annotations

import ast
import json
import operator
import re

import openai

SYSTEM = ("You can use a calculator. To use it, reply with exactly "
          '<tool_call>{"name": "calculator", "arguments": {"expression": "<expression>"}}</tool_call> '
          "and nothing else; the result comes back in the next message. Then reply with just the number.")


def _call(expr: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'


# two worked episodes (never a generated problem: a one-digit operand)
DEMONSTRATION = [
    {"role": "user", "content": "Compute 12*34+5. Answer with just the number."},
    {"role": "assistant", "content": _call("12*34+5")},
    {"role": "tool", "content": "413"},
    {"role": "assistant", "content": "413"},
    {"role": "user", "content": "Compute 71+29*3. Answer with just the number."},
    {"role": "assistant", "content": _call("71+29*3")},
    {"role": "tool", "content": "158"},
    {"role": "assistant", "content": "158"},
]
MAX_CALLS = 3
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """+ - * / and parentheses on numbers; an error message for anything else (the model's observation)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        out = value(ast.parse(str(expression)[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as err:
        return f"error: {err}"
    return str(int(out)) if float(out).is_integer() else f"{out:.6g}"


def tool_result(reply: str) -> str | None:
    """The calculator's answer to the reply's tool call; None when the reply makes no call (the final answer)."""
    found = CALL.search(reply)
    if found is None:
        return None
    try:
        call = json.loads(found.group(1))
        return calculator(call["arguments"]["expression"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"error: malformed tool call ({type(err).__name__})"


async def run(base_url: str, api_key: str, example) -> None:
    """One episode: up to MAX_CALLS calculator calls, then the answer (covrl grades the last reply)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = example.prompt if hasattr(example, "prompt") else str(example)
    messages = [{"role": "system", "content": SYSTEM}, *DEMONSTRATION, {"role": "user", "content": prompt}]
    for _ in range(MAX_CALLS + 1):
        response = await client.chat.completions.create(model="covrl", messages=messages)
        reply = response.choices[0].message.content or ""
        result = tool_result(reply)
        if result is None:
            break
        messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": result}]
    return None

