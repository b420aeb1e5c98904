"""A multi-turn verifiers environment in verifiers' own format (verifiers.v1): the model answers a one-digit
sum, the environment (as the run's user) replies "again=", the model answers a second time; the task's reward
scores the last answer. The user's reply is the environment's tokens between the two model turns."""

import re

import verifiers.v1 as vf

REPLY = "again="


class RetryData(vf.TaskData):
    answer: str


class RetryTask(vf.Task[RetryData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        found = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(found) and found[-1] == self.data.answer)


class RetryTaskset(vf.Taskset[RetryTask, vf.TasksetConfig]):
    def load(self):
        for i in range(30):
            a, b = i % 10, (7 * i + 2) % 10
            yield RetryTask(RetryData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


class RetryEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class RetryEnv(vf.Env[RetryEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated:
                await interaction.turn(REPLY)


__all__ = ["RetryEnv", "RetryTaskset"]
