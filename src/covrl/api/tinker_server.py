"""`covrl serve`: Tinker's REST API, backed by covrl (`covrl.api.tinker`), for one person on the loopback address or
for a team behind API keys.

Tinker's own Python SDK (`pip install tinker`, 0.38) and the tinker-cookbook recipes talk to it unchanged:

    covrl serve --config tiny --port 8765                 # prints the base URL when it is ready
    TINKER_API_KEY=tml-local python -m tinker_cookbook.recipes.sl_loop base_url=http://127.0.0.1:8765 ...

What it serves (the endpoints SDK 0.38 calls for training and sampling):
- sessions: `client/config`, `client/dynamic_config`, `create_session`, `session_heartbeat`, `telemetry`,
  `sessions/<id>/finish`, `healthz`, `get_server_capabilities`;
- training: `create_model` (LoRA from `lora_config`), `get_info`, `forward_backward` (protobuf in and out;
  `forward_only` for `forward`), `optim_step`, `save_weights`, `load_weights` (also creating a model from a
  state: the SDK's `create_training_client_from_state[_with_optimizer]`), `weights_info`;
- sampling: `save_weights_for_sampler` (a named snapshot, or the current weights for
  `save_weights_and_get_sampling_client`), `create_sampling_session`, `samplers/<id>`, `asample` (protobuf
  out; `prompt_logprobs` for `compute_logprobs`);
- checkpoints: `training_runs/<id>/checkpoints` and `checkpoints` (listing), `DELETE
  training_runs/<id>/checkpoints/<type>/<name>`;
- futures: every training or sampling call returns a future at once and runs on one worker thread, one model
  computation at a time (results do not depend on what else runs); each tenant's calls run in arrival order
  (the SDK sends one training client's requests in order) and the tenants with calls waiting take turns, one
  call each; `retrieve_future` answers when the result is there, else `try_again` after a long poll.

Tenants: with API keys (`keys`: key -> tenant name; the SDK sends its key as `X-API-Key`) every request names
its tenant, and a tenant's sessions, training clients, samplers, futures and checkpoints are its own: its folders
are under `<root>/tenants/<name>/`, and another tenant's id or path is answered exactly as one that does not
exist (404). Without keys there is one tenant, the folders are directly under `<root>`, any key is accepted,
and only a loopback address may be listened on. `Limits` bounds each tenant (training clients, queued calls,
disk, kept states) and every request body.

Checkpoints are `tinker://<model id>/weights/<name>` (a covrl atomic checkpoint at
`<tenant root>/<model id>/checkpoints/<name>/`) and `tinker://<model id>/sampler_weights/<name>` (at
`<tenant root>/<model id>/sampler/checkpoints/<name>/`); a model id is the name of the training client's folder,
so a server started again over the same folder serves every path an earlier one returned. A name that holds a
checkpoint already is refused (the SDK's `save_state(..., overwrite=True)` replaces one). Sampling clients keep
the weights they were made with (`covrl.api.tinker.TrainingClient`); `get_info` names a tokenizer folder under
`<root>/tokenizers/`, so the SDK's `get_tokenizer()` loads it without the model hub. Not served: custom losses on
the server (the SDK runs `forward_backward_custom` on the client), image/audio chunks, top-k log-probs,
`stable_reinforce`, the console/billing/admin endpoints. No TLS: put a TLS-terminating proxy in front
(docs/api.md, "Serving a team").
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import shutil
import sys
import threading
import time
import traceback
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from covrl.api import openai_sessions
from covrl.api import tinker as facade
from covrl.api.client import SNAPSHOT_DIR
from covrl.api.tinker_wire import (
    WireError,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)
from covrl.rollout.openai_api import bearer_key

__all__ = ["Limits", "TinkerServer", "serve"]

PROTO = "application/x-protobuf"
# What the SDK is told about this server: API keys, plain httpx, one forward_backward request per call (its
# chunks would arrive as separate requests; Tinker's losses are sums, so they would add up the same).
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                 "fwdbwd_max_chunk_len": 1 << 20, "fwdbwd_max_chunk_bytes_count": 1 << 40,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}
LONG_POLL_S = 30.0     # under the SDK's 45 s timeout for retrieve_future
SESSION_IDLE_S = 300.0  # a session without a heartbeat this long (the SDK sends one every 10 s) has ended
READ_TIMEOUT_S = 300.0  # a connection that sends nothing this long is closed (an idle keep-alive reconnects)
LOCAL_TENANT = "local"
KEY_HEADER = "X-API-Key"


class UserError(ValueError):
    """A request the server refuses (bad field, unknown id): answered with `status` or a failed future."""
    status = 400


class NotFound(UserError):
    """An id or path this tenant has not got: another tenant's is answered the same way as a missing one."""
    status = 404


class Unauthorized(UserError):
    status = 401


class QuotaExceeded(UserError):
    """A tenant at one of its limits (the SDK raises the message at once)."""
    status = 403


class QueueFull(UserError):
    """A tenant with its limit of calls waiting: 429, which the SDK retries with a back-off."""
    status = 429


@dataclass(frozen=True)
class Limits:
    """What each tenant may use (`covrl serve` flags; None: no limit). `max_training_clients`: training clients
    held at once (an ended session's are released); `max_queued`: calls waiting or running; `max_checkpoint_mb`:
    the tenant's folder on disk, checked before each save; `keep_last`: training states kept per training client
    (the oldest are deleted after a save); `max_body_mb`: any request body (413 beyond)."""
    max_training_clients: int | None = None
    max_queued: int | None = 1024
    max_checkpoint_mb: float | None = None
    keep_last: int | None = None
    max_body_mb: float = 64.0


@dataclass
class Tenant:
    name: str
    root: Path                       # its training clients' folders
    service: facade.ServiceClient    # creates its clients, knows only them


@dataclass
class _Future:
    tenant: str
    done: threading.Event = field(default_factory=threading.Event)
    content_type: str = "application/json"
    body: bytes = b""


@dataclass
class _Sampler:
    client: Any            # a covrl.api.tinker.SamplingClient
    base_model: str
    model_path: str | None
    tenant: str
    session_id: str | None = None


class _FairQueue:
    """Jobs in one queue per tenant; `get` serves the tenants with jobs waiting in turn, one job each, so a
    tenant's job waits for at most one job of each other tenant once it is at the head of its own queue. Each
    tenant's jobs keep their order."""

    def __init__(self):
        self._queues: OrderedDict[str, deque] = OrderedDict()
        self._ready = threading.Condition()
        self._closed = False

    def put(self, tenant: str, item: Any) -> None:
        with self._ready:
            self._queues.setdefault(tenant, deque()).append(item)
            self._ready.notify()

    def get(self) -> Any:
        """The next job, or None once closed and empty."""
        with self._ready:
            while not self._queues and not self._closed:
                self._ready.wait()
            if not self._queues:
                return None
            tenant, jobs = self._queues.popitem(last=False)
            item = jobs.popleft()
            if jobs:     # its turn is over: behind every other tenant that has jobs waiting
                self._queues[tenant] = jobs
            return item

    def waiting(self, tenant: str) -> int:
        with self._ready:
            return len(self._queues.get(tenant, ()))

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()


class TinkerServer:
    """The REST server around a `covrl.api.tinker.ServiceClient` (`service`): `start()` serves on a thread,
    `serve_forever()` in this one; `base_url` once bound. `log`: one line per request and per finished job
    (stderr by default; API keys never appear in it). `keys`: API key -> tenant name (None or empty: one user,
    loopback only); `limits`: each tenant's (`Limits`); `model_dirs`: with keys, the folders a local model may
    be read from (a tenant may name a model folder only under one of them)."""

    def __init__(self, service: facade.ServiceClient, *, root: str | Path, host: str = "127.0.0.1",
                 port: int = 0, log: Callable[[str], None] | None = None, keys: Mapping[str, str] | None = None,
                 limits: Limits | None = None, model_dirs: Sequence[str | Path] = ()):
        if not keys and not _is_loopback(host):
            raise ValueError(f"--host {host!r}: listening beyond loopback needs API keys (--keys FILE or "
                             "COVRL_SERVE_KEYS), and a TLS-terminating proxy in front")
        self.service, self.root = service, Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        service.state_dir = str(self.root)
        self.log = log if log is not None else (lambda text: print(text, file=sys.stderr, flush=True))
        self.limits = limits or Limits()
        # keys are kept as digests only: a key never sits in memory dumps of the tables or in any message
        self._keys = {_digest(k): name for k, name in (keys or {}).items()}
        self._model_dirs = [Path(d).resolve() for d in model_dirs]
        self._tenants: dict[str, Tenant] = {}
        self.models: dict[tuple[str, str], facade.TrainingClient] = {}   # (tenant, model id) -> client
        self.samplers: dict[str, _Sampler] = {}
        self.sessions: dict[tuple[str, str], float] = {}     # (tenant, session id) -> last heartbeat (monotonic)
        self._futures: dict[str, _Future] = {}
        self._jobs = _FairQueue()
        self._pending: Counter[str] = Counter()      # tenant -> calls waiting or running
        self._creating: Counter[str] = Counter()     # tenant -> training clients being built
        self._lock = threading.Lock()
        self._httpd = _HTTPServer((host, port), self._handler())
        self._httpd.daemon_threads = True
        self._worker = threading.Thread(target=self._work, name="covrl-serve-worker", daemon=True)
        self._worker.start()
        self._openai_sessions = openai_sessions.SessionEndpoints(service.config.run.seed)
        self._routes: dict[tuple[str, str], Callable[[Tenant, dict], Any]] = {
            ("GET", "get_server_capabilities"): self._capabilities,
            ("GET", "checkpoints"): lambda tenant, _: self._list_checkpoints(tenant, None),
            ("POST", "client/config"): lambda *_: CLIENT_CONFIG,
            ("POST", "client/dynamic_config"): lambda *_: {"refresh_interval_sec": 300},
            ("POST", "create_session"): self._create_session,
            ("POST", "session_heartbeat"): self._heartbeat,
            ("POST", "telemetry"): lambda *_: {"status": "accepted"},
            ("POST", "cancel_future"): lambda *_: None,
            ("POST", "create_model"): self._create_model,
            ("POST", "get_info"): self._get_info,
            ("POST", "optim_step"): self._optim_step,
            ("POST", "save_weights"): self._save_weights,
            ("POST", "load_weights"): self._load_weights,
            ("POST", "weights_info"): self._weights_info,
            ("POST", "save_weights_for_sampler"): self._save_for_sampler,
            ("POST", "create_sampling_session"): self._create_sampling_session,
            ("POST", "asample"): self._asample,
            ("POST", "retrieve_future"): self._retrieve,
        }

    # ------------------------------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def keyed(self) -> bool:
        return bool(self._keys)

    def start(self) -> TinkerServer:
        threading.Thread(target=self._httpd.serve_forever, name="covrl-serve-http", daemon=True).start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._openai_sessions.close()
        self._jobs.close()

    # ------------------------------------------------------------------------------------------ tenants

    def tenant(self, name: str) -> Tenant:
        """The tenant `name` (made on first use): its folders under `<root>/tenants/<name>/` with keys, `<root>`
        itself without."""
        with self._lock:
            if name not in self._tenants:
                if self.keyed:
                    folder = self.root / "tenants" / name
                    folder.mkdir(parents=True, exist_ok=True)
                    self._tenants[name] = Tenant(name, folder, self.service.scoped(folder))
                else:
                    self._tenants[name] = Tenant(name, self.root, self.service)
            return self._tenants[name]

    def _authenticate(self, headers) -> Tenant:
        if not self.keyed:
            return self.tenant(LOCAL_TENANT)
        given = headers.get(KEY_HEADER) or ""
        digest = _digest(given)
        # compare against every digest, so the time taken does not tell how close a guess was
        name = None
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known, digest):
                name = tenant
        if name is None:
            raise Unauthorized(f"{KEY_HEADER}: missing or not a key of this server (set TINKER_API_KEY to the key "
                               "you were given)")
        return self.tenant(name)

    def _tag(self, tenant: Tenant) -> str:
        return f"{tenant.name}: " if self.keyed else ""

    # ------------------------------------------------------------------------------------------ futures

    def _submit(self, tenant: Tenant, what: str, job: Callable[[], tuple[str, bytes]], model_id: str | None = None,
                **extra: Any) -> dict:
        """Queue `job` (returning content type and body) in `tenant`'s queue and answer with its future."""
        limit = self.limits.max_queued
        request_id = uuid.uuid4().hex
        with self._lock:
            if limit is not None and self._pending[tenant.name] >= limit:
                raise QueueFull(f"{self._tag(tenant)}{self._pending[tenant.name]} calls are waiting, this server's "
                                f"limit per tenant (covrl serve --max-queued {limit}); wait for results before "
                                "sending more")
            self._pending[tenant.name] += 1
            self._futures[request_id] = _Future(tenant.name)
        self._jobs.put(tenant.name, (tenant, request_id, what, job))
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {}), **extra}

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            tenant, request_id, what, job = item
            start = time.perf_counter()
            future = self._futures[request_id]
            try:
                future.content_type, future.body = job()
                self.log(f"covrl serve: {self._tag(tenant)}{what} done in {time.perf_counter() - start:.2f}s")
            except Exception as err:   # the caller's future fails with the reason; the server goes on
                category = "user" if isinstance(err, (UserError, ValueError, TypeError, KeyError)) else "server"
                if category == "server":
                    traceback.print_exc()
                self.log(f"covrl serve: {self._tag(tenant)}{what} failed: {type(err).__name__}: {err}")
                future.content_type = "application/json"
                future.body = json.dumps({"error": f"{type(err).__name__}: {err}", "category": category}).encode()
            with self._lock:
                self._pending[tenant.name] -= 1
            future.done.set()

    def _on_worker(self, tenant: Tenant, what: str, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the worker thread (in turn with the queued jobs: one model computation at a time) and
        return its result here, for the calls the SDK expects an answer to, not a future."""
        result: list = []
        failure: list = []

        def job():
            try:
                result.append(fn())
            except UserError as err:     # answered with its own status (a missing path: 404)
                failure.append(err)
                raise
            return "application/json", b"null"
        request_id = self._submit(tenant, what, job)["request_id"]
        future = self._futures[request_id]
        future.done.wait()
        self._futures.pop(request_id, None)
        if failure:
            raise failure[0]
        if not result:
            raise UserError(json.loads(future.body).get("error", f"{what} failed"))
        return result[0]

    def _retrieve(self, tenant: Tenant, body: dict) -> Any:
        request_id = body.get("request_id")
        future = self._futures.get(request_id) if isinstance(request_id, str) else None
        if future is None or future.tenant != tenant.name:
            raise NotFound(f"request_id {request_id!r}: no such future")
        if not future.done.wait(LONG_POLL_S):
            # 408: the SDK polls again at once, quietly (a 200 "try_again" logs a warning every time)
            return _Raw("application/json", _dumps({"type": "try_again", "queue_state": "active"}), status=408)
        self._futures.pop(request_id, None)
        return _Raw(future.content_type, future.body)

    # ------------------------------------------------------------------------------------------ sessions

    def _capabilities(self, tenant: Tenant, _: dict) -> dict:
        names = ["tiny", "HuggingFaceTB/SmolLM2-135M-Instruct"]
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True} for n in names]}

    def _create_session(self, tenant: Tenant, body: dict) -> dict:
        session_id = f"covrl-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sessions[(tenant.name, session_id)] = time.monotonic()
        return {"session_id": session_id}

    def _heartbeat(self, tenant: Tenant, body: dict) -> dict:
        with self._lock:
            self.sessions[(tenant.name, str(body.get("session_id")))] = time.monotonic()
        return {"type": "session_heartbeat"}

    def _release_session(self, tenant: Tenant, session_id: str) -> None:
        """Forget an ended session's training clients and samplers (their calls already queued still run)."""
        with self._lock:
            self.sessions.pop((tenant.name, session_id), None)
            gone = [key for key in self.models if key[0] == tenant.name and key[1].startswith(f"{session_id}:")]
            clients = [self.models.pop(key) for key in gone]
            for sampler_id in [s for s, v in self.samplers.items()
                               if v.tenant == tenant.name and v.session_id == session_id]:
                del self.samplers[sampler_id]
        for client in clients:
            tenant.service.forget(client)
        if clients:
            self.log(f"covrl serve: {self._tag(tenant)}session {session_id} ended: {len(clients)} training "
                     "client(s) released")

    def _reserve_training_client(self, tenant: Tenant) -> None:
        """Count a training client about to be built against the tenant's limit (QuotaExceeded at it, after
        releasing the clients of sessions that stopped sending heartbeats)."""
        limit = self.limits.max_training_clients

        def held() -> int:     # with the lock held
            return sum(1 for key in self.models if key[0] == tenant.name) + self._creating[tenant.name]
        with self._lock:
            full = limit is not None and held() >= limit
            sessions = list(self.sessions.items())
        if full:
            now = time.monotonic()
            for (name, session_id), seen in sessions:
                if name == tenant.name and now - seen > SESSION_IDLE_S:
                    self._release_session(tenant, session_id)
        with self._lock:
            if limit is not None and held() >= limit:
                raise QuotaExceeded(f"{self._tag(tenant)}{held()} training clients held, this server's limit per "
                                    f"tenant (covrl serve --max-training-clients {limit}); a session's training "
                                    f"clients are released {SESSION_IDLE_S:.0f} s after its last heartbeat (when "
                                    "its process ends)")
            self._creating[tenant.name] += 1

    def _built(self, tenant: Tenant) -> None:
        with self._lock:
            self._creating[tenant.name] -= 1

    # ------------------------------------------------------------------------------------------ training

    def _model(self, tenant: Tenant, body: dict) -> tuple[str, facade.TrainingClient]:
        model_id = body.get("model_id")
        client = self.models.get((tenant.name, model_id)) if isinstance(model_id, str) else None
        if client is None:
            raise NotFound(f"model_id {model_id!r}: no such training model on this server")
        return model_id, client

    def _register(self, tenant: Tenant, client: facade.TrainingClient, model_id: str) -> str:
        with self._lock:     # (the HTTP threads count and release a tenant's models)
            self.models[(tenant.name, model_id)] = client
        return model_id

    def _check_base_model(self, base_model: str) -> None:
        """With keys, a tenant names a model covrl knows or a folder under --models-dir: not any folder of this
        machine (another tenant's, or files the server can read)."""
        if not self.keyed or not facade.ServiceClient.is_model_folder(base_model):
            return
        folder = Path(base_model).resolve()
        if not any(folder.is_relative_to(d) for d in self._model_dirs):
            raise UserError(f"base_model {base_model!r}: not served here; name 'tiny' or "
                            "'HuggingFaceTB/SmolLM2-135M-Instruct', or a model folder under the server's "
                            "--models-dir")

    def _create_model(self, tenant: Tenant, body: dict) -> dict:
        base_model = _field(body, "base_model", str)
        self._check_base_model(base_model)
        lora = body.get("lora_config")
        if lora is not None:
            if not isinstance(lora, dict):
                raise UserError(f"lora_config: an object with a rank, got {lora!r}")
            options = {"rank": _int(lora, "rank", "lora_config.rank", minimum=1),
                       "seed": None if lora.get("seed") is None else _int(lora, "seed", "lora_config.seed"),
                       **{k: bool(lora.get(k, True)) for k in ("train_mlp", "train_attn", "train_unembed")}}
        model_id = _model_id(body)
        self._reserve_training_client(tenant)

        def job():
            try:
                if lora is None:
                    client = tenant.service.create_training_client(base_model)
                else:
                    client = tenant.service.create_lora_training_client(base_model, **options)
            finally:
                self._built(tenant)
            return _json({"model_id": self._register(tenant, client, model_id), "type": "create_model"})
        try:
            return self._submit(tenant, f"create_model {base_model}", job)
        except QueueFull:
            self._built(tenant)
            raise

    def _get_info(self, tenant: Tenant, body: dict) -> dict:
        model_id, client = self._model(tenant, body)
        lora = getattr(client.api.model, "peft_config", None)
        rank = None if lora is None else int(next(iter(lora.values())).r)
        # the SDK's get_tokenizer() loads model_data.tokenizer_id with AutoTokenizer: a folder, not a hub name
        tokenizer = str(self._tokenizer_folder(client))
        return {"type": "get_info", "model_id": model_id, "model_name": client.base_model, "is_lora": lora is not None,
                "lora_rank": rank, "model_data": {"model_name": client.base_model, "tokenizer_id": tokenizer,
                                                  "arch": type(client.api.model).__name__}}

    def _tokenizer_folder(self, client: facade.TrainingClient) -> Path:
        """`<root>/tokenizers/<model>-<hash>/`: the tokenizer of `client`'s model, saved once (atomically, by
        rename) so `AutoTokenizer.from_pretrained(folder)` loads it offline."""
        name = client.base_model
        slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(name).name)[:40]
        folder = self.root / "tokenizers" / f"{slug}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
        with self._lock:
            if not folder.is_dir():
                tmp = folder.parent / f".tmp-{folder.name}-{uuid.uuid4().hex[:8]}"
                client.api.tokenizer.save_pretrained(str(tmp))
                try:
                    tmp.rename(folder)
                except OSError:   # another server over the same --dir wrote it first
                    shutil.rmtree(tmp, ignore_errors=True)
        return folder.resolve()

    def forward_backward(self, raw: bytes, tenant: Tenant | None = None) -> dict:
        tenant = tenant or self.tenant(LOCAL_TENANT)
        try:
            request = decode_forward_backward_request(raw)
        except (WireError, ValueError) as err:
            raise UserError(f"forward_backward: {err}") from None
        model_id, client = self._model(tenant, request)
        vocab = _vocab_size(client.api.model)
        for i, d in enumerate(request["data"]):     # (targets never index the model: covrl scores the inputs)
            _check_tokens(d.tokens, vocab, f"data[{i}].model_input")
        data = [facade.Datum(model_input=facade.ModelInput.from_ints(d.tokens),
                             loss_fn_inputs={k: facade.TensorData.from_numpy(v) for k, v in d.loss_fn_inputs.items()})
                for d in request["data"]]
        loss_fn, config, forward_only = request["loss_fn"], request["loss_fn_config"], request["forward_only"]

        def job():
            if forward_only:
                out = client.forward(data, loss_fn, config).result()
            else:
                out = client.forward_backward(data, loss_fn, config).result()
            rows = [{k: v.to_numpy() for k, v in row.items()} for row in out.loss_fn_outputs]
            # the SDK folds the metrics of a call's requests by the reduction their names end in
            metrics = {k if ":" in k else f"{k}:mean": v for k, v in _finite(out.metrics).items()}
            return PROTO, encode_forward_backward_output(rows, metrics, out.loss_fn_output_type)
        what = "forward" if forward_only else f"forward_backward {loss_fn} ({len(data)} datums)"
        return self._submit(tenant, what, job, model_id)

    def _optim_step(self, tenant: Tenant, body: dict) -> dict:
        model_id, client = self._model(tenant, body)
        params = body.get("adam_params") or body.get("optim_params")
        if not isinstance(params, dict):
            raise UserError("optim_step: adam_params is required (Adam is the only optimizer served)")
        adam = facade.AdamParams(**{k: _number(params, k, f"adam_params.{k}")
                                    for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                              "grad_clip_norm") if params.get(k) is not None})

        def job():
            return _json({"metrics": _finite(client.optim_step(adam).result().metrics or {})})
        return self._submit(tenant, "optim_step", job, model_id)

    def _save_weights(self, tenant: Tenant, body: dict) -> dict:
        model_id, client = self._model(tenant, body)
        name = body.get("path") or f"state-{client.api.version:06d}"
        _check_name(name)
        overwrite = bool(body.get("overwrite"))

        def job():
            path = f"tinker://{client.api.state_dir.name}/weights/{name}"
            _refuse_taken(client.api.state_dir / "checkpoints" / name, path, overwrite)
            self._check_disk(tenant)
            client.save_state(name, overwrite=True).result()
            self._keep_last(tenant, client.api.state_dir / "checkpoints")
            return _json({"path": path, "type": "save_weights"})
        return self._submit(tenant, f"save_weights {name}", job, model_id)

    def _check_disk(self, tenant: Tenant) -> None:
        limit = self.limits.max_checkpoint_mb
        if limit is None:
            return
        used = _folder_bytes(tenant.root) / 2**20
        if used >= limit:
            raise QuotaExceeded(f"{self._tag(tenant)}{used:.1f} MB of checkpoints on disk, this server's limit per "
                                f"tenant (covrl serve --max-checkpoint-mb {limit:g}); delete some "
                                "(RestClient.delete_checkpoint_from_tinker_path) or save fewer")

    def _keep_last(self, tenant: Tenant, folder: Path) -> None:
        """Delete the oldest training states in `folder` beyond the last `keep_last` saved (COMPLETE first, so a
        half-deleted state is never read as one)."""
        keep = self.limits.keep_last
        if not keep:
            return
        states = sorted((d for d in folder.iterdir() if (d / "COMPLETE").is_file()),
                        key=lambda d: (d / "COMPLETE").stat().st_mtime_ns)
        for old in states[:-keep]:
            _remove_checkpoint(old)
            self.log(f"covrl serve: {self._tag(tenant)}deleted training state {old.name} (--keep-last {keep})")

    def _state_folder(self, tenant: Tenant, tinker_path: str) -> Path:
        model_id, kind, name = _parse_path(tinker_path)
        if kind != "weights":
            raise UserError(f"path {tinker_path!r}: a training state (tinker://<model>/weights/<name>) is needed")
        folder = tenant.root / model_id / "checkpoints" / name
        if not (folder / "COMPLETE").is_file():
            raise NotFound(f"path {tinker_path!r}: no complete checkpoint")
        return folder

    def _weights_info(self, tenant: Tenant, body: dict) -> dict:
        folder = self._state_folder(tenant, _field(body, "tinker_path", str))
        info = json.loads((folder.parent.parent / facade.CLIENT_FILE).read_text())
        lora = info.get("lora")
        targets = set((lora or {}).get("target_modules") or [])
        return {"base_model": info["base_model"], "is_lora": lora is not None,
                "lora_rank": None if lora is None else lora.get("rank"),
                "train_mlp": None if lora is None else "gate_proj" in targets,
                "train_attn": None if lora is None else "q_proj" in targets, "train_unembed": None}

    def _load_weights(self, tenant: Tenant, body: dict) -> dict:
        path = _field(body, "path", str)
        folder = self._state_folder(tenant, path)
        optimizer = bool(body.get("optimizer"))
        if body.get("model_id"):               # into an existing model
            model_id, client = self._model(tenant, body)

            def job():
                (client.load_state_with_optimizer if optimizer else client.load_state)(str(folder)).result()
                return _json({"path": path, "model_id": model_id, "type": "load_weights"})
            return self._submit(tenant, f"load_weights {path}", job, model_id)

        model_id = _model_id(body)
        self._reserve_training_client(tenant)

        def create():                          # a new model from the state (create-via-load)
            try:
                client = (tenant.service.create_training_client_from_state_with_optimizer if optimizer
                          else tenant.service.create_training_client_from_state)(str(folder))
            finally:
                self._built(tenant)
            return _json({"path": path, "model_id": self._register(tenant, client, model_id), "type": "load_weights"})
        try:
            return self._submit(tenant, f"load_weights {path} (new model)", create)
        except QueueFull:
            self._built(tenant)
            raise

    # ------------------------------------------------------------------------------------------ checkpoints

    def _list_checkpoints(self, tenant: Tenant, model_id: str | None) -> dict:
        """The tenant's checkpoints (of one training run: `model_id`, the folder a tinker:// path names)."""
        if model_id is not None and (not _safe_name(model_id)
                                     or not (tenant.root / model_id / facade.CLIENT_FILE).is_file()):
            raise NotFound(f"training run {model_id!r}: no such training run")
        runs = ([tenant.root / model_id] if model_id is not None
                else sorted(p.parent for p in tenant.root.glob(f"*/{facade.CLIENT_FILE}")))
        found = []
        for run in runs:
            for kind, sub, folder in (("training", "weights", run / "checkpoints"),
                                      ("sampler", "sampler_weights", run / SNAPSHOT_DIR / "checkpoints")):
                for state in sorted(folder.glob("*/COMPLETE")) if folder.is_dir() else []:
                    when = datetime.datetime.fromtimestamp(state.stat().st_mtime, datetime.timezone.utc)
                    name = state.parent.name
                    found.append({"checkpoint_id": f"{sub}/{name}", "checkpoint_type": kind, "time": when.isoformat(),
                                  "tinker_path": f"tinker://{run.name}/{sub}/{name}",
                                  "size_bytes": _folder_bytes(state.parent)})
        return {"checkpoints": found}

    def _delete_checkpoint(self, tenant: Tenant, route: str) -> None:
        parts = route.split("/")      # training_runs/<id>/checkpoints/<weights|sampler_weights>/<name>
        path = f"tinker://{parts[1]}/{parts[3]}/{parts[4]}"
        model_id, kind, name = _parse_path(path)
        folder = (tenant.root / model_id / ("checkpoints" if kind == "weights" else f"{SNAPSHOT_DIR}/checkpoints")
                  / name)
        if not (folder / "COMPLETE").is_file():
            raise NotFound(f"path {path!r}: no complete checkpoint")
        self._on_worker(tenant, f"delete {path}", lambda: _remove_checkpoint(folder))   # not during a save or load

    # ------------------------------------------------------------------------------------------ sampling

    def _save_for_sampler(self, tenant: Tenant, body: dict) -> dict:
        model_id, client = self._model(tenant, body)
        name = body.get("path")
        kind = body.get("kind") or "snapshot"
        if kind not in ("snapshot", "inflight"):
            raise UserError(f"kind: 'snapshot' or 'inflight', got {kind!r}")
        session_id = model_id.split(":train:")[0]

        def job():
            if name is None:      # save_weights_and_get_sampling_client: a client holding the current weights
                sampler_id = self._add_sampler(tenant, client.save_weights_and_get_sampling_client(kind=kind),
                                               client.base_model, None, session_id)
                return _json({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})
            _check_name(name)
            tinker_path = f"tinker://{client.api.state_dir.name}/sampler_weights/{name}"
            # SDK 0.38's save_weights_for_sampler has no overwrite option: a name is saved once
            _refuse_taken(client.api.state_dir / SNAPSHOT_DIR / "checkpoints" / name, tinker_path, False)
            self._check_disk(tenant)
            client.save_weights_for_sampler(name).result()
            return _json({"path": tinker_path, "type": "save_weights_for_sampler"})
        return self._submit(tenant, f"save_weights_for_sampler {name or '(current weights)'}", job, model_id)

    def _add_sampler(self, tenant: Tenant, client, base_model: str, model_path: str | None,
                     session_id: str | None) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.samplers[sampler_id] = _Sampler(client, base_model, model_path, tenant.name, session_id)
        return sampler_id

    def _sampling_client(self, tenant: Tenant, model_path: str | None, base_model: str | None) -> tuple[Any, str]:
        if model_path:
            model_id, kind, name = _parse_path(model_path)
            if kind == "sampler_weights":   # found on disk: also one that an earlier server saved
                folder = tenant.root / model_id / SNAPSHOT_DIR / "checkpoints" / name
                if not (folder / "COMPLETE").is_file():
                    raise NotFound(f"model_path {model_path!r}: no complete sampler weights")
                info = json.loads((tenant.root / model_id / facade.CLIENT_FILE).read_text())
                return tenant.service.create_sampling_client(model_path=str(folder)), info["base_model"]
            state = self._state_folder(tenant, model_path)      # a training state: a client of those weights
            owner = tenant.service.create_training_client_from_state(str(state))
            return owner.save_weights_and_get_sampling_client(), owner.base_model
        if not base_model:
            raise UserError("create_sampling_session: base_model or model_path is required")
        self._check_base_model(base_model)
        return tenant.service.create_sampling_client(base_model=base_model), base_model

    def _create_sampling_session(self, tenant: Tenant, body: dict) -> dict:
        client, base_model = self._on_worker(
            tenant, "create_sampling_session",
            lambda: self._sampling_client(tenant, body.get("model_path"), body.get("base_model")))
        session_id = body.get("session_id") if isinstance(body.get("session_id"), str) else None
        return {"sampling_session_id": self._add_sampler(tenant, client, base_model, body.get("model_path"),
                                                         session_id),
                "type": "create_sampling_session"}

    def _get_sampler(self, tenant: Tenant, sampler_id: str) -> dict:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.tenant != tenant.name:
            raise NotFound(f"sampler {sampler_id!r}: no such sampling session")
        return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    def _asample(self, tenant: Tenant, body: dict) -> dict:
        sampler_id = body.get("sampling_session_id")
        sampler = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if sampler_id is None:      # a one-off sample of a path or base model
            client, _ = self._on_worker(
                tenant, "sample setup",
                lambda: self._sampling_client(tenant, body.get("model_path"), body.get("base_model")))
        elif sampler is not None and sampler.tenant == tenant.name:
            client = sampler.client
        else:
            raise NotFound(f"sampling_session_id {sampler_id!r}: no such sampling session")
        unsupported = [k for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")
                       if body.get(k)] + [k for k in ("target_prompt_logprobs", "prompt_logprobs_last_n")
                                          if body.get(k) is not None]
        if unsupported:
            raise UserError(f"asample: {unsupported} not served by covrl")
        tokens = _prompt_tokens(body.get("prompt"))
        _check_tokens(tokens, _vocab_size(client.api.owner.model), "prompt")
        prompt = facade.ModelInput.from_ints(tokens)
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise UserError(f"sampling_params: an object, got {params!r}")
        sampling = facade.SamplingParams(**{k: params[k] for k in ("max_tokens", "seed", "stop", "temperature",
                                                                   "top_k", "top_p") if params.get(k) is not None})
        if "seed" not in params or params["seed"] is None:
            sampling = facade.SamplingParams(**{**sampling.__dict__, "seed": self._request_seed(client, body)})
        n = _int(body, "num_samples", "num_samples", minimum=1, default=1)
        want_prompt_logprobs = bool(body.get("prompt_logprobs"))

        def job():
            prompt_lp = client.compute_logprobs(prompt).result() if want_prompt_logprobs else None
            out = client.sample(prompt, n, sampling).result()
            return PROTO, encode_sample_response([(s.stop_reason, s.tokens, s.logprobs) for s in out.sequences],
                                                 prompt_lp)
        return self._submit(tenant, f"sample {n} x {len(tokens)} prompt tokens", job,
                            sample_sequence_ids=[uuid.uuid4().hex for _ in range(n)])

    def _openai(self, method: str, path: str, headers, raw: bytes) -> tuple[int, str, bytes]:
        """/openai/<sampling_session_id>/v1/...: the session's OpenAI-compatible routes (chat and text
        completions, models), answered by the session's endpoint (covrl.api.openai_sessions). The tenant's key
        comes as X-API-Key or as the OpenAI client's bearer key; an episode is named by the X-Covrl-Episode
        header."""
        given = headers.get(KEY_HEADER) or bearer_key(headers)
        tenant = self._authenticate({KEY_HEADER: given})
        session_id, route = openai_sessions.split_route(path)
        sampler = self.samplers.get(session_id)
        if sampler is None or sampler.tenant != tenant.name:
            raise NotFound(f"sampling session {session_id!r}: no such sampling session (create one with "
                           "create_sampling_session, or the SDK's create_sampling_client)")
        server = self._openai_sessions.server(
            session_id, sampler.client.api, lambda fn: self._on_worker(tenant, f"{route} on {session_id}", fn))
        return self._openai_sessions.forward(server, method, route, headers, raw)

    def _request_seed(self, client, body: dict) -> int:
        """The seed of a request that names none: a hash of the config's seed, the weights version and the
        request's sequence number in its sampling session, so a run's samples do not depend on the order in
        which its concurrent requests arrive, and a recipe resumed from a checkpoint draws what the
        uninterrupted run drew."""
        key = f"{self.service.config.run.seed}:{client.api.version}:{body.get('seq_id')}"
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1

    # ------------------------------------------------------------------------------------------ HTTP

    def _dispatch(self, method: str, path: str, headers, raw: bytes) -> tuple[int, str, bytes]:
        route = path.split("?", 1)[0].removeprefix("/api/v1/").strip("/")
        try:
            if method == "GET" and route == "healthz":     # unauthenticated: a proxy's health check
                return _answer({"status": "ok"})
            if path.startswith(openai_sessions.PREFIX):
                return self._openai(method, path, headers, raw)
            tenant = self._authenticate(headers)
            if method == "POST" and route == "forward_backward":
                if headers.get("Content-Encoding", "") == "zstd":
                    raise UserError("forward_backward: zstd bodies are not accepted (the server asks for none)")
                return _answer(self.forward_backward(raw, tenant))
            if method == "GET" and route.startswith("samplers/"):
                return _answer(self._get_sampler(tenant, route.split("/", 1)[1]))
            if method == "POST" and route.startswith("sessions/") and route.endswith("/finish"):
                self._release_session(tenant, route.split("/")[1])
                return _answer(None)
            parts = route.split("/")
            if method == "GET" and len(parts) == 3 and parts[0] == "training_runs" and parts[2] == "checkpoints":
                return _answer(self._list_checkpoints(tenant, parts[1]))
            if method == "DELETE" and len(parts) == 5 and parts[0] == "training_runs" and parts[2] == "checkpoints":
                return _answer(self._delete_checkpoint(tenant, route))
            handler = self._routes.get((method, route))
            if handler is None:
                return 404, "application/json", _dumps({"detail": f"{method} /api/v1/{route}: not served by covrl"})
            body = _json_body(raw) if method == "POST" else {}
            return _answer(handler(tenant, body))
        except UserError as err:
            self.log(f"covrl serve: {method} {route}: refused ({err.status}): {err}")
            return err.status, "application/json", _dumps({"detail": str(err)})
        except (TypeError, ValueError, KeyError) as err:   # a field of an unexpected shape
            self.log(f"covrl serve: {method} {route}: refused (400): {type(err).__name__}: {err}")
            return 400, "application/json", _dumps({"detail": f"{route}: {type(err).__name__}: {err}"})
        except Exception as err:
            traceback.print_exc()
            return 500, "application/json", _dumps({"detail": f"{type(err).__name__}: {err}"})

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"    # keep-alive, as the SDK's connection pools expect
            timeout = READ_TIMEOUT_S         # a client that stops sending frees its thread

            def log_message(self, *args):    # one line per job instead (the SDK polls a lot)
                pass

            def _reply(self, status: int, content_type: str, body: bytes, close: bool = False) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                if close:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(body)

            def _refuse(self, status: int, detail: str) -> None:
                """Answer without reading the body: the connection is closed after it."""
                server.log(f"covrl serve: {self.command} {self.path.split('?')[0]}: refused ({status}): {detail}")
                self._reply(status, "application/json", _dumps({"detail": detail}), close=True)

            def _serve(self, method: str) -> None:
                limit = int(server.limits.max_body_mb * 2**20)
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    return self._refuse(411, "request body: send a Content-Length (chunked bodies are not read)")
                try:
                    size = int(self.headers.get("Content-Length") or 0)
                    if size < 0:
                        raise ValueError
                except ValueError:
                    return self._refuse(400, "Content-Length: not a byte count")
                if size > limit:
                    return self._refuse(413, f"request body: {size} bytes, over this server's limit of "
                                             f"{server.limits.max_body_mb:g} MB (covrl serve --max-body-mb)")
                raw = self.rfile.read(size) if size else b""
                if len(raw) < size:          # the client went away mid-body: nothing to answer, nothing run
                    self.close_connection = True
                    return None
                self._reply(*server._dispatch(method, self.path, self.headers, raw))
                return None

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

            def do_DELETE(self):
                self._serve("DELETE")

        return Handler


# ---------------------------------------------------------------------------------------------- helpers

class _HTTPServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError, TimeoutError)):
            super().handle_error(request, client_address)    # not a client that went away or went quiet


@dataclass
class _Raw:
    content_type: str
    body: bytes
    status: int = 200


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def _json(value: Any) -> tuple[str, bytes]:
    return "application/json", _dumps(value)


def _json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"request body: not JSON ({err})") from None
    if not isinstance(body, dict):
        raise UserError(f"request body: a JSON object is needed, got {type(body).__name__}")
    return body


def _answer(value: Any) -> tuple[int, str, bytes]:
    if isinstance(value, _Raw):
        return value.status, value.content_type, value.body
    return 200, "application/json", _dumps(value)


def _finite(metrics: dict) -> dict[str, float]:
    """Metrics as JSON / protobuf doubles: numbers only (NaN and inf kept out, they are not JSON)."""
    out = {}
    for k, v in metrics.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if np.isfinite(f):
            out[str(k)] = f
    return out


def _model_id(body: dict) -> str:
    """The id the SDK derives for a model it creates (`<session id>:train:<model seq id>`)."""
    session_id = _field(body, "session_id", str)
    if ":" in session_id or "/" in session_id:
        raise UserError(f"session_id {session_id!r}: not a session id this server gave")
    return f"{session_id}:train:{_int(body, 'model_seq_id', 'model_seq_id', minimum=0, default=0)}"


def _field(body: dict, name: str, kind: type):
    value = body.get(name)
    if not isinstance(value, kind) or value == "":
        raise UserError(f"{name}: required ({kind.__name__}), got {value!r}")
    return value


def _int(body: dict, key: str, name: str, *, minimum: int | None = None, default: int | None = None) -> int:
    value = body.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise UserError(f"{name}: an integer{'' if minimum is None else f' >= {minimum}'} is needed, got {value!r}")
    return value


def _number(body: dict, key: str, name: str) -> float:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{name}: a number is needed, got {value!r}")
    return float(value)


def _vocab_size(model) -> int | None:
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError):
        return None


def _check_tokens(tokens: list[int], vocab: int | None, where: str) -> None:
    """Token ids outside the model's vocabulary are refused here: on a GPU an out-of-range embedding index stops
    the device for every tenant, not just the one request."""
    if vocab is None or not tokens:
        return
    low, high = min(tokens), max(tokens)
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise UserError(f"{where}: token id {bad} is outside the model's vocabulary (0 to {vocab - 1})")


def _folder_bytes(folder: Path) -> int:    # as covrl.train.run.checkpoint's, which covrl.train does not export
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:    # deleted meanwhile
                continue
    return total


def _remove_checkpoint(folder: Path) -> None:
    (folder / "COMPLETE").unlink(missing_ok=True)     # first: a half-deleted folder is not a checkpoint
    shutil.rmtree(folder, ignore_errors=True)


def _refuse_taken(folder: Path, tinker_path: str, overwrite: bool) -> None:
    """A save under a name that holds a checkpoint: the SDK's 409 Conflict, as a failed future (a 409 answer
    to the request itself would make the SDK retry it for five minutes)."""
    if not overwrite and (folder / "COMPLETE").is_file():
        raise facade.CheckpointExistsError(
            f"409 Conflict: {tinker_path} already exists; save under a new name"
            + (", or pass overwrite=True to replace it" if "/weights/" in tinker_path else
               " (save_weights_for_sampler never replaces sampler weights)"))


def _safe_name(name: str) -> bool:
    """A single folder name: not empty, no separator, not hidden (so not `.` or `..`)."""
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _safe_name(name):
        raise UserError(f"path {name!r}: a checkpoint name without '/' is needed")


def _parse_path(path: str) -> tuple[str, str, str]:
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if (len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not _safe_name(parts[0])
            or not _safe_name(parts[2])):
        raise UserError(f"path {path!r}: expected tinker://<model id>/weights/<name> or .../sampler_weights/<name>")
    return parts[0], parts[1], parts[2]


def _prompt_tokens(prompt: Any) -> list[int]:
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise UserError("prompt: a ModelInput ({'chunks': [...]}) is required")
    tokens: list[int] = []
    for i, chunk in enumerate(prompt["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise UserError(f"prompt.chunks[{i}]: {kind!r}; covrl's models take text (token) chunks only")
        ids = chunk.get("tokens", [])
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise UserError(f"prompt.chunks[{i}].tokens: a list of token ids is needed")
        tokens.extend(ids)
    return tokens


def serve(*, config: str | None, overrides: list[str] | None, port: int, root: str, warmup: bool,
          host: str = "127.0.0.1", keys: Mapping[str, str] | None = None, limits: Limits | None = None,
          model_dirs: Sequence[str] = ()) -> int:
    """Build the ServiceClient and serve until Ctrl-C / SIGTERM (`covrl serve`)."""
    service = facade.ServiceClient(config=config, overrides=overrides or None, warmup=warmup, state_dir=root)
    server = TinkerServer(service, root=root, host=host, port=port, keys=keys, limits=limits, model_dirs=model_dirs)
    if server.keyed:
        tenants = sorted(set(keys.values()))
        print(f"covrl serve: Tinker API at {server.base_url} for {len(tenants)} tenant(s) ({', '.join(tenants)}; "
              f"folders under {Path(root).resolve() / 'tenants'}); ServiceClient(base_url=<this server's URL>) with "
              "TINKER_API_KEY set to the tenant's key", flush=True)
    else:
        print(f"covrl serve: Tinker API at {server.base_url} (models under {Path(root).resolve()}); "
              f"ServiceClient(base_url={server.base_url!r}) with TINKER_API_KEY=tml-<anything>", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0
