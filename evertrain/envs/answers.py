"""The one strict rule for final answers, shared by every math-like environment.

A completion earns credit only if it commits to exactly one final answer, written as ``#### <answer>``
or ``\\boxed{<answer>}`` on its last non-empty line, and that answer equals the expected one after
numeric normalization (thousands commas, trailing zeros, ``-0``, a leading ``$``). Several markers,
a hedge ("70 or 71"), or a list of numbers earn 0: a policy under RL pressure would otherwise learn to
spray candidates.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, ClassVar

from evertrain.envs.base import Environment, Problem, Verdict

_HASH = "####"
_BOXED = "\\boxed{"
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_FRACTION = re.compile(r"([+-]?\d+)\s*/\s*(\d+)")
_EXPONENT = re.compile(r"[eE]([+-]?\d+)\Z")

# Bounds on what the trusted process converts. An answer is parsed in the grading process itself, so
# an unbounded conversion is a stall for every item graded beside it: Fraction(Decimal("1e999999999"))
# builds a billion-digit integer (32 s holding the GIL, measured). No answer any environment expects
# comes near these; anything beyond them is "not a single number" and earns 0.
MAX_NUMBER_CHARS = 400  # the whole written number, signs, separators and exponent included
MAX_DIGITS = 200  # significant digits (numerator and denominator each, for a fraction)
MAX_EXPONENT = 400  # |exponent| of scientific notation


def parse_number(text: str) -> Fraction | None:
    """Parse one number written plainly ('1,234.50', '-0', '$7', '3/4'); None if it is anything else.

    Bounded: at most :data:`MAX_NUMBER_CHARS` characters, :data:`MAX_DIGITS` digits and an exponent of
    at most :data:`MAX_EXPONENT`, checked on the text before anything is converted.
    """
    if len(text) > 4 * MAX_NUMBER_CHARS:  # before strip(): even stripping a huge string costs
        return None
    value = text.strip()
    if len(value) > MAX_NUMBER_CHARS:
        return None
    value = value.removeprefix("$").strip()
    if value.endswith(".") and not value.endswith(".."):
        value = value[:-1]
    if _THOUSANDS.fullmatch(value):
        value = value.replace(",", "")
    if match := _FRACTION.fullmatch(value):
        if max(len(match.group(1)), len(match.group(2))) > MAX_DIGITS + 1:
            return None
        denominator = int(match.group(2))
        return Fraction(int(match.group(1)), denominator) if denominator else None
    if not _NUMBER.fullmatch(value):
        return None
    exponent = _EXPONENT.search(value)
    if exponent and abs(int(exponent.group(1)[:8])) > MAX_EXPONENT:
        return None
    if sum(c.isdigit() for c in (value[:exponent.start()] if exponent else value)) > MAX_DIGITS:
        return None
    try:
        return Fraction(Decimal(value))
    except (InvalidOperation, ValueError):
        return None


def _boxed_contents(line: str, start: int) -> str | None:
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(line)):
        if line[j] == "{":
            depth += 1
        elif line[j] == "}":
            depth -= 1
            if depth == 0:
                return line[i:j]
    return None


def extract_final_answer(completion: str) -> tuple[str | None, str]:
    """The single final answer of ``completion`` and a reason code ('ok' when one was found)."""
    markers = completion.count(_HASH) + completion.count(_BOXED)
    if markers == 0:
        return None, "no_final_answer"
    if markers > 1:
        return None, "multiple_answers"
    lines = [line for line in completion.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if _HASH in last:
        return last.split(_HASH, 1)[1].strip(), "ok"
    if _BOXED in last:
        inner = _boxed_contents(last, last.index(_BOXED))
        return (inner.strip(), "ok") if inner is not None else (None, "unbalanced_boxed")
    return None, "answer_not_on_last_line"


def grade_math(completion: str, expected: str) -> Verdict:
    """Grade a math completion against the expected answer under the strict rule."""
    target = parse_number(expected)
    if target is None:
        raise ValueError(f"expected answer {expected!r} is not a number: the problem data is malformed")
    answer, reason = extract_final_answer(completion)
    if answer is None:
        return Verdict.fail(reason)
    value = parse_number(answer)
    if value is None:
        return Verdict.fail("not_a_single_number", answer=answer[:200])
    if value != target:
        return Verdict.fail("wrong_answer", answer=answer[:200], expected=expected)
    return Verdict.ok(answer=answer[:200])


def question_and_answer(data: Any) -> tuple[str, str | int | float]:
    """The ``question`` and ``answer`` of a problem given as JSON, or a ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"problem must be a JSON object, not {type(data).__name__}")
    question, answer = data.get("question"), data.get("answer")
    if not isinstance(question, str):
        raise ValueError("problem.question must be a string")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError("problem.answer must be a string or a number")
    return question, answer


class MathEnvironment(Environment):
    """Math-like problems ``{"question": str, "answer": str}`` graded by the strict final-answer rule."""

    kind: ClassVar[str] = "math"

    def verify(self, problem: Problem, completion: str) -> Verdict:
        return grade_math(completion, problem.payload["answer"])

    def parse_problem(self, data: dict[str, Any]) -> Problem:
        question, answer = question_and_answer(data)
        if parse_number(str(answer)) is None:
            raise ValueError(f"problem.answer {answer!r} is not a number")
        return Problem.make(self.name, question, {"answer": str(answer)})
