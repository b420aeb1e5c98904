"""A verifiers taskset (verifiers.v1 format) to try `task.name=verifiers` with: one-digit additions asked as
covrl's default task asks them, scored by the answer's last number and a small bonus for answering briefly.

    covrl train --config configs/default.yaml task.name=verifiers task.verifiers.taskset=examples/verifiers_sum
"""

import random
import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        found = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(found) and found[-1] == self.data.answer)

    @vf.reward(weight=0.1)
    async def brief(self, trace) -> float:
        return float(len(trace.last_reply) <= 12)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        # a fixed shuffle of the table: covrl holds out the first task.n_eval tasks, spread over it
        pairs = [(a, b) for a in range(10) for b in range(10)]
        random.Random(0).shuffle(pairs)
        for a, b in pairs:
            yield SumTask(SumData(prompt=f"Compute {a}+{b}. Answer with just the number.", answer=str(a + b)),
                          self.config.task)


__all__ = ["SumTaskset"]
