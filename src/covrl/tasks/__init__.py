"""Verifiable tasks: built-in generators (arithmetic, letters), JSONL / local HF datasets, reward functions."""

from covrl.tasks.base import Example, RewardOutput
from covrl.tasks.config import ArithmeticConfig, LettersConfig, TaskConfig
from covrl.tasks.registry import TASKS, get_builder
from covrl.tasks.rewards import REWARDS, RewardFunctionError, load_user_reward, parse_last_number
from covrl.tasks.task import PromptTooLongError, Task


def build_task(cfg: TaskConfig) -> Task:
    """The task named by `cfg.name` (see `TASKS`), with its train / held-out eval split and reward."""
    return get_builder(cfg.name)(cfg)


__all__ = ["REWARDS", "TASKS", "ArithmeticConfig", "Example", "LettersConfig", "PromptTooLongError",
           "RewardFunctionError", "RewardOutput", "Task", "TaskConfig", "build_task", "get_builder",
           "load_user_reward", "parse_last_number"]
