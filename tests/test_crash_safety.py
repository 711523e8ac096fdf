"""SIGKILL in the middle of any stage, run again, and every table holds the rows of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from evertrain.data.store import Store
from evertrain.tasks import STAGES
from tests.conftest import smoke_config_in


def _run(config_file: Path, cwd: Path, api_url: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": api_url, "EVERTRAIN_PROGRESS": "0"}
    env.pop("EVERTRAIN_KILL_AT", None)
    if kill_at:
        env["EVERTRAIN_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "evertrain.cli", "run", "--config", str(config_file),
                           "--iterations", "1"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _snapshot(store_path: Path) -> dict[str, list[tuple]]:
    store = Store(store_path, read_only=True)
    try:
        queries = {
            "problems": "SELECT iteration, problem_id, env FROM problems",
            "rollouts": "SELECT iteration, problem_id, sample, policy_version, completion, reward, passed "
                        "FROM rollouts",
            "evals": "SELECT iteration, role, problem_id, sample, completion, reward FROM evals",
            "promotions": "SELECT iteration, promoted, challenger_pass1, champion_pass1 FROM promotions",
            "stage_runs": "SELECT iteration, stage, status FROM stage_runs",
            "model_versions": "SELECT iteration, kind FROM model_versions",
        }
        return {name: sorted(map(tuple, store.query(sql).itertuples(index=False))) for name, sql in queries.items()}
    finally:
        store.close()


@pytest.fixture(scope="module")
def api_url(prefect_server) -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _campaign(directory: Path, models_dir: Path) -> Path:
    config = smoke_config_in(directory, models_dir, name="crash")
    path = directory / "campaign.json"
    path.write_text(json.dumps(config.model_dump(mode="json")))
    return path


def test_kill_in_every_stage_then_resume(tmp_path, models_dir, api_url):
    reference_dir, crashed_dir = tmp_path / "reference", tmp_path / "crashed"
    reference_dir.mkdir()
    crashed_dir.mkdir()
    result = _run(_campaign(reference_dir, models_dir), reference_dir, api_url)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = _snapshot(reference_dir / "evertrain.duckdb")

    config_file = _campaign(crashed_dir, models_dir)
    # each run resumes the stages the previous one finished and dies inside the next one's write
    for stage in STAGES:
        result = _run(config_file, crashed_dir, api_url, kill_at=f"{stage}:before_commit")
        assert result.returncode == -signal.SIGKILL, (stage, result.returncode, result.stderr[-3000:])
        status = {row[1]: row[2] for row in _snapshot(crashed_dir / "evertrain.duckdb")["stage_runs"]}
        assert status[stage] == "running", (stage, status)
    result = _run(config_file, crashed_dir, api_url)
    assert result.returncode == 0, result.stderr[-3000:]

    assert _snapshot(crashed_dir / "evertrain.duckdb") == expected

    # the iteration's MLflow run was continued, not duplicated, and is not left running
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{crashed_dir / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("evertrain/crash")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"]
    # the killed update's orphan registration was cleaned up: base + one challenger
    versions = client.search_model_versions("name = 'evertrain-crash'")
    assert len(versions) == 2, [v.version for v in versions]
    assert mlflow.get_tracking_uri()  # mlflow imported and usable in this process
