"""The campaign context: opened once by the flow, passed to every stage, closed when the flow ends; no
per-process caches of runtimes, store connections, clusters or engines."""

from __future__ import annotations

import importlib

import pytest

from evertrain.data.store import Store, StoreError
from tests.conftest import smoke_config_in


def _claim_is_free(uri: str, campaign: str) -> bool:
    """Whether a fresh connection may become ``campaign``'s writer (nothing in this process still holds it)."""
    store = Store(uri)
    try:
        store.claim(campaign)
        return True
    except StoreError:
        return False
    finally:
        store.close()


def test_no_module_level_locator_or_resource_cache_is_left():
    for module, names in {"evertrain.runtime": ("get_runtime", "release_runtimes", "_runtimes"),
                          "evertrain.data.store": ("open_store", "close_store", "_open"),
                          "evertrain.cluster": ("get_cluster", "shutdown_clusters", "_clusters"),
                          "evertrain.inference.ray_workers": ("get_cluster", "shutdown_clusters", "_clusters"),
                          "evertrain.inference.vllm_sampler": ("get_engine", "shutdown_engines", "_engines"),
                          "evertrain.inference.campaign": ("get_engine", "shutdown_engines", "_engines")}.items():
        loaded = importlib.import_module(module)
        assert not [name for name in names if hasattr(loaded, name)], module


def test_two_contexts_in_one_process_own_their_own_store(tmp_path, models_dir):
    from evertrain.runtime import Runtime

    # two campaigns in one store: each context its own connection, each claims its own campaign
    first = smoke_config_in(tmp_path, models_dir, name="first")
    second = smoke_config_in(tmp_path, models_dir, name="second")
    assert first.paths.store == second.paths.store
    with Runtime.open(first) as a, Runtime.open(second) as b:
        assert a.store is not b.store
        b.store.set_campaign_state("second", trainee_version=7)
        a.close()
        assert a.closed and not b.closed
        # closing one leaves the other usable, and writing
        b.store.set_campaign_state("second", trainee_version=8)
        assert b.store.campaign_state("second")["trainee_version"] == 8
        assert _claim_is_free(first.paths.store, "first") and not _claim_is_free(first.paths.store, "second")
    assert _claim_is_free(second.paths.store, "second")


def test_a_second_context_of_an_open_campaign_is_refused_clearly(tmp_path, models_dir):
    from evertrain.runtime import Runtime

    config = smoke_config_in(tmp_path, models_dir, name="twice")
    with Runtime.open(config), pytest.raises(StoreError, match="already open in this process"):
        Runtime.open(config)
    with Runtime.open(config) as again:  # closed: it may be opened again
        assert again.store.campaign_state("twice") is None


def test_campaign_flow_opens_one_context_passes_it_on_and_closes_it(tmp_path, models_dir, prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    from evertrain.flows.campaign import campaign_flow

    config = smoke_config_in(tmp_path, models_dir, name="ctx-flow", problems_per_iteration=4, group_size=4,
                             environments=[{"name": "digits", "weight": 1}], eval={"problems_per_env": 4})
    assert campaign_flow(config, 1) == [0]
    # nothing of the campaign is left open in this process: another writer may claim it at once
    assert _claim_is_free(config.paths.store, config.name)
    with Store(config.paths.store, read_only=True) as store:
        runs = store.query("SELECT stage, status, flow_run_id FROM stage_runs WHERE campaign = ?", [config.name])
    assert set(runs["status"]) == {"completed"} and len(runs) == 6
    # every stage ran inside the one iteration subflow, whose parent run still shows the config (the UI's form)
    [iteration_run] = set(runs["flow_run_id"])
    with get_client(sync_client=True) as client:
        child = client.read_flow_run(iteration_run)
        parent = client.read_flow_run(client.read_task_run(child.parent_task_run_id).flow_run_id)
        assert parent.parameters["config"]["name"] == config.name
        assert child.parameters["rt"] == "<Runtime>" and child.name == f"{config.name}-iteration-0"
        assert f"campaign:{config.name}" in child.tags  # what names its campaign (evertrain approve finds it so)
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id])))
        assert [c.id for c in children] == [child.id]


def test_a_failed_campaign_flow_closes_its_context(tmp_path, models_dir, prefect_server):
    from evertrain.flows.campaign import campaign_flow
    from evertrain.inference.base import BackendError

    # a vLLM interpreter that does not exist: refused by the flow after it opened its context
    config = smoke_config_in(tmp_path, models_dir, name="ctx-fail",
                             generation={"backend": "vllm", "vllm_python": str(tmp_path / "no-python")})
    with pytest.raises(BackendError, match="vllm_python"):
        campaign_flow(config, 1)
    assert _claim_is_free(config.paths.store, config.name)


def test_the_champion_is_the_stores_whatever_mlflows_alias_says(tmp_path, models_dir):
    from evertrain.data.store import now
    from evertrain.models.checkpoint import write_base_checkpoint
    from evertrain.runtime import Runtime
    from evertrain.tasks.promote import rollback

    config = smoke_config_in(tmp_path, models_dir, name="lineage", environments=[{"name": "digits", "weight": 1}])
    with Runtime.open(config) as rt:
        rt.ensure_started()
        base = rt.champion_version()
        other = write_base_checkpoint(tmp_path / "checkpoints" / "other", rt.base_model)
        version = rt.tracker.register(other, run_id=None, iteration=0)
        rt.store.replace("model_versions", {"campaign": "lineage", "version": version}, [{
            "campaign": "lineage", "version": version, "iteration": 0, "kind": "full", "path": rt.stored_path(other),
            "parent_version": base, "created_at": now()}])
        rt.tracker.set_alias("champion", version)  # moved by hand: the store recorded no such event
        assert rt.champion_version() == base and rt.previous_champion_version() is None
        rt.store.record_rollback("lineage", base, version, "by hand, in the store")
        rt.tracker.set_alias("champion", base)  # now stale the other way
        assert (rt.champion_version(), rt.previous_champion_version()) == (version, base)
        rt.tracker.client.delete_registered_model_alias(rt.tracker.model_name, "champion")  # and missing
        assert rt.champion_version() == version
        # a rollback without a target goes to the store's previous champion, not to MLflow's alias, and projects it
        rt.tracker.set_alias("previous_champion", version)
        assert rollback(rt)["champion"] == base
        assert rt.champion_version() == base and rt.tracker.alias("champion") == base


def test_a_vllm_sampler_needs_an_owner_for_its_engine(tmp_path, models_dir):
    from evertrain.inference.backends import open_sampler
    from evertrain.inference.base import BackendError
    from evertrain.inference.campaign import InferenceClosed
    from evertrain.inference.vllm_sampler import Engines
    from evertrain.models.checkpoint import write_base_checkpoint
    from evertrain.runtime import Runtime

    config = smoke_config_in(tmp_path, models_dir, name="owner",
                             generation={"backend": "vllm", "vllm_python": str(tmp_path / "no-python")})
    base = write_base_checkpoint(tmp_path / "base", str(models_dir / "tiny-llama"))
    with pytest.raises(BackendError, match="engines="):  # no process-wide engine to fall back on
        open_sampler(config, base)
    engines = Engines()
    with pytest.raises(BackendError, match="vllm_python"):  # with an owner: refused as before, nothing started
        open_sampler(config, base, engines)
    assert len(engines) == 0
    rt = Runtime.open(config)
    # nothing is started until a stage asks
    assert rt.inference.started_engines is None and rt.inference.pool is None and rt.graders is None
    owned = rt.inference.engines
    rt.close()
    assert rt.inference.started_engines is None and len(owned) == 0
    with pytest.raises(InferenceClosed, match="is closed"):
        _ = rt.inference.engines


def test_a_closed_context_leaves_lent_engines_running_and_stops_its_own(tmp_path, models_dir, monkeypatch):
    from evertrain.inference import campaign
    from evertrain.inference.vllm_sampler import Engines
    from evertrain.runtime import Runtime

    class Recorded(Engines):
        """Real engines (none started: whether they were stopped is what this test asks) that record a stop."""

        def __init__(self) -> None:
            super().__init__()
            self.stopped = 0

        def close(self) -> None:
            self.stopped += 1
            super().close()

    config = smoke_config_in(tmp_path, models_dir, name="engines")
    lent = Recorded()
    rt = Runtime.open(config, engines=lent)
    # the stages sample on the lent engines
    assert rt.inference.engines is lent and rt.inference.started_engines is lent
    rt.close()
    assert lent.stopped == 0  # borrowed, as a store can be: its lender stops it
    with Runtime.open(config, engines=lent) as again:  # and another context may borrow it next
        assert again.inference.engines is lent
    assert lent.stopped == 0
    monkeypatch.setattr(campaign, "Engines", Recorded)  # what the context starts itself, recorded the same way
    with Runtime.open(config) as rt:
        owned = rt.inference.engines
        assert isinstance(owned, Recorded) and owned is not lent
    assert owned.stopped == 1 and lent.stopped == 0


def test_an_endpoint_borrows_the_store_it_is_given_and_closes_only_its_own(tmp_path, models_dir):
    from evertrain.runtime import Runtime
    from evertrain.serving.app import Endpoint

    config = smoke_config_in(tmp_path, models_dir, name="lender")
    with Runtime.open(config) as rt:
        rt.ensure_started()
        borrowing = Endpoint(config, rt.store)
        assert borrowing.store is rt.store
        borrowing.stop()
        assert rt.store.campaign_state("lender") is not None  # still open: the endpoint closed nothing of the context's
        owning = Endpoint(config)
        assert owning.store is not rt.store
        owning.stop()
        with pytest.raises(Exception, match="closed"):
            owning.store.query("SELECT 1")
