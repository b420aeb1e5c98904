"""`Task`: examples + prompt encoding + scoring, the same for every data source."""

from __future__ import annotations

from covrl.tasks.base import Example, RewardOutput
from covrl.tasks.config import RewardTermConfig, TaskConfig
from covrl.tasks.graders import check_available
from covrl.tasks.reward_models import TERM_KINDS
from covrl.tasks.rewards import (
    ISOLATED_REWARDS,
    RewardRunner,
    detect_signature,
    is_user_reward,
    load_user_reward,
    overlong_penalty,
    resolve_reward,
)


class PromptTooLongError(ValueError):
    pass


DEFAULT_N_EVAL = 50            # held-out problems of a generated task (and the most a data file gives by default)
DEFAULT_EVAL_FRACTION = 0.2    # the share of a data file's rows held out when neither n_eval nor eval_fraction is set


def held_out_count(cfg: TaskConfig, total: int | None, *, data_file: bool = False) -> int:
    """How many examples a task's split holds out, the one rule for every source: `task.n_eval` when set;
    `task.eval_fraction` of `total` (the size of a finite problem set: a data file's rows, an enumerated space)
    when set; else DEFAULT_EVAL_FRACTION of a data file's rows, at most DEFAULT_N_EVAL (a small file keeps most
    of its rows for training, a large one holds out the same 50 as always), and DEFAULT_N_EVAL generated
    problems. `total` None: the source's size is not known in advance (problems are drawn without end)."""
    if cfg.n_eval is not None:
        return cfg.n_eval
    if cfg.eval_fraction is not None:
        if total is None:
            raise ValueError(f"task.eval_fraction={cfg.eval_fraction} needs a finite problem set to take a share "
                             f"of; task.name={cfg.name} draws its problems without a fixed total: set task.n_eval "
                             "(a count) instead")
        return max(1, round(cfg.eval_fraction * total))
    if data_file and total is not None:
        return min(DEFAULT_N_EVAL, max(1, round(DEFAULT_EVAL_FRACTION * total)))
    return DEFAULT_N_EVAL


def prompt_key(cfg: TaskConfig, example: Example) -> str:
    """The text that identifies a prompt as the model sees it (the plain prompt when the chat template is off)."""
    return example.prompt if cfg.chat_template else example.plain_prompt


class Task:
    """A verifiable task.

    name           registry name
    train, eval    lists of Example (eval is held out: the sources keep eval prompts out of train where they can)
    eval_repeats   held-out examples whose prompt also occurs in train (counted here, for every source: a
                   taskset that repeats its prompts cannot be split cleanly, and its held-out accuracy then
                   partly measures memorised prompts)
    encode         prompt token ids (chat template or plain format; overlong prompts per `cfg.overlong`)
    encode_answer  demonstration token ids (answer text + EOS) for supervised warm-up
    score          rewards (the optimised signal) and correctness (the grader) for completions
    """

    def __init__(self, cfg: TaskConfig, train: list[Example], eval: list[Example], *,
                 default_reward: str, default_grader: str):
        self.name = cfg.name
        self.cfg = cfg
        self.train = train
        self.eval = eval
        trained = {prompt_key(cfg, e) for e in train}
        self.eval_repeats = sum(1 for e in eval if prompt_key(cfg, e) in trained)
        self.reward_name = default_reward if cfg.reward == "auto" else cfg.reward
        auto_grader = "math_verify" if cfg.reward == "math_verify" else default_grader
        self.grader_name = auto_grader if cfg.grader == "auto" else cfg.grader
        if cfg.rewards:
            # weighted terms, each logged, built by kind: fn (a reward function), model, judge (TERM_KINDS)
            builders = {"fn": self._function_term, **TERM_KINDS}
            self._terms = [(t.log_name, t.weight, builders[t.kind](cfg, i, t)) for i, t in enumerate(cfg.rewards)]
            self.reward_name = " + ".join(f"{w:g}*{n}" for n, w, _ in self._terms)
        else:
            self._terms = [(self.reward_name, 1.0, self._runner(self.reward_name, self.reward_name,
                                                                cfg.reward_signature,
                                                                user=is_user_reward(self.reward_name)))]
        self._reward = self._terms[0][2]
        if "math_verify" in {self.grader_name, *(t.fn for t in cfg.rewards), self.reward_name}:
            check_available()   # a missing extra fails at start-up, naming it
        # a grader that is the (single, built-in) reward reuses its values; one that can hang runs isolated
        self._grader_is_reward = not cfg.rewards and self.grader_name == self.reward_name
        self._grader = (self._runner(self.grader_name, self.grader_name, "covrl", user=False)
                        if self.grader_name in ISOLATED_REWARDS else resolve_reward(self.grader_name))
        self._cache: dict[tuple[int, str], list[int]] = {}
        self.num_truncated = 0
        # the response budget the overlong penalty counts towards when task.overlong_reward.max_tokens is unset
        self.response_budget: int | None = None
        # factory of a fresh Environment per episode (covrl.tasks.environments), set when task.env.name is
        self.environment = None
        self.env_failures = None   # its FailureWatch (covrl.tasks.failures), set with it

    def _function_term(self, cfg: TaskConfig, index: int, term: RewardTermConfig) -> RewardRunner:
        # a bare registry name is a built-in, anything else a user function
        return self._runner(term.fn, term.log_name, term.signature, user=is_user_reward(term.fn))

    def _runner(self, spec: str, name: str, signature: str, *, user: bool) -> RewardRunner:
        cfg = self.cfg
        fn = load_user_reward(spec) if user else resolve_reward(spec)
        if signature == "auto":
            signature = detect_signature(fn, spec)
        isolate = user or spec in ISOLATED_REWARDS   # with the timeout; the process worker imports the spec
        process_spec = ISOLATED_REWARDS.get(spec, spec) if (isolate and cfg.reward_isolation == "process") else None
        return RewardRunner(fn, name=name, timeout_s=cfg.reward_timeout_s, on_error=cfg.reward_errors, isolate=isolate,
                            process_spec=process_spec,
                            signature=signature, answer_field=cfg.answer_field,
                            max_consecutive_errors=cfg.max_consecutive_reward_errors,
                            error_window=cfg.reward_error_window, max_error_rate=cfg.max_reward_error_rate)

    def split_info(self) -> dict[str, int]:
        """The train/eval split in numbers (a run's summary.json `task`)."""
        return {"train_examples": len(self.train), "train_prompts": len({prompt_key(self.cfg, e) for e in self.train}),
                "eval_prompts": len(self.eval), "eval_repeats_train": self.eval_repeats}

    def repeats_warning(self) -> str | None:
        """The start-of-run warning when held-out prompts also occur in training (None when none do)."""
        if not self.eval_repeats:
            return None
        return (f"{self.eval_repeats} of the {len(self.eval)} held-out prompts of task {self.name!r} also occur among "
                "its training prompts: held-out accuracy partly measures prompts the run trains on (the data "
                "repeats its prompts; give distinct held-out prompts, e.g. task.eval_path, to measure "
                "generalisation)")

    def __repr__(self) -> str:
        return (f"Task({self.name!r}, train={len(self.train)}, eval={len(self.eval)}, "
                f"reward={self.reward_name!r}, grader={self.grader_name!r})")

    def close(self) -> None:
        """Release the reward worker processes (reward_isolation="process"); the task stays usable."""
        for _, _, runner in self._terms:
            runner.close()
        if isinstance(self._grader, RewardRunner):
            self._grader.close()

    def prompt_text(self, tokenizer, example: Example) -> str:
        """The text the model is conditioned on: the chat template around `example.prompt` (with the
        assistant turn opened), or `example.plain_prompt` when `chat_template` is off."""
        if not self.cfg.chat_template:
            return example.plain_prompt
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("task.chat_template=true but the tokenizer has no chat template; set "
                             "task.chat_template=false for plain prompts (e.g. the tiny char model)")
        messages = []
        if self.cfg.system_prompt is not None:
            messages.append({"role": "system", "content": self.cfg.system_prompt})
        messages.append({"role": "user", "content": example.prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, tokenizer, example: Example) -> list[int]:
        """Prompt token ids. Over `max_prompt_tokens`: keep the LAST max_prompt_tokens ids (the question and
        the opened assistant turn sit at the end) or raise PromptTooLongError (`overlong="error"`)."""
        key = (id(tokenizer), example.prompt if self.cfg.chat_template else example.plain_prompt)
        ids = self._cache.get(key)
        if ids is None:
            ids = list(tokenizer(self.prompt_text(tokenizer, example), add_special_tokens=False)["input_ids"])
            if len(self._cache) < 1_000_000:
                self._cache[key] = ids
        limit = self.cfg.max_prompt_tokens
        if len(ids) > limit:
            if self.cfg.overlong == "error":
                raise PromptTooLongError(
                    f"prompt of {len(ids)} tokens exceeds task.max_prompt_tokens={limit} "
                    f"(prompt {example.prompt[:80]!r}); raise the limit or set task.overlong='truncate'")
            self.num_truncated += 1
            ids = ids[-limit:]
        return list(ids)

    def encode_answer(self, tokenizer, example: Example) -> list[int]:
        """Demonstration completion ids: the answer text followed by the EOS token."""
        ids = list(tokenizer(example.answer, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(int(tokenizer.eos_token_id))
        return ids

    def score(self, completions: list[str], examples: list[Example],
              lengths: list[int] | None = None) -> RewardOutput:
        """rewards_i = reward(completion_i, example_i) (0.0 on error/timeout, counted in `errors`), or
        Σ_k weight_k·term_k with `task.rewards` (each term's mean in reward/reward/<name>, its failures in
        reward/errors/<name>, and a reward model's / judge's own reward/model/<name>/..., reward/judge/<name>/...);
        correct_i = grader(completion_i, example_i) >= 1. Empty completions are scored
        like any text. With `task.overlong_reward.buffer > 0` and the response `lengths` in tokens, DAPO's soft
        overlong penalty is added to each reward (reward/overlong_penalty: its mean; reward/overlong_frac: the
        fraction of responses penalised); the grader's verdict is unchanged."""
        if len(completions) != len(examples):
            raise ValueError(f"score: {len(completions)} completions but {len(examples)} examples")
        n = max(len(completions), 1)
        rewards = [0.0] * len(completions)
        errors = timeouts = 0
        per_term: dict[str, float] = {}
        terms: dict[str, list[float]] = {}   # each term's own values, for estimators that take them (gdpo)
        term_weights: dict[str, float] = {}
        for name, weight, runner in self._terms:
            values, term_errors, term_timeouts = runner(completions, examples)
            rewards = [r + weight * v for r, v in zip(rewards, values)]
            terms[name], term_weights[name] = [float(v) for v in values], float(weight)
            errors, timeouts = errors + term_errors, timeouts + term_timeouts
            if self.cfg.rewards:
                per_term[f"reward/reward/{name}"] = sum(values) / n
                per_term[f"reward/errors/{name}"] = float(term_errors)
                per_term.update(getattr(runner, "step_metrics", {}))   # a model / judge term's own
        if self._grader_is_reward:
            correct = [v >= 1.0 for v in values]
        elif isinstance(self._grader, RewardRunner):
            correct = [v >= 1.0 for v in self._grader(completions, examples)[0]]
        else:
            correct = [self._grader(c, e) >= 1.0 for c, e in zip(completions, examples)]
        ocfg = self.cfg.overlong_reward
        if ocfg.buffer > 0 and lengths is not None:
            budget = ocfg.max_tokens if ocfg.max_tokens is not None else self.response_budget
            if budget is None:
                raise ValueError("task.overlong_reward.max_tokens is unset and the task was built without the "
                                 "sampler's budget (build_task(cfg, response_budget=sampler.max_new_tokens))")
            if len(lengths) != len(completions):
                raise ValueError(f"score: {len(lengths)} lengths for {len(completions)} completions")
            penalties = [overlong_penalty(int(n_tok), budget, ocfg.buffer, ocfg.penalty) for n_tok in lengths]
            rewards = [r + p for r, p in zip(rewards, penalties)]
            per_term["reward/overlong_penalty"] = sum(penalties) / n
            terms["overlong_penalty"], term_weights["overlong_penalty"] = penalties, 1.0
            per_term["reward/overlong_frac"] = sum(p < 0 for p in penalties) / n
        metrics = {
            "reward/mean": sum(rewards) / n,
            "reward/accuracy": sum(correct) / n,
            "reward/errors": float(errors),
            "reward/timeouts": float(timeouts),
            "reward/empty": float(sum(1 for c in completions if not c.strip())),
            **per_term,
        }
        return RewardOutput(rewards=rewards, correct=correct, errors=errors, metrics=metrics, terms=terms,
                            term_weights=term_weights)
