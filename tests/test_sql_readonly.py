"""`evertrain sql` is read-only for real (issue 45): every way out of "read the store" is refused with a clear
one-line error and exit status 2, and the store (a real one, made by the project's own Store) is unchanged."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from evertrain.cli import main
from evertrain.data.store import Store, StoreError, extension_dir

# what each store held when it was made: every refusal is checked against it, so a write that got through in one
# test fails that test (and every later one of the module, which shares the store)
INITIAL: dict[str, dict[str, object]] = {}


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A DuckLake store with a sentinel row (a rollback) and a second snapshot, so reads touch Parquet files; one
    for the module (each store opened costs about half a second)."""
    uri = f"ducklake:sqlite:{tmp_path_factory.mktemp('lake') / 'store' / 'evertrain.sqlite'}"
    with Store(uri) as store:
        store.record_rollback("demo", 2, 1, "sentinel")
        store.record_rollback("demo", 3, 2, "second")
    INITIAL[uri] = state(uri)
    return uri


def state(uri: str) -> dict[str, object]:
    """What must not change: every table's row count and the sentinel rows, read by a fresh read-only Store."""
    with Store(uri, read_only=True) as store:
        rows = store.query("SELECT reason FROM rollbacks ORDER BY reason")["reason"].tolist()
        return {"counts": store.counts(), "rollbacks": rows}


def sql(uri: str, query: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["sql", query, "--store", uri, "--format", "json"])
    out, err = capsys.readouterr()
    return code, out, err


def refused(uri: str, query: str, capsys: pytest.CaptureFixture[str], *words: str) -> str:
    before = INITIAL.get(uri) or state(uri)
    code, out, err = sql(uri, query, capsys)
    assert code == 2, f"not refused (exit {code}): {out[:500]} {err[-500:]}"
    assert err.startswith("evertrain: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
    assert state(uri) == before
    return err


def test_plain_select_still_works(lake, capsys):
    code, out, err = sql(lake, "SELECT reason, to_version FROM rollbacks ORDER BY reason", capsys)
    assert code == 0, err
    assert json.loads(out) == [{"reason": "second", "to_version": 2}, {"reason": "sentinel", "to_version": 1}]
    for query in ("SHOW TABLES", "DESCRIBE rollbacks", "FROM rollbacks", "SELECT count(*) FROM traces;",
                  "SELECT * FROM ducklake_snapshots('lake')"):
        code, out, err = sql(lake, query, capsys)
        assert code == 0, (query, err)


@pytest.mark.parametrize("reader", ["read_csv('{file}')", "read_text('{file}')", "read_blob('{file}')",
                                    "glob('{folder}/*')"])
def test_host_files_cannot_be_read(lake, tmp_path, capsys, reader):
    secret = tmp_path / "secret.txt"
    secret.write_text("name,password\nroot,hunter2\n")
    query = f"SELECT * FROM {reader.format(file=secret, folder=tmp_path)}"
    err = refused(lake, query, capsys)
    assert "hunter2" not in err


def test_another_sqlite_file_cannot_be_read(lake, tmp_path, capsys):
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE secrets (value TEXT)")
        db.execute("INSERT INTO secrets VALUES ('hunter2')")
    refused(lake, f"SELECT * FROM sqlite_scan('{other}', 'secrets')", capsys, "sqlite_scan")


@pytest.mark.parametrize("query", ["COPY (SELECT 1) TO '{out}'", "COPY rollbacks TO '{out}'",
                                   "EXPORT DATABASE '{folder}'",
                                   # a write hidden after a SELECT
                                   "SELECT count(*) FROM rollbacks; COPY rollbacks TO '{out}'"])
def test_no_file_is_written(lake, tmp_path, capsys, query):
    out, folder = tmp_path / "leak.csv", tmp_path / "export"
    refused(lake, query.format(out=out, folder=folder), capsys)
    assert not out.exists() and not folder.exists()


def test_no_other_database_is_attached(lake, tmp_path, capsys):
    other = tmp_path / "other.duckdb"
    refused(lake, f"ATTACH '{other}' AS other", capsys, "ATTACH")
    assert not other.exists()


def test_the_lake_cannot_be_reattached_writable(lake, capsys):
    catalog = lake.removeprefix("ducklake:sqlite:")
    data = str(Path(catalog).with_suffix(".files")) + "/"
    escape = (f"USE memory; DETACH lake; ATTACH 'ducklake:sqlite:{catalog}' AS writable (DATA_PATH '{data}'); "
              "DELETE FROM writable.rollbacks")
    refused(lake, escape, capsys)
    for query in ("USE memory", "DETACH lake", f"ATTACH 'ducklake:sqlite:{catalog}' AS writable (DATA_PATH '{data}')"):
        refused(lake, query, capsys, "read-only")


@pytest.mark.parametrize("query", [
    "INSERT INTO rollbacks SELECT * FROM rollbacks",
    "UPDATE rollbacks SET reason = 'changed'",
    "DELETE FROM rollbacks",
    "CREATE TABLE memory.scratch AS SELECT 1 AS a",
    "CREATE TEMP TABLE scratch (a INTEGER)",
    "DROP TABLE rollbacks",
    "CHECKPOINT",
    "CALL ducklake_expire_snapshots('lake', older_than => now())",
    "SELECT * FROM ducklake_expire_snapshots('lake', older_than => now())",
    "SELECT * FROM ducklake_delete_orphaned_files('lake', cleanup_all => true)",
    "SELECT * FROM query('SELECT 1')",
])
def test_writes_are_refused_as_read_only(lake, capsys, query):
    refused(lake, query, capsys, "evertrain sql is read-only")


@pytest.mark.parametrize("query", ["LOAD '{ext}'", "INSTALL '{ext}'"])
def test_no_extension_is_installed_or_loaded(lake, tmp_path, capsys, monkeypatch, query):
    monkeypatch.setenv("HOME", str(tmp_path))  # where an INSTALL that got through would write (~/.duckdb)
    ext = extension_dir() / "sqlite_scanner.duckdb_extension"
    refused(lake, query.format(ext=ext), capsys, "LOAD statements are refused")
    assert not (tmp_path / ".duckdb").exists()


@pytest.mark.parametrize("query", ["SET threads = 1", "SET enable_external_access = true", "RESET threads",
                                   "PRAGMA enable_profiling", "SET allowed_directories = ['/']",
                                   "SET VARIABLE x = 1"])
def test_no_setting_is_changed(lake, capsys, query):
    refused(lake, query, capsys, "evertrain sql is read-only")


def test_duckdb_file_store(tmp_path, capsys):
    """The plain DuckDB file store: SELECTs run, escapes are refused the same way."""
    path = str(tmp_path / "evertrain.duckdb")
    with Store(path) as store:
        store.record_rollback("demo", 2, 1, "sentinel")
    code, out, err = sql(path, "SELECT reason FROM rollbacks", capsys)
    assert code == 0, err
    assert json.loads(out) == [{"reason": "sentinel"}]
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2\n")
    refused(path, f"SELECT * FROM read_text('{secret}')", capsys)
    refused(path, f"COPY rollbacks TO '{tmp_path / 'leak.csv'}'", capsys)
    refused(path, f"SELECT 1; ATTACH '{tmp_path / 'other.duckdb'}' AS other", capsys)
    refused(path, "DELETE FROM rollbacks", capsys)
    assert not (tmp_path / "leak.csv").exists() and not (tmp_path / "other.duckdb").exists()


def test_only_a_store_for_user_sql_checks_extension_signatures(lake):
    # the store's own connections skip DuckDB's signature check of the extensions it loads (the pip wheels' own
    # files: hashing them cost 0.37 of a store open's 0.42 CPU-seconds); a user's SQL runs on a connection that
    # keeps it, and read_sql refuses a store opened without it
    setting = "SELECT current_setting('allow_unsigned_extensions')"
    with Store(lake, read_only=True, user_sql=True) as store:
        assert store.scalar(setting) is False
    with Store(lake, read_only=True) as store:
        assert store.scalar(setting) is True
        assert store.scalar("SELECT current_setting('threads')") == 1  # its statements are small (STORE_THREADS)
        with pytest.raises(StoreError, match="user_sql=True"):
            store.read_sql("SELECT 1")
