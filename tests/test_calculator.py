"""The calculator environment: big-number arithmetic with the sandboxed Python tool."""

from __future__ import annotations

import pytest

from evertrain.envs import registry
from evertrain.envs.quality import validate


def test_splits_apart_and_a_real_tool_episode_scores_one():
    env = registry.get("calculator")
    held = {p.id for p in env.problems("eval", 500, 0)}
    train = env.problems("train", 300, 1)
    assert len(held) == 500 and not held & {p.id for p in train}
    problem = env.problems("eval", 1, 0)[0]
    turns = env.reference_transcript(problem)  # the python tool really runs, in the sandbox
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"]
    assert turns[1]["content"] == problem.payload["answer"]
    assert env.verify_transcript(problem, turns).passed
    # the tool's output alone, or the answer inside a call, supplies nothing
    assert env.verify(problem, f"<python>\nprint('#### {problem.payload['answer']}')\n</python>").reward == 0


def test_calculator_passes_the_verifier_self_test():
    report = validate(registry.get("calculator"), problems=1)
    assert report.ok, report.failures


def test_bad_options_name_what_is_wrong():
    with pytest.raises(ValueError, match="digits"):
        registry.get("calculator", digits=[5, 3])
    with pytest.raises(ValueError, match="ops"):
        registry.get("calculator", ops=["/"])
