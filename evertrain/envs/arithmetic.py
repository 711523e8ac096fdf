"""``arithmetic``: generated integer problems such as "What is 17 + 38?".

Every (a, op, b) in range is enumerated once and shuffled with a fixed seed; the first ``eval_pool``
are held out and never trained on: the gate's held-out set is the front of that pool, the sealed test
split its far end (see :meth:`Environment.sealed_problems`). The worked examples shown in the prompt are
excluded from every split.

Two styles:

- ``fixed`` (the default): one scaffold, "What is a + b?" after two fixed worked examples.
- ``varied``: training and gate problems are asked in several phrasings (``TRAIN_PHRASINGS``), with the
  operators of ``ops`` over the ranges of ``ranges``, after 0, 1 or 2 worked examples (``shots``) drawn
  from a pool of examples in those phrasings, so that what is learned is the task and the answer format,
  not one prompt.

Either way the sealed **transfer** split asks held-out problems the way a new user would: in phrasings
never trained on (``TRANSFER_PHRASINGS``), with the operators of ``transfer_ops`` too (never trained on),
and without any worked example.
"""

from __future__ import annotations

import hashlib
import operator
import random
from functools import cached_property
from typing import Any, ClassVar

from evertrain.envs.answers import MathEnvironment
from evertrain.envs.base import Problem, Split

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_WORDS = {"+": "plus", "-": "minus", "*": "times"}
_POOL_SEED = 20261130
_EXAMPLE_TRIPLES = 24  # varied style: triples reserved for worked examples, in no split

TRAIN_PHRASINGS: tuple[str, ...] = (
    "What is {a} {op} {b}?",
    "Compute {a} {op} {b}.",
    "Calculate {a} {op} {b}.",
    "{a} {op} {b} = ?",
    "What is {a} {word} {b}?",
    "Find the value of {a} {op} {b}.",
    "Evaluate {a} {op} {b}.",
    "What do you get for {a} {word} {b}?",
)
# never trained on, in any style: only the sealed transfer split asks these
TRANSFER_PHRASINGS: tuple[str, ...] = (
    "How much is {a} {word} {b}?",
    "Quick question: what's {a} {op} {b}?",
    "Work out {a} {op} {b} for me.",
    "Tell me the result of {a} {word} {b}.",
    "If you take {a} and {b} and combine them with {op}, what number results?",
)

Triple = tuple[int, str, int]


def _pick(options: tuple[Any, ...] | list[Any], *key: Any) -> Any:
    """A choice among ``options`` fixed by ``key`` (a problem's phrasing never changes between runs)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return options[int.from_bytes(digest[:4], "little") % len(options)]


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
                 style: str = "fixed", ranges: list[list[int]] | None = None, shots: list[int] | None = None,
                 transfer_ops: list[str] | None = None, transfer_range: list[int] | None = None,
                 **options: Any) -> None:
        super().__init__(**options)
        self.ops = list(ops or ["+"])
        if style not in ("fixed", "varied"):
            raise ValueError(f"arithmetic: style must be 'fixed' or 'varied', got {style!r}")
        self.style = style
        self.transfer_ops = list(transfer_ops if transfer_ops is not None else
                                 [op for op in ("*",) if op not in self.ops])
        unknown = [op for op in self.ops + self.transfer_ops if op not in _OPS]
        if unknown:
            raise ValueError(f"arithmetic: unknown operators {unknown}; known: {sorted(_OPS)}")
        if set(self.ops) & set(self.transfer_ops):
            raise ValueError(f"arithmetic: transfer_ops {self.transfer_ops} must be operators never trained on, "
                             f"but {sorted(set(self.ops) & set(self.transfer_ops))} are in ops")
        self.ranges = [tuple(r) for r in ranges] if ranges else [(low, high)]
        for r in self.ranges + ([tuple(transfer_range)] if transfer_range else []):
            if len(r) != 2 or not 0 <= r[0] < r[1]:
                raise ValueError(f"arithmetic: a range must be [low, high] with 0 <= low < high, got {list(r)}")
        self.transfer_range = tuple(transfer_range) if transfer_range else (2, 12)
        self.shots = list(shots if shots is not None else ([0, 1, 2] if style == "varied" else [2]))
        if not self.shots or any(not 0 <= k <= 4 for k in self.shots):
            raise ValueError(f"arithmetic: shots must list worked-example counts between 0 and 4, got {self.shots}")
        self.low, self.high = min(r[0] for r in self.ranges), max(r[1] for r in self.ranges)
        self.eval_pool = eval_pool

    @cached_property
    def _pools(self) -> tuple[list[Triple], list[Triple]]:
        train, held, _ = self._split_triples
        return train, held

    @cached_property
    def _split_triples(self) -> tuple[list[Triple], list[Triple], list[Triple]]:
        """(train, held out, worked-example) triples: disjoint, fixed by the options."""
        shots = {user for user, _ in self.examples}
        seen: set[Triple] = set()
        triples: list[Triple] = []
        for low, high in self.ranges:
            for op in self.ops:
                for a in range(low, high + 1):
                    for b in range(low, high + 1):
                        if (a, op, b) not in seen and f"What is {a} {op} {b}?" not in shots:
                            seen.add((a, op, b))
                            triples.append((a, op, b))
        random.Random(_POOL_SEED).shuffle(triples)
        reserved = min(_EXAMPLE_TRIPLES, len(triples) // 4) if self.style == "varied" else 0
        example_triples, triples = triples[:reserved], triples[reserved:]
        held = min(self.eval_pool, len(triples) // 2)
        return triples[held:], triples[:held], example_triples

    # --- prompts -------------------------------------------------------------------------------

    @staticmethod
    def _phrase(template: str, triple: Triple) -> str:
        a, op, b = triple
        return template.format(a=a, op=op, b=b, word=_WORDS[op])

    def _worked(self, triple: Triple) -> tuple[str, str]:
        a, op, b = triple
        user = self._phrase(_pick(TRAIN_PHRASINGS, "example", triple), triple)
        return user, f"{a} {op} {b} = {_OPS[op](a, b)}\n#### {_OPS[op](a, b)}"

    def _problem(self, triple: Triple, split: Split) -> Problem:
        a, op, b = triple
        answer = str(_OPS[op](a, b))
        if split == "transfer":
            prompt = self._phrase(_pick(TRANSFER_PHRASINGS, "transfer", triple), triple)
            return Problem.make(self.name, prompt, {"answer": answer, "expr": f"{a} {op} {b}", "shots": []}, split)
        if self.style == "fixed":
            return Problem.make(self.name, f"What is {a} {op} {b}?", {"answer": answer}, split)
        prompt = self._phrase(_pick(TRAIN_PHRASINGS, "ask", triple), triple)
        _, _, example_triples = self._split_triples
        count = min(_pick(self.shots, "shots", triple), len(example_triples))
        rng = random.Random(repr(("examples", triple)))
        shots = [list(self._worked(t)) for t in rng.sample(example_triples, count)]
        return Problem.make(self.name, prompt, {"answer": answer, "expr": f"{a} {op} {b}", "shots": shots}, split)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        if "shots" not in problem.payload:  # the fixed scaffold: the class's two worked examples
            return super().messages(problem)
        chat = [{"role": "system", "content": self.system_prompt}]
        for user, assistant in problem.payload["shots"]:
            chat += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return [*chat, {"role": "user", "content": problem.prompt}]

    # --- splits --------------------------------------------------------------------------------

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        train, held = self._pools
        if split == "eval":
            return [self._problem(t, "eval") for t in held[:n]]
        if split != "train":
            return self.sealed_problems(split, n, seed, gate=0)
        rng = random.Random(seed)
        return [self._problem(t, "train") for t in rng.sample(train, min(n, len(train)))]

    def sealed_problems(self, split: Split, n: int, seed: int, gate: int) -> list[Problem]:
        if split != "transfer":
            return super().sealed_problems(split, n, seed, gate)
        # held-out triples of the trained operators (far end of the pool) and triples of operators never
        # trained on, interleaved; all asked in held-out phrasings without worked examples
        _, held = self._pools
        low, high = self.transfer_range
        unseen = [(a, op, b) for op in self.transfer_ops for a in range(low, high + 1) for b in range(low, high + 1)]
        random.Random(_POOL_SEED + 1).shuffle(unseen)
        tail = held[::-1]
        mixed = [t for pair in zip(tail, unseen, strict=False) for t in pair] if unseen else tail
        return [self._problem(t, "transfer") for t in mixed[:n]]

    def count(self, split: Split) -> int | None:
        train, held = self._pools
        return len(held) if split == "eval" else len(train)

    # --- guidance (evertrain.frontier) ----------------------------------------------------------------

    hint_levels: ClassVar[int] = 2

    @staticmethod
    def _triple(problem: Problem) -> Triple | None:
        expr = problem.payload.get("expr") or problem.prompt.removeprefix("What is ").rstrip("?")
        parts = str(expr).split()
        if len(parts) != 3 or parts[1] not in _OPS:
            return None
        try:
            return int(parts[0]), parts[1], int(parts[2])
        except ValueError:
            return None

    def problem_kind(self, problem: Problem) -> str:
        """Operator, the operands' digits and the answer's sign: e.g. ``- 2d neg`` (what makes these hard here:
        a 135M model learns two-digit sums well before it learns negative differences)."""
        triple = self._triple(problem)
        if triple is None:
            return problem.id
        a, op, b = triple
        digits = len(str(max(abs(a), abs(b))))
        return f"{op} {digits}d{' neg' if _OPS[op](a, b) < 0 else ''}"

    def answer_prefix(self, problem: Problem, level: int) -> str | None:
        """The working's first steps, one more per level, left open where the model must compute: the sign and the
        reversed difference for a negative result, the second number split into tens and ones otherwise. Short on
        purpose: a 135M model given a long hint in the question drifted into prose (the long campaign's first run)."""
        triple = self._triple(problem)
        if triple is None or not 1 <= level <= self.hint_levels:
            return None
        a, op, b = triple
        if op == "-" and a < b:
            steps = [f"{a} - {b} = -(", f"{a} - {b} = -({b} - {a}) = -"]
        elif op in "+-" and b >= 10 and b % 10:
            tens, ones = (b // 10) * 10, b % 10
            split = f"{a} {op} {b} = {a} {op} {tens} {op} {ones} = "
            steps = [split, f"{split}{_OPS[op](a, tens)} {op} {ones} = "]
        elif op == "*" and b >= 10 and b % 10:
            tens, ones = (b // 10) * 10, b % 10
            split = f"{a} * {b} = {a} * {tens} + {a} * {ones} = "
            steps = [split, f"{split}{a * tens} + {a * ones} = "]
        else:
            steps = [f"{a} {op} {b} = "]
        return steps[level - 1] if level <= len(steps) else None

    def reference(self, problem: Problem) -> str | None:
        expr = problem.payload.get("expr") or problem.prompt.removeprefix("What is ").rstrip("?")
        return f"{expr} = {problem.payload['answer']}\n#### {problem.payload['answer']}"
