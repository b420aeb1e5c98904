"""Configuration of a `covrl bandit` run (pydantic; every option has a default, a range and one line of help)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from covrl.explore.names import AGENT_NAMES, ENV_NAMES
from covrl.settings import Section, known_name


class BanditConfig(Section):
    """One comparison: several agents on one environment, same seeds."""

    env: Annotated[str, known_name(ENV_NAMES, "environment")] = Field("linear", description=f"environment: {', '.join(ENV_NAMES)}")
    agents: list[Annotated[str, known_name(AGENT_NAMES, "agent")]] = Field(["ensemble++", "lints"], min_length=1, description="agents to compare")
    steps: int = Field(1000, ge=1, le=10_000_000, description="rounds T per seed")
    seeds: int = Field(5, ge=1, le=100_000, description="number of seeds (instances)")
    seed: int = Field(0, ge=0, description="first seed; seed s plays environment seed `seed + s`")
    env_options: dict[str, Any] = Field(default_factory=dict, description="options of the environment")
    agent_options: dict[str, Any] = Field(default_factory=dict,
                                          description="options passed to every agent that accepts them")
    track_band_every: int = Field(0, ge=0, description="record the particles' covariance band every N rounds")
    out: Path = Field(Path("runs/bandit"), description="output folder")
    save_agents: bool = Field(False, description="save each agent's final state (seed batch) under out/")
