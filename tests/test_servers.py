"""The team set-up for real: PostgreSQL started by the test, a Prefect server and an MLflow tracking server on
it, the store's DuckLake catalog in it, a process work pool and `prefect worker start`. A run triggered through
the API with the typed campaign config (what the UI's form sends) is picked up by the worker and completes; a
worker killed mid-stage leaves nothing that the next run duplicates or loses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from evertrain import services
from evertrain.data.store import Store
from tests.conftest import smoke_config_in

pytestmark = pytest.mark.skipif(not (services.PG_BIN / "postgres").exists(),
                                reason="PostgreSQL is not installed (apt-get install postgresql; .ci/run does)")


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    # under /tmp itself: as root, PostgreSQL runs as the postgres user, who cannot enter pytest's 0700 tmp folders
    root = Path(tempfile.mkdtemp(prefix="evertrain-services-"))
    try:
        yield services.start(root)
    finally:
        services.remove(root)


def _team_config(directory: Path, models_dir: Path, servers: dict[str, Any], name: str) -> Any:
    config = smoke_config_in(directory, models_dir, name=name)
    data = config.model_dump()
    data["paths"]["store"] = servers["env"]["EVERTRAIN_STORE"]
    data["paths"]["mlflow_uri"] = servers["env"]["MLFLOW_TRACKING_URI"]
    return type(config).model_validate(data).resolved()


def _env(servers: dict[str, Any], home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("EVERTRAIN_KILL_AT", "PREFECT_API_URL")}
    env.update(servers["env"], PREFECT_HOME=str(home), EVERTRAIN_PROGRESS="0", PREFECT_WORKER_QUERY_SECONDS="1",
               PREFECT_WORKER_PREFETCH_SECONDS="5", **extra)
    return env


def _start_worker(pool: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    prefect = Path(sys.executable).with_name("prefect")
    with open(log, "ab") as out:
        return subprocess.Popen([str(prefect), "worker", "start", "--pool", pool, "--type", "process"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_worker(worker: subprocess.Popen) -> None:
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)


def _trigger(client: Any, deployment_id: Any, config: Any, env: dict[str, str] | None = None) -> Any:
    """What the UI's "Run" form does: a flow run of the deployment with the typed config as its parameter
    (and, for the run to be killed, the fault-injection variable in its process's environment)."""
    run = client.create_flow_run_from_deployment(
        deployment_id, parameters={"config": config.model_dump(mode="json"), "iterations": 1},
        job_variables={"env": env} if env else None)
    return run.id


def _wait_final(client: Any, run_id: Any, worker: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.read_flow_run(run_id).state
        if state is not None and state.is_final():
            return state.type.value
        assert worker.poll() is None, f"the worker exited ({worker.returncode}):\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"flow run {run_id} not finished after {timeout} s; worker log:\n{log.read_text()[-3000:]}")


def _store_rows(uri: str, campaign: str) -> dict[str, Any]:
    store = Store(uri, read_only=True)
    try:
        rollouts = store.query("SELECT iteration, count(*) AS n, count(DISTINCT (problem_id, sample)) AS keys, "
                               "count(reward) AS scored FROM rollouts WHERE campaign = ? GROUP BY ALL ORDER BY ALL",
                               [campaign])
        stages = store.query("SELECT iteration, stage, status FROM stage_runs WHERE campaign = ? ORDER BY ALL",
                             [campaign])
        promotions = int(store.scalar("SELECT count(*) FROM promotions WHERE campaign = ?", [campaign]))
    finally:
        store.close()
    return {"rollouts": [tuple(int(v) for v in row) for row in rollouts.itertuples(index=False)],
            "stages": {(int(r.iteration), r.stage): r.status for r in stages.itertuples(index=False)},
            "promotions": promotions}


def _mlflow_runs(servers: dict[str, Any], campaign: str) -> list[str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=servers["env"]["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(f"evertrain/{campaign}")
    if experiment is None:
        return []
    # the iterations' runs (the base model's files are logged through the server by a run of their own)
    return [r.info.status for r in client.search_runs([experiment.experiment_id])
            if "evertrain.iteration" in r.data.tags]


def _run_on_a_worker(client: Any, deployment_id: Any, config: Any, pool: str, env: dict[str, str],
                     log: Path) -> str:
    """Start a worker, trigger one run of the deployment, wait for its final state, kill the worker."""
    worker = _start_worker(pool, env, log)
    try:
        return _wait_final(client, _trigger(client, deployment_id, config), worker, log)
    finally:
        _kill_worker(worker)


def test_worker_runs_a_triggered_iteration_then_resumes_after_sigkill(servers, models_dir, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from evertrain.flows.deploy import deploy

    config = _team_config(tmp_path, models_dir, servers, "team")
    pool, home, log = "evertrain-test", tmp_path / "prefect-home", tmp_path / "worker.log"
    home.mkdir()
    with temporary_settings({PREFECT_API_URL: servers["env"]["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        [deployment_id] = deploy([config], pool=pool)
        deployment = client.read_deployment(deployment_id)
        assert deployment.work_pool_name == pool and deployment.global_concurrency_limit.limit == 1
        assert "config" in deployment.parameter_openapi_schema["properties"]  # the UI's typed form

        # 1. a worker picks up a triggered run and completes a whole iteration against the servers;
        # 2. the next run's flow-run process (on the same worker: one worker start the less) is SIGKILLed
        # inside the score stage's write, then the worker too
        worker = _start_worker(pool, _env(servers, home), log)
        try:
            state = _wait_final(client, _trigger(client, deployment_id, config), worker, log)
            assert state == "COMPLETED", log.read_text()[-3000:]
            first = _store_rows(config.paths.store, "team")
            assert first["rollouts"] == [(0, 32, 32, 32)]
            assert set(first["stages"].values()) == {"completed"} and len(first["stages"]) == 6
            assert _mlflow_runs(servers, "team") == ["FINISHED"]

            state = _wait_final(client, _trigger(client, deployment_id, config,
                                                 {"EVERTRAIN_KILL_AT": "score:before_commit"}), worker, log)
        finally:
            _kill_worker(worker)
        assert state in ("CRASHED", "FAILED"), state
        killed = _store_rows(config.paths.store, "team")
        assert killed["stages"][(1, "score")] == "running"
        assert killed["rollouts"] == [(0, 32, 32, 32), (1, 32, 32, 0)]  # the killed score wrote nothing

        # 3. a fresh worker's run resumes iteration 1 at score: nothing lost, nothing duplicated
        assert _run_on_a_worker(client, deployment_id, config, pool, _env(servers, home), log) == "COMPLETED", \
            log.read_text()[-3000:]
    final = _store_rows(config.paths.store, "team")
    assert final["rollouts"] == [(0, 32, 32, 32), (1, 32, 32, 32)]
    assert set(final["stages"].values()) == {"completed"} and len(final["stages"]) == 12
    assert final["promotions"] == 2
    assert sorted(_mlflow_runs(servers, "team")) == ["FINISHED", "FINISHED"]  # iteration 1's run was continued
    # the MLflow server runs without MLflow 3's job runner (seven huey_consumer processes evertrain never uses)
    assert not [p.pid for p in psutil.Process(servers["mlflow"]["pid"]).children(recursive=True)
                if "huey" in " ".join(p.cmdline())]
    # the data files live under the shared data path, the catalog in PostgreSQL
    lake = Path(servers["env"]["EVERTRAIN_STORE"].partition("?data_path=")[2])
    assert any(lake.rglob("*.parquet"))
    shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
