"""``arithmetic``: generated integer problems such as "What is 17 + 38?".

Every (a, op, b) in range is enumerated once and shuffled with a fixed seed; the first ``eval_pool``
are held out for evaluation and never trained on. The worked examples shown in the prompt are excluded
from both splits.
"""

from __future__ import annotations

import operator
import random
from functools import cached_property
from typing import Any, ClassVar

from evertrain.envs.answers import MathEnvironment
from evertrain.envs.base import Problem, Split

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_POOL_SEED = 20261130


class Arithmetic(MathEnvironment):
    name: ClassVar[str] = "arithmetic"
    source: ClassVar[str] = "generated"
    templated: ClassVar[bool] = True
    system_prompt: ClassVar[str] = (
        "Solve the problem. Give the final answer on the last line as '#### <number>'."
    )
    examples: ClassVar[tuple[tuple[str, str], ...]] = (
        ("What is 12 + 7?", "12 + 7 = 19\n#### 19"),
        ("What is 30 - 14?", "30 - 14 = 16\n#### 16"),
    )

    def __init__(self, ops: list[str] | None = None, low: int = 2, high: int = 60, eval_pool: int = 500,
                 **options: Any) -> None:
        super().__init__(**options)
        self.ops = list(ops or ["+"])
        unknown = [op for op in self.ops if op not in _OPS]
        if unknown:
            raise ValueError(f"arithmetic: unknown operators {unknown}; known: {sorted(_OPS)}")
        if not 0 <= low < high:
            raise ValueError(f"arithmetic: need 0 <= low < high, got low={low} high={high}")
        self.low, self.high, self.eval_pool = low, high, eval_pool

    @cached_property
    def _pools(self) -> tuple[list[tuple[int, str, int]], list[tuple[int, str, int]]]:
        shots = {user for user, _ in self.examples}
        triples = [
            (a, op, b)
            for op in self.ops
            for a in range(self.low, self.high + 1)
            for b in range(self.low, self.high + 1)
            if f"What is {a} {op} {b}?" not in shots
        ]
        random.Random(_POOL_SEED).shuffle(triples)
        held = min(self.eval_pool, len(triples) // 2)
        return triples[held:], triples[:held]

    def _problem(self, triple: tuple[int, str, int], split: Split) -> Problem:
        a, op, b = triple
        return Problem.make(self.name, f"What is {a} {op} {b}?", {"answer": str(_OPS[op](a, b))}, split)

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        train, held = self._pools
        if split == "eval":
            return [self._problem(t, "eval") for t in held[:n]]
        rng = random.Random(seed)
        return [self._problem(t, "train") for t in rng.sample(train, min(n, len(train)))]

    def count(self, split: Split) -> int | None:
        train, held = self._pools
        return len(held) if split == "eval" else len(train)

    def reference(self, problem: Problem) -> str | None:
        return f"{problem.prompt.removeprefix('What is ').rstrip('?')} = {problem.payload['answer']}\n" \
               f"#### {problem.payload['answer']}"
