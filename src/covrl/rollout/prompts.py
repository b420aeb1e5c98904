"""Checks every sampler backend applies to the prompts of a generate call."""

from __future__ import annotations

from covrl.tasks.task import PromptTooLongError


def check_prompts(prompts, n: int, *, context: int | None, max_new_tokens: int) -> None:
    """Non-empty token-id lists, n >= 1, and each prompt + max_new_tokens within the model's context (positions
    past it would run through RoPE extrapolation silently)."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("generate: prompts must be a non-empty list of token-id lists")
    if n < 1:
        raise ValueError(f"generate: n={n} must be >= 1")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty")
        if context and len(p) + max_new_tokens > context:
            raise PromptTooLongError(
                f"prompt {i} has {len(p)} tokens; with sampler.max_new_tokens={max_new_tokens} it "
                f"exceeds the model context (max_position_embeddings={context}); lower "
                "task.max_prompt_tokens (overlong=truncate) or sampler.max_new_tokens")
