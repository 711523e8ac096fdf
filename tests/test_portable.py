"""A campaign's state moves: copy data/, mlflow/ and state/ elsewhere, delete the original, and the campaign
continues there (checkpoints, manifests, MLflow artifact locations and optimizer state all follow)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from evertrain.config import PathsConfig, load_config
from evertrain.data.store import Store
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from tests.conftest import ROOT, smoke_config_in

STATE = ("data", "mlflow", "state", "campaign.json")


def _run(cwd: Path, api_url: str, preloaded) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": api_url, "EVERTRAIN_PROGRESS": "0"}
    # the defaults under test are the relative ones: earlier tests' mlflow.set_tracking_uri() exports
    # MLFLOW_TRACKING_URI, which the config would otherwise (rightly) take as the user's choice
    for name in ("EVERTRAIN_KILL_AT", "MLFLOW_TRACKING_URI", "EVERTRAIN_STORE"):
        env.pop(name, None)
    # forked from a process that has imported what a run imports (tests/preloaded.py): a process of its own,
    # in ``cwd``, without 12 CPU-seconds of imports
    return preloaded(env).run(["run", "--config", "campaign.json", "--iterations", "1"], cwd=cwd, env=env,
                              timeout=600)


def _relative_campaign(directory: Path) -> None:
    """The smoke campaign with the default, relative paths (data/, mlflow/, state/) and a small mix."""
    data = load_config(ROOT / "configs" / "smoke.toml").model_dump(mode="json")
    data.update(name="moved", problems_per_iteration=4, group_size=4,
                environments=[{"name": "digits", "weight": 1}])
    data["model"]["models_dir"] = "state/models"
    data.pop("paths")  # the defaults: relative to the working directory
    (directory / "campaign.json").write_text(json.dumps(data))


@pytest.fixture(scope="module")
def api_url(prefect_server) -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def test_moved_campaign_continues(tmp_path, api_url, monkeypatch, preloaded):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("EVERTRAIN_STORE", raising=False)
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    _relative_campaign(first)
    result = _run(first, api_url, preloaded)
    assert result.returncode == 0, result.stderr[-3000:]

    second.mkdir()
    for name in STATE:
        source = first / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, second / name)
    shutil.rmtree(first)  # anything still pointing at the old folder now fails loudly

    result = _run(second, api_url, preloaded)
    assert result.returncode == 0, result.stderr[-3000:]
    old = str(first)
    # a line as the iteration ends (reward, groups with signal, the gate with its interval, cost), and a final
    # table that fits 100 columns
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("iteration 1 | reward ")]
    assert len(line) <= 100 and re.search(r"\| signal \d+% \|", line), line
    assert re.search(r"\| gate [-+]\d\.\d{3} \[", line) and re.search(r"\| \d+ s, cpu \d+ s$", line), line
    assert "| INFO    |" not in result.stderr, "Prefect's INFO lines on the terminal (evertrain run --verbose only)"
    table = [line for line in result.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert len(table) >= 5 and max(len(line) for line in table) <= 100, result.stdout

    monkeypatch.chdir(second)  # the store's default URI is relative to the working directory
    store = Store(PathsConfig().store, read_only=True)
    try:
        stages = store.query("SELECT iteration, status FROM stage_runs WHERE campaign = 'moved'")
        versions = store.query("SELECT version, iteration, kind, path FROM model_versions ORDER BY version")
        configs = store.query("SELECT config FROM campaigns")["config"].tolist()
    finally:
        store.close()
    # iteration 0 was kept, iteration 1 ran in the new folder, every stage of both completed
    assert sorted(stages["iteration"].tolist()) == [0] * 6 + [1] * 6
    assert set(stages["status"]) == {"completed"}
    assert versions["kind"].tolist() == ["base", "lora", "lora"]
    for path in versions["path"]:
        assert not Path(path).is_absolute(), path
        assert (second / "state" / "checkpoints" / path).is_dir(), path
    assert not any(old in c for c in configs)
    for manifest in (second / "state" / "checkpoints").rglob("evertrain_checkpoint.json"):
        base = json.loads(manifest.read_text())["base_model"]
        assert base == "state/models/tiny-llama", (manifest, base)

    from mlflow import MlflowClient

    uri = f"sqlite:///{second / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.get_experiment_by_name("evertrain/moved")
    new_root = (second / "mlflow" / "artifacts").as_uri()
    assert experiment.artifact_location.startswith(new_root)
    runs = client.search_runs([experiment.experiment_id])  # the campaign's run and its two iterations' runs
    assert len(runs) == 3 and all(r.info.artifact_uri.startswith(new_root) for r in runs)
    model_versions = client.search_model_versions("name = 'evertrain-moved'")
    assert len(model_versions) == 3
    assert all(v.source.startswith(new_root) and old not in v.source for v in model_versions)
    # the optimizer state was registered with the weights, and iteration 1 continued from it
    challenger = client.get_model_version("evertrain-moved", "2")
    logged = [a.path for a in client.list_artifacts(challenger.run_id, "checkpoint")]
    assert "checkpoint/optimizer.pt" in logged
    second_run = next(r for r in runs if r.data.tags["evertrain.iteration"] == "1")
    assert second_run.data.tags["update.optimizer_state"] == "restored"
    assert second_run.data.metrics["update/optimizer_restored"] == 1.0


def test_unrestorable_optimizer_state_is_reported(tmp_path, models_dir, caplog):
    config = smoke_config_in(tmp_path, models_dir, name="optimizer", problems_per_iteration=4, group_size=4,
                             environments=[{"name": "digits", "weight": 1}])
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score", "update"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    # v2's optimizer state no longer fits its parameters (as after a change of LoRA rank)
    torch.save({"state": {0: {}}, "param_groups": []}, rt.checkpoint(2) / "optimizer.pt")
    with caplog.at_level(logging.WARNING, logger="evertrain"):
        for stage in ("curate", "rollout", "score", "update"):
            metrics = run_stage(rt, stage, 1, STAGE_FUNCTIONS[stage])
    assert metrics["optimizer_restored"] == 0.0
    assert "optimizer state not restored" in caplog.text
    tags = rt.tracker.client.get_run(rt.tracker.run_id(1)).data.tags
    assert tags["update.optimizer_state"].startswith("fresh: v2's optimizer state does not fit")
    assert rt.tracker.client.get_run(rt.tracker.run_id(0)).data.tags["update.optimizer_state"] == "fresh: base model"
    rt.close()
