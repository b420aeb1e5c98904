"""On-policy distillation (distill.teacher): the student samples, a frozen teacher scores the drawn tokens, and
minus the per-token reverse KL is the learning signal. A teacher equal to the student gives a zero signal; a
trained teacher's reverse KL falls over a short run; a teacher with another tokenizer is refused."""

from __future__ import annotations

import pytest
import torch
from train_helpers import tiny_cfg

from covrl.models import char_tokenizer, tiny_llama
from covrl.train import latest_checkpoint, prepare_run, read_jsonl, train_sync

torch.set_num_threads(1)
QUIET = {"eval.before": False, "eval.after": False}


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory):
    """A tiny model trained further than the students below (more warm-up, then RL), saved as an HF folder."""
    tmp = tmp_path_factory.mktemp("teacher")
    run = prepare_run(tiny_cfg(tmp, **{"run.name": "teacher", **QUIET, "sft_warmup.steps": 60, "loop.steps": 6}),
                      console=False)
    train_sync(run)
    run.close()
    return latest_checkpoint(tmp / "teacher") / "model"


def _distill(tmp_path, name, teacher, **extra):
    cfg = tiny_cfg(tmp_path, **{"run.name": name, **QUIET, "distill.teacher": {"source": "hf", "path": str(teacher)},
                                "algorithm.loss": "reinforce", **extra})
    run = prepare_run(cfg, console=False)
    train_sync(run)
    run.close()
    return read_jsonl(tmp_path / name / "metrics.jsonl")


def test_a_teacher_equal_to_the_student_gives_no_signal(tmp_path, teacher_folder):
    """The student starts from the teacher's own weights (model.source=hf on the same folder, no warm-up): the
    reverse KL is 0 on every token and the gradient vanishes."""
    records = _distill(tmp_path, "same", teacher_folder, **{"model.source": "hf", "model.path": str(teacher_folder),
                                                            "sft_warmup.steps": 0, "loop.steps": 1})
    r = records[0]
    assert abs(r["distill/token_kl"]) < 1e-6 and r["grad_norm"] < 1e-6


def test_the_reverse_kl_to_a_trained_teacher_falls(tmp_path, teacher_folder):
    records = _distill(tmp_path, "learn", teacher_folder, **{"loop.steps": 12, "optim.lr": 3e-3})
    first = sum(r["distill/token_kl"] for r in records[:3]) / 3
    last = sum(r["distill/token_kl"] for r in records[-3:]) / 3
    assert first > 0.05 and last < 0.7 * first, (first, last)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    folder = tmp_path / "other"
    tok = char_tokenizer("0123456789+=")
    tiny_llama(len(tok), hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32).save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = tiny_cfg(tmp_path, **{"run.name": "x", **QUIET, "distill.teacher": {"source": "hf", "path": str(folder)}})
    with pytest.raises(ValueError, match="another tokenizer than the student"):
        prepare_run(cfg, console=False)
