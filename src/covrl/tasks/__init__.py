"""Verifiable tasks: built-in generators (arithmetic, letters), JSONL / local HF datasets, reward functions."""

from covrl.tasks.base import Example, RewardOutput
from covrl.tasks.config import ArithmeticConfig, EnvironmentConfig, LettersConfig, TaskConfig
from covrl.tasks.environments import ENVIRONMENTS, Environment, EnvStep, build_environment
from covrl.tasks.failures import FailureWatch, UserCodeError
from covrl.tasks.openenv import OpenEnvError  # noqa: F401 - registers task.env.name=openenv (imports openenv lazily)
from covrl.tasks.registry import TASKS, get_builder
from covrl.tasks.rewards import REWARDS, RewardFunctionError, load_user_reward, parse_last_number
from covrl.tasks.task import PromptTooLongError, Task


def build_task(cfg: TaskConfig, *, response_budget: int | None = None) -> Task:
    """The task named by `cfg.name` (see `TASKS`), with its train / held-out eval split and reward;
    `response_budget`: the sampler's max_new_tokens, what task.overlong_reward counts towards by default."""
    task = get_builder(cfg.name)(cfg)
    task.response_budget = response_budget
    if cfg.env.name is not None:
        task.environment = build_environment(task, cfg.env)
        # an environment's own failures (reset / step raising) follow the user-reward rule
        task.env_failures = FailureWatch(
            f"environment {cfg.env.name}", unit="environment steps", window=cfg.reward_error_window,
            max_rate=cfg.max_reward_error_rate, limits=f"task.max_reward_error_rate={cfg.max_reward_error_rate} over "
                                  f"task.reward_error_window={cfg.reward_error_window}")
    return task


__all__ = ["ENVIRONMENTS", "REWARDS", "TASKS", "ArithmeticConfig", "EnvStep", "Environment", "EnvironmentConfig",
           "Example", "LettersConfig", "PromptTooLongError",
           "RewardFunctionError", "RewardOutput", "FailureWatch", "UserCodeError", "Task", "TaskConfig", "build_environment", "build_task", "get_builder",
           "load_user_reward", "parse_last_number"]
