"""The Tinker facade: a cookbook-style loop runs 2 steps (with covrl's copies of Tinker's types, and with the
SDK's own `tinker.types` objects when the package is importable), its names match the SDK's, and bad Datums
raise errors naming the field."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
import torch
from api_helpers import SMALL, tinker_sdk

import covrl.api.tinker as facade

ROOT = Path(__file__).resolve().parents[2]
SDK = tinker_sdk()


def rl_steps(service_client, T, steps=2, loss_fn="importance_sampling"):
    """sample groups -> centred rewards -> Datums -> forward_backward -> optim_step, Tinker's calls only."""
    training_client = service_client.create_lora_training_client(base_model="tiny", rank=8)
    tokenizer = training_client.get_tokenizer()
    task = training_client.api.task
    params = T.SamplingParams(max_tokens=4, temperature=1.0)
    out = []
    for step in range(steps):
        sampling_client = training_client.save_weights_and_get_sampling_client(name=f"{step:06d}")
        datums = []
        for ex in task.train[step * 4: step * 4 + 4]:
            prompt = task.encode(tokenizer, ex)
            res = sampling_client.sample(prompt=T.ModelInput.from_ints(prompt), num_samples=4,
                                         sampling_params=params).result()
            rewards = [float(i % 2) for i in range(4)]    # a fixed contrast: the loop, not the task, is tested
            for seq, r in zip(res.sequences, rewards):
                tokens, ob = prompt + seq.tokens, len(prompt) - 1
                datums.append(T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                    "target_tokens": tokens[1:], "logprobs": [0.0] * ob + list(seq.logprobs),
                    "advantages": [0.0] * ob + [r - 0.5] * len(seq.tokens)}))
        fb = training_client.forward_backward(datums, loss_fn=loss_fn).result()
        opt = training_client.optim_step(T.AdamParams(learning_rate=1e-3)).result()
        assert len(fb.loss_fn_outputs) == len(datums)
        assert len(fb.loss_fn_outputs[0]["logprobs"].tolist()) == datums[0].model_input.length
        out.append({**fb.metrics, **opt.metrics})
    return training_client, out


def test_cookbook_loop_runs_two_steps(tmp_path):
    service = facade.ServiceClient(config="tiny", overrides=SMALL, state_dir=str(tmp_path))
    client, metrics = rl_steps(service, facade.types)
    assert client.api.version == 2
    for m in metrics:
        assert m["skipped"] == 0.0 and m["grad_norm"] > 0 and "mismatch/k3" in m and "loss:sum" in m
        assert m["mismatch/k3"] < 1e-6      # the sampler shares the trainer's weights: on-policy
    path = client.save_state("after-2").result().path
    client.load_state_with_optimizer(path).result()
    assert client.api.version == 2


def test_sampling_an_old_lora_snapshot(tmp_path):
    """save_weights_for_sampler -> two more steps -> create_sampling_client(path) samples the old adapters."""
    service = facade.ServiceClient(config="tiny", overrides=SMALL, state_dir=str(tmp_path))
    client, _ = rl_steps(service, facade.types, steps=1)
    path = client.save_weights_for_sampler("after-1").result().path
    assert path == "covrl://sampler/after-1@1"
    prompt = facade.ModelInput.from_ints(client.api.task.encode(client.get_tokenizer(), client.api.task.train[0]))
    params = facade.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    then = client.save_weights_and_get_sampling_client().sample(prompt, 6, params).result().sequences
    for _ in range(2):
        client.forward_backward(rl_datums(client, prompt), "importance_sampling").result()
        client.optim_step(facade.AdamParams(learning_rate=1e-2)).result()
    now = client.save_weights_and_get_sampling_client().sample(prompt, 6, params).result().sequences
    old = client.create_sampling_client(path).sample(prompt, 6, params).result().sequences
    assert [s.tokens for s in old] == [s.tokens for s in then]
    assert [s.logprobs for s in old] == [s.logprobs for s in then]
    assert [s.logprobs for s in now] != [s.logprobs for s in then]
    with pytest.raises(ValueError, match="no snapshot 'missing'"):
        client.create_sampling_client("covrl://sampler/missing@0")


def rl_datums(client, prompt):
    res = client.save_weights_and_get_sampling_client().sample(
        prompt, 4, facade.SamplingParams(max_tokens=4, temperature=1.0)).result()
    tokens, ob = prompt.to_ints(), prompt.length - 1
    return [facade.Datum(model_input=facade.ModelInput.from_ints((tokens + s.tokens)[:-1]), loss_fn_inputs={
        "target_tokens": (tokens + s.tokens)[1:], "logprobs": [0.0] * ob + list(s.logprobs),
        "advantages": [0.0] * ob + [float(i % 2) - 0.5] * len(s.tokens)}) for i, s in enumerate(res.sequences)]


@pytest.mark.skipif(SDK is None, reason="the tinker SDK is not importable (set COVRL_TINKER_SITE)")
def test_cookbook_loop_with_the_sdks_own_types(tmp_path):
    from tinker import types as sdk_types

    service = facade.ServiceClient(config="tiny", overrides=SMALL, state_dir=str(tmp_path))
    client, metrics = rl_steps(service, sdk_types)
    assert client.api.version == 2 and all(m["grad_norm"] > 0 for m in metrics)


@pytest.mark.skipif(SDK is None, reason="the tinker SDK is not importable (set COVRL_TINKER_SITE)")
def test_names_match_the_sdk():
    covered = {
        "ServiceClient": ["create_lora_training_client"],
        "TrainingClient": ["forward", "forward_backward", "forward_backward_custom", "optim_step", "save_state",
                           "load_state", "load_state_with_optimizer", "save_weights_and_get_sampling_client",
                           "save_weights_for_sampler", "create_sampling_client", "get_tokenizer"],
        "SamplingClient": ["sample", "compute_logprobs", "get_tokenizer"],
    }
    for cls, methods in covered.items():
        for name in methods:
            for variant in (name, f"{name}_async"):
                if not hasattr(getattr(SDK, cls), variant):
                    continue
                mine = getattr(getattr(facade, cls), variant)
                sdk_params = [p for p in inspect.signature(getattr(getattr(SDK, cls), variant)).parameters
                              if p != "self"]
                ours = inspect.signature(mine).parameters
                if "args" in ours:          # the *_async wrappers forward everything
                    continue
                first = [p for p in sdk_params if inspect.signature(getattr(getattr(SDK, cls), variant))
                         .parameters[p].default is inspect.Parameter.empty]
                assert all(p in ours for p in first), (cls, variant, first, list(ours))
    for field in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        assert getattr(SDK.AdamParams(), field) == getattr(facade.AdamParams(), field), field
    for field in ("max_tokens", "seed", "stop", "temperature", "top_k", "top_p"):
        assert hasattr(facade.SamplingParams(), field) and field in SDK.SamplingParams.model_fields


def test_the_example_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("tinker_rl_loop", ROOT / "examples" / "tinker_rl_loop.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["tinker_rl_loop"] = module
    spec.loader.exec_module(module)
    r = module.main(steps=2, batch_size=4, group_size=4, overrides={**SMALL, "sft_warmup.steps": 10,
                                                                    "run.output_dir": str(tmp_path)},
                    log=lambda *_: None)
    assert len(r["history"]) == 2


# ------------------------------------------------------------------------------------------- bad inputs

def datum(tokens, **inputs):
    return facade.Datum(model_input=facade.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


@pytest.mark.parametrize("data,loss,match", [
    ([datum([1, 2, 3], advantages=[0.0, 1.0, 2.0], logprobs=[0.0, -1.0])], "importance_sampling",
     r"data\[0\].loss_fn_inputs\['advantages'\]: 3 values but model_input has 2"),
    ([datum([1, 2, 3], advantages=[0.0, 1.0])], "importance_sampling",
     r"loss_fn_inputs\['logprobs'\]: missing \(required by loss_fn 'importance_sampling'\)"),
    ([facade.Datum(model_input=facade.ModelInput.from_ints([1, 2]), loss_fn_inputs={})], "cross_entropy",
     r"data\[0\].loss_fn_inputs\['target_tokens'\]: missing"),
    ([facade.Datum(model_input=facade.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [5, 6]})],
     "cross_entropy", r"target_tokens'\]\[0\] = 5 but model_input\[1\] = 2"),
    ([datum([1, 2, 3], weights=[1.0, 1.0]), datum([1, 2, 3])], "cross_entropy",
     r"data\[1\].loss_fn_inputs\['weights'\]: missing"),
    ([datum([1, 2, 3], mask=[1.0, 1.0])], "cross_entropy", r"loss_fn_inputs\['mask'\]: not supported"),
    ([datum([1, 2, 3])], "nope", "loss_fn: unknown loss 'nope'"),
    ([], "cross_entropy", "data: a non-empty list"),
])
def test_bad_datums_name_the_field(tmp_path, data, loss, match):
    service = facade.ServiceClient(config="tiny", overrides=SMALL, state_dir=str(tmp_path))
    client = service.create_training_client(base_model="tiny")
    with pytest.raises(ValueError, match=match):
        client.forward_backward(data, loss_fn=loss)


def test_cross_entropy_matches_summed_logprobs(tmp_path):
    service = facade.ServiceClient(config="tiny", overrides=SMALL, state_dir=str(tmp_path))
    client = service.create_training_client(base_model="tiny")
    tokens = [3, 5, 7, 9, 4]
    fb = client.forward_backward([datum(tokens, weights=[0.0, 1.0, 1.0, 1.0])], "cross_entropy").result()
    lp = torch.tensor(fb.loss_fn_outputs[0]["logprobs"].tolist())
    assert abs(fb.metrics["loss:sum"] + float(lp[1:].sum())) < 1e-5
    logprobs = client.save_weights_and_get_sampling_client().compute_logprobs(
        facade.ModelInput.from_ints(tokens)).result()
    assert logprobs[0] is None and torch.allclose(torch.tensor(logprobs[1:]), lp, atol=1e-6)


def test_on_policy_distillation_the_cookbook_way(tmp_path):
    """tinker-cookbook's on-policy distillation with the facade's calls only: a teacher sampling client from
    `ServiceClient.create_sampling_client(model_path=...)`, its `compute_logprobs` on the student's sampled
    sequences, advantages = −(log p_student − log p_teacher) per sampled token, `importance_sampling`. The
    teacher is the tiny model fine-tuned on the task's answers; the student's reverse KL to it falls."""
    T = facade.types
    service = facade.ServiceClient(config="tiny", overrides=SMALL, state_dir=str(tmp_path))
    teacher_trainer = service.create_training_client(base_model="tiny")
    tokenizer, task = teacher_trainer.get_tokenizer(), teacher_trainer.api.task
    for step in range(6):                      # supervised: the teacher learns the task's answers
        datums = []
        for i in range(8):
            ex = task.train[(step * 8 + i) % len(task.train)]
            prompt = task.encode(tokenizer, ex)
            answer = task.encode_answer(tokenizer, ex)
            tokens = prompt + answer
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
            datums.append(T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]),
                                  loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
        teacher_trainer.forward_backward(datums, "cross_entropy").result()
        teacher_trainer.optim_step(T.AdamParams(learning_rate=3e-3)).result()
    path = teacher_trainer.save_weights_for_sampler("teacher").result().path
    teacher = service.create_sampling_client(model_path=path)
    with pytest.raises(ValueError, match="no training client"):
        service.create_sampling_client(model_path="covrl://sampler/nobody@3")

    student = service.create_training_client(base_model="tiny")
    params = T.SamplingParams(max_tokens=6, temperature=1.0)
    kls = []
    for step in range(12):
        sampler = student.save_weights_and_get_sampling_client(name=f"s{step}")
        datums, diffs = [], []
        for i in range(4):
            prompt = task.encode(tokenizer, task.train[(step * 4 + i) % len(task.train)])
            for seq in sampler.sample(T.ModelInput.from_ints(prompt), 4, params).result().sequences:
                tokens, ob = prompt + seq.tokens, len(prompt) - 1
                teacher_lp = teacher.compute_logprobs(T.ModelInput.from_ints(tokens)).result()[1:]
                reverse_kl = [s - t for s, t in zip(seq.logprobs, teacher_lp[ob:])]
                diffs += reverse_kl
                datums.append(T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                    "target_tokens": tokens[1:], "logprobs": [0.0] * ob + list(seq.logprobs),
                    "advantages": [0.0] * ob + [-d for d in reverse_kl]}))
        student.forward_backward(datums, "importance_sampling").result()
        student.optim_step(T.AdamParams(learning_rate=3e-3)).result()
        kls.append(sum(diffs) / len(diffs))
    first, last = sum(kls[:3]) / 3, sum(kls[-3:]) / 3
    print("reverse KL per token, by step:", [round(k, 3) for k in kls])
    assert first > 0.1, kls                    # the teacher differs from the student at the start
    assert last < 0.5 * first, kls             # and the student's reverse KL to it falls


def test_weightless_targets_are_ignored_as_tinker_ignores_them(tmp_path):
    """The cookbook's RL datums put target 0 on the prompt positions (advantage 0, log-prob 0), its SL datums
    weight 0 there: both give exactly the loss and gradients of the same datums with the true targets; a wrong
    target with a weight is still refused."""
    service = facade.ServiceClient(config="tiny", overrides=SMALL, state_dir=str(tmp_path))
    client = service.create_lora_training_client(base_model="tiny", rank=8)
    prompt, answer = [5, 6, 7, 8], [9, 10, 2]
    tokens, ob = prompt + answer, len(prompt) - 1

    def run(targets, inputs, loss):
        datum = facade.Datum(model_input=facade.ModelInput.from_ints(tokens[:-1]),
                             loss_fn_inputs={"target_tokens": targets, **inputs})
        out = client.forward_backward([datum], loss).result()
        grads = [p.grad.clone() for p in client.api.params]
        for p in client.api.params:
            p.grad = None
        return out.metrics["loss:sum"], grads

    rl = {"logprobs": [0.0] * ob + [-1.0, -1.2, -0.7], "advantages": [0.0] * ob + [0.5] * 3}
    true, zeroed = tokens[1:], [0] * ob + tokens[len(prompt):]
    for inputs, loss in ((rl, "importance_sampling"), ({"weights": [0.0] * ob + [1.0] * 3}, "cross_entropy")):
        a, b = run(true, inputs, loss), run(zeroed, inputs, loss)
        assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    with pytest.raises(ValueError, match=r"target_tokens'\]\[3\] = 0 but model_input\[4\] = 9"):
        run(true[:3] + [0] + true[4:], rl, "importance_sampling")


def test_a_client_from_a_saved_state_takes_the_same_next_step(tmp_path):
    """create_training_client_from_state_with_optimizer (the recipes' resume): the rebuilt client's next step
    equals the original's bit for bit; without the optimizer the weights match but the step differs; each
    client writes into a folder of its own."""
    service = facade.ServiceClient(config="tiny", overrides=SMALL, state_dir=str(tmp_path))
    client, _ = rl_steps(service, facade.types)
    path = client.save_state("after-2").result().path
    again = service.create_training_client_from_state_with_optimizer(path)
    weights_only = service.create_training_client_from_state(path)
    folders = {c.api.state_dir for c in (client, again, weights_only)}
    assert len(folders) == 3 and all(f.parent == tmp_path for f in folders)
    assert again.api.version == client.api.version == 2
    prompt = facade.ModelInput.from_ints(client.api.task.encode(client.get_tokenizer(), client.api.task.train[0]))
    datums = rl_datums(client, prompt)
    before, after = [p.detach().clone() for p in client.api.params], []
    for c in (client, again, weights_only):
        assert all(torch.equal(p, q) for p, q in zip(c.api.params, before))
        c.forward_backward(datums, "importance_sampling").result()
        c.optim_step(facade.AdamParams(learning_rate=1e-3)).result()
        after.append([p.detach().clone() for p in c.api.params])
    assert all(torch.equal(a, b) for a, b in zip(after[0], after[1]))
    assert not all(torch.equal(a, b) for a, b in zip(after[0], after[2]))
    with pytest.raises(ValueError, match="not a state a training client of the facade saved"):
        service.create_training_client_from_state(str(tmp_path / "nowhere"))


RECIPE = '''
import sys
import tinker
from tinker import types
from tinker.types.tensor_data import TensorData

assert tinker.ModelInputChunk and tinker.StopReason and issubclass(tinker.TinkerError, Exception)
assert types.ImageChunk and types.ImageAssetPointerChunk and TensorData is types.TensorData
service = tinker.ServiceClient(config="tiny", overrides={"sft_warmup.steps": 0, "task.n_train": 8,
                                                         "run.num_threads": 1}, state_dir=sys.argv[1])
client = service.create_lora_training_client(base_model="tiny", rank=8)
prompt = types.ModelInput.from_ints([5, 6, 7])
seqs = client.save_weights_and_get_sampling_client().sample(
    prompt, 2, types.SamplingParams(max_tokens=3)).result().sequences
tokens = prompt.to_ints() + seqs[0].tokens
datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
    "target_tokens": TensorData.from_numpy(__import__("numpy").array(tokens[1:])),
    "weights": [0.0, 0.0] + [1.0] * len(seqs[0].tokens)})
client.forward_backward([datum], "cross_entropy").result()
client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
try:
    types.ModelInput([types.ImageChunk(data=b"", format="png")]).to_ints()
except ValueError as err:
    print("refused:", err)
print("version", client.api.version)
'''


def test_a_recipe_written_for_the_sdk_runs_unchanged_through_the_alias(tmp_path):
    """`python -m covrl.api.tinker RECIPE.py`: `import tinker`, `tinker.types`, `tinker.types.tensor_data` and the
    names the cookbook imports resolve to the facade; image chunks are refused with a reason."""
    import subprocess

    script = tmp_path / "recipe.py"
    script.write_text(RECIPE)
    proc = subprocess.run([sys.executable, "-m", "covrl.api.tinker", str(script), str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: model_input: image chunks are not supported" in proc.stdout and "version 1" in proc.stdout


def test_string_stops_of_the_cookbooks_renderers_are_honoured(tmp_path):
    service = facade.ServiceClient(config="tiny", overrides=SMALL, state_dir=str(tmp_path))
    client = service.create_lora_training_client(base_model="tiny", rank=8)
    prompt = facade.ModelInput.from_ints(client.api.task.encode(client.get_tokenizer(), client.api.task.train[0]))
    sampler = client.save_weights_and_get_sampling_client()
    free = sampler.sample(prompt, 8, facade.SamplingParams(max_tokens=12, seed=0)).result().sequences
    tok = client.get_tokenizer()
    texts = [tok.decode(s.tokens, skip_special_tokens=True) for s in free]
    stop = max(sorted(set("".join(texts)) - {" ", "\n"}), key=lambda c: sum(c in t for t in texts))
    cut = sampler.sample(prompt, 8, facade.SamplingParams(max_tokens=12, seed=0, stop=["\n\nUser:", stop])
                         ).result().sequences
    ended = [s for s in cut if stop in tok.decode(s.tokens, skip_special_tokens=True)]
    assert ended and all(s.stop_reason == "stop" for s in ended)


def test_the_config_follows_the_model_unless_one_is_named(monkeypatch):
    """A recipe's own `ServiceClient(base_url=...)`: tiny gets the tiny preset, SmolLM2 the default SmolLM2 run
    (not the tiny preset's warm-up); COVRL_TINKER_CONFIG or config= names one for every model."""
    from covrl.config import load_preset

    monkeypatch.delenv("COVRL_TINKER_CONFIG", raising=False)
    service = facade.ServiceClient(base_url="http://ignored")
    assert service.base_config("tiny") == load_preset("tiny")
    assert service.base_config("HuggingFaceTB/SmolLM2-135M-Instruct") == load_preset("default")
    monkeypatch.setenv("COVRL_TINKER_CONFIG", "tiny")
    assert facade.ServiceClient().base_config("smollm2") == load_preset("tiny")
