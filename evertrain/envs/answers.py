"""The one strict rule for final answers, shared by every math-like environment.

A completion earns credit only if it commits to exactly one final answer, written as ``#### <answer>``
or ``\\boxed{<answer>}`` on its last non-empty line, and that answer equals the expected one after
numeric normalization (thousands commas, trailing zeros, ``-0``, a leading ``$``). Several markers,
a hedge ("70 or 71"), or a list of numbers earn 0: a policy under RL pressure would otherwise learn to
spray candidates.

Numbers are read by one canonical rule (:func:`canonical_number`; :func:`number_hazard` for the numbers
inside a longer answer), used by every environment before any scorer sees a value: any spelling of a
digit or sign is the same value, any spelling of nan or inf is refused, and the digit and magnitude
bounds are checked on the whole value, however its exponent is written, before anything is built.
"""

from __future__ import annotations

import math
import re
import unicodedata
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, ClassVar

from evertrain.envs.base import Environment, Problem, Verdict

_HASH = "####"
_BOXED = "\\boxed{"
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_THOUSANDS = re.compile(r"[+-]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]*)?")
_FRACTION = re.compile(r"([+-]?[0-9]+)\s*/\s*([0-9]+)")
_DIGIT_UNDERSCORE = re.compile(r"(?<=[0-9])_(?=[0-9])")  # Python's float() and Decimal() accept 1_000

# Bounds on what the trusted process converts. An answer is parsed in the grading process itself, so
# an unbounded conversion is a stall for every item graded beside it: Fraction(Decimal("1e999999999"))
# builds a billion-digit integer (32 s holding the GIL, measured). No answer any environment expects
# comes near these; anything beyond them is "not a single number" and earns 0.
MAX_NUMBER_CHARS = 400  # the whole written number, signs, separators and exponent included
MAX_DIGITS = 200  # significant digits (numerator and denominator each, for a fraction)
# |decimal exponent| of the value itself (not of what is written after the 'e'): values up to 9.99e300
# and down to 1e-300 stay finite and non-zero for a scorer that turns the answer into a float (floats
# end at 1.8e308 and underflow to 0 below 4.9e-324); past the bound the same text may mean inf or 0.
MAX_EXPONENT = 300

# Spellings a scorer's float()/Decimal()/complex() reads as a non-finite value.
NON_FINITE_WORDS = ("nan", "snan", "inf", "infinity")
# Unicode signs that mean minus (U+2212 MINUS SIGN survives NFKC; the dashes are what models write).
_MINUSES = dict.fromkeys(map(ord, "\u2212\u2010\u2011\u2012\u2013\u2014\u2015\ufe63\uff0d"), "-")
_SUPERSCRIPTS = dict(zip(map(ord, "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b"),
                         "0123456789+-", strict=True))


def normalize_numeric_text(text: str) -> str:
    """``text`` with every spelling of a digit or sign a number parser accepts made ASCII, in one pass.

    Python's ``float``/``int``/``Decimal`` accept any Unicode decimal digit (fullwidth, Arabic-Indic ...),
    and NFKC folds fullwidth letters (``ｎａｎ``); minus signs and dashes become ``-``; a run of superscript
    digits becomes an explicit power (``10⁹⁹⁹`` is ``10^999``, not the number 10999). Callers bound the
    length first: this is linear in it.
    """
    if text.isascii():
        return text
    out: list[str] = []
    in_superscript = False
    for char in text:
        if ord(char) in _SUPERSCRIPTS:
            out.append(("" if in_superscript else "^") + _SUPERSCRIPTS[ord(char)])
            in_superscript = True
            continue
        in_superscript = False
        if char.isascii():
            out.append(char)
        elif char.isdecimal():
            out.append(str(unicodedata.decimal(char)))
        else:
            out.append(unicodedata.normalize("NFKC", char).translate(_MINUSES))
    return "".join(out)


def _magnitude(integer: str, fraction: str, exponent: str) -> tuple[int, int] | None:
    """(significant digits, decimal exponent of the leading digit) of a decimal written as its three
    parts (digits only, signs removed from ``exponent``'s digits by the caller), or None for zero.
    Bounded: an exponent of more than 7 digits is never converted (it is out of any bound anyway)."""
    digits = (integer + fraction).lstrip("0")
    if not digits:
        return None
    sign = -1 if exponent.startswith("-") else 1
    exponent_digits = exponent.lstrip("+-").lstrip("0") or "0"
    if len(exponent_digits) > 7:
        return len(digits.rstrip("0")), sign * 10**7
    leading = len(integer.lstrip("0")) - 1 if integer.lstrip("0") else -(len(fraction) - len(fraction.lstrip("0")) + 1)
    return len(digits.rstrip("0")), leading + sign * int(exponent_digits)


def canonical_number(text: str) -> tuple[Fraction | None, str]:
    """The one reading of a written number, bounded and finite: ``(value, "ok")`` or ``(None, why)``.

    Accepted: plain decimals and scientific notation in any Unicode digits and minus signs, ``1_000``
    and ``1,234`` separators, a leading ``$``, a trailing period, and ``a/b`` fractions. ``why`` is
    ``"non_finite"`` for any spelling of nan or inf (any case, Unicode letters), ``"out_of_bounds"`` for
    more than :data:`MAX_DIGITS` significant digits or a value whose decimal exponent passes
    :data:`MAX_EXPONENT` (``1e9_99``, ``1E+0000999``, ``1000...0e200``, ``1e-400``, however the exponent is
    spelled), and ``"not_a_number"`` otherwise. Every bound is checked on the text before a conversion.
    """
    if len(text) > 4 * MAX_NUMBER_CHARS:  # before strip(): even stripping a huge string costs
        return None, "out_of_bounds"
    value = normalize_numeric_text(text).strip()
    if len(value) > MAX_NUMBER_CHARS:
        return None, "out_of_bounds"
    value = value.removeprefix("$").strip()
    if value.endswith(".") and not value.endswith(".."):
        value = value[:-1]
    if value.lstrip("+-").lower() in NON_FINITE_WORDS:
        return None, "non_finite"
    value = _DIGIT_UNDERSCORE.sub("", value)
    if _THOUSANDS.fullmatch(value):
        value = value.replace(",", "")
    if match := _FRACTION.fullmatch(value):
        if max(len(match.group(1).lstrip("+-0")), len(match.group(2).lstrip("0"))) > MAX_DIGITS:
            return None, "out_of_bounds"
        denominator = int(match.group(2))
        return (Fraction(int(match.group(1)), denominator), "ok") if denominator else (None, "not_a_number")
    if not _NUMBER.fullmatch(value):
        return None, "not_a_number"
    mantissa, _, exponent = value.lower().partition("e")
    integer, _, fraction = mantissa.lstrip("+-").partition(".")
    size = _magnitude(integer, fraction, exponent)
    if size is not None and (size[0] > MAX_DIGITS or abs(size[1]) > MAX_EXPONENT):
        return None, "out_of_bounds"
    try:
        return Fraction(Decimal(value)), "ok"
    except (InvalidOperation, ValueError):
        return None, "not_a_number"


def parse_number(text: str) -> Fraction | None:
    """Parse one number written plainly ('1,234.50', '-0', '$7', '3/4'); None if it is anything else.

    The value of :func:`canonical_number`: bounded and finite, whatever the spelling.
    """
    return canonical_number(text)[0]


# Number-like tokens inside a longer answer (a list, a coordinate pair, an expression), for
# :func:`number_hazard`. Linear: every token starts on a digit or a point, and every quantifier is
# possessive, so no attempt backtracks and the blanks after a number are read once.
_TOKEN = re.compile(r"""
    (?P<hex>0[xX][0-9a-fA-F_]*+(?:\.[0-9a-fA-F_]*+)?+(?:[pP][ \t]*+(?P<hexexp>[+-]?+[0-9_]++))?+)
  | (?:(?P<int>[0-9][0-9_]*+)(?:\.(?P<frac>[0-9_]*+))?+ | \.(?P<pfrac>[0-9][0-9_]*+))
    (?:[ \t]*+[eE][ \t]*+(?P<exp>[+-]?+[ \t]*+[0-9][0-9_]*+))?+
    (?:[ \t]*+(?:\*\*|\^)[ \t]*+\(?+[ \t]*+(?P<pow>[+-]?+[0-9][0-9_]*+))?+
""", re.VERBOSE)
_WORD_NON_FINITE = re.compile(r"(?<![a-z])(?:s?nan|inf(?:inity)?)(?![a-z])")
# letters of number spellings only (nan, snan, inf, infinity, exponent, complex unit): an answer made of
# these and digits is a number to some scorer even after it removes spaces ("n a n" is nan to one)
_NUMERIC_LETTERS = frozenset("nasiftyej")


def _squeeze(text: str) -> str:
    return "".join(text.split()).replace("_", "").lower()


def number_hazard(answer: str, oracle: str = "") -> str | None:
    """Why some number written in ``answer`` is one no scorer may see, or None. Linear in the text.

    For answers that are not one number (lists, pairs, expressions): every number-like token is read
    with the bounds of :func:`canonical_number` (digits, and the value's own exponent however spelled:
    ``1e9_99``, ``1E+0000999``, ``10**999``, ``10⁹⁹⁹``, ``0x1p9999``), and non-finite words are looked for
    in any case and Unicode spelling, also with spaces and underscores removed when the answer is made
    only of number-like characters (a scorer that strips spaces reads ``n a n`` as nan). A hazard the
    oracle itself shows (an oracle holding a 300-digit string) is allowed.
    Reasons: ``"non_finite_answer"``, ``"over_long_number"``.
    """
    text = normalize_numeric_text(answer).lower()
    reference = normalize_numeric_text(oracle).lower()
    if _WORD_NON_FINITE.search(text) and not _WORD_NON_FINITE.search(reference):
        return "non_finite_answer"
    squeezed = _squeeze(text)
    if {c for c in squeezed if c.isalpha()} <= _NUMERIC_LETTERS:
        squeezed_oracle = _squeeze(reference)
        if any(word in squeezed and word not in squeezed_oracle for word in ("nan", "inf")):
            return "non_finite_answer"
    long_ok = _longest_digits(reference) > MAX_DIGITS
    for match in _TOKEN.finditer(text):
        if match.group("hex") is not None:
            exponent = (match.group("hexexp") or "0").replace("_", "")
            if len(exponent.lstrip("+-0")) > 4 or abs(int(exponent or "0")) > 4 * MAX_EXPONENT:
                return "over_long_number"
            if len(match.group("hex").replace("_", "")) > MAX_DIGITS:
                return "over_long_number"
            continue
        integer = (match.group("int") or "").replace("_", "")
        fraction = (match.group("frac") or match.group("pfrac") or "").replace("_", "")
        exponent = "".join((match.group("exp") or "").split()).replace("_", "")
        size = _magnitude(integer, fraction, exponent)
        if size is None:
            continue
        if size[0] > MAX_DIGITS and not long_ok:
            return "over_long_number"
        if abs(size[1]) > MAX_EXPONENT and (exponent or not long_ok):
            return "over_long_number"
        if match.group("pow") is not None and _power_too_big(integer, fraction, match.group("pow")):
            return "over_long_number"
    return None


def _power_too_big(integer: str, fraction: str, power: str) -> bool:
    """Whether base ** power (as written) passes the value bound; computed on logarithms, never built."""
    power = power.replace("_", "")
    digits = power.lstrip("+-").lstrip("0")
    if not digits:
        return False
    try:
        base = float(f"{integer or '0'}.{fraction or '0'}")
    except ValueError:
        return True
    if base in (0.0, 1.0):
        return False
    if len(digits) > 7:
        return True
    return abs(int(digits)) * abs(math.log10(base)) > MAX_EXPONENT


def _longest_digits(text: str) -> int:
    longest = run = 0
    for char in text:
        run = run + 1 if "0" <= char <= "9" else 0 if char != "_" else run
        longest = max(longest, run)
    return longest


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
