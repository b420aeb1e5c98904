"""Reward terms scored by a model: kind `model` (a transformers sequence-classification reward model) and kind
`judge` (an LLM judge behind an OpenAI-compatible endpoint, or a local causal LM), registered by kind in
`TERM_KINDS` for `Task` (a term of kind fn is a reward function, covrl.tasks.rewards).

Both are RewardRunners scoring a whole batch, so their failures follow the user-reward rule exactly (the first one
shown at once, the rest counted in task/errors/<name>, the run stops by task.max_reward_error_rate over
task.reward_error_window and task.max_consecutive_reward_errors; task.reward_errors=raise stops at the first).
Each returns per-step metrics in `step_metrics` (reward/model/<name>/..., reward/judge/<name>/...).

Models load lazily at first use and once per process (cached by folder, device and dtype): building a Task costs
nothing, and the train and eval tasks share one copy. torch and transformers are imported only then.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from covrl.tasks.base import Example
from covrl.tasks.config import JudgeConfig, RewardModelConfig, RewardTermConfig, TaskConfig
from covrl.tasks.rewards import RewardFunctionError, RewardRunner

__all__ = ["TERM_KINDS", "JudgeError", "JudgeTerm", "RewardModelTerm", "fill_template", "parse_grade"]

_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.Lock()


def _cached(key: tuple, load: Callable[[], Any]):
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = load()
        return _CACHE[key]


def _device(name: str) -> str:
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _dtype(name: str):
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def _check_folder(path: str, field: str) -> Path:
    """A missing or non-model folder is an error at start-up naming the config field."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{field}={path!r}: no such local folder (covrl never downloads a model; save it "
                                f"with save_pretrained or `huggingface-cli download --local-dir`)")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{field}={path!r}: {folder.resolve()} has no config.json (expected a transformers "
                                "model folder)")
    return folder


def _pad_id(tok) -> int:
    for pad in (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id):
        if pad is not None:
            return int(pad)
    return 0


class _BatchTerm(RewardRunner):
    """A term that scores a batch itself: `_score` returns one float or one exception per completion; the
    exceptions go through the RewardRunner's failure rule as a user reward's would."""

    def __init__(self, task_cfg: TaskConfig, name: str, what: str):
        super().__init__(None, name=name, timeout_s=None, on_error=task_cfg.reward_errors, isolate=False,
                         signature="trl", answer_field=task_cfg.answer_field,
                         max_consecutive_errors=task_cfg.max_consecutive_reward_errors,
                         error_window=task_cfg.reward_error_window, max_error_rate=task_cfg.max_reward_error_rate)
        self.watch.what = what
        self.task_cfg = task_cfg
        self.step_metrics: dict[str, float] = {}

    def _score(self, completions: list[str], examples: list[Example]) -> list[float | Exception]:
        raise NotImplementedError

    def _call_batch(self, completions, examples):
        self.step_metrics = {}
        results = self._score(list(completions), list(examples)) if completions else []
        rewards: list[float] = []
        errors = timeouts = 0
        last: Exception | None = None
        for i, (result, ex) in enumerate(zip(results, examples)):
            if isinstance(result, Exception):
                self._failed(result, f"completion {i}", ex.prompt)
                errors += 1
                timeouts += isinstance(result, TimeoutError)
                last, result = result, 0.0
            rewards.append(float(result))
        return rewards, errors, timeouts, last

    def _prompt(self, example: Example) -> str:
        """The prompt as the policy saw it when the chat template is off (e.g. "7+5="), else its text."""
        return example.prompt if self.task_cfg.chat_template else example.plain_prompt

    def _messages(self, user: str, assistant: str | None = None) -> list[dict[str, str]]:
        messages = []
        if self.task_cfg.system_prompt is not None:
            messages.append({"role": "system", "content": self.task_cfg.system_prompt})
        messages.append({"role": "user", "content": user})
        if assistant is not None:
            messages.append({"role": "assistant", "content": assistant})
        return messages


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return {f"{prefix}/mean": mean, f"{prefix}/std": std, f"{prefix}/min": min(values), f"{prefix}/max": max(values)}


class RewardModelTerm(_BatchTerm):
    """A sequence-classification reward model: the `label` logit (after `normalise`) of prompt + completion, in
    eval mode under no_grad, `batch_size` texts a forward pass, right-padded (a causal model reads the score at
    the last real token, and right padding leaves each row's positions as unpadded). A failing forward fails
    the completions of its batch. Logs reward/model/<name>/{mean,std,min,max} of the scores."""

    def __init__(self, task_cfg: TaskConfig, index: int, term: RewardTermConfig):
        super().__init__(task_cfg, term.log_name, f"reward model {term.log_name}")
        self.cfg: RewardModelConfig = term.model
        self.field = f"task.rewards[{index}].model"
        self.folder = _check_folder(self.cfg.path, f"{self.field}.path")
        self._lock = threading.Lock()

    def _load(self):
        cfg = self.cfg
        key = ("reward_model", str(self.folder.resolve()), _device(cfg.device), cfg.dtype)

        def load():
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
                model = AutoModelForSequenceClassification.from_pretrained(
                    str(self.folder), dtype=_dtype(cfg.dtype), local_files_only=True)
            except Exception as err:  # noqa: BLE001 - named by its field, stops the run like a failing reward
                raise RewardFunctionError(f"{self.field}.path={cfg.path!r}: cannot load the reward model: "
                                          f"{type(err).__name__}: {err}") from err
            model.config.pad_token_id = _pad_id(tok)   # batches of more than one row need it
            return model.eval().to(key[2]), tok
        model, tok = _cached(key, load)
        return model, tok, self._label_index(model)

    def _label_index(self, model) -> int:
        label, n = self.cfg.label, int(model.config.num_labels)
        if isinstance(label, str) and not label.lstrip("-").isdigit():
            names = {str(v): int(k) for k, v in (model.config.id2label or {}).items()}
            if label not in names:
                raise RewardFunctionError(f"{self.field}.label={label!r}: the model's labels are {sorted(names)}")
            return names[label]
        index = int(label)
        if not -n <= index < n:
            raise RewardFunctionError(f"{self.field}.label={index}: the model has {n} logits")
        return index

    def texts(self, completions: list[str], examples: list[Example], tok=None) -> list[tuple[str, bool]]:
        """(text, templated) per completion: the reward model's chat template around [user: prompt, assistant:
        completion] when it has one (and `chat_template`), else the prompt text followed by the completion."""
        if tok is None:
            tok = self._load()[1]
        if self.cfg.chat_template and getattr(tok, "chat_template", None):
            return [(tok.apply_chat_template(self._messages(ex.prompt, c), tokenize=False), True)
                    for c, ex in zip(completions, examples)]
        sep = "\n" if self.task_cfg.chat_template else ""
        return [(self._prompt(ex) + sep + c, False) for c, ex in zip(completions, examples)]

    def _score(self, completions, examples):
        import torch

        model, tok, index = self._load()
        pad = int(model.config.pad_token_id)
        results: list[float | Exception] = []
        texts = self.texts(completions, examples, tok)
        size = self.cfg.batch_size
        for start in range(0, len(texts), size):
            chunk = texts[start:start + size]
            try:
                rows = [list(tok(t, add_special_tokens=not templated)["input_ids"])[-self.cfg.max_length:]
                        for t, templated in chunk]
                with self._lock, torch.no_grad():
                    logits = self._forward(model, rows, pad)
                scores = self._normalise(logits.float())[:, index].tolist()
                for s in scores:
                    results.append(s if math.isfinite(s) else ValueError(f"the reward model returned {s}"))
            except Exception as err:  # noqa: BLE001 - fails this batch's completions, counted
                results.extend([err] * len(chunk))
        self.step_metrics = _stats(f"reward/model/{self.name}", [r for r in results if isinstance(r, float)])
        return results

    def _forward(self, model, rows: list[list[int]], pad: int):
        import torch

        if any(not r for r in rows):
            raise ValueError("an empty text (no tokens) cannot be scored")
        device = next(model.parameters()).device
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        # a causal classifier reads the rightmost token that is not the pad id: a row whose last real token is
        # the pad id (pad = eos) would be read one token early, so it is scored alone without padding
        alone = [i for i, r in enumerate(rows) if r[-1] == pad and len(rows) > 1]
        if alone:
            logits = logits.clone()
            saved, model.config.pad_token_id = model.config.pad_token_id, None
            try:
                for i in alone:
                    logits[i] = model(input_ids=torch.tensor([rows[i]], device=device)).logits[0]
            finally:
                model.config.pad_token_id = saved
        return logits

    def _normalise(self, logits):
        import torch

        if self.cfg.normalise == "sigmoid":
            return torch.sigmoid(logits)
        if self.cfg.normalise == "softmax":
            return torch.softmax(logits, dim=-1)
        return logits


# --- judges --------------------------------------------------------------------------------------------------


class JudgeError(RuntimeError):
    """The judge's endpoint or model failed on one request (after its retries)."""


class JudgeTimeout(JudgeError, TimeoutError):
    """The judge's endpoint did not answer within judge.timeout_s (after its retries)."""


class JudgeParseError(ValueError):
    """The judge's reply holds no grade."""


def fill_template(template: str, prompt: str, completion: str, answer: str) -> str:
    """`template` with {prompt}, {completion}, {answer} replaced in one pass (a placeholder inside a filled-in
    text is left alone; other braces are literal)."""
    values = {"{prompt}": prompt, "{completion}": completion, "{answer}": answer}
    return re.sub(r"\{(?:prompt|completion|answer)\}", lambda m: values[m.group(0)], template)


def parse_grade(reply: str, cfg: JudgeConfig) -> float:
    """The grade in [0, 1] of a judge reply (JudgeConfig.parse); JudgeParseError when it holds none."""
    if cfg.parse == "label":
        words = sorted(cfg.labels, key=len, reverse=True)   # the longest label first at one place
        found = re.findall(r"(?<!\w)(" + "|".join(re.escape(w) for w in words) + r")(?!\w)", reply, re.IGNORECASE)
        if not found:
            raise JudgeParseError(f"the judge's reply holds none of the labels {sorted(cfg.labels)}: {reply[:500]!r}")
        lower = {k.lower(): v for k, v in cfg.labels.items()}
        return float(lower[found[-1].lower()])
    matches = list(re.finditer(cfg.pattern, reply))
    if not matches:
        raise JudgeParseError(f"the judge's reply has no grade matching judge.pattern={cfg.pattern!r}: "
                              f"{reply[:500]!r}")
    text = matches[-1].group(1)
    try:
        grade = float(text)
    except (TypeError, ValueError):
        raise JudgeParseError(f"the judge's grade {text!r} is not a number (reply {reply[:500]!r})") from None
    if not (cfg.min_grade <= grade <= cfg.max_grade) or not math.isfinite(grade):
        raise JudgeParseError(f"the judge's grade {grade:g} lies outside [judge.min_grade={cfg.min_grade:g}, "
                              f"judge.max_grade={cfg.max_grade:g}] (reply {reply[:500]!r})")
    return (grade - cfg.min_grade) / (cfg.max_grade - cfg.min_grade)


class _HTTPBackend:
    """POST <base_url>/chat/completions of an OpenAI-compatible server (vllm serve, SGLang, llama.cpp's server,
    OpenAI), `concurrency` requests in flight; a request that times out, cannot connect or gets HTTP 429/5xx is
    retried `retries` times with doubling backoff, so one request takes at most about
    (retries + 1) * timeout_s + backoff_s * (2**retries - 1) and a dead endpoint never hangs the run."""

    def __init__(self, cfg: JudgeConfig, field: str):
        self.cfg, self.field = cfg, field
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self._pool: ThreadPoolExecutor | None = None

    def replies(self, messages: list[list[dict]]) -> list[tuple[str | Exception, int, float]]:
        """(reply or error, retries, seconds) per conversation."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="covrl-judge")
        return list(self._pool.map(self._ask, messages))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _request(self, messages: list[dict]) -> str:
        body: dict[str, Any] = {"messages": messages, "max_tokens": self.cfg.max_new_tokens, "temperature": 0.0}
        if self.cfg.model is not None:
            body["model"] = self.cfg.model
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key_env:
            headers["Authorization"] = f"Bearer {os.environ.get(self.cfg.api_key_env, '')}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as response:
            raw = response.read()
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(f"judge endpoint {self.url} sent no choices[0].message.content: {raw[:300]!r}") from None
        if not isinstance(content, str):
            raise JudgeError(f"judge endpoint {self.url} sent a non-text message content: {content!r:.300}")
        return content

    def _ask(self, messages: list[dict]) -> tuple[str | Exception, int, float]:
        t0 = time.perf_counter()
        attempts = self.cfg.retries + 1
        for attempt in range(attempts):
            got = self._attempt(messages)
            if isinstance(got, str):
                return got, attempt, time.perf_counter() - t0
            retry, err = got
            if not retry or attempt == attempts - 1:
                break
            time.sleep(self.cfg.backoff_s * 2 ** attempt)
        if attempt:
            err = type(err)(f"{err} (after {attempt + 1} attempts)")
        return err, attempt, time.perf_counter() - t0

    def _attempt(self, messages) -> str | tuple[bool, JudgeError]:
        """The reply, or (retryable, the error)."""
        where = f"judge endpoint {self.url} ({self.field}.base_url)"
        try:
            return self._request(messages)
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode("utf-8", "replace")
            return err.code == 429 or err.code >= 500, JudgeError(f"{where} answered HTTP {err.code}: {detail}")
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                return True, JudgeTimeout(f"{where} did not answer within {self.cfg.timeout_s} s")
            return True, JudgeError(f"{where} is unreachable: {err.reason} (is the server running?)")
        except TimeoutError:
            return True, JudgeTimeout(f"{where} did not answer within {self.cfg.timeout_s} s")
        except JudgeError as err:
            return False, err
        except (OSError, http.client.HTTPException) as err:   # a connection reset or dropped mid-answer
            return True, JudgeError(f"{where} failed: {type(err).__name__}: {err}")


class _LocalBackend:
    """A local causal LM: the filled prompts in the judge tokenizer's chat template (plain text without one),
    left-padded, `batch_size` a greedy generate call of max_new_tokens; a failing call fails its batch."""

    def __init__(self, cfg: JudgeConfig, field: str):
        self.cfg, self.field = cfg, field
        self.folder = _check_folder(cfg.path, f"{field}.path")
        self._lock = threading.Lock()

    def _load(self):
        key = ("judge", str(self.folder.resolve()), _device(self.cfg.device), self.cfg.dtype)

        def load():
            from covrl.models import load_pretrained

            try:
                model, tok = load_pretrained(self.folder, self.cfg.dtype)   # left-padded, pad token set
            except Exception as err:  # noqa: BLE001
                raise RewardFunctionError(f"{self.field}.path={self.cfg.path!r}: cannot load the judge model: "
                                          f"{type(err).__name__}: {err}") from err
            if tok is None:
                raise RewardFunctionError(f"{self.field}.path={self.cfg.path!r}: the folder has no tokenizer")
            return model.eval().to(key[2]), tok
        return _cached(key, load)

    def prompt_text(self, tok, messages: list[dict]) -> str:
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return "\n\n".join(m["content"] for m in messages)

    def replies(self, messages: list[list[dict]]) -> list[tuple[str | Exception, int, float]]:
        import torch

        model, tok = self._load()
        out: list[tuple[str | Exception, int, float]] = []
        size = self.cfg.batch_size
        for start in range(0, len(messages), size):
            chunk = messages[start:start + size]
            t0 = time.perf_counter()
            try:
                texts = [self.prompt_text(tok, m) for m in chunk]
                templated = bool(getattr(tok, "chat_template", None))
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)
                device = next(model.parameters()).device
                with self._lock, torch.no_grad():
                    gen = model.generate(input_ids=enc["input_ids"].to(device),
                                         attention_mask=enc["attention_mask"].to(device), do_sample=False,
                                         max_new_tokens=self.cfg.max_new_tokens, pad_token_id=tok.pad_token_id)
                new = gen[:, enc["input_ids"].shape[1]:]
                replies: list[str | Exception] = tok.batch_decode(new, skip_special_tokens=True)
            except Exception as err:  # noqa: BLE001 - fails this batch's completions, counted
                replies = [JudgeError(f"the local judge ({self.field}.path) failed: {type(err).__name__}: {err}")
                           ] * len(chunk)
            seconds = time.perf_counter() - t0
            out.extend((r, 0, seconds) for r in replies)
        return out

    def close(self) -> None:
        pass


class JudgeTerm(_BatchTerm):
    """An LLM judge: judge.template filled with the example's prompt, the completion and the reference answer,
    sent as the user message (after judge.system_prompt), the reply's grade parsed into [0, 1]. A request that
    fails after its retries, and a reply without a grade, fail their completion (counted; the reply is shown).
    Logs reward/judge/<name>/{mean (of the parsed grades), parse_failures, request_errors, retries, latency_s
    (mean seconds per request), latency_max_s}."""

    def __init__(self, task_cfg: TaskConfig, index: int, term: RewardTermConfig):
        super().__init__(task_cfg, term.log_name, f"judge {term.log_name}")
        self.cfg: JudgeConfig = term.judge
        self.field = f"task.rewards[{index}].judge"
        backend = _HTTPBackend if self.cfg.base_url is not None else _LocalBackend
        self.backend = backend(self.cfg, self.field)

    def conversation(self, completion: str, example: Example) -> list[dict[str, str]]:
        text = fill_template(self.cfg.template, example.prompt, completion, example.answer)
        messages = [{"role": "user", "content": text}]
        if self.cfg.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        return messages

    def _score(self, completions, examples):
        answers = self.backend.replies([self.conversation(c, ex) for c, ex in zip(completions, examples)])
        results: list[float | Exception] = []
        parse_failures = request_errors = retries = 0
        for reply, tries, _ in answers:
            retries += tries
            if isinstance(reply, Exception):
                request_errors += 1
                results.append(reply)
                continue
            try:
                results.append(parse_grade(reply, self.cfg))
            except JudgeParseError as err:
                parse_failures += 1
                results.append(err)
        grades = [r for r in results if isinstance(r, float)]
        seconds = [s for _, _, s in answers]
        prefix = f"reward/judge/{self.name}"
        self.step_metrics = {
            **({f"{prefix}/mean": sum(grades) / len(grades)} if grades else {}),
            f"{prefix}/parse_failures": float(parse_failures),
            f"{prefix}/request_errors": float(request_errors),
            f"{prefix}/retries": float(retries),
            **({f"{prefix}/latency_s": sum(seconds) / len(seconds), f"{prefix}/latency_max_s": max(seconds)}
               if seconds else {}),
        }
        return results

    def close(self) -> None:
        super().close()
        self.backend.close()


# kind -> term(task_cfg, index in task.rewards, term config); kind fn is Task's own (a reward function)
TERM_KINDS: dict[str, Callable[[TaskConfig, int, RewardTermConfig], RewardRunner]] = {
    "model": RewardModelTerm,
    "judge": JudgeTerm,
}
