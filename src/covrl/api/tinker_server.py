"""`covrl serve`: Tinker's REST API on the loopback address, backed by covrl (`covrl.api.tinker`).

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
- futures: every training or sampling call returns a future at once and runs on one worker thread in arrival
  order (the SDK sends one training client's requests in order); `retrieve_future` answers when the result is
  there, else `try_again` after a long poll.

Checkpoints are `tinker://<model id>/weights/<name>` (a covrl atomic checkpoint at
`<root>/<model id>/checkpoints/<name>/`) and `tinker://<model id>/sampler_weights/<name>` (at
`<root>/<model id>/sampler/checkpoints/<name>/`); a model id is the name of the training client's folder under
`--dir`, so a server started again over the same folder serves every path an earlier one returned. A name that
holds a checkpoint already is refused (the SDK's `save_state(..., overwrite=True)` replaces one). Sampling
clients keep the weights they were made with (`covrl.api.tinker.TrainingClient`); `get_info` names a tokenizer
folder under `<root>/tokenizers/`, so the SDK's `get_tokenizer()` loads it without the model hub. Not served: custom losses on the server (the SDK runs
`forward_backward_custom` on the client), image/audio chunks, top-k log-probs, `stable_reinforce`, the
console/billing/admin endpoints. There is no authentication: the SDK needs `TINKER_API_KEY` set to any value that starts with `tml-`,
and the server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import json
import queue
import shutil
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from covrl.api import tinker as facade
from covrl.api.client import SNAPSHOT_DIR
from covrl.api.tinker_wire import (
    WireError,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)

__all__ = ["TinkerServer", "serve"]

PROTO = "application/x-protobuf"
# What the SDK is told about this server: API keys (any value), plain httpx, one forward_backward request per
# call (its chunks would arrive as separate requests; Tinker's losses are sums, so they would add up the same).
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                 "fwdbwd_max_chunk_len": 1 << 20, "fwdbwd_max_chunk_bytes_count": 1 << 40,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}
LONG_POLL_S = 30.0     # under the SDK's 45 s timeout for retrieve_future


class UserError(ValueError):
    """A request the server refuses (bad field, unknown id): answered with status 400 or a failed future."""


@dataclass
class _Future:
    done: threading.Event = field(default_factory=threading.Event)
    content_type: str = "application/json"
    body: bytes = b""


@dataclass
class _Sampler:
    client: Any            # a covrl.api.tinker.SamplingClient
    base_model: str
    model_path: str | None


class TinkerServer:
    """The REST server around a `covrl.api.tinker.ServiceClient` (`service`): `start()` serves on a thread,
    `serve_forever()` in this one; `base_url` once bound. `log`: one line per request and per finished job
    (stderr by default)."""

    def __init__(self, service: facade.ServiceClient, *, root: str | Path, host: str = "127.0.0.1",
                 port: int = 0, log: Callable[[str], None] | None = None):
        self.service, self.root = service, Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        service.state_dir = str(self.root)
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.models: dict[str, facade.TrainingClient] = {}
        self.samplers: dict[str, _Sampler] = {}
        self.sessions: dict[str, float] = {}            # session id -> last heartbeat (monotonic)
        self._futures: dict[str, _Future] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._httpd = _HTTPServer((host, port), self._handler())
        self._httpd.daemon_threads = True
        self._worker = threading.Thread(target=self._work, name="covrl-serve-worker", daemon=True)
        self._worker.start()
        self._routes: dict[tuple[str, str], Callable[[dict], Any]] = {
            ("GET", "healthz"): lambda _: {"status": "ok"},
            ("GET", "get_server_capabilities"): self._capabilities,
            ("POST", "client/config"): lambda _: CLIENT_CONFIG,
            ("POST", "client/dynamic_config"): lambda _: {"refresh_interval_sec": 300},
            ("POST", "create_session"): self._create_session,
            ("POST", "session_heartbeat"): self._heartbeat,
            ("POST", "telemetry"): lambda _: {"status": "accepted"},
            ("POST", "cancel_future"): lambda _: None,
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

    def start(self) -> TinkerServer:
        threading.Thread(target=self._httpd.serve_forever, name="covrl-serve-http", daemon=True).start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._jobs.put(None)

    # ------------------------------------------------------------------------------------------ futures

    def _submit(self, what: str, job: Callable[[], tuple[str, bytes]], model_id: str | None = None,
                **extra: Any) -> dict:
        """Queue `job` (returning content type and body) and answer with its future."""
        request_id = uuid.uuid4().hex
        with self._lock:
            self._futures[request_id] = _Future()
        self._jobs.put((request_id, what, job))
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {}), **extra}

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            request_id, what, job = item
            start = time.perf_counter()
            future = self._futures[request_id]
            try:
                future.content_type, future.body = job()
                self.log(f"covrl serve: {what} done in {time.perf_counter() - start:.2f}s")
            except Exception as err:   # the caller's future fails with the reason; the server goes on
                category = "user" if isinstance(err, (UserError, ValueError, TypeError, KeyError)) else "server"
                if category == "server":
                    traceback.print_exc()
                self.log(f"covrl serve: {what} failed: {type(err).__name__}: {err}")
                future.content_type = "application/json"
                future.body = json.dumps({"error": f"{type(err).__name__}: {err}", "category": category}).encode()
            future.done.set()

    def _on_worker(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the worker thread (in order with the queued jobs: one model computation at a time) and
        return its result here, for the calls the SDK expects an answer to, not a future."""
        result: list = []

        def job():
            result.append(fn())
            return "application/json", b"null"
        request_id = self._submit(what, job)["request_id"]
        future = self._futures[request_id]
        future.done.wait()
        self._futures.pop(request_id, None)
        if not result:
            raise UserError(json.loads(future.body).get("error", f"{what} failed"))
        return result[0]

    def _retrieve(self, body: dict) -> Any:
        request_id = body.get("request_id")
        future = self._futures.get(request_id)
        if future is None:
            raise UserError(f"request_id {request_id!r}: no such future")
        if not future.done.wait(LONG_POLL_S):
            # 408: the SDK polls again at once, quietly (a 200 "try_again" logs a warning every time)
            return _Raw("application/json", _dumps({"type": "try_again", "queue_state": "active"}), status=408)
        self._futures.pop(request_id, None)
        return _Raw(future.content_type, future.body)

    # ------------------------------------------------------------------------------------------ sessions

    def _capabilities(self, _: dict) -> dict:
        names = ["tiny", "HuggingFaceTB/SmolLM2-135M-Instruct"]
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True} for n in names]}

    def _create_session(self, body: dict) -> dict:
        session_id = f"covrl-{uuid.uuid4().hex[:12]}"
        self.sessions[session_id] = time.monotonic()
        return {"session_id": session_id}

    def _heartbeat(self, body: dict) -> dict:
        self.sessions[str(body.get("session_id"))] = time.monotonic()
        return {"type": "session_heartbeat"}

    # ------------------------------------------------------------------------------------------ training

    def _model(self, body: dict) -> tuple[str, facade.TrainingClient]:
        model_id = body.get("model_id")
        if model_id not in self.models:
            raise UserError(f"model_id {model_id!r}: no such training model on this server")
        return model_id, self.models[model_id]

    def _register(self, client: facade.TrainingClient, model_id: str) -> str:
        self.models[model_id] = client
        return model_id

    def _create_model(self, body: dict) -> dict:
        base_model = _field(body, "base_model", str)
        lora = body.get("lora_config")
        model_id = _model_id(body)

        def job():
            if lora is None:
                client = self.service.create_training_client(base_model)
            else:
                client = self.service.create_lora_training_client(
                    base_model, rank=int(lora["rank"]), seed=lora.get("seed"),
                    train_mlp=bool(lora.get("train_mlp", True)), train_attn=bool(lora.get("train_attn", True)),
                    train_unembed=bool(lora.get("train_unembed", True)))
            return _json({"model_id": self._register(client, model_id), "type": "create_model"})
        return self._submit(f"create_model {base_model}", job)

    def _get_info(self, body: dict) -> dict:
        model_id, client = self._model(body)
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

    def forward_backward(self, raw: bytes) -> dict:
        try:
            request = decode_forward_backward_request(raw)
        except (WireError, ValueError) as err:
            raise UserError(f"forward_backward: {err}") from None
        model_id, client = self._model(request)
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
        return self._submit(what, job, model_id)

    def _optim_step(self, body: dict) -> dict:
        model_id, client = self._model(body)
        params = body.get("adam_params") or body.get("optim_params")
        if not isinstance(params, dict):
            raise UserError("optim_step: adam_params is required (Adam is the only optimizer served)")
        adam = facade.AdamParams(**{k: params[k] for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                                           "grad_clip_norm") if params.get(k) is not None})

        def job():
            return _json({"metrics": _finite(client.optim_step(adam).result().metrics or {})})
        return self._submit("optim_step", job, model_id)

    def _save_weights(self, body: dict) -> dict:
        model_id, client = self._model(body)
        name = body.get("path") or f"state-{client.api.version:06d}"
        _check_name(name)
        overwrite = bool(body.get("overwrite"))

        def job():
            path = f"tinker://{client.api.state_dir.name}/weights/{name}"
            _refuse_taken(client.api.state_dir / "checkpoints" / name, path, overwrite)
            client.save_state(name, overwrite=True).result()
            return _json({"path": path, "type": "save_weights"})
        return self._submit(f"save_weights {name}", job, model_id)

    def _state_folder(self, tinker_path: str) -> Path:
        model_id, kind, name = _parse_path(tinker_path)
        if kind != "weights":
            raise UserError(f"path {tinker_path!r}: a training state (tinker://<model>/weights/<name>) is needed")
        folder = self.root / model_id / "checkpoints" / name
        if not (folder / "COMPLETE").is_file():
            raise UserError(f"path {tinker_path!r}: no complete checkpoint at {folder}")
        return folder

    def _weights_info(self, body: dict) -> dict:
        folder = self._state_folder(_field(body, "tinker_path", str))
        info = json.loads((folder.parent.parent / facade.CLIENT_FILE).read_text())
        lora = info.get("lora")
        targets = set((lora or {}).get("target_modules") or [])
        return {"base_model": info["base_model"], "is_lora": lora is not None,
                "lora_rank": None if lora is None else lora.get("rank"),
                "train_mlp": None if lora is None else "gate_proj" in targets,
                "train_attn": None if lora is None else "q_proj" in targets, "train_unembed": None}

    def _load_weights(self, body: dict) -> dict:
        path = _field(body, "path", str)
        folder = self._state_folder(path)
        optimizer = bool(body.get("optimizer"))
        if body.get("model_id"):               # into an existing model
            model_id, client = self._model(body)

            def job():
                (client.load_state_with_optimizer if optimizer else client.load_state)(str(folder)).result()
                return _json({"path": path, "model_id": model_id, "type": "load_weights"})
            return self._submit(f"load_weights {path}", job, model_id)

        model_id = _model_id(body)

        def create():                          # a new model from the state (create-via-load)
            client = (self.service.create_training_client_from_state_with_optimizer if optimizer
                      else self.service.create_training_client_from_state)(str(folder))
            return _json({"path": path, "model_id": self._register(client, model_id), "type": "load_weights"})
        return self._submit(f"load_weights {path} (new model)", create)

    # ------------------------------------------------------------------------------------------ sampling

    def _save_for_sampler(self, body: dict) -> dict:
        model_id, client = self._model(body)
        name = body.get("path")
        kind = body.get("kind") or "snapshot"
        if kind not in ("snapshot", "inflight"):
            raise UserError(f"kind: 'snapshot' or 'inflight', got {kind!r}")

        def job():
            if name is None:      # save_weights_and_get_sampling_client: a client holding the current weights
                sampler_id = self._add_sampler(client.save_weights_and_get_sampling_client(kind=kind),
                                               client.base_model, None)
                return _json({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})
            _check_name(name)
            tinker_path = f"tinker://{client.api.state_dir.name}/sampler_weights/{name}"
            # SDK 0.38's save_weights_for_sampler has no overwrite option: a name is saved once
            _refuse_taken(client.api.state_dir / SNAPSHOT_DIR / "checkpoints" / name, tinker_path, False)
            client.save_weights_for_sampler(name).result()
            return _json({"path": tinker_path, "type": "save_weights_for_sampler"})
        return self._submit(f"save_weights_for_sampler {name or '(current weights)'}", job, model_id)

    def _add_sampler(self, client, base_model: str, model_path: str | None) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        self.samplers[sampler_id] = _Sampler(client, base_model, model_path)
        return sampler_id

    def _sampling_client(self, model_path: str | None, base_model: str | None) -> tuple[Any, str]:
        if model_path:
            model_id, kind, name = _parse_path(model_path)
            if kind == "sampler_weights":   # found on disk: also one that an earlier server saved
                folder = self.root / model_id / SNAPSHOT_DIR / "checkpoints" / name
                if not (folder / "COMPLETE").is_file():
                    raise UserError(f"model_path {model_path!r}: no complete sampler weights at {folder}")
                info = json.loads((self.root / model_id / facade.CLIENT_FILE).read_text())
                return self.service.create_sampling_client(model_path=str(folder)), info["base_model"]
            state = self._state_folder(model_path)      # a training state: a client of those weights
            owner = self.service.create_training_client_from_state(str(state))
            return owner.save_weights_and_get_sampling_client(), owner.base_model
        if not base_model:
            raise UserError("create_sampling_session: base_model or model_path is required")
        return self.service.create_sampling_client(base_model=base_model), base_model

    def _create_sampling_session(self, body: dict) -> dict:
        client, base_model = self._on_worker(
            "create_sampling_session", lambda: self._sampling_client(body.get("model_path"), body.get("base_model")))
        return {"sampling_session_id": self._add_sampler(client, base_model, body.get("model_path")),
                "type": "create_sampling_session"}

    def _get_sampler(self, sampler_id: str) -> dict:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise UserError(f"sampler {sampler_id!r}: no such sampling session")
        return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    def _asample(self, body: dict) -> dict:
        sampler_id = body.get("sampling_session_id")
        if sampler_id is None:      # a one-off sample of a path or base model
            client, _ = self._on_worker(
                "sample setup", lambda: self._sampling_client(body.get("model_path"), body.get("base_model")))
        elif sampler_id in self.samplers:
            client = self.samplers[sampler_id].client
        else:
            raise UserError(f"sampling_session_id {sampler_id!r}: no such sampling session")
        unsupported = [k for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")
                       if body.get(k)] + [k for k in ("target_prompt_logprobs", "prompt_logprobs_last_n")
                                          if body.get(k) is not None]
        if unsupported:
            raise UserError(f"asample: {unsupported} not served by covrl")
        prompt = facade.ModelInput.from_ints(_prompt_tokens(body.get("prompt")))
        params = body.get("sampling_params") or {}
        sampling = facade.SamplingParams(**{k: params[k] for k in ("max_tokens", "seed", "stop", "temperature",
                                                                   "top_k", "top_p") if params.get(k) is not None})
        if "seed" not in params or params["seed"] is None:
            sampling = facade.SamplingParams(**{**sampling.__dict__, "seed": self._request_seed(client, body)})
        n = int(body.get("num_samples", 1))
        want_prompt_logprobs = bool(body.get("prompt_logprobs"))

        def job():
            prompt_lp = client.compute_logprobs(prompt).result() if want_prompt_logprobs else None
            out = client.sample(prompt, n, sampling).result()
            return PROTO, encode_sample_response([(s.stop_reason, s.tokens, s.logprobs) for s in out.sequences],
                                                 prompt_lp)
        return self._submit(f"sample {n} x {len(prompt.to_ints())} prompt tokens", job,
                            sample_sequence_ids=[uuid.uuid4().hex for _ in range(n)])

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
            if method == "POST" and route == "forward_backward":
                if headers.get("Content-Encoding", "") == "zstd":
                    raise UserError("forward_backward: zstd bodies are not accepted (the server asks for none)")
                return _answer(self.forward_backward(raw))
            if method == "GET" and route.startswith("samplers/"):
                return _answer(self._get_sampler(route.split("/", 1)[1]))
            if method == "POST" and route.startswith("sessions/") and route.endswith("/finish"):
                self.sessions.pop(route.split("/")[1], None)
                return _answer(None)
            handler = self._routes.get((method, route))
            if handler is None:
                return 404, "application/json", _dumps({"detail": f"{method} /api/v1/{route}: not served by covrl"})
            body = json.loads(raw or b"{}") if method == "POST" else {}
            if not isinstance(body, dict):
                raise UserError("the request body must be a JSON object")
            return _answer(handler(body))
        except (UserError, json.JSONDecodeError) as err:
            self.log(f"covrl serve: {method} {route}: refused: {err}")
            return 400, "application/json", _dumps({"detail": str(err)})
        except Exception as err:
            traceback.print_exc()
            return 500, "application/json", _dumps({"detail": f"{type(err).__name__}: {err}"})

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"    # keep-alive, as the SDK's connection pools expect

            def log_message(self, *args):    # one line per job instead (the SDK polls a lot)
                pass

            def _serve(self, method: str) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(size) if size else b""
                status, content_type, body = server._dispatch(method, self.path, self.headers, raw)
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        return Handler


# ---------------------------------------------------------------------------------------------- helpers

class _HTTPServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):   # a client that went away
            super().handle_error(request, client_address)


@dataclass
class _Raw:
    content_type: str
    body: bytes
    status: int = 200


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def _json(value: Any) -> tuple[str, bytes]:
    return "application/json", _dumps(value)


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
    return f"{_field(body, 'session_id', str)}:train:{int(body.get('model_seq_id') or 0)}"


def _field(body: dict, name: str, kind: type):
    value = body.get(name)
    if not isinstance(value, kind) or value == "":
        raise UserError(f"{name}: required ({kind.__name__}), got {value!r}")
    return value


def _refuse_taken(folder: Path, tinker_path: str, overwrite: bool) -> None:
    """A save under a name that holds a checkpoint: the SDK's 409 Conflict, as a failed future (a 409 answer
    to the request itself would make the SDK retry it for five minutes)."""
    if not overwrite and (folder / "COMPLETE").is_file():
        raise facade.CheckpointExistsError(
            f"409 Conflict: {tinker_path} already exists; save under a new name"
            + (", or pass overwrite=True to replace it" if "/weights/" in tinker_path else
               " (save_weights_for_sampler never replaces sampler weights)"))


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith("."):
        raise UserError(f"path {name!r}: a checkpoint name without '/' is needed")


def _parse_path(path: str) -> tuple[str, str, str]:
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not parts[0] or not parts[2]:
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
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    return tokens


def serve(*, config: str | None, overrides: list[str] | None, port: int, root: str, warmup: bool,
          host: str = "127.0.0.1") -> int:
    """Build the ServiceClient and serve until Ctrl-C / SIGTERM (`covrl serve`)."""
    service = facade.ServiceClient(config=config, overrides=overrides or None, warmup=warmup, state_dir=root)
    server = TinkerServer(service, root=root, host=host, port=port)
    print(f"covrl serve: Tinker API at {server.base_url} (models under {Path(root).resolve()}); "
          f"ServiceClient(base_url={server.base_url!r}) with TINKER_API_KEY=tml-<anything>", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0
