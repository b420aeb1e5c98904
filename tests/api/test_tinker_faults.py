"""Faults around `covrl serve` leave the other clients' results bit for bit what they are without the fault,
through Tinker's own SDK (0.38), with the LoRA clients sharing one base model (covrl.api.multilora):

- a client that goes away mid-request: a queued call whose retrieve_future connection is closed before the
  result is ready, and a body cut short;
- garbage: malformed protobuf and JSON bodies;
- the server SIGKILLed and started again over the same folder: the other client goes on from its saved state
  (`create_training_client_from_state_with_optimizer`), and its later steps equal an uninterrupted run's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from api_helpers import SMALL
from test_tinker_semantics import PROMPT
from test_tinker_server import _api_key  # noqa: F401 - the autouse fixture (a key for the SDK's own checks)
from test_tinker_tenants import ALICE, BOB, hold_worker, post, sft_datum, team_server, wait_until

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed (make setup installs it)")
from tinker import types  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def lora(base_url: str, key: str):
    # the same base model and seed for every client: their LoRA clients share one base
    return tinker.ServiceClient(base_url=base_url, api_key=key).create_lora_training_client(
        base_model="tiny", rank=4, seed=3).result()


def step(client, i: int) -> tuple:
    """One RL-like step: sample at a seed, a cross-entropy forward_backward on the first sample, optim_step."""
    sampling = client.save_weights_and_get_sampling_client().result()
    res = sampling.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=2,
                          sampling_params=types.SamplingParams(max_tokens=4, seed=40 + i)).result()
    samples = [(list(s.tokens), list(s.logprobs)) for s in res.sequences]
    fb = client.forward_backward([sft_datum(PROMPT + samples[0][0] + [20])], loss_fn="cross_entropy").result()
    opt = client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return samples, fb.metrics["loss:sum"], fb.loss_fn_outputs[0]["logprobs"].tolist(), opt.metrics["grad_norm"]


def test_a_client_gone_mid_request_and_garbage_leave_another_clients_results_bit_exact(tmp_path):
    alone_server = team_server(tmp_path / "alone")
    try:
        bob = lora(alone_server.base_url, BOB)
        alone = [step(bob, i) for i in range(3)]
    finally:
        alone_server.close()

    server = team_server(tmp_path / "faults")
    host, port = server._httpd.server_address[:2]
    try:
        alice, bob = lora(server.base_url, ALICE), lora(server.base_url, BOB)
        assert len(server.service._bases) == 1          # two tenants' LoRA clients on one base
        got = []
        for i in range(3):
            assert post(server, ALICE, "forward_backward", raw=b"\x1a\xff\xff",
                        content_type="application/x-protobuf").status_code == 400
            assert post(server, ALICE, "create_model", raw=b'{"base_model": 7').status_code == 400
            # Alice's optim_step queued behind a held worker; her connection closes while it waits for the result
            release = hold_worker(server, "alice")
            queued = post(server, ALICE, "optim_step", {"model_id": alice.model_id,
                                                        "adam_params": {"learning_rate": 1e-2}})
            request_id = queued.json()["request_id"]
            body = f'{{"request_id": "{request_id}"}}'.encode()
            with socket.create_connection((host, port)) as sock:
                sock.sendall(b"POST /api/v1/retrieve_future HTTP/1.1\r\nX-API-Key: " + ALICE.encode()
                             + b"\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                time.sleep(0.05)   # the server is in its long poll now
            with socket.create_connection((host, port)) as sock:      # a body cut short, then gone
                sock.sendall(b"POST /api/v1/forward_backward HTTP/1.1\r\nX-API-Key: " + ALICE.encode()
                             + b"\r\nContent-Length: 1000\r\n\r\n\x1a\x05")
            release.set()
            wait_until(lambda: server._pending["alice"] == 0)      # her call ran, with no one to answer
            step(alice, 10 + i)                                     # and she trains on
            got.append(step(bob, i))
    finally:
        server.close()
    assert got == alone     # bit for bit: samples, log-probs, losses, grad norms


def _serve(folder: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """`covrl serve` (tiny, the test's small overrides) as its own process; (process, base URL)."""
    overrides = [f"{k}={v}" for k, v in SMALL.items()]
    out = open(log, "a")   # noqa: SIM115 - the process writes to it until it ends
    proc = subprocess.Popen([sys.executable, "-m", "covrl", "serve", "--config", "tiny", "--port", "0", "--dir",
                             str(folder), "--no-warmup", *overrides], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if "Tinker API at " in line and proc.pid:
                url = line.split("Tinker API at ", 1)[1].split()[0]
                try:
                    if httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200:
                        return proc, url
                except httpx.HTTPError:
                    pass
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"covrl serve did not start: {log.read_text()}")


@pytest.mark.slow   # about 30 s: two server processes started
def test_a_server_killed_and_restarted_over_its_folder_leaves_the_other_clients_run_bit_exact(tmp_path):
    """Bob saves his state after each step. The server is SIGKILLed while Alice's call is in flight, started
    again over the same --dir, and Bob resumes from his last state: his steps equal an uninterrupted run's."""
    alone_server = team_server(tmp_path / "alone")   # no keys needed: the same model on a server of its own
    try:
        bob = lora(alone_server.base_url, BOB)
        alone = [step(bob, i) for i in range(4)]
    finally:
        alone_server.close()

    folder, log = tmp_path / "serve", tmp_path / "serve.log"
    proc, url = _serve(folder, log)
    try:
        alice, bob = lora(url, "tml-alice"), lora(url, "tml-bob")
        got = []
        for i in range(2):
            got.append(step(bob, i))
            state = bob.save_state(f"bob-{i}").result().path
        alice_fb = alice.forward_backward([sft_datum(PROMPT + [20, 21, 22])], loss_fn="cross_entropy")
        os.kill(proc.pid, signal.SIGKILL)          # mid-flight for Alice
        proc.wait(30)
        del alice_fb
        proc, url = _serve(folder, log)            # the same folder
        bob = tinker.ServiceClient(base_url=url, api_key="tml-bob").create_training_client_from_state_with_optimizer(
            state).result()
        got += [step(bob, i) for i in range(2, 4)]
    finally:
        proc.kill()
        proc.wait(30)
    assert got == alone
    assert torch.isfinite(torch.tensor(alone[-1][1]))
