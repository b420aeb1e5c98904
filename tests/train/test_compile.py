"""trainer.compile: the torch.compile'd forward+backward gives the eager step's log-probs, gradients and metrics
(within float rounding), compile time is reported apart, and one graph serves every micro-batch shape.

The default tests capture with the aot_eager backend (dynamo + AOTAutograd's joint forward/backward graph, eager
kernels: a few seconds); the inductor test (real generated kernels, a minute or more of compiling on a loaded
2-core machine) is slow."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from test_trainer import grads_of_step, make_model
from train_helpers import comparable, synthetic_batch, tiny_cfg

from covrl.models.compiled import compile_module
from covrl.train.parallel.wrappers import TrainerConfig
from covrl.train.run.driver import train_sync
from covrl.train.run.folder import prepare_run
from covrl.train.run.sinks import read_jsonl
from covrl.train.step.trainer import Trainer, forward_batch

# metrics compared between the eager and the compiled step (wall times and the compile time differ)
COMPARED = ("loss", "grad_norm", "loss/policy", "entropy", "kl/k3_mean")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()   # each test compiles its own model: no cache entries (or recompile limit) carried over
    yield
    torch._dynamo.reset()


def _cfg(backend: str, **over):
    return tiny_cfg(**{"trainer.compile": True, "trainer.compile_backend": backend, "optim.micro_batch_size": 4,
                       "optim.max_grad_norm": None, **over})


def _compare(eager, m_eager, compiled, m_comp):
    # eager kernels on a captured graph: only the order of a few reductions can differ
    for ga, gb in zip(eager, compiled):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)
    for key in COMPARED:
        if key in m_eager:
            assert m_comp[key] == pytest.approx(m_eager[key], rel=1e-4, abs=1e-6), key


# slow (~10-16 s): torch.compile of the step; tests/rollout/test_sampler_compile.py keeps a compiled path in the
# default suite
@pytest.mark.slow
def test_compiled_step_matches_eager_and_one_graph_serves_a_new_shape():
    batch = synthetic_batch(make_model(), groups=3, group_size=4)
    eager, m_eager = grads_of_step(tiny_cfg(**{"optim.micro_batch_size": 4, "optim.max_grad_norm": None,
                                               "optim.share_prompts": False}), batch, model=make_model())
    model = make_model()
    trainer = Trainer(model, _cfg("aot_eager"))
    captured = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **k: captured.append([p.grad.detach().clone() for p in trainer.params])
    m_comp = trainer.step(batch)
    _compare(eager, m_eager, captured[0], m_comp)
    assert m_comp["time/compile_s"] > 0.0          # the first step compiled, and says so
    assert "time/compile_s" not in m_eager
    trainer.optimizer.step = step
    again = trainer.step(synthetic_batch(model, groups=2, group_size=4, prompt_len=7, max_len=9, seed=1))
    assert again["time/compile_s"] == 0.0, "dynamic shapes: rows x length changed without a re-compile"
    assert again["skipped"] == 0.0 and again["policy_version"] == 2.0


@pytest.mark.slow
def test_compiled_step_matches_the_shared_prompt_eager_step():
    """The default eager step shares prompts through a KV cache; the compiled step runs the per-row pass."""
    batch = synthetic_batch(make_model(), groups=3, group_size=4)
    eager, m_eager = grads_of_step(tiny_cfg(**{"optim.micro_batch_size": 4, "optim.max_grad_norm": None}), batch,
                                   model=make_model())
    compiled, m_comp = grads_of_step(_cfg("aot_eager"), batch, model=make_model())
    _compare(eager, m_eager, compiled, m_comp)


def test_compile_refuses_a_distributed_trainer():
    with pytest.raises(ValidationError, match="trainer.compile=true runs with trainer.parallel=none"):
        TrainerConfig(compile=True, parallel="ddp")
    with pytest.raises(ValidationError, match="compile_backend"):
        TrainerConfig(compile=True, compile_backend="tvm")
    with pytest.raises(ValueError, match="trainer.compile_backend='tvm'"):
        compile_module(make_model(), "tvm")


@pytest.mark.slow
def test_inductor_logprobs_and_gradients_match_eager():
    """Generated C++ kernels (fused, reordered reductions): log-probs within 1e-4 and gradients within 1e-4
    relative of eager fp32 on the tiny model; measured 5e-7 and 1e-5 (docs/performance.md)."""
    model = make_model()
    batch = synthetic_batch(model, groups=3, group_size=4, shared_prompts=False)
    compiled = compile_module(model, "inductor")
    out = []
    for module in (model, compiled):
        model.zero_grad(set_to_none=True)
        lp = forward_batch(module, batch, 1.0, with_stats=False, share_prompts=False).logprobs
        (lp * batch.response_mask).sum().backward()
        out.append((lp.detach() * batch.response_mask, [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=1e-4)
    for ga, gb in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)


def _tiny_run(tmp_path, name, **over):
    run = prepare_run(tiny_cfg(tmp_path, **{"run.name": name, "eval.before": False, **over}), console=False)
    summary = train_sync(run)
    run.close()
    records = read_jsonl(tmp_path / name / "metrics.jsonl")
    assert summary["status"] == "completed" and [r["step"] for r in records] == [1, 2, 3]
    return records, comparable(records)


def test_sampler_compile_tiny_run_matches_the_eager_run(tmp_path):
    """sampler.compile end to end: the same rollouts (same seed), so the same metrics within float rounding;
    the compile is paid in step 1 and logged apart."""
    _, eager = _tiny_run(tmp_path, "eager-sampler")
    raw, compiled = _tiny_run(tmp_path, "compiled-sampler", **{"sampler.compile": True,
                                                                "sampler.compile_backend": "eager"})
    for a, b in zip(eager, compiled):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, float):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
            else:
                assert b[key] == value, key
    compile_s = [r["time/sampler_compile_s"] for r in raw]
    assert compile_s[0] > 0.0 and compile_s[1:] == [0.0, 0.0], compile_s
