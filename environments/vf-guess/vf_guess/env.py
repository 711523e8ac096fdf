"""The taskset, its tasks, their rewards, and the environment that answers each guess."""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

INTEGER = re.compile(r"-?[0-9]+")
PROMPT = ("I picked a whole number from {low} to {high}. Guess it: reply with one number. "
          "After each wrong guess I say 'higher' or 'lower'.")


def feedback(target: int, reply: str) -> tuple[str, bool]:
    """What the environment says to ``reply``, and whether it is the number."""
    numbers = INTEGER.findall(reply or "")
    if len(numbers) != 1:
        return "Reply with exactly one number.", False
    guess = int(numbers[0])
    if guess == target:
        return "correct", True
    return ("higher" if guess < target else "lower"), False


class GuessData(vf.TaskData):
    target: int
    low: int
    high: int
    max_guesses: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        if not replies or len(replies) > self.data.max_guesses:
            return 0.0
        return 1.0 if feedback(self.data.target, replies[-1].content or "")[1] else 0.0

    @vf.reward(weight=0.0)
    async def efficiency(self, trace: vf.Trace) -> float:
        return 1.0 / max(1, len(trace.assistant_messages))


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 200
    high: int = 10
    max_guesses: int = 4
    seed: int = 0


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for index in range(self.config.num_tasks):
            target = rng.randint(1, self.config.high)
            yield GuessTask(GuessData(id=f"guess-{index}", prompt=PROMPT.format(low=1, high=self.config.high),
                                      target=target, low=1, high=self.config.high,
                                      max_guesses=self.config.max_guesses), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task: GuessTask, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as exchange:
            segment = await exchange.turn()  # the prompt is the task's: the policy guesses first
            for _ in range(task.data.max_guesses - 1):
                if segment.terminated:
                    break
                said, solved = feedback(task.data.target, segment.last_reply)
                if solved:
                    break
                segment = await exchange.turn(said)
