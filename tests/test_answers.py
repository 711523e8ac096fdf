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
