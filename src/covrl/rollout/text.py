"""Response ids -> text for reward functions."""

from __future__ import annotations

from covrl.models.forward import decode_responses as decode_response_tokens
from covrl.rollout.types import RolloutBatch


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    """The text of each response of `batch`: the tokens with mask 1, special tokens (EOS) dropped."""
    return decode_response_tokens(tokenizer, batch.response_ids, batch.response_mask)
