"""Messages -> token ids for episodes: the opening prompt (with tools) and the environment's later messages as
a token DELTA appended to the context. The context of a turn is never re-rendered from text: the model's
tokens stay exactly what the sampler drew, and each environment reply is tokenised on its own.

With a chat template, a reply's delta is what the template adds after a finished assistant turn: rendered
against a fixed dummy history (user "U", assistant "A"), minus that history's text up to the assistant's
end-of-turn token (the sampler stopped on it; the template's separator after it, e.g. "\\n", belongs to the
delta), with the next assistant turn opened. Without a chat template (plain prompts, the tiny char model),
messages are the role formats of `PLAIN_FORMATS`."""

from __future__ import annotations

import json

from covrl.tasks.tools import Tool, tool_description

__all__ = ["PLAIN_FORMATS", "delta_ids", "prompt_ids", "template_supports_tools"]

# role -> format of one message in plain (no chat template) episodes
PLAIN_FORMATS: dict[str, str] = {
    "system": "{content}\n",
    "user": "{content}",
    "assistant": "{content}",
    "tool": "\n<tool_response>{content}</tool_response>\n",
}

_DUMMY_HISTORY = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools=` argument (it mentions `tools`)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(template.values())
    return isinstance(template, str) and "tools" in template


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _plain(messages: list[dict]) -> str:
    out = []
    for m in messages:
        fmt = PLAIN_FORMATS.get(m["role"])
        if fmt is None:
            raise ValueError(f"plain episodes have no format for role {m['role']!r}; roles: {sorted(PLAIN_FORMATS)}")
        out.append(fmt.format(content=m["content"]))
    return "".join(out)


def _compact_tools(tools: list[Tool]) -> str:
    # one line per tool: plain prompts feed small models with short contexts
    sigs = []
    for t in tools:
        params = t.schema["function"]["parameters"]["properties"]
        sigs.append(f"{t.name}({', '.join(params)})")
    return "tools: " + "; ".join(sigs)


def prompt_ids(tokenizer, messages: list[dict], tools: list[Tool], *, chat_template: bool) -> list[int]:
    """The episode's opening context: `messages` (from `Environment.reset`) with the assistant turn opened.
    Tools go to the template's `tools=` when it supports them, else a plain-text description in the system
    message; plain prompts get a one-line `tools: name(args)` header."""
    if not chat_template:
        head = (_compact_tools(tools) + "\n") if tools else ""
        return _encode(tokenizer, head + _plain(messages))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("task.chat_template=true but the tokenizer has no chat template; set "
                         "task.chat_template=false for plain prompts (e.g. the tiny char model)")
    messages = [dict(m) for m in messages]
    kwargs = {}
    if tools and template_supports_tools(tokenizer):
        kwargs["tools"] = [t.schema for t in tools]
    elif tools:
        text = tool_description(tools)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = messages[0]["content"] + "\n\n" + text
        else:
            messages.insert(0, {"role": "system", "content": text})
    return _encode(tokenizer, tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                            **kwargs))


def delta_ids(tokenizer, messages: list[dict], *, chat_template: bool) -> list[int]:
    """Token ids of the environment's `messages` after a finished assistant turn, ending with the next
    assistant turn opened (see the module docstring)."""
    if not chat_template:
        return _encode(tokenizer, _plain(messages))
    messages = [{**m, "content": m["content"] if isinstance(m["content"], str) else json.dumps(m["content"])}
                for m in messages]
    before = tokenizer.apply_chat_template(_DUMMY_HISTORY, tokenize=False)
    after = tokenizer.apply_chat_template(_DUMMY_HISTORY + messages, add_generation_prompt=True, tokenize=False)
    if not after.startswith(before):
        raise ValueError("the chat template renders a conversation differently once messages follow (its text "
                         "is not a prefix); episodes need a prefix-stable template")
    eos = tokenizer.eos_token or ""
    cut = before.rfind(eos) if eos else -1
    separator = before[cut + len(eos):] if cut >= 0 else ""
    return _encode(tokenizer, separator + after[len(before):])
