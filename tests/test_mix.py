"""The adaptive environment mix: shares follow learnability, with a floor, and every mix is stored."""

from __future__ import annotations

import pytest

from evertrain.data.store import Store
from evertrain.mix import counts, learnability, plan, shares
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from tests.conftest import smoke_config_in


def test_learnability_peaks_at_half_and_vanishes_at_the_ends():
    assert learnability(0.5, 1.0) == pytest.approx(1.0)
    assert learnability(0.0, 0.0) == 0.0 and learnability(1.0, 0.0) == 0.0
    assert learnability(None, None) == 1.0  # no history: explored first
    assert learnability(0.5, 0.5) > learnability(0.1, 0.2) > 0


def test_shares_keep_the_floor_and_weight_zero():
    split = shares([1.0, 1.0, 0.0, 2.0], [0.0, 0.8, 1.0, 0.4], floor=0.1)
    assert sum(split) == pytest.approx(1.0)
    assert split[2] == 0.0  # evaluation only, whatever its learnability
    assert split[0] == pytest.approx(0.1)  # nothing to learn: the floor, not starved
    assert split[1] == pytest.approx(split[3])  # weight x learnability: 1 x 0.8 = 2 x 0.4
    assert split[1] > 0.1
    assert shares([1.0, 3.0], [0.0, 0.0], floor=0.1) == pytest.approx([0.1 + 0.8 * 0.25, 0.1 + 0.8 * 0.75])
    assert counts(16, [0.02, 0.49, 0.49]) == [1, 8, 7] or counts(16, [0.02, 0.49, 0.49]) == [1, 7, 8]
    assert counts(2, [0.02, 0.49, 0.49]).count(0) == 1  # too few problems for everyone: no negative counts


def _rollouts(campaign: str, iteration: int, env: str, rewards: list[list[float]]) -> list[dict]:
    return [{"campaign": campaign, "iteration": iteration, "problem_id": f"{env}-{iteration}-{g}", "sample": s,
             "env": env, "reward": r, "passed": r == 1.0}
            for g, group in enumerate(rewards) for s, r in enumerate(group)]


def test_curate_follows_the_mix_and_logs_every_change(tmp_path, models_dir):
    config = smoke_config_in(tmp_path, models_dir, problems_per_iteration=12,
                             mix={"adaptive": True, "window": 2, "floor": 0.1},
                             environments=[{"name": "arithmetic", "weight": 1}, {"name": "digits", "weight": 1},
                                           {"name": "gsm8k", "weight": 1}, {"name": "sql", "weight": 0}])
    rt = Runtime.open(config)
    curate = STAGE_FUNCTIONS["curate"]
    first = run_stage(rt, "curate", 0, curate)
    # iteration 0: no history, every trained environment explored alike, sql (weight 0) not at all
    assert [first[f"problems_{e}"] for e in ("arithmetic", "digits", "gsm8k", "sql")] == [4, 4, 4, 0]
    # history: arithmetic half its groups informative, digits every group informative, gsm8k all failed
    rows = (_rollouts(rt.campaign, 0, "arithmetic", [[1, 0, 1, 0], [0, 0, 0, 0]] * 2)
            + _rollouts(rt.campaign, 0, "digits", [[1, 0, 0, 1]] * 4)
            + _rollouts(rt.campaign, 0, "gsm8k", [[0, 0, 0, 0]] * 4))
    rt.store.append("rollouts", rows)
    second = run_stage(rt, "curate", 1, curate)
    got = {e: second[f"problems_{e}"] for e in ("arithmetic", "digits", "gsm8k", "sql")}
    assert got["digits"] > got["arithmetic"] > got["gsm8k"] >= 1 and got["sql"] == 0
    assert sum(got.values()) == 12
    assert second["mix_share_gsm8k"] == pytest.approx(0.1)  # the floor
    mix = rt.store.query("SELECT * FROM mix WHERE iteration = 1 ORDER BY env")
    assert list(mix["env"]) == ["arithmetic", "digits", "gsm8k", "sql"]
    assert mix.set_index("env").loc["gsm8k", "pass_rate"] == 0.0
    assert mix.set_index("env").loc["digits", "informative_share"] == 1.0
    # a rerun replaces the iteration's mix rows and makes the same choice
    before = rt.store.counts()["mix"]
    assert run_stage(rt, "curate", 1, curate)["problems_digits"] == got["digits"]
    assert rt.store.counts()["mix"] == before == 8
    # MLflow got the shares as curate metrics
    runs = rt.tracker.client.search_runs([rt.tracker.experiment_id])
    logged = {k for run in runs for k in run.data.metrics}
    assert "curate/mix_share_digits" in logged
    # the report shows the mix over iterations
    from evertrain.report import format_mix, mix_over_iterations

    lines = format_mix(mix_over_iterations(rt.store, rt.campaign))
    assert [line.split(":")[0] for line in lines] == ["mix i=0", "mix i=1"]
    assert "gsm8k 0.10 (" in lines[1] and "sql 0.00 (0," in lines[1]


def test_fixed_weights_are_unchanged_without_the_flag(tmp_path, models_dir):
    config = smoke_config_in(tmp_path, models_dir)
    store = Store(tmp_path / "plain.duckdb")
    try:
        got = plan(config, store, "smoke", 0)
    finally:
        store.close()
    assert [m.problems for m in got] == [3, 1, 4]  # allocate(8, [2, 1, 3]), as before
