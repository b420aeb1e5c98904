"""A toy OpenEnv environment, "guess the number", and its apps.

GuessEnvironment (multi-turn): reset(seed) picks a number in 1..8 from the seed (its observation also carries
the keywords reset received); each step reads the last integer of the message and answers "too high" / "too
low" / "no number" (reward 0) or "correct" (reward 1, done); after `MAX_GUESSES` wrong guesses the episode
ends at reward 0.

`app` holds many sessions at once; `single_app` holds one (OpenEnv's default).
"""

from __future__ import annotations

import random
import re
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from openenv_toy.models import GuessObservation, TextAction

MAX_GUESSES = 3


def last_int(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.target = 1

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self.target = random.Random(seed).randint(1, 8)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(feedback="Guess my number (1-8).", reward=0.0,
                                reset_kwargs={"seed": seed, "episode_id": episode_id, **kwargs})

    def step(self, action: TextAction, timeout_s=None, **kwargs) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        guess = last_int(action.message)
        n = self._state.step_count
        if guess == self.target:
            return GuessObservation(feedback="correct", guesses=n, reward=1.0, done=True)
        feedback = "no number" if guess is None else ("too high" if guess > self.target else "too low")
        return GuessObservation(feedback=feedback, guesses=n, reward=0.0, done=n >= MAX_GUESSES)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, TextAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
single_app = create_app(GuessEnvironment, TextAction, GuessObservation, env_name="guess")
