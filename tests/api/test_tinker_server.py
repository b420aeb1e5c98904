"""`covrl serve` against Tinker's own SDK (PyPI `tinker` 0.38) and the tinker-cookbook recipes (PyPI
`tinker-cookbook` 0.6.1), unchanged: the wire codec against the SDK's protobuf code, the SDK's calls giving what
the in-process facade gives, clear refusals, and `sl_loop` / `rl_loop` run, killed after a checkpoint and
resumed, with the resumed steps equal to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from api_helpers import SMALL

import covrl.api.tinker as facade
from covrl.api.tinker_server import TinkerServer
from covrl.api.tinker_wire import (
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed (make setup installs it)")
ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "examples" / "cookbook_recipe.py"
KEY = {"TINKER_API_KEY": "tml-covrl-test"}


@pytest.fixture(autouse=True)
def _api_key(monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", KEY["TINKER_API_KEY"])


def serve(tmp_path, overrides=None, config="tiny"):
    service = facade.ServiceClient(config=config, overrides={**SMALL, **(overrides or {})}, warmup=False,
                                   state_dir=str(tmp_path / "serve"))
    return TinkerServer(service, root=tmp_path / "serve", log=lambda _: None).start()


# ---------------------------------------------------------------------------------------------- wire codec

def test_wire_codec_reads_and_writes_what_the_sdk_writes_and_reads():
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    sparse = types.TensorData(data=[1.5, -2.0], dtype="float32", shape=[2, 3], sparse_crow_indices=[0, 1, 2],
                              sparse_col_indices=[2, 0])
    datums = [types.Datum(model_input=types.ModelInput.from_ints([5, 70000, 3]),
                          loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.tensor([7, 8, 9])),
                                          "weights": types.TensorData.from_torch(torch.tensor([0.0, 0.5, 1.0])),
                                          "mask": sparse}),
              types.Datum(model_input=types.ModelInput.from_ints([]), loss_fn_inputs={})]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn="ppo",
                                                          loss_fn_config={"clip_low_threshold": 0.75, "mode": "x"}),
        model_id="s:train:0", seq_id=12)
    proto = forward_backward_request_to_proto(request)
    proto.forward_only = True
    got = decode_forward_backward_request(proto.SerializeToString())
    assert (got["model_id"], got["seq_id"], got["loss_fn"], got["forward_only"]) == ("s:train:0", 12, "ppo", True)
    assert got["loss_fn_config"] == {"clip_low_threshold": 0.75, "mode": "x"}
    assert got["data"][0].tokens == [5, 70000, 3] and got["data"][1].tokens == []
    inputs = got["data"][0].loss_fn_inputs
    assert inputs["target_tokens"].dtype == np.int64 and inputs["target_tokens"].tolist() == [7, 8, 9]
    assert inputs["weights"].tolist() == [0.0, 0.5, 1.0]
    assert inputs["mask"].tolist() == [[0.0, 0.0, 1.5], [-2.0, 0.0, 0.0]]

    sample = deserialize_sample_response(encode_sample_response(
        [("stop", [4, 99999], [-0.25, -3.5]), ("length", [], [])], [None, -1.0, -2.5]))
    assert [(s.stop_reason, s.tokens, s.logprobs) for s in sample.sequences] == [
        ("stop", [4, 99999], [-0.25, -3.5]), ("length", [], None)]   # the SDK reads no bytes as None
    assert sample.prompt_logprobs == [None, -1.0, -2.5]

    out = deserialize_forward_backward_output(encode_forward_backward_output(
        [{"logprobs": np.array([-1.0, -2.0]), "elementwise_loss": np.array([0.5, 0.25])},
         {"logprobs": np.array([]), "elementwise_loss": np.array([])}], {"loss:sum": 0.75, "n:mean": -1e30}))
    assert [{k: v.tolist() for k, v in row.items()} for row in out.loss_fn_outputs] == [
        {"logprobs": [-1.0, -2.0], "elementwise_loss": [0.5, 0.25]}, {"logprobs": [], "elementwise_loss": []}]
    assert out.metrics == {"loss:sum": 0.75, "n:mean": -1e30} and out.loss_fn_output_type == "ArrayRecord"


# ---------------------------------------------------------------------------------------------- SDK calls

def sdk_calls(service_client, types):
    """The calls a cookbook RL step makes, through whichever client: every number the SDK hands back."""
    training = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=3)
    if hasattr(training, "result"):
        training = training.result()
    sampling = training.save_weights_and_get_sampling_client()
    sampling = sampling.result() if hasattr(sampling, "result") else sampling
    prompt = [11, 12, 13, 14]
    res = sampling.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3,
                          sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=5)).result()
    datums = []
    for i, seq in enumerate(res.sequences):
        tokens, ob = prompt + list(seq.tokens), len(prompt) - 1
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(torch.tensor([0] * ob + list(seq.tokens))),
            "logprobs": types.TensorData.from_torch(torch.tensor([0.0] * ob + list(seq.logprobs))),
            "advantages": types.TensorData.from_torch(torch.tensor([0.0] * ob + [i - 1.0] * len(seq.tokens)))}))
    fb = training.forward_backward(datums, loss_fn="importance_sampling").result()
    opt = training.optim_step(types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95)).result()
    after = training.forward(datums, loss_fn="cross_entropy").result()
    return {"tokens": [list(s.tokens) for s in res.sequences], "q": [list(s.logprobs) for s in res.sequences],
            "stop": [s.stop_reason for s in res.sequences],
            "logprobs": [row["logprobs"].tolist() for row in fb.loss_fn_outputs],
            "loss": [row["elementwise_loss"].tolist() for row in fb.loss_fn_outputs],
            "loss_sum": fb.metrics["loss:sum"], "grad_norm": opt.metrics["grad_norm"],
            "after": [row["logprobs"].tolist() for row in after.loss_fn_outputs]}, training


def test_the_sdk_through_the_server_gets_what_the_facade_gives_in_process(tmp_path):
    from tinker import types

    server = serve(tmp_path / "a")
    try:
        remote, training = sdk_calls(tinker.ServiceClient(base_url=server.base_url), types)
        info = training.get_info()
        assert info.model_data.model_name == "tiny" and info.is_lora and info.lora_rank == 4
        # a state round trip and a named snapshot, by tinker:// path
        state = training.save_state("s1").result().path
        assert state.startswith("tinker://") and state.endswith("/weights/s1")
        resumed = tinker.ServiceClient(base_url=server.base_url).create_training_client_from_state_with_optimizer(
            state).result()
        assert resumed.get_info().lora_rank == 4
        snap = training.save_weights_for_sampler("snap").result().path
        again = training.save_weights_and_get_sampling_client().result()
        lp = again.compute_logprobs(types.ModelInput.from_ints([11, 12, 13])).result()
        assert lp[0] is None and len(lp) == 3 and all(v < 0 for v in lp[1:])
        old = tinker.ServiceClient(base_url=server.base_url).create_sampling_client(model_path=snap).result()
        assert len(old.sample(prompt=types.ModelInput.from_ints([11]), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=2)).result().sequences[0].tokens) == 2
    finally:
        server.close()
    local, _ = sdk_calls(facade.ServiceClient(config="tiny", overrides=SMALL, warmup=False,
                                              state_dir=str(tmp_path / "b")), facade.types)
    assert remote["tokens"] == local["tokens"] and remote["stop"] == local["stop"]
    # float32 on the wire: the values the facade computed, rounded to float32
    for key in ("q", "logprobs", "loss", "after"):
        assert [np.float32(v).tolist() for v in local[key]] == remote[key], key
    assert remote["loss_sum"] == pytest.approx(local["loss_sum"], rel=1e-12)
    assert remote["grad_norm"] == local["grad_norm"] and remote["after"] != remote["logprobs"]


def test_the_server_refuses_bad_requests_by_name(tmp_path):
    import httpx
    from tinker import types

    server = serve(tmp_path)
    try:
        training = tinker.ServiceClient(base_url=server.base_url).create_lora_training_client(
            base_model="tiny", rank=2).result()
        image = types.Datum(model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
                            loss_fn_inputs={"weights": types.TensorData.from_torch(torch.ones(1))})
        with pytest.raises(Exception, match="image"):
            training.forward_backward([image], loss_fn="cross_entropy").result()
        bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(torch.tensor([9, 9, 9])),
            "weights": types.TensorData.from_torch(torch.ones(3))})
        fresh = tinker.ServiceClient(base_url=server.base_url).create_lora_training_client(
            base_model="tiny", rank=2).result()
        with pytest.raises(Exception, match="target_tokens"):
            fresh.forward_backward([bad], loss_fn="cross_entropy").result()
        with pytest.raises(Exception, match="no complete checkpoint"):
            tinker.ServiceClient(base_url=server.base_url).create_training_client_from_state(
                "tinker://nope/weights/x").result()
        r = httpx.post(f"{server.base_url}/api/v1/optim_step", json={"model_id": "nope", "adam_params": {}})
        assert r.status_code == 404 and "no such training model" in r.json()["detail"]
        assert httpx.get(f"{server.base_url}/api/v1/billing/usage").status_code == 404
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------- the cookbook

def word_model(folder: Path) -> Path:
    """A local transformers folder: a word-level tokenizer in which `\\boxed{d}` is one token, and a randomly
    initialised 1-layer Llama over it. With it a random policy writes a boxed digit often enough that the
    cookbook's own GSM8K reward is 1 for some samples and 0 for others, so rl_loop trains."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from covrl.models.tiny import tiny_llama

    pieces = ["<pad>", "<s>", "<eos>", "<unk>", "User", "Assistant", ":", " ", "\n\n", "\n", "What", "is", "+", "?",
              *"0123456789", *[f"\\boxed{{{d}}}" for d in range(10)]]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\\boxed\{\d\}|\n\n|\n|[A-Za-z]+|\d|\S| "), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<eos>",
                                   unk_token="<unk>")
    fast.save_pretrained(folder)
    tiny_llama(len(pieces), hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
               max_positions=512).save_pretrained(folder)
    return folder


def write_rows(path: Path, recipe: str, n: int = 48) -> Path:
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for _ in range(n):
            a, b = (int(x) for x in rng.integers(0, 5, 2))
            row = ({"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                                 {"role": "assistant", "content": f"\\boxed{{{a + b}}}"}]}
                   if recipe == "sl_loop" else {"question": f"What is {a}+{b}?", "answer": f"{a}+{b}\n#### {a + b}"})
            f.write(json.dumps(row) + "\n")
    return path


def recipe_command(recipe, data, model, base_url, log_path, steps):
    args = [sys.executable, str(RUNNER), recipe, "--data", str(data), f"base_url={base_url}", f"model_name={model}",
            f"log_path={log_path}", f"max_steps={steps}", "save_every=2", "lora_rank=8", "batch_size=4"]
    if recipe == "rl_loop":
        args += ["group_size=4", "max_tokens=6", "loss_fn=importance_sampling", "learning_rate=1e-2"]
    else:
        args += ["learning_rate=1e-2"]
    return args


def steps_of(log_path: Path) -> dict[int, dict]:
    """The last logged metrics of each step (a killed run may have logged a step the resumed one logs again)."""
    out = {}
    for line in (log_path / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[int(row["step"])] = row
    return out


def run_killed_after_checkpoint(command, log_path: Path, env, timeout_s=240) -> None:
    """Start the recipe and SIGKILL it once its checkpoint of batch 2 is in checkpoints.jsonl."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    marker = log_path / "checkpoints.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if marker.is_file() and '"batch": 2' in marker.read_text():
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the recipe ended before its checkpoint: {proc.stderr.read()[-3000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow   # a long end-to-end run: make test-slow (the default suite stays near 10 minutes)
@pytest.mark.parametrize("recipe", ["sl_loop", "rl_loop"])
def test_cookbook_recipe_runs_and_resumes_after_a_kill_against_covrl_serve(tmp_path, recipe):
    pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (make setup installs it)")
    model = str(word_model(tmp_path / "model"))
    data = write_rows(tmp_path / "rows.jsonl", recipe)
    server = serve(tmp_path, {"sampler.max_new_tokens": 8})
    env = {**os.environ, **KEY, "TINKER_COOKBOOK_RUNS_DIR": str(tmp_path / "runs")}
    try:
        whole = tmp_path / "whole"
        done = subprocess.run(recipe_command(recipe, data, model, server.base_url, whole, 4), env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        killed = tmp_path / "killed"
        command = recipe_command(recipe, data, model, server.base_url, killed, 4)
        run_killed_after_checkpoint(command, killed, env)
        resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "Resuming from batch 2" in resumed.stderr
    finally:
        server.close()
    ref, got = steps_of(whole), steps_of(killed)
    assert sorted(ref) == sorted(got) == [0, 1, 2, 3]
    keys = (["train_mean_nll", "grad_norm", "num_tokens"] if recipe == "sl_loop"
            else ["reward/total", "grad_norm"])
    for step in range(4):
        for key in keys:
            if key in ref[step] or key in got[step]:
                assert got[step].get(key) == ref[step].get(key), (step, key)
    if recipe == "rl_loop":   # the cookbook's own reward varied, so the loop trained
        assert any("grad_norm" in ref[s] for s in range(4)) and any(ref[s]["reward/total"] > 0 for s in range(4))
    final = [json.loads(line) for line in (killed / "checkpoints.jsonl").read_text().splitlines()]
    assert final[-1]["name"] == "final" and final[-1]["state_path"].startswith("tinker://")


def test_a_result_slower_than_the_long_poll_still_arrives(tmp_path, monkeypatch, caplog):
    from tinker import types

    import covrl.api.tinker_server as server_module

    monkeypatch.setattr(server_module, "LONG_POLL_S", 0.01)
    server = serve(tmp_path)
    try:
        training = tinker.ServiceClient(base_url=server.base_url).create_lora_training_client(
            base_model="tiny", rank=2).result()
        sampling = training.save_weights_and_get_sampling_client().result()
        res = sampling.sample(prompt=types.ModelInput.from_ints([3, 4]), num_samples=2,
                   sampling_params=types.SamplingParams(max_tokens=3, seed=1)).result()
        assert [len(s.tokens) for s in res.sequences] == [3, 3]
    finally:
        server.close()
    assert "try_again" not in caplog.text     # polled again quietly


def test_an_agent_samples_a_sessions_weights_through_the_openai_routes(tmp_path):
    """`/openai/<sampling_session_id>/v1`: the real `openai` client's chat completion is drawn from the session's
    weights on the server's model thread; the answer's prompt ids are the chat template's, its log-probs those of
    the session's own compute_logprobs (float32), and an unknown session is a 404 naming it."""
    import urllib.request

    openai = pytest.importorskip("openai")
    server = serve(tmp_path)
    try:
        request = urllib.request.Request(f"{server.base_url}/api/v1/create_sampling_session",
                                         data=json.dumps({"base_model": "tiny"}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=60) as answer:
            session = json.loads(answer.read())["sampling_session_id"]
        client = openai.OpenAI(base_url=f"{server.base_url}/openai/{session}/v1", api_key="any", max_retries=0)
        assert [m.id for m in client.models.list().data] == [session]
        messages = [{"role": "user", "content": "Compute 2+3."}]
        reply = client.chat.completions.create(model=session, messages=messages, max_tokens=4, logprobs=True,
                                               extra_body={"return_token_ids": True})
        answer = reply.model_dump()
        prompt, ids = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
        lps = [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
        assert 1 <= len(ids) == len(lps) <= 4
        endpoint = server._openai_sessions.server(session, server.samplers[session].client.api, None)
        assert prompt == endpoint.chat_prompt_ids(messages)
        scored = server.samplers[session].client.compute_logprobs(facade.ModelInput.from_ints(prompt + ids)).result()
        assert np.allclose(lps, scored[len(prompt):], atol=1e-5)
        with pytest.raises(openai.NotFoundError, match="no such sampling session"):
            openai.OpenAI(base_url=f"{server.base_url}/openai/sampler-nope/v1", api_key="any",
                          max_retries=0).chat.completions.create(model="x", messages=messages)
    finally:
        server.close()
