"""A tool-using verifiers taskset in verifiers' own format (verifiers.v1): an `add` tool served by a Toolset (an
MCP server per rollout, toolset.py), one-digit sums, the last number of the final reply scored."""

import re

import verifiers.v1 as vf

from .toolset import AddTools


class ToolData(vf.TaskData):
    answer: str


class ToolTask(vf.Task[ToolData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [AddTools(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        found = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(found) and found[-1] == self.data.answer)


class ToolTaskset(vf.Taskset[ToolTask, vf.TasksetConfig]):
    def load(self):
        for i in range(12):
            a, b = i % 10, (5 * i + 3) % 10
            yield ToolTask(ToolData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["ToolTaskset"]
