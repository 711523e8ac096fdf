"""``rg:<generator>``: every reasoning-gym generator builds, splits, and grades in the sandbox.

The per-generator checks share one module fixture that grades all generators on a pool of two threads
(two sandbox runs each: the reference as a policy's answer is graded, then the other answers batched in one).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest

from evertrain.envs import reasoning_gym as rg
from evertrain.envs import registry
from evertrain.envs.base import Problem, Verdict
from evertrain.sandbox import Limits, SandboxRunRecord

GENERATORS = rg.generator_names()
WRONG = "#### not the answer"


@dataclass
class Graded:
    """What one generator did: its problems and the verdicts of the completions tried on them."""

    train: list[Problem] = field(default_factory=list)
    eval: list[Problem] = field(default_factory=list)
    references: list[str | None] = field(default_factory=list)
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    error: str | None = None


def _grade(generator: str) -> Graded:
    graded = Graded()
    try:
        env = rg.ReasoningGym(generator, eval_size=2)
        graded.train, graded.eval = env.problems("train", 2, 1), env.problems("eval", 2, 1)
        first, held = graded.train[0], graded.eval[0]
        graded.references = [env.reference(first), env.reference(held)]
        # the policy's path (one sandbox a grade) for the reference; the rest in one batched sandbox (the quality
        # check's path, a fork an answer), so the reference graded again also checks that both paths agree
        probes: dict[str, tuple[Problem, str]] = {}
        if graded.references[0] is not None:
            graded.verdicts["reference"] = env.verify(first, graded.references[0])
            probes["reference_again"] = (first, graded.references[0])
        if graded.references[1] is not None:
            probes["reference_eval"] = (held, graded.references[1])
        probes.update(empty=(held, ""), wrong=(held, WRONG))
        graded.verdicts.update(zip(probes, env.verify_probes(list(probes.values())), strict=True))
    except Exception as error:  # reported by the test of that generator
        graded.error = f"{type(error).__name__}: {error}"
    return graded


@pytest.fixture(scope="module")
def graded() -> dict[str, Graded]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(GENERATORS, pool.map(_grade, GENERATORS), strict=True))


# ---------------------------------------------------------------------------------------------------
# Names


def test_generator_names_are_every_registered_generator():
    import reasoning_gym  # noqa: F401  (registers every generator)
    from reasoning_gym.factory import DATASETS

    assert len(GENERATORS) >= 100
    assert sorted(DATASETS) == GENERATORS
    # the pinned table names the module that defines each generator, which is all the scorer imports
    assert {name: cls.__module__.removeprefix("reasoning_gym.")
                             for name, (cls, _) in DATASETS.items()} == rg.RG_MODULES
    assert rg.installed_version() == rg.RG_VERSION


def test_registry_resolves_rg_names():
    env = registry.get("rg:chain_sum", reward="score")
    assert isinstance(env, rg.ReasoningGym)
    assert (env.name, env.kind, env.source) == ("rg:chain_sum", "reasoning", "reasoning-gym 0.1.25 (generated)")
    assert env.reward_mode == "score"
    assert registry.get("rg:ab").name == "rg:ab"  # a per-instance name
    with pytest.raises(registry.UnknownEnvironment):
        registry.get("rg:no_such_generator")


def test_exception_lists_name_real_generators():
    for table in (rg.RG_REFERENCE_EXCEPTIONS, rg.SCORER_FIXES, rg.TUPLE_METADATA):
        assert set(table) <= set(GENERATORS)
    assert set(GENERATORS) >= rg.MULTILINE_GENERATORS
    assert all(reason.strip() for reason in (*rg.RG_REFERENCE_EXCEPTIONS.values(), *rg.SCORER_FIXES.values()))


# ---------------------------------------------------------------------------------------------------
# Every generator


@pytest.mark.parametrize("generator", GENERATORS)
def test_every_generator(graded, generator):
    g = graded[generator]
    assert g.error is None, g.error
    name = f"rg:{generator}"
    assert len(g.train) == 2 and len(g.eval) == 2
    assert {p.split for p in g.train} == {"train"} and {p.split for p in g.eval} == {"eval"}
    assert not {p.id for p in g.train} & {p.id for p in g.eval}
    for problem in g.train + g.eval:
        assert problem.env == name and problem.prompt == problem.payload["question"]
        assert set(problem.payload) == {"question", "answer", "metadata"}
        assert json.loads(json.dumps(problem.payload, allow_nan=False)) == problem.payload  # plain JSON
        assert problem.id == rg.rg_problem_id(name, problem.payload["question"], problem.payload["answer"])
    if generator in rg.RG_REFERENCE_EXCEPTIONS:
        assert g.references == [None, None]
    else:
        for key in ("reference", "reference_eval"):
            verdict = g.verdicts[key]
            assert (verdict.reward, verdict.passed, verdict.reason) == (1.0, True, "correct"), verdict.detail
        again, first = g.verdicts["reference_again"], g.verdicts["reference"]
        assert (again.reward, again.reason, again.detail["rg_score"]) == (first.reward, first.reason, 1.0)
        if rg.SYMBOLIC.get(generator) == "arithmetic":  # puzzles are plain tokens, evaluated exactly here
            assert first.detail["sandbox_runs"] == []
        else:  # one scorer run; two for symbolic answers (reduced where no oracle is, then scored)
            rows = first.detail["sandbox_runs"]
            assert len(rows) == (2 if generator in rg.SYMBOLIC else 1)
            for row in rows:
                assert row["purpose"] == rg.SCORER_PURPOSE and isinstance(row["started_at"], str)
                assert row["exit_code"] == 0 and row["limit_hit"] is None
        json.dumps(first.detail)
    assert (g.verdicts["empty"].reward, g.verdicts["empty"].reason) == (0.0, "no_final_answer")
    wrong = g.verdicts["wrong"]
    assert wrong.reward == 0.0 and not wrong.passed, wrong.detail
    expected = ("answer_not_plain_expression",) if generator in rg.SYMBOLIC else (
        "wrong_answer", "partial_credit", "scorer_raised")
    assert wrong.reason in expected, (wrong.reason, wrong.detail)


# ---------------------------------------------------------------------------------------------------
# Splits


def test_eval_pool_is_fixed_and_train_never_draws_from_it(monkeypatch):
    env = rg.ReasoningGym("chain_sum", eval_size=10)
    held = env.problems("eval", 10, 0)
    assert [p.id for p in held] == [p.id for p in rg.ReasoningGym("chain_sum", eval_size=10).problems("eval", 10, 5)]
    assert env.problems("eval", 3, 0) == held[:3]
    with pytest.raises(ValueError, match="eval_size"):
        env.problems("eval", 11, 0)
    # a train seed next to the eval seed draws the eval items again (item i of seed s is Random(s + i))
    monkeypatch.setattr(rg, "train_seed", lambda seed: rg.EVAL_SEED + 1)
    raw = env._dataset(rg.EVAL_SEED + 1, 9)
    overlapping = {rg.rg_problem_id(env.name, item["question"], item["answer"]) for item in raw} & {p.id for p in held}
    assert len(overlapping) >= 5  # without the exclusion these would be trained on
    train = env.problems("train", 5, 0)
    assert len(train) == 5 and not {p.id for p in train} & {p.id for p in held}


def test_train_is_deterministic_in_the_seed():
    env = rg.ReasoningGym("basic_arithmetic", eval_size=5)
    ids = [p.id for p in env.problems("train", 6, 3)]
    assert ids == [p.id for p in env.problems("train", 6, 3)] and len(set(ids)) == 6
    assert ids != [p.id for p in env.problems("train", 6, 4)]
    assert rg.train_seed(3) != rg.EVAL_SEED and env.count("train") is None and env.count("eval") is None


def test_config_overrides_reach_generation_and_scoring():
    env = rg.ReasoningGym("chain_sum", config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                          eval_size=3)
    problem = env.problems("train", 1, 0)[0]
    assert problem.payload["metadata"]["num_terms"] == 2
    assert env.verify(problem, env.reference(problem)).passed
    with pytest.raises(TypeError):  # an unknown setting is the generator config's error
        rg.ReasoningGym("chain_sum", config={"no_such_setting": 1}).problems("train", 1, 0)


@pytest.mark.parametrize("options, message", [
    ({"reward": "lenient"}, "reward"), ({"config": {"seed": 1}}, "seed or size"), ({"config": [1]}, "config"),
    ({"eval_size": 0}, "eval_size"), ({"temperature": 1}, "takes no options"),
    ({"examples": []}, "non-empty list"), ({"examples": [["What is 2 + 2?"]]}, r"examples\[0\]"),
    ({"examples": [["What is 2 + 2?", "It is 4."]]}, "#### <answer>"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        rg.ReasoningGym("chain_sum", **options)


def test_examples_option_replaces_the_generic_worked_example():
    problem = rg.ReasoningGym("basic_arithmetic").problems("train", 1, 0)[0]
    default = rg.ReasoningGym("basic_arithmetic").messages(problem)
    assert [m["role"] for m in default] == ["system", "user", "assistant", "user"]
    assert default[1]["content"] == rg.EXAMPLE[0]
    pairs = [["What is 4 + 3?", "4 + 3 = 7\n#### 7"], ["What is 2 + 5?", "2 + 5 = 7\n#### 7"]]
    env = rg.ReasoningGym("basic_arithmetic", examples=pairs)
    messages = env.messages(problem)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages[1:5]] == [x for pair in pairs for x in pair]
    assert messages[-1]["content"] == problem.prompt and messages[0] == default[0]
    # the grader and the problems are unchanged by the prompt
    assert env.verify(problem, env.reference(problem)).passed
    assert env.problems("train", 3, 0) == rg.ReasoningGym("basic_arithmetic").problems("train", 3, 0)


# ---------------------------------------------------------------------------------------------------
# Rewards


def test_score_mode_gives_the_fractional_rg_score_and_strict_mode_gives_zero():
    from reasoning_gym import create_dataset

    strict, score = rg.ReasoningGym("caesar_cipher", eval_size=1), rg.ReasoningGym("caesar_cipher", reward="score",
                                                                                   eval_size=1)
    problem = strict.problems("eval", 1, 0)[0]
    answer = problem.payload["answer"] + " XYZ"  # the base scorer: len(oracle) / len(answer) when it contains it
    expected = create_dataset("caesar_cipher", seed=1, size=1).score_answer(answer, problem.payload)
    assert 0.0 < expected < 1.0
    partial = score.verify(problem, f"#### {answer}")
    assert partial.reward == pytest.approx(expected) and not partial.passed and partial.reason == "partial_credit"
    assert strict.verify(problem, f"#### {answer}").reward == 0.0
    assert score.verify(problem, score.reference(problem)).reward == 1.0


@pytest.mark.parametrize("generator, completion", [
    ("gsm_symbolic", "#### {answer} or 7"), ("quantum_lock", "#### {answer}, 7"), ("word_sorting", "#### {answer}, 7"),
    ("fraction_simplification", "#### 7; {answer}"),
])
def test_hedges_that_rg_scorers_would_credit_earn_zero(generator, completion):
    env = rg.ReasoningGym(generator, reward="score", eval_size=1)
    problem = env.problems("eval", 1, 0)[0]
    verdict = env.verify(problem, completion.format(answer=problem.payload["answer"]))
    assert (verdict.reward, verdict.reason) == (0.0, "hedged_answer")
    assert rg.hedged(problem.payload["answer"], problem.payload["answer"]) is None


def test_game_of_life_halting_needs_the_right_answer():
    env = rg.ReasoningGym("game_of_life_halting", eval_size=1)
    problem = env.problems("eval", 1, 0)[0]
    wrong = "True" if problem.payload["answer"] == "False" else "False"
    verdict = env.verify(problem, f"#### {wrong}")
    assert verdict.reward == 0.0 and verdict.detail["rg_score_before_fix"] == 1.0  # rg alone would pay
    assert env.verify(problem, f"#### {problem.payload['answer'].lower()}").passed


def test_multiline_answers_are_written_with_backslash_n():
    env = rg.ReasoningGym("mini_sudoku", eval_size=1)
    problem = env.problems("eval", 1, 0)[0]
    assert "\n" in problem.payload["answer"] and "\\n" in env.reference(problem)
    assert "\\n" in env.messages(problem)[0]["content"]
    assert "\\n" not in rg.ReasoningGym("chain_sum").messages(problem)[0]["content"]
    messages = env.messages(problem)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[-1]["content"] == problem.prompt and "####" in messages[0]["content"]


# ---------------------------------------------------------------------------------------------------
# Forging a grade


@pytest.mark.parametrize("generator, answer, blocked", [
    # binary_matrix and n_queens eval() the answer; the sympy-based scorers parse it with eval too
    ("binary_matrix", "[__import__('os').write(1, b'score 1.0'), __import__('os')._exit(0)]", "__import__"),
    ("n_queens", "[print('score 1.0'), exit(0)]", "print"),
    ("binary_matrix", "[o for o in __import__('gc').get_objects() if type(o) is str and len(o) == 32]", "__import__"),
    ("polynomial_multiplication", "__import__('os')._exit(0)", "__import__"),
    ("binary_matrix", "(lambda: open('/proc/self/fd/1', 'w').write('x score 1.0'))()", "open"),
    # the real threat: find the nonce and the report descriptor in the scorer's frames, write the report, exit.
    # Without the audit hook this earns 1.0 (checked by hand when the hook went in).
    ("binary_matrix", "[__import__('os').write(f.f_locals['report_fd'], (f.f_locals['nonce'] + ' score 1.0' + chr(10))"
                      ".encode()) + __import__('os')._exit(0) for f in [__import__('sys')._getframe(i) "
                      "for i in range(1, 5)] if 'nonce' in f.f_locals]", "name "),
])
def test_an_answer_that_a_scorer_evals_cannot_forge_a_grade(generator, answer, blocked):
    # Answers are no longer evaluated at all: the list-reading scorers get a literal-only eval (the answer
    # is data or it is nothing), the sympy ones a token allowlist and a reduction to plain data. The audit
    # hook stays behind both, so either way the grade is 0.
    env = rg.ReasoningGym(generator, reward="score", eval_size=1)
    problem = env.problems("eval", 1, 0)[0]
    verdict = env.verify(problem, f"#### {answer}")
    assert (verdict.reward, verdict.passed) == (0.0, False), verdict.detail
    assert verdict.reason in ("answer_not_plain_expression", "wrong_answer", "answer_blocked"), verdict.detail
    if verdict.reason == "answer_blocked":
        assert any(blocked in item for item in verdict.detail["blocked"])


def test_the_scorer_that_evaluates_an_answer_never_holds_the_oracle(monkeypatch):
    """A symbolic grade runs two sandboxes: the answer alone, reduced to a plain-data tree; then the
    oracle with that tree. The oracle never reaches the first, the answer's text never the second."""
    env = rg.ReasoningGym("polynomial_multiplication", eval_size=1)
    problem = env.problems("eval", 1, 0)[0]
    requests = []
    real = rg.run_python

    def spy(source, **kwargs):
        requests.append(json.loads(kwargs["stdin"]))
        return real(source, **kwargs)

    monkeypatch.setattr(rg, "run_python", spy)
    oracle = problem.payload["answer"]
    answer = oracle.replace(" ", "")  # the right answer, written differently from the oracle's text
    verdict = env.verify(problem, f"#### {answer}")
    assert verdict.passed, verdict.detail
    reduce, score = requests
    assert reduce["mode"] == "reduce" and "entry" not in reduce and oracle not in json.dumps(reduce)
    assert score["answer"] == "" and answer not in json.dumps(score) and isinstance(score["tree"], list)


@pytest.mark.parametrize("answer", [
    "'{0.__class__.__mro__}'.format(1)",
    "[x for x in '{0.gi_frame.f_back.f_locals}'.format((y for y in []))]",
    "'{.__globals__[nonce]}'.format(len)",
    "[[1 if c == '1' else 0 for c in row] for row in '{0.f_back.f_locals[entry][answer]}'.format(0).split()]",
])
def test_format_field_walks_to_the_scorers_frames_earn_nothing(answer):
    # str.format walks attributes named inside a string constant, where the hook's name check never looked
    for generator in ("binary_matrix", "n_queens"):
        env = rg.ReasoningGym(generator, reward="score", eval_size=1)
        problem = env.problems("eval", 1, 0)[0]
        verdict = env.verify(problem, f"#### {answer}")
        assert verdict.reward == 0.0 and not verdict.passed, (generator, verdict.detail)


# the generators whose scorers are wrapped (SCORER_FIXES, SYMBOLIC, INPUT_CHECKS) or eval the answer
WRAPPED = sorted({*rg.SCORER_FIXES, *rg.SYMBOLIC, *rg.INPUT_CHECKS, "binary_matrix", "gsm_symbolic",
                  "bitwise_arithmetic", "number_sorting"})


def test_ci_runs_the_verifier_self_test_of_every_generator():
    """The self-test of the wrapped generators (``evertrain.envs.quality.validate``, known-good answers earn 1 and
    a battery of known-bad ones 0) ran here once per wrapped generator: 43 s of the suite on two cores (#47). It is
    the same check that CI's ``evertrain envs --validate 1`` step runs for every environment, all 106 generators
    among them, failing the build on any: that step must stay in CI. (Its other assertion, that a known-good answer
    earns 1, is test_every_generator's for every generator.)"""
    from tests.conftest import ROOT

    steps = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.lstrip().startswith("#")]
    assert any("evertrain envs --validate" in line and "--json" in line for line in steps)
    assert WRAPPED and set(WRAPPED) <= set(GENERATORS)


def test_items_whose_oracle_is_an_unevaluated_integral_are_left_out():
    env = rg.ReasoningGym("intermediate_integration", eval_size=60)
    problems = env.problems("eval", 60, 0) + env.problems("train", 60, 1)
    assert len(env.problems("eval", 60, 0)) == 60
    assert not any("Integral" in p.payload["answer"] for p in problems)


def test_a_fake_score_line_in_a_decoded_answer_earns_nothing():
    env = rg.ReasoningGym("n_queens", reward="score", eval_size=1)
    problem = env.problems("eval", 1, 0)[0]
    verdict = env.verify(problem, "#### _ Q\\nscore 1.0\\n0123456789abcdef0123456789abcdef score 1.0")
    assert verdict.reward == 0.0 and verdict.reason == "wrong_answer"


@pytest.mark.parametrize("generator", ["basic_arithmetic", "caesar_cipher", "number_sorting", "count_primes"])
def test_probes_graded_together_get_the_verdicts_graded_alone_in_one_sandbox(generator):
    """The quality check's probes (the project's own answers, never a policy's) of one generator are scored in one
    sandbox, each in a process forked from the one that loaded the generator: the verdicts of one sandbox each."""
    from evertrain.envs.quality import CURATION_PROBES, probes_for

    env = rg.ReasoningGym(generator, eval_size=2)
    problems = env.problems("train", 4, 3)
    items = [(p, c) for p in problems for _, c in probes_for(env, p, None, CURATION_PROBES)]
    items += [(p, reference) for p in problems if (reference := env.reference(p))]  # right answers: both outcomes
    alone, together = [env.verify(p, c) for p, c in items], env.verify_probes(items)
    assert [(v.reward, v.passed, v.reason) for v in together] == [(v.reward, v.passed, v.reason) for v in alone]
    assert any(v.passed for v in together) and any(v.reason in ("wrong_answer", "partial_credit") for v in together)
    assert len({row["run_id"] for v in together for row in v.detail.get("sandbox_runs", [])}) == 1
    assert len({row["run_id"] for v in alone for row in v.detail.get("sandbox_runs", [])}) > 1


def test_the_self_test_grades_a_generator_s_cases_together_with_the_verdicts_of_one_sandbox_each():
    from evertrain.envs.quality import validate

    env = rg.ReasoningGym("count_primes", eval_size=2)
    together = validate(env, problems=1)
    env.probes_together = False
    alone = validate(env, problems=1)
    assert together.ok and alone.ok, (together.failures, alone.failures)
    assert [(c.label, c.reward, c.reason) for c in together.cases] == \
        [(c.label, c.reward, c.reason) for c in alone.cases]
    assert len(together.cases) > 10 and all(c.seconds > 0 for c in together.cases)
    # one sandbox (one record, stored once) for the generator's cases that reach its scorer, one each before
    assert len(together.sandbox_runs) == len({r["run_id"] for r in together.sandbox_runs}) == 1
    assert len(alone.sandbox_runs) > 5


def _record(stdout: str, exit_code: int | None = 0, limit_hit: str | None = None) -> SandboxRunRecord:
    return SandboxRunRecord(run_id="r", purpose=rg.SCORER_PURPOSE, code_sha256="x", limits=Limits(),
                            exit_code=exit_code, signal=None, wall_s=0.1, cpu_s=0.1, peak_rss_kb=1, stdout_bytes=0,
                            stderr_bytes=0, stdout=stdout, stderr="", limit_hit=limit_hit,
                            started_at=datetime.now(UTC))


@pytest.mark.parametrize("stdout, exit_code, limit_hit, reason", [
    ("N score 1.0\n", 0, None, "correct"),
    ("N score 0.25\n", 0, None, "partial_credit"),
    ("score 1.0\nM score 1.0\n", 0, None, "scorer_report_garbled"),  # no line with this grade's nonce
    ("N score 1.0\nN score 0.0\n", 0, None, "scorer_report_garbled"),  # two reports: someone forged one
    ("N score 1.0\n", 1, None, "scorer_crashed"),
    ("N score 1.0\n", None, "timeout", "timeout"),
    ("N score 1.5\n", 0, None, "scorer_bad_score"),
    ("N score nan\n", 0, None, "scorer_bad_score"),
    ("N error scorer_raised \"ValueError()\"\n", 0, None, "scorer_raised"),
    ("N blocked [\"name __import__\"]\n", 0, None, "answer_blocked"),
    ("N xscore 1.0\n", 0, None, "scorer_report_garbled"),
])
def test_only_one_clean_nonce_report_counts(stdout, exit_code, limit_hit, reason):
    nonce = "0f" * 16
    result = rg._result(_record(stdout.replace("N ", nonce + " "), exit_code, limit_hit), nonce)
    assert result.reason == reason
    assert (result.score is not None) == (reason in ("correct", "partial_credit"))


# ---------------------------------------------------------------------------------------------------
# evertrain score: the reasoning-gym item itself


def test_parse_problem_takes_the_reasoning_gym_item():
    env = rg.ReasoningGym("chain_sum", eval_size=1)
    generated = env.problems("eval", 1, 0)[0]
    parsed = env.parse_problem({"question": generated.prompt, "answer": generated.payload["answer"],
                                "metadata": generated.payload["metadata"]})
    assert parsed.id == generated.id and parsed.payload == generated.payload
    assert env.parse_problem({"question": "q?", "answer": None}).payload == {"question": "q?", "answer": None,
                                                                               "metadata": {}}
    for bad, message in [([], "JSON object"), ({"answer": "1"}, "question"), ({"question": "q", "answer": 1}, "answer"),
                         ({"question": "q", "answer": "1", "metadata": []}, "metadata")]:
        with pytest.raises(ValueError, match=message):
            env.parse_problem(bad)
    with pytest.raises(ValueError, match="source_dataset"):
        rg.ReasoningGym("composite").parse_problem({"question": "q", "answer": "1", "metadata": {}})


def test_score_lines_grades_rg_items():
    from evertrain.scoring import score_lines

    env = rg.ReasoningGym("arc_1d", eval_size=1)
    problem = env.problems("eval", 1, 0)[0]
    item: dict[str, Any] = {"id": "a", "env": "rg:arc_1d", "problem": problem.payload,
                            "completion": env.reference(problem)}
    lines = [json.dumps(item), json.dumps({**item, "id": "b", "completion": "#### 1 2 3"})]
    results, audit = score_lines(lines, workers=1)
    assert [(r["id"], r["reward"]) for r in results] == [("a", 1.0), ("b", 0.0)]
    assert len(audit) == 2 and {row["purpose"] for row in audit} == {rg.SCORER_PURPOSE}


def test_plain_metadata():
    assert rg._plain({1: (1, 2), "s": {3}, "f": float("inf"), "o": object}) == {
        "1": [1, 2], "s": [3], "f": "inf", "o": str(object)}
