"""The strict final-answer rule shared by every math-like environment."""

from __future__ import annotations

import pytest

from evertrain.envs.answers import grade_math, parse_number


@pytest.mark.parametrize(("completion", "expected"), [
    ("12 + 7 = 19\n#### 19", "19"),
    ("so the total is\n\\boxed{1,234}", "1234"),
    ("#### 72.00", "72"),
    ("#### -0", "0"),
    ("#### $18", "18"),
    ("#### 3/4", "0.75"),
    ("work\n#### 5.\n\n", "5"),
])
def test_correct_answers_earn_one(completion, expected):
    assert grade_math(completion, expected).reward == 1.0


@pytest.mark.parametrize(("completion", "reason"), [
    ("The answer is 72.", "no_final_answer"),
    ("#### 70 or 71", "not_a_single_number"),
    ("#### 70\n#### 71", "multiple_answers"),
    ("#### 72\n\\boxed{72}", "multiple_answers"),
    ("#### 1 2 3 4 5 6 7 8 72", "not_a_single_number"),
    ("#### 72\nI hope this helps!", "answer_not_on_last_line"),
    ("#### 71", "wrong_answer"),
    ("#### seventy-two", "not_a_single_number"),
    ("", "no_final_answer"),
])
def test_hedges_floods_and_misses_earn_zero(completion, reason):
    verdict = grade_math(completion, "72")
    assert verdict.reward == 0.0 and not verdict.passed and verdict.reason == reason


def test_parse_number_normalizes():
    assert parse_number("1,000") == parse_number("1000.0") == 1000
    assert parse_number("1,00") is None  # not a thousands grouping
    assert parse_number("-0") == 0


def test_malformed_expected_answer_is_an_operator_error():
    with pytest.raises(ValueError, match="malformed"):
        grade_math("#### 1", "one")


@pytest.mark.parametrize("number", ["1e999999999", "1E+99999", "-1e-999999999", "9" * 5000, "1" * 4400 + "/7",
                                    "7/" + "3" * 4400, "0." + "0" * 5000 + "1", "1,000" * 5000, "$" + "1" * 300])
def test_parse_number_is_bounded(number):
    import time

    started = time.monotonic()
    assert parse_number(number) is None
    assert grade_math(f"#### {number}", "7").reason == "not_a_single_number"
    assert time.monotonic() - started < 0.05


def test_numbers_within_the_bounds_still_parse():
    assert parse_number("1e300") == 10 ** 300 and parse_number("-2.5e-3") == parse_number("-0.0025")
    assert parse_number("9" * 200) == int("9" * 200) and parse_number("9" * 201) is None


def test_an_over_long_completion_is_refused_before_grading():
    from evertrain.envs import registry
    from evertrain.scoring import MAX_COMPLETION_CHARS, verify_safely

    env = registry.get("arithmetic")
    problem = env.problems("eval", 1, 0)[0]
    verdict = verify_safely(env, problem, "x" * (MAX_COMPLETION_CHARS + 1) + f"\n#### {problem.payload['answer']}")
    assert (verdict.reward, verdict.reason) == (0.0, "completion_too_long")
