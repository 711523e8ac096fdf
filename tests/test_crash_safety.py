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
from tests.conftest import smoke_config_in, store_uri

POINTS = ("start", "before_commit", "end")  # every point evertrain.faults.maybe_kill is called with


def _command(config_file: Path, api_url: str, kill_at: str | None = None) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PREFECT_API_URL": api_url, "EVERTRAIN_PROGRESS": "0"}
    env.pop("EVERTRAIN_KILL_AT", None)
    if kill_at:
        env["EVERTRAIN_KILL_AT"] = kill_at
    return [sys.executable, "-m", "evertrain.cli", "run", "--config", str(config_file), "--iterations", "1"], env


def _run(config_file: Path, cwd: Path, api_url: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    command, env = _command(config_file, api_url, kill_at)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _snapshot(store_path: str) -> dict[str, list[tuple]]:
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


def test_kill_in_every_stage_then_resume(tmp_path, models_dir, api_url, preloaded):
    reference_dir, crashed_dir = tmp_path / "reference", tmp_path / "crashed"
    reference_dir.mkdir()
    crashed_dir.mkdir()
    command, env = _command(_campaign(reference_dir, models_dir), api_url)
    # the reference and the killed runs are forked from a process that has imported what a run imports
    # (tests/preloaded.py): each a process of its own, killed for real, without 12 CPU-seconds of imports;
    # the resume at the end is a plain `python -m evertrain.cli run`, its start-up included
    preloader = preloaded(env)
    # the uninterrupted reference runs beside the killed runs (its own store, MLflow and checkpoints); output
    # to a file, as a pipe nobody reads could fill and stall it
    reference = preloader.start(command[3:], cwd=reference_dir, env=env, stdout=reference_dir / "run.log")
    try:
        config_file = _campaign(crashed_dir, models_dir)
        args, _ = _command(config_file, api_url)
        # each run resumes the stages the previous one finished and dies in the next one, at each fault-injection
        # point in turn: as it starts, inside its first write before the commit, after its work is stored
        for stage, point in zip(STAGES, POINTS * 2, strict=True):
            result = preloader.run(args[3:], cwd=crashed_dir, env={**env, "EVERTRAIN_KILL_AT": f"{stage}:{point}"},
                                   timeout=300)
            assert result.returncode == -signal.SIGKILL, (stage, point, result.returncode, result.stderr[-3000:])
            status = {row[1]: row[2] for row in _snapshot(store_uri(crashed_dir))["stage_runs"]}
            assert status[stage] == "running", (stage, status)
        result = _run(config_file, crashed_dir, api_url)
        assert result.returncode == 0, result.stderr[-3000:]
    except BaseException:  # a failed assertion above must not leave the reference running
        preloader.wait(reference, timeout=0)  # killed, if still running
        raise
    assert preloader.wait(reference, timeout=300) == 0, (reference_dir / "run.log").read_text()[-3000:]
    expected = _snapshot(store_uri(reference_dir))
    assert _snapshot(store_uri(crashed_dir)) == expected

    # the iteration's MLflow run was continued, not duplicated, and is not left running
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{crashed_dir / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("evertrain/crash")
    runs = [r for r in client.search_runs([experiment.experiment_id]) if "evertrain.iteration" in r.data.tags]
    assert [r.info.status for r in runs] == ["FINISHED"]
    # the killed update's orphan registration was cleaned up: base + one challenger
    versions = client.search_model_versions("name = 'evertrain-crash'")
    assert len(versions) == 2, [v.version for v in versions]
    # the surviving challenger is complete in MLflow: weights, manifest and the optimizer state it continues from
    challenger = client.get_model_version_by_alias("evertrain-crash", "challenger")
    logged = Path(mlflow.artifacts.download_artifacts(artifact_uri=challenger.source))
    assert {"evertrain_checkpoint.json", "adapter_model.safetensors", "optimizer.pt"} <= \
        {p.name for p in logged.iterdir()}


def test_every_fault_injection_point_is_exercised():
    """The kill test above must cover every point the code can be killed at: a new point fails this."""
    import re

    root = Path(__file__).resolve().parents[1]
    used: set[str] = set()
    for source in [*root.glob("tasks/*.py"), *root.glob("evertrain/**/*.py"), *root.glob("flows/*.py"),
                   *root.glob("models/*.py")]:
        text = source.read_text()
        used |= set(re.findall(r'maybe_kill\("(\w+)"\)', text))
        used |= set(re.findall(r'faults_point: str \| None = "(\w+)"', text))
    assert used == set(POINTS), f"fault-injection points in the code {sorted(used)} vs exercised {POINTS}"
