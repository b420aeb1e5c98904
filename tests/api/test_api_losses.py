"""Each loss through TrainingClient.forward_backward equals its covrl.math function (or Tinker's documented
formula) on the same inputs: the loss value and the accumulated gradient."""

from __future__ import annotations

import pytest
import torch
from api_helpers import SMALL, make_batch

from covrl.api import API_LOSSES, MATH_LOSSES, TINKER_LOSSES
from covrl.math import LOSS_SPECS, policy_loss


def grads(client):
    return torch.cat([p.grad.reshape(-1) for p in client.params]).clone()


def reference(client, batch, fn):
    """loss = fn(logprobs with grad), backward, gradient; the client's forward on the same (trimmed) rows."""
    client.zero_grad()
    fwd = client._forward(batch.select(torch.arange(len(batch))))
    loss = fn(fwd.logprobs)
    loss.backward()
    return float(loss.detach()), grads(client)


def test_every_math_loss_is_registered():
    assert set(MATH_LOSSES) == set(LOSS_SPECS)
    assert {"cross_entropy", "importance_sampling", "ppo", "tinker_cispo", "tinker_gspo",
            "tinker_dro"} == set(TINKER_LOSSES)


@pytest.mark.parametrize("name", sorted(LOSS_SPECS))
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum"])
def test_math_loss_equals_policy_loss(client, name, agg_mode):
    batch = make_batch(client)
    client.micro_batch_size = None
    ref_loss, ref_grad = reference(client, batch, lambda lp: policy_loss(
        name, logprobs=lp, sampler_logprobs=batch.sampler_logprobs, advantages=batch.advantages,
        mask=batch.response_mask, agg_mode=agg_mode).loss)
    client.zero_grad()
    r = client.forward_backward(batch, name, agg_mode=agg_mode)
    assert r.loss == ref_loss, (name, r.loss, ref_loss)
    assert torch.equal(grads(client), ref_grad), name
    assert "mismatch/k3" in r.metrics and r.metrics["mismatch/k3"] > 0   # the sampler log-probs were moved


def test_math_loss_options_and_micro_batches(client):
    batch = make_batch(client)
    opts = {"clip_low": 0.1, "clip_high": 0.1, "dual_clip": None}
    ref_loss, ref_grad = reference(client, batch, lambda lp: policy_loss(
        "ppo_clip", logprobs=lp, sampler_logprobs=batch.sampler_logprobs, advantages=batch.advantages,
        mask=batch.response_mask, **opts).loss)
    client.zero_grad()
    client.micro_batch_size = 5          # uneven chunks: the aggregate is over the whole call
    r = client.forward_backward(batch, "ppo_clip", loss_options=opts)
    assert abs(r.loss - ref_loss) <= 1e-6 * max(1, abs(ref_loss))
    assert torch.allclose(grads(client), ref_grad, rtol=1e-5, atol=1e-7)


def tinker_formula(name, lp, q, adv, w, options):
    ratio = torch.exp(lp - q)
    if name == "cross_entropy":
        return -(lp * w).sum()
    if name == "importance_sampling":
        return -(ratio * adv * w).sum()
    lo, hi = options.get("clip_low_threshold", 0.8), options.get("clip_high_threshold", 1.2)
    if name == "ppo":
        return -(torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv) * w).sum()
    if name == "tinker_cispo":   # Tinker's one-sided default (0.0, 4.0)
        lo, hi = options.get("clip_low_threshold", 0.0), options.get("clip_high_threshold", 4.0)
        return -(ratio.clamp(lo, hi).detach() * lp * adv * w).sum()
    if name == "tinker_gspo":
        seq = ((lp.detach() - q) * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)
        s = torch.exp(seq + lp - lp.detach())
        return -(torch.minimum(s * adv, s.clamp(lo, hi) * adv) * w).sum()
    if name == "tinker_dro":
        return -((lp * adv - 0.5 * options["beta"] * (lp - q) ** 2) * w).sum()
    raise AssertionError(name)


@pytest.mark.parametrize("name,options", [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
                                          ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
                                          ("tinker_cispo", {}), ("tinker_gspo", {}), ("tinker_dro", {"beta": 0.5})])
def test_tinker_loss_equals_formula(client, name, options):
    batch = make_batch(client, seed=1)
    client.micro_batch_size = None
    w = batch.response_mask
    ref_loss, ref_grad = reference(client, batch, lambda lp: tinker_formula(
        name, lp.float(), batch.sampler_logprobs, batch.advantages, w, options))
    client.zero_grad()
    r = client.forward_backward(batch, name, loss_options=options)
    assert abs(r.loss - ref_loss) <= 1e-5 * max(1, abs(ref_loss)), (name, r.loss, ref_loss)
    assert torch.allclose(grads(client), ref_grad, rtol=1e-5, atol=1e-6), name
    assert r.metrics["loss:sum"] == r.loss


def test_gradients_accumulate(client):
    batch = make_batch(client)
    client.forward_backward(batch, "covariance")
    once = grads(client)
    client.forward_backward(batch, "covariance")
    assert torch.allclose(grads(client), 2 * once)


def test_custom_loss(client):
    batch = make_batch(client)
    ref_loss, ref_grad = reference(client, batch, lambda lp: (lp.float() ** 2 * batch.response_mask).sum())
    client.zero_grad()
    r = client.forward_backward_custom(batch, lambda b, lp: ((lp ** 2 * b.response_mask).sum(), {"x": 1.0}))
    assert r.loss == ref_loss and r.metrics["x"] == 1.0
    assert torch.equal(grads(client), ref_grad)


def test_correction_weights_reach_the_loss(client):
    batch = make_batch(client)
    r = client.forward_backward(batch, "covariance", correction={"is_level": "token", "is_threshold": 1.5})
    assert r.metrics["correction/weight_max"] <= 1.5 and r.metrics["correction/is_changed_frac"] > 0
    assert set(API_LOSSES) >= set(MATH_LOSSES)


@pytest.mark.parametrize("mode", ["replay", "full"])
def test_forward_replays_a_truncating_samplers_kept_sets(tmp_path, mode):
    """With sampler.top_k the client's forward scores the drawn tokens on the sampler's kept sets (replay): at
    equal weights the log-probs are the sampler's, ratio 1; the full softmax is lower by log S_t < 0."""
    from covrl.api import TrainBatch, TrainingClient

    client = TrainingClient.from_config("tiny", {**SMALL, "sampler.top_k": 4, "trainer.truncation": mode},
                                        state_dir=tmp_path)
    sampling = client.save_weights_and_get_sampling_client()
    examples, _ = client.stream.take(2)
    out = sampling.sample([client.task.encode(client.tokenizer, ex) for ex in examples], 3)
    batch = TrainBatch.from_rollouts(out.batch)
    assert batch.sampler_kept is not None and int(batch.sampler_kept.max()) <= 4
    lp = client.forward(batch).logprobs
    mask = batch.response_mask > 0
    gap = (lp - batch.sampler_logprobs)[mask]
    if mode == "replay":
        assert gap.abs().max() < 1e-4
    else:
        assert gap.max() < 0 and gap.mean() < -1e-2


def test_a_per_call_truncation_the_trainer_does_not_replay_warns_once(tmp_path):
    """Sampling with top_p per call while the training client scores the full softmax warns (once per rule);
    sampling with the rule the client replays does not."""
    import warnings

    from covrl.api import SamplingParams, TrainingClient

    client = TrainingClient.from_config("tiny", {**SMALL, "sampler.top_k": 4}, state_dir=tmp_path)
    sampling = client.save_weights_and_get_sampling_client()
    examples, _ = client.stream.take(1)
    prompt = client.task.encode(client.tokenizer, examples[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampling.sample(prompt, 2)                                        # the replayed rule: quiet
        sampling.sample(prompt, 2, SamplingParams(top_p=0.9))             # another rule: warns
        sampling.sample(prompt, 2, SamplingParams(top_p=0.9))             # the same again: quiet
    texts = [str(w.message) for w in caught if "kept mass" in str(w.message)]
    assert len(texts) == 1 and "top_p=0.9" in texts[0] and "replays" in texts[0]
