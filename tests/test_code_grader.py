"""The code grader and the ``code`` / ``mbpp`` environments, with real sandboxes."""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from evertrain.envs.base import Problem, Verdict
from evertrain.envs.code import MBPP, MBPP_EXCLUDED, REASONS, CodeEnvironment, extract_code, grade_code
from evertrain.sandbox import plain

ADD = {"tests": ["assert add(1, 2) == 3", "assert add(5, 7) == 12", "assert add(-4, 4) == 0"],
       "entry_point": "add"}


@pytest.fixture(scope="module")
def mbpp() -> MBPP:
    return MBPP()


def _mbpp_rows() -> dict[int, dict]:
    with open(Path(__file__).parents[1] / "data" / "mbpp" / "mbpp.jsonl") as lines:
        return {row["task_id"]: row for row in map(json.loads, lines)}


# --- plain data -------------------------------------------------------------------------------------

PLAIN_VALUES = [None, True, False, 0, -1, 2**200, -(2**70), 1.5, -0.0, math.inf, "é\x00\ud800", b"\x00\xff",
                1 + 2j, [], (), {}, set(), frozenset(), [1, (2, 3.0)], {(1, "a"): {"x": [None]}, 2: b""},
                {frozenset({1, 2}), (1,)}, [[[[1]]]]]


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=repr)
def test_plain_round_trip_keeps_exact_types(value: object) -> None:
    back = plain.decode(plain.encode(value))
    assert back == value and type(back) is type(value)
    assert repr(back) == repr(value)


def test_plain_keeps_int_float_bool_apart() -> None:
    assert [type(v) for v in plain.decode(plain.encode([1, 1.0, True, (1,)]))] == [int, float, bool, tuple]
    assert math.isnan(plain.decode(plain.encode(math.nan)))


def stable_id(value: object) -> str:
    """repr without memory addresses: the same test ids in every process (pytest-xdist compares them)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


class AlwaysEqual:
    def __eq__(self, other: object) -> bool:
        return True


class Int(int):
    pass


@pytest.mark.parametrize("value", [AlwaysEqual(), Int(3), type("S", (str,), {})("x"), [1, Int(2)],
                                   {"k": AlwaysEqual()}, (x for x in ()), map(str, []), int, print,
                                   range(3), bytearray(b"x"), memoryview(b"x")], ids=stable_id)
def test_plain_refuses_everything_else(value: object) -> None:
    with pytest.raises(plain.NotPlain):
        plain.encode(value)


def test_plain_refuses_cycles() -> None:
    loop: list = []
    loop.append(loop)
    with pytest.raises(plain.NotPlain):
        plain.encode(loop)


@pytest.mark.parametrize("blob", [b'{"a": 1}', b'["f", NaN]', b'["i", "zz"]', b'["q", 1]', b'["l", 1]',
                                  b'["e", [["l", []]]]', b'["d", [[1, 2]]]', b"[]", b'"s"', b"\xff",
                                  b'["N", 1]', b'["B", 1]', b'["s", 1]', b"[" * 100_000])
def test_plain_decoder_rejects_malformed_input(blob: bytes) -> None:
    with pytest.raises(plain.DecodeError):
        plain.decode(blob)


# --- extracting code --------------------------------------------------------------------------------

def test_extract_code() -> None:
    assert extract_code("def f(): pass") == "def f(): pass"
    assert extract_code("Here:\n```python\nx = 1\n```\nand\n```\ny = 2\n```\nbye") == "y = 2"
    assert extract_code("```py\nz = 3\n```\n```text\nnot code\n```") == "z = 3"
    assert extract_code("Sure!\n```python\ndef f():\n    return 1") == "def f():\n    return 1"
    assert extract_code("```python\n```") == ""


# --- grading ----------------------------------------------------------------------------------------

def test_correct_solution_passes_with_audit_rows() -> None:
    verdict, records = grade_code(ADD, "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```")
    assert (verdict.reward, verdict.passed, verdict.reason) == (1.0, True, "correct")
    assert [t["passed"] for t in verdict.detail["tests"]] == [True, True, True]
    assert [r.purpose for r in records] == ["candidate", "tests"]
    rows = verdict.detail["sandbox_runs"]
    assert [row["run_id"] for row in rows] == [r.run_id for r in records] == verdict.detail["run_ids"]
    json.dumps(verdict.detail)  # the detail is stored as JSON
    assert all(isinstance(row["started_at"], str) for row in rows)


def test_differently_written_solution_passes() -> None:
    source = "import operator\nfrom functools import reduce\n\n" \
             "def add(*xs):\n    return reduce(operator.add, xs)"
    assert grade_code(ADD, source)[0].passed


def test_wrong_solution_fails_with_per_test_detail() -> None:
    verdict, _ = grade_code(ADD, "def add(a, b):\n    return a + b if a > 0 else a - b")
    assert (verdict.reward, verdict.reason) == (0.0, "tests_failed")
    assert [t["passed"] for t in verdict.detail["tests"]] == [True, True, False]
    assert verdict.detail["tests"][2]["error"].startswith("AssertionError")


def test_candidate_exceptions_reach_the_tests_as_builtin_types() -> None:
    expects_raise = "try:\n    inv(0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    raise AssertionError"
    payload = {"tests": [expects_raise, "assert inv(4) == 0.25"], "entry_point": "inv"}
    assert grade_code(payload, "def inv(x):\n    return 1 / x")[0].passed
    assert grade_code(payload, "def inv(x):\n    return 1 / x if x else 0")[0].reason == "tests_failed"


def test_helpers_and_classes_stay_in_the_candidate() -> None:
    source = ("class Acc:\n    def __init__(self):\n        self.n = 0\n\n"
              "def _go(a, b):\n    return a + b\n\ndef add(a, b):\n    return _go(a, b)\n")
    assert grade_code(ADD, source)[0].passed


@pytest.mark.parametrize(("completion", "reason"), [
    ("", "no_code"), ("```python\n```", "no_code"), ("def add(a, b) return a", "syntax_error"),
    ("def plus(a, b):\n    return a + b", "missing_function"),
    ("raise ValueError('boom')", "candidate_crashed"), ("import nonexistent_module_xyz", "candidate_crashed"),
])
def test_failure_reasons(completion: str, reason: str) -> None:
    verdict, records = grade_code(ADD, completion)
    assert (verdict.reward, verdict.passed, verdict.reason) == (0.0, False, reason)
    assert reason in REASONS
    assert len(records) == (0 if reason == "no_code" else 2)


# --- the mbpp environment ---------------------------------------------------------------------------

def test_mbpp_splits(mbpp: MBPP) -> None:
    left_out = set(MBPP_EXCLUDED) | set(MBPP.constant_ids())  # a constant passes the tests of the latter
    excluded_eval = sum(11 <= t <= 510 for t in left_out)
    assert mbpp.count("eval") == 500 - excluded_eval
    assert mbpp.count("train") == 464 - (len(left_out) - excluded_eval)
    eval_ids = {p.payload["task_id"] for p in mbpp.problems("eval", 10_000, 0)}
    train_ids = {p.payload["task_id"] for p in mbpp.problems("train", 10_000, 0)}
    assert not eval_ids & train_ids
    assert min(eval_ids) == 11 and max(eval_ids) == 510 and min(train_ids) == 511
    assert not (eval_ids | train_ids) & (left_out | set(range(1, 11)))
    assert [p.id for p in mbpp.problems("train", 5, 7)] == [p.id for p in mbpp.problems("train", 5, 7)]
    assert [p.id for p in mbpp.problems("train", 5, 7)] != [p.id for p in mbpp.problems("train", 5, 8)]
    assert all(p.split == "eval" for p in mbpp.problems("eval", 3, 0))


def test_mbpp_prompt_shows_one_test_and_the_name(mbpp: MBPP) -> None:
    problem = next(p for p in mbpp.problems("eval", 500, 0) if p.payload["task_id"] == 17)
    tests = problem.payload["tests"]
    assert tests[0] in problem.prompt and tests[1] not in problem.prompt and tests[2] not in problem.prompt
    assert f"`{problem.payload['entry_point']}`" in problem.prompt and "```python" in problem.prompt
    chat = mbpp.messages(problem)
    assert chat[0]["role"] == "system" and chat[-1]["content"] == problem.prompt
    assert mbpp.reference(problem).startswith("```python\n")


def test_mbpp_reference_passes_through_verify(mbpp: MBPP) -> None:
    problem = mbpp.problems("eval", 1, 0)[0]
    verdict = mbpp.verify(problem, mbpp.reference(problem))
    assert isinstance(verdict, Verdict) and verdict.passed
    assert len(verdict.detail["sandbox_runs"]) == 2


def test_mbpp_hardcoding_the_visible_test_fails(mbpp: MBPP) -> None:
    problem = next(p for p in mbpp.problems("eval", 500, 0) if p.payload["task_id"] == 17)
    # task 17: square_perimeter(a); the prompt shows `assert square_perimeter(10)==40`
    assert problem.payload["tests"][0] == "assert square_perimeter(10)==40"
    verdict = mbpp.verify(problem, "```python\ndef square_perimeter(a):\n    return 40\n```")
    assert verdict.reason == "tests_failed"
    assert [t["passed"] for t in verdict.detail["tests"]] == [True, False, False]
    assert mbpp.verify(problem, "```python\ndef square_perimeter(side):\n    return side * 4\n```").passed


def _grade_reference(row: dict) -> tuple[int, Verdict]:
    from evertrain.envs.code import mbpp_entry_point

    payload = {"tests": row["test_list"], "test_setup": row["test_setup_code"],
               "entry_point": mbpp_entry_point(row["code"], row["test_list"][0])}
    return row["task_id"], grade_code(payload, row["code"])[0]


def test_mbpp_reference_sample_scores_one() -> None:
    """Every tenth task's reference (all 974 are graded by benchmarks/sandbox.py: only MBPP_EXCLUDED fail).

    Task 123 is left out: its reference alone takes 3 s of CPU, which would make this test slow.
    """
    rows = _mbpp_rows()
    sample = [rows[t] for t in sorted(rows) if t % 10 == 3 and t not in MBPP_EXCLUDED and t != 123]
    with ThreadPoolExecutor(4) as pool:
        verdicts = dict(pool.map(_grade_reference, sample))
    failed = {t: (v.reason, v.detail.get("tests")) for t, v in verdicts.items() if not v.passed}
    assert len(sample) >= 95
    assert failed == {}


def test_mbpp_exclusions_are_real() -> None:
    """Each listed exception does fail as graded: the list is not an excuse for something else."""
    rows = _mbpp_rows()
    with ThreadPoolExecutor(4) as pool:
        verdicts = dict(pool.map(_grade_reference, [rows[t] for t in MBPP_EXCLUDED]))
    assert all(v.reason in ("non_plain_value", "non_plain_argument") for v in verdicts.values()), verdicts


# --- the generic code environment -------------------------------------------------------------------

def test_code_environment_reads_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "problems.jsonl"
    rows = [{"prompt": f"Write double{i}(x).", "entry_point": f"double{i}",
             "tests": [f"assert double{i}(2) == 4", f"assert double{i}(0) == 0"],
             "reference": f"def double{i}(x):\n    return 2 * x"} for i in range(20)]
    rows[0]["split"] = "eval"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    env = CodeEnvironment(path=str(path))
    assert env.count("train") + env.count("eval") == 20 and env.count("eval") >= 1
    problem = env.problems("eval", 1, 0)[0]
    assert isinstance(problem, Problem) and problem.env == "code"
    assert problem.prompt.startswith("Write double")
    assert env.verify(problem, env.reference(problem)).passed
    assert not env.verify(problem, "```python\ndef wrong(x):\n    return x\n```").passed
    with pytest.raises(ValueError, match="path="):
        CodeEnvironment().problems("train", 1, 0)
    path.write_text('{"prompt": 1}\n')
    with pytest.raises(ValueError, match=":1: not a code problem"):
        CodeEnvironment(path=str(path)).count("train")
