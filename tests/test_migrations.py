"""Schema migrations: a store made by the schema before migrations opens, upgrades and keeps its rows.

The old store is made here the way evertrain made it then: the frozen DDL (tests/data/store_schema_v1.sql, the
``SCHEMA`` string of store.py before migrations) executed on a fresh store (without its PRIMARY KEY clauses on
DuckLake, which refuses them), ``schema_info`` set to 1, and rows written by plain SQL.
"""

from __future__ import annotations

import multiprocessing
import re
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from evertrain.data import schema
from evertrain.data.store import Store, StoreError, StoreLocation, connect_lake

V1_DDL = (Path(__file__).parent / "data" / "store_schema_v1.sql").read_text()


def _parse(ddl: str) -> dict[str, tuple[list[tuple[str, str]], tuple[str, ...]]]:
    """{table: ([(column, type)], key)} read from DDL text (independently of evertrain.data.schema)."""
    ddl = re.sub(r"--[^\n]*", "", ddl)
    found = {}
    for table, body in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\);", ddl, re.S):
        key: tuple[str, ...] = ()
        if match := re.search(r",\s*PRIMARY KEY \(([^)]*)\)", body):
            key = tuple(c.strip() for c in match.group(1).split(","))
            body = body[:match.start()] + body[match.end():]
        columns = []
        for part in (p.strip() for p in body.split(",") if p.strip()):
            name, kind = part.split(None, 1)
            if kind.endswith(" PRIMARY KEY"):
                kind, key = kind.removesuffix(" PRIMARY KEY"), (name,)
            columns.append((name, kind))
        found[table] = (columns, key)
    return found


def _connect(uri: str) -> duckdb.DuckDBPyConnection:
    location = StoreLocation.parse(uri)
    return connect_lake(location) if location.kind == "ducklake" else duckdb.connect(location.target)


def make_v1_store(uri: str, drop_columns: tuple[str, ...] = ()) -> dict[str, list[tuple]]:
    """A store as evertrain made it before migrations, with rows in several tables; the rows, by table.

    ``drop_columns`` ('table.column') are left out of the DDL: a store made before those columns were added
    to version 1's tables (which then happened without a version bump)."""
    ddl = V1_DDL
    for dropped in drop_columns:
        table, column = dropped.split(".")
        head, body = ddl.split(f"CREATE TABLE IF NOT EXISTS {table} (", 1)
        body, tail = body.split(");", 1)
        body = re.sub(rf"\b{column} [A-Z\[\]]+,\s*", "", body)
        ddl = f"{head}CREATE TABLE IF NOT EXISTS {table} ({body});{tail}"
    lake = StoreLocation.parse(uri).kind == "ducklake"
    if lake:  # what store.py's LAKE_SCHEMA did: no comments, no PRIMARY KEY clauses
        ddl = re.sub(r" PRIMARY KEY", "", re.sub(r",\s*PRIMARY KEY \([^)]*\)", "", re.sub(r"--[^\n]*", "", ddl)))
    rows = {
        "problems": [("c", 0, "p1", "arithmetic", "train", "1+1?", '{"answer": 2}', None, None)],
        "rollouts": [("c", 0, "p1", 0, "arithmetic", 1, "1+1?", "2", [1, 2], [3], [-0.5], [1], 1.0, True),
                     ("c", 0, "p1", 1, "arithmetic", 1, "1+1?", "3", [1, 2], [4], [-0.7], [1], 0.0, False)],
        "model_versions": [("c", 1, -1, "base", "base", None), ("c", 2, 0, "lora", "v2", 1)],
        "promotions": [("c", 0, 2, 1, True, 0.6, 0.4)],
        "campaigns": [("c", '{"name": "c"}')],
    }
    con = _connect(uri)
    try:
        con.execute(ddl)
        con.execute("INSERT INTO schema_info VALUES (1)")
        con.executemany("INSERT INTO problems (campaign, iteration, problem_id, env, split, prompt, payload, "
                        "messages, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows["problems"])
        con.executemany("INSERT INTO rollouts (campaign, iteration, problem_id, sample, env, policy_version, "
                        "prompt_text, completion, prompt_ids, completion_ids, logprobs, loss_mask, reward, passed) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows["rollouts"])
        con.executemany("INSERT INTO model_versions (campaign, version, iteration, kind, path, parent_version) "
                        "VALUES (?, ?, ?, ?, ?, ?)", rows["model_versions"])
        con.executemany("INSERT INTO promotions (campaign, iteration, challenger_version, champion_version, "
                        "promoted, challenger_pass1, champion_pass1) VALUES (?, ?, ?, ?, ?, ?, ?)", rows["promotions"])
        con.executemany("INSERT INTO campaigns (campaign, config) VALUES (?, ?)", rows["campaigns"])
    finally:
        con.close()
    return rows


READ_BACK = {
    "problems": "SELECT campaign, iteration, problem_id, env, split, prompt, payload, messages, created_at "
                "FROM problems ORDER BY ALL",
    "rollouts": "SELECT campaign, iteration, problem_id, sample, env, policy_version, prompt_text, completion, "
                "prompt_ids, completion_ids, logprobs, loss_mask, reward, passed FROM rollouts ORDER BY sample",
    "model_versions": "SELECT campaign, version, iteration, kind, path, parent_version FROM model_versions "
                      "ORDER BY version",
    "promotions": "SELECT campaign, iteration, challenger_version, champion_version, promoted, challenger_pass1, "
                  "champion_pass1 FROM promotions",
    "campaigns": "SELECT campaign, config FROM campaigns",
}


def _clean(value: object) -> object:
    """A cell as plain Python: NULL (None, NaN, NA) as None, lists as lists, floats rounded (FLOAT[] is 32-bit)."""
    if isinstance(value, str):
        return value
    if hasattr(value, "__len__"):
        return [_clean(x) for x in value]  # type: ignore[union-attr]
    if value is None or pd.isna(value):
        return None
    value = getattr(value, "item", lambda: value)()
    return round(value, 4) if isinstance(value, float) else value


def _rows(store: Store) -> dict[str, list[tuple]]:
    return {table: [tuple(_clean(v) for v in row) for row in store.query(sql).itertuples(index=False)]
            for table, sql in READ_BACK.items()}


def _expected(rows: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    return {table: [tuple(_clean(v) for v in row) for row in table_rows] for table, table_rows in rows.items()}


def _uri(kind: str, tmp_path: Path) -> str:
    return f"ducklake:sqlite:{tmp_path / 'old.sqlite'}" if kind == "ducklake" else str(tmp_path / "old.duckdb")


def test_version_1_is_the_schema_before_migrations() -> None:
    """Migration 1 declares exactly the frozen DDL: every table, column, type and key, in order."""
    frozen = _parse(V1_DDL)
    declared = {name: ([(c.name, c.type) for c in t.columns], t.key) for name, t in schema.tables(1).items()}
    assert declared == frozen
    assert list(declared) == list(frozen)
    assert len(frozen) == 19 and frozen["rollouts"][1] == ("campaign", "iteration", "problem_id", "sample")


@pytest.mark.parametrize("kind", ["ducklake", "duckdb"])
def test_a_store_made_before_migrations_upgrades_and_keeps_its_rows(tmp_path: Path, kind: str) -> None:
    uri = _uri(kind, tmp_path)
    rows = make_v1_store(uri, drop_columns=("rollouts.top_p", "evals.gen_key"))
    store = Store(uri)
    try:
        assert store.migrated == list(range(2, schema.LATEST + 1))
        assert store.scalar("SELECT max(version) FROM schema_info") == schema.LATEST
        assert store.scalar("SELECT count(*) FROM schema_info") == 1
        assert store.query("SELECT version FROM schema_migrations ORDER BY version")["version"].tolist() == \
            list(range(2, schema.LATEST + 1))
        assert _rows(store) == _expected(rows)
        # the columns version 1 gained before migrations existed are added, NULL in the old rows
        assert store.query("SELECT top_p FROM rollouts")["top_p"].isna().all()
        assert store.counts()["evals"] == 0 and "gen_key" in store.query("SELECT * FROM evals").columns
        # every table of the latest schema is there, with every column (an added column comes last)
        for name, table in schema.tables().items():
            assert set(store.query(f"SELECT * FROM {name} LIMIT 0").columns) == {c.name for c in table.columns}
        # the named queries read the old rows
        assert store.base_version("c") == 1
        assert store.rollouts_for_update("c", 0, 0)["completion_ids"].map(list).tolist() == [[3], [4]]
        assert store.champion_history("c")[0] == 2  # the promotion promoted v2
        assert store.lineage("c", 2) == [{"version": 2, "iteration": 0, "kind": "lora"},
                                         {"version": 1, "iteration": -1, "kind": "base"}]  # the base: NULL parent
    finally:
        store.close()
    again = Store(uri)
    try:
        assert again.migrated == []  # re-opening is a no-op
        assert again.scalar("SELECT count(*) FROM schema_migrations") == schema.LATEST - 1
        assert _rows(again) == _expected(rows)
    finally:
        again.close()


def test_a_new_store_records_every_migration(tmp_path: Path) -> None:
    store = Store(f"ducklake:sqlite:{tmp_path / 'new.sqlite'}")
    try:
        assert store.migrated == list(range(1, schema.LATEST + 1))
        assert store.query("SELECT version FROM schema_migrations ORDER BY version")["version"].tolist() == \
            store.migrated
        assert store.scalar("SELECT version FROM schema_info") == schema.LATEST
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["ducklake", "duckdb"])
def test_a_store_newer_than_the_code_is_refused(tmp_path: Path, kind: str) -> None:
    uri = _uri(kind, tmp_path)
    Store(uri).close()
    con = _connect(uri)
    try:
        con.execute("UPDATE schema_info SET version = ?", [schema.LATEST + 1])
    finally:
        con.close()
    with pytest.raises(StoreError) as refused:
        Store(uri)
    message = str(refused.value)
    assert f"schema version {schema.LATEST + 1}" in message and f"(version {schema.LATEST})" in message
    assert "upgrade evertrain" in message
    reader = Store(uri, read_only=True)  # readers are not refused: they write nothing
    try:
        assert reader.scalar("SELECT version FROM schema_info") == schema.LATEST + 1
    finally:
        reader.close()


def _open_and_report(uri: str, queue: multiprocessing.Queue) -> None:
    try:
        store = Store(uri)
        queue.put(("ok", store.migrated))
        store.close()
    except Exception as error:  # reported to the parent, which fails the test with it
        queue.put(("error", repr(error)))


def test_two_processes_opening_an_old_store_at_once_migrate_it_once(tmp_path: Path) -> None:
    uri = _uri("ducklake", tmp_path)
    rows = make_v1_store(uri)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_open_and_report, args=(uri, queue)) for _ in range(3)]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=180) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert all(status == "ok" for status, _ in results), results
    applied = [versions for _, versions in results if versions]
    assert applied == [list(range(2, schema.LATEST + 1))], results  # one process migrated, the others found it done
    store = Store(uri)
    try:
        assert store.query("SELECT version FROM schema_migrations ORDER BY version")["version"].tolist() == \
            list(range(2, schema.LATEST + 1))
        assert _rows(store) == _expected(rows)
    finally:
        store.close()
