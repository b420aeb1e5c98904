"""`covrl serve` keeps the SDK's documented semantics (Tinker SDK 0.38, through the SDK itself): sampling clients
keep the weights they were made with (snapshot and inflight), every tinker:// path survives a restart, temperature
0 is greedy, `get_tokenizer()` works offline, `stop=[]` runs to max_tokens, and a checkpoint name is not silently
reused. The facade's side of the same rules runs in-process (full fine-tunes hold their weights on disk)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from api_helpers import SMALL
from test_tinker_server import KEY, ROOT, _api_key, serve  # noqa: F401 - _api_key: the autouse fixture

import covrl.api.tinker as facade

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed (make setup installs it)")
from tinker import types  # noqa: E402

PROMPT = [11, 12, 13, 14]


def lora_client(server, rank=4):
    return tinker.ServiceClient(base_url=server.base_url).create_lora_training_client(
        base_model="tiny", rank=rank, seed=3).result()


def draw(sampling, seed=5, n=3, **params):
    res = sampling.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=n,
                          sampling_params=types.SamplingParams(max_tokens=4, seed=seed, **params)).result()
    return [(list(s.tokens), list(s.logprobs), s.stop_reason) for s in res.sequences]


def one_step(training, lr=5e-2):
    """An SFT step on a fixed sequence, large enough to move every sampled log-prob."""
    tokens = PROMPT + [20, 21, 22, 23]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:])),
        "weights": types.TensorData.from_torch(torch.ones(len(tokens) - 1))})
    training.forward_backward([datum], loss_fn="cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=lr)).result()


def scored(sampling, tokens=(11, 12, 13, 14, 20, 21)):
    return sampling.compute_logprobs(types.ModelInput.from_ints(list(tokens))).result()


# ------------------------------------------------------------------------------- sampling clients keep weights

def test_snapshot_and_inflight_clients_keep_their_weights_across_optim_steps(tmp_path):
    server = serve(tmp_path)
    try:
        training = lora_client(server)
        snapshot = training.save_weights_and_get_sampling_client().result()
        inflight = training.save_weights_and_get_sampling_client(kind="inflight").result()
        before, scores = draw(snapshot), scored(snapshot)
        assert draw(inflight) == before
        one_step(training)
        fresh = training.save_weights_and_get_sampling_client().result()
        after = draw(fresh)                    # the new weights, before any old ones were swapped in
        assert [lp for _, lp, _ in after] != [lp for _, lp, _ in before]
        # the SDK's snapshot: version 0 for its whole life (samples and compute_logprobs, bit for bit)
        assert draw(snapshot) == before and scored(snapshot) == scores
        # inflight: the weights of the latest inflight save, which is still version 0's
        assert draw(inflight) == before
        assert draw(fresh) == after            # sampling old weights put the current ones back bit for bit
        one_step(training)
        assert draw(fresh) == after and draw(snapshot) == before   # two generations held at once
        newest = training.save_weights_and_get_sampling_client(kind="inflight").result()
        # an inflight save moves every inflight client to the new weights
        assert draw(inflight) == draw(newest) != after
    finally:
        server.close()


def test_a_full_fine_tune_holds_old_weights_on_disk_and_frees_them(tmp_path):
    service = facade.ServiceClient(config="tiny", overrides=SMALL, warmup=False, state_dir=str(tmp_path))
    training = service.create_training_client("tiny")
    params = facade.SamplingParams(max_tokens=4, temperature=1.0, seed=7)
    prompt = facade.ModelInput.from_ints(PROMPT)
    held_dir = training.api.state_dir / "sampler" / "held"
    clients, seen = [], []
    for _ in range(3):
        clients.append(training.save_weights_and_get_sampling_client())
        seen.append([s.logprobs for s in clients[-1].sample(prompt, 2, params).result().sequences])
        datum = facade.Datum(model_input=facade.ModelInput.from_ints(PROMPT + [20, 21, 22]),
                             loss_fn_inputs={"target_tokens": PROMPT[1:] + [20, 21, 22, 23]})
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(facade.AdamParams(learning_rate=5e-2)).result()
    assert len(list(held_dir.glob("*.safetensors"))) == 3     # one file per held version, written at its step
    for client, expected in zip(clients, seen):
        assert [s.logprobs for s in client.sample(prompt, 2, params).result().sequences] == expected
    assert len(training._loaded) == facade.HELD_LOADED    # the least recently used one was dropped
    assert len({str(e) for e in seen}) == 3
    del clients, client
    gc.collect()
    assert list(held_dir.glob("*.safetensors")) == []      # freed with the last client holding them


# --------------------------------------------------------------------------------------- paths across restarts

def test_sampler_weights_paths_survive_a_restart(tmp_path):
    server = serve(tmp_path)
    try:
        training = lora_client(server)
        one_step(training)
        path = training.save_weights_for_sampler("after-1").result().path
        state = training.save_state("state-1").result().path
        then = draw(tinker.ServiceClient(base_url=server.base_url).create_sampling_client(model_path=path).result())
    finally:
        server.close()
    again = serve(tmp_path)     # a new server over the same --dir
    try:
        service = tinker.ServiceClient(base_url=again.base_url)
        assert draw(service.create_sampling_client(model_path=path).result()) == then
        resumed = service.create_training_client_from_state(state).result()
        assert draw(resumed.save_weights_and_get_sampling_client().result()) == then
        with pytest.raises(Exception, match="no complete sampler weights"):
            service.create_sampling_client(model_path=path.replace("after-1", "missing")).result()
    finally:
        again.close()


# -------------------------------------------------------------------------------------------- sampling params

def test_temperature_zero_is_greedy_with_the_models_log_probs(tmp_path):
    server = serve(tmp_path)
    try:
        training = lora_client(server)
        sampling = training.save_weights_and_get_sampling_client().result()
        a, b = draw(sampling, seed=1, n=2, temperature=0.0), draw(sampling, seed=2, n=2, temperature=0.0)
        assert a[0] == a[1] == b[0] == b[1]     # no randomness left
        model = next(iter(server.models.values())).api.model
        tokens, logprobs, _ = a[0]
        with torch.no_grad():
            for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
                logits = model(input_ids=torch.tensor([PROMPT + tokens[:i]])).logits[0, -1].float()
                assert tok == int(logits.argmax())
                assert lp == pytest.approx(float(torch.log_softmax(logits, -1)[tok]), abs=1e-5)   # temperature 1
        with pytest.raises(Exception, match="temperature"):
            draw(sampling, temperature=-1.0)
    finally:
        server.close()


def test_an_empty_stop_list_runs_to_max_tokens_past_eos(tmp_path):
    server = serve(tmp_path)
    try:
        training = lora_client(server, rank=8)
        eos = training.get_tokenizer().eos_token_id
        tokens = PROMPT + [eos]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:])),
            "weights": types.TensorData.from_torch(torch.tensor([0.0, 0.0, 0.0, 1.0]))})
        for _ in range(15):       # teach it to end the answer at once
            training.forward_backward([datum], loss_fn="cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        sampling = training.save_weights_and_get_sampling_client().result()
        default = draw(sampling, temperature=0.0, n=1)[0]
        assert default[0] == [eos] and default[2] == "stop"          # stop=None: EOS stops
        unstopped = draw(sampling, temperature=0.0, n=1, stop=[])[0]
        assert len(unstopped[0]) == 4 and unstopped[0][0] == eos and unstopped[2] == "length"
    finally:
        server.close()


# ------------------------------------------------------------------------------------------------- tokenizer

def test_get_tokenizer_loads_offline_from_the_servers_folder(tmp_path):
    server = serve(tmp_path)
    script = ("import sys, tinker\n"
              "t = tinker.ServiceClient(base_url=sys.argv[1]).create_lora_training_client(base_model='tiny', "
              "rank=2).result()\n"
              "print(t.get_info().model_data.tokenizer_id)\n"
              "print(t.get_tokenizer().encode('hello 42', add_special_tokens=False))\n")
    env = {**os.environ, **KEY, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf-home")}
    try:
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-c", script, server.base_url], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert time.monotonic() - start < 60          # no hub retries
        folder, ids = done.stdout.strip().splitlines()[-2:]
        assert Path(folder).is_dir() and Path(folder).is_relative_to((tmp_path / "serve").resolve())
        ours = next(iter(server.models.values())).api.tokenizer
        assert json.loads(ids) == ours.encode("hello 42", add_special_tokens=False)
    finally:
        server.close()


# ----------------------------------------------------------------------------------------- checkpoint names

def test_a_taken_checkpoint_name_is_refused_unless_overwrite(tmp_path):
    server = serve(tmp_path)
    try:
        training = lora_client(server)
        path = training.save_state("s").result().path
        snap = training.save_weights_for_sampler("snap").result().path
        then = draw(tinker.ServiceClient(base_url=server.base_url).create_sampling_client(model_path=snap).result())
        one_step(training)
        with pytest.raises(tinker.RequestFailedError, match=f"409 Conflict: {path} already exists.*overwrite=True"):
            training.save_state("s").result()
        with pytest.raises(tinker.RequestFailedError, match=f"409 Conflict: {snap} already exists"):
            training.save_weights_for_sampler("snap").result()
        folder = server.root / path.split("/")[2] / "checkpoints" / "s"
        assert json.loads((folder / "COMPLETE").read_text())["policy_version"] == 0    # untouched
        assert draw(tinker.ServiceClient(base_url=server.base_url).create_sampling_client(model_path=snap)
                    .result()) == then
        assert training.save_state("s", overwrite=True).result().path == path
        assert json.loads((folder / "COMPLETE").read_text())["policy_version"] == 1
    finally:
        server.close()


def test_the_facade_refuses_a_taken_name_too(tmp_path):
    service = facade.ServiceClient(config="tiny", overrides=SMALL, warmup=False, state_dir=str(tmp_path))
    training = service.create_lora_training_client("tiny", rank=2)
    training.save_state("s").result()
    with pytest.raises(facade.CheckpointExistsError, match="'s' already exists.*overwrite=True"):
        training.save_state("s").result()
    training.save_state("s", overwrite=True).result()
    training.save_weights_for_sampler("w").result()
    with pytest.raises(facade.CheckpointExistsError, match="'w' already exists"):
        training.save_weights_for_sampler("w").result()


# ------------------------------------------------------------------------------------------ the cookbook's DPO

DPO_DRIVER = """
import sys
import datasets
sys.path.insert(0, sys.argv[1])
from cookbook_recipe import install_local_stand_ins
rows = datasets.load_dataset("json", data_files=sys.argv[2], split="train")
install_local_stand_ins("tiny", sys.argv[2])     # the tokenizer, the renderer lookup
datasets.load_dataset = lambda *a, **k: datasets.DatasetDict({"train": rows, "test": rows})
import chz
from tinker_cookbook.recipes.preference.dpo import train
chz.nested_entrypoint(train.cli_main, argv=sys.argv[3:])
"""


# slow (~10 s): a second cookbook recipe; tests/api/test_tinker_facade.py keeps one in the default suite
@pytest.mark.slow
def test_the_cookbooks_dpo_recipe_takes_two_steps_against_a_frozen_reference(tmp_path):
    """tinker-cookbook's DPO recipe (its own code; hub data, tokenizer and renderer replaced as
    examples/cookbook_recipe.py does) takes its reference with save_weights_and_get_sampling_client() and
    scores with it after every optim_step."""
    pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (make setup installs it)")
    rows = tmp_path / "hhh.jsonl"
    with rows.open("w") as f:
        for i in range(8):
            f.write(json.dumps({"chosen": f"\n\nHuman: {i}+1?\n\nAssistant: {i + 1}",
                                "rejected": f"\n\nHuman: {i}+1?\n\nAssistant: no"}) + "\n")
    server = serve(tmp_path)
    log = tmp_path / "dpo"
    try:
        done = subprocess.run(
            [sys.executable, "-c", DPO_DRIVER, str(ROOT / "examples"), str(rows), "model_name=tiny", "dataset=hhh",
             f"base_url={server.base_url}", f"log_path={log}", "renderer_name=role_colon", "batch_size=4",
             "max_steps=2", "max_length=64", "learning_rate=1e-2", "behavior_if_log_dir_exists=delete"],
            env={**os.environ, **KEY, "TINKER_COOKBOOK_RUNS_DIR": str(tmp_path / "runs")}, capture_output=True,
            text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
    finally:
        server.close()
    steps = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    losses = [row["dpo_loss"] for row in steps if "dpo_loss" in row]
    assert len(losses) == 2 and losses[0] == pytest.approx(0.6931, abs=1e-4)   # log 2: policy == reference
    # step 1 is scored against the frozen reference: the update shows (a reference that followed the policy
    # would give log 2 again)
    assert losses[1] < losses[0] - 0.01
