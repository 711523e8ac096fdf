"""Checkpoint retention deletes old challengers from disk, MLflow artifacts and the registry, never alias targets."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.utils.file_utils import local_file_uri_to_path

from evertrain.data.store import StoreError
from evertrain.models.checkpoint import load_policy
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, STAGES, run_stage
from evertrain.tasks.promote import rollback
from tests.conftest import smoke_config_in


def test_retention_keeps_aliases_and_deletes_the_rest(tmp_path, models_dir):
    # a gate that never promotes (a gain of 1.0 is impossible): the base stays champion, challengers pile up
    config = smoke_config_in(tmp_path, models_dir, name="retention", problems_per_iteration=4, group_size=4,
                             environments=[{"name": "digits", "weight": 1}],
                             promotion={"min_gain": 1.0, "confidence": 0.5, "bootstrap_samples": 200},
                             retention={"keep_challengers": 0})
    rt = Runtime.open(config)
    for iteration in (0, 1):
        for stage in STAGES:
            run_stage(rt, stage, iteration, STAGE_FUNCTIONS[stage])
            if (iteration, stage) == (0, "update"):
                first = rt.checkpoint(2)
                first_source = rt.tracker.client.get_model_version(rt.tracker.model_name, "2").source
    assert rt.tracker.alias("champion") == 1 and rt.tracker.alias("challenger") == 3

    # v2 is no alias target, not the trainee, and K = 0: gone from disk, MLflow's artifacts and the registry
    assert not first.exists()
    assert Path(local_file_uri_to_path(first_source)).parent.exists()  # the run's artifact folder is still there
    assert not Path(local_file_uri_to_path(first_source)).exists()
    names = {int(v.version) for v in rt.tracker.client.search_model_versions(f"name = '{rt.tracker.model_name}'")}
    assert names == {1, 3}
    row = rt.store.model_version(rt.campaign, 2)
    assert row["kind"] == "lora-deleted" and row["path"] == ""
    with pytest.raises(StoreError, match="deleted by checkpoint retention"):
        rollback(rt, 2)
    # every alias target still loads, from the working copy and from MLflow
    for version in (1, 3):
        load_policy(rt.checkpoint(version), trainable=False, device="cpu")
        assert (rt.tracker.download(version) / "evertrain_checkpoint.json").exists()
    rt.close()


def test_retention_off_keeps_everything(tmp_path, models_dir):
    from evertrain.retention import apply_retention

    config = smoke_config_in(tmp_path, models_dir, name="keepall", problems_per_iteration=4, group_size=4,
                             environments=[{"name": "digits", "weight": 1}], retention={"keep_challengers": None})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score", "update"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    assert apply_retention(rt) == {"deleted_versions": [], "kept_versions": []}
    assert rt.checkpoint(2).exists()
    rt.close()
