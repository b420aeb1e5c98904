"""Pydantic configuration of a task."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from covrl.settings import Section
from covrl.tasks.registry import TASKS


class ArithmeticConfig(Section):
    """Problems like "Compute 7+5." (chat) / "7+5=" (plain)."""

    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], min_length=1,
                                              description="operators drawn uniformly between operands")
    digits: int = Field(1, ge=1, le=6, description="digits per operand (1: 0..9, 2: 10..99, ...)")
    num_terms: int = Field(2, ge=2, le=5, description="operands per problem (3+ = multi-step, usual precedence)")
    allow_negative: bool = Field(True, description="keep problems whose result is negative")


class LettersConfig(Section):
    """Random lowercase words for the count_letters / sort_letters tasks."""

    alphabet: str = Field("abcdefgh", min_length=2, description="letters the words are drawn from")
    min_length: int = Field(3, ge=1, le=64, description="shortest word")
    max_length: int = Field(6, ge=1, le=64, description="longest word")

    @model_validator(mode="after")
    def _check(self):
        if self.max_length < self.min_length:
            raise ValueError(f"letters.max_length={self.max_length} < letters.min_length={self.min_length}")
        return self


class FibChainConfig(Section):
    """A Fibonacci-style recurrence worked out step by step: plain prompt "03,05:" (two seeds), worked solution
    "a:03+05=08;b:05+08=13;c:08+13=21;...;#NN" (each step adds the last two values mod `modulus` and names its
    label; the result after '#'). Every step reads only the step before it, so the working is long but local:
    11 characters a step, 24 steps make a ~268-token response on the character tokenizer."""

    min_steps: int = Field(24, ge=1, le=52, description="fewest written steps per problem")
    max_steps: int = Field(24, ge=1, le=52, description="most written steps per problem (labels a-z then A-Z: <= 52)")
    modulus: int = Field(100, ge=2, le=10_000, description="values are taken mod this and written with a fixed "
                         "number of digits (100: two digits, '07')")

    @model_validator(mode="after")
    def _check(self):
        if self.max_steps < self.min_steps:
            raise ValueError(f"fib_chain.max_steps={self.max_steps} < fib_chain.min_steps={self.min_steps}")
        return self


class ReasoningGymConfig(Section):
    """A reasoning-gym procedural dataset (extra covrl[reasoning]; generated locally, nothing downloaded)."""

    dataset: str | None = Field(None, min_length=1, description="reasoning-gym dataset name, e.g. "
                                "basic_arithmetic, leg_counting, chain_sum (required for task.name=reasoning_gym)")
    options: dict[str, Any] = Field(default_factory=dict, description="the dataset's own config options, e.g. "
                                    "{min_terms: 2, max_terms: 2} for basic_arithmetic")
    size: int | None = Field(None, ge=1, le=10_000_000, description="distinct training problems generated "
                             "(task.n_train cycles through them); None = task.n_train")


class OverlongRewardConfig(Section):
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_tokens - buffer response tokens, then
    falling linearly to -penalty at max_tokens."""

    buffer: int = Field(0, ge=0, le=1_000_000, description="length of the penalised stretch before the budget, "
                        "in tokens (0: off)")
    penalty: float = Field(1.0, ge=0, description="penalty at the budget (DAPO: 1.0)")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000, description="the response budget; None = "
                                   "sampler.max_new_tokens (filled in by the run's config)")


Signature = Literal["auto", "covrl", "trl"]


class MessageConfig(Section):
    """One chat message of a demonstration (`task.env.demonstration`)."""

    role: Literal["user", "assistant", "tool"] = Field(..., description="who speaks: user, assistant or tool")
    content: str = Field(..., description="the message text (an assistant message may hold <tool_call> blocks)")


class EnvironmentConfig(Section):
    """Multi-turn episodes (covrl.tasks.environments; docs/environments.md). No name = single-turn rollouts."""

    name: str | None = Field(None, description="environment registry name (single_turn, calculator, add) or a "
                             "user class 'module:Class' / 'file.py:Class' (an Environment, or a TRL "
                             "environment_factory object); None = ordinary single-turn rollouts")
    max_turns: int = Field(4, ge=1, le=256, description="assistant turns per episode at most")
    max_tool_calls: int = Field(4, ge=0, le=1024, description="tool calls per episode at most (a message after "
                                "the limit is the final answer)")
    tool_timeout_s: float | None = Field(5.0, gt=0, le=86400.0, description="per-call timeout of a tool "
                                         "(thread-isolated like user rewards; None = no timeout)")
    demonstration: list[MessageConfig] = Field(default_factory=list, description="a worked episode shown "
                                               "before the problem, as earlier turns of the conversation (user, "
                                               "assistant with a <tool_call>, tool result, final answer): a small "
                                               "model that never writes the call format unprompted copies it, "
                                               "so RL has calls to reinforce (empty = none)")


class RewardTermConfig(Section):
    """One weighted term of `task.rewards`: the run's reward is Σ weight·fn(...), each term logged."""

    fn: str = Field(..., min_length=1, description="reward registry name, or a user reward 'module:function' / "
                    "'file.py:function'")
    weight: float = Field(1.0, description="weight of this term in the summed reward")
    name: str | None = Field(None, min_length=1, description="name in the logs (task/reward/<name>); default: "
                             "the registry name or the function's name")
    signature: Signature = Field("auto", description="covrl: fn(completion, example) -> float; trl: "
                                 "fn(completions, **columns) -> list[float]; auto: from the parameters")

    @field_validator("weight", mode="before")
    @classmethod
    def _no_bool(cls, v):
        if isinstance(v, bool):   # pydantic would read `weight: true` as 1.0
            raise ValueError(f"weight must be a number, not a boolean; got {v!r}")
        return v

    @property
    def log_name(self) -> str:
        return self.name or self.fn.rpartition(":")[2]


class TaskConfig(Section):
    """Which problems to pose and how to score them."""

    name: str = Field("arithmetic", description="task registry name: arithmetic, count_letters, "
                      "sort_letters, fib_chain (long worked solutions), jsonl (path = a .jsonl file), hf_dataset (path = a local datasets folder), "
                      "reasoning_gym (task.reasoning_gym.dataset)")
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig, description="arithmetic options")
    letters: LettersConfig = Field(default_factory=LettersConfig, description="count/sort letters options")
    fib_chain: FibChainConfig = Field(default_factory=FibChainConfig, description="fib_chain options (a "
                                      "multi-step recurrence whose worked solution is the demonstration)")
    env: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="multi-turn episodes with "
                                   "tools (env.name set) instead of single-turn completions")
    reasoning_gym: ReasoningGymConfig = Field(default_factory=ReasoningGymConfig,
                                              description="reasoning-gym dataset (task.name=reasoning_gym)")
    overlong_reward: OverlongRewardConfig = Field(default_factory=OverlongRewardConfig,
                                                  description="soft overlong punishment added to the reward")
    path: str | None = Field(None, description="data file/folder for jsonl / hf_dataset tasks")
    eval_path: str | None = Field(None, description="separate eval file/folder (else n_eval rows split off)")
    prompt_field: str = Field("prompt", min_length=1, description="record field holding the prompt")
    answer_field: str = Field("answer", min_length=1, description="record field holding the reference answer")
    split: str = Field("train", description="split to read from an hf_dataset folder")
    reward: str = Field("auto", description="reward registry name (last_number, exact_match, format, "
                        "last_number_format, final_answer, math_verify, reasoning_gym) or auto = the task's natural reward")
    reward_fn: str | None = Field(None, description="user reward 'module:function' or 'file.py:function'; "
                                  "overrides `reward`; signature fn(completion: str, example) -> float, or "
                                  "TRL's fn(completions, **columns) -> list[float]")
    reward_signature: Signature = Field("auto", description="signature of reward_fn: covrl (per completion), trl "
                                        "(per batch, TRL's), auto = detected from its parameters")
    rewards: list[RewardTermConfig] = Field(default_factory=list, description="weighted reward terms "
                                            "[{fn, weight, name, signature}, ...]: reward = sum of weight*fn; "
                                            "overrides `reward`; each logged as task/reward/<name>")
    grader: str = Field("auto", description="reward registry name whose value >= 1 means correct "
                        "(accuracy); auto = the task's natural grader (math_verify when task.reward=math_verify)")
    n_train: int = Field(1000, ge=1, le=10_000_000, description="training examples (drawn from the train pool)")
    n_eval: int = Field(50, ge=0, le=1_000_000, description="held-out eval examples, disjoint from train")
    seed: int = Field(0, ge=0, description="seed of problem generation and of the train/eval split")
    chat_template: bool = Field(True, description="wrap prompts in the tokenizer's chat template; false = "
                                "plain prompts (e.g. '7+5=') for models without one")
    system_prompt: str | None = Field(None, description="system message for the chat template (None = the "
                                      "template's default)")
    max_prompt_tokens: int = Field(512, ge=1, le=1_000_000, description="longest prompt in tokens")
    overlong: Literal["truncate", "error"] = Field("truncate", description="prompts over max_prompt_tokens: "
                                                   "truncate (keep the last tokens) or raise an error")
    reward_timeout_s: float | None = Field(5.0, gt=0, le=86400.0, description="per-call timeout for user reward "
                                           "functions (thread-based; None = no timeout)")
    reward_isolation: Literal["thread", "process"] = Field(
        "thread", description="where user reward calls run: a worker thread (cheap; a hang is abandoned) "
        "or a spawned worker process (a hang or crash is killed)")
    reward_errors: Literal["zero", "raise"] = Field("zero", description="a failing user reward call: "
                                                    "reward 0 and counted (zero) or stop (raise)")
    max_consecutive_reward_errors: int | None = Field(8, ge=1, le=1_000_000, description="with reward_errors="
                                                      "zero: stop the run (exit 2, the function's traceback "
                                                      "shown) after this many batches in a row on which a reward "
                                                      "function failed for every completion; None = never stop")
    max_reward_error_rate: float | None = Field(
        0.5, ge=0.0, lt=1.0, description="with reward_errors=zero: stop the run (exit 2, the first failure's "
                                         "traceback shown) when more than this fraction of a reward function's "
                                         "last task.reward_error_window completions failed; None = never")
    reward_error_window: int = Field(64, ge=1, le=1_000_000, description="completions over which "
                                                                        "task.max_reward_error_rate is measured")

    @field_validator("name")
    @classmethod
    def _known_task(cls, v: str) -> str:
        if v not in TASKS:
            raise ValueError(f"task.name={v!r}; allowed: {sorted(TASKS)}")
        return v

    @model_validator(mode="after")
    def _one_reward_source(self):
        if self.rewards and self.reward_fn:
            raise ValueError("set either task.reward_fn or task.rewards (a list of weighted terms), not both")
        names = [t.log_name for t in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"task.rewards: term names must be distinct (set `name`); got {names}")
        return self

    @model_validator(mode="after")
    def _needs_path(self):
        if self.name in ("jsonl", "hf_dataset") and not self.path:
            raise ValueError(f"task.path is required for task.name={self.name!r}")
        if self.name == "reasoning_gym" and not self.reasoning_gym.dataset:
            raise ValueError("task.reasoning_gym.dataset is required for task.name='reasoning_gym' (e.g. "
                             "basic_arithmetic, leg_counting)")
        return self
