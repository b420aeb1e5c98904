"""OpenAI-compatible routes for `covrl serve`'s sampling sessions: an agent program (any program that calls a
chat-completions API) samples from a session's weights through `/openai/<sampling_session_id>/v1`, with the
same answers as covrl's training endpoint (covrl.rollout.openai_api: the chat template, tool calls, log-probs,
`return_token_ids` for the exact prompt and sampled ids).

Each session gets, on its first call, an `OpenAIServer` on 127.0.0.1 around a `ClientSampler`; the Tinker
server authenticates the caller (the tenant's key as `X-API-Key` or as the OpenAI client's bearer key) and
forwards the request to it. Every generation runs on the Tinker server's model thread, in turn with the
tenants' other jobs, with the session's weights held (a snapshot's are swapped in and out as for `asample`)."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import torch

from covrl.rollout.openai_api import (
    EPISODE_HEADER,
    EPISODE_KEY_PREFIX,
    PLAIN_AGENT_TEMPLATE,
    OpenAIServer,
    bearer_key,
)

__all__ = ["ClientSampler", "SessionEndpoints"]

PREFIX = "/openai/"


class ClientSampler:
    """The face of a covrl sampler (`generate`, `cfg`, `eos_ids`, `context`, `version`) over one sampling
    client (covrl.api.SamplingClient): `on_worker(fn)` runs each generation on the server's model thread."""

    def __init__(self, client, on_worker: Callable[[Callable[[], Any]], Any]):
        self.client, self.on_worker = client, on_worker

    @property
    def _sampler(self):
        return self.client.owner.sampler

    @property
    def cfg(self):
        return self._sampler.cfg

    @property
    def eos_ids(self):
        return getattr(self._sampler, "eos_ids", None)

    @property
    def context(self):
        return getattr(self._sampler, "context", None)

    @property
    def version(self) -> int:
        return self.client.version

    def generate(self, rows: list[list[int]], n: int, *, generator: torch.Generator, policy_version=None,
                 greedy: bool = False, **_: Any):
        api = self.client

        def job():
            api._check_fresh()           # a client of pushed weights that are no longer the sampler's refuses
            with api._weights_held():
                return api.owner.sampler.generate(rows, n, generator=generator, policy_version=api.version,
                                                  greedy=greedy)
        return self.on_worker(job)


class SessionEndpoints:
    """One OpenAIServer per sampling session (made at its first call, closed with the server)."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self._servers: dict[str, OpenAIServer] = {}
        self._lock = threading.Lock()

    def server(self, session_id: str, client, on_worker: Callable[[Callable[[], Any]], Any]) -> OpenAIServer:
        with self._lock:
            found = self._servers.get(session_id)
            if found is None:
                tokenizer = client.owner.tokenizer
                template = None if getattr(tokenizer, "chat_template", None) else PLAIN_AGENT_TEMPLATE
                found = self._servers[session_id] = OpenAIServer(
                    ClientSampler(client, on_worker), tokenizer, chat_template=template, model_name=session_id,
                    generator=torch.Generator().manual_seed(self.seed), version=lambda: client.version)
            return found

    def forward(self, server: OpenAIServer, method: str, route: str, headers, raw: bytes) -> tuple[int, str, bytes]:
        """The session server's answer to `method route` (its own path, e.g. /v1/chat/completions): status,
        content type and body. The episode header, and a bearer key that names an episode, go along."""
        sent = {"Content-Type": "application/json"}
        if headers.get(EPISODE_HEADER):
            sent[EPISODE_HEADER] = headers.get(EPISODE_HEADER)
        bearer = bearer_key(headers)
        if bearer.startswith(EPISODE_KEY_PREFIX):
            sent["Authorization"] = f"Bearer {bearer}"
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}{route}", data=raw if method == "POST" else None,
                                         headers=sent, method=method)
        try:
            with urllib.request.urlopen(request, timeout=900) as answer:
                return answer.status, answer.headers.get("Content-Type", "application/json"), answer.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers.get("Content-Type", "application/json"), err.read()

    def close(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.close()


def split_route(path: str) -> tuple[str, str]:
    """'/openai/<session>/v1/chat/completions?x' -> ('<session>', '/v1/chat/completions')."""
    rest = path.split("?", 1)[0][len(PREFIX):]
    session, _, route = rest.partition("/")
    return session, "/" + route
