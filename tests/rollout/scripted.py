"""Test helpers for covrl's OpenAI-compatible endpoint: the tiny char tokenizer, a prefix-stable chat template
with tools, and a scripted sampler whose completions are texts chosen per prompt (exact, known token ids)."""

from __future__ import annotations

import torch

from covrl.models import ModelConfig, load_model
from covrl.rollout import SamplerConfig
from covrl.rollout.types import RolloutBatch

# user / tool turns end with a newline, an assistant turn with EOS (as the sampler stops), the generation prompt
# "A:": a later call's prompt extends the earlier prompt + completion when the assistant text comes back unchanged
TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
            "{% for m in messages %}{% if m['role'] == 'assistant' %}A:{{ m['content'] or '' }}"
            "{% for tc in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ tc['function']['name'] }}\", "
            "\"arguments\": {{ tc['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{{ eos_token }}"
            "{% else %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}A:{% endif %}")


def tiny_model():
    torch.manual_seed(0)
    return load_model(ModelConfig(source="tiny", tiny={"hidden_size": 32, "num_layers": 1, "intermediate_size": 64,
                                                       "num_heads": 2}), seed=3)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class ScriptedSampler:
    """A sampler whose completion of a prompt is `script(prompt_text)` encoded (EOS appended unless the text
    ends with '...': a cut answer), with log q of token k = -0.01 * (k + 1) - 0.001 * id (known, distinct)."""

    def __init__(self, tokenizer, script, max_new_tokens: int = 256):
        self.tokenizer, self.script = tokenizer, script
        self.cfg = SamplerConfig(max_new_tokens=max_new_tokens)
        self.eos_ids = [tokenizer.eos_token_id]
        self.pad_id = tokenizer.pad_token_id
        self.context = None
        self.version = 0
        self.calls = 0

    def logq(self, ids: list[int]) -> list[float]:
        return [-0.01 * (k + 1) - 0.001 * t for k, t in enumerate(ids)]

    def generate(self, prompts, n, *, generator, policy_version=None, greedy=False, refresh=None) -> RolloutBatch:
        self.calls += 1
        rows = []
        for p in prompts:
            text = self.script(self.tokenizer.decode(p))
            ids = encode(self.tokenizer, text.removesuffix("..."))
            rows += [ids if text.endswith("...") else ids + self.eos_ids] * n
        B, T = len(rows), max(len(r) for r in rows)
        resp = torch.zeros((B, T), dtype=torch.long)
        mask, lq = torch.zeros((B, T)), torch.zeros((B, T))
        for i, r in enumerate(rows):
            resp[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
            lq[i, :len(r)] = torch.tensor(self.logq(r))
        P = max(len(p) for p in prompts)
        return RolloutBatch(prompt_ids=torch.zeros((B, P), dtype=torch.long), prompt_mask=torch.ones((B, P)),
                            response_ids=resp, response_mask=mask, sampler_logprobs=lq,
                            group_ids=torch.arange(B), policy_version=torch.full((B,), self.version))
