"""reach_bound against brute-force autograd, and its exact Cauchy–Schwarz property on the empirical batch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from covrl.diagnostics import reach_bound
from covrl.diagnostics.reach import as_sequences, select_params, sequence_logprobs

torch.set_num_threads(1)


def _model(seed=0):
    from covrl.models import tiny_llama

    return tiny_llama(12, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=16,
                      seed=seed).double()


def _batch(seed, B=6, P=3, R=3, V=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P + R), generator=gen)
    ids[:, 0] = 1
    sm = torch.zeros(B, P + R, dtype=torch.bool)
    sm[:, P:] = True
    return {"input_ids": ids, "score_mask": sm}, torch.randn(B, generator=gen, dtype=torch.float64)


MODEL = _model()


def _brute(model, batch, adv, y1, y2, center=True):
    params = [p for _, p in select_params(model)]
    lp1 = sequence_logprobs(model, as_sequences(y1))[0]
    lp2 = sequence_logprobs(model, as_sequences(y2))[0]
    d = torch.autograd.grad(lp1 - lp2, params)
    a = adv - adv.mean() if center else adv
    lp = sequence_logprobs(model, as_sequences(batch))
    g = torch.autograd.grad((a * lp).mean(), params)
    scores = []
    for b in range(len(adv)):
        row = {k: v[b] for k, v in batch.items()}
        s = torch.autograd.grad(sequence_logprobs(model, as_sequences((row["input_ids"], row["score_mask"])))[0], params)
        scores.append(sum(float((x * y).sum()) for x, y in zip(s, d)))
    return sum(float((x * y).sum()) for x, y in zip(d, g)), torch.tensor(scores, dtype=torch.float64)


@pytest.mark.parametrize("method", ["backward", "jvp"])
def test_rate_and_projections_match_brute_force(method):
    batch, adv = _batch(1)
    y1 = (batch["input_ids"][0], batch["score_mask"][0])
    y2 = (batch["input_ids"][3], batch["score_mask"][3])
    rb = reach_bound(MODEL, batch, adv, y1, y2, method=method)
    rate, proj = _brute(MODEL, batch, adv, y1, y2)
    assert rb.method == method
    # fp64 model, but HF's RMSNorm (and eager attention for the JVP) compute in fp32 internally
    assert rb.metrics["rate"] == pytest.approx(rate, rel=1e-5)
    assert torch.allclose(rb.projections, proj, rtol=1e-5, atol=1e-6)
    x, a = proj, adv - adv.mean()
    bound = float(a.pow(2).mean().sqrt() * (x - x.mean()).pow(2).mean().sqrt())
    assert rb.metrics["bound"] == pytest.approx(bound, rel=1e-5)


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10_000))
def test_cauchy_schwarz_holds_exactly_on_the_batch(seed):
    batch, adv = _batch(seed, B=5)
    gen = torch.Generator().manual_seed(seed + 1)
    i, j = torch.randperm(5, generator=gen)[:2].tolist()
    rb = reach_bound(MODEL, batch, adv, (batch["input_ids"][i], batch["score_mask"][i]),
                     (batch["input_ids"][j], batch["score_mask"][j]), method="backward")
    m = rb.metrics
    assert abs(m["rate"]) <= m["bound"] * (1 + 1e-12) + 1e-15
    assert -1 - 1e-12 <= m["ratio"] <= 1 + 1e-12


def test_uncentred_rate_is_covariance_plus_drift():
    batch, adv = _batch(2)
    adv = adv + 3.0  # far from centred
    y1 = (batch["input_ids"][0], batch["score_mask"][0])
    y2 = (batch["input_ids"][1], batch["score_mask"][1])
    rb = reach_bound(MODEL, batch, adv, y1, y2, center=False, method="backward")
    m = rb.metrics
    assert m["rate"] == pytest.approx(m["covariance"] + m["drift"], rel=1e-10)
    rate, _ = _brute(MODEL, batch, adv, y1, y2, center=False)
    assert m["rate"] == pytest.approx(rate, rel=1e-6)


def test_two_responses_bound_is_tight_by_enumeration():
    from torch import nn

    class Tab(nn.Module):
        def __init__(self):
            super().__init__()
            self.theta = nn.Parameter(torch.tensor([0.3, -0.8], dtype=torch.float64))

        def forward(self, input_ids, attention_mask=None):
            return self.theta.expand(*input_ids.shape, -1)

    model = Tab()
    batch = {"input_ids": torch.tensor([[0, 0], [0, 1]]), "score_mask": torch.tensor([[False, True], [False, True]])}
    probs = torch.softmax(model.theta.detach(), 0)
    rb = reach_bound(model, batch, torch.tensor([1.0, 0.0]), (torch.tensor([0, 0]), torch.tensor([False, True])),
                     (torch.tensor([0, 1]), torch.tensor([False, True])), weights=probs, method="backward")
    assert rb.metrics["ratio"] == pytest.approx(1.0, abs=1e-12)
    # hand value: rate = Cov(A, <d, s>) with d = e0 − e1: <d, s(y)> = ±1 − (π0 − π1) → rate = 2·π0·π1
    p0, p1 = probs.tolist()
    assert rb.metrics["rate"] == pytest.approx(2 * p0 * p1, rel=1e-12)


def test_rollout_batch_input_matches_dict():
    from covrl.rollout.types import RolloutBatch

    batch, adv = _batch(4, B=3, P=3, R=3)
    ids, sm = batch["input_ids"], batch["score_mask"]
    # left-pad the prompts by one token and right-pad the responses by one
    prompt_ids = torch.cat([torch.zeros(3, 1, dtype=torch.long), ids[:, :3]], 1)
    prompt_mask = torch.cat([torch.zeros(3, 1), torch.ones(3, 3)], 1)
    response_ids = torch.cat([ids[:, 3:], torch.zeros(3, 1, dtype=torch.long)], 1)
    response_mask = torch.cat([torch.ones(3, 3), torch.zeros(3, 1)], 1)
    rb = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                      response_mask=response_mask, sampler_logprobs=torch.zeros(3, 4), group_ids=torch.zeros(3),
                      policy_version=torch.zeros(3))
    seqs = as_sequences(rb)
    assert torch.equal(seqs.input_ids, ids) and torch.equal(seqs.score_mask, sm)


def test_errors():
    batch, adv = _batch(5)
    one = (batch["input_ids"][0], batch["score_mask"][0])
    with pytest.raises(ValueError, match="one sequence"):
        reach_bound(MODEL, batch, adv, batch, one)
    with pytest.raises(ValueError, match="advantages"):
        reach_bound(MODEL, batch, adv[:2], one, one)
    with pytest.raises(ValueError, match="method"):
        reach_bound(MODEL, batch, adv, one, one, method="magic")
    bad = {"input_ids": batch["input_ids"], "score_mask": torch.ones_like(batch["score_mask"])}
    with pytest.raises(ValueError, match="first token"):
        reach_bound(MODEL, bad, adv, one, one)
