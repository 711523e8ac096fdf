"""Shared fixtures: a tiny model built once, a smoke config in a temp dir, one Prefect test server."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("EVERTRAIN_PROGRESS", "0")

from evertrain.config import CampaignConfig, load_config
from evertrain.quiet import quiet_libraries

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


# An MLflow SQLite database with MLflow's tables created and migrated and nothing in them, made on first use
# and copied to where a test's campaign keeps its tracking database: the tests do not each run MLflow's
# schema migrations (about 1.6 CPU-seconds a database). Made by MLflow's own table creation, as its store
# runs it on a new file; the store itself then adds the default experiment, with the artifact root of its time.
_MLFLOW_TEMPLATE: list[Path] = []


def _mlflow_template() -> Path | None:
    if not _MLFLOW_TEMPLATE:
        import sqlalchemy

        try:
            from mlflow.store.db.utils import _all_tables_exist, _initialize_tables
        except ImportError:  # another MLflow's internals: every test migrates its own database
            return None
        folder = Path(tempfile.mkdtemp(prefix="evertrain-test-mlflow-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        engine = sqlalchemy.create_engine(f"sqlite:///{folder / 'mlflow.db'}")
        try:
            _initialize_tables(engine)
            assert _all_tables_exist(engine)
        finally:
            engine.dispose()
        _MLFLOW_TEMPLATE.append(folder / "mlflow.db")
    return _MLFLOW_TEMPLATE[0]


# One torch thread for the tests' campaigns unless a test asks for more: for a model this small the second
# thread's synchronisation costs more than it computes (measured: a smoke iteration took 36 CPU-seconds with
# two threads on two cores, 23-25 with one), and under `make test TEST_WORKERS=2` the other core runs the
# other worker. Written into the config, so `evertrain run` subprocesses of a test follow it too.
# EVERTRAIN_TEST_TORCH_THREADS=0 gives the campaigns the library's default (every core), to compare.
TEST_TORCH_THREADS = int(os.environ.get("EVERTRAIN_TEST_TORCH_THREADS", "1")) or None
if TEST_TORCH_THREADS:  # the tests that drive torch themselves (losses, TRL, the policy) run as the campaigns do
    import torch

    torch.set_num_threads(TEST_TORCH_THREADS)


def smoke_config_in(directory: Path, models_dir: Path, **overrides: object) -> CampaignConfig:
    """configs/smoke.toml with every path moved under ``directory`` (and its MLflow database created)."""
    config = load_config(ROOT / "configs" / "smoke.toml")
    overrides.setdefault("torch_threads", TEST_TORCH_THREADS)
    data = config.model_dump()
    data["model"]["models_dir"] = str(models_dir)
    data["paths"] = {
        "store": store_uri(directory),
        "mlflow_uri": f"sqlite:///{directory / 'mlflow' / 'mlflow.db'}",
        "artifacts": str(directory / "mlflow" / "artifacts"),
        "checkpoints": str(directory / "checkpoints"),
    }
    for key, value in overrides.items():
        if key == "model" and isinstance(value, dict):
            # merged, not replaced: the model's folder (and smoke's tiny model unless a path is named) are kept,
            # so no test converts the embedded SmolLM2 into the working directory's state/models
            value = {**data["model"], **value}
        data[key] = value
    config = CampaignConfig.model_validate(data)
    database = directory / "mlflow" / "mlflow.db"
    if config.paths.mlflow_uri == f"sqlite:///{database}" and not database.exists() and \
            (template := _mlflow_template()) is not None:
        database.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, database)
    return config


def api_key(store: Any, scopes: str = "infer,feedback,admin", name: str | None = None) -> str:
    """A new API key in ``store``, made through the project's own API (what `evertrain keys create` does): its
    secret, for the clients of a test's endpoint (serving.auth = "keys" is the default)."""
    import uuid

    from evertrain.serving.auth import create_key

    secret, _row = create_key(store, name or f"test-{uuid.uuid4().hex[:8]}", scopes, actor="pytest")
    return secret


def bearer(secret: str) -> dict[str, str]:
    """The header that carries an API key (for clients other than ``openai``, which takes ``api_key=``)."""
    return {"Authorization": f"Bearer {secret}"}


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
def prefect_server(prefect_database: Path):
    """One real Prefect server (the test harness) for the whole session, on a copy of the suite's migrated database:
    the harness would otherwise migrate a new one (about 8 CPU-seconds) in every xdist worker. The harness names
    its database ``prefect-test.db`` in the folder it makes with ``mkdtemp``; the copy is put there first (where a
    later Prefect names it otherwise, the harness migrates its own, as before)."""
    from prefect.testing import utilities
    from prefect.testing.utilities import prefect_test_harness

    def premigrated(*args: Any, **kwargs: Any) -> str:
        folder = tempfile.mkdtemp(*args, **kwargs)
        shutil.copyfile(prefect_database, Path(folder) / "prefect-test.db")
        return folder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utilities, "mkdtemp", premigrated)
        harness = prefect_test_harness(server_startup_timeout=120)
        harness.__enter__()
    try:
        yield
    finally:
        harness.__exit__(None, None, None)


@pytest.fixture(scope="session")
def prefect_database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Prefect database with every migration applied, made once for the suite (one for all xdist workers, under
    a file lock): a test that lets `evertrain run`, `serve` or `ui` start Prefect's server in a PREFECT_HOME of its
    own puts a copy there first (:func:`prefect_home`). A new database costs about 8 CPU-seconds of migrations
    (8.9 s wall against 2.7 s for one already migrated, AMD EPYC); the suite starts nine such servers."""
    import subprocess
    import sys

    import prefect
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, above every worker's own
    target = shared / f"prefect-{prefect.__version__}" / "prefect.db"
    with FileLock(str(shared / "prefect-database.lock")):
        if not target.exists():
            building = target.parent.with_name(target.parent.name + ".partial")
            shutil.rmtree(building, ignore_errors=True)
            building.mkdir(parents=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
            subprocess.run([sys.executable, "-c", "import asyncio\n"
                            "from prefect.server.database import provide_database_interface\n"
                            "asyncio.run(provide_database_interface().create_db())"],
                           env={**env, "PREFECT_HOME": str(building)}, check=True, timeout=300)
            building.rename(target.parent)
    return target


def prefect_home(home: Path, database: Path) -> Path:
    """``home`` made a PREFECT_HOME whose database is a copy of the migrated ``database``; returns ``home``."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(database, home / "prefect.db")
    return home


@pytest.fixture(scope="session")
def preloaded():
    """``preloaded(env)``: a :class:`tests.preloaded.Preloader` for ``evertrain`` runs with ``env``, its runs forked
    from one process that has imported what a run imports (about 12 CPU-seconds a run the less); one per
    environment for the session."""
    from tests.preloaded import Preloaders

    preloaders = Preloaders()
    yield preloaders
    preloaders.close()


# The longest files first (their wall times in the suite, docs/benchmarks/tests.md): with pytest-xdist's
# --dist loadfile each worker takes the next file as it frees up, so a long file taken last would run alone on
# one core at the end while the other idles. `make test` passes --no-loadscope-reorder: xdist otherwise
# reorders the files by their number of tests, which put the long one-test files (servers, deployments) last.
LONGEST_FIRST = ("test_vllm.py", "test_run_signal.py", "test_deployments.py", "test_servers.py", "test_ray.py",
                 "test_reasoning_gym.py", "test_many_envs.py", "test_store_concurrency.py", "test_endpoint_vllm.py",
                 "test_ray_nodes.py", "test_crash_safety.py", "test_ecosystem.py", "test_verifiers_env.py",
                 "test_adversarial_sandbox.py", "test_curation.py",
                 "test_approval.py", "test_curriculum.py", "test_portable.py", "test_sql_readonly.py",
                 "test_honest_measurement.py", "test_endpoint.py", "test_cli_refusals.py",
                 "test_update_data_parallel.py", "test_promotion.py", "test_docs.py", "test_terminal.py",
                 "test_sft.py", "test_async.py", "test_export.py", "test_campaign_flow.py", "test_adversarial.py",
                 "test_accelerate.py", "test_api_keys.py", "test_tool_envs.py", "test_tool_rollout.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # a stable sort: the files keep their tests together and in order, the others keep theirs
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
