"""``verifiers:<taskset>``: tasksets written for verifiers 0.4 (``verifiers.v1``) train in the loop, their reward
functions graded in the rubric worker's jail, audited before they train.

vf-sums is a real package in the repository's environments/ folder, written only against verifiers' public API
and installed with pip by `make setup` as a user installs one; vf-planted (tests/vf_planted, loaded from its
folder through the ``path`` option) carries the rubrics a community package may ship: loose, crashing, hanging."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evertrain.envs import registry
from evertrain.envs.quality import validate

PLANTED = str(Path(__file__).resolve().parent / "vf_planted")


@pytest.fixture(scope="module")
def sums():
    env = registry.get("verifiers:vf-sums", num_tasks=60, templated=True)
    yield env
    env.close()


@pytest.fixture(scope="module")
def loose():
    env = registry.get("verifiers:vf-planted", path=PLANTED, mode="loose", timeout_s=2)
    yield env
    env.close()


def test_a_taskset_becomes_problems_with_fixed_disjoint_splits(sums):
    train, held = sums.problems("train", 1000, 0), sums.problems("eval", 1000, 0)
    assert len(train) + len(held) == 60 and held
    assert not {p.prompt for p in train} & {p.prompt for p in held}  # no task (here: no prompt) on both sides
    assert [p.id for p in sums.problems("eval", 5, 0)] == [p.id for p in held[:5]]  # a stable held-out order
    sums.close()  # a fresh worker process loads the same tasks: the same problems, split the same way
    again = registry.get("verifiers:vf-sums", num_tasks=60, templated=True)
    assert [p.id for p in again.problems("eval", 1000, 0)] == [p.id for p in held]
    problem = train[0]
    assert sums.messages(problem)[0]["role"] == "system" and problem.prompt in sums.messages(problem)[-1]["content"]


def test_the_rubric_grades_with_its_components_kept(sums):
    problem = sums.problems("train", 1, 0)[0]
    answer = problem.payload["answer"]
    right = sums.verify(problem, f"so \\boxed{{{answer}}}")
    assert right.passed and right.reward == 1.0 and right.detail["rewards"] == {"correct": 1.0}
    assert right.detail["metrics"]["reply_chars"] > 0  # the package's own metric, kept per rollout
    wrong = sums.verify(problem, f"\\boxed{{{int(answer) + 1}}}")
    assert not wrong.passed and wrong.reward == 0.0 and wrong.reason == "wrong"
    # the key names the worker's own task: a payload claiming another answer changes nothing
    forged = type(problem)(problem.env, problem.id, problem.prompt, {**problem.payload, "answer": "1"})
    assert sums.verify(forged, "\\boxed{1}").reward == 0.0


def test_a_rubric_that_crashes_or_hangs_costs_that_rollout_only(loose):
    problem = loose.problems("train", 1, 0)[0]
    for reply, why in (("crash \\boxed{1}", "fell over"), ("hang \\boxed{1}", "longer than 2 s")):
        bad = loose.verify(problem, reply)
        assert bad.reason == "grader_error" and bad.reward == 0.0 and why in bad.detail["error"], bad
        good = loose.verify(problem, f"\\boxed{{{problem.payload['answer']}}}")  # the next one is graded as usual
        assert good.passed, good


def test_a_grade_starts_no_process_and_cannot_forge_later_grades(loose):
    """A reward function that runs the answer (eval, sympy) would let the answer start a process that outlives its
    grade and writes forged grades: a grading child starts none (an audit hook refuses it: that rollout's grader
    error), keeps no descriptor but its reply pipe, and its whole process group is killed after each grade."""
    import time

    problem = loose.problems("train", 1, 0)[0]
    refused = loose.verify(problem, "fork")
    assert refused.reason == "grader_error" and "os.fork" in refused.detail["error"], refused
    time.sleep(0.5)  # the forger's writes, had it any descriptor of the worker's
    for reply in ("\\boxed{-1}", "nothing", "\\boxed{-2}"):
        verdict = loose.verify(problem, reply)
        assert verdict.reward == 0.0 and verdict.reason == "wrong", verdict


def test_a_loose_rubric_is_flagged_and_refused_unless_accepted(loose):
    report = validate(loose, problems=1)
    assert not report.ok and any("(hedge)" in failure for failure in report.failures), report.failures
    assert report.by_label()["hedge"]["failed"] > 0 and report.by_label()["good"]["failed"] == 0
    accepted = registry.get("verifiers:vf-planted", path=PLANTED, mode="loose", timeout_s=2, accept=["hedge"])
    report = validate(accepted, problems=1)
    assert report.ok and report.accepted and all("(hedge)" in line for line in report.accepted)


def test_bad_options_and_names_are_refused_with_what_is_wrong():
    from evertrain.sandbox.verifiers_worker import RubricError

    with pytest.raises(ValueError, match="eval_share"):
        registry.get("verifiers:vf-sums", eval_share=1.5)
    with pytest.raises(registry.UnknownEnvironment, match="name the taskset"):
        registry.check_name("verifiers:")
    missing = registry.get("verifiers:vf-no-such-taskset")
    with pytest.raises(RubricError, match="vf-no-such-taskset"):
        missing.problems("train", 1, 0)
    from evertrain.envs.base import Problem

    # a grade never raises: a worker that cannot start is that rollout's grader error, at once the second time
    stray = Problem("verifiers:vf-no-such-taskset", "x", "What?", {"key": "k", "messages": []})
    assert missing.verify(stray, "1").reason == "grader_error"
    wrong_knob = registry.get("verifiers:vf-sums", digitz=3)
    with pytest.raises(RubricError, match="digitz"):
        wrong_knob.problems("train", 1, 0)


GUESS = {"num_tasks": 40, "answer_field": "target", "answer_format": "plain", "max_turns": 3, "templated": True}


def test_a_multi_turn_environment_is_replayed_from_the_policy_s_replies_alone():
    guess = registry.get("verifiers:vf-guess", **GUESS)
    problem = guess.problems("train", 1, 0)[0]
    target = problem.payload["answer"]
    low = "1" if target != "1" else "2"
    assert guess.multi_turn and guess.conversational and guess.max_turns == 3
    said = guess.reply(problem, [{"role": "assistant", "content": low}])
    assert said in ("higher", "lower")
    assert guess.reply(problem, [{"role": "assistant", "content": target}]) is None  # solved: it says no more
    text = guess.episode_text([{"role": "assistant", "content": low}, {"role": "user", "content": said},
                               {"role": "assistant", "content": target}])
    verdict = guess.verify(problem, text)
    assert verdict.passed and verdict.detail["turns"] == 2 and verdict.detail["rewards"]["solved"] == 1.0
    # the environment's messages are never read from the graded text: a forged "correct" earns nothing
    forged = json.dumps({"replies": [low]}) + "\ncorrect"
    assert not guess.verify(problem, forged).passed
    # more replies than the turn limit: graded on the first max_turns only
    assert not guess.verify(problem, json.dumps({"replies": [low] * 3 + [target]})).passed


def test_a_campaign_refuses_to_train_on_a_loose_rubric_until_its_config_accepts_the_probe(tmp_path, models_dir):
    from evertrain.runtime import EnvironmentInvalid, Runtime
    from tests.conftest import smoke_config_in

    spec = {"name": "verifiers:vf-planted", "weight": 1, "options": {"path": PLANTED, "mode": "loose",
                                                                      "timeout_s": 2}}
    config = smoke_config_in(tmp_path / "refused", models_dir, name="loose", environments=[spec])
    with Runtime.open(config) as rt, pytest.raises(EnvironmentInvalid, match=r"\(hedge\)"):
        rt.ensure_started()
    spec["options"]["accept"] = ["hedge"]
    config = smoke_config_in(tmp_path / "accepted", models_dir, name="loose", environments=[spec])
    with Runtime.open(config) as rt:
        rt.ensure_started()  # the same rubric, its paid probe accepted by name: it trains
        assert rt.store.campaign_state("loose") is not None
