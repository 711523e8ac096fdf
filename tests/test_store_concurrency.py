"""The DuckLake store: readers in other processes while a campaign writes, concurrent writers, compaction,
the per-campaign claim, and the store URI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from evertrain.data.store import Store, StoreError, StoreLocation
from tests.conftest import smoke_config_in, store_uri


@pytest.fixture(scope="module")
def api_url(prefect_server) -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


READER = textwrap.dedent("""
    import json, sys, time
    from evertrain.data.store import Store, StoreError
    uri, out, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    from pathlib import Path
    while True:  # the catalog file appears before its writer has created the lake in it
        try:
            store = Store(uri, read_only=True)
            break
        except StoreError as error:
            if "does not exist yet" not in str(error):
                raise
            time.sleep(0.1)
    with open(out, "w") as sink:
        while not Path(stop).exists():
            try:
                rows = store.query("SELECT iteration, count(*) AS n, count(reward) AS scored FROM rollouts "
                                   "GROUP BY ALL ORDER BY ALL").values.tolist()
                problems = store.query("SELECT iteration, count(*) AS n FROM problems GROUP BY ALL").values.tolist()
            except Exception as error:  # a missing table before the writer created the schema is fine
                if "does not exist" not in str(error):
                    raise
                rows, problems = [], []
            sink.write(json.dumps({"rollouts": rows, "problems": problems}) + "\\n")
            sink.flush()
            time.sleep(0.2)
""")


def test_readers_see_whole_stages_while_a_campaign_writes(tmp_path, models_dir, api_url):
    config = smoke_config_in(tmp_path, models_dir, name="watched")
    config_file = tmp_path / "campaign.json"
    config_file.write_text(json.dumps(config.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_API_URL": api_url, "EVERTRAIN_PROGRESS": "0"}
    env.pop("EVERTRAIN_KILL_AT", None)
    env.pop("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", None)  # the run's own default, not this process's
    observations, stop = tmp_path / "seen.jsonl", tmp_path / "stop"
    # output to files, not pipes: nobody reads a pipe until the end, and a full one would stall the campaign
    reader_log, writer_log = open(tmp_path / "reader.log", "w"), open(tmp_path / "writer.log", "w")  # noqa: SIM115
    reader = subprocess.Popen([sys.executable, "-c", READER, config.paths.store, str(observations), str(stop)],
                              env=env, stdout=reader_log, stderr=subprocess.STDOUT)
    writer = subprocess.Popen([sys.executable, "-m", "evertrain.cli", "run", "--config", str(config_file),
                               "--iterations", "2"], cwd=tmp_path, env=env, stdout=writer_log, stderr=subprocess.STDOUT)
    # `evertrain sql` from another shell answers while the campaign writes (the README's promise); asked until
    # it has answered twice (each is a process of its own, seconds of imports, taken from the campaign's CPU)
    answers = []
    while writer.poll() is None and len(answers) < 2:
        sql = subprocess.run([sys.executable, "-m", "evertrain.cli", "sql", "SELECT count(*) AS n FROM rollouts",
                              "--store", config.paths.store, "--format", "json"],
                             env=env, capture_output=True, text=True, timeout=120)
        if writer.poll() is None and "does not exist" not in sql.stderr:
            assert sql.returncode == 0, sql.stderr[-2000:]
            answers.append(json.loads(sql.stdout)[0]["n"])
        time.sleep(1)
    writer.wait()
    stop.touch()
    reader.wait(timeout=120)
    reader_log.close()
    writer_log.close()
    assert writer.returncode == 0, (tmp_path / "writer.log").read_text()[-3000:]
    # without --verbose, Prefect's INFO lines stay off the terminal (they did in a plain run: #47)
    assert "| INFO " not in (tmp_path / "writer.log").read_text()
    assert reader.returncode == 0, (tmp_path / "reader.log").read_text()[-3000:]
    assert answers, "evertrain sql never answered while the campaign ran"

    problems = config.problems_per_iteration
    rollouts = problems * config.group_size
    seen = [json.loads(line) for line in observations.read_text().splitlines()]
    totals = [sum(n for _, n, _ in s["rollouts"]) for s in seen]
    assert len(seen) > 10 and max(totals) == 2 * rollouts
    assert totals == sorted(totals), "a reader saw the row count shrink"
    assert any(0 < t < 2 * rollouts for t in totals), "the reader never looked while the campaign was writing"
    for s in seen:  # never a partial stage: a stage's rows appear all at once, its scores too
        assert all(n == rollouts and scored in (0, rollouts) for _, n, scored in s["rollouts"]), s
        assert all(n == problems for _, n in s["problems"]), s


WRITER = textwrap.dedent("""
    import sys
    from evertrain.data.store import Store
    uri, campaign = sys.argv[1], sys.argv[2]
    store = Store(uri)
    for iteration in range(15):
        rows = [{"campaign": campaign, "iteration": iteration, "problem_id": f"p{k}", "sample": 0, "env": "e"}
                for k in range(50)]
        store.replace("rollouts", {"campaign": campaign, "iteration": iteration}, rows)
        store.replace("rollouts", {"campaign": campaign, "iteration": iteration}, rows)  # a rerun
        store.append("sandbox_runs", [{"run_id": f"{campaign}-{iteration}", "campaign": campaign}])
    store.close()
""")


def test_concurrent_writers_lose_and_duplicate_nothing(tmp_path):
    uri = store_uri(tmp_path)
    Store(uri).close()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, uri, name], stderr=subprocess.PIPE, text=True)
               for name in ("a", "b", "c")]
    for writer in writers:
        _, err = writer.communicate(timeout=600)
        assert writer.returncode == 0, err[-3000:]
    store = Store(uri, read_only=True)
    counts = store.query("SELECT campaign, count(*) AS n, count(DISTINCT (iteration, problem_id)) AS keys "
                         "FROM rollouts GROUP BY ALL ORDER BY ALL").values.tolist()
    audits = store.scalar("SELECT count(*) FROM sandbox_runs")
    store.close()
    assert counts == [["a", 750, 750], ["b", 750, 750], ["c", 750, 750]]
    assert audits == 45


HOLDING_READER = textwrap.dedent("""
    import sys, time
    from evertrain.data.store import Store
    store = Store(sys.argv[1], read_only=True)
    store.con.execute("BEGIN TRANSACTION")  # a long read: a report, a notebook, `evertrain sql` on a big table
    store.con.execute("SELECT count(*) FROM sandbox_runs").fetchone()
    print("reading", flush=True)
    sys.stdin.readline()  # holds its transaction until told
    store.con.execute("COMMIT")
""")


def test_a_reader_s_open_transaction_does_not_block_a_writer(tmp_path):
    """Issue 45: in SQLite's default journal mode a reader in another process holding its transaction made every
    commit fail with "database is locked" (three endpoints and a campaign on one store jammed for good); the
    catalog's write-ahead log lets the writer commit while the reader still reads."""
    uri = store_uri(tmp_path)
    store = Store(uri)
    store.append("sandbox_runs", [{"run_id": "before", "campaign": "c"}])
    reader = subprocess.Popen([sys.executable, "-c", HOLDING_READER, uri], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "reading"
        store.append("sandbox_runs", [{"run_id": "during", "campaign": "c"}])  # raised "database is locked" before
        assert reader.poll() is None  # the reader still held its transaction when the commit went through
        assert set(store.query("SELECT run_id FROM sandbox_runs")["run_id"]) == {"before", "during"}
    finally:
        reader.communicate("done\n", timeout=60)
        store.close()
    assert reader.returncode == 0


def test_compaction_merges_small_files_and_keeps_every_row(tmp_path):
    store = Store(store_uri(tmp_path))
    for iteration in range(20):
        store.replace("rollouts", {"campaign": "c", "iteration": iteration},
                      [{"campaign": "c", "iteration": iteration, "problem_id": f"p{k}", "sample": s, "reward": k * s}
                       for k in range(8) for s in range(4)])
        store.update_rollout_scores("c", iteration, store.query(
            "SELECT problem_id, sample, 1.0 AS reward, true AS passed, 'ok' AS reason, '{}' AS detail, "
            "now() AS scored_at FROM rollouts WHERE campaign = 'c' AND iteration = ?", [iteration]))
    before = store.query("SELECT iteration, problem_id, sample, reward FROM rollouts ORDER BY ALL")
    result = store.compact(keep_seconds=0)
    after = store.query("SELECT iteration, problem_id, sample, reward FROM rollouts ORDER BY ALL")
    store.close()
    assert before.equals(after) and len(after) == 20 * 32 and (after["reward"] == 1.0).all()
    assert result["after"]["files"] < result["before"]["files"] / 4, result
    assert result["after"]["data_bytes"] < result["before"]["data_bytes"], result


def test_one_writer_per_campaign_many_readers(tmp_path):
    uri = store_uri(tmp_path)
    first = Store(uri)
    first.claim("solo")
    holder = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from evertrain.data.store import Store
        Store({uri!r}).claim("solo")""")], capture_output=True, text=True, timeout=120)
    assert holder.returncode != 0 and "in use by another process" in holder.stderr
    assert f"pid {os.getpid()}" in holder.stderr
    other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from evertrain.data.store import Store
        Store({uri!r}).claim("another")""")], capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr  # other campaigns share the store
    reader = Store(uri, read_only=True)
    assert reader.counts()["rollouts"] == 0
    first.close()  # the claim goes with the connection (and with the process, SIGKILL included)
    again = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from evertrain.data.store import Store
        Store({uri!r}).claim("solo")""")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    reader.close()


def test_store_uri_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lake = StoreLocation.parse("ducklake:sqlite:data/x.sqlite")
    assert (lake.kind, lake.catalog, lake.target) == ("ducklake", "sqlite", str(tmp_path / "data" / "x.sqlite"))
    assert lake.data_path == f"{tmp_path / 'data' / 'x.files'}/"
    assert StoreLocation.parse(lake.uri) == lake
    pg = StoreLocation.parse("ducklake:postgres:dbname=e host=h?data_path=/shared/lake")
    assert (pg.target, pg.data_path) == ("dbname=e host=h", "/shared/lake/")
    with pytest.raises(StoreError, match="data path"):
        StoreLocation.parse("ducklake:postgres:dbname=e host=h")
    with pytest.raises(StoreError, match="'sqlite' or 'postgres'"):
        StoreLocation.parse("ducklake:mysql:x")
    assert StoreLocation.parse("old.duckdb").kind == "duckdb"
    for uri in ("duckdb:///tmp/x.duckdb", "postgres://u@h/db"):  # not a folder named "duckdb:" in the cwd
        with pytest.raises(StoreError, match="unknown scheme"):
            StoreLocation.parse(uri)
    assert not list(tmp_path.iterdir())
    with pytest.raises(StoreError, match="does not exist yet"):
        Store("ducklake:sqlite:missing.sqlite", read_only=True)


def test_plain_duckdb_file_still_works(tmp_path):
    store = Store(tmp_path / "old.duckdb")
    store.replace("problems", {"campaign": "c", "iteration": 0}, [{"campaign": "c", "iteration": 0, "problem_id": "p"}])
    store.append("sandbox_runs", [{"run_id": "r", "campaign": "c"}])
    store.append("sandbox_runs", [{"run_id": "r", "campaign": "d"}])
    assert store.counts()["problems"] == 1 and store.scalar("SELECT campaign FROM sandbox_runs") == "d"
    store.close()
    assert Path(tmp_path / "old.duckdb").exists()


@pytest.mark.parametrize("kind", ["ducklake", "duckdb"])
def test_a_column_the_schema_gained_is_added_to_an_existing_store(tmp_path, kind):
    uri = store_uri(tmp_path) if kind == "ducklake" else str(tmp_path / "old.duckdb")
    store = Store(uri)
    store.replace("evals", {"campaign": "c"},
                  [{"campaign": "c", "iteration": 0, "model_version": 1, "problem_id": "p", "sample": 0}])
    store.con.execute("ALTER TABLE evals DROP COLUMN reason")  # a store made before the column existed,
    store.con.execute("UPDATE schema_info SET version = 1")  # at schema version 1 (before migrations)
    store.close()
    store = Store(uri)
    frame = store.query("SELECT problem_id, reason FROM evals")
    store.close()
    assert frame.values.tolist() == [["p", None]]


def test_compaction_keeps_what_a_reader_of_the_last_hour_may_need(tmp_path):
    """compact(keep_seconds) keeps every snapshot younger than that and the files they read: a reader that began
    on an older snapshot still finds its files (DuckLake's own older_than took snapshots and files made seconds
    before a cutoff of an hour)."""
    store = Store(store_uri(tmp_path))
    for iteration in range(3):
        store.replace("rollouts", {"campaign": "c", "iteration": iteration},
                      [{"campaign": "c", "iteration": iteration, "problem_id": f"p{k}", "sample": 0, "reward": 0.0}
                       for k in range(4)])
    pinned = int(store.scalar("SELECT max(snapshot_id) FROM ducklake_snapshots('lake')"))  # a reader's snapshot
    snapshots = store.scalar("SELECT count(*) FROM ducklake_snapshots('lake')")
    store.replace("rollouts", {"campaign": "c", "iteration": 0}, [])  # files only the older snapshots read
    store.compact(keep_seconds=3600)
    assert store.scalar("SELECT count(*) FROM ducklake_snapshots('lake')") > snapshots  # none expired
    # the pinned snapshot still reads its rows: its files were neither expired nor cleaned up
    assert store.query(f"SELECT * FROM rollouts AT (VERSION => {pinned}) WHERE iteration = 0").shape[0] == 4
    # files scheduled for deletion by a compaction longer ago than keep_seconds go at the next one
    scheduled = "SELECT count(*) FROM __ducklake_metadata_lake.ducklake_files_scheduled_for_deletion"
    store.compact(keep_seconds=1)
    waiting = store.scalar(scheduled)
    assert waiting > 0
    time.sleep(1.5)
    store.compact(keep_seconds=1)
    assert store.scalar(scheduled + " WHERE CAST(schedule_start AS TIMESTAMPTZ) < now() - INTERVAL 1 SECOND") == 0
    store.compact(keep_seconds=0)  # nothing to keep: only the newest snapshot is left, its rows whole
    assert store.scalar("SELECT count(*) FROM ducklake_snapshots('lake')") == 1
    assert store.scalar("SELECT count(*) FROM rollouts") == 8
    store.close()
