"""`covrl serve` shared by a team, through Tinker's own SDK (0.38): API keys are tenants, and a tenant cannot
sample, load, list, delete or retrieve another's checkpoints, samplers, models or futures (answered exactly as a
missing one); a bad key gets 401 and keys never reach the log; a non-loopback address needs keys; request bodies
are bounded (413) and malformed ones get a 400 naming the field; quotas answer with a message the SDK shows;
tenants take turns on the one worker; and one tenant's garbage or dropped connections leave another's results
bit for bit what they are alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from api_helpers import SMALL
from test_tinker_semantics import PROMPT, one_step
from test_tinker_server import _api_key  # noqa: F401 - the autouse fixture (a key for the SDK's own checks)

import covrl.api.tinker as facade
from covrl.api.cli_serve import parse_keys, read_keys
from covrl.api.tinker_server import Limits, TinkerServer

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed (make setup installs it)")
from tinker import types  # noqa: E402

ALICE, BOB = "tml-alice-7f3a9c1e5b", "tml-bob-2d8e4f6a0c"
KEYS = {ALICE: "alice", BOB: "bob"}


class Log(list):
    """The server's log lines, kept."""

    def __call__(self, line: str) -> None:
        self.append(line)


def team_server(tmp_path, log=None, **limits) -> TinkerServer:
    service = facade.ServiceClient(config="tiny", overrides=SMALL, warmup=False, state_dir=str(tmp_path / "serve"))
    return TinkerServer(service, root=tmp_path / "serve", keys=KEYS, limits=Limits(**limits),
                        log=log if log is not None else (lambda _: None)).start()


def sdk(server, key):
    return tinker.ServiceClient(base_url=server.base_url, api_key=key)


def lora(server, key, seed=3):
    return sdk(server, key).create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()


def post(server, key, route, body=None, raw=None, content_type="application/json"):
    headers = {"X-API-Key": key} if key else {}
    if raw is not None:
        return httpx.post(f"{server.base_url}/api/v1/{route}", content=raw,
                          headers={**headers, "Content-Type": content_type}, timeout=30)
    return httpx.post(f"{server.base_url}/api/v1/{route}", json=body or {}, headers=headers, timeout=30)


def sft_datum(tokens):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:])),
        "weights": types.TensorData.from_torch(torch.ones(len(tokens) - 1))})


def hold_worker(server, tenant="alice"):
    """Occupy the one worker until the returned event is set (so calls queue up behind it)."""
    release, running = threading.Event(), threading.Event()

    def job():
        running.set()
        release.wait(60)
        return "application/json", b"null"
    server._submit(server.tenant(tenant), "hold", job)
    assert running.wait(30)
    return release


def wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------- isolation

def test_a_tenant_cannot_reach_another_tenants_checkpoints_samplers_models_or_futures(tmp_path, capfd):
    log = Log()
    server = team_server(tmp_path, log)
    try:
        bob = lora(server, BOB)
        one_step(bob)
        state = bob.save_state("s").result().path
        snap = bob.save_weights_for_sampler("w").result().path
        bob.save_weights_and_get_sampling_client().result()
        (bob_model,) = [model for tenant, model in server.models if tenant == "bob"]
        (bob_sampler,) = [s for s, v in server.samplers.items() if v.tenant == "bob"]
        pending = post(server, BOB, "optim_step", {"model_id": bob_model, "adam_params": {"learning_rate": 0.0}})
        bob_future = pending.json()["request_id"]
        assert (tmp_path / "serve" / "tenants" / "bob" / state.split("/")[2] / "checkpoints" / "s").is_dir()

        alice_sdk = sdk(server, ALICE)
        alice = lora(server, ALICE)

        def refused_as_missing(route, body, key, real, missing):
            """Alice's answer for Bob's id or path is the answer for one that does not exist, word for word."""
            got = post(server, ALICE, route, {**body, key: real})
            ref = post(server, ALICE, route, {**body, key: missing})
            assert got.status_code == ref.status_code == 404, (route, got.text)
            assert got.json()["detail"] == ref.json()["detail"].replace(missing, real), (route, got.text)

        missing_state = state.replace(state.split("/")[2], "tiny-nosuchrun")
        missing_snap = snap.replace(snap.split("/")[2], "tiny-nosuchrun")
        # load: Bob's state into a new model or into Alice's; weights_info
        refused_as_missing("load_weights", {"session_id": "covrl-x", "model_seq_id": 0}, "path", state, missing_state)
        refused_as_missing("weights_info", {}, "tinker_path", state, missing_state)
        with pytest.raises(tinker.NotFoundError, match="no complete checkpoint"):
            alice_sdk.create_training_client_from_state(state).result()
        with pytest.raises(tinker.NotFoundError, match="no complete checkpoint"), pytest.warns(FutureWarning):
            alice.load_state(state).result()      # (deprecated in the SDK, still sent)
        # sample: Bob's sampler weights, Bob's sampling session
        refused_as_missing("create_sampling_session", {"session_id": "covrl-x"}, "model_path", snap, missing_snap)
        with pytest.raises(tinker.NotFoundError, match="no complete sampler weights"):
            alice_sdk.create_sampling_client(model_path=snap).result()
        prompt = {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}
        refused_as_missing("asample", {"prompt": prompt, "num_samples": 1, "sampling_params": {"max_tokens": 2}},
                           "sampling_session_id", bob_sampler, "sampler-000000000000")
        got = httpx.get(f"{server.base_url}/api/v1/samplers/{bob_sampler}", headers={"X-API-Key": ALICE})
        ref = httpx.get(f"{server.base_url}/api/v1/samplers/sampler-0", headers={"X-API-Key": ALICE})
        assert got.status_code == ref.status_code == 404
        assert got.json()["detail"] == ref.json()["detail"].replace("sampler-0", bob_sampler)
        # train: Bob's model; retrieve: Bob's future
        for route in ("optim_step", "get_info", "save_weights", "save_weights_for_sampler"):
            refused_as_missing(route, {"adam_params": {"learning_rate": 1.0}}, "model_id", bob_model, "covrl-x:train:0")
        refused_as_missing("retrieve_future", {}, "request_id", bob_future, "0" * 32)
        # list and delete
        rest = tinker.RestClient(base_url=server.base_url, api_key=ALICE)
        assert rest.list_user_checkpoints().result().checkpoints == []
        with pytest.raises(tinker.NotFoundError, match="no such training run"):
            rest.list_checkpoints(state.split("/")[2]).result()
        with pytest.raises(tinker.NotFoundError, match="no complete checkpoint"):
            rest.delete_checkpoint_from_tinker_path(state).result()
        bob_rest = tinker.RestClient(base_url=server.base_url, api_key=BOB)
        assert sorted(c.tinker_path for c in bob_rest.list_user_checkpoints().result().checkpoints) == sorted(
            [state, snap])
        # Bob's future is still his, and his paths still load for him
        assert post(server, BOB, "retrieve_future", {"request_id": bob_future}).status_code == 200
        assert sdk(server, BOB).create_training_client_from_state(state).result().get_info().lora_rank == 4
        bob_rest.delete_checkpoint_from_tinker_path(state).result()
        assert [c.tinker_path for c in bob_rest.list_user_checkpoints().result().checkpoints] == [snap]
    finally:
        server.close()
    out, err = capfd.readouterr()
    for text in (out, err, "\n".join(log)):
        assert ALICE not in text and BOB not in text     # keys never reach the log
    assert any(line.startswith("covrl serve: bob: ") for line in log)


def test_a_bad_or_missing_key_gets_401_and_is_not_logged(tmp_path, capfd):
    log = Log()
    server = team_server(tmp_path, log)
    wrong = "tml-mallory-guessed-1"
    try:
        assert httpx.get(f"{server.base_url}/api/v1/healthz").status_code == 200    # a proxy's health check
        for key in (None, wrong, ALICE + "x"):
            r = post(server, key, "create_session", {})
            assert r.status_code == 401 and "X-API-Key" in r.json()["detail"], r.text
            assert wrong not in r.text
        with pytest.raises(tinker.AuthenticationError):
            sdk(server, wrong).create_lora_training_client(base_model="tiny", rank=2).result()
        assert server.models == {}
    finally:
        server.close()
    out, err = capfd.readouterr()
    for text in (out, err, "\n".join(log)):
        assert wrong not in text and ALICE not in text


def test_keys_from_a_file_and_the_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# the team\nalice: tml-alice-7f3a9c1e5b\n\n  bob:tml-bob-2d8e4f6a0c  \ntml-solo-0123456789\n")
    got = read_keys(str(keys), "carol: tml-carol-55aa77bb, bob: tml-bob-2d8e4f6a0c")
    with pytest.raises(ValueError, match="another tenant") as err:
        read_keys(str(keys), f"mallory: {BOB}")
    assert BOB not in str(err.value)
    assert got[ALICE] == "alice" and got[BOB] == "bob" and got["tml-carol-55aa77bb"] == "carol"
    assert got["tml-solo-0123456789"].startswith("key-") and len(got) == 4     # a key alone: a tenant of its own
    assert read_keys(str(keys), None)["tml-solo-0123456789"] == got["tml-solo-0123456789"]   # stable
    for entry, words in (("alice: sk-live-abcdefghijk", "tml-"), ("al ice: tml-0123456789ab", "tenant name"),
                         (f"a: {ALICE}\nb: {ALICE}", "listed already")):
        with pytest.raises(ValueError, match=words) as err:
            parse_keys(entry.splitlines(), "--keys f line")
        assert "abcdefghijk" not in str(err.value) and ALICE not in str(err.value)   # never the key itself
    with pytest.raises(ValueError, match="no keys"):
        (tmp_path / "empty").write_text("# nobody\n")
        read_keys(str(tmp_path / "empty"), None)


def test_listening_beyond_loopback_needs_keys(tmp_path):
    service = facade.ServiceClient(config="tiny", overrides=SMALL, warmup=False, state_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs API keys"):
        TinkerServer(service, root=tmp_path, host="0.0.0.0", port=0)
    env = {k: v for k, v in os.environ.items() if k not in ("COVRL_DEBUG", "COVRL_SERVE_KEYS")}
    done = subprocess.run([sys.executable, "-m", "covrl", "serve", "--host", "0.0.0.0", "--port", "0", "--dir",
                           str(tmp_path / "s")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("covrl serve: ") == 1 and "Traceback" not in done.stderr
    assert "--keys" in done.stderr and "TLS" in done.stderr
    (tmp_path / "bad").write_text(f"alice: {ALICE[:8]}\n")
    done = subprocess.run([sys.executable, "-m", "covrl", "serve", "--keys", str(tmp_path / "bad"), "--port", "0",
                           "--dir", str(tmp_path / "s")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "line 1" in done.stderr and ALICE[:8] not in done.stderr


def test_covrl_serve_with_keys_listens_beyond_loopback_and_never_prints_a_key(tmp_path):
    """The command itself: keys from a file and the environment, 0.0.0.0, a bad key refused, a good one served;
    neither key in anything it printed."""
    (tmp_path / "keys").write_text(f"alice: {ALICE}\n")
    env = {**{k: v for k, v in os.environ.items() if k != "COVRL_DEBUG"}, "COVRL_SERVE_KEYS": f"bob: {BOB}"}
    proc = subprocess.Popen([sys.executable, "-m", "covrl", "serve", "--config", "tiny", "--no-warmup", "--keys",
                             str(tmp_path / "keys"), "--host", "0.0.0.0", "--port", "0", "--dir", str(tmp_path / "s"),
                             "sft_warmup.steps=0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert "2 tenant(s) (alice, bob" in first, first + proc.stderr.read()
        port = int(first.split("Tinker API at http://0.0.0.0:")[1].split(" ")[0])
        url = f"http://127.0.0.1:{port}"
        assert httpx.post(f"{url}/api/v1/create_session", headers={"X-API-Key": "tml-wrong-0123456"}).status_code == 401
        training = tinker.ServiceClient(base_url=url, api_key=BOB).create_lora_training_client(
            base_model="tiny", rank=2).result()
        assert training.save_state("s").result().path.startswith("tinker://")
        assert list((tmp_path / "s" / "tenants" / "bob").glob("*/checkpoints/s/COMPLETE"))
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    printed = first + out + err
    assert "save_weights s done" in printed and "refused (401)" in printed
    assert ALICE not in printed and BOB not in printed and "tml-wrong" not in printed


# ---------------------------------------------------------------------------------------------- bad input

def test_an_oversized_body_gets_413_and_malformed_ones_a_400_naming_the_field(tmp_path):
    from tinker.proto.request_conv import forward_backward_request_to_proto

    server = team_server(tmp_path, max_body_mb=0.01)
    try:
        alice = lora(server, ALICE)
        with pytest.raises(tinker.APIStatusError, match="413.*max-body-mb") as err:
            alice.forward_backward([sft_datum(list(range(3, 2003)))], loss_fn="cross_entropy").result()
        assert err.value.status_code == 413
        (model_id,) = [model for _, model in server.models]
        request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[sft_datum(PROMPT)], loss_fn="cross_entropy"), model_id=model_id, seq_id=1)
        good = forward_backward_request_to_proto(request).SerializeToString()
        proto = "application/x-protobuf"
        cases = {
            b"\xff\xff\xff": "ForwardBackwardRequest: truncated varint",
            good + b"\x1a\x03\x0a\x05\x01": "data[1].model_input.chunks: payload runs past the end",
            good + b"\x18\x01": "data[1]: a number where a sub-message",
            good + b"\x1a\x04\x12\x02\x0a\x00": "data[1].loss_fn_inputs[''].dtype",
            good.replace(b"cross_entropy", b"cross\xffentropy"): "ForwardBackwardRequest.loss_fn: not UTF-8",
        }
        for raw, words in cases.items():
            r = post(server, ALICE, "forward_backward", raw=raw, content_type=proto)
            assert r.status_code == 400 and words in r.json()["detail"], (words, r.text)
        assert post(server, ALICE, "forward_backward", raw=good, content_type=proto).status_code == 200
        out_of_vocab = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[sft_datum([1, 10**6, 2])], loss_fn="cross_entropy"), model_id=model_id, seq_id=2)
        r = post(server, ALICE, "forward_backward", content_type=proto,
                 raw=forward_backward_request_to_proto(out_of_vocab).SerializeToString())
        assert r.status_code == 400 and "data[0].model_input: token id 1000000" in r.json()["detail"]
        for route, body, words in (("optim_step", b"{not json", "request body: not JSON"),
                                   ("optim_step", b"[1, 2]", "a JSON object"),
                                   ("create_model", b'{"session_id": "s", "base_model": "tiny", '
                                                    b'"lora_config": {"rank": "four"}}', "lora_config.rank"),
                                   ("create_model", b'{"session_id": "s", "base_model": "/etc"}', "base_model"),
                                   ("optim_step", b'{"model_id": "%s", "adam_params": {"learning_rate": "x"}}'
                                    % model_id.encode(), "adam_params.learning_rate")):
            r = post(server, ALICE, route, raw=body)
            assert r.status_code == 400 and words in r.json()["detail"], (route, r.text)
        one_step(alice)        # the server goes on
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------- quotas

def test_quotas_answer_with_a_message_the_sdk_shows(tmp_path):
    server = team_server(tmp_path / "a", max_training_clients=1, keep_last=2, max_queued=3)
    try:
        alice = lora(server, ALICE)
        with pytest.raises(tinker.PermissionDeniedError, match="--max-training-clients 1"):
            lora(server, ALICE)
        lora(server, BOB)                          # a limit per tenant
        paths = [alice.save_state(f"s{i}").result().path for i in range(3)]
        rest = tinker.RestClient(base_url=server.base_url, api_key=ALICE)
        assert sorted(c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints) == paths[1:]
        release = hold_worker(server, "bob")
        (model_id,) = [model for tenant, model in server.models if tenant == "alice"]
        body = {"model_id": model_id, "adam_params": {"learning_rate": 0.0}}
        assert [post(server, ALICE, "optim_step", body).status_code for _ in range(3)] == [200] * 3
        r = post(server, ALICE, "optim_step", body)
        assert r.status_code == 429 and "--max-queued 3" in r.json()["detail"]
        assert post(server, BOB, "create_session", {}).status_code == 200
        release.set()
        wait_until(lambda: server._pending["alice"] == 0)
        assert post(server, ALICE, "optim_step", body).status_code == 200
    finally:
        server.close()
    server = team_server(tmp_path / "b", max_checkpoint_mb=1e-6)
    try:
        alice = lora(server, ALICE)
        with pytest.raises(tinker.RequestFailedError, match="--max-checkpoint-mb"):
            alice.save_state("s").result()
        with pytest.raises(tinker.RequestFailedError, match="--max-checkpoint-mb"):
            alice.save_weights_for_sampler("w").result()
    finally:
        server.close()


def test_a_silent_sessions_training_clients_are_released_at_the_limit(tmp_path, monkeypatch):
    import covrl.api.tinker_server as server_module

    server = team_server(tmp_path, max_training_clients=1)
    try:
        first = lora(server, ALICE)
        monkeypatch.setattr(server_module, "SESSION_IDLE_S", 0.0)     # every session counts as ended
        second = lora(server, ALICE)
        assert len([m for t, m in server.models if t == "alice"]) == 1
        with pytest.raises(tinker.NotFoundError, match="no such training model"):
            first.forward([sft_datum(PROMPT)], loss_fn="cross_entropy").result()
        second.forward([sft_datum(PROMPT)], loss_fn="cross_entropy").result()
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------- scheduling

def test_tenants_take_turns_so_a_flood_does_not_starve_another_tenant(tmp_path):
    log = Log()
    server = team_server(tmp_path, log)
    try:
        alice, bob = lora(server, ALICE), lora(server, BOB)
        datum = sft_datum(PROMPT + [20, 21])
        release = hold_worker(server, "alice")
        flood = [alice.forward([datum], loss_fn="cross_entropy") for _ in range(12)]
        wait_until(lambda: server._jobs.waiting("alice") == 12)
        mine = bob.forward([datum], loss_fn="cross_entropy")
        wait_until(lambda: server._jobs.waiting("bob") == 1)
        release.set()
        outputs = [f.result() for f in flood] + [mine.result()]
    finally:
        server.close()
    done = [line.split(": ")[1] for line in log if " forward done" in line]
    assert sorted(done) == ["alice"] * 12 + ["bob"]
    assert done.index("bob") <= 1          # behind at most one of the flood's 12 (FIFO: behind all 12)
    first = outputs[0].loss_fn_outputs[0]["logprobs"].tolist()
    assert all(o.loss_fn_outputs[0]["logprobs"].tolist() == first for o in outputs)   # same weights, same answer


def bob_steps(server, n=3):
    """Bob's SFT steps: every loss and log-prob the SDK hands back."""
    bob = lora(server, BOB, seed=5)
    got = []
    for i in range(n):
        fb = bob.forward_backward([sft_datum(PROMPT + [20 + i, 21, 22])], loss_fn="cross_entropy").result()
        bob.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        got.append((fb.metrics["loss:sum"], fb.loss_fn_outputs[0]["logprobs"].tolist()))
    return got


def test_garbage_and_dropped_connections_leave_another_tenants_results_bit_exact(tmp_path):
    alone_server = team_server(tmp_path / "alone")
    try:
        alone = bob_steps(alone_server)
    finally:
        alone_server.close()
    server = team_server(tmp_path / "shared")
    stop, errors, rounds = threading.Event(), [], []
    host, port = server._httpd.server_address[:2]

    def mallory():
        """Alice trains her own model and, between her calls, sends garbage and drops connections mid-request."""
        try:
            alice = lora(server, ALICE, seed=9)
            while not stop.is_set():
                post(server, ALICE, "forward_backward", raw=b"\x1a\xff\xff", content_type="application/x-protobuf")
                post(server, ALICE, "create_model", raw=b'{"base_model": 7')
                with socket.create_connection((host, port)) as sock:      # a body cut short, then gone
                    sock.sendall(b"POST /api/v1/forward_backward HTTP/1.1\r\nX-API-Key: " + ALICE.encode()
                                 + b"\r\nContent-Length: 1000\r\n\r\n\x1a\x05")
                with socket.create_connection((host, port)) as sock:      # a request line and nothing more
                    sock.sendall(b"POST /api/v1/optim_step HTTP/1.1\r\n")
                one_step(alice)
                rounds.append(1)
        except Exception as err:   # noqa: BLE001 - reported by the main thread
            errors.append(err)
    thread = threading.Thread(target=mallory, daemon=True)
    try:
        thread.start()
        wait_until(lambda: any(t == "alice" for t, _ in server.models))
        shared = bob_steps(server)
        during = len(rounds)
    finally:
        stop.set()
        thread.join(60)
        server.close()
    assert not errors, errors
    assert during >= 1               # Alice's garbage and steps ran between Bob's
    assert shared == alone           # bit for bit


def test_a_tenants_sampling_session_answers_only_its_own_key_on_the_openai_routes(tmp_path):
    """/openai/<session>/v1 on a team server: the OpenAI client's bearer key is the tenant's key; another
    tenant gets a 404 for the session (it is not theirs) and no key a 401."""
    openai = pytest.importorskip("openai")
    server = team_server(tmp_path)
    try:
        session = post(server, ALICE, "create_sampling_session", {"base_model": "tiny"}).json()["sampling_session_id"]
        messages = [{"role": "user", "content": "Compute 2+3."}]

        def chat(key):
            return openai.OpenAI(base_url=f"{server.base_url}/openai/{session}/v1", api_key=key,
                                 max_retries=0).chat.completions.create(model=session, messages=messages, max_tokens=2)
        assert chat(ALICE).choices[0].message.content is not None
        with pytest.raises(openai.NotFoundError, match="no such sampling session"):
            chat(BOB)
        with pytest.raises(openai.AuthenticationError):
            chat("tml-nobody")
    finally:
        server.close()
