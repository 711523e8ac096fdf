"""Shared fixtures: a tiny model built once, a smoke config in a temp dir, one Prefect test server."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("EVERTRAIN_PROGRESS", "0")

from evertrain.config import CampaignConfig, load_config
from evertrain.runtime import quiet_libraries

quiet_libraries()

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models/ folder holding the tiny model (built from a config, nothing downloaded)."""
    from evertrain.models.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("models")
    build_tiny_model(path / "tiny-llama")
    return path


def store_uri(directory: Path) -> str:
    """The embedded default store (DuckLake on a SQLite catalog) under ``directory``."""
    return f"ducklake:sqlite:{directory / 'evertrain.sqlite'}"


def smoke_config_in(directory: Path, models_dir: Path, **overrides: object) -> CampaignConfig:
    """configs/smoke.toml with every path moved under ``directory``."""
    config = load_config(ROOT / "configs" / "smoke.toml")
    data = config.model_dump()
    data["model"]["models_dir"] = str(models_dir)
    data["paths"] = {
        "store": store_uri(directory),
        "mlflow_uri": f"sqlite:///{directory / 'mlflow' / 'mlflow.db'}",
        "artifacts": str(directory / "mlflow" / "artifacts"),
        "checkpoints": str(directory / "checkpoints"),
    }
    for key, value in overrides.items():
        data[key] = value
    return CampaignConfig.model_validate(data)


def check_one_tool_call(rollout: Any) -> tuple[list[dict], int, int]:
    """A stored rollout of one tool call then a final answer: its turns, reward, and a loss mask that
    trains on the policy's tokens and never on the tool message. Returns (turns, tool start, tool end)."""
    turns = json.loads(rollout.turns)
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"], turns
    assert rollout.tool_calls == 1 and rollout.reward == 1.0, (rollout.completion, rollout.reason)
    start, end = turns[1]["tokens"]
    mask = list(rollout.loss_mask)
    assert set(mask[start:end]) == {0} and set(mask[:start]) == {1} and 1 in mask[end:]
    return turns, start, end


@pytest.fixture
def smoke_config(tmp_path: Path, models_dir: Path) -> CampaignConfig:
    return smoke_config_in(tmp_path, models_dir)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory):
    """One real Prefect server (the test harness) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
