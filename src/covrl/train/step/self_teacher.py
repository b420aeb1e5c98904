"""On-policy self-distillation (SDFT / OPSD, `distill.teacher: self`): the model is its own teacher.

The student samples from the plain prompt as in RL; the teacher is the same network given a privileged prompt
that holds the example's reference answer (`distill.self_teacher.template`), and it scores the very tokens the
student drew. The per-token reverse KL log p_teacher(y_t | x⁺, y_<t) − log π(y_t | x, y_<t) is then the learning
signal exactly as with a separate teacher (`Trainer._distilled`); the teacher's log-probs are computed without
gradient (a stop-gradient on the target), with the trainer's current weights or a frozen copy of the weights RL
started from (`distill.self_teacher.weights`). No second model is loaded and the sampler is only the student, so
any sampler backend works.

    teacher = SelfTeacher(cfg.distill.self_teacher, task, tokenizer, example_at)   # example_at: position -> Example
    privileged = teacher.privileged(batch)   # the batch with each row's prompt replaced by its privileged prompt

A row's example is found from its stream position (`RolloutBatch.prompt_index`), so rows of any source (sync,
async, Ray, dynamic sampling, episodes) are matched to their own answer, also where two examples share a prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field, field_validator

from covrl.rollout.types import RolloutBatch
from covrl.settings import ConfigError, Section
from covrl.tasks import Example

__all__ = ["CHAT_TEMPLATE", "PLAIN_TEMPLATE", "SelfTeacher", "SelfTeacherConfig", "check_template",
           "needs_initial_weights"]

# With a chat model: the question, a solved example, then the request to answer (tinker-cookbook's
# DEFAULT_DEMO_TEMPLATE, without its "including the thinking process", which asks for a longer answer).
CHAT_TEMPLATE = ("{prompt}\n\nThis is an example of a correct response:\n{answer}\n\n"
                 "Now answer with a response of your own.")
# With plain prompts (task.chat_template=false, e.g. "7+5="): the solved example, then the question again.
PLAIN_TEMPLATE = "{prompt}{answer}\n{prompt}"
_FIELDS = ("prompt", "answer")


def check_template(template: str) -> set[str]:
    """The fields `template` reads (a subset of {prompt}, {answer}); a ValueError for any other field or a
    malformed brace."""
    import string

    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ValueError(f"distill.self_teacher.template is not a format string ({err}); write literal braces "
                         "as {{ and }}") from None
    unknown = sorted(n for n in names if n not in _FIELDS)
    if unknown:
        raise ValueError(f"distill.self_teacher.template reads {{{unknown[0]}}}; the fields are {{prompt}} (the "
                         "task's prompt) and {answer} (the example's reference answer)")
    return names


class SelfTeacherConfig(Section):
    """The self-teacher of `distill.teacher: self`: its privileged prompt and which weights score."""

    template: str | None = Field(
        None, description="the privileged prompt, from {prompt} (the task's prompt: the user message inside the "
        "chat template, or the plain prompt with task.chat_template=false) and {answer} (the example's reference "
        "answer); it takes the prompt's place, the chat template and task.system_prompt around it as usual. None: "
        "'{prompt}\\n\\nThis is an example of a correct response:\\n{answer}\\n\\nNow answer with a response of "
        "your own.' with the chat template, '{prompt}{answer}\\n{prompt}' without. A template without {answer} "
        "distils a context (e.g. an instruction) instead of the answers")
    weights: Literal["initial", "current"] = Field(
        "initial", description="the teacher's weights: initial (frozen, the weights RL starts from; one more copy "
        "of the model in memory, shared with the KL reference when kl.coef > 0) or current (the trainer's own "
        "weights at each step, no copy: a target that moves with the student)")

    @field_validator("template", mode="before")
    @classmethod
    def _known_fields(cls, v):
        if isinstance(v, dict):   # YAML reads an unquoted {prompt}... as a mapping
            raise ValueError("YAML read the template as a mapping: quote it, e.g. "
                             "distill.self_teacher.template='\"{prompt} ({answer})\"' on the command line")
        if isinstance(v, str):
            check_template(v)
        return v


class SelfTeacher:
    """The privileged prompts of the self-teacher (see the module docstring). `frozen`: score with the frozen
    initial weights (the Trainer's `ref_model`) rather than the trainer's own."""

    def __init__(self, cfg: SelfTeacherConfig, task, tokenizer, example_at: Callable[[int], Example]):
        self.template = cfg.template or (CHAT_TEMPLATE if task.cfg.chat_template else PLAIN_TEMPLATE)
        self.reads_answer = "answer" in check_template(self.template)
        self.frozen = cfg.weights == "initial"
        self.task, self.tokenizer, self.example_at = task, tokenizer, example_at
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self._ids: dict[tuple[str, str, str], list[int]] = {}

    def check_answers(self, examples: list[Example], task_name: str, answer_field: str) -> None:
        """A ConfigError naming the fields when the template reads {answer} and training examples have none."""
        if not self.reads_answer:
            return
        missing = sum(1 for ex in examples if not str(ex.answer).strip())
        if missing:
            raise ConfigError(
                f"distill.teacher=self: distill.self_teacher.template reads {{answer}}, but {missing} of "
                f"{len(examples)} training examples of task {task_name!r} have no reference answer "
                f"(task.answer_field={answer_field!r}); give the task's answers, or a template without {{answer}}")

    def prompt_text(self, example: Example) -> str:
        """The privileged prompt as the model reads it (chat template and system prompt included)."""
        def fill(prompt: str) -> str:
            return self.template.format(prompt=prompt, answer=example.answer)
        privileged = Example(prompt=fill(example.prompt), answer=example.answer,
                             meta={**example.meta, "plain_prompt": fill(example.plain_prompt)})
        return self.task.prompt_text(self.tokenizer, privileged)

    def prompt_ids(self, example: Example) -> list[int]:
        """Token ids of the privileged prompt (cached per example; never truncated: task.max_prompt_tokens bounds
        what the student sees, the teacher reads the whole demonstration)."""
        key = (example.prompt, example.plain_prompt, example.answer)
        ids = self._ids.get(key)
        if ids is None:
            ids = list(self.tokenizer(self.prompt_text(example), add_special_tokens=False)["input_ids"])
            if len(self._ids) < 1_000_000:
                self._ids[key] = ids
        return ids

    def privileged(self, batch: RolloutBatch) -> RolloutBatch:
        """`batch` with each row's prompt replaced by its example's privileged prompt (left-padded); the responses,
        masks and every other field unchanged, so a forward of it scores the drawn tokens given x⁺."""
        if batch.prompt_index is None:
            raise ValueError("distill.teacher=self finds each row's example by its stream position: the batch has "
                             "no prompt_index (score the rollouts with covrl.train.score_rollouts(..., positions))")
        rows = [self.prompt_ids(self.example_at(int(p))) for p in batch.prompt_index.tolist()]
        width = max(len(r) for r in rows)
        device = batch.prompt_ids.device
        ids = torch.full((len(rows), width), self.pad_id, dtype=batch.prompt_ids.dtype, device=device)
        mask = torch.zeros((len(rows), width), dtype=batch.prompt_mask.dtype, device=device)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r):] = torch.as_tensor(r, dtype=ids.dtype, device=device)
                mask[i, width - len(r):] = 1
        return replace(batch, prompt_ids=ids, prompt_mask=mask)


def needs_initial_weights(cfg) -> bool:
    """Whether the run keeps a frozen copy of the weights RL starts from (the Trainer's `ref_model`, saved in
    checkpoints/initial/ so that a resume restores it): for a KL reference, or a self-teacher with initial weights.
    `cfg`: a TrainConfig."""
    d = cfg.distill
    return cfg.kl.coef > 0 or (d.teacher == "self" and d.self_teacher.weights == "initial")
