"""The calculator's second tool version (a changed interface, for the drift demo): same problems, same sandbox,
same grading; an agent that keeps calling the old tool fails."""

from __future__ import annotations

import json

import pytest

from evertrain.envs import registry
from evertrain.envs.quality import validate
from evertrain.envs.tools import run_episode


def test_a_v1_episode_fails_against_v2_and_a_v2_episode_passes():
    v1, v2 = registry.get("calculator"), registry.get("calculator", tool_version=2)
    problem = v2.problems("eval", 1, 0)[0]
    assert problem.id == v1.problems("eval", 1, 0)[0].id  # the task did not change, only the tool
    p = problem.payload
    old = [f"<python>\n{p['a']} {p['op']} {p['b']}\n</python>", f"#### {p['answer']}"]
    assert v1.verify_transcript(problem, run_episode(v1, problem, iter(old).__next__)).passed
    # under v2 the python tool is gone: the call is no call, the first turn is the final answer, and it fails
    turns = run_episode(v2, problem, iter(old).__next__)
    assert [t["role"] for t in turns] == ["assistant"]
    assert v2.verify_transcript(problem, turns).reward == 0

    operation = {"+": "add", "-": "subtract", "*": "multiply"}[p["op"]]
    new = [f'<calc>\n{{"operation": "{operation}", "x": {p["a"]}, "y": {p["b"]}}}\n</calc>', f"#### {p['answer']}"]
    turns = run_episode(v2, problem, iter(new).__next__)  # the calc tool really runs, in the sandbox
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"]
    assert turns[1]["content"] == p["answer"] and not turns[1]["error"]
    assert v2.verify_transcript(problem, turns).passed
    assert not v1.verify_transcript(problem, run_episode(v1, problem, iter(new).__next__)).passed


@pytest.mark.parametrize(("call", "says"), [
    ('{"op": "*", "a": 2, "b": 3}', "keys operation, x, y"),  # v1-style names
    ("2 * 3", "must be JSON"),
    ('{"operation": "divide", "x": 2, "y": 3}', "operation must be one of"),
    ('{"operation": "add", "x": "__import__(\'os\')", "y": 3}', "must be integers"),
])
def test_a_malformed_v2_call_replies_with_what_is_wrong(call, says):
    v2 = registry.get("calculator", tool_version=2)
    result = v2.tools["calc"].run(call, v2.problems("eval", 1, 0)[0])
    assert result.error and says in result.output


def test_v2_passes_the_verifier_self_test_and_shows_the_new_interface():
    v2 = registry.get("calculator", tool_version=2)
    report = validate(v2, problems=1)
    assert report.ok, report.failures
    chat = v2.messages(v2.problems("eval", 1, 0)[0])
    assert "<calc>" in chat[0]["content"] and "<python>" not in json.dumps(chat)
    assert "<python>" in json.dumps(registry.get("calculator").messages(v2.problems("eval", 1, 0)[0]))
    with pytest.raises(ValueError, match="tool_version"):
        registry.get("calculator", tool_version=3)
