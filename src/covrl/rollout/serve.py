"""A token-in / token-out generate endpoint around any covrl sampler, on the loopback address.

It speaks the wire format of vLLM's `/inference/v1/generate` (prime-rl's engines; the `renderers` client that
verifiers' train client uses): a request carries prompt token ids and sampling parameters, the answer the
completion's token ids with the log-probability of each under the sampler's distribution q. So an environment
framework that renders and parses its own chats (verifiers, prime-rl's orchestrator) can drive covrl's
sampler (hf or vLLM, the current policy version), and every token it reports is one covrl drew, with log q
exactly as the sync loop records it.

    POST /inference/v1/generate  {"token_ids": [...], "sampling_params": {...}}
         -> {"prompt_token_ids": [...], "policy_version": <version>, "choices": [{"token_ids": [...],
             "finish_reason": "stop" | "length", "logprobs": {"content": [{"token": "token_id:<id>",
             "logprob": <log q>, "top_logprobs": [...] (with sampler.return_topk)}, ...]}}]}
    GET  /v1/models  -> {"data": [{"id": <name>, "max_model_len": <context>}]}

Requests that arrive together (concurrent episodes) are generated in one batched `sampler.generate` call: the
batcher waits `batch_window_s` after the last arrival, or until `max_batch` requests are pending.

Sampling is covrl's (the trainer's importance ratios and the gap accounting assume the sampler's configured
q): a request's temperature, top_p, top_k, min_p or max_tokens that differ from the sampler's are not applied
and are warned about once, by name; n > 1 is refused. A request's stop token ids that the sampler does not
stop at end the completion at their first occurrence (the tokens before it are unchanged draws of q).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

__all__ = ["GenerateServer"]

# request field -> the sampler config field covrl samples with
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "max_tokens": "max_new_tokens"}
# fields that carry no sampling choice (bookkeeping of the client), accepted silently
_IGNORED_FIELDS = {"logprobs", "skip_special_tokens", "stop_token_ids", "n", "seed", "return_token_ids",
                   "include_stop_str_in_output", "spaces_between_special_tokens", "chat_template_kwargs"}
# what "no truncation" reads as in a request, per field
_NEUTRAL = {"top_p": 1.0, "top_k": -1, "min_p": 0.0}


class _HTTPServer(ThreadingHTTPServer):
    # many episodes connect at once: socketserver's backlog of 5 overflows and some connections are reset
    request_queue_size = 1024


@dataclass
class _Pending:
    prompt: list[int]
    stop_ids: set[int]
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    error: BaseException | None = None
    kept: list[int] | None = None   # the sampler's kept-set size per token (a truncating sampler; agents' rows)


class GenerateServer:
    """The endpoint around `sampler` (a covrl sampler: `generate`, `cfg`, `eos_ids`, `context`).

    `generator`: the torch.Generator every batch draws from; `version`: a callable giving the policy version
    the sampler holds (recorded by the caller, who also reads `batches` / `requests` for its metrics).
    `refresh` (set by the caller, None by default): () -> (weights, version) newer than the sampler's, or None,
    polled before each batch, so that a batch of calls is drawn by the newest weights handed (an agent's episode
    in the async loop's partial rollouts: one version per call, calls of one episode may differ).
    `warn`: where the once-per-field warnings go (stderr by default)."""

    def __init__(self, sampler, *, generator: torch.Generator, model_name: str = "covrl",
                 batch_window_s: float = 0.05, max_batch: int = 256, version: Callable[[], int] | None = None,
                 warn: Callable[[str], None] | None = None):
        self.sampler, self.generator, self.model_name = sampler, generator, model_name
        self.batch_window_s, self.max_batch = float(batch_window_s), int(max_batch)
        self.version = version
        self.refresh: Callable[[], tuple[Any, int] | None] | None = None
        self.warn = warn or (lambda text: print(f"warning: {text}", file=sys.stderr, flush=True))
        self.warned: set[str] = set()
        self.requests = self.batches = 0
        self.greedy = False
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._lock = threading.Lock()      # one generate at a time; load_weights callers take it too
        self._stop = threading.Event()
        self._httpd = _HTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        # a new thread starts at OpenMP's default thread count, not its creator's: the batcher adopts this one
        self._torch_threads = torch.get_num_threads()
        self._threads = [threading.Thread(target=self._httpd.serve_forever, name="covrl-generate-http", daemon=True),
                         threading.Thread(target=self._batch_loop, name="covrl-generate-batcher", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL (`/v1`); the generate route is mounted at the server root."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def lock(self) -> threading.Lock:
        """Held while a batch generates: take it to load new weights between batches."""
        return self._lock

    def close(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- requests ---------------------------------------------------------------------------------------------
    def _check_sampling(self, params: dict) -> set[int]:
        """The request's stop token ids; warns once per sampling field covrl does not apply."""
        if int(params.get("n", 1) or 1) != 1:
            raise ValueError(f"sampling_params.n={params['n']}: one completion per request")
        cfg = self.sampler.cfg
        for name, value in params.items():
            if value is None or name in _IGNORED_FIELDS:
                continue
            ours = getattr(cfg, _SAMPLING_FIELDS[name], None) if name in _SAMPLING_FIELDS else None
            if name in _SAMPLING_FIELDS:
                same = (ours is None and value == _NEUTRAL.get(name)) or (ours is not None and value == ours)
                if name == "max_tokens" and ours is not None and int(value) >= int(ours):
                    same = True   # a larger budget: covrl's cap holds, nothing is cut that the caller wanted
                if same:
                    continue
                text = (f"generate endpoint: sampling_params.{name}={value!r} is not applied; covrl samples "
                        f"with sampler.{_SAMPLING_FIELDS[name]}={ours!r} (the trainer's ratios assume it)")
            else:
                text = f"generate endpoint: sampling_params.{name}={value!r} is not supported and ignored"
            if name not in self.warned:
                self.warned.add(name)
                self.warn(text)
        return {int(t) for t in params.get("stop_token_ids") or []}

    def submit(self, prompt: list[int], sampling_params: dict | None = None, timeout_s: float = 600.0) -> dict:
        """Generate one completion (blocks; batched with the other pending requests): the response body."""
        stop_ids = self._check_sampling(dict(sampling_params or {}))
        if not prompt or not all(isinstance(t, int) for t in prompt):
            raise ValueError("token_ids must be a non-empty list of integers")
        item = _Pending(list(prompt), stop_ids)
        self._queue.put(item)
        if not item.done.wait(timeout_s):
            raise TimeoutError(f"generate endpoint: no completion within {timeout_s:g} s")
        if item.error is not None:
            raise item.error
        return item.result

    def _batch_loop(self) -> None:
        # generate with the creating thread's count, as the run's numbers and vLLM's CPU attention (which checks
        # it against the engine's) expect; torch._C's setter, since vLLM's CPU worker turns torch.set_num_threads
        # into a no-op once its engine runs
        torch._C.set_num_threads(self._torch_threads)
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            deadline = time.monotonic() + self.batch_window_s
            while len(batch) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    batch.append(self._queue.get(timeout=left))
                    deadline = time.monotonic() + self.batch_window_s   # more may follow: wait again
                except queue.Empty:
                    break
            self._generate(batch)

    def _generate(self, batch: list[_Pending]) -> None:
        try:
            with self._lock:
                newer = self.refresh() if self.refresh is not None else None
                if newer is not None and int(newer[1]) > int(self.sampler.version):
                    self.sampler.load_weights(newer[0], int(newer[1]))
                version = self.version() if self.version is not None else None
                out = self.sampler.generate([p.prompt for p in batch], 1, generator=self.generator,
                                            policy_version=version, greedy=self.greedy)
            self.batches += 1
            self.requests += len(batch)
            eos = set(getattr(self.sampler, "eos_ids", None) or [])
            for j, item in enumerate(batch):
                length = int(out.response_mask[j].sum())
                ids = out.response_ids[j, :length].tolist()
                lps = out.sampler_logprobs[j, :length].tolist()
                cut = next((k for k, t in enumerate(ids) if t in item.stop_ids), None)
                if cut is not None:
                    ids, lps = ids[:cut + 1], lps[:cut + 1]
                finish = "stop" if (ids and (ids[-1] in eos or ids[-1] in item.stop_ids)) else "length"
                if out.sampler_kept is not None:
                    item.kept = out.sampler_kept[j, :len(ids)].tolist()
                content = [{"token": f"token_id:{t}", "logprob": float(lp)} for t, lp in zip(ids, lps)]
                if out.sampler_topk_ids is not None:   # sampler.return_topk: OpenAI's top_logprobs per token
                    top_ids, top_lps = out.sampler_topk_ids[j].tolist(), out.sampler_topk_logprobs[j].tolist()
                    for k, entry in enumerate(content):
                        entry["top_logprobs"] = [{"token": f"token_id:{t}", "logprob": float(lp)}
                                                 for t, lp in zip(top_ids[k], top_lps[k])]
                item.result = {
                    "request_id": uuid.uuid4().hex, "prompt_token_ids": item.prompt,
                    "policy_version": version if version is not None else getattr(self.sampler, "version", None),
                    "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish,
                                 "logprobs": {"content": content}}],
                    "usage": {"prompt_tokens": len(item.prompt), "completion_tokens": len(ids),
                              "total_tokens": len(item.prompt) + len(ids)},
                }
        except BaseException as err:  # noqa: BLE001 - every waiting request gets the error, none hangs
            for item in batch:
                item.error = err
        finally:
            for item in batch:
                item.done.set()

    # -- HTTP -------------------------------------------------------------------------------------------------
    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):   # quiet: the run's own progress line reports
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):   # the client left (an agent timed out)
                    pass

            def do_GET(self):
                if self.path.rstrip("/") in ("/v1/models", "/models"):
                    context = getattr(server.sampler, "context", None)
                    max_len = int(context) if context else None
                    self._send(200, {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                                 "max_model_len": max_len}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                if self.path.rstrip("/") != "/inference/v1/generate":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                    result = server.submit(body.get("token_ids") or [], body.get("sampling_params"))
                except (ValueError, TypeError) as err:
                    self._send(400, {"error": {"message": str(err), "type": "BadRequestError"}})
                    return
                except Exception as err:  # noqa: BLE001 - the caller sees the engine's error, not a hang
                    self._send(500, {"error": {"message": f"{type(err).__name__}: {err}"}})
                    return
                self._send(200, result)

        return Handler
