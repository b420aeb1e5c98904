"""The records of covrl.api: what a loop hands the training client (`TrainBatch`, `AdamParams`) and the sampling
client (`SamplingParams`), and what comes back. Every check names the field it refuses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from covrl.rollout.types import RolloutBatch


class StaleSamplingClientError(RuntimeError):
    """A SamplingClient used after the weights it was created for were replaced (see SamplingClient.version)."""


def _tensor(name: str, value, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(dtype)
    try:
        return torch.as_tensor(value, dtype=dtype)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name}: not a rectangular numeric array ({err})") from None


def _pad_rows(name: str, rows: Sequence[Sequence], width: int, dtype: torch.dtype, *, left: bool,
              fill: float = 0) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        r = _tensor(f"{name}[{i}]", list(r), dtype)
        if r.dim() != 1:
            raise ValueError(f"{name}[{i}]: expected a 1-d sequence, got shape {list(r.shape)}")
        if left:
            out[i, width - len(r):] = r
        else:
            out[i, : len(r)] = r
    return out


@dataclass(frozen=True)
class TrainBatch:
    """B sequences as [left-padded prompt | right-padded response], the layout of covrl's forward.

    prompt_ids / prompt_mask [B, P]; response_ids / response_mask [B, T] (1 = a token to score);
    sampler_logprobs [B, T] the sampler's log q of the response tokens (None: on-policy, no mismatch metrics);
    advantages [B, T] or [B] (a row's advantage broadcast over its tokens); weights [B, T] per-token weights of
    Tinker's sums (cross_entropy) and the mask of covrl.math losses (default: response_mask); sampled [B, T]
    the tokens the sampler drew, for the mismatch metrics and the correction (default: weights > 0).
    Build it with `from_sequences` (lists, padding done here) or `from_rollouts` (a sampler's RolloutBatch).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    sampler_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    sampler_kept: torch.Tensor | None = None   # [B, T] kept-set sizes of a truncating sampler (RolloutBatch's)

    def __post_init__(self):
        for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "sampler_logprobs", "advantages",
                     "weights", "sampled"):
            v = getattr(self, name)
            if isinstance(v, torch.Tensor) and v.is_inference():   # a sampler's tensors: autograd may not save them
                object.__setattr__(self, name, v.clone())
        for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
            v = getattr(self, name)
            if not isinstance(v, torch.Tensor) or v.dim() != 2:
                raise ValueError(f"TrainBatch.{name}: expected a [B, L] tensor, got "
                                 f"{list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
        B, T = self.response_ids.shape
        for name, shape in (("prompt_mask", tuple(self.prompt_ids.shape)), ("response_mask", (B, T))):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"TrainBatch.{name}: shape {list(getattr(self, name).shape)} != {list(shape)}")
        if self.prompt_ids.shape[0] != B:
            raise ValueError(f"TrainBatch.prompt_ids: {self.prompt_ids.shape[0]} rows but response_ids has {B}")
        if B == 0:
            raise ValueError("TrainBatch.response_ids: the batch has no rows")
        if int((self.prompt_mask > 0).sum(1).min()) == 0:
            raise ValueError("TrainBatch.prompt_ids: every row needs at least one prompt token (the first token "
                             "is never scored: nothing predicts it)")
        for name in ("sampler_logprobs", "weights", "sampled", "sampler_kept"):
            v = getattr(self, name)
            if v is not None and tuple(v.shape) != (B, T):
                raise ValueError(f"TrainBatch.{name}: shape {list(v.shape)} != response_ids {[B, T]}")
        a = self.advantages
        if a is not None:
            if a.dim() == 1 and a.shape[0] == B:
                object.__setattr__(self, "advantages", a.float()[:, None].expand(B, T) * self.response_mask.float())
            elif tuple(a.shape) != (B, T):
                raise ValueError(f"TrainBatch.advantages: shape {list(a.shape)} is neither [B]={[B]} nor "
                                 f"[B, T]={[B, T]}")
        for name in ("sampler_logprobs", "advantages", "weights"):
            v = getattr(self, name)
            if v is not None and not bool(torch.isfinite(v.float()[self.response_mask > 0]).all()):
                raise ValueError(f"TrainBatch.{name}: non-finite values on response tokens")

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def loss_weights(self) -> torch.Tensor:
        m = self.response_mask.float()
        return m if self.weights is None else self.weights.float() * m

    @property
    def sampled_mask(self) -> torch.Tensor:
        m = (self.loss_weights > 0).float() if self.sampled is None else self.sampled.float()
        return m * self.response_mask.float()

    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                       sampler_logprobs: Sequence[Sequence[float]] | None = None,
                       advantages: Sequence[float] | Sequence[Sequence[float]] | None = None,
                       weights: Sequence[Sequence[float]] | None = None, pad_id: int = 0) -> TrainBatch:
        """From python lists: prompts[i] and responses[i] (token ids); the optional per-token lists must have
        the length of their response; advantages may be one number per row."""
        if len(prompts) != len(responses):
            raise ValueError(f"responses: {len(responses)} rows but prompts has {len(prompts)}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}]: empty (the first token is never scored)")
        lengths = [len(r) for r in responses]
        for name, per_token in (("sampler_logprobs", sampler_logprobs), ("weights", weights),
                                ("advantages", advantages)):
            if per_token is None:
                continue
            if len(per_token) != len(responses):
                raise ValueError(f"{name}: {len(per_token)} rows but responses has {len(responses)}")
            for i, (v, n) in enumerate(zip(per_token, lengths)):
                if name == "advantages" and not isinstance(v, (list, tuple, torch.Tensor)):
                    continue
                if len(v) != n:
                    raise ValueError(f"{name}[{i}]: {len(v)} values but responses[{i}] has {n} tokens")
        P, T = max(map(len, prompts)), max(max(lengths), 1)
        prompt_ids = _pad_rows("prompts", prompts, P, torch.long, left=True, fill=pad_id)
        prompt_mask = _pad_rows("prompts", [[1.0] * len(p) for p in prompts], P, torch.float32, left=True)
        response_mask = _pad_rows("responses", [[1.0] * n for n in lengths], T, torch.float32, left=False)
        response_ids = _pad_rows("responses", responses, T, torch.long, left=False, fill=pad_id)

        def per_token(name, rows):
            return None if rows is None else _pad_rows(name, rows, T, torch.float32, left=False)

        adv = None
        if advantages is not None:
            scalar = all(not isinstance(v, (list, tuple, torch.Tensor)) for v in advantages)
            adv = _tensor("advantages", list(advantages), torch.float32) if scalar else per_token(
                "advantages", advantages)
        return cls(prompt_ids, prompt_mask, response_ids, response_mask,
                   sampler_logprobs=per_token("sampler_logprobs", sampler_logprobs), advantages=adv,
                   weights=per_token("weights", weights))

    @classmethod
    def from_rollouts(cls, batch: RolloutBatch, advantages: torch.Tensor | None = None,
                      weights: torch.Tensor | None = None) -> TrainBatch:
        """The rows of a sampler's RolloutBatch (tokens, masks and its sampler log-probs)."""
        return cls(batch.prompt_ids, batch.prompt_mask.float(), batch.response_ids, batch.response_mask.float(),
                   sampler_logprobs=batch.sampler_logprobs.float(), advantages=advantages, weights=weights,
                   sampler_kept=batch.sampler_kept)

    def select(self, rows: torch.Tensor) -> TrainBatch:
        """Rows `rows` with all-padding columns dropped (leading prompt, trailing response columns)."""
        def pick(v):
            return None if v is None else v[rows]
        sub = {k: pick(getattr(self, k)) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                                                 "sampler_logprobs", "advantages", "weights", "sampled",
                                                 "sampler_kept")}
        cols = (sub["prompt_mask"] > 0).any(0).nonzero()
        p0 = int(cols[0]) if cols.numel() else 0
        rcols = (sub["response_mask"] > 0).any(0).nonzero()
        t = max(int(rcols[-1]) + 1 if rcols.numel() else 1, 1)
        sub["prompt_ids"], sub["prompt_mask"] = sub["prompt_ids"][:, p0:], sub["prompt_mask"][:, p0:]
        for k in ("response_ids", "response_mask", "sampler_logprobs", "advantages", "weights", "sampled",
                  "sampler_kept"):
            if sub[k] is not None:
                sub[k] = sub[k][:, :t]
        return replace(self, **sub)


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyper-parameters of one `optim_step` (Tinker's names). grad_clip_norm 0 = no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self):
        for name in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"AdamParams.{name}: expected a number >= 0, got {v!r}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"AdamParams.{name}: expected 0 <= {name} < 1, got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings (Tinker's names); None keeps the sampler config's value. top_k -1 or 0 = off."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[int] | None = None


@dataclass
class ForwardResult:
    """Per-token quantities of the batch's response tokens [B, T] (0 on padding), detached."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    sum_pi_sq: torch.Tensor


@dataclass
class ForwardBackwardResult(ForwardResult):
    """The loss (its gradient was added to the parameters' .grad), the token losses and the metrics: the loss's
    own (loss/*), the mismatch and correction metrics when the batch has sampler log-probs (mismatch/*,
    correction/*), and `entropy`."""

    loss: float = 0.0
    token_loss: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class OptimStepResult:
    version: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SampledSequence:
    """One sample: its tokens (EOS included when it stopped), the sampler's log q of each, and why it ended."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str            # "stop" (an EOS) or "length" (max_tokens)
    prompt_index: int


@dataclass(frozen=True)
class SampleResult:
    """`sequences` in row order [prompt 0 x n, prompt 1 x n, ...]; `batch` the same rows as a RolloutBatch
    (TrainBatch.from_rollouts takes it as is); `version` the weights that sampled them."""

    sequences: list[SampledSequence]
    batch: RolloutBatch
    version: int
