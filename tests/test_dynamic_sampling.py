"""DAPO's dynamic sampling, bounded (``update.dynamic_sampling_draws``, tasks/dynamic_sampling.py).

A grader that gives some problems reward 0 whatever the completion makes their groups uninformative; the
score stage must then draw fresh problems, sample and grade them, store them marked as refills, gain
informative groups, never draw more rounds than allowed, and change nothing when the knob is 0.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest

from evertrain.config import ConfigError, UpdateConfig, parse_config
from evertrain.envs.base import Problem, Verdict
from evertrain.envs.digits import Digits
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from tests.conftest import smoke_config_in

PROBLEMS, G = 6, 4


class Picky(Digits):
    """``digits``' problems, graded so that a problem is hopeless (reward 0 for every completion) unless
    ``easy(k)``; the others get a reward spread by the completion's text, so their groups are informative."""

    def __init__(self, easy_every: int = 3, **options: Any) -> None:
        super().__init__(**options)
        self.easy_every = easy_every

    def easy(self, problem: Problem) -> bool:
        return self.easy_every > 0 and (problem.payload["k"] // 2) % self.easy_every == 0

    def verify(self, problem: Problem, completion: str) -> Verdict:
        if not self.easy(problem):
            return Verdict.fail("hopeless")
        reward = (zlib.crc32(completion.encode()) % 997) / 996
        return Verdict(reward=reward, passed=reward > 0.5, reason="spread", detail={})


def campaign(tmp_path: Path, models_dir: Path, name: str, draws: int | None, easy_every: int = 3,
             algorithm: str = "grpo") -> Runtime:
    update: dict[str, Any] = {"algorithm": algorithm, "skip_zero_variance": True, "minibatch_size": 8,
                              "microbatch_size": 8}
    if draws is not None:
        update["dynamic_sampling_draws"] = draws
    # a store per campaign: two contexts of one process on one DuckLake SQLite catalog contend ("database is locked")
    config = smoke_config_in(tmp_path / name, models_dir, name=name, environments=[{"name": "digits", "weight": 1}],
                             problems_per_iteration=PROBLEMS, group_size=G, update=update,
                             eval={"problems_per_env": 4, "sealed_problems": 3})
    rt = Runtime.open(config)
    rt.ensure_started()  # the verifier self-test runs on the real digits environment, then the grader is swapped
    rt.envs["digits"] = Picky(easy_every=easy_every)
    return rt


def scored(rt: Runtime) -> dict[str, Any]:
    for stage in ("curate", "rollout"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    return run_stage(rt, "score", 0, STAGE_FUNCTIONS["score"])


def informative_groups(rt: Runtime) -> int:
    return int(rt.store.scalar(
        """SELECT count(*) FROM (SELECT problem_id FROM rollouts WHERE campaign = ? AND iteration = 0
           GROUP BY problem_id HAVING max(reward) > min(reward))""", [rt.config.name]))


def rollouts_of(rt: Runtime, refills: bool) -> Any:
    where = "refill_round >= 1" if refills else "coalesce(refill_round, 0) = 0"
    return rt.store.query(f"""SELECT problem_id, sample, refill_round, completion, reward FROM rollouts
                              WHERE campaign = ? AND iteration = 0 AND {where} ORDER BY problem_id, sample""",
                          [rt.config.name])


# --- config -------------------------------------------------------------------------------------------


def test_dynamic_sampling_draws_default_to_two_for_dapo_and_refuse_bad_values():
    assert UpdateConfig(algorithm="dapo").refill_draws == 2
    assert UpdateConfig(algorithm="grpo").refill_draws == 0 and UpdateConfig(algorithm="dr_grpo").refill_draws == 0
    assert UpdateConfig(algorithm="dapo", dynamic_sampling_draws=0).refill_draws == 0
    assert UpdateConfig(algorithm="grpo", dynamic_sampling_draws=5).refill_draws == 5
    for bad in (-1, 33, "many"):
        with pytest.raises(ConfigError, match=r"update\.dynamic_sampling_draws"):
            parse_config({"update": {"dynamic_sampling_draws": bad}})


# --- the score stage ----------------------------------------------------------------------------------


def test_refill_adds_stored_informative_groups_and_leaves_the_curated_batch_alone(tmp_path, models_dir):
    off = campaign(tmp_path, models_dir, "ds-off", draws=0)
    on = campaign(tmp_path, models_dir, "ds-on", draws=3)
    off_metrics, on_metrics = scored(off), scored(on)

    # without it: the curated batch only, no refill metric, no sampling counted in the score stage
    assert not any(key.startswith("refill") for key in off_metrics)
    assert rollouts_of(off, refills=True).empty and len(rollouts_of(off, refills=False)) == PROBLEMS * G
    start = informative_groups(off)
    assert 0 < start < PROBLEMS, "the grader must leave some groups uninformative for this test to mean anything"
    assert off_metrics["tokens_computed"] == 0

    # the curated batch is the same rows either way (seeded); its zero-variance groups stay stored
    curated_off, curated_on = rollouts_of(off, refills=False), rollouts_of(on, refills=False)
    assert curated_on[["problem_id", "sample", "completion", "reward"]].equals(
        curated_off[["problem_id", "sample", "completion", "reward"]])
    assert on_metrics["zero_variance_share"] == off_metrics["zero_variance_share"] > 0

    # with it: fresh problems drawn, sampled, graded and stored, marked with their round
    refills = rollouts_of(on, refills=True)
    drawn = set(refills["problem_id"])
    assert on_metrics["refill_groups"] == len(drawn) > 0 and len(refills) == len(drawn) * G
    assert refills["reward"].notna().all() and set(refills["refill_round"]) <= {1, 2, 3}
    assert 1 <= on_metrics["refill_draws"] <= 3 and max(refills["refill_round"]) == on_metrics["refill_draws"]
    assert not drawn & set(curated_on["problem_id"])
    problems = on.store.query("SELECT problem_id, split, refill_round FROM problems WHERE campaign = 'ds-on'")
    assert set(problems[problems["refill_round"] >= 1]["problem_id"]) == drawn
    assert set(problems["split"]) == {"train"}
    env = on.env("digits")
    held_out = {p.id for p in env.problems("eval", 4, on.config.seed)}
    held_out |= {p.id for split in ("test", "transfer") for p in env.sealed_problems(split, 3, on.config.seed, 4)}
    assert not drawn & held_out

    # more informative groups than without it, never more than the batch had problems
    gained = on_metrics["refill_informative_groups"]
    assert gained > 0 and on_metrics["informative_groups"] == start + gained == informative_groups(on) <= PROBLEMS
    assert on_metrics["informative_target"] == PROBLEMS
    # the refill's sampling is the stage's own cost
    assert on_metrics["completion_tokens"] > 0 and on_metrics["tokens_computed"] > 0
    assert on_metrics["cpu_s"] > off_metrics["cpu_s"]

    # the update trains on the refill groups: more informative groups than without dynamic sampling
    updated_off = run_stage(off, "update", 0, STAGE_FUNCTIONS["update"])
    updated_on = run_stage(on, "update", 0, STAGE_FUNCTIONS["update"])
    trained_off = updated_off["groups"] - updated_off["skipped_zero_variance_groups"]
    trained_on = updated_on["groups"] - updated_on["skipped_zero_variance_groups"]
    assert trained_off == start and trained_on == start + gained > trained_off
    assert updated_on["trained_sequences"] > updated_off["trained_sequences"]


def test_the_bound_holds_reruns_replace_and_turning_it_off_removes_the_refills(tmp_path, models_dir):
    rt = campaign(tmp_path, models_dir, "ds-bound", draws=None, easy_every=0, algorithm="dapo")  # all hopeless
    assert rt.config.update.refill_draws == 2
    metrics = scored(rt)
    # nothing informative can be found: exactly two rounds, each drawing one problem per uninformative group
    assert metrics["refill_draws"] == 2 and metrics["refill_informative_groups"] == 0
    assert metrics["refill_groups"] == 2 * PROBLEMS and metrics["informative_groups"] == 0
    refills = rollouts_of(rt, refills=True)
    assert sorted(refills.groupby("refill_round")["problem_id"].nunique().items()) == [(1, PROBLEMS), (2, PROBLEMS)]
    first = set(refills["problem_id"])

    # a rerun of the stage replaces its own rows with the same ones (seeded): no row count grows
    counts = rt.store.counts()
    again = run_stage(rt, "score", 0, STAGE_FUNCTIONS["score"])
    assert again["refill_groups"] == metrics["refill_groups"] and rt.store.counts() == counts
    assert set(rollouts_of(rt, refills=True)["problem_id"]) == first

    # a rerun of rollout then score re-samples the curated batch and refills it again
    run_stage(rt, "rollout", 0, STAGE_FUNCTIONS["rollout"])
    assert len(rollouts_of(rt, refills=False)) == PROBLEMS * G
    run_stage(rt, "score", 0, STAGE_FUNCTIONS["score"])
    assert rt.store.counts() == counts

    # turned off: the score stage's refill rows go, the curated (zero-variance) groups stay
    rt.config.update = UpdateConfig(**{**rt.config.update.model_dump(), "dynamic_sampling_draws": 0})
    off = run_stage(rt, "score", 0, STAGE_FUNCTIONS["score"])
    assert "refill_draws" not in off and rollouts_of(rt, refills=True).empty
    assert len(rollouts_of(rt, refills=False)) == PROBLEMS * G
    assert int(rt.store.scalar("SELECT count(*) FROM problems WHERE campaign = 'ds-bound'")) == PROBLEMS
    # one round allowed: one round drawn
    rt.config.update = UpdateConfig(**{**rt.config.update.model_dump(), "dynamic_sampling_draws": 1})
    one = run_stage(rt, "score", 0, STAGE_FUNCTIONS["score"])
    assert one["refill_draws"] == 1 and set(rollouts_of(rt, refills=True)["refill_round"]) == {1}
