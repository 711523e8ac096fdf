"""Curation keeps duplicates, contaminated and uninformative problems out of training, and counts them."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from evertrain.data.store import now
from evertrain.envs import registry
from evertrain.envs.quality import NgramIndex, validate
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from evertrain.tasks.base import allocate
from evertrain.tasks.evaluate import eval_problems, pass_at_k
from tests.conftest import smoke_config_in

HELD = "A farmer has 12 cows and buys 7 more at the market on Sunday. How many cows does the farmer have now?"


def test_ngram_index_finds_overlap_and_near_duplicates():
    index = NgramIndex(n=8)
    index.add(HELD)
    assert index.overlaps("Story: a farmer has 12 cows and buys 7 more at the market on Sunday. Then?")
    assert not index.overlaps("A baker bakes 40 loaves and sells 12 of them. How many loaves are left?")
    near = NgramIndex(n=3)
    near.add(HELD)
    assert near.max_jaccard(HELD.replace("Sunday", "Monday")) > 0.7
    assert near.max_jaccard("Completely different words in this sentence about the sea and ships") == 0.0


def _code_problems(tmp_path):
    rows = [
        {"prompt": HELD + " Write cows().", "tests": ["assert cows() == 19"], "split": "eval"},
        # the same problem with a different function name: contaminates the held-out set
        {"prompt": HELD + " Write count_cows().", "tests": ["assert count_cows() == 19"], "split": "train"},
    ] + [{"prompt": f"Write f{i}() returning {i} for task number {i} of the plain list.",
          "tests": [f"assert f{i}() == {i}"], "split": "train"} for i in range(12)]
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_curate_drops_contaminated_problems(tmp_path, models_dir):
    path = _code_problems(tmp_path)
    config = smoke_config_in(tmp_path, models_dir, name="decontam", problems_per_iteration=13,
                             environments=[{"name": "code", "weight": 1, "options": {"path": str(path)}}],
                             eval={"problems_per_env": 1}, curation={"oversample": 1})
    with Runtime.open(config) as rt:
        metrics = run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
        prompts = rt.store.query("SELECT prompt FROM problems")["prompt"]
    assert metrics["dropped_contaminated"] == 1
    assert not prompts.str.contains("farmer").any() and len(prompts) == 12


def test_weight_zero_environment_is_evaluated_but_never_trained_on(tmp_path, models_dir):
    assert allocate(16, [7, 0]) == [16, 0] and allocate(5, [1, 0, 1]) in ([3, 0, 2], [2, 0, 3])
    config = smoke_config_in(
        tmp_path, models_dir, name="guard", problems_per_iteration=5,
        environments=[{"name": "arithmetic", "weight": 1}, {"name": "digits", "weight": 0}],
        eval={"problems_per_env": 4})
    rt = Runtime.open(config)
    metrics = run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
    assert metrics["problems_digits"] == 0 and metrics["problems"] == 5
    assert set(rt.store.query("SELECT env FROM problems")["env"]) == {"arithmetic"}
    assert {p.env for p in eval_problems(rt)} == {"arithmetic", "digits"}


def test_difficulty_history_skips_mastered_and_hopeless_problems(tmp_path, models_dir):
    config = smoke_config_in(
        tmp_path, models_dir, name="difficulty", problems_per_iteration=4,
        environments=[{"name": "arithmetic", "weight": 1, "options": {"low": 2, "high": 5, "eval_pool": 8}}],
        eval={"problems_per_env": 8}, curation={"oversample": 2, "history_k": 4})
    rt = Runtime.open(config)
    train = registry.get("arithmetic", low=2, high=5, eval_pool=8).problems("train", 8, 0)
    easy, hard = train[0].id, train[1].id
    history = pd.DataFrame([
        {"campaign": "difficulty", "iteration": 0, "problem_id": pid, "sample": s, "env": "arithmetic",
         "policy_version": 1, "completion": "", "reward": float(ok), "passed": ok, "generated_at": now()}
        for pid, ok in ((easy, True), (hard, False)) for s in range(4)])
    rt.store.replace("rollouts", {"campaign": "difficulty", "iteration": 0}, history)
    first = run_stage(rt, "curate", 1, STAGE_FUNCTIONS["curate"])
    assert (first["dropped_too_easy"], first["dropped_too_hard"]) == (1, 1)
    chosen = set(rt.store.query("SELECT problem_id FROM problems WHERE iteration = 1")["problem_id"])
    assert easy not in chosen and hard not in chosen and len(chosen) == 4
    # the history lives in the store: a new process (here: a fresh runtime) makes the same decisions
    rt.close()
    with Runtime.open(config) as rt:
        again = run_stage(rt, "curate", 1, STAGE_FUNCTIONS["curate"])
    assert (again["dropped_too_easy"], again["dropped_too_hard"]) == (1, 1)


@pytest.mark.parametrize("name", ["arithmetic", "gsm8k", "digits", "mbpp", "sql", "gsm8k-tools"])
def test_environment_validation(name):
    report = validate(registry.get(name))
    assert report.ok, report.failures


def test_validation_catches_a_grader_that_trusts_hacks():
    env = registry.get("arithmetic")

    class Gullible(type(env)):
        def verify(self, problem, completion):
            verdict = super().verify(problem, completion.split(" or ")[0])
            return verdict

    report = validate(Gullible())
    assert not report.ok and any("or" in failure for failure in report.failures)


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_campaign_refuses_an_environment_that_fails_validation(tmp_path, models_dir):
    from evertrain.runtime import EnvironmentInvalid

    path = tmp_path / "broken.jsonl"  # the reference solution fails its own tests: a broken grader or data set
    rows = [{"prompt": f"Write f{i}().", "tests": [f"assert f{i}() == {i}"],
             "reference": f"def f{i}():\n    return -1", "split": split}
            for i, split in enumerate(["train", "eval"] * 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = smoke_config_in(tmp_path, models_dir, name="broken", eval={"problems_per_env": 1},
                             environments=[{"name": "code", "weight": 1, "options": {"path": str(path)}}])
    rt = Runtime.open(config)
    with pytest.raises(EnvironmentInvalid, match=r"failed validation.*(reference|known-good completion) earned 0"):
        run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
    assert rt.store.query("SELECT count(*) AS n FROM problems")["n"].iloc[0] == 0
    assert not rt.store.query("SELECT ok FROM env_validations")["ok"].iloc[0]


@pytest.mark.parametrize("check", [True, False])
def test_curate_drops_problems_a_constant_answer_passes(tmp_path, models_dir, check):
    """`a - b` on a small range: the items whose answer is 0 (and every item a sign- or digit-changed answer
    would pass) leave the training mix with the quality check on, counted as dropped_hackable; off, they stay."""
    config = smoke_config_in(tmp_path, models_dir, name=f"hackable{int(check)}", problems_per_iteration=12,
                             environments=[{"name": "arithmetic", "weight": 1,
                                            "options": {"ops": ["-"], "low": 2, "high": 6, "eval_pool": 4}}],
                             eval={"problems_per_env": 2}, curation={"oversample": 4, "quality_check": check})
    with Runtime.open(config) as rt:
        metrics = run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
        answers = [json.loads(p)["answer"] for p in rt.store.query("SELECT payload FROM problems")["payload"]]
    zeros = [a for a in answers if float(a) == 0]
    if check:
        assert metrics["dropped_hackable"] > 0 and not zeros and answers, (metrics, answers)
    else:
        assert metrics["dropped_hackable"] == 0 and zeros, (metrics, answers)


@pytest.mark.parametrize("limit", [0.25, 1.0])
def test_curate_leaves_out_an_environment_a_constant_answer_mostly_passes(tmp_path, models_dir, limit):
    """reasoning-gym's circuit_logic answers 1 on every item: with the quality check at the default
    max_majority_share its candidates are dropped as guessable (the arithmetic beside it is kept); at 1 (off) they
    stay."""
    config = smoke_config_in(tmp_path, models_dir, name=f"guessable{int(limit * 100)}", problems_per_iteration=8,
                             environments=[{"name": "arithmetic", "weight": 1},
                                           {"name": "rg:circuit_logic", "weight": 1, "eval_problems": 2}],
                             eval={"problems_per_env": 2}, curation={"max_majority_share": limit})
    with Runtime.open(config) as rt:
        metrics = run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
        envs = rt.store.query("SELECT env, count(*) AS n FROM problems GROUP BY env").set_index("env")["n"]
    assert envs.get("arithmetic", 0) > 0, (metrics, envs)
    if limit < 1:
        assert metrics["dropped_guessable"] > 0 and "rg:circuit_logic" not in envs, (metrics, envs)
    else:
        assert metrics["dropped_guessable"] == 0 and envs.get("rg:circuit_logic", 0) > 0, (metrics, envs)


def test_answer_majority_reads_the_share_of_the_most_common_expected_answer():
    from evertrain.envs import registry
    from evertrain.envs.quality import answer_majority

    circuit = answer_majority(registry.get("rg:circuit_logic"))
    assert circuit is not None and circuit.answer == "1" and circuit.share == 1.0 and circuit.items >= 50
    spread = answer_majority(registry.get("arithmetic"))
    assert spread is not None and spread.share < 0.25 and spread.classes > 20, spread
    assert answer_majority(registry.get("mbpp")) is None  # graded by running tests, not by a final answer
