"""The data that flows from the sampler to the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class RolloutBatch:
    """B rollouts, right-padded to a common length.

    prompt_ids       [B, P] long, left-padded prompts (pad = pad_token_id), with prompt_mask [B, P]
    response_ids     [B, T] long, right-padded responses; response_mask [B, T] float (1 = generated token)
    sampler_logprobs [B, T] float32: log q(y_t | c_t) in the sampler's own dtype/temperature, 0 on padding
    group_ids        [B] long: rows with the same id answer the same prompt
    rewards          [B] (outcome) or [B, T] (per token) float32; None until scored
    policy_version   [B] long: the trainer version whose weights generated each row
    sampler_topk_ids / sampler_topk_logprobs [B, T, K] (optional): the sampler's top-k for score centring
    prompt_index     [B] long: position of the prompt in the task's data stream (for exact resume)
    info             per-row python metadata (answers, texts) and timing; not moved to devices
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    sampler_logprobs: torch.Tensor
    group_ids: torch.Tensor
    policy_version: torch.Tensor
    rewards: torch.Tensor | None = None
    sampler_topk_ids: torch.Tensor | None = None
    sampler_topk_logprobs: torch.Tensor | None = None
    prompt_index: torch.Tensor | None = None
    info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def tensor_fields(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def select(self, index: torch.Tensor | list[int]) -> RolloutBatch:
        """Rows `index` (micro-batching, dropping stale rows). `info` lists of length B are indexed too."""
        idx = torch.as_tensor(index, dtype=torch.long)
        updates = {k: v[idx] for k, v in self.tensor_fields().items()}
        info = {k: ([v[i] for i in idx.tolist()] if isinstance(v, list) and len(v) == len(self) else v)
                for k, v in self.info.items()}
        return replace(self, **updates, info=info)
