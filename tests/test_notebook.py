"""The notebook reruns a stage of a finished iteration and queries its rows; it must run clean."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from evertrain.config import ConfigError, load_config, project_home
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, STAGES, run_stage
from tests.conftest import smoke_config_in

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "rerun_a_stage.ipynb"


def _files(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


def test_project_home_is_the_checkout_above_the_working_directory(tmp_path, monkeypatch):
    root = Path(__file__).resolve().parents[1]
    monkeypatch.delenv("EVERTRAIN_HOME", raising=False)
    assert project_home(root / "notebooks") == root
    assert project_home(tmp_path) == tmp_path.resolve()  # outside any checkout: the working directory
    monkeypatch.setenv("EVERTRAIN_HOME", str(tmp_path))
    assert project_home(root / "notebooks") == tmp_path.resolve()


def test_relative_config_and_state_resolve_against_the_home_from_anywhere(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.toml").write_text('name = "mine"\n[paths]\nstore = "data/lake.sqlite"\n')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("EVERTRAIN_HOME", str(tmp_path))
    config = load_config("configs/mine.toml")
    assert config.paths.store == str(tmp_path / "data" / "lake.sqlite")
    assert config.paths.checkpoints == str(tmp_path / "state" / "checkpoints")
    monkeypatch.chdir(tmp_path)  # at home the paths stay as written
    assert load_config("configs/mine.toml").paths.store == "data/lake.sqlite"
    monkeypatch.delenv("EVERTRAIN_HOME")
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=r"configs/mine.toml does not exist \(looked in"):
        load_config("configs/mine.toml")


def test_notebook_reruns_a_stage(tmp_path, models_dir, monkeypatch):
    """Run as Jupyter runs it: the kernel in notebooks/, the config relative to the project home."""
    home = tmp_path / "home"
    config = smoke_config_in(home, models_dir)
    rt = Runtime.open(config)
    for stage in STAGES:  # a finished iteration, made without Prefect (the notebook does the rest)
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    before = rt.store.counts()
    rt.close()  # the notebook's kernel is another process: let it open the DuckDB file

    data = config.model_dump(mode="json")  # the state's paths relative, as a user writes them
    data["paths"] = {key: value.replace(f"{home}/", "") for key, value in data["paths"].items()}
    assert all(str(home) not in value for value in data["paths"].values())
    (home / "configs").mkdir()
    (home / "configs" / "campaign.json").write_text(json.dumps(data))
    monkeypatch.setenv("EVERTRAIN_HOME", str(home))
    monkeypatch.setenv("EVERTRAIN_CONFIG", "configs/campaign.json")
    monkeypatch.setenv("EVERTRAIN_STAGE", "rollout")
    beside = _files(NOTEBOOK.parent)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    assert _files(NOTEBOOK.parent) <= beside | {".ipynb_checkpoints"}, "the notebook wrote beside itself"

    outputs = "".join(str(o.get("text", "")) + json.dumps(o.get("data", {}))
                      for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "rerunning rollout of iteration 0" in outputs
    assert "mean_reward" in outputs
    rt = Runtime.open(config)
    assert rt.store.counts() == before
    # the rerun really happened: the rollout stage's record is newer than the others
    times = rt.store.query("SELECT stage, finished_at FROM stage_runs WHERE iteration = 0").set_index("stage")
    assert times.loc["rollout", "finished_at"] > times.loc["promote", "finished_at"]
    # what the notebook displayed is what the rerun stored (its metrics cell shows the stage's own numbers)
    stored = json.loads(rt.store.scalar("SELECT metrics FROM stage_runs WHERE iteration = 0 AND stage = 'rollout'"))
    assert f"'completion_tokens': {stored['completion_tokens']}" in outputs
    rt.close()
