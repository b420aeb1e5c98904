"""`task.agent`: an agent program the user already has, trained as it is (docs/environments.md, "Training an
agent program you already have").

The program is a Python callable `run(base_url, api_key, example) -> float | None` (async, or a plain function
run in a worker thread) that talks to an OpenAI-compatible API at `base_url` with `api_key` in a loop, as it
would to any provider. covrl serves that API from its own sampler (covrl.rollout.openai_api), records the exact
tokens of every call of the episode (the api_key names it), and trains on them; the reward is the number the
program returns, or, when it returns None, the task's reward of the episode's last assistant text. The task
(`task.name`, its data) gives the examples; the example is covrl's Example (example.prompt, example.answer,
example["field"]).

Or a command (`task.agent.command`, any language): run once per episode through the shell, in its own process
group, with OPENAI_BASE_URL and OPENAI_API_KEY (the episode's key) in its environment and the example as one JSON
object on stdin, {"prompt": ..., "answer": ..., "meta": {...the data row's other fields}}; the last non-empty line
of its stdout is the episode's reward (a finite number), or `null` / no output for the task's reward of the last
assistant text. A non-zero exit, a last line that is anything else, or passing task.agent.timeout_s (the whole
process group is killed) fails the episode: shown at once, counted by the user-code rule."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import signal
from collections.abc import Callable

from pydantic import Field, model_validator

from covrl.settings import Section

__all__ = ["AgentCommandError", "AgentConfig", "build_agent", "command_agent", "example_json", "load_agent",
           "parse_reward_line"]


class AgentConfig(Section):
    """An agent program that calls covrl's OpenAI-compatible endpoint (task.agent.fn or task.agent.command set:
    every step's rollouts are its episodes; sync loop)."""

    fn: str | None = Field(None, min_length=1, description="the agent: 'file.py:run' or 'module:run', signature "
                           "[async] run(base_url: str, api_key: str, example) -> float | None (None: the task's "
                           "reward of the last assistant text); unset = no agent")
    command: str | None = Field(None, min_length=1, description="the agent as a shell command run per episode "
                                "(instead of fn): OPENAI_BASE_URL / OPENAI_API_KEY in its environment, the example "
                                "as JSON on stdin, the reward as the last line of stdout (null / none: the task's "
                                "reward of the last assistant text)")
    concurrency: int = Field(16, ge=1, le=100_000, description="episodes run at once")
    timeout_s: float = Field(300.0, gt=0, le=86400.0, description="one episode's deadline; past it the episode "
                             "fails (counted, nothing of it trained)")


    @model_validator(mode="after")
    def _one_program(self):
        if self.fn and self.command:
            raise ValueError("task.agent: set fn (a Python function) or command (a program run per episode), not both")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.fn or self.command)

    @property
    def spec(self) -> str:
        """How messages name the program."""
        return self.fn or f"command {self.command!r}"


class AgentCommandError(RuntimeError):
    """The agent command exited non-zero or printed something that is not a reward."""


def example_json(example) -> str:
    """The example as the command reads it on stdin: {"prompt", "answer", "meta"} (values JSON cannot hold are
    written as their str)."""
    return json.dumps({"prompt": example.prompt, "answer": example.answer, "meta": dict(example.meta)}, default=str)


def parse_reward_line(stdout: str) -> float | None:
    """The reward on the last non-empty line of `stdout`: a finite number, or None (`null` / `none` / no output:
    the task scores the last assistant text). Raises AgentCommandError for anything else."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines or lines[-1].lower() in ("null", "none"):
        return None
    try:
        reward = float(lines[-1])
    except ValueError:
        reward = math.nan
    if not math.isfinite(reward):
        raise AgentCommandError(f"the last line of its stdout is {lines[-1][:120]!r}; it must be the episode's "
                                "reward (a finite number) or null (the task's reward of the last assistant text); "
                                "print anything else to stderr")
    return reward


def _tail(data: bytes, limit: int = 2000) -> str:
    text = data.decode(errors="replace").rstrip()
    return text if len(text) <= limit else "..." + text[-limit:]


def command_agent(command: str) -> Callable:
    """The agent function that runs `command` per episode (see the module docstring)."""

    async def run(base_url: str, api_key: str, example) -> float | None:
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        proc = await asyncio.create_subprocess_shell(
            command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, start_new_session=True)   # its own process group: a timeout kills what it started too
        try:
            out, err = await proc.communicate(example_json(example).encode())
        finally:
            if proc.returncode is None:   # cancelled (the episode's deadline): the whole group goes
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await proc.wait()
        if proc.returncode != 0:
            raise AgentCommandError(f"exited with status {proc.returncode}; its stderr ends:\n{_tail(err)}")
        return parse_reward_line(out.decode(errors="replace"))

    return run


def build_agent(cfg: AgentConfig) -> Callable:
    """The episode function of `task.agent`: the loaded fn, or the command's runner."""
    if cfg.command:
        return command_agent(cfg.command)
    if not cfg.fn:
        raise ValueError("task.agent: set fn or command")
    return load_agent(cfg.fn)


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
