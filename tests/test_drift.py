"""The drift monitor on a real Prefect server and the real store: graded traces whose pass rate falls start a
campaign run with the reason; a rate above the threshold starts nothing; a second check while a run is in
flight, or after it within the cooldown, starts nothing."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pandas as pd
import pytest

from evertrain.data.store import Store
from evertrain.drift import DRIFT_TAG, check, drift_flow, live_window
from evertrain.serving.traces import FEEDBACK_COLUMNS, TRACE_COLUMNS
from evertrain.stats import wilson
from tests.conftest import smoke_config_in


def _traces(store, campaign: str, outcomes: list[bool], *, tools: str = "calc", version: int = 1,
            minutes_ago: float = 1.0, key_id: str | None = None) -> None:
    """Graded calculator traces (one per outcome, oldest first), as the endpoint writes them."""
    start = datetime.now(UTC) - timedelta(minutes=minutes_ago)
    traces, feedback = [], []
    for i, passed in enumerate(outcomes):
        at = start + timedelta(seconds=i)
        trace_id = f"chatcmpl-{uuid.uuid4().hex}"
        traces.append({c: None for c in TRACE_COLUMNS} | {
            "trace_id": trace_id, "campaign": campaign, "model_version": version, "model": f"{campaign}@v{version}",
            "env": "calculator", "tools": tools, "status": "ok", "http_status": 200, "created_at": at,
            "prompt_tokens": 10, "cached_tokens": 0, "completion_tokens": 5, "cost_usd": 0.0, "latency_ms": 1.0,
            "key_id": key_id})
        feedback.append({c: None for c in FEEDBACK_COLUMNS} | {
            "trace_id": trace_id, "campaign": campaign, "source": "verifier", "passed": passed,
            "reward": float(passed), "detail": "{}", "created_at": at})
    store.append("traces", pd.DataFrame(traces))
    store.append("trace_feedback", pd.DataFrame(feedback))


@pytest.fixture
def monitored(tmp_path, models_dir, prefect_server):
    """A campaign whose deployment is registered on the Prefect server (no runner: its runs stay scheduled)."""
    from evertrain.flows.deploy import build_deployment

    name = f"drift-{uuid.uuid4().hex[:6]}"
    config = smoke_config_in(tmp_path, models_dir, name=name,
                             environments=[{"name": "calculator", "weight": 1}],
                             drift={"threshold": 0.5, "window_minutes": 30, "min_requests": 20,
                                    "cooldown_minutes": 60, "iterations": 2})
    build_deployment(config).apply()
    store = Store(config.paths.store)  # its own connection (no per-process cache of stores)
    return config, store


def _runs(campaign: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[DRIFT_TAG, f"campaign:{campaign}"])))


def test_a_falling_pass_rate_starts_one_campaign_run_with_the_reason(monitored):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.states import Completed

    config, store = monitored
    # the python tool served well 20 minutes ago; now (tool v2, "calc") the same model fails 28 of 30
    _traces(store, config.name, [True] * 18 + [False] * 2, tools="python", minutes_ago=20)
    _traces(store, config.name, [True, False, True] + [False] * 27, tools="calc")
    readings = {r.tools: r for r in live_window(store, config.name, 30, 0.5, 20)}
    assert readings["python"].requests == 20 and not readings["python"].dropped
    assert readings["calc"].requests == 30 and readings["calc"].passed == 2 and readings["calc"].dropped
    assert readings["calc"].high < 0.5

    result = drift_flow(config)
    assert result["dropped"] == ["calculator[calc]"] and result["flow_run_id"]
    runs = _runs(config.name)
    assert len(runs) == 1
    run = runs[0]
    assert str(run.id) == result["flow_run_id"]
    assert run.name.startswith("drift: calculator[calc] 0.07 < 0.50"), run.name
    assert "drift:calculator/calc" in run.tags and run.parameters["iterations"] == 2
    assert run.parameters["config"]["name"] == config.name  # the deployment's own config, merged in
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(run.deployment_id)
        assert deployment.name == f"campaign-{config.name}"
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"drift-{config.name}"])))
    low, high = wilson(2, 30)
    assert f"| calculator[calc] | 1 | 0.067 | [{low:.3f}, {high:.3f}] | 30 | 0.50 | **yes** |" in artifacts[0].data
    assert "| calculator[python] | 1 | 0.900 |" in artifacts[0].data

    # a second check while that run is scheduled: the same drop starts nothing
    again = check(config, store)
    assert again["dropped"] and again["flow_run_id"] is None and again["blocked"].startswith("in flight")
    # the run finished (the model did not recover yet): still nothing within the cooldown
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Completed(), force=True)
    later = check(config, store)
    assert later["flow_run_id"] is None and later["blocked"].startswith("cooldown"), later
    assert len(_runs(config.name)) == 1
    # once the cooldown is over (here: a config without one) a drop still there may start a run again
    over = config.model_copy(update={"drift": config.drift.model_copy(update={"cooldown_minutes": 0})})
    after = check(over, store)
    assert after["flow_run_id"] is not None and len(_runs(config.name)) == 2


def test_a_drift_run_that_failed_is_retried_not_left_to_the_cooldown(monitored):
    """Issue 45: the run a drop started failed (in `make flywheel`: the store's catalog locked); the next check that
    still finds the drop starts it again at once, up to drift.retries times in a row, then says why it waits."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Failed

    config, store = monitored
    config = config.model_copy(update={"drift": config.drift.model_copy(update={"retries": 1})})
    _traces(store, config.name, [False] * 30)
    first = check(config, store)
    assert first["flow_run_id"] is not None
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(first["flow_run_id"], Failed(), force=True)
    retried = check(config, store)
    assert retried["flow_run_id"] is not None and retried["blocked"] is None, retried  # not "cooldown"
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(retried["flow_run_id"], Crashed(), force=True)
    waits = check(config, store)  # two failures in a row, one retry allowed: the cooldown, with the reason
    assert waits["flow_run_id"] is None and waits["blocked"].startswith("cooldown"), waits
    assert "last 2 runs failed, more than drift.retries = 1" in waits["blocked"]
    assert len(_runs(config.name)) == 2


def test_a_pass_rate_above_the_threshold_or_too_few_requests_start_nothing(monitored):
    config, store = monitored
    _traces(store, config.name, [True] * 15 + [False] * 10, tools="calc")  # 0.60: above the threshold
    _traces(store, config.name, [False] * 12, tools="python")  # 0 of 12: below it, but fewer than min_requests
    # old failures outside the window do not count
    _traces(store, config.name, [False] * 40, tools="calc", minutes_ago=45)
    result = check(config, store)
    readings = {r["tools"]: r for r in result["readings"]}
    assert readings["calc"]["requests"] == 25 and readings["python"]["requests"] == 12
    assert result["dropped"] == [] and result["flow_run_id"] is None and result["outcome"] == "no drop"
    assert _runs(config.name) == []


def test_one_client_s_passing_burst_does_not_hide_another_client_s_drop(monitored):
    """Issue 45: pooled, 60 easy passes of one key and 24 failures of another read 0.71 (no drop); the second
    client's slice reads 0.00 and starts the run."""
    config, store = monitored
    _traces(store, config.name, [True] * 60, key_id="k_burst")
    _traces(store, config.name, [False] * 24, key_id="k_user", minutes_ago=0.5)
    readings = {r.client: r for r in live_window(store, config.name, 30, 0.5, 20)}
    assert readings[None].requests == 84 and not readings[None].dropped  # what the monitor read before
    assert readings["k_user"].dropped and readings["k_user"].rate == 0.0 and not readings["k_burst"].dropped
    result = check(config, store)
    assert result["dropped"] == ["calculator[calc] client k_user"] and result["flow_run_id"] is not None
    (run,) = _runs(config.name)
    assert "client k_user" in run.name and "drift:calculator/calc" in run.tags


def test_only_the_version_served_last_is_judged(monitored):
    """After a swap the new champion's answers decide, not the failures of the version it replaced."""
    config, store = monitored
    _traces(store, config.name, [False] * 30, tools="calc", version=1, minutes_ago=10)
    _traces(store, config.name, [True] * 20 + [False] * 4, tools="calc", version=2, minutes_ago=2)
    (reading,) = live_window(store, config.name, 30, 0.5, 20)
    assert reading.model_version == 2 and reading.requests == 24 and not reading.dropped
    assert check(config, store)["flow_run_id"] is None and _runs(config.name) == []


def test_alert_only_and_a_missing_deployment(monitored, tmp_path, models_dir):
    config, store = monitored
    _traces(store, config.name, [False] * 25, tools="calc")
    alert = config.model_copy(update={"drift": config.drift.model_copy(update={"action": "alert"})})
    assert check(alert, store)["flow_run_id"] is None and _runs(config.name) == []
    missing = config.model_copy(update={"drift": config.drift.model_copy(update={"deployment": "nope/nothing"})})
    with pytest.raises(LookupError, match="no deployment 'nope/nothing'"):
        check(missing, store)


def test_the_monitor_is_a_deployment_on_an_interval_beside_the_campaign(monitored):
    from prefect.client.orchestration import get_client

    from evertrain.flows.deploy import build_drift_deployment

    config, _store = monitored
    config = config.model_copy(update={"drift": config.drift.model_copy(update={"interval_seconds": 45})})
    deployment_id = build_drift_deployment(config).apply()
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployment_id)
        flow = client.read_flow(deployment.flow_id)
    assert flow.name == "evertrain-drift" and deployment.name == f"drift-{config.name}"
    assert [s.schedule.interval.total_seconds() for s in deployment.schedules] == [45.0]
    assert deployment.parameters["config"]["drift"]["threshold"] == 0.5
    assert "drift" in deployment.tags and f"campaign:{config.name}" in deployment.tags


def test_a_campaign_run_the_monitor_started_keeps_its_reason_as_its_name(prefect_server):
    """Prefect renames a flow run after its flow's flow_run_name when the run starts; a drift run keeps the reason."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    from evertrain.drift import campaign_run_name

    @flow(name="named-like-the-campaign", flow_run_name=campaign_run_name)
    def named(config: dict) -> str:
        from prefect.runtime import flow_run

        return flow_run.name

    with get_client(sync_client=True) as client:
        drift_run = client.create_flow_run(named, name="drift: calculator[calc] 0.04 < 0.50",
                                           parameters={"config": {"name": "c1"}}, tags=[DRIFT_TAG])
        plain_run = client.create_flow_run(named, name="any-name", parameters={"config": {"name": "c1"}})
    assert run_flow(named, flow_run=drift_run, parameters={"config": {"name": "c1"}}) == \
        "drift: calculator[calc] 0.04 < 0.50"
    assert run_flow(named, flow_run=plain_run, parameters={"config": {"name": "c1"}}) == "c1"
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(drift_run.id).name == "drift: calculator[calc] 0.04 < 0.50"
        assert client.read_flow_run(plain_run.id).name == "c1"
