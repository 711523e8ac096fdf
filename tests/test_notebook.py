"""The notebook reruns a stage of a finished iteration and queries its rows; it must run clean."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, STAGES, run_stage
from tests.conftest import smoke_config_in

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "rerun_a_stage.ipynb"


def test_notebook_reruns_a_stage(tmp_path, models_dir, monkeypatch):
    config = smoke_config_in(tmp_path, models_dir)
    rt = Runtime.open(config)
    for stage in STAGES:  # a finished iteration, made without Prefect (the notebook does the rest)
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    before = rt.store.counts()
    rt.close()  # the notebook's kernel is another process: let it open the DuckDB file

    config_file = tmp_path / "campaign.json"
    config_file.write_text(json.dumps(config.model_dump(mode="json")))
    monkeypatch.setenv("EVERTRAIN_CONFIG", str(config_file))
    monkeypatch.setenv("EVERTRAIN_STAGE", "rollout")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()

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
