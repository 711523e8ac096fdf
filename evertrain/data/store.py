"""The trajectory store: every problem, rollout, reward, evaluation and decision, behind one URI.

Where it lives is one setting, ``paths.store`` (or ``EVERTRAIN_STORE``):

``ducklake:sqlite:data/evertrain.sqlite`` (the default)
    DuckLake: a SQLite catalog file plus Parquet data files beside it (``data/evertrain.files/``).
    Any number of processes read consistent snapshots while a campaign writes (a plain DuckDB file
    refuses even a read-only connection from another process while its writer holds it).
``ducklake:postgres:dbname=evertrain host=db port=5432 user=u?data_path=/shared/lake/``
    The same tables with the catalog in PostgreSQL and the data files on a path every machine sees:
    what a team runs. ``?data_path=`` names the data folder (required here).
``data/evertrain.duckdb`` (any other value: a file path)
    The previous store, one DuckDB file: one process at a time, readers included.

Writes are bulk (pandas frames scanned by DuckDB, never ``executemany``) and rerun-safe: a stage
deletes the rows of its own key scope and inserts the new ones in one transaction, so rerunning a
stage never duplicates a row and a crash mid-write (SIGKILL included) leaves either the old rows or
the new ones: a DuckLake commit is one catalog transaction that makes the already written Parquet
files visible, so a killed writer leaves at most unreferenced files, which ``compact`` deletes.
DuckLake has no primary keys, so the keys below are kept by the code: every insert first deletes
the rows with the same key, in the same transaction.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import duckdb_ext  # type: ignore[import-not-found]  # namespace package of the duckdb-ext-* wheels
import pandas as pd
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential, wait_incrementing

from evertrain import faults
from evertrain.data import schema
from evertrain.data.queries import Queries

DEFAULT_STORE = "ducklake:sqlite:data/evertrain.sqlite"
LAKE = "lake"  # the name the DuckLake catalog is attached as (and made the default database)

TABLES = ("problems", "rollouts", "evals", "promotions", "stage_runs", "model_versions",
          "campaigns", "campaign_state", "env_validations", "rollbacks", "sandbox_runs", "mix", "sft_examples",
          "approvals", "traces", "trace_feedback", "curriculum", "broad_sealed", "api_keys", "api_key_events",
          "approval_attempts")

SCHEMA_VERSION = schema.LATEST
SCHEMA = schema.ddl()  # the latest tables' DDL, for reading (the store is made by evertrain.data.schema.migrate)
# each table's key columns: DuckLake has no primary keys, so the code keeps them (every insert deletes its keys first)
KEYS = {name: table.key for name, table in schema.tables().items() if table.key}


def _columns_from_schema(ddl: str) -> dict[str, list[tuple[str, str]]]:
    """Each table's (column, type) pairs read back from rendered DDL (an independent check for the docs test)."""
    columns: dict[str, list[tuple[str, str]]] = {}
    for table, body in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\);", ddl, re.S):
        body = re.sub(r",\s*PRIMARY KEY \([^)]*\)", "", body)
        columns[table] = [tuple(part.split(None, 1)) for part in (p.strip() for p in body.split(",")) if part]
    return columns


class StoreError(RuntimeError):
    """The store cannot be opened or written; the message says why and what to do."""


def now() -> datetime:
    return datetime.now(UTC)


def to_json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def extension_dir() -> Path:
    """Where the DuckDB extension wheels (duckdb-ext-ducklake, -sqlite, -postgres) put their files."""
    base = Path(next(iter(duckdb_ext.__path__)))
    return base / "extensions" / f"v{duckdb.__version__}" / "linux_amd64"


@dataclass(frozen=True)
class StoreLocation:
    """A parsed ``paths.store`` value (see the module docstring for the three forms)."""

    kind: str  # "ducklake" or "duckdb"
    catalog: str = ""  # "sqlite" or "postgres"
    target: str = ""  # the SQLite catalog file, the Postgres connection string, or the DuckDB file
    data_path: str = ""

    @classmethod
    def parse(cls, uri: str | Path, base: Path | None = None) -> StoreLocation:
        """Parse ``uri``; relative paths in it are taken relative to ``base`` (default: the working directory)."""
        text = str(uri)

        def absolute(path: str) -> str:
            return str((Path(base) / path if base is not None else Path(path)).resolve())

        if not text.startswith("ducklake:"):
            scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):", text)
            if scheme:  # "duckdb:///x.duckdb", "postgres://...": would silently become a folder named "duckdb:"
                raise StoreError(f"store URI {text!r}: unknown scheme {scheme.group(1)!r}; a DuckDB store is a plain "
                                 "file path (data/evertrain.duckdb), a DuckLake one ducklake:sqlite:<file> or "
                                 "ducklake:postgres:<connection string>?data_path=<folder>")
            return cls("duckdb", target=absolute(text))
        rest, _, data_path = text.removeprefix("ducklake:").partition("?data_path=")
        catalog, _, target = rest.partition(":")
        if catalog == "sqlite":
            if not target:
                raise StoreError(f"store URI {text!r} names no SQLite catalog file: ducklake:sqlite:<file>")
            target = absolute(target)
            data_path = absolute(data_path) if data_path else str(Path(target).with_suffix(".files"))
        elif catalog == "postgres":
            if not data_path:
                raise StoreError(f"store URI {text!r} has no data path: a Postgres catalog is shared by machines, "
                                 "so name a folder they all see, e.g. '...?data_path=/shared/evertrain-lake/'")
            if "://" not in data_path:
                data_path = absolute(data_path)
        else:
            raise StoreError(f"store URI {text!r}: the catalog must be 'sqlite' or 'postgres' "
                             "(ducklake:sqlite:<file> or ducklake:postgres:<connection string>?data_path=<folder>)")
        return cls("ducklake", catalog, target, data_path.rstrip("/") + "/")

    @property
    def uri(self) -> str:
        """The absolute URI (what a flow run started from another directory must be given)."""
        if self.kind == "duckdb":
            return self.target
        default = self.catalog == "sqlite" and self.data_path == f"{Path(self.target).with_suffix('.files')}/"
        suffix = "" if default else f"?data_path={self.data_path}"
        return f"ducklake:{self.catalog}:{self.target}{suffix}"

    def describe(self) -> str:
        if self.kind == "duckdb":
            return f"DuckDB file {self.target}"
        where = self.target if self.catalog == "sqlite" else _hide_password(self.target)
        return f"DuckLake ({self.catalog} catalog {where}, data {self.data_path})"

    def exists(self) -> bool:
        """Whether there is anything to read yet (a Postgres catalog is assumed to exist)."""
        if self.kind == "duckdb" or self.catalog == "sqlite":
            return Path(self.target).exists()
        return True


def resolve_uri(uri: str | Path, base: Path | None = None) -> str:
    """``uri`` with its relative paths made absolute (against ``base``, default: the working directory)."""
    return StoreLocation.parse(uri, base).uri


def _hide_password(conninfo: str) -> str:
    return re.sub(r"password=\S+", "password=***", conninfo)


# DuckDB threads for the store's own connections. Its statements are small (a stage's row, a champion look-up, a
# batch of rollouts): a second thread's synchronisation costs more than it computes. Measured on a DuckLake
# store with a SQLite catalog (AMD EPYC, 2 cores; benchmarks/store_ops.py): a one-row replace took 14.3 CPU-ms
# with one thread against 18.5 with two, a small read 7.4 against 8.2. A user's own SQL (`evertrain sql`) runs
# with DuckDB's default (every core).
STORE_THREADS = 1


def connect_lake(location: StoreLocation, read_only: bool = False,
                 con: duckdb.DuckDBPyConnection | None = None,
                 check_signatures: bool = False) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the DuckLake store attached as ``lake`` and used by default.

    This is also the notebook recipe: ``con = connect_lake(StoreLocation.parse(uri), read_only=True)``.
    The extensions are loaded from the installed wheels by path: nothing is downloaded (this machine
    has no internet, and autoinstall would try).

    DuckDB checks an extension's signature on every LOAD by hashing the whole file: about 0.18 CPU-seconds for
    each of the two 50 MB files, 0.37 of a store open's 0.42 (AMD EPYC). The files are the pip wheels' own, as
    trusted as DuckDB's library beside them, so the store's connections skip the check
    (``allow_unsigned_extensions``, a setting fixed when the connection is made). ``check_signatures=True``
    keeps it, for a connection that runs a user's SQL (``evertrain sql``), which also keeps DuckDB's default
    thread count (the store's own connections use :data:`STORE_THREADS`).
    """
    if con is None:
        config: dict[str, Any] = {"autoinstall_known_extensions": False, "autoload_known_extensions": False,
                                  "allow_unsigned_extensions": not check_signatures}
        if not check_signatures:
            config["threads"] = STORE_THREADS
        con = duckdb.connect(config=config)
    folder = extension_dir()
    scanner = "sqlite_scanner" if location.catalog == "sqlite" else "postgres_scanner"
    for name in ("ducklake", scanner):
        path = folder / f"{name}.duckdb_extension"
        if not path.exists():
            raise StoreError(f"DuckDB extension {name} is not installed ({path} missing): "
                             f"pip install duckdb-ext-{name.removesuffix('_scanner')}=={duckdb.__version__}.20260205")
        con.execute(f"LOAD '{path}'")
    if location.catalog == "sqlite":
        catalog = Path(location.target)
        if read_only and not catalog.exists():
            raise StoreError(f"store {location.describe()} does not exist yet: run a campaign first")
        catalog.parent.mkdir(parents=True, exist_ok=True)
        if not location.data_path.startswith(("s3://", "gs://", "az://")):
            Path(location.data_path).mkdir(parents=True, exist_ok=True)
        _follow_moved_data(catalog, location.data_path)  # readers too: `evertrain report` first after a move
    options = [f"DATA_PATH '{location.data_path}'"]
    if read_only:
        options.append("READ_ONLY")
    if location.catalog == "sqlite":
        # write-ahead logging: readers never block a writer nor a writer readers (see SQLITE_BUSY_MS below)
        options += [f"META_BUSY_TIMEOUT {SQLITE_BUSY_MS}"] + ([] if read_only else ["META_JOURNAL_MODE 'WAL'"])
    target = location.target.replace("'", "''")
    con.execute(f"ATTACH 'ducklake:{location.catalog}:{target}' AS {LAKE} ({', '.join(options)})")
    con.execute(f"USE {LAKE}")
    return con


# what `evertrain sql` (Store.read_sql) may run: one SELECT (SHOW, DESCRIBE, SUMMARIZE and FROM ... parse as
# SELECTs; PRAGMA show_tables does too, but json_serialize_sql cannot check it, so it is refused); EXPLAIN is
# refused, as EXPLAIN ANALYZE runs the statement it explains
READ_STATEMENTS = frozenset({duckdb.StatementType.SELECT})
# functions a SELECT may call that write or reach past the store: DuckLake's maintenance (expire, cleanup and
# orphan deletion remove files from the data folder), the SQLite/Postgres scanners (attach or query any
# database file, run SQL on the catalog) and query()/query_table(), which run SQL given as a string
REFUSED_FUNCTION_PREFIXES = ("ducklake_", "sqlite_", "postgres_")
REFUSED_FUNCTIONS = frozenset({"query", "query_table"})
# DuckLake's functions that only read the catalog: allowed despite their prefix
READ_FUNCTIONS = frozenset({"ducklake_snapshots", "ducklake_table_info", "ducklake_list_files",
                            "ducklake_table_changes", "ducklake_table_insertions", "ducklake_table_deletions",
                            "ducklake_current_snapshot", "ducklake_last_committed_snapshot", "ducklake_options"})


def _function_names(tree: Any) -> Iterator[str]:
    """Every function name in a statement parsed by ``json_serialize_sql`` (scalar and table functions)."""
    if isinstance(tree, dict):
        name = tree.get("function_name")
        if isinstance(name, str):
            yield name.lower()
        for value in tree.values():
            yield from _function_names(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _function_names(value)


def refuse_unless_read(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Raise :class:`StoreError` unless ``sql`` is one SELECT calling no function that writes or reaches
    past the store (see ``REFUSED_FUNCTIONS``); what this lets through also runs under :func:`lock_down`."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as error:
        raise StoreError(f"query does not parse: {error}") from None
    if len(statements) != 1:
        raise StoreError(f"evertrain sql runs one statement at a time, this has {len(statements)}: it is "
                         "read-only, so a second statement could only be a refused one or a lost result")
    kind = statements[0].type
    if kind not in READ_STATEMENTS:
        raise StoreError(f"evertrain sql is read-only: {kind.name} statements are refused (only SELECT, "
                         "SHOW, DESCRIBE and SUMMARIZE run; the store is written only by evertrain's own commands)")
    parsed = json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0])
    if parsed.get("error"):
        raise StoreError(f"evertrain sql is read-only: this statement cannot be checked, so it is refused "
                         f"({parsed.get('error_message', 'unknown')})")
    for name in _function_names(parsed["statements"]):
        if name in REFUSED_FUNCTIONS or (name.startswith(REFUSED_FUNCTION_PREFIXES) and name not in READ_FUNCTIONS):
            raise StoreError(f"evertrain sql is read-only: function {name}() is refused (it may write, run "
                             "other SQL, or read outside the store)")


def lock_down(con: duckdb.DuckDBPyConnection, location: StoreLocation) -> None:
    """Confine a connection that has the store attached to reading the store's own files: no other file,
    no extension, no setting changed afterwards (``enable_external_access`` off, ``lock_configuration`` on).

    DuckLake reads its Parquet files through DuckDB's file system, so the data folder stays allowed
    (``allowed_directories``); the SQLite catalog and a DuckDB file are open already.
    """
    if location.kind == "ducklake":
        con.execute("SET allowed_directories = ?", [[location.data_path]])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def _follow_moved_data(catalog: Path, data_path: str) -> None:
    """Point a SQLite catalog at its data folder's new place after the store was moved or copied.

    DuckLake records its data path as an absolute string (every data file is stored relative to it), and
    refuses to attach with another one; a copied ``data/`` folder would otherwise need OVERRIDE_DATA_PATH on
    every connection, readers included. Rewritten only when the new folder exists (the files came along).
    """
    if not Path(data_path).is_dir():
        return
    if not catalog.exists():
        return
    # closed at once, not merely committed (sqlite3's context manager does not close): Python's copy of
    # SQLite must not keep the file open beside DuckDB's own copy, or closing it later drops the POSIX
    # locks DuckDB's copy holds on the file, and concurrent writers can corrupt the catalog
    db = sqlite3.connect(catalog, timeout=30)
    try:
        try:
            row = db.execute("SELECT value FROM ducklake_metadata WHERE key = 'data_path'").fetchone()
        except sqlite3.OperationalError:  # a new catalog: DuckLake creates its tables on ATTACH
            return
        if row and row[0] != data_path:
            with db:
                db.execute("UPDATE ducklake_metadata SET value = ? WHERE key = 'data_path'", [data_path])
    finally:
        db.close()


# The SQLite catalog is in write-ahead-log mode (set by the first writer's ATTACH; the mode stays with the file).
# In SQLite's default rollback-journal mode a reader's lock blocks a writer's commit and a writer waiting to commit
# blocks new readers: with three endpoints tracing every second, a campaign and `evertrain sql` on one store, an
# endpoint's commit stalled holding its pending lock and every process then met "database is locked" for good
# (benchmarks/shared_store.py, 2 minutes). With the log, readers read the last commit while a writer writes, and
# writers still take turns (Store._writer_lock). The log lives beside the catalog (``-wal``, ``-shm``): move or
# copy the catalog with them, or after every process closed the store (the last one folds the log back in).
SQLITE_BUSY_MS = 5000  # how long a catalog statement waits for SQLite's lock before "database is locked"
def _retryable(error: BaseException) -> bool:
    """A write that lost a race: another writer committed to the same table, or held the SQLite catalog."""
    if not isinstance(error, duckdb.Error):
        return False
    text = str(error).lower()
    return any(s in text for s in ("conflict", "database is locked", "could not serialize", "deadlock"))


def _lost_races(attempts: int, wait: Any) -> Retrying:
    """Try again what lost a race with another writer (:func:`_retryable`), ``attempts`` times in all, waiting
    ``wait`` between tries; anything else, or the last try's error, is raised as it was."""
    return Retrying(retry=retry_if_exception(_retryable), stop=stop_after_attempt(attempts), wait=wait,
                    reraise=True)


class Store(Queries):
    """The store of one deployment. Whoever opens one closes it (a campaign's :class:`~evertrain.runtime.Runtime`
    owns its own); several instances in one process may share the files (DuckLake, or one DuckDB file)."""

    def __init__(self, path: str | Path, read_only: bool = False, *, user_sql: bool = False) -> None:
        """``user_sql``: this store will run a user's SQL (:meth:`read_sql`), so its connection loads only
        extensions whose signatures check (see :func:`connect_lake`)."""
        self.user_sql = user_sql
        self.location = StoreLocation.parse(path)
        self.lake = self.location.kind == "ducklake"
        self.path = Path(self.location.target) if self.location.kind == "duckdb" or \
            self.location.catalog == "sqlite" else Path(self.location.data_path)
        self.read_only = read_only
        self._lock = threading.RLock()
        self._claims: dict[str, Any] = {}
        self._writes = 0
        self._locked_down = False
        self.migrated: list[int] = []  # the schema versions this open applied (evertrain.data.schema)
        if self.lake:
            self._open_lake()
        else:
            self._open_file()

    def _open_file(self) -> None:
        if not self.read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif not self.path.exists():
            raise StoreError(f"store {self.path} does not exist yet: run a campaign first")
        try:
            self.con = duckdb.connect(str(self.path), read_only=self.read_only,
                                      config={} if self.user_sql else {"threads": STORE_THREADS})
        except duckdb.IOException as error:
            if "lock" in str(error).lower():
                raise StoreError(
                    f"store {self.path} is in use by another process (a DuckDB file allows one process, readers "
                    f"included): wait for that campaign to finish, or use the default DuckLake store "
                    f"({DEFAULT_STORE}), which readers may query while a campaign writes. DuckDB said: {error}"
                ) from None
            raise StoreError(f"cannot open store {self.path}: {error}") from None
        except duckdb.Error as error:
            raise StoreError(f"{self.path} is not a usable DuckDB store: {error}") from None
        if not self.read_only:
            self._migrate()

    def _open_lake(self) -> None:
        try:
            self.con = connect_lake(self.location, read_only=self.read_only, check_signatures=self.user_sql)
        except StoreError:
            raise
        except duckdb.Error as error:
            if self.read_only and "creating a new DuckLake is explicitly disabled" in str(error):
                # the catalog file is there but its first writer has not created the lake in it yet
                raise StoreError(f"store {self.location.describe()} does not exist yet: run a campaign first") \
                    from None
            raise StoreError(f"cannot open store {self.location.describe()}: {error}") from None
        if not self.read_only:
            self._migrate()

    def _migrate(self) -> None:
        """Bring the store's schema up to date (evertrain.data.schema), in one transaction: two processes
        opening an old or new store at once race on it, and the loser's retry finds the store current."""
        # DuckLake's data inlining (small writes kept in the catalog) is left off on purpose: measured here it
        # halved a one-row commit (0.17 s against 0.37 s), but with three concurrent writers replacing their own
        # rows, rows came back duplicated (900 rows for 750 keys; tests/test_store_concurrency.py)
        try:
            self.migrated = self._write(lambda con: schema.migrate(con, self.lake, now), faults_point=None)
        except schema.SchemaTooNew as error:
            self.con.close()
            raise StoreError(
                f"store {self.location.describe()} has schema version {error.found}, newer than this evertrain "
                f"knows (version {error.known}): it was written by a newer evertrain; upgrade evertrain to open it "
                "(readers opened read-only are not refused)") from None

    def close(self) -> None:
        for handle in self._claims.values():
            handle.close()
        self._claims.clear()
        self.con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading -------------------------------------------------------------------------------
    def query(self, sql: str, params: list[Any] | dict[str, Any] | None = None) -> pd.DataFrame:
        """Run SQL and return the whole result as a frame (results must be fetched before the next call)."""
        with self._lock:
            return self._retry_read(lambda: self.con.execute(sql, params or []).df())

    def read_sql(self, sql: str) -> pd.DataFrame:
        """Run a user's SQL read-only for real (``evertrain sql``): the connection is locked down to the store's
        own files first (:func:`lock_down`, for good: this store is for reading after that), and anything but
        one plain SELECT is refused (:func:`refuse_unless_read`) with a :class:`StoreError`."""
        if not self.read_only or not self.user_sql:
            raise StoreError("read_sql needs a store opened with read_only=True, user_sql=True")
        with self._lock:
            if not self._locked_down:
                lock_down(self.con, self.location)
                self._locked_down = True
            refuse_unless_read(self.con, sql)
        try:
            return self.query(sql)
        except duckdb.PermissionException as error:  # a file outside the store: said in one line
            reason = str(error).splitlines()[0].removeprefix("Permission Error: ")
            raise StoreError(f"evertrain sql reads only the store's own files: {reason}") from None

    def records(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        """The rows as dicts; empty when the query fails on a store that predates a table it reads (a report's
        section over a store made by an older evertrain, opened read-only, so not upgraded)."""
        try:
            return self.query(sql, params).to_dict("records")
        except duckdb.Error:
            return []

    def scalar(self, sql: str, params: list[Any] | dict[str, Any] | None = None) -> Any:
        with self._lock:
            row = self._retry_read(lambda: self.con.execute(sql, params or []).fetchone())
        return None if row is None else row[0]

    def snapshot_id(self) -> int | None:
        """The lake's current snapshot: every commit, from any process, moves it, so an unchanged id means nothing
        was written since. A poller's cheap "anything new?" (1.6 CPU-ms against the champion query's 12.9 on a
        smoke campaign's store, AMD EPYC). None for a plain DuckDB file, which has no snapshots."""
        if not self.lake:
            return None
        return int(self.scalar(f"SELECT id FROM ducklake_current_snapshot('{LAKE}')"))

    def _retry_read(self, read: Callable[[], Any]) -> Any:
        """A DuckLake read that met a commit in progress is read again (a DuckDB file has no such race)."""
        if not self.lake:
            return read()
        # 50 tries, 0.02 s doubling to at most 1 s between them (about 40 s in all)
        return _lost_races(50, wait_exponential(multiplier=0.02, max=1.0))(read)

    def counts(self) -> dict[str, int]:
        """Row count of every table: what rerun-safety tests compare."""
        return {table: int(self.scalar(f"SELECT count(*) FROM {table}")) for table in TABLES}

    # --- writing -------------------------------------------------------------------------------
    @contextmanager
    def _writer_lock(self) -> Iterator[None]:
        """Writers to one SQLite catalog take turns (a file lock around each transaction): SQLite has one
        writer at a time anyway, and waiting here is cheaper than DuckLake failing the commit with
        "database is locked" after the Parquet files were written."""
        if not (self.lake and self.location.catalog == "sqlite"):
            yield
            return
        with open(f"{self.location.target}.write-lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _write(self, body: Callable[[duckdb.DuckDBPyConnection], Any], faults_point: str | None = "before_commit",
               attempts: int = 20) -> Any:
        """Run ``body`` in one transaction and commit it, again from the start if it lost a race with
        another writer (DuckLake detects conflicting commits; the loser's transaction is rolled back whole)."""
        def once() -> Any:
            with self._writer_lock():  # released while waiting to try again: other writers may commit meanwhile
                self.con.execute("BEGIN TRANSACTION")
                try:
                    result = body(self.con)
                    if faults_point:
                        faults.maybe_kill(faults_point)
                    self.con.execute("COMMIT")
                except BaseException:
                    _rollback(self.con)
                    raise
                self._writes += 1
                return result

        with self._lock:
            if not self.lake:  # a DuckDB file has one writer process: no race to lose
                return once()
            # ``attempts`` tries, 0.05 s doubling to at most 2 s between them
            return _lost_races(attempts, wait_exponential(multiplier=0.05, max=2.0))(once)

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """One transaction around the caller's statements (not retried: prefer replace/append, which are)."""
        with self._lock, self._writer_lock():
            self.con.execute("BEGIN TRANSACTION")
            try:
                yield self.con
            except BaseException:
                _rollback(self.con)
                raise
            faults.maybe_kill("before_commit")
            self.con.execute("COMMIT")
            self._writes += 1

    def replace(self, table: str, scope: Mapping[str, Any], rows: pd.DataFrame | list[dict[str, Any]]) -> int:
        """Delete the rows of ``table`` matching ``scope`` and insert ``rows``, atomically."""
        frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
        where = " AND ".join(f"{column} = ?" for column in scope) or "TRUE"

        def body(con: duckdb.DuckDBPyConnection) -> None:
            con.execute(f"DELETE FROM {table} WHERE {where}", list(scope.values()))
            if len(frame):
                _insert(con, table, frame, ())

        self._write(body)
        return len(frame)

    def append(self, table: str, rows: pd.DataFrame | list[dict[str, Any]]) -> int:
        """Insert rows whose keys are new (the audit tables), replacing any with the same key."""
        frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
        if not len(frame):
            return 0
        self._write(lambda con: _insert(con, table, frame, KEYS.get(table, ())))
        return len(frame)

    def append_missing(self, table: str, rows: pd.DataFrame | list[dict[str, Any]], key: tuple[str, ...]) -> int:
        """Insert the rows whose ``key`` columns match no row of ``table`` yet (a replayed journal: some of its
        rows may have been committed before, or be in it twice); the number inserted."""
        frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
        frame = frame.drop_duplicates(subset=list(key))  # a row replayed from two copies of one journal
        if not len(frame):
            return 0
        columns = ", ".join(frame.columns)
        match = " AND ".join(f"t.{column} = i.{column}" for column in key)

        def body(con: duckdb.DuckDBPyConnection) -> int:
            con.register("_incoming", frame)
            try:
                return int(con.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM _incoming i "
                                       f"WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE {match})").fetchone()[0])
            finally:
                con.unregister("_incoming")

        return self._write(body)

    def update_rollout_scores(self, campaign: str, iteration: int, scores: pd.DataFrame) -> int:
        """Write rewards and verdicts onto existing rollout rows (keys: problem_id, sample)."""

        def body(con: duckdb.DuckDBPyConnection) -> None:
            con.register("_scores", scores)
            try:
                con.execute(
                    """UPDATE rollouts SET reward = s.reward, passed = s.passed, reason = s.reason,
                           detail = s.detail, scored_at = s.scored_at
                       FROM _scores s
                       WHERE rollouts.campaign = ? AND rollouts.iteration = ?
                         AND rollouts.problem_id = s.problem_id AND rollouts.sample = s.sample""",
                    [campaign, iteration],
                )
            finally:
                con.unregister("_scores")

        self._write(body)
        return len(scores)

    def replace_refills(self, campaign: str, iteration: int, problems: pd.DataFrame | list[dict[str, Any]],
                        rollouts: pd.DataFrame | list[dict[str, Any]]) -> int:
        """Replace one iteration's dynamic-sampling rows (``refill_round >= 1``) in ``problems`` and ``rollouts``
        with the given ones, in one transaction (the score stage's own rows: a rerun never duplicates them)."""
        problem_frame = problems if isinstance(problems, pd.DataFrame) else pd.DataFrame(problems)
        rollout_frame = rollouts if isinstance(rollouts, pd.DataFrame) else pd.DataFrame(rollouts)

        def body(con: duckdb.DuckDBPyConnection) -> None:
            for table, frame in (("problems", problem_frame), ("rollouts", rollout_frame)):
                con.execute(f"DELETE FROM {table} WHERE campaign = ? AND iteration = ? AND refill_round >= 1",
                            [campaign, iteration])
                if len(frame):
                    _insert(con, table, frame, ())

        self._write(body)
        return len(rollout_frame)

    # --- lineage: one transaction per event (MLflow's aliases are projected from these: tracking.py) ----------
    def record_version(self, campaign: str, version: int, iteration: int, kind: str, path: str,
                       parent: int | None, replaces_iteration: bool = True) -> None:
        """``version`` registered for ``iteration`` and made the trainee, in one transaction (replacing the
        versions an earlier run of the iteration registered, unless ``replaces_iteration`` is False)."""
        row = pd.DataFrame([{"campaign": campaign, "version": version, "iteration": iteration, "kind": kind,
                             "path": path, "parent_version": parent, "created_at": now()}])

        def body(con: duckdb.DuckDBPyConnection) -> None:
            if replaces_iteration:
                con.execute("DELETE FROM model_versions WHERE campaign = ? AND iteration = ?", [campaign, iteration])
            _insert(con, "model_versions", row, KEYS["model_versions"])
            _set_trainee(con, campaign, version)

        self._write(body)

    def record_decision(self, campaign: str, iteration: int, decision: Mapping[str, Any],
                        trainee: int | None = None) -> None:
        """The gate's decision for ``iteration`` (a ``promotions`` row, replacing a rerun's) and, when the
        trainee is reset, the new trainee, in one transaction."""
        row = pd.DataFrame([{**decision, "campaign": campaign, "iteration": iteration}])

        def body(con: duckdb.DuckDBPyConnection) -> None:
            con.execute("DELETE FROM promotions WHERE campaign = ? AND iteration = ?", [campaign, iteration])
            _insert(con, "promotions", row, ())
            if trainee is not None:
                _set_trainee(con, campaign, trainee)

        self._write(body)

    def record_rollback(self, campaign: str, from_version: int, to_version: int, reason: str, *,
                        actor: str | None = None, host: str | None = None, unpromoted: bool = False) -> None:
        """A rollback of the champion to ``to_version``, which becomes the trainee too, in one transaction, with
        who made it and from where."""
        row = pd.DataFrame([{"campaign": campaign, "rolled_back_at": now(), "from_version": from_version,
                             "to_version": to_version, "reason": reason, "actor": actor, "host": host,
                             "unpromoted": unpromoted}])

        def body(con: duckdb.DuckDBPyConnection) -> None:
            _insert(con, "rollbacks", row, KEYS["rollbacks"])
            _set_trainee(con, campaign, to_version)

        self._write(body)

    # --- one writer per campaign ------------------------------------------------------------------
    def claim(self, campaign: str) -> None:
        """Make this process the one writer of ``campaign`` until it closes the store or exits.

        Many processes may share a DuckLake store, but two runs of the same campaign would interleave
        its iterations. The claim is a lock the operating system drops when the process dies (SIGKILL
        included), so a crashed run never blocks the next one: an flock on a file beside a SQLite catalog,
        a session-level advisory lock in a Postgres catalog. A DuckDB file is locked whole already.
        """
        if not self.lake or campaign in self._claims:
            return
        if self.location.catalog == "sqlite":
            # held open until close(): the lock lives as long as the file handle
            handle: Any = open(f"{self.location.target}.{_safe(campaign)}.campaign-lock", "a+")  # noqa: SIM115
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                handle.close()
                if holder == str(os.getpid()):
                    raise StoreError(
                        f"campaign {campaign!r} in store {self.location.describe()} is already open in this process "
                        "(another Runtime of it is not closed): close it first, or pass the open one") from None
                raise StoreError(
                    f"campaign {campaign!r} in store {self.location.describe()} is in use by another process "
                    f"(pid {holder}): one run per campaign at a time; wait for it to finish, or stop it. "
                    "Readers (evertrain sql) are never refused.") from None
            handle.truncate(0)
            handle.write(str(os.getpid()))
            handle.flush()
        else:
            # late: psycopg2, for a PostgreSQL store only
            import psycopg2

            handle = psycopg2.connect(self.location.target)
            handle.autocommit = True
            with handle.cursor() as cursor:
                cursor.execute("SELECT pg_try_advisory_lock(hashtext(%s))", [f"evertrain:{campaign}"])
                if not cursor.fetchone()[0]:
                    handle.close()
                    raise StoreError(
                        f"campaign {campaign!r} in store {self.location.describe()} is in use by another process "
                        "(its Postgres advisory lock is held): one run per campaign at a time.")
        self._claims[campaign] = handle

    # --- maintenance ---------------------------------------------------------------------------------
    def compact(self, keep_seconds: float = 3600.0) -> dict[str, Any]:
        """Merge the small Parquet files many small writes leave, then delete the files no snapshot younger
        than ``keep_seconds`` needs (a reader's running query pins its snapshot; an hour is generous).

        DuckLake's own maintenance functions; without them every stage write adds files and a long
        campaign's queries slow down. Returns files and bytes before and after.
        """
        if not self.lake:
            with self._lock:
                self.con.execute("CHECKPOINT")
            return {}
        before = self.disk_usage()
        cutoff = now().timestamp() - keep_seconds
        # DuckLake's own `older_than` of expire_snapshots and cleanup_old_files compares the catalog's timestamps
        # by their date alone (measured on the SQLite catalog, DuckLake 0.3: with older_than = now - 1 h both took
        # a snapshot and files made seconds before; with yesterday 23:59:59 neither). So the snapshots to expire are
        # chosen here, by DuckDB's own comparison, and passed by id; the files earlier compactions scheduled for
        # deletion are deleted before this one schedules more, all at once when every one of them is older than the
        # cutoff (a campaign compacting every few minutes), else those scheduled before the cutoff's day began.
        # keep_seconds <= 0 deletes them all. delete_orphaned_files compares the files' own times, correctly: a
        # writer's uncommitted files stay.
        day_start = datetime.fromtimestamp(cutoff, UTC).replace(hour=0, minute=0, second=0, microsecond=0)

        def scheduled_before() -> None:
            """The files earlier compactions scheduled for deletion (keep_seconds > 0)."""
            young = self.con.execute(
                f"SELECT count(*) FROM __ducklake_metadata_{LAKE}.ducklake_files_scheduled_for_deletion "
                "WHERE CAST(schedule_start AS TIMESTAMPTZ) >= to_timestamp(?)", [cutoff]).fetchone()[0]
            if young:
                self.con.execute(f"CALL ducklake_cleanup_old_files('{LAKE}', older_than => to_timestamp(?))",
                                 [day_start.timestamp() - 1e-3])
            else:
                self.con.execute(f"CALL ducklake_cleanup_old_files('{LAKE}', cleanup_all => true)")

        def maintain() -> None:
            if keep_seconds > 0:
                scheduled_before()
            self.con.execute(f"CALL ducklake_merge_adjacent_files('{LAKE}')")
            expired = [int(row[0]) for row in self.con.execute(
                f"SELECT snapshot_id FROM ducklake_snapshots('{LAKE}') WHERE snapshot_time < to_timestamp(?) "
                f"AND snapshot_id < (SELECT max(snapshot_id) FROM ducklake_snapshots('{LAKE}'))", [cutoff]).fetchall()]
            if expired:
                self.con.execute(f"CALL ducklake_expire_snapshots('{LAKE}', versions => ?)", [expired])
            if keep_seconds <= 0:  # nothing to keep: every scheduled file goes, this compaction's included
                self.con.execute(f"CALL ducklake_cleanup_old_files('{LAKE}', cleanup_all => true)")
            self.con.execute(f"CALL ducklake_delete_orphaned_files('{LAKE}', older_than => to_timestamp(?))", [cutoff])

        with self._lock, self._writer_lock():
            # 20 tries, waiting 0.1 s more each time (0.1, 0.2, ... 1.9 s)
            _lost_races(20, wait_incrementing(start=0.1, increment=0.1))(maintain)
        return {"before": before, "after": self.disk_usage()}

    def disk_usage(self) -> dict[str, int]:
        """Files and bytes under the data path, and the catalog's bytes (a SQLite catalog)."""
        files = [p for p in Path(self.location.data_path).rglob("*") if p.is_file()] if self.lake else [self.path]
        catalog = 0
        if self.lake and self.location.catalog == "sqlite":
            catalog = sum(p.stat().st_size for p in Path(self.location.target).parent.glob(
                Path(self.location.target).name + "*") if p.is_file() and not p.name.endswith("lock"))
        return {"files": len(files), "data_bytes": sum(p.stat().st_size for p in files if p.exists()),
                "catalog_bytes": catalog}

    # --- stage bookkeeping -----------------------------------------------------------------------
    def stage_status(self, campaign: str, iteration: int) -> dict[str, str]:
        frame = self.query("SELECT stage, status FROM stage_runs WHERE campaign = ? AND iteration = ?",
                           [campaign, iteration])
        return dict(zip(frame["stage"], frame["status"], strict=True))

    def record_stage(self, campaign: str, iteration: int, stage: str, status: str, *,
                     started_at: datetime, wall_s: float | None = None, cpu_s: float | None = None,
                     metrics: dict[str, Any] | None = None, flow_run_id: str | None = None,
                     error: str | None = None) -> None:
        finished = now() if status != "running" else None
        self.replace("stage_runs", {"campaign": campaign, "iteration": iteration, "stage": stage}, [{
            "campaign": campaign, "iteration": iteration, "stage": stage, "status": status,
            "started_at": started_at, "finished_at": finished, "wall_s": wall_s, "cpu_s": cpu_s,
            "metrics": to_json(metrics or {}), "flow_run_id": flow_run_id, "error": error,
        }])

    # --- campaign state --------------------------------------------------------------------------
    def campaign_state(self, campaign: str) -> dict[str, Any] | None:
        frame = self.query("SELECT * FROM campaign_state WHERE campaign = ?", [campaign])
        return None if frame.empty else frame.iloc[0].to_dict()

    def set_campaign_state(self, campaign: str, **values: Any) -> None:
        state = self.campaign_state(campaign) or {"campaign": campaign, "trainee_version": None}
        state.update(values, updated_at=now())
        self.replace("campaign_state", {"campaign": campaign}, [state])

    def ancestors(self, campaign: str, start: int, depth: int) -> dict[int, int]:
        """Versions reachable from ``start`` through at most ``depth`` parent links, with their distance
        (the lineage, read from ``model_versions``: the store is its authority)."""
        lags, version = {start: 0}, start
        for distance in range(1, depth + 1):
            parent = self.scalar("SELECT parent_version FROM model_versions WHERE campaign = ? AND version = ?",
                                 [campaign, version])
            if parent is None or parent != parent:  # None or NaN: the base model has no parent
                break
            version = int(parent)
            lags[version] = distance
        return lags

    # --- the endpoint's API keys ------------------------------------------------------------------
    def add_api_key(self, key: Mapping[str, Any], actor: str, host: str) -> None:
        """Store a new API key (``key``: the columns of ``api_keys``, its secret's hash and never the secret) and
        its 'create' audit row, in one transaction; a working key of the same name is refused (StoreError)."""
        row = {column: key.get(column) for column in ("key_id", "name", "prefix", "key_sha256", "scopes",
                                                        "created_at", "created_by")}
        event = {"key_id": row["key_id"], "name": row["name"], "action": "create", "scopes": row["scopes"],
                 "actor": actor, "host": host, "happened_at": row["created_at"]}

        def body(con: duckdb.DuckDBPyConnection) -> None:
            taken = con.execute("SELECT count(*) FROM api_keys WHERE name = ? AND revoked_at IS NULL",
                                [row["name"]]).fetchone()[0]  # type: ignore[index]
            if taken:
                raise StoreError(f"an API key named {row['name']!r} exists and works: revoke it first, or choose "
                                 "another name")
            _insert(con, "api_keys", pd.DataFrame([row]), KEYS["api_keys"])
            _insert(con, "api_key_events", pd.DataFrame([event]), ())

        self._write(body)

    def revoke_api_key(self, name_or_id: str, actor: str, host: str) -> list[dict[str, Any]]:
        """Revoke the working key whose id or name is ``name_or_id`` (an id first), recording who, when and
        from where; the keys revoked (empty: no working key has that id or name)."""
        def body(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
            found = con.execute(
                "SELECT key_id, name, scopes FROM api_keys WHERE revoked_at IS NULL AND key_id = ?",
                [name_or_id]).fetchall() or con.execute(
                "SELECT key_id, name, scopes FROM api_keys WHERE revoked_at IS NULL AND name = ?",
                [name_or_id]).fetchall()
            stamp = now()
            for key_id, _name, _scopes in found:
                con.execute("UPDATE api_keys SET revoked_at = ?, revoked_by = ? WHERE key_id = ?",
                            [stamp, actor, key_id])
            if found:
                _insert(con, "api_key_events", pd.DataFrame([
                    {"key_id": key_id, "name": name, "action": "revoke", "scopes": scopes, "actor": actor,
                     "host": host, "happened_at": stamp} for key_id, name, scopes in found]), ())
            return [{"key_id": key_id, "name": name, "scopes": scopes, "revoked_at": stamp}
                    for key_id, name, scopes in found]

        return self._write(body)

    def model_version(self, campaign: str, version: int) -> dict[str, Any]:
        frame = self.query("SELECT * FROM model_versions WHERE campaign = ? AND version = ?",
                           [campaign, version])
        if frame.empty:
            raise StoreError(f"campaign {campaign!r} has no model version {version} in the store")
        return frame.iloc[0].to_dict()


def _insert(con: duckdb.DuckDBPyConnection, table: str, frame: pd.DataFrame, keys: tuple[str, ...]) -> None:
    """Insert every row of ``frame`` into ``table`` (columns matched by name), first deleting the rows that
    have the same ``keys`` (the INSERT OR REPLACE that DuckLake, having no primary keys, lacks)."""
    columns = ", ".join(frame.columns)
    con.register("_incoming", frame)
    try:
        if keys:
            key_list = ", ".join(keys)
            con.execute(f"DELETE FROM {table} WHERE ({key_list}) IN (SELECT ({key_list}) FROM _incoming)")
        con.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM _incoming")
    finally:
        con.unregister("_incoming")


def _set_trainee(con: duckdb.DuckDBPyConnection, campaign: str, version: int) -> None:
    """Make ``version`` the campaign's trainee (inside the caller's transaction)."""
    _insert(con, "campaign_state", pd.DataFrame([{"campaign": campaign, "trainee_version": version,
                                                  "updated_at": now()}]), KEYS["campaign_state"])


def _rollback(con: duckdb.DuckDBPyConnection) -> None:
    with contextlib.suppress(duckdb.Error):  # a failed commit has already ended the transaction
        con.execute("ROLLBACK")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
