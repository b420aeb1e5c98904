"""save_state / load_state round trip (weights, optimizer state, version, generator: bit-exact), versioned
sampling clients, and bad inputs that raise errors naming the field."""

from __future__ import annotations

import copy

import pytest
import torch
from api_helpers import SMALL, make_batch

from covrl.api import AdamParams, SamplingParams, StaleSamplingClientError, TrainBatch, TrainingClient
from covrl.train.run.checkpoint import COMPLETE


def step(client, lr=1e-2):
    client.forward_backward(make_batch(client), "ppo_clip")
    return client.optim_step(AdamParams(learning_rate=lr, grad_clip_norm=1.0))


def test_save_load_round_trip_is_bit_exact(client, tmp_path):
    step(client)
    step(client)
    path = client.save_state("two")
    assert (path / COMPLETE).is_file()
    weights = {k: v.clone() for k, v in client.model.state_dict().items()}
    opt = copy.deepcopy(client.optimizer.state_dict())   # state_dict() holds the live tensors
    gen = client.generator.get_state()
    after_save = step(client)                            # where an uninterrupted client goes next
    after_weights = {k: v.clone() for k, v in client.model.state_dict().items()}

    fresh = TrainingClient.from_config("tiny", SMALL, state_dir=tmp_path)
    fresh.load_state(path)
    assert fresh.version == 2 and torch.equal(fresh.generator.get_state(), gen)
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    loaded = fresh.optimizer.state_dict()
    assert loaded["param_groups"] == opt["param_groups"]
    for i, s in opt["state"].items():
        for key, t in s.items():
            assert torch.equal(loaded["state"][i][key], t), (i, key)
    fresh.stream.position = client.stream.position - 4    # the same prompts as the uninterrupted next step
    again = step(fresh)
    assert again.metrics["grad_norm"] == after_save.metrics["grad_norm"]
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, after_weights[k]), k


def test_load_weights_only(client):
    step(client)
    path = client.save_state("one")
    before = client.optimizer.state_dict()["state"][0]["step"].clone()
    step(client)
    client.load_state("one", optimizer=False)            # a name under state_dir/checkpoints
    assert client.version == 2 and client.optimizer.state_dict()["state"][0]["step"] > before
    assert path.name == "one"


def test_sampling_client_is_versioned(client):
    s0 = client.save_weights_and_get_sampling_client()
    prompt = client.task.encode(client.tokenizer, client.task.train[0])
    out = s0.sample(prompt, 3, SamplingParams(max_tokens=2, seed=5))
    assert out.version == 0 and len(out.sequences) == 3 and all(len(s.tokens) <= 2 for s in out.sequences)
    again = s0.sample(prompt, 3, SamplingParams(max_tokens=2, seed=5))
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]
    for s in out.sequences:
        assert len(s.logprobs) == len(s.tokens) and all(lp <= 0 for lp in s.logprobs)
    step(client)
    with pytest.raises(StaleSamplingClientError, match="version 0"):
        s0.sample(prompt, 1)
    s1 = client.save_weights_and_get_sampling_client()
    assert s1.sample(prompt, 1).version == 1


def test_snapshot_client_samples_its_version_after_newer_weights(client):
    prompts = [client.task.encode(client.tokenizer, ex) for ex in client.task.train[:3]]
    params = SamplingParams(max_tokens=3, seed=11)
    step(client)
    client.save_weights_for_sampler("v1")
    at_v1 = client.save_weights_and_get_sampling_client().sample(prompts, 4, params)
    step(client)
    step(client)
    live = client.save_weights_and_get_sampling_client()
    at_v3 = live.sample(prompts, 4, params)
    weights_v3 = {k: v.clone() for k, v in client.model.state_dict().items()}
    snap = client.create_sampling_client("v1")
    again = snap.sample(prompts, 4, params)
    assert again.version == 1 and snap.version == 1
    assert again.batch.response_ids.equal(at_v1.batch.response_ids)
    assert again.batch.sampler_logprobs.equal(at_v1.batch.sampler_logprobs)
    assert not again.batch.sampler_logprobs.equal(at_v3.batch.sampler_logprobs)   # other weights did sample
    # the current weights are back bit for bit, and the current version's client is still fresh and exact
    for k, v in client.model.state_dict().items():
        assert torch.equal(v, weights_v3[k]), k
    assert live.sample(prompts, 4, params).batch.sampler_logprobs.equal(at_v3.batch.sampler_logprobs)
    assert client.create_sampling_client(client.state_dir / "sampler" / "checkpoints" / "v1").version == 1
    with pytest.raises(Exception, match="not a complete checkpoint"):
        client.create_sampling_client("nope")


# ------------------------------------------------------------------------------------------- bad inputs

def test_bad_batches_name_the_field():
    with pytest.raises(ValueError, match=r"sampler_logprobs\[1\]: 1 values but responses\[1\] has 2"):
        TrainBatch.from_sequences([[1], [2]], [[3], [4, 5]], sampler_logprobs=[[0.0], [0.0]])
    with pytest.raises(ValueError, match="responses: 1 rows but prompts has 2"):
        TrainBatch.from_sequences([[1], [2]], [[3]])
    with pytest.raises(ValueError, match=r"advantages\[0\]: 3 values"):
        TrainBatch.from_sequences([[1]], [[3, 4]], advantages=[[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=r"prompts\[0\]: empty"):
        TrainBatch.from_sequences([[]], [[3]])
    ok = TrainBatch.from_sequences([[1]], [[3, 4]])
    with pytest.raises(ValueError, match="TrainBatch.advantages: shape"):
        TrainBatch(ok.prompt_ids, ok.prompt_mask, ok.response_ids, ok.response_mask, advantages=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="TrainBatch.sampler_logprobs: non-finite"):
        TrainBatch(ok.prompt_ids, ok.prompt_mask, ok.response_ids, ok.response_mask,
                   sampler_logprobs=torch.tensor([[float("nan"), 0.0]]))


def test_bad_calls_name_the_field(client):
    batch = TrainBatch.from_sequences([[1, 2]], [[3, 4]], advantages=[1.0])
    with pytest.raises(ValueError, match="loss_fn: unknown loss 'nope'"):
        client.forward_backward(batch, "nope")
    with pytest.raises(ValueError, match=r"sampler_logprobs"):
        client.forward_backward(batch, "importance_sampling")
    with pytest.raises(ValueError, match=r"advantages"):
        client.forward_backward(TrainBatch.from_sequences([[1]], [[3]]), "covariance")
    with pytest.raises(TypeError, match="unknown options \\['clip'\\]"):
        client.forward_backward(batch, "covariance", loss_options={"clip": 1})
    with pytest.raises(TypeError, match="needs the option"):
        client.forward_backward(TrainBatch.from_sequences([[1]], [[3]], sampler_logprobs=[[-1.0]], advantages=[1.0]),
                                "tinker_dro")
    with pytest.raises(TypeError, match="batch: expected covrl.api.TrainBatch"):
        client.forward_backward({"tokens": [1]}, "covariance")
    with pytest.raises(ValueError, match="AdamParams.learning_rate"):
        AdamParams(learning_rate=-1)
    with pytest.raises(ValueError, match="AdamParams.beta2"):
        AdamParams(beta2=1.0)
    s = client.save_weights_and_get_sampling_client()
    with pytest.raises(ValueError, match="num_samples"):
        s.sample([1, 2], 0)
    with pytest.raises(ValueError, match="sampling_params.max_tokens"):
        s.sample([1, 2], 1, SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="sampling_params.stop"):
        s.sample([1, 2], 1, SamplingParams(stop=[1.5]))
    with pytest.raises(ValueError, match="name: a plain folder name"):
        client.save_state("../x")
