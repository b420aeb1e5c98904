"""Forward passes of a causal LM over [left-padded prompt | right-padded response], the transformers KV-cache
shims, and response decoding: the model plumbing that the trainer, the HF sampler and evaluation share.

Everything takes plain tensors (this layer knows no RolloutBatch); covrl.train.step.micro_step.forward_batch and
covrl.rollout.decode_responses are the batch-taking wrappers.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from covrl.math import entropy_from_logits, sum_pi_squared, token_logprobs
from covrl.math.truncation import TruncationRule, kept_log_mass, kept_mask, truncate_logits
from covrl.models.precision import autocast as autocast_context


@dataclass
class ResponseForward:
    logprobs: torch.Tensor              # [b, t] fp32, carries the gradient when computed with grad
    entropy: torch.Tensor               # [b, t] detached (zeros without stats)
    sum_pi_sq: torch.Tensor             # [b, t] detached (zeros without stats)
    topk_logprobs: torch.Tensor | None  # [b, t, K] with grad (score centring), else None
    truncation: TruncationStats | None = None   # the kept sets of a truncating sampler, measured


@dataclass
class TruncationStats:
    """Per token [b, t], detached: log S = log π(K) (the trainer's full-softmax mass on the kept set), whether
    the trainer's own rule on its logits kept another number of tokens than the sampler reported, and whether
    the drawn token fell outside the trainer's top-|K| (it is added to the set)."""

    log_kept_mass: torch.Tensor
    count_mismatch: torch.Tensor
    sampled_outside: torch.Tensor


TOPK_TRUNCATED_FLOOR = -1e4   # a top-k id outside the kept set: log π_K = −inf, floored so products stay finite


# ------------------------------------------------------------------------------------------ KV-cache shims

@functools.cache
def cache_argument() -> str:
    """Name of the KV-cache argument of transformers models (`cache` in transformers >= 5.2x, else
    `past_key_values`)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def output_cache(out):
    """The KV cache of a model output under either spelling, or None when the model returned none."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def static_cache_from(model, cache, rows: torch.Tensor, max_len: int):
    """A transformers `StaticCache` of `len(rows)` rows x `max_len` slots holding row `rows[i]` of the prefilled
    DynamicCache `cache` (the prompts' keys / values in slots [0, P)); decode steps write slot P, P+1, ...
    Preallocated and written in place, so a compiled decode step sees the same shapes at every step."""
    from transformers import StaticCache

    static = StaticCache(config=model.config, max_cache_len=max_len)
    for i, layer in enumerate(cache.layers):
        static.update(layer.keys[rows], layer.values[rows], i)
    return static


def checkpointing(model) -> bool:
    """Activation checkpointing disables the KV cache in training mode, so prompts cannot be shared."""
    with warnings.catch_warnings():   # transformers 5 deprecates the old spelling
        warnings.simplefilter("ignore")
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            try:
                return bool(getattr(model, name))
            except AttributeError:
                continue
    return False


# ---------------------------------------------------------------------------------------------- forward

def shared_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor | None:
    """Row -> index of its distinct prompt, or None when no two rows share a prompt."""
    key = torch.cat([prompt_ids, prompt_mask.long()], dim=1)
    unique, inverse = torch.unique(key, dim=0, return_inverse=True)
    return inverse if unique.shape[0] < key.shape[0] else None


def full_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                response_mask: torch.Tensor) -> torch.Tensor:
    """Logits [b, t, V] that predict the response tokens, from one pass over every row's prompt and response."""
    t = response_ids.shape[1]
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    attn = torch.cat([prompt_mask, response_mask], dim=1).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    try:
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False, logits_to_keep=t + 1)
    except TypeError:  # models without logits_to_keep
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False)
    return out.logits[:, -(t + 1):-1]


def packed_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                  response_mask: torch.Tensor, prompt_of_row: torch.Tensor | None = None) -> torch.Tensor:
    """Same logits as `full_logits` from ONE sequence that packs the rows without padding: each distinct prompt
    once (rows sharing it, `prompt_of_row`, see it as their prefix) followed by the rows' responses, with a
    block attention mask (a response sees its prompt and its own earlier tokens, nothing else) and per-segment
    position ids (a response continues its prompt's positions). Padding costs no compute."""
    device = response_ids.device
    b = response_ids.shape[0]
    if prompt_of_row is None:
        prompt_of_row = torch.arange(b, device=device)
    n_prompts = int(prompt_of_row.max()) + 1
    first = torch.zeros(n_prompts, dtype=torch.long, device=device).scatter_(
        0, prompt_of_row, torch.arange(b, device=device))
    ids, seg_prompt, seg_row, pos = [], [], [], []
    prompt_last = torch.zeros(n_prompts, dtype=torch.long, device=device)   # packed index of its last token
    prompt_len = prompt_mask.sum(1).long()
    for g in range(n_prompts):
        toks = prompt_ids[first[g]][prompt_mask[first[g]] > 0]
        prompt_last[g] = sum(len(x) for x in ids) + len(toks) - 1
        ids.append(toks)
        seg_prompt.append(torch.full((len(toks),), g, device=device))
        seg_row.append(torch.full((len(toks),), -1, device=device))
        pos.append(torch.arange(len(toks), device=device))
    resp_len = response_mask.sum(1).long()
    starts = torch.zeros(b, dtype=torch.long, device=device)
    for r in range(b):   # a response's last token predicts nothing: its tokens 0 .. t-2 are the predictors
        toks = response_ids[r, :max(int(resp_len[r]) - 1, 0)]
        starts[r] = sum(len(x) for x in ids)
        g = int(prompt_of_row[r])
        ids.append(toks)
        seg_prompt.append(torch.full((len(toks),), g, device=device))
        seg_row.append(torch.full((len(toks),), r, device=device))
        pos.append(int(prompt_len[first[g]]) + torch.arange(len(toks), device=device))
    ids_t, sp, sr, ps = (torch.cat(x) for x in (ids, seg_prompt, seg_row, pos))
    visible = (sp[:, None] == sp[None, :]) & (ps[None, :] <= ps[:, None]) & ((sr[None, :] == -1) | (sr[:, None] == sr[None, :]))
    out = model(input_ids=ids_t[None], attention_mask=visible[None, None], position_ids=ps[None], use_cache=False)
    flat = out.logits[0]
    t = response_ids.shape[1]
    # predictor of response token j of row r: its prompt's last token (j = 0), else its response token j - 1
    j = torch.arange(t, device=device)[None, :]
    index = torch.where(j == 0, prompt_last[prompt_of_row][:, None], starts[:, None] + j - 1)
    index = torch.where(j < resp_len[:, None], index, prompt_last[prompt_of_row][:, None])   # padding: any row
    return flat[index]


def shared_prompt_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                         response_mask: torch.Tensor, prompt_of_row: torch.Tensor) -> torch.Tensor | None:
    """Same logits as `full_logits`, computing each distinct prompt once: the prompt pass (with grad) builds a
    KV cache that is indexed out to the rows of that prompt, then the responses run on top of it. With G
    prompts of length P and B rows of length T this costs G·P + B·T token passes instead of B·(P + T).
    None when the model returns no usable cache."""
    n_prompts = int(prompt_of_row.max()) + 1
    first = torch.zeros(n_prompts, dtype=torch.long, device=prompt_of_row.device).scatter_(
        0, prompt_of_row, torch.arange(len(prompt_of_row), device=prompt_of_row.device))
    p_ids, p_mask = prompt_ids[first], prompt_mask[first].long()
    p_pos = (p_mask.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True, logits_to_keep=1)
    cache = output_cache(out)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    first_logits = out.logits[:, -1][prompt_of_row]           # predicts response token 0 of each row
    t = response_ids.shape[1]
    if t == 1:
        return first_logits[:, None]
    cache.batch_select_indices(prompt_of_row)                 # indexing keeps the graph: grads reach the prompt
    attn = torch.cat([prompt_mask.long(), response_mask[:, :-1].long()], dim=1)
    start = p_mask.sum(-1)[prompt_of_row][:, None]
    pos = start + torch.arange(t - 1, device=start.device)[None]
    rest = model(input_ids=response_ids[:, :-1], attention_mask=attn, position_ids=pos, use_cache=True,
                 **{cache_argument(): cache})
    return torch.cat([first_logits[:, None], rest.logits], dim=1)


def forward_tokens(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                   response_mask: torch.Tensor, temperature: float, *, with_stats: bool = True,
                   topk_ids: torch.Tensor | None = None, share_prompts: bool = True,
                   autocast: str = "none", truncation: TruncationRule | None = None,
                   replay: bool = False, kept_counts: torch.Tensor | None = None,
                   packing: bool = False) -> ResponseForward:
    """Log-probs of the response tokens in one forward pass.

    Input = [left-padded prompt | right-padded response]; position ids follow the attention mask (as in
    generation), so the trainer sees the same positions as the sampler. Only the logits that predict response
    tokens are computed (`logits_to_keep`). log p = log softmax(z/τ)[y] with τ the sampler's temperature.
    `share_prompts`: rows with identical prompts (a group) share one prompt pass through a KV cache (same
    values up to float rounding, much less compute when prompts are long compared with responses).
    `with_stats`: also the detached entropy and Σπ² per token; `topk_ids` [b, t, K]: also their log-probs.
    `packing`: the rows packed into one sequence without padding (`packed_logits`; prompts shared when
    `share_prompts`).
    `autocast` (covrl.models.precision.AUTOCAST_MODES): the model runs under torch.autocast; the log-probs,
    entropy and Σπ² are computed after it, in fp32 from the (bf16) logits upcast block by block.
    `truncation` (the sampler's top-k / top-p / min-p): the kept sets are measured (`truncation` of the result);
    with `replay` every quantity is that of the truncated distribution π_K (docs/theory.md §12). The kept set is
    the trainer's own top-`kept_counts` (the sampler's recorded sizes) or, without them, the rule on these logits;
    the drawn token is always in it.
    """
    prompt_of_row = shared_prompts(prompt_ids, prompt_mask) if share_prompts else None
    logits = None
    with autocast_context(autocast, response_ids.device, model):
        if packing:
            logits = packed_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, prompt_of_row)
        elif prompt_of_row is not None and not checkpointing(model):
            logits = shared_prompt_logits(model, prompt_ids, prompt_mask, response_ids, response_mask,
                                          prompt_of_row)
        if logits is None:
            logits = full_logits(model, prompt_ids, prompt_mask, response_ids, response_mask)
    stats = None
    if truncation is not None and truncation.active:
        kept, stats = _kept_sets(logits.detach(), response_ids, temperature, truncation, kept_counts)
        if replay:
            logits = truncate_logits(logits, kept)
    logprobs = token_logprobs(logits, response_ids, temperature)
    topk = None
    if topk_ids is not None:
        topk = token_logprobs(logits, topk_ids.clamp(0, logits.shape[-1] - 1), temperature)
        if replay and stats is not None:
            topk = topk.clamp(min=TOPK_TRUNCATED_FLOOR)
    if with_stats:
        with torch.no_grad():
            detached = logits.detach()
            entropy = entropy_from_logits(detached, temperature)
            sps = sum_pi_squared(detached, temperature)
    else:
        entropy = sps = torch.zeros_like(logprobs)
    return ResponseForward(logprobs=logprobs, entropy=entropy, sum_pi_sq=sps, topk_logprobs=topk, truncation=stats)


@torch.no_grad()
def _kept_sets(logits: torch.Tensor, response_ids: torch.Tensor, temperature: float, rule: TruncationRule,
               kept_counts: torch.Tensor | None) -> tuple[torch.Tensor, TruncationStats]:
    """The trainer's kept set per position (the drawn token included) and its measurements."""
    by_rule = kept_mask(logits, temperature, rule)
    if kept_counts is None:
        own = by_rule
        mismatch = torch.zeros(response_ids.shape, dtype=torch.bool, device=logits.device)
    else:
        own = kept_mask(logits, temperature, counts=kept_counts)
        mismatch = (by_rule.sum(-1) != kept_counts) & (kept_counts > 0)
    outside = ~own.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    kept = own.scatter(-1, response_ids.unsqueeze(-1), True)
    return kept, TruncationStats(kept_log_mass(logits, temperature, kept), mismatch, outside)


# ----------------------------------------------------------------------------------------------- decoding

def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Text of each response row: the tokens with mask 1, special tokens (EOS) dropped; an empty generation
    decodes to ''."""
    return [tokenizer.decode(ids[mask > 0].tolist(), skip_special_tokens=True)
            for ids, mask in zip(response_ids, response_mask)]
