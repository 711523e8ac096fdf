"""Environments: references earn 1, splits never overlap, ids are stable content hashes."""

from __future__ import annotations

import pytest

from evertrain.envs import registry
from evertrain.envs.base import Problem


@pytest.mark.parametrize("name", ["arithmetic", "gsm8k", "digits"])
def test_train_and_eval_never_share_a_problem(name):
    env = registry.get(name)
    held = {p.id for p in env.problems("eval", 200, 0)}
    train = {p.id for p in env.problems("train", 500, 1)}
    assert held and train and not held & train


def test_every_gsm8k_reference_answer_scores_one():
    env = registry.get("gsm8k")
    problems = env.problems("train", env.count("train"), 0) + env.problems("eval", env.count("eval"), 0)
    assert len(problems) == 7473
    failures = [p.id for p in problems if env.verify(p, env.reference(p)).reward != 1.0]
    assert failures == []


@pytest.mark.parametrize("name", ["arithmetic", "gsm8k"])
def test_references_pass_and_junk_fails(name):
    env = registry.get(name)
    for problem in env.problems("eval", 20, 0):
        assert env.verify(problem, env.reference(problem)).passed
        for junk in ["", "I don't know", "#### 1\n#### 2", f"#### {problem.payload['answer']} or 1"]:
            assert env.verify(problem, junk).reward == 0.0


def test_ids_are_content_hashes():
    a = Problem.make("arithmetic", "What is 2 + 2?", {"answer": "4"})
    b = Problem.make("arithmetic", "What is 2 + 2?", {"answer": "4"})
    c = Problem.make("arithmetic", "What is 2 + 3?", {"answer": "5"})
    assert a.id == b.id != c.id


def test_same_seed_same_problems():
    env = registry.get("gsm8k")
    assert [p.id for p in env.problems("train", 10, 3)] == [p.id for p in env.problems("train", 10, 3)]
    assert [p.id for p in env.problems("train", 10, 3)] != [p.id for p in env.problems("train", 10, 4)]


def test_unknown_environment_lists_known_names():
    with pytest.raises(registry.UnknownEnvironment, match="arithmetic"):
        registry.get("chess")
