"""``digits``: a learnable toy environment for tests and plumbing checks.

The policy is asked to reply with digits only; the reward is the share of the reply's characters
that are digits (1.0 and ``passed`` only for a non-empty, all-digit reply). A randomly initialized
tiny model earns a little of it by chance and visibly more after a few updates, so a test can show
learning in seconds. It measures nothing about capability.
"""

from __future__ import annotations

import random
from typing import ClassVar

from evertrain.envs.base import Environment, Problem, Split, Verdict


class Digits(Environment):
    name: ClassVar[str] = "digits"
    kind: ClassVar[str] = "toy"
    source: ClassVar[str] = "generated"
    templated: ClassVar[bool] = True
    system_prompt: ClassVar[str] = "Reply with digits only."

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        # even numbers are held out, odd ones are for training: the splits never meet
        rng = random.Random(seed if split == "train" else 7)
        parity = 1 if split == "train" else 0
        numbers = rng.sample(range(parity, 2000, 2), n)
        return [Problem.make(self.name, f"Count to {k}.", {"k": k}, split) for k in numbers]

    def verify(self, problem: Problem, completion: str) -> Verdict:
        text = completion.strip()
        if not text:
            return Verdict.fail("empty")
        share = sum(ch.isdigit() for ch in text) / len(text)
        if share == 1.0:
            return Verdict.ok("all_digits")
        return Verdict(reward=share, passed=False, reason="not_all_digits", detail={"digit_share": share})

    def reference(self, problem: Problem) -> str | None:
        return str(problem.payload["k"])
