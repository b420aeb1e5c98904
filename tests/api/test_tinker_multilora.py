"""One base model, many LoRA adapters (covrl.api.multilora): the LoRA training clients of one base model share
its weights in memory, and each client's losses, gradients, log-probs and samples are bit for bit those of the
same client built alone with a model of its own (`ServiceClient(share_base=False)`, the route every client took
before the base was shared), also when the clients' calls interleave. Full fine-tunes keep their own copy."""

from __future__ import annotations

import gc

import pytest
import torch
from api_helpers import SMALL

import covrl.api.tinker as facade
from covrl.api.tinker import types

PROMPT = [11, 12, 13, 14]


def _datum(tokens: list[int], adv: float) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "logprobs": [0.0] * 3 + [-1.3] * (n - 3),
        "advantages": [0.0] * 3 + [adv] * (n - 3)})


def _params(client: facade.TrainingClient) -> list[torch.Tensor]:
    return [p.detach().clone() for p in client.api.params]


def _step(client: facade.TrainingClient, i: int, k: int) -> dict:
    """One RL-like step of client `k` at step `i`: sample at a seed, score, forward_backward, optim_step."""
    sampling = client.save_weights_and_get_sampling_client()
    out = sampling.sample(types.ModelInput.from_ints(PROMPT), num_samples=3,
                          sampling_params=types.SamplingParams(max_tokens=4, seed=100 * i + k)).result()
    seqs = [(list(s.tokens), list(s.logprobs)) for s in out.sequences]
    data = [_datum(PROMPT + t, adv=(-1.0) ** j * (j + 1)) for j, (t, _) in enumerate(seqs)]
    fb = client.forward_backward(data, loss_fn="importance_sampling").result()
    grads = [p.grad.detach().clone() for p in client.api.params]
    scores = sampling.compute_logprobs(types.ModelInput.from_ints(PROMPT + seqs[0][0])).result()
    opt = client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return {"samples": seqs, "scores": scores, "grads": grads, "metrics": fb.metrics, "grad_norm": opt.metrics,
            "outputs": [(o["logprobs"].tolist(), o["elementwise_loss"].tolist()) for o in fb.loss_fn_outputs]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("warmup_steps", [0, 3])
def test_lora_clients_share_the_base_and_match_clients_alone_bit_for_bit(tmp_path, warmup_steps):
    """Three LoRA clients (two ranks, two seeds: the two with seed 3 share one base) whose steps interleave,
    against each client alone in a ServiceClient of its own that builds its own model. warmup_steps=0: the
    adapters are drawn right after the model loader; 3: after a warm-up of the base."""
    overrides = {**SMALL, "sft_warmup.steps": warmup_steps, "sft_warmup.batch_size": 8}
    specs = [(4, 3), (8, 3), (4, 5)]   # (rank, seed)
    shared = facade.ServiceClient(config="tiny", overrides=overrides, state_dir=str(tmp_path / "shared"))
    clients = [shared.create_lora_training_client("tiny", rank=r, seed=s) for r, s in specs]
    assert len(shared._bases) == 2    # one base per seed: seed 3's two clients share theirs
    base = {id(p) for p in clients[0].api.model.get_base_model().parameters() if not p.requires_grad}
    assert base == {id(p) for p in clients[1].api.model.get_base_model().parameters() if not p.requires_grad}
    assert not base & {id(p) for p in clients[2].api.model.parameters()}
    frozen = [p.detach().clone() for p in clients[0].api.model.get_base_model().parameters() if not p.requires_grad]

    together = {k: [] for k in range(len(specs))}
    for i in range(2):                 # interleaved: 0, 1, 2, 0, 1, 2
        for k, c in enumerate(clients):
            together[k].append(_step(c, i, k))
    for k, (r, s) in enumerate(specs):
        alone_service = facade.ServiceClient(config="tiny", overrides=overrides, share_base=False,
                                             state_dir=str(tmp_path / f"alone{k}"))
        alone = alone_service.create_lora_training_client("tiny", rank=r, seed=s)
        assert len(alone_service._bases) == 0
        steps = [_step(alone, i, k) for i in range(2)]
        assert _same(_params(alone), _params(clients[k])), f"client {k}: final adapters differ"
        for i in range(2):
            for what in steps[i]:
                assert _same(steps[i][what], together[k][i][what]), f"client {k}, step {i}: {what} differ"
    # training the adapters left the shared base weights untouched
    now = [p for p in clients[0].api.model.get_base_model().parameters() if not p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(frozen, now))


def test_full_fine_tunes_keep_their_own_copy_and_a_base_is_freed_with_its_last_client(tmp_path):
    service = facade.ServiceClient(config="tiny", overrides=SMALL, state_dir=str(tmp_path))
    full = [service.create_training_client("tiny", seed=3) for _ in range(2)]
    a, b = (dict(c.api.model.named_parameters()) for c in full)
    assert all(a[n].data_ptr() != b[n].data_ptr() for n in a) and len(service._bases) == 0
    lora = [service.create_lora_training_client("tiny", rank=4, seed=3) for _ in range(2)]
    ptrs = [{p.data_ptr() for p in c.api.model.parameters() if not p.requires_grad} for c in lora]
    assert ptrs[0] == ptrs[1] and not ptrs[0] & {p.data_ptr() for p in a.values()}
    assert len(service._bases) == 1
    for c in lora:
        service.forget(c)
    del lora, c
    gc.collect()
    assert len(service._bases) == 0   # the last client gone: the base is freed


def _loader_rng_untouched(source: str, path: str | None = None) -> bool:
    from covrl.models import ModelConfig
    from covrl.models.loading import MODEL_SOURCES

    with torch.random.fork_rng():
        torch.manual_seed(7)
        fresh = torch.get_rng_state()
        MODEL_SOURCES[source](ModelConfig(source=source, path=path), 7)
        return torch.equal(torch.get_rng_state(), fresh)


def test_model_loaders_leave_the_global_rng_alone(tmp_path):
    """A shared base draws each client's adapters from manual_seed(seed), where load_model draws them right
    after the loader: the same draws only while no loader consumes the global RNG."""
    from test_tinker_server import word_model

    assert _loader_rng_untouched("tiny")
    assert _loader_rng_untouched("hf", str(word_model(tmp_path / "word")))


@pytest.mark.slow
def test_smollm2_loader_leaves_the_global_rng_alone():   # about 30 s: the GGUF is converted on each load
    pytest.importorskip("gguf")
    assert _loader_rng_untouched("smollm2")
