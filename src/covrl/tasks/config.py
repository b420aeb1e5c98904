"""Pydantic configuration of a task."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from covrl.settings import Section, config_note, known_name
from covrl.tasks.agent import AgentConfig
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


class OpenEnvConfig(Section):
    """An OpenEnv environment server (task.env.name=openenv; covrl.tasks.openenv, docs/environments.md): one
    WebSocket session per episode, the assistant's message as the action, the observation as the next user
    message."""

    base_url: str | list[str] | None = Field(None, description="a running server (http://host:port or "
                                             "ws://host:port), or a list of them: each episode opens its session "
                                             "on the least busy one")
    server: str | None = Field(None, min_length=3, description="'module:app' / 'file.py:app': an OpenEnv app "
                               "(create_app) that covrl serves with uvicorn on 127.0.0.1 from the first episode "
                               "and stops at exit (instead of base_url)")
    servers: int = Field(1, ge=1, le=256, description="local servers started for `server`: an app holding one "
                         "session at a time (OpenEnv's default) needs one per episode running at once")
    client: str | None = Field(None, min_length=3, description="'module:Class': the environment's EnvClient "
                               "subclass; None = OpenEnv's GenericEnvClient (dict actions and observations)")
    action: str | None = Field(None, min_length=3, description="'module:Class': the Action class, built as "
                               "Class(**{action_field: text}, **action_extra); None = a dict (the server "
                               "validates it against its own Action class)")
    action_field: str = Field("message", min_length=1, description="action field that receives the "
                              "assistant's message")
    action_extra: dict[str, Any] = Field(default_factory=dict, description="constant fields added to every "
                                         "action")
    observation_field: str | None = Field(None, min_length=1, description="observation field shown to the "
                                          "model as the next user message; None = the observation's only text "
                                          "field, else all its fields as JSON")
    opening: Literal["observation", "task", "task+observation"] = Field(
        "observation", description="the first user message: the reset observation's text, the task's prompt, "
        "or the task's prompt followed by the observation's text")
    reset_fields: list[str] | None = Field(None, description="keyword arguments sent to reset, from: seed (the "
                                           "same for a prompt's episodes), episode_id, prompt, the answer field, "
                                           "the example's other fields; None = all (the server passes on only "
                                           "those its reset accepts)")
    reward_mode: Literal["sum", "last", "task"] = Field(
        "sum", description="episode reward: the sum or the last of the step rewards (None from every step = "
        "the task's reward scores the final message), or task = always the task's reward")
    timeout_s: float = Field(30.0, gt=0, le=3600.0, description="seconds to connect and per reset / step "
                             "answer; past it the call fails with the server's URL")
    startup_timeout_s: float = Field(120.0, gt=0, le=3600.0, description="seconds for a `server` started by "
                                     "covrl to answer /health")

    @model_validator(mode="after")
    def _one_source(self):
        if self.base_url is not None and self.server is not None:
            raise ValueError("set task.env.openenv.base_url (a running server) or task.env.openenv.server (an "
                             "app covrl starts), not both")
        if self.servers > 1 and self.server is None:
            raise ValueError("task.env.openenv.servers > 1 needs task.env.openenv.server (list running servers in "
                             "base_url instead)")
        return self


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
    openenv: OpenEnvConfig = Field(default_factory=OpenEnvConfig, description="the OpenEnv server and its "
                                   "text <-> action / observation mapping (task.env.name=openenv)")


DEFAULT_JUDGE_TEMPLATE = """You are grading a response to a task.

Task:
{prompt}

Reference answer:
{answer}

Response:
{completion}

How correct is the response? Reply with a line "Grade: N", N an integer from 0 (wrong) to 10 (fully correct)."""

TorchDType = Literal["auto", "float32", "bfloat16", "float16"]


class RewardModelConfig(Section):
    """A transformers sequence-classification model scoring prompt + completion (a `task.rewards` term of
    kind model)."""

    path: str = Field(..., min_length=1, description="local folder of an AutoModelForSequenceClassification "
                      "model with its tokenizer (never downloaded)")
    batch_size: int = Field(16, ge=1, le=65536, description="completions per forward pass")
    max_length: int = Field(2048, ge=8, le=1_000_000, description="tokens per scored text; longer texts keep "
                            "their last max_length tokens (the completion's end, where the score is read)")
    label: int | str = Field(0, description="which logit is the score: an index, or a label name of the "
                             "model's config (id2label)")
    normalise: Literal["none", "sigmoid", "softmax"] = Field(
        "none", description="none: the raw logit; sigmoid: sigmoid(logit) in [0, 1]; softmax: the label's "
        "probability over the model's labels")
    chat_template: bool = Field(True, description="score the reward model's own chat template around "
                                "[user: prompt, assistant: completion] when its tokenizer has one (else the "
                                "prompt text followed by the completion)")
    device: str = Field("cpu", min_length=1, description="torch device of the reward model (cpu, cuda, "
                        "cuda:1, ...; auto = cuda when available)")
    dtype: TorchDType = Field("float32", description="parameter dtype (auto: as stored)")


class JudgeConfig(Section):
    """An LLM judge grading each completion (a `task.rewards` term of kind judge): a prompt template, a grade
    parser and a backend, either an OpenAI-compatible endpoint (`base_url`) or a local causal LM (`path`)."""

    base_url: str | None = Field(None, min_length=1, description="OpenAI-compatible API root, e.g. "
                                 "http://127.0.0.1:8000/v1 (vllm serve); requests go to <base_url>/chat/completions")
    model: str | None = Field(None, min_length=1, description="model name sent to the endpoint (vllm serve: the "
                              "served model name); None = not sent")
    api_key_env: str | None = Field(None, min_length=1, description="environment variable holding a bearer "
                                    "token for the endpoint (None = no Authorization header)")
    path: str | None = Field(None, min_length=1, description="local folder of a causal LM judge (transformers "
                             "generate, greedy), instead of base_url")
    template: str = Field(DEFAULT_JUDGE_TEMPLATE, min_length=1, description="the judge's prompt: {prompt}, "
                          "{completion} and {answer} are replaced, other braces are literal")
    system_prompt: str | None = Field(None, description="system message sent before the template (None = none)")
    parse: Literal["number", "label"] = Field(
        "number", description="number: the last match of `pattern` (its first group a number g) gives "
        "(g - min_grade) / (max_grade - min_grade), a g outside [min_grade, max_grade] is an error; label: the "
        "last of `labels` found as a whole word (case-insensitive) gives its value")
    pattern: str = Field(r"(?i)grade\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)", min_length=1,
                         description="regex whose first group is the grade (parse=number)")
    min_grade: float = Field(0.0, description="lowest grade (maps to 0)")
    max_grade: float = Field(10.0, description="highest grade (maps to 1)")
    labels: dict[str, float] = Field(default_factory=lambda: {"yes": 1.0, "no": 0.0},
                                     description="word -> value in [0, 1] (parse=label)")
    max_new_tokens: int = Field(64, ge=1, le=65536, description="longest judge reply in tokens")
    timeout_s: float = Field(30.0, gt=0, le=86400.0, description="per-request timeout of the endpoint (socket "
                             "timeout: connect and each read)")
    retries: int = Field(2, ge=0, le=100, description="retries of a request that timed out, could not connect "
                         "or got HTTP 429/5xx (other 4xx are not retried)")
    backoff_s: float = Field(0.5, ge=0, le=600.0, description="wait before the first retry, doubled each retry")
    concurrency: int = Field(8, ge=1, le=1024, description="requests in flight at once")
    batch_size: int = Field(8, ge=1, le=65536, description="prompts per generate call (local judge)")
    device: str = Field("cpu", min_length=1, description="torch device of a local judge (auto = cuda when "
                        "available)")
    dtype: TorchDType = Field("float32", description="parameter dtype of a local judge (auto: as stored)")

    @model_validator(mode="after")
    def _check(self):
        if (self.base_url is None) == (self.path is None):
            raise ValueError("judge: set exactly one of base_url (an OpenAI-compatible endpoint) and path (a "
                             "local causal LM folder)")
        if "{completion}" not in self.template:
            raise ValueError("judge.template has no {completion} placeholder: the judge would not see the response")
        if self.parse == "number":
            try:
                groups = re.compile(self.pattern).groups
            except re.error as err:
                raise ValueError(f"judge.pattern={self.pattern!r} is not a regex: {err}") from None
            if groups < 1:
                raise ValueError(f"judge.pattern={self.pattern!r} has no group; its first group is the grade")
            if not self.max_grade > self.min_grade:
                raise ValueError(f"judge.max_grade={self.max_grade} must exceed judge.min_grade={self.min_grade}")
        else:
            if not self.labels:
                raise ValueError("judge.labels is empty (parse=label)")
            bad = {k: v for k, v in self.labels.items() if not 0.0 <= v <= 1.0 or not k.strip()}
            if bad:
                raise ValueError(f"judge.labels: values must lie in [0, 1] and words be non-empty; got {bad}")
        return self


RewardKind = Literal["fn", "model", "judge"]


class RewardTermConfig(Section):
    """One weighted term of `task.rewards`: the run's reward is Σ weight·term(...), each term logged. kind fn: a
    reward function; model: a reward model (`model`); judge: an LLM judge (`judge`)."""

    kind: RewardKind = Field("fn", description="fn: a reward function (`fn`); model: a sequence-classification "
                             "reward model (`model`); judge: an LLM judge (`judge`)")
    fn: str | None = Field(None, min_length=1, description="reward registry name, or a user reward "
                           "'module:function' / 'file.py:function' (kind fn)")
    model: RewardModelConfig | None = Field(None, description="the reward model (kind model)")
    judge: JudgeConfig | None = Field(None, description="the judge (kind judge)")
    weight: float = Field(1.0, description="weight of this term in the summed reward")
    name: str | None = Field(None, min_length=1, description="name in the logs (task/reward/<name>); default: "
                             "the registry name or the function's name (kind fn), else the kind")
    signature: Signature = Field("auto", description="covrl: fn(completion, example) -> float; trl: "
                                 "fn(completions, **columns) -> list[float]; auto: from the parameters (kind fn)")

    @field_validator("weight", mode="before")
    @classmethod
    def _no_bool(cls, v):
        if isinstance(v, bool):   # pydantic would read `weight: true` as 1.0
            raise ValueError(f"weight must be a number, not a boolean; got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_source(self):
        given = {k for k in ("fn", "model", "judge") if getattr(self, k) is not None}
        if self.kind not in given:
            raise ValueError(f"a reward term of kind {self.kind} needs `{self.kind}`"
                             + (f" (found {', '.join(sorted(given))}: set kind accordingly)" if given else ""))
        if given != {self.kind}:
            raise ValueError(f"a reward term of kind {self.kind} takes `{self.kind}` only; remove "
                             f"{', '.join(sorted(given - {self.kind}))} (or change kind)")
        return self

    @property
    def log_name(self) -> str:
        if self.name:
            return self.name
        return self.fn.rpartition(":")[2] if self.kind == "fn" else self.kind


class VerifiersConfig(Section):
    """A verifiers environment (task.name=verifiers; covrl.tasks.verifiers_env, docs/environments.md): its taskset,
    played by covrl's policy through verifiers' own harness and runtime."""

    taskset: str | None = Field(None, min_length=1, description="the taskset: an installed module exporting its "
                                "Taskset (a verifiers id, e.g. my_taskset or owner/my-taskset) or a folder holding "
                                "that package (required for task.name=verifiers)")
    options: dict[str, Any] = Field(default_factory=dict, description="the taskset's own config fields")
    env_options: dict[str, Any] = Field(default_factory=dict, description="fields of the environment's config "
                                        "(verifiers EnvConfig: id, max_concurrent_agents, an env's own fields)")
    harness: str = Field("null", min_length=1, description="the agent's harness id (null: verifiers' chat loop)")
    harness_options: dict[str, Any] = Field(default_factory=dict, description="the harness's config fields")
    runtime: dict[str, Any] = Field(default_factory=lambda: {"type": "subprocess"}, description="the harness "
                                    "runtime (verifiers RuntimeConfig; subprocess = processes on the host covrl runs on)")
    renderer: dict[str, Any] = Field(default_factory=dict, description="the renderers config that turns chats "
                                     "into tokens (e.g. {type: default, tool_parser: hermes}); empty = the "
                                     "tokenizer's chat template, no tool parsing")
    pool_size: int | None = Field(None, ge=1, le=10_000_000, description="tasks read after the held-out ones "
                                  "(the training pool); None = task.n_train")
    max_concurrent: int = Field(64, ge=1, le=100_000, description="episodes played at once")
    episode_timeout_s: float | None = Field(600.0, gt=0, le=86400.0, description="one episode's deadline "
                                            "(verifiers' env timeout); past it the episode fails, counted")


class TaskConfig(Section):
    """Which problems to pose and how to score them.

    Choices: `name` picks the task, and only that task's sub-section is read (`choices`); the reward is one
    weighted list `rewards`, of which `reward` (a registry name or a user function) is the one-term shorthand."""

    config_key: ClassVar[str] = "task"
    choices: ClassVar[dict[str, tuple[str, frozenset[str]]]] = {
        "arithmetic": ("name", frozenset({"arithmetic"})),
        "letters": ("name", frozenset({"count_letters", "sort_letters"})),
        "fib_chain": ("name", frozenset({"fib_chain"})),
        "reasoning_gym": ("name", frozenset({"reasoning_gym"})),
        "verifiers": ("name", frozenset({"verifiers"})),
    }

    name: Annotated[str, known_name(TASKS, "task")] = Field("arithmetic", description="task registry name: arithmetic, count_letters, "
                      "sort_letters, fib_chain (long worked solutions), jsonl (path = a .jsonl file), hf_dataset (path = a local datasets folder), "
                      "reasoning_gym (task.reasoning_gym.dataset), verifiers (task.verifiers.taskset)")
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig, description="arithmetic options")
    letters: LettersConfig = Field(default_factory=LettersConfig, description="count/sort letters options")
    fib_chain: FibChainConfig = Field(default_factory=FibChainConfig, description="fib_chain options (a "
                                      "multi-step recurrence whose worked solution is the demonstration)")
    env: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="multi-turn episodes with "
                                   "tools (env.name set) instead of single-turn completions")
    verifiers: VerifiersConfig = Field(default_factory=VerifiersConfig,
                                       description="verifiers environment (task.name=verifiers)")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="an agent program that calls covrl's "
                               "OpenAI-compatible endpoint (task.agent.fn or task.agent.command); its episodes are the "
                               "rollouts")
    reasoning_gym: ReasoningGymConfig = Field(default_factory=ReasoningGymConfig,
                                              description="reasoning-gym dataset (task.name=reasoning_gym)")
    overlong_reward: OverlongRewardConfig = Field(default_factory=OverlongRewardConfig,
                                                  description="soft overlong punishment added to the reward")
    path: str | None = Field(None, description="data file/folder for jsonl / hf_dataset tasks")
    eval_path: str | None = Field(None, description="separate eval file/folder (else rows split off: "
                                                        "task.n_eval / task.eval_fraction)")
    prompt_field: str = Field("prompt", min_length=1, description="record field holding the prompt")
    answer_field: str = Field("answer", min_length=1, description="record field holding the reference answer")
    split: str = Field("train", description="split to read from an hf_dataset folder")
    reward: str = Field("auto", min_length=1, description="the reward as one function: a registry name "
                        "(last_number, exact_match, format, last_number_format, final_answer, math_verify, "
                        "reasoning_gym), auto = the task's natural reward, or a user function 'module:function' / "
                        "'file.py:function' with signature fn(completion: str, example) -> float or TRL's "
                        "fn(completions, **columns) -> list[float]; shorthand of a one-term `rewards` (set one of "
                        "the two)")
    reward_signature: Signature = Field("auto", description="signature of a user function in `reward`: covrl (per "
                                        "completion), trl (per batch, TRL's), auto = detected from its parameters")
    rewards: list[RewardTermConfig] = Field(default_factory=list, description="weighted reward terms "
                                            "[{fn, weight, name, signature}, ...]: reward = sum of weight*fn; "
                                            "each logged as task/reward/<name>; a term "
                                            "{kind: model, model: {path}} is a reward model, {kind: judge, "
                                            "judge: {base_url | path}} an LLM judge (docs/training.md)")
    grader: str = Field("auto", description="reward registry name whose value >= 1 means correct "
                        "(accuracy); auto = the task's natural grader (math_verify when task.reward=math_verify)")
    n_train: int = Field(1000, ge=1, le=10_000_000, description="training examples (drawn from the train pool)")
    n_eval: int | None = Field(None, ge=0, le=1_000_000, description="held-out eval examples, disjoint from train "
                               "(a count); None: task.eval_fraction's rule")
    eval_fraction: float | None = Field(None, gt=0, lt=1, description="share of a data file's rows (jsonl, "
                                        "hf_dataset) or of an enumerable arithmetic space held out for eval; None "
                                        "with n_eval None: 0.2 of a data file's rows, at most 50, and 50 generated "
                                        "problems; set n_eval or eval_fraction, not both")
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

    @model_validator(mode="before")
    @classmethod
    def _old_reward_fn_key(cls, data: Any) -> Any:
        """`task.reward_fn: X` (the old key of a user function) reads as `task.reward: X`, with a note."""
        if not isinstance(data, dict) or "reward_fn" not in data:
            return data
        data = dict(data)
        spec = data.pop("reward_fn")
        if spec is None:   # a resolved config of an older version: nothing was set
            return data
        if data.get("reward", "auto") != "auto":
            raise ValueError(f"task.reward_fn={spec!r} and task.reward={data['reward']!r}: task.reward_fn is the old "
                             "name of task.reward (a registry name or 'module:function'); keep one")
        config_note(f"task.reward_fn is now task.reward (a registry name or a user 'module:function'); read "
                    f"task.reward_fn={spec!r} as task.reward={spec!r}")
        data["reward"] = spec
        return data

    @model_validator(mode="after")
    def _one_reward_source(self):
        if self.rewards and self.reward != "auto":
            raise ValueError(f"task.reward={self.reward!r} and task.rewards (a list of terms) are both set: "
                             "task.reward is the one-term shorthand; keep one (a term is {fn: NAME, weight: W})")
        names = [t.log_name for t in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"task.rewards: term names must be distinct (set `name`); got {names}")
        return self

    @model_validator(mode="after")
    def _one_eval_size(self):
        if self.n_eval is not None and self.eval_fraction is not None:
            raise ValueError(f"task.n_eval={self.n_eval} and task.eval_fraction={self.eval_fraction}: set one of "
                             "them (a count or a share of the rows), not both")
        return self

    @model_validator(mode="after")
    def _needs_path(self):
        if self.name in ("jsonl", "hf_dataset") and not self.path:
            raise ValueError(f"task.path is required for task.name={self.name!r}")
        if self.name == "verifiers" and not self.verifiers.taskset:
            raise ValueError("task.verifiers.taskset is required for task.name='verifiers' (an installed taskset "
                             "module or a folder holding one)")
        if self.name == "verifiers" and self.env.name is not None:
            raise ValueError(f"task.env.name={self.env.name!r}: a verifiers task runs its own episodes; leave "
                             "task.env.name unset")
        if self.name == "reasoning_gym" and not self.reasoning_gym.dataset:
            raise ValueError("task.reasoning_gym.dataset is required for task.name='reasoning_gym' (e.g. "
                             "basic_arithmetic, leg_counting)")
        return self
