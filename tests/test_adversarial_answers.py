"""Answer-side attacks on the graders (issue 23): each wrong answer here must earn exactly 0.

Classes: non-finite values by another spelling, a number bound that reads only part of the number,
scorer tolerances looser than the question's precision, premises restated or contradictory
(propositional logic), and text parsing whose time grows faster than its input. Each test was checked
to fail on the code before its fix.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from evertrain.envs.answers import canonical_number, grade_math, number_hazard, parse_number

# ---------------------------------------------------------------------------------------------------
# 1. Non-finite values by another spelling; 4. bounds that read only part of a number

NON_FINITE_SPELLINGS = ["NaN", "-inF", "Infinity", "+INFINITY", "ｎａｎ", "\u2212inf", "sNaN", "n a n", "na n+0i",
                        "n_a_n"]
OUT_OF_BOUNDS_SPELLINGS = ["1e999", "1E+0000999", "1e9_99", "-1e9_99", "１e９９９", "1" + "0" * 150 + "e200",
                           "9_" * 200 + "9", "1e-400", "10**999", "10^999", "10\u2079\u2079\u2079", "0x1p9999",
                           "1e000000009999999999", "1e9_99+2i", "[1, 2, 1e9_99]"]


@pytest.mark.parametrize("answer", NON_FINITE_SPELLINGS)
def test_every_spelling_of_a_non_finite_value_is_refused_before_the_scorer(answer):
    from evertrain.envs.reasoning_gym import precheck

    entry = {"question": "q", "answer": "-15.0 + 3.0i", "metadata": {}}
    assert precheck("complex_arithmetic", answer, entry) == "non_finite_answer"


@pytest.mark.parametrize("answer", OUT_OF_BOUNDS_SPELLINGS)
def test_every_spelling_of_a_huge_exponent_is_refused_before_the_scorer(answer):
    from evertrain.envs.reasoning_gym import precheck

    entry = {"question": "q", "answer": "7.023159", "metadata": {}}
    assert precheck("decimal_arithmetic", answer, entry) == "over_long_number"


def test_canonical_number_reads_one_value_whatever_the_spelling():
    assert canonical_number("１２３")[0] == 123 and canonical_number("\u22125")[0] == -5
    assert canonical_number("1_000")[0] == 1000 and canonical_number("$1,234.50")[0] == parse_number("1234.5")
    assert canonical_number("١٢")[0] == 12  # Arabic-Indic digits, which float() also reads
    assert [canonical_number(x)[1] for x in ("NaN", "-inF", "ｉｎｆ", "Infinity")] == ["non_finite"] * 4
    assert [canonical_number(x)[1] for x in ("1e9_99", "1E+0000999", "1e-400", "9" * 201)] == ["out_of_bounds"] * 4
    assert canonical_number("1e300")[0] == 10**300 and canonical_number("hello")[1] == "not_a_number"
    assert number_hazard("[1, 2, 3]") is None and number_hazard("(4.051, -5.487)") is None
    assert number_hazard("bean antics") is None and number_hazard("x**3 + 2*x") is None


def test_a_partial_credit_formula_gives_nothing_for_nan_spelled_with_spaces():
    """rg:complex_arithmetic scores min(1, exp(-distance)): nan makes that 1.0, and its parser removes
    spaces, so 'n a n' (which the old precheck's word match missed) earned full reward."""
    from evertrain.envs.reasoning_gym import ReasoningGym

    env = ReasoningGym("complex_arithmetic")
    problem = env.problems("eval", 1, 0)[0]
    for answer in ("n a n", "na n+0i"):
        verdict = env.verify(problem, f"#### {answer}")
        assert (verdict.reward, verdict.reason) == (0.0, "non_finite_answer"), (answer, verdict)
    assert env.verify(problem, env.reference(problem)).reward == 1.0


def test_the_exponent_bound_reads_the_whole_exponent_and_builds_nothing_big():
    """The old bound read the first 8 characters of the exponent: '1e0000000099999999999' passed as
    1e0 and Fraction(Decimal(...)) built a ten-billion-digit integer in the grading process. Run in a
    child with a memory cap so the old code fails instead of taking the machine down; the honest item
    graded after it in the same process keeps its reward."""
    script = textwrap.dedent("""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from evertrain.envs.answers import grade_math, parse_number
        for text in ("1e0000000099999999999", "1E+00000000000999999999", "-1e-0000000099999999999"):
            assert parse_number(text) is None, text
            assert grade_math("#### " + text, "7").reward == 0.0
        assert grade_math("#### 7", "7").reward == 1.0
        print("bounded")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "bounded", done.stderr[-2000:]


def test_the_math_rule_refuses_non_finite_and_huge_spellings_and_keeps_unicode_digits():
    for answer in ("1e9_99", "NaN", "-inF", "1E+0000999", "１e９９９"):
        assert grade_math(f"#### {answer}", "7").reward == 0.0
    assert grade_math("#### ７", "7").reward == 1.0
    assert grade_math("#### \u22127", "-7").reward == 1.0


# ---------------------------------------------------------------------------------------------------
# 2. Scorer tolerances looser than the question's stated precision


def _moved_last_number(oracle: str, step: str, descending: bool) -> str:
    """The oracle with its last number moved by ``step`` (outward, so a sorted list stays sorted).
    Written here, apart from the module's own helper, so the test does not trust the code it checks."""
    import re
    from decimal import Decimal

    last = list(re.finditer(r"-?[0-9]+(?:\.[0-9]+)?", oracle))[-1]
    moved = Decimal(last.group(0)) + (-Decimal(step) if descending else Decimal(step))
    return oracle[:last.start()] + format(moved, "f") + oracle[last.end():]


# (generator, how far the answer is moved: 0.6 of a unit of the precision the question states or,
# where it states none, of the oracle's last written digit); each was full credit from rg's scorer
LOOSE = [("decimal_arithmetic", "sig12"), ("number_format", "last"), ("number_sorting", "last"),
         ("pool_matrix", "0.006")]


@pytest.mark.parametrize(("generator", "step"), LOOSE)
def test_a_number_just_outside_the_stated_precision_earns_nothing(generator, step):
    from decimal import Decimal

    from evertrain.envs.reasoning_gym import ReasoningGym, encode_answer

    env = ReasoningGym(generator)
    problems = env.problems("eval", 3, 0)
    refused_by_the_fix = 0
    for problem in problems:
        oracle = problem.payload["answer"]
        last = oracle.replace("'", " ").replace("]", " ").split()[-1]
        if step == "sig12":
            delta = str(Decimal("0.6") * Decimal(10) ** (Decimal(last).adjusted() - 11))
        elif step == "last":
            delta = str(Decimal("0.6") * Decimal(10) ** Decimal(last).as_tuple().exponent)
        else:
            delta = step
        descending = problem.payload["metadata"].get("direction") == "descending"
        bad = _moved_last_number(oracle, delta, descending)
        verdict = env.verify(problem, "#### " + encode_answer(generator, bad))
        assert verdict.reward == 0.0, (oracle, bad, verdict)
        if verdict.reason == "outside_stated_precision":
            assert verdict.detail["rg_score_before_fix"] == 1.0
            refused_by_the_fix += 1
        assert env.verify(problem, env.reference(problem)).reward == 1.0
    # rg's scorer credited these (where its own tolerance was tight enough, e.g. a 0 cell, it did not)
    assert refused_by_the_fix >= 2


def test_an_answer_rounded_coarser_than_the_question_asks_earns_nothing():
    """decimal_arithmetic asks for 12 significant digits; its scorer accepted anything within 0.001."""
    from evertrain.envs.reasoning_gym import within_stated_precision

    entry = {"question": "Please solve this problem to a maximum of 12 significant digits, rounding up from the "
                         "half. Only reply with the final value.\n4.180+(7.365/3.440) = ?",
             "answer": "6.32098837209", "metadata": {}}
    assert within_stated_precision("decimal_arithmetic", "6.32098837209", entry)
    assert within_stated_precision("decimal_arithmetic", "6.320988372093", entry)  # more digits, still right
    assert not within_stated_precision("decimal_arithmetic", "6.321", entry)
    assert not within_stated_precision("decimal_arithmetic", "6.32098837210", entry)  # one unit off


# ---------------------------------------------------------------------------------------------------
# 3. Restating the premises (propositional logic)


def _transformed(premises: list[str]) -> list[str]:
    found = []
    for premise in premises:
        found += [f"¬¬{premise}", f"(({premise}))", f"({premise} ∧ {premise})", f"¬(¬{premise})"]
    found.append(" ∧ ".join(f"({p})" for p in reversed(premises)))  # the conjunction, reordered
    return found


def test_a_premise_trivially_transformed_earns_nothing():
    from evertrain.envs.reasoning_gym import ReasoningGym

    env = ReasoningGym("propositional_logic")
    credited = 0
    for problem in env.problems("eval", 4, 0):
        premises = problem.payload["metadata"]["premises"]
        for answer in _transformed(premises):
            verdict = env.verify(problem, f"#### {answer}")
            assert verdict.reward == 0.0, (premises, answer, verdict)
            credited += verdict.detail.get("rg_score_before_fix") == 1.0
        assert env.verify(problem, env.reference(problem)).reward == 1.0
    assert credited > 0  # rg's own scorer gave these full credit: the check is what refuses them


def test_premises_that_contradict_each_other_are_refused():
    """From P and ¬P everything follows: rg credited the contradiction (Q ∧ ¬Q) as a conclusion."""
    from evertrain.envs.reasoning_gym import ReasoningGym, premises_consistent

    env = ReasoningGym("propositional_logic")
    item = {"question": "Given:\n1. P\n.2. ¬P\n.What can we conclude from the above statements?", "answer": None,
            "metadata": {"premises": ["P", "¬P"], "variables": ["P", "Q"], "example_answer": "(Q ∧ ¬Q)"}}
    problem = env.parse_problem(item)
    for answer in ("(Q ∧ ¬Q)", "(Q → P)", "(P ∧ Q)"):
        verdict = env.verify(problem, f"#### {answer}")
        assert (verdict.reward, verdict.reason) == (0.0, "restates_premises"), verdict
    pool = env.problems("eval", 100, 0) + env.problems("train", 50, 1)
    assert all(premises_consistent(p.payload) for p in pool)


# ---------------------------------------------------------------------------------------------------
# 5. Text parsing in the grading process: linear in its input

# Each took minutes at 200k characters before (measured: 12 s for the code fences at 60k characters,
# 9 s for the tool tag at 20k, growing with the square of the length).
STALLING = {  # Python expressions, built in the child process that parses them
    "code_fences": "'```' * 66_000",
    "code_open_fence": "'```' + ' ' * 199_000 + 'x'",
    "tool_tag": "'<' + ' ' * 199_000 + 'x'",
    "tool_closing_tags": "'< / ' * 49_000",
    "tool_fence": "'<python>\\n```\\n' + ' ' * 199_000 + 'x\\n</python>\\n#### 1'",
    "number_blanks": "'#### 1' + ' ' * 199_000 + 'e'",
}


def test_adversarial_inputs_parse_in_linear_time_and_honest_items_keep_their_reward():
    """Every 200k-character input goes through the real grading path (verify_many, two workers) in a
    child process with a generous bound; the honest items graded in the same batch earn 1. On the old
    code the child ran past the bound (the quadratic regexes hold the GIL, stalling every worker)."""
    script = textwrap.dedent(f"""
        import json
        from evertrain.envs import registry
        from evertrain.envs.code import extract_code
        from evertrain.envs.answers import number_hazard
        from evertrain.envs.tools import parse_tool_call
        from evertrain.scoring import verify_many

        stalling = {{name: eval(expression) for name, expression in {STALLING!r}.items()}}
        assert all(len(text) > 195_000 for text in stalling.values())
        for text in stalling.values():  # each parser directly
            extract_code(text), parse_tool_call(text, ["python", "sql"]), number_hazard(text)
        calculator = registry.get("calculator")
        mbpp = registry.get("mbpp")
        honest = [(env, p, env.known_good(p)[0]) for env in (calculator, mbpp) for p in env.problems("eval", 2, 0)]
        problem = calculator.problems("eval", 1, 0)[0]
        code_problem = mbpp.problems("eval", 1, 0)[0]
        attacks = [(calculator, problem, text) for text in stalling.values()]
        attacks += [(mbpp, code_problem, text) for text in stalling.values()]
        verdicts = verify_many(attacks + honest, workers=2)
        print(json.dumps([[v.reward for v in verdicts[:len(attacks)]], [v.reward for v in verdicts[len(attacks):]]]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    attacks, honest = json.loads(done.stdout.strip().splitlines()[-1])
    assert attacks == [0.0] * (2 * len(STALLING)) and honest == [1.0] * 4


# ---------------------------------------------------------------------------------------------------
# The reasoning-gym scorer program, now a module (evertrain/sandbox/rg_scorer.py): its guards, in-process


def test_the_scorer_programs_hook_names_every_escape_in_evaluated_code():
    from evertrain.sandbox import rg_scorer

    def names(source: str) -> set[str]:
        return set(rg_scorer._names(compile(source, "<answer>", "eval"), set()))

    assert "__class__" in names("().__class__.__base__")
    assert "_format_field" in names("'{0.gi_frame}'.format")  # a brace in a string constant
    assert "open" in names("[open(x) for x in 'ab']")  # inside a nested code object
    assert {"open", "getattr", "print", "format"} <= rg_scorer._BLOCKED_NAMES


def test_the_scorer_program_rebuilds_only_allowlisted_plain_data():
    from evertrain.sandbox import rg_scorer

    assert rg_scorer._rebuild(["Add", ["Symbol", "x"], ["Integer", "1"]], ["x"]) == "x + 1"
    for tree in (["Integral", ["Symbol", "x"], ["Symbol", "x"]], ["Symbol", "y"], ["Integer", 7], "x + 1"):
        with pytest.raises(ValueError):
            rg_scorer._rebuild(tree, ["x"])
    entry = {"metadata": {"input": [[1, 2], [3, 4]]}}
    rg_scorer._revive(entry, ["input"])
    assert entry["metadata"]["input"] == ((1, 2), (3, 4))


def test_the_scorer_program_is_the_module_the_environment_runs():
    from pathlib import Path

    from evertrain.envs import reasoning_gym
    from evertrain.sandbox import rg_scorer

    assert Path(rg_scorer.__file__).read_text() == reasoning_gym.SCORER_SOURCE
    assert "SCORER_SOURCE = r'''" not in Path(reasoning_gym.__file__).read_text()


# ---------------------------------------------------------------------------------------------------
# The verifier self-test holds a known-bad case of each class


def test_the_self_test_battery_holds_a_case_of_each_class():
    from evertrain.envs import registry
    from evertrain.envs.quality import bad_battery
    from evertrain.envs.reasoning_gym import ReasoningGym

    env = registry.get("arithmetic")
    problem = env.problems("eval", 1, 0)[0]
    cases = bad_battery(env, problem, None)
    completions = {label: [c for lab, c in cases if lab == label] for label, _ in cases}
    assert "#### n a n" in completions["non_finite"] and "#### 1e9_99" in completions["over_long_number"]
    assert any(len(c) > 100_000 for c in completions["stalling"])
    code = registry.get("mbpp")
    assert "stalling" in {label for label, _ in code.known_bad(code.problems("eval", 1, 0)[0], None)}
    for generator, label in (("decimal_arithmetic", "tolerance"), ("pool_matrix", "tolerance"),
                             ("propositional_logic", "restated")):
        rg = ReasoningGym(generator)
        item = rg.problems("eval", 1, 0)[0]
        found = [c for lab, c in rg.known_bad(item, None) if lab == label]
        assert found, (generator, label)
    logic = ReasoningGym("propositional_logic")
    item = logic.problems("eval", 1, 0)[0]
    assert any("¬¬" in c for lab, c in logic.known_bad(item, None) if lab == "restated")
