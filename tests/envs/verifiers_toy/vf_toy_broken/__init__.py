"""A verifiers taskset whose reward function raises (a bug in the user's environment)."""

import verifiers.v1 as vf


class BrokenData(vf.TaskData):
    answer: str


class BrokenTask(vf.Task[BrokenData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        return 1 / 0


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        for i in range(12):
            yield BrokenTask(BrokenData(prompt=f"{i % 10}+1=", answer=str(i % 10 + 1)), self.config.task)


__all__ = ["BrokenTaskset"]
