"""The taskset, its tasks and their reward."""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

PROMPT = "What is {expression}? Think briefly, then put the final answer in \\boxed{{}}."
SYSTEM = "You are a careful calculator. End your reply with the answer in \\boxed{}."
EXAMPLE = " For example: What is 4 + 9? 4 + 9 = 13, so the answer is \\boxed{13}."
INTEGER = re.compile(r"-?[0-9]+")


class SumsData(vf.TaskData):
    answer: str
    terms: list[int]


class SumsTask(vf.Task[SumsData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the reply holds exactly one boxed answer and it is the sum, written as an integer."""
        reply = trace.last_reply
        if reply.count("\\boxed{") != 1:
            return 0.0
        answer = vf.extract_boxed_answer(reply, strict=True).strip()
        return 1.0 if INTEGER.fullmatch(answer) and int(answer) == int(self.data.answer) else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumsConfig(vf.TasksetConfig):
    num_tasks: int = 400
    terms: int = 2
    digits: int = 2
    seed: int = 0
    example: bool = True  # a worked example in the system prompt, showing the answer's format


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        low, high = 10 ** (self.config.digits - 1), 10 ** self.config.digits - 1
        possible = (high - low + 1) ** self.config.terms
        seen: set[tuple[int, ...]] = set()
        while len(seen) < min(self.config.num_tasks, possible):
            terms = tuple(rng.randint(low, high) for _ in range(self.config.terms))
            if terms in seen:
                continue
            seen.add(terms)
            yield SumsTask(SumsData(id="+".join(map(str, terms)), prompt=PROMPT.format(
                expression=" + ".join(map(str, terms))), answer=str(sum(terms)),
                system_prompt=SYSTEM + (EXAMPLE if self.config.example else ""),
                terms=list(terms)), self.config.task)
