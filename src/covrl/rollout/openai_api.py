"""An OpenAI-compatible endpoint around any covrl sampler, on the loopback address, that records the exact tokens.

An agent program written against the OpenAI API (the `openai` client, LangChain, a hand-rolled loop) points its
`base_url` at this server and runs unchanged; covrl samples every completion from its own sampler (hf or vLLM,
the policy version being trained) and records, per call, the token ids the model saw and drew:

    POST /v1/chat/completions   messages -> the tokenizer's chat template (with `tools`) -> token ids -> sample
    POST /v1/completions        prompt text (or token ids) -> sample
    GET  /v1/models             the served model
    POST /inference/v1/generate the token-in / token-out route of covrl.rollout.serve (unchanged)

Episodes. The client names its episode with its API key: `api_key="ep-<id>"` (sent as `Authorization: Bearer
ep-<id>`, so any OpenAI client works unchanged), or with the header `X-Covrl-Episode: <id>`. Each call of an
episode is recorded as an `AgentCall`: the prompt token ids exactly as the template produced them, the sampled
ids, their log q under the sampler, the finish reason, the policy version and, with a truncating sampler
(top-k / top-p / min-p), the size of the kept set each token was drawn from (the trainer's replay). With `strict=True` (training) only
episodes opened with `calls.open(id)` are served (401 otherwise: a late call of an abandoned episode records
nothing).

Requests. Handled: `messages`, `prompt`, `n`, `max_tokens` / `max_completion_tokens` (the completion is cut there:
the kept tokens are unchanged draws of q), `stop` (strings; cut after the token that completes one, the stop text
left out of the returned text), `stop_token_ids`, `logprobs`, `top_logprobs` (the sampler's top-k, with
sampler.return_topk >= k), `tools` (into the chat template), `tool_choice` (auto / none), `chat_template_kwargs`,
`return_token_ids` (vLLM's: `prompt_token_ids` and each choice's `token_ids` in the answer), `stream` (the whole
completion as one chunk, then `[DONE]`). Sampling is covrl's: the trainer's ratios assume the sampler's q, so a
`temperature` / `top_p` / `top_k` / `min_p` / penalty that differs from the sampler's is not applied and warned
about once, by name; so are `seed` (draws come from the run's generator) and bookkeeping fields (`user`,
`metadata`, `store`, `parallel_tool_calls`, `stream_options`, `service_tier`). Any other field is a 400 naming it.

Tool calls. The completion's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes / Qwen
format, and covrl's plain template's) become the message's `tool_calls` (arguments as a JSON string, OpenAI's
form; finish_reason "tool_calls"), the blocks cut from `content`. Arguments that come back in a request's
assistant messages as JSON strings are parsed to objects before templating (as vLLM does).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field

from covrl.rollout.serve import GenerateServer, _Pending
from covrl.tasks.tools import TOOL_CALL_PATTERN, parse_tool_calls

__all__ = ["AgentCall", "CallLog", "EPISODE_HEADER", "bearer_key", "EPISODE_KEY_PREFIX", "OpenAIServer", "PLAIN_AGENT_TEMPLATE",
           "episode_api_key"]

EPISODE_KEY_PREFIX = "ep-"
EPISODE_HEADER = "X-Covrl-Episode"

# request fields that choose the sampling distribution: not applied (covrl samples with its sampler's q); the
# value a request may carry that changes nothing, per field (None: only the sampler's own value)
_DISTRIBUTION = {"temperature": None, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
                 "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None}
# bookkeeping of the client: ignoring them changes nothing the agent sees (warned once)
_HARMLESS = {"seed", "user", "metadata", "store", "parallel_tool_calls", "stream_options", "service_tier"}
_COMMON = {"model", "n", "max_tokens", "stop", "stop_token_ids", "logprobs", "stream", "return_token_ids"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "chat_template_kwargs"}
_COMPLETION = _COMMON | {"prompt", "add_special_tokens"}

# The chat format for a tokenizer without a chat template (the tiny char models): the messages' texts one per
# line, an assistant turn closed by EOS, tool calls in covrl's <tool_call> form (the line breaks are Jinja
# expressions: chat templates render with trim_blocks, which eats a literal one after a tag). The generation
# prompt is the line break that the next call's rendering puts before the assistant text, so a later call's
# prompt begins with the earlier prompt + the sampled ids (+ the EOS the template adds when the draw was cut)
# and the calls merge into one row (covrl.rollout.agents). covrl.rollout.episodes.PLAIN_CHAT_TEMPLATE ends a
# user turn with nothing instead, so there a second call's prompt never extends the first call's.
PLAIN_AGENT_TEMPLATE = (
    "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ m['content'] or '' }}"
    "{% for tc in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ tc['function']['name'] }}\", "
    "\"arguments\": {{ tc['function']['arguments'] if tc['function']['arguments'] is string "
    "else tc['function']['arguments'] | tojson }}}</tool_call>{% endfor %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n' }}{% endif %}")


def episode_api_key(episode: str) -> str:
    """The API key that names `episode` (give it to the agent's OpenAI client)."""
    return f"{EPISODE_KEY_PREFIX}{episode}"


class RequestError(ValueError):
    """A request covrl refuses: the HTTP status and the message the client sees."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AgentCall:
    """One sampled completion of an episode, as the sampler produced it (n > 1: one per choice)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str          # stop | length | tool_calls
    policy_version: int | None
    text: str                   # the returned content (tool-call blocks cut out)
    kept: list[int] | None = None   # a truncating sampler's kept-set size per sampled token (trainer.truncation)


@dataclass
class _Episode:
    calls: list[AgentCall] = field(default_factory=list)


class CallLog:
    """The recorded calls, by episode id. `strict`: only episodes opened with `open` are served and recorded."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    def open(self, episode: str) -> None:
        with self._lock:
            self._episodes[episode] = _Episode()

    def close(self, episode: str) -> list[AgentCall]:
        """The episode's calls, in the order they completed; later calls of it are refused (strict)."""
        with self._lock:
            found = self._episodes.pop(episode, None)
        return [] if found is None else found.calls

    def calls(self, episode: str) -> list[AgentCall]:
        with self._lock:
            found = self._episodes.get(episode)
            return [] if found is None else list(found.calls)

    def check(self, episode: str | None) -> None:
        if not self.strict:
            return
        if episode is None:
            raise RequestError("no episode named: use the API key 'ep-<id>' (Authorization: Bearer ep-<id>) or the "
                               f"header {EPISODE_HEADER}", 401)
        with self._lock:
            if episode not in self._episodes:
                raise RequestError(f"episode {episode!r} is not open (finished, timed out, or never started)", 401)

    def record(self, episode: str | None, calls: list[AgentCall]) -> None:
        if episode is None:
            return
        with self._lock:
            found = self._episodes.get(episode)
            if found is None:
                if self.strict:   # closed while the call generated: the episode is over, nothing is added
                    return
                found = self._episodes[episode] = _Episode()
            found.calls.extend(calls)


def bearer_key(headers) -> str:
    """The key of an `Authorization: Bearer <key>` header (what an OpenAI client sends as its api_key), or ''."""
    auth = headers.get("Authorization") or ""
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def _episode_of(headers) -> str | None:
    named = headers.get(EPISODE_HEADER)
    if named:
        return named.strip()
    key = bearer_key(headers)
    return key[len(EPISODE_KEY_PREFIX):] if key.startswith(EPISODE_KEY_PREFIX) and len(key) > 3 else None


def _normalise_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty list of {role, content} objects is required")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError(f"messages[{i}]: an object with a role is required")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):   # content parts: the text parts, joined (images are not supported)
            kinds = {p.get("type") for p in content if isinstance(p, dict)}
            if kinds - {"text"}:
                raise RequestError(f"messages[{i}].content: part types {sorted(kinds - {'text'})} are not supported "
                                   "(text only)")
            m["content"] = "".join(p.get("text", "") for p in content)
        calls = m.get("tool_calls")
        if calls:
            parsed = []
            for tc in calls:
                tc = dict(tc)
                fn = dict(tc.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass   # left as the model wrote it
                tc["function"] = fn
                parsed.append(tc)
            m["tool_calls"] = parsed
        out.append(m)
    return out


def _tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content without the tool-call blocks, OpenAI tool_calls) of a completion; malformed blocks stay text."""
    calls = parse_tool_calls(text)
    if not calls or any(c.error for c in calls):
        return text, []
    content = TOOL_CALL_PATTERN.sub("", text).strip()
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


class OpenAIServer(GenerateServer):
    """The OpenAI-compatible routes on covrl.rollout.serve's server (its batcher: concurrent requests are one
    `sampler.generate` call). `tokenizer`: the policy's (its chat template renders `messages`; `chat_template`
    replaces it, e.g. covrl's plain template for a tokenizer without one). `calls`: where the calls are recorded
    (a CallLog; strict for training)."""

    def __init__(self, sampler, tokenizer, *, calls: CallLog | None = None, chat_template: str | None = None,
                 **kwargs):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.calls = calls if calls is not None else CallLog()
        super().__init__(sampler, **kwargs)

    # -- requests ---------------------------------------------------------------------------------------------
    def _fields(self, body: dict, allowed: set[str], route: str) -> None:
        for name, value in body.items():
            if name in allowed:
                continue
            if name in _DISTRIBUTION:
                if value is None or value == _DISTRIBUTION[name]:
                    continue
                ours = getattr(self.sampler.cfg, name, None)
                if ours is not None and value == ours:
                    continue
                self._warn_once(name, f"{route}: {name}={value!r} is not applied; covrl samples with its sampler's "
                                      f"settings (sampler.{name}={ours!r}; the trainer's ratios assume them)")
            elif name in _HARMLESS:
                if value is not None:
                    self._warn_once(name, f"{route}: {name}={value!r} is ignored (draws come from the run's "
                                          "generator; bookkeeping fields are not kept)")
            else:
                raise RequestError(f"unsupported field {name!r} for {route} (covrl's endpoint handles: "
                                   f"{', '.join(sorted(allowed))})")

    def _warn_once(self, name: str, text: str) -> None:
        if name not in self.warned:
            self.warned.add(name)
            self.warn(text)

    def _template(self, messages: list[dict], tools, kwargs: dict) -> str:
        tok = self.tokenizer
        extra = dict(kwargs or {})
        if tools:
            extra["tools"] = tools
        if self.chat_template is not None:
            extra["chat_template"] = self.chat_template
        elif not getattr(tok, "chat_template", None):
            raise RequestError("the tokenizer has no chat template: use /v1/completions with plain prompts")
        try:
            return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except Exception as err:  # noqa: BLE001 - a template error is the request's (roles, tool format)
            raise RequestError(f"the chat template failed on these messages: {type(err).__name__}: {err}") from err

    def chat_prompt_ids(self, messages: list[dict], tools=None, chat_template_kwargs: dict | None = None) -> list[int]:
        """The token ids a chat request is sampled from: the template's text, encoded without added specials."""
        text = self._template(_normalise_messages(messages), tools, chat_template_kwargs or {})
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _max_tokens(self, body: dict) -> int:
        cap = int(self.sampler.cfg.max_new_tokens)
        for name in ("max_completion_tokens", "max_tokens"):
            value = body.get(name)
            if value is not None:
                if not isinstance(value, int) or value < 1:
                    raise RequestError(f"{name}={value!r}: a positive integer is required")
                return min(cap, value)
        return cap

    def _stops(self, body: dict) -> list[str]:
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise RequestError(f"stop={stop!r}: a string or a list of non-empty strings is required")
        return stops

    def _sample(self, prompt: list[int], body: dict) -> list[dict]:
        """n completions of `prompt` (one batch with the other pending requests), cut at max_tokens / stop:
        [{ids, logprobs, top, finish, version, text}]."""
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or not 1 <= n <= 128:
            raise RequestError(f"n={n!r}: an integer from 1 to 128 is required")
        context = getattr(self.sampler, "context", None)
        budget = int(self.sampler.cfg.max_new_tokens)
        if context and len(prompt) + budget > int(context):
            raise RequestError(f"the prompt has {len(prompt)} tokens; with sampler.max_new_tokens={budget} it "
                               f"passes the model's context of {context} tokens")
        max_tokens, stops = self._max_tokens(body), self._stops(body)
        stop_ids = {int(t) for t in body.get("stop_token_ids") or []}
        items = [_Pending(list(prompt), stop_ids) for _ in range(n)]
        for item in items:
            self._queue.put(item)
        out = []
        for item in items:
            if not item.done.wait(600.0):
                raise TimeoutError("no completion within 600 s")
            if item.error is not None:
                raise item.error
            choice = item.result["choices"][0]
            ids, finish = list(choice["token_ids"]), choice["finish_reason"]
            content = choice["logprobs"]["content"]
            lps = [float(c["logprob"]) for c in content]
            top = [c.get("top_logprobs") for c in content]
            kept = item.kept
            if len(ids) > max_tokens:
                ids, lps, top, finish = ids[:max_tokens], lps[:max_tokens], top[:max_tokens], "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            for k in range(len(ids)) if stops else ():
                upto = self.tokenizer.decode(ids[:k + 1], skip_special_tokens=True)
                hit = min((upto.find(s) for s in stops if s in upto), default=-1)
                if hit >= 0:
                    ids, lps, top, finish, text = ids[:k + 1], lps[:k + 1], top[:k + 1], "stop", upto[:hit]
                    break
            out.append({"ids": ids, "logprobs": lps, "top": top, "finish": finish, "text": text,
                        "version": item.result.get("policy_version"),
                        "kept": None if kept is None else kept[:len(ids)]})
        return out

    def _logprobs(self, sample: dict, top_n: int) -> dict:
        tok = self.tokenizer
        entries = []
        for t, lp, top in zip(sample["ids"], sample["logprobs"], sample["top"]):
            entry = {"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode([t]).encode()),
                     "top_logprobs": []}
            for alt in (top or [])[:top_n]:
                alt_id = int(str(alt["token"]).rsplit(":", 1)[-1])
                text = tok.decode([alt_id])
                entry["top_logprobs"].append({"token": text, "logprob": float(alt["logprob"]),
                                              "bytes": list(text.encode())})
            entries.append(entry)
        return {"content": entries}

    def _top_n(self, body: dict) -> int:
        top_n = body.get("top_logprobs") or 0
        if not isinstance(top_n, int) or top_n < 0:
            raise RequestError(f"top_logprobs={top_n!r}: a non-negative integer is required")
        have = int(getattr(self.sampler.cfg, "return_topk", 0) or 0)
        if top_n > have:
            self._warn_once("top_logprobs", f"top_logprobs={top_n}: the sampler records its top {have} "
                                            "(sampler.return_topk); the answer lists at most those")
        return top_n

    def _record(self, episode: str | None, prompt: list[int], samples: list[dict], finishes: list[str]) -> None:
        self.calls.record(episode, [AgentCall(list(prompt), s["ids"], s["logprobs"], f, s["version"], s["text"],
                                              s["kept"]) for s, f in zip(samples, finishes)])

    def chat(self, body: dict, episode: str | None = None) -> dict:
        """The answer to a /v1/chat/completions request (recorded under `episode`)."""
        self._fields(body, _CHAT, "/v1/chat/completions")
        self.calls.check(episode)
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise RequestError(f"tool_choice={choice!r}: only 'auto' and 'none' (a forced call would change the "
                               "sampling distribution)")
        if choice == "none":
            tools = None
        prompt = self.chat_prompt_ids(body.get("messages"), tools, body.get("chat_template_kwargs"))
        samples = self._sample(prompt, body)
        top_n = self._top_n(body) if body.get("logprobs") else 0
        choices, finishes = [], []
        for i, s in enumerate(samples):
            content, calls = _tool_calls(s["text"]) if tools else (s["text"], [])
            finish = "tool_calls" if calls and s["finish"] == "stop" else s["finish"]
            s["text"] = content
            message = {"role": "assistant", "content": content if content or not calls else None}
            if calls:
                message["tool_calls"] = calls
            item = {"index": i, "message": message, "finish_reason": finish,
                    "logprobs": self._logprobs(s, top_n) if body.get("logprobs") else None}
            if body.get("return_token_ids"):
                item["token_ids"] = s["ids"]
            choices.append(item)
            finishes.append(finish)
        self._record(episode, prompt, samples, finishes)
        out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
               "model": self.model_name, "choices": choices, "usage": self._usage(prompt, samples)}
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = prompt
        return out

    def completion(self, body: dict, episode: str | None = None) -> dict:
        """The answer to a /v1/completions request (recorded under `episode`)."""
        self._fields(body, _COMPLETION, "/v1/completions")
        self.calls.check(episode)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str) and prompt:
            # vLLM's default for completions: the tokenizer's special tokens (a BOS) added
            ids = list(self.tokenizer(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
                       ["input_ids"])
        else:
            raise RequestError("prompt: one non-empty string or one list of token ids is required")
        samples = self._sample(ids, body)
        if body.get("logprobs"):
            top_n = int(body["logprobs"]) if not isinstance(body["logprobs"], bool) else 0
            if top_n > int(getattr(self.sampler.cfg, "return_topk", 0) or 0):
                self._warn_once("logprobs", f"logprobs={top_n}: the sampler records its top "
                                            f"{getattr(self.sampler.cfg, 'return_topk', 0)} (sampler.return_topk)")
        choices = []
        for i, s in enumerate(samples):
            item = {"index": i, "text": s["text"], "finish_reason": s["finish"], "logprobs": None}
            if body.get("logprobs"):
                lp = self._logprobs(s, top_n)["content"]
                item["logprobs"] = {"tokens": [e["token"] for e in lp], "token_logprobs": [e["logprob"] for e in lp],
                                    "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]}
                                                     for e in lp], "text_offset": []}
            if body.get("return_token_ids"):
                item["token_ids"] = s["ids"]
            choices.append(item)
        self._record(episode, ids, samples, [s["finish"] for s in samples])
        out = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
               "model": self.model_name, "choices": choices, "usage": self._usage(ids, samples)}
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = ids
        return out

    @staticmethod
    def _usage(prompt: list[int], samples: list[dict]) -> dict:
        done = sum(len(s["ids"]) for s in samples)
        return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}

    # -- HTTP -------------------------------------------------------------------------------------------------
    def _handler(self):
        base = super()._handler()
        server = self
        routes = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "completion",
                  "/completions": "completion"}

        class Handler(base):
            def _stream(self, answer: dict, kind: str) -> None:
                # the whole completion as one chunk, then the finish chunk and [DONE] (server-sent events)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"
                for choice in answer["choices"]:
                    if kind == "chat":
                        delta = {k: v for k, v in choice["message"].items() if v is not None}
                        for j, tc in enumerate(delta.get("tool_calls") or []):
                            tc["index"] = j
                        parts = [{"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"],
                                  "finish_reason": None},
                                 {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}]
                    else:
                        parts = [choice]
                    for part in parts:
                        event = {"id": answer["id"], "object": chunk_object, "created": answer["created"],
                                 "model": answer["model"], "choices": [part]}
                        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def do_POST(self):
                kind = routes.get(self.path.split("?", 1)[0].rstrip("/"))
                if kind is None:
                    base.do_POST(self)
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                    if not isinstance(body, dict):
                        raise RequestError("the request body must be a JSON object")
                    episode = _episode_of(self.headers)
                    answer = server.chat(body, episode) if kind == "chat" else server.completion(body, episode)
                except RequestError as err:
                    self._send(err.status, {"error": {"message": str(err), "type": "invalid_request_error",
                                                      "code": err.status}})
                    return
                except (ValueError, TypeError) as err:
                    self._send(400, {"error": {"message": str(err), "type": "invalid_request_error"}})
                    return
                except Exception as err:  # noqa: BLE001 - the agent sees the engine's error, not a hang
                    self._send(500, {"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error"}})
                    return
                if body.get("stream"):
                    self._stream(answer, kind)
                else:
                    self._send(200, answer)

        return Handler
