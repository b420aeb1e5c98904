"""On-policy self-distillation (distill.teacher: self; SDFT / OPSD): the student samples from the plain prompt,
the model itself given a privileged prompt with the example's reference answer scores the same drawn tokens (no
grad; current or frozen initial weights), and minus the per-token reverse KL is the learning signal.

The teacher prompt follows the references: TRL's `SDFTTrainer` (huggingface/trl,
trl/experimental/sdft/sdft_trainer.py and sdft_config.py at f2cd57710ae345ea6428ae95363267fcf38a3dc8:
`teacher_prompt_template = "{prompt}\\n\\n{privileged_context}"` in the last user turn, `teacher_model_kind`
base | live | ema, teacher forward under `torch.no_grad()`), tinker-cookbook (thinking-machines-lab/tinker-cookbook,
tinker_cookbook/distillation/sdft.py at 9dfcc3a2cf44432d621a01005073dc6d76a1e87a: `DEFAULT_DEMO_TEMPLATE` as the
user message, a frozen base teacher, advantage = teacher_lp − student_lp in its `topk=0` mode) and prime-rl
(PrimeIntellect-ai/prime-rl, src/prime_rl/orchestrator/algo/opsd.py at 559b44772e471d1538537b8805cc77f3824a5e64:
the live policy scores hint_block + sample tokens, the demonstration in a leading system message).

Checked here: the teacher's log-probs equal a plain forward of the model on [privileged prompt | response] built
by hand (current and initial weights, padded and packed, and the chat-template prompt text); the plain prompt as
the template with current weights gives a signal of exactly zero; the config errors; a tiny end-to-end run logs
the distillation metrics and resumes exactly; packing on / off give the same step."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from train_helpers import TIME_KEYS, TIME_PREFIXES, comparable, tiny_cfg

from covrl.config import ConfigError
from covrl.models import char_tokenizer, frozen_copy, tiny_llama
from covrl.rollout.types import RolloutBatch, ScoredBatch
from covrl.rollout.vllm import vllm_available
from covrl.tasks import Example, build_task
from covrl.train import latest_checkpoint, prepare_run, read_jsonl, train_sync
from covrl.train.step.self_teacher import CHAT_TEMPLATE, SelfTeacher, SelfTeacherConfig
from covrl.train.step.trainer import Trainer

torch.set_num_threads(1)
QUIET = {"eval.before": False, "eval.after": False}
SELF = {"distill.teacher": "self", "algorithm.loss": "reinforce", "logging.noise_scale": False}


# ------------------------------------------------------------------------------------------------- helpers

def _parts(template=None, weights="current", temperature=0.7, packing=False, seed=0, micro_batch_size=4):
    """A Trainer with a self-teacher on the tiny model, the task's training examples and the tokenizer."""
    over = {**SELF, "distill.self_teacher.weights": weights, "sampler.temperature": temperature,
            "trainer.packing": packing, "optim.micro_batch_size": micro_batch_size}
    if template is not None:
        over["distill.self_teacher.template"] = json.dumps(template)   # quoted: YAML reads {prompt} as a mapping
    cfg = tiny_cfg(**over)
    tok = char_tokenizer()
    model = tiny_llama(len(tok), hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=64,
                       seed=seed)
    task = build_task(cfg.task)
    examples = task.train
    teacher = SelfTeacher(cfg.distill.self_teacher, task, tok, lambda p: examples[p % len(examples)])
    ref = frozen_copy(model) if weights == "initial" else None
    return Trainer(model, cfg, ref_model=ref, teacher=teacher), task, tok


def _batch(task, tok, positions, group_size=3, max_len=5, seed=0) -> ScoredBatch:
    """Rows answering the examples at stream `positions` (group_size each): the task's plain prompts, left-padded,
    and random responses of mixed lengths, right-padded."""
    g = torch.Generator().manual_seed(seed)
    prompts = [task.encode(tok, task.train[p % len(task.train)]) for p in positions for _ in range(group_size)]
    rows, width = len(prompts), max(len(p) for p in prompts)
    prompt_ids = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p):] = torch.tensor(p)
        prompt_mask[i, width - len(p):] = 1
    lengths = torch.randint(1, max_len + 1, (rows,), generator=g)
    lengths[0] = max_len
    response_mask = (torch.arange(max_len)[None] < lengths[:, None]).float()
    response_ids = torch.randint(4, len(tok), (rows, max_len), generator=g) * response_mask.long()
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, sampler_logprobs=-torch.rand(rows, max_len, generator=g)
                        * response_mask, group_ids=torch.arange(len(positions)).repeat_interleave(group_size),
                        policy_version=torch.zeros(rows, dtype=torch.long),
                        prompt_index=torch.tensor(positions).repeat_interleave(group_size)
                        ).scored(torch.randint(0, 2, (rows,), generator=g).float())


def _brute_force(model, tok, texts, batch, temperature):
    """log p(y_t | x⁺, y_<t) by one plain forward of each row's [privileged prompt | response], no padding."""
    out = torch.zeros(batch.response_ids.shape)
    with torch.no_grad():
        for i, text in enumerate(texts):
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            n = int(batch.response_mask[i].sum())
            response = batch.response_ids[i, :n].tolist()
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / temperature
            logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
            out[i, :n] = logp.gather(-1, torch.tensor(response)[:, None])[:, 0]
    return out


def _run(tmp_path, name, **over):
    cfg = tiny_cfg(tmp_path, **{"run.name": name, **QUIET, **SELF, **over})
    run = prepare_run(cfg, console=False)
    train_sync(run)
    run.close()
    return read_jsonl(tmp_path / name / "metrics.jsonl")


# --------------------------------------------------------------------------------- the teacher's log-probs

@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("weights", ["current", "initial"])
def test_the_teacher_logprobs_are_a_forward_on_the_privileged_prompt(weights, packing):
    """Against a hand-built [plain prompt + answer + newline + plain prompt | response] forward (the default
    template without a chat template), at the sampler's temperature; with initial weights the frozen copy scores,
    not the trained model (here perturbed after the copy)."""
    trainer, task, tok = _parts(weights=weights, packing=packing)
    if weights == "initial":
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    positions = [0, 5, 2, 70]   # 70: the second epoch of a 64-example list, the example at 6
    batch = _batch(task, tok, positions)
    texts = []
    for p in batch.prompt_index.tolist():
        ex = task.train[p % len(task.train)]
        texts.append(f"{ex.plain_prompt}{ex.answer}\n{ex.plain_prompt}")
    got = trainer._teacher_logprobs(batch, None) * batch.response_mask   # padding: not read
    scorer = trainer.ref_model if weights == "initial" else trainer.model
    want = _brute_force(scorer, tok, texts, batch, 0.7)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    other = trainer.model if weights == "initial" else None
    if other is not None:   # the trained weights would give other numbers
        assert not torch.allclose(_brute_force(other, tok, texts, batch, 0.7), want, atol=1e-3)


def test_the_chat_prompt_holds_the_question_the_answer_and_the_system_prompt():
    """With a chat template the template fills the user turn; the chat template and task.system_prompt wrap it
    exactly as they wrap the student's prompt."""
    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    cfg = tiny_cfg(**{"task.chat_template": True, "task.system_prompt": "Be brief."})
    task = build_task(cfg.task)
    ex = Example(prompt="Compute 3+4.", answer="7")
    teacher = SelfTeacher(SelfTeacherConfig(), task, tok, lambda p: ex)
    assert teacher.prompt_text(ex) == ("<system>Be brief.\n<user>Compute 3+4.\n\nThis is an example of a correct "
                                       "response:\n7\n\nNow answer with a response of your own.\n<assistant>")
    assert teacher.template == CHAT_TEMPLATE
    assert task.prompt_text(tok, ex) == "<system>Be brief.\n<user>Compute 3+4.\n<assistant>"
    own = SelfTeacher(SelfTeacherConfig(template="Answer: {answer}. {prompt}"), task, tok, lambda p: ex)
    assert own.prompt_text(ex) == "<system>Be brief.\n<user>Answer: 7. Compute 3+4.\n<assistant>"


def test_the_plain_prompt_as_template_with_current_weights_is_the_student_itself():
    """x⁺ = x and the current weights: the teacher's forward is the student's own, bit for bit (one chunk of the
    batch's shape: the same float operations)."""
    trainer, task, tok = _parts(template="{prompt}", weights="current", micro_batch_size=64)
    batch = _batch(task, tok, [1, 2, 3, 4])
    got = trainer._teacher_logprobs(batch, None)
    from covrl.train.step.micro_step import forward_batch

    with torch.no_grad():
        want = forward_batch(trainer.model, batch, 0.7, with_stats=False).logprobs
    mask = batch.response_mask
    assert torch.equal(got * mask, want * mask)


def test_the_plain_prompt_as_template_with_current_weights_gives_zero_signal(tmp_path):
    """End to end: the reverse KL is exactly 0 on every token, so is the gradient (reward_weight 0)."""
    records = _run(tmp_path, "zero", **{"distill.self_teacher.template": '"{prompt}"',
                                        "distill.self_teacher.weights": "current", "loop.steps": 2})
    assert len(records) == 2
    for r in records:
        assert r["distill/token_kl"] == 0.0 and r["distill/reverse_kl"] == 0.0
        assert r["grad_norm"] == 0.0 and r["loss"] == 0.0


# -------------------------------------------------------------------------------------------- config errors

@pytest.mark.parametrize(("over", "match"), [
    ({"distill.teacher": "self", "distill.engine": "vllm"}, "distill.engine=vllm serves a separate teacher"),
    ({"distill.self_teacher.weights": "current"}, "distill.self_teacher is read by distill.teacher=self only"),
    ({"distill.teacher": "self", "distill.self_teacher.template": '"{question} {answer}"'},
     r"distill.self_teacher.template reads \{question\}"),
    ({"distill.teacher": "self", "distill.self_teacher.template": '"{prompt"'}, "distill.self_teacher.template is not"),
    ({"distill.teacher": "self", "distill.self_teacher.template": "{prompt}"}, "quote it"),
    ({"distill.teacher": "self", "distill.self_teacher.weights": "latest"}, "distill.self_teacher.weights"),
    ({"distill.teacher": "itself"}, "distill.teacher"),
])
def test_config_errors_name_the_field(over, match):
    with pytest.raises(ConfigError, match=match):
        tiny_cfg(**over)


def test_a_task_without_reference_answers_is_refused(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": "" if i % 2 else str(i + 1)}) + "\n"
                            for i in range(10)))
    data = {"task.name": "jsonl", "task.path": str(path), "task.chat_template": False, "task.n_eval": 2,
            "sft_warmup.steps": 0}
    cfg = tiny_cfg(tmp_path, **{"run.name": "noanswer", **QUIET, **SELF, **data})
    missing = r"reads \{answer\}, but \d+ of \d+ training examples of task 'jsonl' .*task.answer_field='answer'"
    with pytest.raises(ConfigError, match=missing):
        prepare_run(cfg, console=False)
    # a template without {answer} (context distillation) reads no answer
    cfg = tiny_cfg(tmp_path, **{"run.name": "context", **QUIET, **SELF, **data, "loop.steps": 1,
                                "distill.self_teacher.template": "1+1=2\n{prompt}"})
    prepare_run(cfg, console=False).close()


def test_the_trainer_refuses_what_the_self_teacher_cannot_do():
    trainer, task, tok = _parts(weights="initial")
    with pytest.raises(ValueError, match="weights=initial scores with the frozen initial weights"):
        Trainer(trainer.model, trainer.cfg, teacher=trainer.teacher)
    ddp = trainer.cfg.model_copy(update={"trainer": trainer.cfg.trainer.model_copy(update={"parallel": "ddp"})})
    with pytest.raises(ValueError, match="distill.teacher=self runs with trainer.parallel=none"):
        Trainer(trainer.model, ddp, ref_model=trainer.ref_model, teacher=trainer.teacher)
    with pytest.raises(ValueError, match="no prompt_index"):
        trainer.teacher.privileged(replace(_batch(task, tok, [0]), prompt_index=None))


# ------------------------------------------------------------------------------------------ end to end

def test_a_tiny_run_logs_the_distillation_metrics_and_resumes_exactly(tmp_path):
    """Initial weights (the default): checkpoints/initial holds them, and a run stopped after 2 steps and resumed
    to 4 logs what the uninterrupted 4-step run logs."""
    over = {"checkpoint.every_rollouts": 32, "loop.steps": 4}
    full = _run(tmp_path, "full", **over)
    assert len(full) == 4
    for r in full:
        for key in ("distill/reverse_kl", "distill/token_kl", "distill/teacher_logprob", "time/teacher"):
            assert key in r and r[key] == r[key] and abs(r[key]) < 1e3, (key, r)
    assert any(r["distill/token_kl"] != 0 for r in full)
    assert (tmp_path / "full" / "checkpoints" / "initial" / "model").is_dir()

    cfg = tiny_cfg(tmp_path, **{"run.name": "part", **QUIET, **SELF, **over, "loop.steps": 2})
    run = prepare_run(cfg, console=False)
    train_sync(run)
    run.close()
    assert latest_checkpoint(tmp_path / "part") is not None
    cfg = tiny_cfg(tmp_path, **{"run.name": "part", **QUIET, **SELF, **over})
    run = prepare_run(cfg, console=False, resume=True)
    train_sync(run)
    run.close()
    assert comparable(read_jsonl(tmp_path / "part" / "metrics.jsonl")) == comparable(full)


def test_packing_on_and_off_give_the_same_step(tmp_path):
    padded = _run(tmp_path, "padded", **{"loop.steps": 2})
    packed = _run(tmp_path, "packed", **{"loop.steps": 2, "trainer.packing": True})
    assert len(padded) == 2 and padded[0]["distill/token_kl"] != 0
    for a, b in zip(padded, packed, strict=True):
        keys = [k for k in a if not k.startswith(TIME_PREFIXES) and k not in TIME_KEYS and k != "trainer/packing"]
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (k, a[k], b[k])


@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (the vllm extra)")
def test_with_the_vllm_sampler_the_trainer_scores_the_teacher(tmp_path):
    """The sampler is only the student: with sampler.backend=vllm the trainer's model scores the privileged prompt
    (x⁺ = x with current weights: exactly zero signal; the default template: a nonzero one)."""
    shape = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128, "max_positions": 256}
    over = {"sampler.backend": "vllm", "sampler.vllm.model_cache": str(tmp_path / "cache"), "loop.steps": 2,
            **{f"model.tiny.{k}": v for k, v in shape.items()}}   # tests/rollout/test_vllm.py's engine shape
    zero = _run(tmp_path, "vllm-zero", **over, **{"distill.self_teacher.template": '"{prompt}"',
                                                   "distill.self_teacher.weights": "current"})
    assert len(zero) == 2 and all(r["distill/token_kl"] == 0.0 and r["grad_norm"] == 0.0 for r in zero)
    default = _run(tmp_path, "vllm-default", **over)
    assert len(default) == 2 and default[0]["distill/token_kl"] != 0.0
