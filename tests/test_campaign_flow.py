"""A complete two-iteration campaign through the real Prefect flow, MLflow (SQLite) and a DuckDB file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from evertrain.tasks import STAGE_FUNCTIONS, STAGES, run_stage
from tests.conftest import smoke_config_in


@pytest.fixture(scope="module")
def finished_campaign(tmp_path_factory, models_dir, prefect_server):
    from evertrain.flows.campaign import campaign_flow
    from evertrain.runtime import get_runtime

    config = smoke_config_in(tmp_path_factory.mktemp("campaign"), models_dir)
    finished = campaign_flow(config, 2)
    return config, get_runtime(config), finished


def test_two_iterations_write_every_table(finished_campaign):
    config, rt, finished = finished_campaign
    assert finished == [0, 1]
    store = rt.store
    per_iteration = store.query(
        "SELECT iteration, count(*) AS n FROM problems WHERE campaign = ? GROUP BY iteration ORDER BY iteration",
        [config.name],
    )
    assert per_iteration["n"].tolist() == [config.problems_per_iteration] * 2
    # G rollouts for every curated problem of every iteration, every one scored
    groups = store.query(
        """SELECT p.iteration, p.problem_id, count(r.sample) AS samples, count(r.reward) AS scored
           FROM problems p LEFT JOIN rollouts r USING (campaign, iteration, problem_id)
           WHERE p.campaign = ? GROUP BY ALL""", [config.name])
    assert (groups["samples"] == config.group_size).all()
    assert (groups["scored"] == config.group_size).all()
    statuses = store.query("SELECT status FROM stage_runs WHERE campaign = ?", [config.name])["status"]
    assert len(statuses) == 2 * len(STAGES) and set(statuses) == {"completed"}
    promotions = store.query("SELECT * FROM promotions WHERE campaign = ? ORDER BY iteration", [config.name])
    assert promotions["iteration"].tolist() == [0, 1]
    assert promotions["reason"].str.len().min() > 0
    evals = store.query("SELECT iteration, model_version, count(*) AS n FROM evals GROUP BY ALL")
    n_eval = config.eval.problems_per_env * len(config.environments)
    assert (evals["n"] == n_eval).all()


def test_update_changed_the_weights(finished_campaign):
    config, rt, _ = finished_campaign
    versions = rt.store.query("SELECT * FROM model_versions WHERE campaign = ? ORDER BY version", [config.name])
    assert versions["kind"].tolist() == ["base", "lora", "lora"]
    first, second = (Path(p) for p in versions["path"].tolist()[1:])
    a, b = load_file(first / "adapter_model.safetensors"), load_file(second / "adapter_model.safetensors")
    lora_b = [k for k in a if "lora_B" in k]
    assert lora_b, "the adapter has no LoRA B matrices"
    # LoRA B starts at zero: a non-zero B means the update moved the policy away from the base model
    assert any(a[k].abs().sum() > 0 for k in lora_b)
    assert any(not torch.equal(a[k], b[k]) for k in a), "iteration 1 did not change the weights"
    deltas = rt.store.query(
        "SELECT json_extract(metrics, '$.weight_delta_norm')::DOUBLE AS d FROM stage_runs WHERE stage = 'update'")
    assert (deltas["d"] > 0).all()


def test_mlflow_holds_runs_and_registry(finished_campaign):
    config, rt, _ = finished_campaign
    client = rt.tracker.client
    experiment = client.get_experiment_by_name(config.experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.tags["evertrain.iteration"] for r in runs) == ["0", "1"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert all("rollout/completions" in r.data.metrics and "promote/gain" in r.data.metrics for r in runs)
    assert all(r.data.tags.get("prefect.flow_run_id") for r in runs)
    versions = client.search_model_versions(f"name = '{config.registered_model}'")
    assert len(versions) == 3
    champion = client.get_model_version_by_alias(config.registered_model, "champion")
    challenger = client.get_model_version_by_alias(config.registered_model, "challenger")
    assert int(challenger.version) == 3
    import mlflow

    path = Path(mlflow.artifacts.download_artifacts(artifact_uri=champion.source))
    assert (path / "evertrain_checkpoint.json").exists()
    for run in runs:  # each iteration's run carries the campaign's progress figure and the decision
        assert "figures/progress.png" in [a.path for a in client.list_artifacts(run.info.run_id, "figures")]
        assert run.data.tags["promotion.reason"]


def test_report_lists_every_iteration(finished_campaign, tmp_path):
    from evertrain.plots import html_report
    from evertrain.report import iteration_report

    config, rt, _ = finished_campaign
    rows = iteration_report(rt.store, config.name)
    assert [r["iteration"] for r in rows] == [0, 1]
    for row in rows:
        assert row["status"] == "completed" and row["tokens"] > 0 and row["dollars"] > 0
        assert row["pass1_challenger"] is not None and row["promoted"] is not None
        assert set(row["dropped"]) >= {"duplicate", "near_duplicate", "contaminated", "too_easy", "too_hard"}
    page = html_report(config.name, rows)
    assert page.count("<img") == 1 and "data:image/png;base64," in page and "iteration 1" in page


@pytest.mark.parametrize("stage", STAGES)
def test_rerunning_a_stage_keeps_row_counts(finished_campaign, stage):
    config, rt, _ = finished_campaign
    before = rt.store.counts()
    champion = rt.tracker.alias("champion")
    run_stage(rt, stage, 1, STAGE_FUNCTIONS[stage])
    after = rt.store.counts()
    # sandbox_runs is an append-only audit log; every other table must be unchanged
    assert {k: v for k, v in after.items() if k != "sandbox_runs"} == \
        {k: v for k, v in before.items() if k != "sandbox_runs"}
    assert rt.tracker.alias("champion") == champion or stage in ("update", "promote")
    status = rt.store.stage_status(config.name, 1)
    assert status[stage] == "completed"
