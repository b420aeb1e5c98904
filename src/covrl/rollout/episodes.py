"""Multi-turn episodes through any sampler: environments (covrl.tasks.environments) answer each assistant turn,
and the batch carries which response tokens are the model's.

Per episode the context is a list of token ids that only grows: the opening prompt, then per turn the tokens
the sampler drew (up to its end-of-turn token) and the environment's reply as a token delta
(covrl.tasks.render.delta_ids). The next turn's prompt IS that list, so the trainer's sequence is, token for
token, what the sampler conditioned on (no re-tokenisation between turns). In the RolloutBatch:

    prompt_ids        the opening prompt
    response_ids      every later token: model turns and environment replies, in order
    response_mask     1 on all of them (the trainer's forward attends to the replies)
    loss_mask         1 on model tokens only: the loss, its normaliser, corrections and mismatch metrics
    sampler_logprobs  log q of model tokens; 0 on environment tokens (nothing was sampled there)
    sampler_topk_*    with sampler.return_topk: the sampler's top-k of each model token (score centring); ids 0
                      and log-probs 0 on environment tokens, as on padding (loss_mask excludes both)

An episode ends when the environment says done, at `max_turns`, when a turn ends without an end-of-turn token
(the response hit sampler.max_new_tokens), or when the next turn would not fit the model's context."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from covrl.rollout.types import RolloutBatch, RolloutTiming, ScoredBatch
from covrl.tasks.render import delta_ids, prompt_ids

__all__ = ["Episode", "EpisodeBatch", "generate_episodes", "score_episodes"]


@dataclass
class Episode:
    """One episode's tokens (flat lists over the response) and outcome."""

    prompt: list[int]
    tokens: list[int]
    model: list[int]              # 1 = the model's token
    logq: list[float]
    final_text: str = ""          # the last assistant message (what the task scores)
    reward: float | None = None   # set by the environment, else the task scores final_text
    turns: int = 0
    end: str = "done"             # done | max_turns | length | context | error
    env_metrics: dict | None = None
    topk_ids: list[torch.Tensor] | None = None   # per piece [L, K] (turns and replies), with sampler.return_topk
    topk_lp: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class EpisodeBatch:
    batch: RolloutBatch
    episodes: list[Episode]


def _fits(sampler, length: int) -> bool:
    context = getattr(sampler, "context", None)
    return not context or length + sampler.cfg.max_new_tokens <= context


def generate_episodes(sampler, tokenizer, make_env: Callable, examples: list, n: int, *,
                      generator: torch.Generator, chat_template: bool, max_turns: int,
                      policy_version: int | None = None, greedy: bool = False, failures=None) -> EpisodeBatch:
    """n episodes per example (rows [e0 x n, e1 x n, ...], group ids = example index), one environment from
    `make_env()` each; every turn generates for all live episodes in one `sampler.generate` call. `failures`:
    the run's FailureWatch (covrl.tasks.failures) of the environment's steps: a step that raises ends its
    episode at reward 0 and is counted; the first shows its traceback, and too many stop the run. Environments
    with a `close()` (a server session) are closed at the end, also when the batch fails."""
    if hasattr(make_env, "run_episodes"):   # an environment framework that plays its own episodes (verifiers)
        return _driven_episodes(sampler, tokenizer, make_env, examples, n, generator=generator,
                                policy_version=policy_version, greedy=greedy, failures=failures)
    envs: list = []
    try:
        envs = [make_env() for _ in examples for _ in range(n)]
        return _episodes(envs, sampler, tokenizer, examples, n, generator=generator, chat_template=chat_template,
                         max_turns=max_turns, policy_version=policy_version, greedy=greedy, failures=failures)
    finally:
        for env in envs:
            if hasattr(env, "close"):
                env.close()


def _episodes(envs: list, sampler, tokenizer, examples: list, n: int, *, generator: torch.Generator,
              chat_template: bool, max_turns: int, policy_version: int | None, greedy: bool,
              failures) -> EpisodeBatch:
    row_examples = [ex for ex in examples for _ in range(n)]
    episodes = []
    for env, ex in zip(envs, row_examples):
        ids = prompt_ids(tokenizer, env.reset(ex), list(getattr(env, "tools", []) or []), chat_template=chat_template)
        episodes.append(Episode(prompt=ids, tokens=[], model=[], logq=[]))
    eos = set(getattr(sampler, "eos_ids", None) or [tokenizer.eos_token_id])
    timing = RolloutTiming()
    live = list(range(len(episodes)))
    for turn in range(max_turns):
        if turn > 0:
            for i in [i for i in live if not _fits(sampler, len(episodes[i].prompt) + len(episodes[i].tokens))]:
                episodes[i].end = "context"
            live = [i for i in live if episodes[i].end != "context"]
        if not live:
            break
        out = sampler.generate([episodes[i].prompt + episodes[i].tokens for i in live], 1, generator=generator,
                               policy_version=policy_version, greedy=greedy)
        timing = timing + out.timing
        still = []
        steps = failed = 0
        for j, i in enumerate(live):
            ep = episodes[i]
            length = int(out.response_mask[j].sum())
            toks = out.response_ids[j, :length].tolist()
            ep.tokens += toks
            ep.model += [1] * length
            ep.logq += out.sampler_logprobs[j, :length].tolist()
            if out.sampler_topk_ids is not None:
                ep.topk_ids = (ep.topk_ids or []) + [out.sampler_topk_ids[j, :length]]
                ep.topk_lp = (ep.topk_lp or []) + [out.sampler_topk_logprobs[j, :length].float()]
            ep.turns += 1
            ep.final_text = tokenizer.decode(toks, skip_special_tokens=True)
            if not toks or toks[-1] not in eos:
                ep.end = "length"
                # optional step_cut: an environment that grades the cut turn itself (OpenEnv: its reward)
                if not hasattr(envs[i], "step_cut"):
                    continue
            steps += 1
            try:
                step = envs[i].step_cut(ep.final_text) if ep.end == "length" else envs[i].step(ep.final_text)
            except Exception as err:  # noqa: BLE001 - a broken environment ends its episode at reward 0, counted
                ep.end, ep.reward = "error", 0.0
                failed += 1
                if failures is not None:
                    failures.failed(err, f"episode {i}, turn {turn + 1}", f"message {ep.final_text[:80]!r}")
                continue
            if step.done or ep.end == "length":
                ep.reward = step.reward
                continue
            if turn == max_turns - 1:   # the model still wanted a tool: no final answer
                ep.end, ep.reward = "max_turns", 0.0
                continue
            delta = delta_ids(tokenizer, step.messages, chat_template=chat_template)
            ep.tokens += delta
            ep.model += [0] * len(delta)
            ep.logq += [0.0] * len(delta)
            if ep.topk_ids is not None:   # nothing was sampled at a reply token: padding's zeros
                K = ep.topk_ids[-1].shape[-1]
                ep.topk_ids.append(torch.zeros((len(delta), K), dtype=torch.long))
                ep.topk_lp.append(torch.zeros((len(delta), K)))
            still.append(i)
        if failures is not None:
            failures.observe(steps, failed)
        live = still
    for ep, env in zip(episodes, envs):
        ep.env_metrics = env.metrics() if hasattr(env, "metrics") else {}
    return EpisodeBatch(_assemble(episodes, n, sampler, tokenizer, policy_version, timing), episodes)


# a tokenizer without a chat template (the tiny model's): each message's text, joined by newlines (an assistant's
# tool calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, closed by EOS as sampled), the generation
# prompt empty: a single-turn prompt renders to exactly the task's plain prompt, and a later turn's prompt
# extends the tokens already drawn (one training row per episode)
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if not loop.first %}\n{% endif %}{{ m['content'] or '' }}"
    "{% for tc in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ tc['function']['name'] }}\", "
    "\"arguments\": {{ tc['function']['arguments'] if tc['function']['arguments'] is string "
    "else tc['function']['arguments'] | tojson }}}</tool_call>{% endfor %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt and messages[-1]['role'] != 'user' %}\n{% endif %}")


def _endpoint(env, sampler, tokenizer):
    """The environment's generate endpoint (covrl.rollout.serve) around `sampler`, and the folder of the
    tokenizer its client renders chats with; made at the first call, closed with the environment."""
    server = env.endpoint
    if server is None:
        import tempfile

        from covrl.rollout.serve import GenerateServer

        server = env.endpoint = GenerateServer(sampler, generator=torch.Generator())
        server.tokenizer_dir = tempfile.mkdtemp(prefix="covrl-tokenizer-")
        if not getattr(tokenizer, "chat_template", None):   # plain prompts: the messages' texts, one per line
            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
        tokenizer.save_pretrained(server.tokenizer_dir)
    server.sampler = sampler
    return server


def _driven_episodes(sampler, tokenizer, env, examples: list, n: int, *, generator: torch.Generator,
                     policy_version: int | None, greedy: bool, failures) -> EpisodeBatch:
    """Episodes an environment framework plays itself against covrl's generate endpoint (covrl.tasks.
    verifiers_env): each comes back as one token sequence with its sampled mask and log q; the tokens before
    the first sampled one are the prompt. Every sampled token was drawn by `sampler` from `generator`."""
    server = _endpoint(env, sampler, tokenizer)
    server.generator, server.greedy = generator, greedy
    version = sampler.version if policy_version is None else int(policy_version)
    server.version = lambda: version
    t0, batches0 = time.perf_counter(), server.batches
    outcomes = env.run_episodes(server.base_url, server.tokenizer_dir, examples, n,
                                temperature=float(sampler.cfg.temperature), max_tokens=int(sampler.cfg.max_new_tokens))
    episodes, failed = [], 0
    for i, out in enumerate(outcomes):
        sampled = out["sampled"]
        first = next((k for k, m in enumerate(sampled) if m), len(sampled))
        ep = Episode(prompt=out["tokens"][:first], tokens=out["tokens"][first:],
                     model=[int(m) for m in sampled[first:]], logq=[float(x) for x in out["logprobs"][first:]],
                     final_text=out["final_text"], reward=float(out["reward"]), turns=int(out["turns"]),
                     env_metrics={"branches": float(out["branches"]),
                                  **{f"reward/{k}": v for k, v in out["terms"].items()}})
        if out["error"] is not None or not ep.prompt or not ep.tokens:
            ep.end, ep.reward = "error", 0.0
            failed += 1
            if failures is not None:
                err = RuntimeError(out["error"] or "the episode has no sampled tokens")
                err.remote_traceback = out.get("traceback")
                failures.failed(err, f"episode {i}", f"example {examples[i // n].prompt[:60]!r}")
            if not ep.prompt:   # nothing rendered: a one-token placeholder row, out of the loss
                ep.prompt, ep.tokens, ep.model, ep.logq = [_pad_id(sampler, tokenizer)], [], [], []
        episodes.append(ep)
    if failures is not None:
        failures.observe(len(outcomes), failed)
    timing = RolloutTiming(generate_s=time.perf_counter() - t0)
    batch = _assemble(episodes, n, sampler, tokenizer, policy_version, timing)
    env.last_batches = server.batches - batches0
    return EpisodeBatch(batch, episodes)


def _pad_id(sampler, tokenizer) -> int:
    """The sampler's pad id, else the tokenizer's (its EOS when it has none)."""
    pad = getattr(sampler, "pad_id", None)
    return int(pad if pad is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                           else tokenizer.eos_token_id))


def _assemble(episodes: list[Episode], n: int, sampler, tokenizer, policy_version, timing) -> RolloutBatch:
    pad = _pad_id(sampler, tokenizer)
    B = len(episodes)
    P = max(len(e.prompt) for e in episodes)
    T = max(1, max(len(e.tokens) for e in episodes))
    prompt_ids_ = torch.full((B, P), pad, dtype=torch.long)
    prompt_mask = torch.zeros((B, P))
    response_ids = torch.full((B, T), pad, dtype=torch.long)
    response_mask = torch.zeros((B, T))
    loss_mask = torch.zeros((B, T))
    logq = torch.zeros((B, T))
    for i, e in enumerate(episodes):
        prompt_ids_[i, P - len(e.prompt):] = torch.tensor(e.prompt, dtype=torch.long)
        prompt_mask[i, P - len(e.prompt):] = 1.0
        L = len(e.tokens)
        if L:
            response_ids[i, :L] = torch.tensor(e.tokens, dtype=torch.long)
            response_mask[i, :L] = 1.0
            loss_mask[i, :L] = torch.tensor(e.model, dtype=torch.float32)
            logq[i, :L] = torch.tensor(e.logq, dtype=torch.float32)
    topk_ids, topk_lp = _assemble_topk(episodes, T)
    version = sampler.version if policy_version is None else int(policy_version)
    return RolloutBatch(prompt_ids=prompt_ids_, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, sampler_logprobs=logq,
                        sampler_topk_ids=topk_ids, sampler_topk_logprobs=topk_lp,
                        group_ids=torch.arange(B // n).repeat_interleave(n),
                        policy_version=torch.full((B,), version, dtype=torch.long), loss_mask=loss_mask,
                        timing=timing)


def _assemble_topk(episodes: list[Episode], T: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """[B, T, K] top-k ids / log-probs (zeros on replies and padding), or (None, None) without top-k."""
    pieces = [e.topk_ids for e in episodes if e.topk_ids]
    if not pieces:
        return None, None
    K = pieces[0][0].shape[-1]
    ids = torch.zeros((len(episodes), T, K), dtype=torch.long)
    lp = torch.zeros((len(episodes), T, K))
    for i, e in enumerate(episodes):
        if e.topk_ids:
            row_ids, row_lp = torch.cat(e.topk_ids), torch.cat(e.topk_lp)
            ids[i, :len(row_ids)], lp[i, :len(row_lp)] = row_ids, row_lp
    return ids, lp


def score_episodes(task, tokenizer, episodes: EpisodeBatch, examples: list, n: int) -> ScoredBatch:
    """The episodes' rewards (the environment's, else the task's reward of the final assistant message),
    correctness (the task's grader where the task scored, else reward >= 1) and per-batch episode metrics
    (task/turns, task/tool_calls, task/tool_call_rate, task/tool_errors, task/end_<reason>)."""
    t0 = time.perf_counter()
    eps = episodes.episodes
    row_examples = [ex for ex in examples for _ in range(n)]
    todo = [i for i, e in enumerate(eps) if e.reward is None]
    rewards = [0.0 if e.reward is None else float(e.reward) for e in eps]
    correct = [math.isfinite(r) and r >= 1.0 for r in rewards]
    metrics: dict[str, float] = {}
    if todo:
        scored = task.score([eps[i].final_text for i in todo], [row_examples[i] for i in todo])
        for k, i in enumerate(todo):
            rewards[i], correct[i] = scored.rewards[k], scored.correct[k]
        metrics.update({f"task/{k.split('/', 1)[-1]}": float(v) for k, v in scored.metrics.items()
                        if k not in ("reward/mean", "reward/accuracy")})
    B = max(len(eps), 1)
    metrics["task/turns"] = sum(e.turns for e in eps) / B
    calls = [float((e.env_metrics or {}).get("tool_calls", 0.0)) for e in eps]
    metrics["task/tool_calls"] = sum(calls) / B
    metrics["task/tool_call_rate"] = sum(c > 0 for c in calls) / B
    metrics["task/tool_errors"] = sum(float((e.env_metrics or {}).get("tool_errors", 0.0)) for e in eps) / B
    for reason in ("max_turns", "length", "context", "error"):
        metrics[f"task/end_{reason}"] = sum(e.end == reason for e in eps) / B
    # an environment's own reward terms (unweighted scores, as task.rewards logs them) and its branch count
    terms = sorted({k for e in eps for k in (e.env_metrics or {}) if k.startswith("reward/")})
    for k in terms:
        metrics[f"task/{k}"] = sum(float((e.env_metrics or {}).get(k, 0.0)) for e in eps) / B
    if any("branches" in (e.env_metrics or {}) for e in eps):
        metrics["task/verifiers_multi_branch"] = sum(float((e.env_metrics or {}).get("branches", 1)) > 1
                                                     for e in eps) / B
    batch = episodes.batch
    texts = [tokenizer.decode(e.tokens, skip_special_tokens=True) for e in eps]
    return batch.scored(torch.tensor(rewards, dtype=torch.float32), correct=correct, texts=texts,
                        task_metrics=metrics, score_s=time.perf_counter() - t0)
