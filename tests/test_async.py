"""Async mode overlaps sampling with the update and never trains on a rollout staler than the bound."""

from __future__ import annotations

import json

from evertrain.runtime import Runtime
from tests.conftest import smoke_config_in


def test_async_campaign_respects_the_staleness_bound(tmp_path, models_dir, prefect_server):
    from evertrain.flows.campaign import campaign_flow

    config = smoke_config_in(
        tmp_path, models_dir, name="async", environments=[{"name": "digits", "weight": 1}],
        problems_per_iteration=4, group_size=4,
        update={"mode": "async", "max_staleness": 1, "replay": True, "learning_rate": 1e-2,
                "finetune": "full", "minibatch_size": 16, "microbatch_size": 16},
    )
    assert campaign_flow(config, 3) == [0, 1, 2]
    rt = Runtime.open(config)
    rollouts = rt.store.query("SELECT iteration, min(policy_version) AS v FROM rollouts GROUP BY ALL ORDER BY 1")
    versions = rt.store.query("SELECT iteration, version, parent_version FROM model_versions ORDER BY version")
    updates = rt.store.query("SELECT iteration, metrics FROM stage_runs WHERE stage = 'update' ORDER BY iteration")
    lags = [json.loads(m)["max_lag"] for m in updates["metrics"]]
    # iteration 1's rollouts were sampled while update 0 ran: by the base model, one version behind
    challenger_0 = int(versions[versions["iteration"] == 0]["version"].iloc[0])
    assert int(rollouts["v"].iloc[1]) < challenger_0
    assert max(lags) == 1 and all(lag <= config.update.max_staleness for lag in lags)
    assert any(json.loads(m)["is_weight_mean"] != 1.0 for m in updates["metrics"])
    # the iteration after next was also prefetched, and every iteration finished every stage once
    statuses = rt.store.query("SELECT iteration, count(*) AS n FROM stage_runs GROUP BY 1 ORDER BY 1")
    assert statuses["n"].tolist()[:3] == [6, 6, 6]


def test_update_drops_rollouts_beyond_the_bound(tmp_path, models_dir):
    from evertrain.tasks import STAGE_FUNCTIONS, run_stage

    config = smoke_config_in(tmp_path, models_dir, name="stale", environments=[{"name": "digits", "weight": 1}],
                             problems_per_iteration=4, group_size=4,
                             update={"max_staleness": 1, "replay": True, "learning_rate": 1e-2, "finetune": "full",
                                     "minibatch_size": 16, "microbatch_size": 16})
    rt = Runtime.open(config)
    for iteration in range(3):
        for stage in ("curate", "rollout", "score", "update"):
            run_stage(rt, stage, iteration, STAGE_FUNCTIONS[stage])
    # pretend iteration 3's rollouts came from the base model (three updates ago): all must be dropped
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 3, STAGE_FUNCTIONS[stage])
    rt.store.con.execute("UPDATE rollouts SET policy_version = 1 WHERE iteration = 3")
    assert rt.store.scalar("SELECT count(*) FILTER (WHERE policy_version <> 1) FROM rollouts WHERE iteration = 3") == 0
    metrics = run_stage(rt, "update", 3, STAGE_FUNCTIONS["update"])
    assert metrics["dropped_stale_groups"] >= 4  # all of iteration 3, and iteration 2's (lag 2) too
    assert metrics["max_lag"] <= 1
