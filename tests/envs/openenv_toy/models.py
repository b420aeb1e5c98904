"""Action and observation types of the toy environments (OpenEnv's pydantic models)."""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class TextAction(Action):
    """The assistant's message."""

    message: str = Field(..., description="what the model wrote")


class GuessObservation(Observation):
    """What the player sees: the task, or feedback on the last guess."""

    feedback: str = Field("", description="the problem at reset, then 'too high' / 'too low' / 'correct'")
    guesses: int = Field(0, description="guesses so far")
    reset_kwargs: dict = Field(default_factory=dict, description="the keywords reset received (for the tests)")
