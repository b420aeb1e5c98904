"""What every bandit agent shares: the act/update interface, a class registry, and save/load.

An agent plays `act(arms) -> index` and learns from `update(x, y)`. Linear agents are batched over S
independent seeds (leading dimension S); neural agents hold one seed (S = 1)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

# class name -> class; filled by `register_agent` when covrl.explore.linear / .neural are imported.
AGENT_CLASSES: dict[str, type] = {}
_AGENT_MODULES = ("covrl.explore.linear", "covrl.explore.neural")


def register_agent(cls: type) -> type:
    """Class decorator: make `cls` loadable by `load_agent` under its class name."""
    AGENT_CLASSES[cls.__name__] = cls
    return cls


class BanditAgent:
    """Interface: `act(arms) -> indices`, `update(x, y)`, `num_parameters()`, `state_dict()`,
    `load_state_dict(state)`; `config` holds the constructor arguments so `load_agent` can rebuild it."""

    config: dict[str, Any]
    batched: bool = False

    def act(self, arms: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def num_parameters(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:  # pragma: no cover - interface
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def save_agent(agent: BanditAgent, path: str | Path) -> Path:
    """Write the agent's class name, constructor config and full state (including its random generator,
    so a loaded agent continues exactly where the saved one stopped) to `path` with torch.save."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"class": type(agent).__name__, "config": agent.config, "state": agent.state_dict()}
    torch.save(payload, path)
    return path


def load_agent(path: str | Path, **overrides: Any) -> BanditAgent:
    """Rebuild an agent saved by `save_agent`. `overrides` replace constructor arguments that cannot be
    serialised (e.g. a custom `feature_extractor` module; its weights are restored from the state)."""
    for module in _AGENT_MODULES:
        importlib.import_module(module)
    payload = torch.load(Path(path), weights_only=True)  # never unpickle arbitrary objects
    name = payload["class"]
    if name not in AGENT_CLASSES:
        raise ValueError(f"saved agent class {name!r} is not known; known: {', '.join(sorted(AGENT_CLASSES))}")
    config = {**payload["config"], **overrides}
    agent = AGENT_CLASSES[name](**config)
    agent.load_state_dict(payload["state"])
    return agent
