"""Unattended runs: `evertrain serve` on a short interval, and a second concurrent run refused cleanly."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from evertrain.data.store import Store
from tests.conftest import prefect_home, smoke_config_in, store_uri


@pytest.fixture(scope="module")
def api_url(prefect_server) -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _env(api_url: str) -> dict[str, str]:
    env = {**os.environ, "PREFECT_API_URL": api_url, "EVERTRAIN_PROGRESS": "0"}
    env.pop("EVERTRAIN_KILL_AT", None)
    return env


def _config_file(directory: Path, models_dir: Path, name: str) -> Path:
    config = smoke_config_in(directory, models_dir, name=name)
    path = directory / "campaign.json"
    path.write_text(json.dumps(config.model_dump(mode="json")))
    return path


def _finished_runs(directory: Path, campaign: str) -> int:
    """Finished MLflow runs, read with plain SQL: an MLflow client would try to migrate a database that the
    served process may be creating at that very moment."""
    db = directory / "mlflow" / "mlflow.db"
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            row = con.execute(
                """SELECT count(*) FROM runs JOIN experiments USING (experiment_id)
                   WHERE experiments.name = ? AND runs.status = 'FINISHED'
                   AND run_uuid IN (SELECT run_uuid FROM tags WHERE key = 'evertrain.iteration')""",
                [f"evertrain/{campaign}"]).fetchone()
    except sqlite3.Error:  # not created yet, or busy
        return 0
    return int(row[0])


def test_serve_runs_two_scheduled_iterations(tmp_path, models_dir, prefect_database):
    """No PREFECT_API_URL: `evertrain serve` starts a real Prefect server (with its scheduler) itself."""
    config = _config_file(tmp_path, models_dir, "served")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "EVERTRAIN_KILL_AT")}
    # the runner asks for scheduled runs every 2 s, not every 10 s: each iteration's run starts sooner
    env.update(PREFECT_HOME=str(prefect_home(tmp_path / "prefect-home", prefect_database)), EVERTRAIN_PROGRESS="0",
               PREFECT_RUNNER_POLL_FREQUENCY="2")
    # output to a file: the runner logs every skipped schedule, and an undrained pipe would stall it
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "evertrain.cli", "serve", "--config", str(config),
                                   "--interval", "3", "--port", "4311"], cwd=tmp_path, env=env,
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        # generous: on a shared 2-core machine the server's start alone took minutes
        deadline = time.monotonic() + 900
        # two iterations done: their MLflow runs are ended last, after the promotion decision
        while _finished_runs(tmp_path, "served") < 2 and time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        # SIGTERM, a service manager's stop (Ctrl-C's SIGINT does the same from a terminal; sent from here in the
        # full suite, `serve` twice ran on for the whole minute below, was killed, and left its Prefect server)
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    assert server.returncode == 0, log.read_text()[-3000:]
    # the Prefect server it started is stopped with it, not left running on its own
    port = re.search(r"started a Prefect server: UI at http://127\.0\.0\.1:(\d+)", log.read_text()).group(1)
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if "server" in (cmd := p.info["cmdline"] or []) and ("--port", port) in itertools.pairwise(cmd)]
    assert not left, f"the Prefect server on port {port} outlived `evertrain serve`: {left}"
    assert _finished_runs(tmp_path, "served") >= 2
    store = Store(store_uri(tmp_path), read_only=True)
    done = store.query("SELECT iteration FROM promotions ORDER BY iteration")["iteration"].tolist()
    flow_runs = store.query("SELECT DISTINCT flow_run_id FROM stage_runs WHERE flow_run_id IS NOT NULL")
    store.close()
    assert done[:2] == [0, 1]
    assert len(flow_runs) >= 2  # each iteration came from its own scheduled flow run


def test_a_run_may_not_change_what_the_campaign_promises(tmp_path, models_dir):
    """Issue 45: what a deployment's run checks before any stage (evertrain.promises): a laxer gate than the
    config the operator recorded is refused, naming each change, and so is a store with no record of the campaign."""
    from evertrain import promises
    from evertrain.config import CampaignConfig

    config = smoke_config_in(tmp_path, models_dir, name="promised")
    promises.record(config)
    data = config.model_dump(mode="json")
    data["promotion"]["max_regression"] = 1.0
    data["eval"]["problems_per_env"] = 1
    weaker = CampaignConfig.model_validate(data)
    store = Store(config.paths.store)
    try:
        promises.check(store, config)  # the recorded config itself passes
        with pytest.raises(promises.PromiseError, match=r"promotion\.max_regression.*Nothing ran") as refused:
            promises.check(store, weaker)
        assert "eval.problems_per_env" in str(refused.value)
    finally:
        store.close()
    data = config.model_dump(mode="json")
    data["paths"]["store"] = str(tmp_path / "elsewhere.duckdb")
    elsewhere = CampaignConfig.model_validate(data)
    other = Store(elsewhere.paths.store)
    try:
        with pytest.raises(promises.PromiseError, match="has no recorded config"):
            promises.check(other, elsewhere)
    finally:
        other.close()


def test_second_concurrent_run_is_refused_without_damage(tmp_path, models_dir, api_url, preloaded):
    config = _config_file(tmp_path, models_dir, "busy")
    command = ["run", "--config", str(config)]
    # both runs forked from a process that has imported what a run imports (tests/preloaded.py): processes of
    # their own, without 12 CPU-seconds of imports each
    preloader = preloaded(_env(api_url))
    out, err = tmp_path / "first.out", tmp_path / "first.err"
    first = preloader.start([*command, "--iterations", "3"], cwd=tmp_path, env=_env(api_url), stdout=out, stderr=err)
    try:
        # the first run has claimed the campaign once its pid is in the claim's lock file
        claim = tmp_path / "evertrain.sqlite.busy.campaign-lock"
        deadline = time.monotonic() + 120
        while not (claim.exists() and claim.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
        second = preloader.run([*command, "--iterations", "1"], cwd=tmp_path, env=_env(api_url), timeout=120)
    except BaseException:
        preloader.wait(first, timeout=0)  # killed, if still running
        raise
    assert preloader.wait(first, timeout=600) == 0, err.read_text()[-3000:]
    assert second.returncode == 2, second.stderr[-3000:]
    assert "in use by another process" in second.stderr and "Traceback" not in second.stderr
    store = Store(store_uri(tmp_path), read_only=True)
    counts = store.query("SELECT iteration, count(*) AS n FROM rollouts GROUP BY iteration ORDER BY iteration")
    stages = store.query("SELECT status, count(*) AS n FROM stage_runs GROUP BY status")
    store.close()
    assert counts["iteration"].tolist() == [0, 1, 2] and (counts["n"] == 8 * 4).all()
    assert stages.set_index("status")["n"].to_dict() == {"completed": 18}
