"""Response ids -> text for reward functions."""

from __future__ import annotations

from covrl.rollout.types import RolloutBatch


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    """The text of each response: the tokens with mask 1, special tokens (EOS) dropped."""
    texts = []
    for ids, mask in zip(batch.response_ids.tolist(), batch.response_mask.tolist()):
        kept = [t for t, m in zip(ids, mask) if m > 0]
        texts.append(tokenizer.decode(kept, skip_special_tokens=True))
    return texts
