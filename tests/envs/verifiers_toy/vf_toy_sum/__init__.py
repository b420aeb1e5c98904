"""A single-turn verifiers taskset in verifiers' own format (verifiers.v1): one-digit sums posed as covrl's
arithmetic task poses them in plain form ("3+4="), scored by two weighted rewards."""

import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        found = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(found) and found[-1] == self.data.answer)

    @vf.reward(weight=0.25)
    async def short(self, trace) -> float:
        return float(len(trace.last_reply) <= 2)


class SumTasksetConfig(vf.TasksetConfig):
    count: int = 40


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self):
        for i in range(self.config.count):
            a, b = i % 10, (3 * i + 1) % 10
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["SumTaskset"]
