"""Lineage: the store is its authority (one transaction per event), MLflow's aliases a projection of it.

A registration (the version and the trainee), a gate's decision (and a reset trainee) and a rollback (and the
trainee) each commit once, or not at all; :meth:`Tracker.project_lineage` points ``champion`` and
``previous_champion`` where the store's events say, and repairs them when run again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from evertrain.data.store import Store
from evertrain.tracking import Tracker
from tests.conftest import smoke_config_in

ROOT = Path(__file__).resolve().parents[1]


def _decision(challenger: int, champion: int, promoted: bool, stamp: str) -> dict:
    return {"challenger_version": challenger, "champion_version": champion, "promoted": promoted,
            "challenger_pass1": 0.5, "champion_pass1": 0.4, "reason": "test", "reset_trainee": False,
            "decided_at": stamp}


def _trainee(store: Store, campaign: str) -> int:
    return int(store.campaign_state(campaign)["trainee_version"])


def test_each_lineage_event_is_one_transaction_and_the_champion_follows_the_events(tmp_path: Path) -> None:
    store = Store(f"ducklake:sqlite:{tmp_path / 'store.sqlite'}")
    try:
        writes = store._writes
        store.record_version("c", 1, -1, "base", "base", None, replaces_iteration=False)
        assert store._writes == writes + 1  # the version and the trainee: one commit
        assert store.champion_history("c") == (1, None) and _trainee(store, "c") == 1
        store.record_version("c", 2, 0, "lora", "v2", 1)
        store.record_version("c", 3, 0, "lora", "v3", 1)  # a rerun of iteration 0 replaces v2
        assert store.iteration_versions("c", 0)["version"].tolist() == [3]
        assert _trainee(store, "c") == 3 and store.model_version("c", 1)["kind"] == "base"

        writes = store._writes
        store.record_decision("c", 0, _decision(3, 1, True, "2026-01-01 00:00:00+00"))
        assert store._writes == writes + 1
        assert store.champion_history("c") == (3, 1)
        store.record_version("c", 4, 1, "lora", "v4", 3)
        store.record_decision("c", 1, _decision(4, 3, False, "2026-01-01 00:01:00+00"), trainee=3)  # a reset
        assert store.champion_history("c") == (3, 1) and _trainee(store, "c") == 3
        store.record_decision("c", 1, _decision(4, 3, False, "2026-01-01 00:01:00+00"))  # a rerun replaces it
        assert store.promotions("c")["iteration"].tolist().count(1) == 1

        writes = store._writes
        store.record_rollback("c", 3, 1, "test")
        assert store._writes == writes + 1
        assert store.champion_history("c") == (1, 3) and _trainee(store, "c") == 1
        store.record_rollback("c", 1, 3, "undo")
        assert store.champion_history("c") == (3, 1) and _trainee(store, "c") == 3
        # the store's one champion query, and the latest challenger MLflow's alias projects
        assert not hasattr(store, "champion_from_events") and store.latest_challenger("c") == 4
    finally:
        store.close()


KILLED_REGISTRATION = """
import sys
from evertrain import faults
from evertrain.data.store import Store
store = Store(sys.argv[1])
faults.current_stage.set("update")
store.record_version("c", 3, 0, "lora", "v3", 1)  # killed inside its transaction
"""


def test_a_registration_killed_mid_transaction_leaves_neither_the_version_nor_the_trainee(tmp_path: Path) -> None:
    uri = f"ducklake:sqlite:{tmp_path / 'store.sqlite'}"
    store = Store(uri)
    store.record_version("c", 1, -1, "base", "base", None, replaces_iteration=False)
    store.record_version("c", 2, 0, "lora", "v2", 1)
    store.close()
    killed = subprocess.run([sys.executable, "-c", KILLED_REGISTRATION, uri], cwd=ROOT, timeout=120,
                            env={**os.environ, "EVERTRAIN_KILL_AT": "update:before_commit"})
    assert killed.returncode == -9
    store = Store(uri)
    try:
        assert store.iteration_versions("c", 0)["version"].tolist() == [2]  # the old registration stands
        assert _trainee(store, "c") == 2  # and the trainee with it
    finally:
        store.close()


def test_mlflow_aliases_are_projected_from_the_store_and_repaired(tmp_path: Path) -> None:
    config = smoke_config_in(tmp_path, tmp_path / "models", name="lineage")
    tracker = Tracker(config)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "weights.txt").write_text("w")
    base = tracker.register(checkpoint, run_id=None, iteration=None)
    challenger = tracker.register(checkpoint, run_id=None, iteration=0)
    store = Store(config.paths.store)
    try:
        store.record_version("lineage", base, -1, "base", "base", None, replaces_iteration=False)
        assert tracker.project_lineage(store, "lineage") == {"champion": base, "previous_champion": None,
                                                             "challenger": None}
        assert tracker.alias("champion") == base and tracker.alias("previous_champion") is None
        store.record_version("lineage", challenger, 0, "lora", "v", base)
        # the update's registration reaches MLflow's challenger alias through the same projection, not by itself
        assert tracker.project_lineage(store, "lineage")["challenger"] == challenger
        assert tracker.alias("challenger") == challenger
        store.record_decision("lineage", 0, _decision(challenger, base, True, "2026-01-01 00:00:00+00"))
        tracker.project_lineage(store, "lineage")
        assert (tracker.alias("champion"), tracker.alias("previous_champion")) == (challenger, base)
        # a crash between the store's commit and the projection leaves MLflow behind: running it again repairs
        tracker.set_alias("champion", base)
        tracker.set_alias("previous_champion", challenger)
        tracker.project_lineage(store, "lineage")
        assert (tracker.alias("champion"), tracker.alias("previous_champion")) == (challenger, base)
        store.record_rollback("lineage", challenger, base, "test")
        tracker.project_lineage(store, "lineage")
        assert (tracker.alias("champion"), tracker.alias("previous_champion")) == (base, challenger)
    finally:
        store.close()
