"""``gsm8k-tools``: the GSM8K word problems, with a sandboxed Python tool as a calculator.

The problems and the held-out split are exactly ``gsm8k``'s (loaded by :class:`GSM8K`): a question
held out of ``gsm8k`` is held out here too, so training on one environment never leaks the other's
evaluation set. The problem ids differ, on purpose: an id is a content hash that includes the
environment's name, and the store keys problems by (campaign, iteration, problem_id), so the same
question curated from both environments in one iteration must not collide. ``payload["gsm8k_id"]``
links each problem to its ``gsm8k`` twin.

The reference episode (:meth:`GSM8KTools.reference_transcript`) calls the tool once with the
solution's own calculator annotations (``<<48/2=24>>`` becomes ``print(48/2)``), then gives the
solution as the final answer.
"""

from __future__ import annotations

import ast
import json
import re
from functools import cached_property
from typing import ClassVar

from evertrain.envs.answers import MathEnvironment
from evertrain.envs.base import FixedSplits, Problem, Tool, vendored_path
from evertrain.envs.gsm8k import GSM8K
from evertrain.envs.tools import Message, PythonTool, ToolCall, ToolEnvironment

_ANNOTATION = re.compile(r"<<([^>=]*)=[^>]*>>")
_ANY_ANNOTATION = re.compile(r"<<[^>]*>>")


class GSM8KTools(FixedSplits, ToolEnvironment, MathEnvironment):
    """GSM8K with the ``python`` tool: up to two tool calls, then the final answer (three assistant turns)."""

    name: ClassVar[str] = "gsm8k-tools"
    source: ClassVar[str] = GSM8K.source
    tools: ClassVar[dict[str, Tool]] = {"python": PythonTool()}
    max_turns: ClassVar[int] = 3
    system_prompt: ClassVar[str] = (
        "Solve the math word problem. You may use a Python tool: write Python code between <python> and "
        "</python> and stop. The code runs and what it prints (or the value of its last line) comes back in "
        "the next message. You may use the tool up to 2 times.\n"
        "When you know the answer, do not call the tool: explain briefly and give the final answer on the "
        "last line as '#### <number>'."
    )
    worked_example: ClassVar[tuple[Message, ...]] = (
        {"role": "user",
         "content": "A baker makes 17 trays of 23 cookies and sells 250 cookies. How many cookies are left?"},
        {"role": "assistant",
         "content": "The baker makes 17 * 23 cookies and sells 250 of them.\n<python>\n17 * 23 - 250\n</python>"},
        {"role": "tool", "content": "141"},
        {"role": "assistant",
         "content": "17 trays of 23 cookies are 391 cookies, and 391 - 250 = 141 are left.\n#### 141"},
    )

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        """GSM8K's own splits, re-labelled: same questions, answers, solutions and held-out set."""
        source = GSM8K()
        splits: dict[str, list[Problem]] = {}
        for split in ("train", "eval"):
            pool = source.problems(split, source.count(split) or 0, 0)  # eval: file order; train: a fixed shuffle
            splits[split] = [
                Problem.make(self.name, p.prompt, {**p.payload, "gsm8k_id": p.id}, split) for p in pool
            ]
        return splits

    def reference(self, problem: Problem) -> str | None:
        return problem.payload.get("solution")

    @cached_property
    def _calculations(self) -> dict[tuple[str, str], list[str]]:
        """(question, solution without annotations) -> the solution's calculator expressions, read lazily."""
        table: dict[tuple[str, str], list[str]] = {}
        with vendored_path("gsm8k", "train.jsonl").open() as lines:
            for line in lines:
                row = json.loads(line)
                solution = row["answer"]
                table[(row["question"], _ANY_ANNOTATION.sub("", solution))] = _ANNOTATION.findall(solution)
        return table

    def reference_calls(self, problem: Problem) -> list[ToolCall]:
        expressions = self._calculations.get((problem.prompt, problem.payload.get("solution", "")), [])
        lines = []
        for expression in expressions:
            try:
                ast.parse(expression.strip(), mode="eval")
            except (SyntaxError, ValueError):
                continue
            lines.append(f"print({expression.strip()})")
        return [ToolCall("python", "\n".join(lines or [f"print({problem.payload['answer']!r})"]))]
