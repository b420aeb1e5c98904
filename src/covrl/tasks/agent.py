"""`task.agent`: an agent program the user already has, trained as it is (docs/environments.md, "Training an
agent program you already have").

The program is a Python callable `run(base_url, api_key, example) -> float | None` (async, or a plain function
run in a worker thread) that talks to an OpenAI-compatible API at `base_url` with `api_key` in a loop, as it
would to any provider. covrl serves that API from its own sampler (covrl.rollout.openai_api), records the exact
tokens of every call of the episode (the api_key names it), and trains on them; the reward is the number the
program returns, or, when it returns None, the task's reward of the episode's last assistant text. The task
(`task.name`, its data) gives the examples; the example is covrl's Example (example.prompt, example.answer,
example["field"])."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from pydantic import Field

from covrl.settings import Section

__all__ = ["AgentConfig", "load_agent"]


class AgentConfig(Section):
    """An agent program that calls covrl's OpenAI-compatible endpoint (task.agent.fn set: every step's rollouts
    are its episodes; sync loop)."""

    fn: str | None = Field(None, min_length=1, description="the agent: 'file.py:run' or 'module:run', signature "
                           "[async] run(base_url: str, api_key: str, example) -> float | None (None: the task's "
                           "reward of the last assistant text); unset = no agent")
    concurrency: int = Field(16, ge=1, le=100_000, description="episodes run at once")
    timeout_s: float = Field(300.0, gt=0, le=86400.0, description="one episode's deadline; past it the episode "
                             "fails (counted, nothing of it trained)")


def load_agent(spec: str) -> Callable:
    """The agent function named by `spec` ('file.py:run' / 'module:run'), checked to take three arguments."""
    from covrl.tasks.rewards import load_user_reward

    fn = load_user_reward(spec, field="task.agent.fn", kind="agent function")
    try:
        inspect.signature(fn).bind("base_url", "api_key", "example")
    except TypeError as err:
        raise ValueError(f"task.agent.fn={spec!r}: the agent is called as run(base_url, api_key, example); "
                         f"its signature {inspect.signature(fn)} does not take that ({err})") from err
    except ValueError:   # no signature to read (a builtin): called as is
        pass
    return fn
