"""``calculator``: arithmetic on numbers too large to do in one's head, with the sandboxed Python tool.

"What is 48213 * 7719?": SmolLM2-135M cannot multiply five-digit numbers in its head, but it can
copy an expression into a ``<python>`` call and copy the tool's reply into ``#### <number>``. The
prompt shows one worked tool episode (an honest starting signal: the grader stays the strict
final-answer rule of the last turn, with tool blocks removed, so the tool's output itself supplies
nothing and a ``####`` inside a call earns nothing).

Problems are generated from a seed: train problems from the seed, held-out problems from a fixed
pool seed, and any train problem that collides with a held-out one is dropped (ids are content
hashes). Options: ``digits`` (the sizes of the operands, default [3, 5]), ``ops`` (default ``+ - *``),
``eval_pool`` (held-out pool size, default 500), ``tool_version`` (default 1).

``tool_version = 2`` is the same task behind a changed tool interface, as a deployed tool changes under a
trained agent: the ``python`` tool is gone, and a ``calc`` tool takes JSON with named arguments,
``<calc>{"operation": "multiply", "x": 3841, "y": 5127}</calc>``. The arithmetic still runs in the same
bubblewrap sandbox and the final answer is graded by the same rule, so a v1 episode (a ``<python>`` call)
makes no call at all under v2 and earns 0. The problems (and their ids) are the same in both versions.
"""

from __future__ import annotations

import json
import operator
import random
import re
from functools import cached_property
from typing import Any, ClassVar

from evertrain.envs.answers import MathEnvironment
from evertrain.envs.base import Problem, Split, Tool, prompt_key
from evertrain.envs.tools import Message, PythonTool, ToolCall, ToolEnvironment, ToolOutput

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_POOL_SEED = 15_015
# the question :meth:`Calculator.rebuild` computes (on its prompt_key): integers of at most 40 digits, + - *
_QUESTION = re.compile(r"what is (-?\d{1,40}(?: [-+*] -?\d{1,40})*)\?")
_MAX_OPERANDS = 8


def _evaluate(parts: list[str]) -> int:
    """``a op b op c ...`` (integers; + - *) with Python's precedence, as the tool and the curriculum compute it."""
    total, sign, term = 0, 1, int(parts[0])
    for op, number in zip(parts[1::2], parts[2::2], strict=True):
        if op == "*":
            term *= int(number)
        else:
            total, sign, term = total + sign * term, (1 if op == "+" else -1), int(number)
    return total + sign * term


_OPERATIONS = {"add": "+", "subtract": "-", "multiply": "*"}  # tool v2's names for the operators


class CalcTool(PythonTool):
    """Tool version 2: JSON with named arguments in, the result out, computed in the Python sandbox."""

    name: ClassVar[str] = "calc"
    description: ClassVar[str] = (
        'Arithmetic on two integers. Input: JSON {"operation": "add" | "subtract" | "multiply", "x": <integer>, '
        '"y": <integer>}. Replies with the result.')
    usage: ClassVar[str] = 'calc: the input must be JSON like {"operation": "multiply", "x": 3841, "y": 5127}'

    def run(self, call: str, problem: Problem) -> ToolOutput:
        """Never raises on what ``call`` holds: a malformed call replies with what is wrong, as an error."""
        try:
            args = json.loads(call)
        except ValueError:
            return ToolOutput(output=self.usage, error=True)
        if not isinstance(args, dict) or set(args) != {"operation", "x", "y"}:
            return ToolOutput(output=f"{self.usage} (keys operation, x, y)", error=True)
        if args["operation"] not in _OPERATIONS:
            return ToolOutput(output=f"calc: operation must be one of {', '.join(_OPERATIONS)}", error=True)
        if not all(type(args[k]) is int for k in ("x", "y")):
            return ToolOutput(output="calc: x and y must be integers", error=True)
        # validated integers and an operator from the table: the program below is exactly one expression
        return super().run(f"{args['x']} {_OPERATIONS[args['operation']]} {args['y']}", problem)


class Calculator(ToolEnvironment, MathEnvironment):
    """Big-number arithmetic; a ``python`` tool call, then the final answer (two assistant turns)."""

    name: ClassVar[str] = "calculator"
    source: ClassVar[str] = "generated"
    templated: ClassVar[bool] = True
    tools: ClassVar[dict[str, Tool]] = {"python": PythonTool()}
    max_turns: ClassVar[int] = 2
    system_prompt: ClassVar[str] = (
        "Answer the arithmetic question. The numbers are large, so use the Python tool: write the expression "
        "between <python> and </python> and stop. Its result comes back in the next message. Then give the "
        "final answer on the last line as '#### <number>'."
    )
    worked_example: ClassVar[tuple[Message, ...]] = (
        {"role": "user", "content": "What is 3841 * 5127?"},
        {"role": "assistant", "content": "<python>\n3841 * 5127\n</python>"},
        {"role": "tool", "content": "19692807"},
        {"role": "assistant", "content": "#### 19692807"},
    )

    v2_system_prompt: ClassVar[str] = (
        "Answer the arithmetic question. The numbers are large, so use the calc tool: write its JSON input, "
        '{"operation": "add", "subtract" or "multiply", "x": ..., "y": ...}, between <calc> and </calc> and stop. '
        "Its result comes back in the next message. Then give the final answer on the last line as '#### <number>'."
    )
    v2_worked_example: ClassVar[tuple[Message, ...]] = (
        {"role": "user", "content": "What is 3841 * 5127?"},
        {"role": "assistant", "content": '<calc>\n{"operation": "multiply", "x": 3841, "y": 5127}\n</calc>'},
        {"role": "tool", "content": "19692807"},
        {"role": "assistant", "content": "#### 19692807"},
    )

    def __init__(self, digits: list[int] | None = None, ops: list[str] | None = None, eval_pool: int = 500,
                 tool_version: int = 1, **options: Any) -> None:
        super().__init__(**options)
        if tool_version not in (1, 2):
            raise ValueError(f"calculator: tool_version must be 1 (python tool) or 2 (calc tool), got {tool_version}")
        self.tool_version = tool_version
        if tool_version == 2:  # instance attributes shadow the class's v1 interface
            self.tools = {"calc": CalcTool()}
            self.system_prompt = self.v2_system_prompt
            self.worked_example = self.v2_worked_example
        self.digits = list(digits or [3, 5])
        if len(self.digits) != 2 or not 1 <= self.digits[0] <= self.digits[1] <= 30:
            raise ValueError(f"calculator: digits must be [low, high] with 1 <= low <= high <= 30, got {digits}")
        self.ops = list(ops or ["+", "-", "*"])
        unknown = [op for op in self.ops if op not in _OPS]
        if unknown or not self.ops:
            raise ValueError(f"calculator: ops must be among {sorted(_OPS)}, got {ops}")
        self.eval_pool = eval_pool

    def _number(self, rng: random.Random) -> int:
        size = rng.randint(*self.digits)
        return rng.randint(10 ** (size - 1), 10 ** size - 1)

    def _make(self, rng: random.Random, split: Split) -> Problem:
        a, b, op = self._number(rng), self._number(rng), rng.choice(self.ops)
        return Problem.make(self.name, f"What is {a} {op} {b}?", {"a": a, "b": b, "op": op,
                                                                   "answer": str(_OPS[op](a, b))}, split)

    @cached_property
    def _held_out(self) -> list[Problem]:
        rng = random.Random(_POOL_SEED)
        return [self._make(rng, "eval") for _ in range(self.eval_pool)]

    @cached_property
    def _held_ids(self) -> frozenset[str]:
        return frozenset(problem.id for problem in self._held_out)

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        if split == "eval":
            if n > self.eval_pool:
                raise ValueError(f"calculator: {n} held-out problems asked, the pool holds {self.eval_pool}")
            return self._held_out[:n]
        rng = random.Random(f"calculator-train-{seed}")
        found: list[Problem] = []
        while len(found) < n:
            problem = self._make(rng, "train")
            if problem.id not in self._held_ids:
                found.append(problem)
        return found

    def count(self, split: Split) -> int | None:
        return self.eval_pool if split == "eval" else None

    def rebuild(self, problem: Problem) -> Problem | None:
        """The problem with its answer computed here from the question ("What is <integers joined by this
        environment's operators>?", up to spacing and case), whatever answer came with it; None for any other
        question. Two operands give the generator's own problem (its id), more a curriculum level's."""
        match = _QUESTION.fullmatch(prompt_key(problem.prompt))
        if match is None:
            return None
        parts = match.group(1).split()
        if any(op not in self.ops for op in parts[1::2]) or len(parts) > 2 * _MAX_OPERANDS - 1:
            return None
        expr, answer = " ".join(parts), str(_evaluate(parts))
        if len(parts) == 3:
            payload: dict[str, Any] = {"a": int(parts[0]), "b": int(parts[2]), "op": parts[1], "answer": answer}
        else:
            payload = {"expr": expr, "answer": answer}
        return Problem.make(self.name, f"What is {expr}?", payload, problem.split)

    def reference(self, problem: Problem) -> str | None:
        return f"#### {problem.payload['answer']}"

    def reference_calls(self, problem: Problem) -> list[ToolCall]:
        p = problem.payload
        if "expr" in p and self.tool_version == 2:  # a two-operand curriculum problem, "a op b", for tool v2
            a, op, b = p["expr"].split()
            p = {"a": int(a), "op": op, "b": int(b)}
        elif "expr" in p:  # a curriculum level's problem: more operands (evertrain.curriculum)
            return [ToolCall("python", p["expr"])]
        if self.tool_version == 2:  # the second version of the tool (the drift demo)
            operation = {v: k for k, v in _OPERATIONS.items()}[p["op"]]
            return [ToolCall("calc", json.dumps({"operation": operation, "x": p["a"], "y": p["b"]}))]
        return [ToolCall("python", f"{p['a']} {p['op']} {p['b']}")]
