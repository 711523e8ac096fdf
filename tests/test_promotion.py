"""The promotion gate never promotes a worse model; rollback restores the previous champion."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from evertrain.config import PromotionConfig
from evertrain.data.store import StoreError, now
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, STAGES, run_stage
from evertrain.tasks.promote import _consecutive_failures, ahead, decide, rollback
from tests.conftest import smoke_config_in


def _paired(challenger: list[float], champion: list[float], envs: list[str] | None = None) -> pd.DataFrame:
    envs = envs or ["a"] * len(challenger)
    return pd.DataFrame({"problem_id": [str(i) for i in range(len(challenger))], "env": envs,
                         "challenger": challenger, "champion": champion})


def test_gate_promotes_a_clearly_better_challenger():
    rng = np.random.default_rng(0)
    champion = (rng.random(200) < 0.3).astype(float)
    challenger = np.maximum(champion, (rng.random(200) < 0.3).astype(float))
    decision = decide(_paired(challenger.tolist(), champion.tolist()), PromotionConfig(confidence=0.95), seed=1)
    assert decision["promoted"] and decision["p_better"] >= 0.95 and decision["gain_low"] > 0


@pytest.mark.parametrize(("challenger", "champion", "reason"), [
    ([0.0] * 50, [1.0] * 25 + [0.0] * 25, "regressed"),
    ([1.0] * 10 + [0.0] * 40, [1.0] * 10 + [0.0] * 40, "gain +0.000 is not above"),
    ([1.0] * 11 + [0.0] * 39, [1.0] * 10 + [0.0] * 40, "P(better)"),
])
def test_gate_keeps_the_champion(challenger, champion, reason):
    rule = PromotionConfig(confidence=0.95, max_regression=0.05)
    decision = decide(_paired(challenger, champion), rule, seed=1)
    assert not decision["promoted"] and reason in decision["reason"]


def test_gate_blocks_a_regression_hidden_by_an_average_gain():
    # +0.4 on env a, -0.2 on env b: better on average, but b regresses beyond the tolerance
    challenger = [1.0] * 20 + [0.0] * 30 + [0.0] * 50
    champion = [0.0] * 50 + [1.0] * 10 + [0.0] * 40
    envs = ["a"] * 50 + ["b"] * 50
    decision = decide(_paired(challenger, champion, envs), PromotionConfig(confidence=0.5, max_regression=0.05), 1)
    assert not decision["promoted"] and "b regressed" in decision["reason"]


def test_futility_counts_ties_as_not_worse():
    from evertrain.stats import paired_bootstrap

    # the challenger lost one of 57 problems and won none: no bootstrap mean is above 0, so P(better) is 0,
    # but that is no evidence that the rest of the evaluation is futile
    challenger, champion = np.array([0.0] + [1.0] * 56), np.ones(57)
    tie = paired_bootstrap(challenger, champion, np.zeros(57), 2000, seed=0)
    assert tie["p_better"] == 0.0 and tie["p_not_worse"] > 0.3
    clearly_worse = paired_bootstrap(np.zeros(57), np.array([1.0] * 15 + [0.0] * 42), np.zeros(57), 2000, seed=0)
    assert clearly_worse["p_not_worse"] < 0.05


def test_slices_take_the_same_share_of_every_environment():
    from evertrain.envs.base import Problem
    from evertrain.tasks.evaluate import slices

    problems = [Problem.make("a", f"a{i}", {}, "eval") for i in range(8)]
    problems += [Problem.make("b", f"b{i}", {}, "eval") for i in range(4)]
    parts = slices(problems, 4)
    assert [[p.env for p in part] for part in parts] == [["a", "a", "b"]] * 4
    assert [p.id for part in parts for p in part if p.env == "a"] == [p.id for p in problems[:8]]
    assert slices(problems, 1) == [problems]


def _register_random_challenger(rt, iteration: int, models_dir) -> int:
    """What a broken update would register: full weights, freshly randomly initialized."""
    from evertrain.models.checkpoint import save_checkpoint
    from evertrain.models.tiny import build_tiny_model

    random_base = build_tiny_model(models_dir.parent / "random-tiny", seed=1234)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_base)
    path = save_checkpoint(model, rt.checkpoint_dir(iteration), rt.base_model)
    run_id, _ = rt.tracker.iteration_run(iteration)
    version = rt.tracker.register(path, run_id, iteration)
    rt.store.replace("model_versions", {"campaign": rt.campaign, "version": version}, [{
        "campaign": rt.campaign, "version": version, "iteration": iteration, "kind": "full", "path": str(path),
        "parent_version": None, "created_at": now()}])
    rt.store.record_stage(rt.campaign, iteration, "update", "completed", started_at=now())
    return version


def test_worse_challenger_is_never_promoted_and_rollback_restores(tmp_path, models_dir):
    config = smoke_config_in(
        tmp_path, models_dir, name="gate", environments=[{"name": "digits", "weight": 1}],
        problems_per_iteration=8, group_size=8, eval={"problems_per_env": 24},
        update={"learning_rate": 1e-2, "finetune": "full", "minibatch_size": 32, "microbatch_size": 32, "epochs": 2},
        promotion={"confidence": 0.8, "bootstrap_samples": 500},
    )
    rt = Runtime.open(config)
    for iteration in range(5):  # at most 5 iterations to a first promotion; the rest needs just one champion
        for stage in STAGES:
            run_stage(rt, stage, iteration, STAGE_FUNCTIONS[stage])
        decision = rt.store.last_promotion(rt.campaign)
        if decision is not None and bool(decision["promoted"]):
            break
    promotions = rt.store.query("SELECT * FROM promotions ORDER BY iteration")
    assert promotions["promoted"].any(), promotions[["iteration", "reason"]]
    champion = rt.champion_version()
    assert champion != 1

    # a random-weights challenger for the next iteration must lose the gate
    bad_at = iteration + 1
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, bad_at, STAGE_FUNCTIONS[stage])
    bad = _register_random_challenger(rt, bad_at, models_dir)
    run_stage(rt, "evaluate", bad_at, STAGE_FUNCTIONS["evaluate"])
    metrics = run_stage(rt, "promote", bad_at, STAGE_FUNCTIONS["promote"])
    assert metrics["promoted"] == 0.0
    assert rt.champion_version() == champion
    decision = rt.store.query("SELECT * FROM promotions WHERE iteration = ?", [bad_at]).iloc[0]
    assert decision["challenger_version"] == bad and decision["challenger_pass1"] < decision["champion_pass1"]
    # and it cost a quarter of an evaluation: the gate stopped at its first look (eval.looks = 4)
    assert "stopped for futility after 6 of 24 problems" in decision["reason"], decision["reason"]
    answered = rt.store.query("SELECT count(*) AS n FROM evals WHERE iteration = ? AND model_version = ?",
                              [bad_at, bad])
    assert int(answered["n"].iloc[0]) == 6

    # the challenger the gate refused cannot be served by a rollback unless that is asked for by name (issue 45)
    with pytest.raises(StoreError, match="was never champion"):
        rollback(rt, to_version=bad)
    assert rt.champion_version() == champion and rt.store.query("SELECT * FROM rollbacks").empty

    # rollback: champion goes back to previous_champion, and the next rollout samples from it
    previous = rt.tracker.alias("previous_champion")
    result = rollback(rt)
    assert result["champion"] == previous and rt.champion_version() == previous
    assert rt.tracker.alias("previous_champion") == champion
    for stage in ("curate", "rollout"):
        run_stage(rt, stage, bad_at + 1, STAGE_FUNCTIONS[stage])
    used = rt.store.query("SELECT DISTINCT policy_version FROM rollouts WHERE iteration = ?",
                          [bad_at + 1])["policy_version"]
    assert used.tolist() == [previous]
    rows = rt.store.query("SELECT * FROM rollbacks")
    assert len(rows) == 1 and rows["actor"].iloc[0] and rows["host"].iloc[0] and not rows["unpromoted"].iloc[0]


def test_trainee_is_reset_to_the_champion_after_failed_gates(tmp_path, models_dir):
    config = smoke_config_in(tmp_path, models_dir, name="reset", environments=[{"name": "digits", "weight": 1}],
                             problems_per_iteration=4, group_size=4, eval={"problems_per_env": 4},
                             promotion={"min_gain": 1.0, "reset_after_failures": 2, "bootstrap_samples": 200})
    rt = Runtime.open(config)
    for iteration in range(2):
        for stage in STAGES:
            run_stage(rt, stage, iteration, STAGE_FUNCTIONS[stage])
    decisions = rt.store.query("SELECT promoted, reset_trainee, reason FROM promotions ORDER BY iteration")
    assert not decisions["promoted"].any()
    assert decisions["reset_trainee"].tolist() == [False, True] and "reset" in decisions["reason"].iloc[1]
    assert rt.trainee_version() == rt.champion_version() == 1
    for stage in ("curate", "rollout"):
        run_stage(rt, stage, 2, STAGE_FUNCTIONS[stage])
    assert set(rt.store.query("SELECT policy_version FROM rollouts WHERE iteration = 2")["policy_version"]) == {1}


def test_a_refusal_for_want_of_evidence_does_not_count_toward_a_reset(tmp_path, models_dir):
    """A challenger ahead of the champion but short of the confidence (the demo's seed 2: +0.04 and +0.06 on
    the gate, P(better) 0.80 and 0.89, sealed gain +0.13) is not a reason to throw the trainee away; one that
    is behind, or regressed on an environment, is."""
    config = smoke_config_in(tmp_path, models_dir, name="ahead", environments=[{"name": "digits", "weight": 1}],
                             promotion={"reset_after_failures": 2, "max_regression": 0.05})
    rt = Runtime.open(config)
    rule = rt.config.promotion
    short = decide(_paired([1.0] * 18 + [0.0] * 82, [1.0] * 12 + [0.0] * 88), PromotionConfig(confidence=0.999), 1)
    assert not short["promoted"] and "P(better)" in short["reason"]
    assert ahead(0.18, 0.12, short["per_env"], rule)
    assert not ahead(0.10, 0.12, {"digits": {"challenger": 0.10, "champion": 0.12, "problems": 100}}, rule)
    regressed = {"a": {"challenger": 0.9, "champion": 0.2, "problems": 50},
                 "b": {"challenger": 0.1, "champion": 0.3, "problems": 50}}
    assert not ahead(0.5, 0.25, regressed, rule)  # ahead overall, but b dropped by 0.2

    def gate(iteration: int, challenger: float, champion: float) -> None:
        per_env = {"digits": {"challenger": challenger, "champion": champion, "problems": 100}}
        rt.store.replace("promotions", {"campaign": rt.campaign, "iteration": iteration}, [{
            "campaign": rt.campaign, "iteration": iteration, "challenger_version": iteration + 2,
            "champion_version": 1, "promoted": False, "challenger_pass1": challenger, "champion_pass1": champion,
            "p_better": 0.85, "gain_low": -0.02, "gain_high": 0.14, "per_env": json.dumps(per_env),
            "reason": "kept champion", "reset_trainee": False, "decided_at": now()}])

    gate(0, 0.16, 0.12)
    gate(1, 0.18, 0.12)
    assert _consecutive_failures(rt, 2) == 0  # two refusals, both ahead: no reset due
    gate(1, 0.10, 0.12)
    assert _consecutive_failures(rt, 2) == 1
    gate(0, 0.12, 0.12)  # a tie is not ahead
    assert _consecutive_failures(rt, 2) == 2
