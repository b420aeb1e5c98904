"""The "hf" sampler backend: turns prompts into `RolloutBatch`es. It runs its own decode loop over a transformers causal LM with a KV cache:

- prompts are left-padded (attention mask + position ids = running count of real tokens); each DISTINCT
  prompt is prefilled once and its KV cache repeated for its n samples; only the last position's logits are
  computed (`logits_to_keep=1`); a prompt that with `max_new_tokens` exceeds the model's context
  (max_position_embeddings) is refused (PromptTooLongError) rather than run through RoPE extrapolation;
- each step takes the logits z (computed in the sampler's dtype), upcasts to fp32 and forms the SAMPLING
  distribution q: z / temperature, then top-k (keep the k largest logits; ties at the k-th value kept), then
  top-p (keep the smallest prefix of the sorted distribution whose mass reaches p), renormalised:
      log q(v) = log_softmax(filtered z / T)(v)     (-inf outside the kept set)
  The token is drawn from exactly this q (inverse CDF with one uniform per row from the caller's
  `torch.Generator`), and `sampler_logprobs` is log q(y) of the drawn token. So a bf16 sampler against an
  fp32 trainer is a real engine mismatch, and top-k/top-p are part of the sampler (q != p even at equal
  weights) -- both show up in the trainer's importance ratios;
- a row ends at its first EOS (the EOS is part of the response and has mask 1); later positions are padding
  (mask 0, log-prob 0); finished rows leave the batch (the KV cache is compacted) and the loop stops when
  every row has ended or after `max_new_tokens`.

With `sampler.compile` the decode step runs behind torch.compile over a preallocated StaticCache instead
(covrl.models.compiled.compile_decode_step): rows are padded up to a power of two and the cache length
(prompt + max_new_tokens) up to a multiple of `sampler.compile_bucket`, so one graph serves every step and
every batch in the same bucket; finished rows stay in the batch (masked out of the outputs: the shapes cannot
change), and the uniforms are still drawn for the live rows only, so with the same generator the tokens are
the eager loop's whenever the logits agree to fp32 rounding. The prefill stays eager.

Greedy decoding takes argmax q (the same filtered distribution) and reports log q of that token.

In-flight weight updates (`refresh`, the async loop's partial rollouts, docs/async.md): between two decode
steps the caller may hand newer weights; the sampler loads them and prefills every live row again (prompt +
the tokens drawn so far) with the new weights, so each later token is drawn from exactly the new version's q
(the old KV cache, computed by other weights, is dropped rather than mixed). `token_versions` records the
version that drew each token; the random stream is consumed as without the update (one uniform per live row
and step), so tokens drawn before the update are unchanged.
"""

from __future__ import annotations

import copy
import time

import torch

from covrl.math.truncation import TruncationRule, kept_mask, truncate_logits
from covrl.models.compiled import compile_decode_step, compile_seconds, compiled_graphs
from covrl.models.forward import cache_argument, output_cache, static_cache_from
from covrl.models.loading import lora_merge_plan, merge_lora_state_dict, pad_and_stop_ids
from covrl.rollout.config import SamplerConfig, truncation_rule
from covrl.rollout.prompts import check_prompts
from covrl.rollout.protocol import WeightsRefresh
from covrl.rollout.registry import register_sampler
from covrl.rollout.types import TOPK_LOGPROB_FLOOR, RolloutBatch, RolloutTiming

__all__ = ["HFSampler", "build_hf_sampler", "filtered_logprobs", "sample_from_logprobs"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _module_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _module_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def filtered_logprobs(logits: torch.Tensor, temperature: float = 1.0, rule: TruncationRule | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log q [..., V], kept-set size [...] or None without truncation) for logits [..., V]: fp32 log_softmax of
    logits / temperature restricted to the kept set of `rule` (covrl.math.truncation: ties at the boundary
    kept, the most likely token always kept), -inf outside it, renormalised inside it."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if rule is None or not rule.active:
        return torch.log_softmax(z, dim=-1), None
    kept = kept_mask(z, 1.0, rule)
    return torch.log_softmax(truncate_logits(z, kept), dim=-1), kept.sum(-1)


def sample_from_logprobs(logq: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of logq [B, V] by inverse CDF: u ~ U[0, total) from `generator` (one draw per row,
    on the generator's device), token = first index whose cumulative mass exceeds u. Tokens with q = 0 can
    never be chosen (their CDF step is flat)."""
    cdf = torch.cumsum(logq.exp(), dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(logq.shape[0], 1, generator=generator, device=generator.device).to(cdf.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=logq.shape[-1] - 1)


class _DynamicDecode:
    """The eager decode loop: the prompts' DynamicCache repeated to the rows; finished rows leave the batch and
    the cache (compacted), so the shapes shrink as rows end."""

    def __init__(self, sampler: HFSampler, cache, expand: torch.Tensor, attn: torch.Tensor, next_pos: torch.Tensor):
        if len(expand) > int(expand.max()) + 1:   # rows share prompts: repeat their cache rows
            cache.batch_select_indices(expand)
        self.module, self.cache_kwarg, self.cache = sampler.module, sampler._cache_kwarg, cache
        self.attn, self.next_pos = attn[expand], next_pos[expand]

    def step(self, tok: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Logits [live, V] after feeding `tok` (one per live row); `keep` = the live rows that go on (None: all)."""
        if keep is not None:
            self.cache.batch_select_indices(keep)
            tok, self.attn, self.next_pos = tok[keep], self.attn[keep], self.next_pos[keep]
        self.attn = torch.cat([self.attn, self.attn.new_ones((self.attn.shape[0], 1))], dim=-1)
        out = self.module(input_ids=tok[:, None], attention_mask=self.attn, position_ids=self.next_pos[:, None],
                          use_cache=True, **{self.cache_kwarg: self.cache})
        self.cache = output_cache(out)
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1, :]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _StaticDecode:
    """The compiled decode loop (sampler.compile): fixed rows (padded to a power of two with copies of row 0) over a
    StaticCache of a bucketed length; every row runs every step, and only the live rows' logits are returned."""

    def __init__(self, sampler: HFSampler, cache, expand: torch.Tensor, attn: torch.Tensor, next_pos: torch.Tensor):
        rows, P = len(expand), attn.shape[1]
        padded = 1 << (rows - 1).bit_length()
        length = _round_up(P + sampler.cfg.max_new_tokens, sampler.cfg.compile_bucket)
        index = torch.cat([expand, expand.new_zeros(padded - rows)])
        self.module, self.step_fn = sampler.module, sampler._decode_step()
        self.cache = static_cache_from(sampler.module, cache, index, length)
        # prompt padding masked; the generated slots all 1: the causal mask hides the slots not yet written
        self.attn = torch.cat([attn[index], attn.new_ones((padded, length - P))], dim=-1)
        self.next_pos, self.tok = next_pos[index], attn.new_zeros(padded)
        self.live = torch.arange(rows, device=attn.device)

    def step(self, tok: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        self.tok[self.live] = tok
        if keep is not None:
            self.live = self.live[keep]
        logits = self.step_fn(self.module, self.tok[:, None], self.next_pos[:, None], self.attn, self.cache)
        self.next_pos = self.next_pos + 1
        return logits[self.live]


class HFSampler:
    """The transformers backend (see the module docstring for the decode loop and the log-prob semantics)."""

    def __init__(self, cfg: SamplerConfig, model, tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_dtype = _module_dtype(model)
        self.dtype = _DTYPES[cfg.dtype] if cfg.dtype else self.model_dtype
        same = self.dtype == self.model_dtype
        if cfg.share_weights == "always" and not same:
            raise ValueError(f"sampler.share_weights='always' needs sampler.dtype == the model dtype "
                             f"({self.model_dtype}), got {self.dtype}")
        self.shares_weights = cfg.share_weights == "always" or (
            cfg.share_weights == "auto" and same and cfg.sync_every == 1)
        # A private copy of a LoRA model is merged (plain Linear layers: no adapter overhead per token);
        # load_weights then merges the trainer's adapters into it.
        self._lora_plan = None if self.shares_weights else lora_merge_plan(model)
        if self.shares_weights:
            self.module = model
        else:
            self.module = copy.deepcopy(model)
            if self._lora_plan is not None:
                self._lora_adapter = model.active_adapter
                self.module = self.module.merge_and_unload()
            self.module = self.module.to(self.dtype)
            self.module.eval()
            for p in self.module.parameters():
                p.requires_grad_(False)
        self.pad_id, self.eos_ids = pad_and_stop_ids(tokenizer, model)
        self.version = 0
        self._cache_kwarg = cache_argument()
        self._compiled_step = None          # (backend, compiled decode step), made on first use
        self.decode_graphs = 0              # graphs compiled by this sampler's generate calls (sampler.compile)
        # Positions past the model's trained context would run through RoPE extrapolation silently.
        self.context = getattr(getattr(model, "config", None), "max_position_embeddings", None)

    # ------------------------------------------------------------------ weights

    def load_weights(self, model_or_state_dict, version: int) -> None:
        """Copy the trainer's weights (a module or its state dict) into the sampler, cast to the sampler's
        dtype, and mark them as policy `version`. With shared weights only the version changes. A LoRA
        model's adapters are merged into the sampler's plain copy (W + scaling * B @ A)."""
        if self.shares_weights and model_or_state_dict is self.module:
            self.version = int(version)
            return
        state = model_or_state_dict.state_dict() if hasattr(model_or_state_dict, "state_dict") \
            else model_or_state_dict
        if self._lora_plan is not None:
            state = merge_lora_state_dict(state, self._lora_plan, self._lora_adapter)
        with torch.no_grad():
            self.module.load_state_dict(state, strict=True)
        self.version = int(version)

    # ------------------------------------------------------------------ generation

    def _decode_step(self):
        backend = self.cfg.compile_backend
        if self._compiled_step is None or self._compiled_step[0] != backend:
            self._compiled_step = (backend, compile_decode_step(backend, self._cache_kwarg))
        return self._compiled_step[1]

    def _check_prompts(self, prompts, n):
        check_prompts(prompts, n, context=self.context, max_new_tokens=self.cfg.max_new_tokens)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int, *, generator: torch.Generator,
                 policy_version: int | None = None, greedy: bool = False,
                 refresh: WeightsRefresh | None = None) -> RolloutBatch:
        """n samples per prompt -> RolloutBatch with rows [p0 x n, p1 x n, ...] and group_ids = prompt index.
        Deterministic given `generator` (the only source of randomness). `policy_version` defaults to the
        version of the last `load_weights`. `refresh`: newer weights taken between decode steps (module
        docstring); the batch then carries `token_versions`."""
        if refresh is not None and self.cfg.compile:
            raise ValueError("in-flight weight updates (async_loop.partial_rollouts) need the eager decode loop: "
                             "set sampler.compile=false")
        self._check_prompts(prompts, n)
        version = self.version if policy_version is None else int(policy_version)
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        model = self.module
        was_training = model.training
        model.eval()  # dropout off; HF also disables the KV cache under gradient checkpointing in train mode
        t0 = time.perf_counter()
        c0, g0 = (compile_seconds(), compiled_graphs()) if self.cfg.compile else (0.0, 0)
        try:
            pieces = [self._generate_chunk(rows[s: s + self.cfg.max_batch], generator, greedy, refresh)
                      for s in range(0, len(rows), self.cfg.max_batch)]
        finally:
            if was_training:
                model.train()
        elapsed = time.perf_counter() - t0
        compile_s = compile_seconds() - c0 if self.cfg.compile else 0.0
        if self.cfg.compile:
            self.decode_graphs += compiled_graphs() - g0
        timing = RolloutTiming(generate_s=elapsed, prefill_s=sum(p["prefill_s"] for p in pieces),
                               compile_s=compile_s)
        return self._assemble(rows, pieces, n, version, timing)

    def _prefill(self, rows: list[list[int]], device) -> tuple:
        """Left-padded ids, attention mask, position ids of `rows`, and the model's output on them (KV cache
        and the last position's logits)."""
        P = max(len(r) for r in rows)
        ids = torch.full((len(rows), P), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), P), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
            attn[i, P - len(r):] = 1
        ids, attn = ids.to(device), attn.to(device)
        positions = (attn.cumsum(-1) - 1).clamp_(min=0)
        out = self.module(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True,
                          logits_to_keep=1)
        return attn, positions, out

    def _generate_chunk(self, rows: list[list[int]], generator: torch.Generator, greedy: bool,
                        refresh: WeightsRefresh | None = None) -> dict:
        cfg = self.cfg
        device = _module_device(self.module)
        B = len(rows)
        # The n samples of a prompt share their prefix: prefill each distinct prompt once, then repeat its
        # KV cache rows (n times less prefill compute for n samples per prompt).
        first_row: dict[tuple[int, ...], int] = {}
        expand = torch.tensor([first_row.setdefault(tuple(r), len(first_row)) for r in rows], device=device)
        unique = [list(k) for k in first_row]
        eos = torch.tensor(sorted(set(self.eos_ids) | set(cfg.stop_token_ids)), device=device)
        stops = [s for s in cfg.stop_strings if s]
        window = 2 * max((len(s) for s in stops), default=0) + 2   # tokens enough to hold any stop string
        K = cfg.return_topk

        out_tokens = torch.full((B, cfg.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        out_logq = torch.zeros((B, cfg.max_new_tokens), dtype=torch.float32, device=device)
        out_len = torch.zeros(B, dtype=torch.long, device=device)
        rule = truncation_rule(cfg)
        out_kept = torch.zeros((B, cfg.max_new_tokens), dtype=torch.long, device=device) if rule.active else None
        if K:
            out_topk_ids = torch.zeros((B, cfg.max_new_tokens, K), dtype=torch.long, device=device)
            out_topk_lp = torch.zeros((B, cfg.max_new_tokens, K), dtype=torch.float32, device=device)

        out_version = torch.full((B, cfg.max_new_tokens), self.version, dtype=torch.long) if refresh else None

        t0 = time.perf_counter()
        attn, positions, out = self._prefill(unique, device)
        prefill_s = time.perf_counter() - t0
        decode = (_StaticDecode if cfg.compile else _DynamicDecode)(self, output_cache(out), expand, attn,
                                                                     positions[:, -1] + 1)
        logits = out.logits[:, -1, :][expand]
        active = torch.arange(B, device=device)  # original row of each live batch entry
        for t in range(cfg.max_new_tokens):
            logq, kept = filtered_logprobs(logits, cfg.temperature, rule)
            tok = logq.argmax(-1) if greedy else sample_from_logprobs(logq, generator)
            out_tokens[active, t] = tok
            out_logq[active, t] = logq.gather(-1, tok[:, None]).squeeze(-1)
            if kept is not None:
                out_kept[active, t] = kept
            if out_version is not None:
                out_version[active.cpu(), t] = self.version
            out_len[active] = t + 1
            if K:
                top = logq.topk(min(K, logq.shape[-1]), dim=-1)
                out_topk_ids[active, t, : top.indices.shape[-1]] = top.indices
                out_topk_lp[active, t, : top.values.shape[-1]] = top.values.clamp(min=TOPK_LOGPROB_FLOOR)
            alive = ~torch.isin(tok, eos)
            if stops:
                for j, row in enumerate(active.tolist()):
                    if bool(alive[j]):
                        tail = self.tokenizer.decode(out_tokens[row, max(0, t + 1 - window): t + 1].tolist(),
                                                     skip_special_tokens=True)
                        alive[j] = not any(s in tail for s in stops)
            if t == cfg.max_new_tokens - 1 or not bool(alive.any()):
                break
            keep = None if bool(alive.all()) else alive.nonzero().squeeze(-1)  # finished rows leave the batch
            if keep is not None:
                active = active[keep]
            newer = refresh() if refresh is not None else None
            if newer is not None and int(newer[1]) > self.version:
                # new weights mid-generation: drop the old cache, prefill the live rows' prefixes again
                self.load_weights(newer[0], int(newer[1]))
                prefixes = [rows[int(i)] + out_tokens[i, : t + 1].tolist() for i in active.tolist()]
                t1 = time.perf_counter()
                attn, positions, out = self._prefill(prefixes, device)
                prefill_s += time.perf_counter() - t1
                decode = _DynamicDecode(self, output_cache(out), torch.arange(len(prefixes), device=device),
                                        attn, positions[:, -1] + 1)
                logits = out.logits[:, -1, :]
            else:
                logits = decode.step(tok, keep)
        piece = {"tokens": out_tokens.cpu(), "logq": out_logq.cpu(), "length": out_len.cpu(),
                 "prefill_s": prefill_s}
        if out_version is not None:
            piece["versions"] = out_version
        if out_kept is not None and not greedy:
            piece["kept"] = out_kept.cpu()
        if K:
            piece["topk_ids"], piece["topk_lp"] = out_topk_ids.cpu(), out_topk_lp.cpu()
        return piece

    def _assemble(self, rows, pieces, n, version, timing: RolloutTiming) -> RolloutBatch:
        B = len(rows)
        P = max(len(r) for r in rows)
        T = max(int(p["length"].max()) for p in pieces)
        prompt_ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((B, P), dtype=torch.float32)
        for i, r in enumerate(rows):
            prompt_ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
            prompt_mask[i, P - len(r):] = 1.0
        length = torch.cat([p["length"] for p in pieces])
        response_mask = (torch.arange(T)[None, :] < length[:, None]).float()
        response_ids = torch.cat([p["tokens"][:, :T] for p in pieces]).masked_fill(response_mask == 0,
                                                                                   self.pad_id)
        logq = torch.cat([p["logq"][:, :T] for p in pieces]) * response_mask
        topk_ids = topk_lp = None
        if self.cfg.return_topk:
            topk_ids = torch.cat([p["topk_ids"][:, :T] for p in pieces])
            topk_lp = torch.cat([p["topk_lp"][:, :T] for p in pieces]) * response_mask[..., None]
        kept = None
        if all("kept" in p for p in pieces):
            kept = torch.cat([p["kept"][:, :T] for p in pieces]) * response_mask.long()
        token_versions = None
        if all("versions" in p for p in pieces):
            token_versions = torch.cat([p["versions"][:, :T] for p in pieces])
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
            response_mask=response_mask, sampler_logprobs=logq, sampler_kept=kept,
            group_ids=torch.arange(len(rows) // n).repeat_interleave(n),
            policy_version=torch.full((B,), version, dtype=torch.long),
            sampler_topk_ids=topk_ids, sampler_topk_logprobs=topk_lp, token_versions=token_versions,
            timing=timing,
        )


@register_sampler("hf")
def build_hf_sampler(cfg: SamplerConfig, model, tokenizer) -> HFSampler:
    return HFSampler(cfg, model, tokenizer)
