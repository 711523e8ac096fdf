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


# ---------------------------------------------------------------------------------------------------
# The verifier self-test: an API every environment implements (known_good, known_bad, oracle_answer,
# write_answer), run by `evertrain envs --validate` and by a campaign before it trains on an environment.

ANSWER_LABELS = {"empty", "junk", "non_finite", "zero", "one", "other_problem", "restated", "hedge",
                 "over_long_number"}


@pytest.mark.parametrize("name", ["arithmetic", "gsm8k", "sql", "gsm8k-tools"])
def test_answer_environments_pass_the_whole_battery(name):
    from evertrain.envs.quality import validate

    report = validate(registry.get(name), problems=1)
    assert report.ok, report.failures
    labels = report.by_label()
    assert set(labels) >= ANSWER_LABELS, set(labels)
    assert all(entry["failed"] == 0 for entry in labels.values())
    assert all(case.reward == 0.0 for case in report.cases if case.expect == 0.0)  # exactly 0, not small


def test_code_environment_battery_includes_its_own_bad_answers():
    from evertrain.envs.quality import validate

    report = validate(registry.get("mbpp"), problems=1)
    assert report.ok, report.failures
    expected = {"stop_iteration", "other_problem", "zero", "one", "non_finite", "restated", "hack"}
    assert set(report.by_label()) >= expected


def test_a_new_environment_plugs_into_the_self_test():
    from evertrain.envs.arithmetic import Arithmetic
    from evertrain.envs.quality import validate

    class Units(Arithmetic):
        name = "units-test"

        def known_good(self, problem):
            return [f"#### {problem.payload['answer']}", f"\\boxed{{{problem.payload['answer']}}}"]

        def known_bad(self, problem, other):
            return [("negated", f"#### -{problem.payload['answer']}0")]

    report = validate(Units(), problems=1)
    assert report.ok, report.failures
    assert report.by_label()["negated"]["cases"] == 2 and report.by_label()["good"]["cases"] == 4


@pytest.mark.parametrize("credits, label", [
    ("nan", "non_finite"), ("0", "zero"), ("1e999999999", "over_long_number"), (" or ", "hedge"),
])
def test_a_verifier_that_credits_a_bad_answer_fails_its_self_test(credits, label):
    from evertrain.envs.arithmetic import Arithmetic
    from evertrain.envs.base import Verdict
    from evertrain.envs.quality import validate

    class Gullible(Arithmetic):
        def verify(self, problem, completion):
            if credits in completion:
                return Verdict.ok()
            return super().verify(problem, completion)

    report = validate(Gullible(), problems=1)
    assert not report.ok
    assert report.by_label()[label]["failed"] > 0, report.failures


def test_envs_validate_json_parses_and_progress_goes_to_stderr():
    import json
    import subprocess
    import sys

    # rg:bf's generator prints dots to stdout while it builds problems: they must not reach the JSON, not from
    # the processes of the pool either (--jobs 2), whose rows come back in the order asked for
    result = subprocess.run([sys.executable, "-m", "evertrain.cli", "envs", "--validate", "1", "--json", "--jobs", "2",
                             "--env", "arithmetic", "--env", "rg:coin_flip", "--env", "rg:bf"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout)  # nothing but the JSON on stdout
    assert [row["name"] for row in rows] == ["arithmetic", "rg:coin_flip", "rg:bf"]
    for row in rows:
        assert row["selftest"]["status"] == "ok" and row["selftest"]["cases"] > 20
        assert row["selftest"]["by_label"]["zero"]["failed"] == 0
    assert "self-test arithmetic" in result.stderr


def test_rebuild_takes_the_answer_from_the_environment_never_from_whoever_sent_the_problem():
    """Issue 45: the endpoint grades, and curation trains, on Environment.rebuild's problem: a claimed answer
    is replaced by the environment's own; a question it cannot vouch for gives None."""
    get = registry.get
    calculator = get("calculator")
    for own in calculator.problems("train", 20, 3) + calculator.problems("eval", 20, 0):
        claimed = Problem.make("calculator", own.prompt, {"answer": "1"})
        rebuilt = calculator.rebuild(claimed)  # the generator's own problem: same id, same answer
        assert (rebuilt.id, rebuilt.prompt, rebuilt.payload) == (own.id, own.prompt, own.payload)
    rebuilt = calculator.rebuild(Problem.make("calculator", "what is  12 + 7 * 3 - 4?", {"answer": "53"}))
    assert rebuilt.payload == {"expr": "12 + 7 * 3 - 4", "answer": "29"}  # Python's precedence, as the tool's
    for question in ("What is 2 ** 300?", "What is 7 / 2?", "What is twelve plus one?", "What is 1 + 1? Say 3."):
        assert calculator.rebuild(Problem.make("calculator", question, {"answer": "2"})) is None, question
    assert get("calculator", ops=["+"]).rebuild(Problem.make("calculator", "What is 3 * 4?", {})) is None

    gsm8k = get("gsm8k")
    own = gsm8k.problems("train", 1, 5)[0]
    sent = Problem.make("gsm8k", "  " + own.prompt.upper().replace(" ", "\u200b  ") + "\n", {"answer": "0"})
    assert gsm8k.rebuild(sent) == own
    assert gsm8k.rebuild(Problem.make("gsm8k", own.prompt + " Then add one.", {"answer": "0"})) is None
    arithmetic = get("arithmetic")
    own = arithmetic.problems("train", 1, 2)[0]
    assert arithmetic.rebuild(Problem.make("arithmetic", own.prompt, {"answer": "0"})) == own

    products = get("rg:products")  # generated without end: nothing to look it up in, nothing computed
    assert products.rebuild(products.problems("train", 1, 0)[0]) is None
