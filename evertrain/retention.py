"""Checkpoint retention: a never-ending campaign must not fill the disk.

After each promote decision, every model version's checkpoint is deleted (working copy under
``paths.checkpoints``, logged artifacts under MLflow, and the registry entry) unless it is one of:
the champion, the previous champion, the challenger (what the store's lineage says; MLflow's aliases are its
projection), the trainee and its parents
within ``update.max_staleness`` (async mode and replay still read them), a base version (it is a
manifest of a few bytes), or one of the last ``retention.keep_challengers`` challengers. The
``model_versions`` rows stay, with an empty path and a ``deleted`` kind suffix, so lineage and reports
still name every version.
"""

from __future__ import annotations

import logging
import shutil
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

from evertrain.data.lineage import aliases
from evertrain.portable import resolve_under
from evertrain.runtime import Runtime

log = logging.getLogger("evertrain")


def protected_versions(rt: Runtime) -> set[int]:
    """Versions retention must never delete: the champion, the one before it and the challenger, as the store's
    lineage says (MLflow's aliases are only its projection), and the trainee's recent ancestors."""
    keep = {v for v in aliases(rt.store, rt.campaign).values() if v is not None}
    state = rt.store.campaign_state(rt.campaign)
    trainee = None if state is None or pd.isna(state["trainee_version"]) else int(state["trainee_version"])
    if trainee is not None:
        keep |= set(rt.store.ancestors(rt.campaign, trainee, rt.config.update.max_staleness))
    return keep


def apply_retention(rt: Runtime) -> dict[str, Any]:
    """Delete the checkpoints retention does not keep; returns what was kept and deleted."""
    k = rt.config.retention.keep_challengers
    if k is None:
        return {"deleted_versions": [], "kept_versions": []}
    versions = rt.store.model_versions(rt.campaign)
    live = versions[~versions["kind"].str.endswith("-deleted") & (versions["kind"] != "base")]
    keep = protected_versions(rt) | set(int(v) for v in live["version"].tolist()[-k:] if k)
    deleted = []
    for row in live.itertuples(index=False):
        version = int(row.version)
        if version in keep:
            continue
        _delete_checkpoint(rt, version, row.path)
        deleted.append(version)
    if deleted:
        log.info("retention: deleted the checkpoints of v%s", ", v".join(map(str, deleted)))
    return {"deleted_versions": deleted, "kept_versions": sorted(keep)}


def _delete_checkpoint(rt: Runtime, version: int, path: str | None) -> None:
    if isinstance(path, str) and path:
        shutil.rmtree(resolve_under(path, rt.checkpoints_root()), ignore_errors=True)
    try:
        source = rt.tracker.client.get_model_version(rt.tracker.model_name, str(version)).source
    except MlflowException:  # already gone from the registry (an earlier, interrupted retention pass)
        source = None
    if source:
        try:
            get_artifact_repository(source).delete_artifacts()
        except (OSError, MlflowException, NotImplementedError) as error:
            log.warning("retention: could not delete the MLflow artifacts of v%d at %s: %s", version, source, error)
        rt.tracker.delete_version(version)
    # the row stays (lineage, reports), marked so nothing tries to load it
    rt.store.replace("model_versions", {"campaign": rt.campaign, "version": version}, [{
        **rt.store.model_version(rt.campaign, version), "path": "",
        "kind": f"{rt.store.model_version(rt.campaign, version)['kind']}-deleted"}])
