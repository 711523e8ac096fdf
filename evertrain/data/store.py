"""The trajectory store: every problem, rollout, reward, evaluation and decision, in one DuckDB file.

One process writes at a time (DuckDB locks the file against other processes, readers included), so the
flow's process owns one connection and every stage writes through it. Writes are bulk (pandas frames
scanned by DuckDB, never ``executemany``) and rerun-safe: a stage deletes the rows of its own key scope
and inserts the new ones in one transaction, so rerunning a stage never duplicates a row and a crash
mid-write never leaves half of one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from evertrain import faults

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_info (version INTEGER);

CREATE TABLE IF NOT EXISTS problems (
    campaign VARCHAR, iteration INTEGER, problem_id VARCHAR,
    env VARCHAR, split VARCHAR, prompt VARCHAR, payload JSON, messages JSON,
    created_at TIMESTAMPTZ,
    PRIMARY KEY (campaign, iteration, problem_id)
);

CREATE TABLE IF NOT EXISTS rollouts (
    campaign VARCHAR, iteration INTEGER, problem_id VARCHAR, sample INTEGER,
    env VARCHAR, policy_version INTEGER,
    prompt_text VARCHAR, completion VARCHAR,
    prompt_ids INTEGER[], completion_ids INTEGER[], logprobs FLOAT[],
    loss_mask UTINYINT[], turns JSON, finish_reason VARCHAR,
    prompt_tokens INTEGER, completion_tokens INTEGER, tool_calls INTEGER, tool_errors INTEGER, rework INTEGER,
    generated_at TIMESTAMPTZ,
    reward DOUBLE, passed BOOLEAN, reason VARCHAR, detail JSON, scored_at TIMESTAMPTZ,
    PRIMARY KEY (campaign, iteration, problem_id, sample)
);

CREATE TABLE IF NOT EXISTS evals (
    campaign VARCHAR, iteration INTEGER, model_version INTEGER, role VARCHAR,
    problem_id VARCHAR, sample INTEGER, env VARCHAR,
    completion VARCHAR, completion_tokens INTEGER, turns JSON, tool_calls INTEGER, tool_errors INTEGER,
    rework INTEGER, reward DOUBLE, passed BOOLEAN, reason VARCHAR, reused_from INTEGER,
    created_at TIMESTAMPTZ,
    PRIMARY KEY (campaign, iteration, model_version, problem_id, sample)
);

CREATE TABLE IF NOT EXISTS promotions (
    campaign VARCHAR, iteration INTEGER,
    challenger_version INTEGER, champion_version INTEGER, promoted BOOLEAN,
    challenger_pass1 DOUBLE, champion_pass1 DOUBLE, p_better DOUBLE, gain_low DOUBLE, gain_high DOUBLE,
    per_env JSON, reason VARCHAR, reset_trainee BOOLEAN, decided_at TIMESTAMPTZ,
    PRIMARY KEY (campaign, iteration)
);

CREATE TABLE IF NOT EXISTS stage_runs (
    campaign VARCHAR, iteration INTEGER, stage VARCHAR, status VARCHAR,
    started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ, wall_s DOUBLE, cpu_s DOUBLE,
    metrics JSON, flow_run_id VARCHAR, error VARCHAR,
    PRIMARY KEY (campaign, iteration, stage)
);

CREATE TABLE IF NOT EXISTS model_versions (
    campaign VARCHAR, version INTEGER, iteration INTEGER, kind VARCHAR,
    path VARCHAR, parent_version INTEGER, created_at TIMESTAMPTZ,
    PRIMARY KEY (campaign, version)
);

CREATE TABLE IF NOT EXISTS campaigns (
    campaign VARCHAR PRIMARY KEY, config JSON, updated_at TIMESTAMPTZ
);

CREATE TABLE IF NOT EXISTS campaign_state (
    campaign VARCHAR PRIMARY KEY, trainee_version INTEGER, updated_at TIMESTAMPTZ
);

CREATE TABLE IF NOT EXISTS env_validations (
    env VARCHAR, options JSON, ok BOOLEAN, checked INTEGER, failures JSON, validated_at TIMESTAMPTZ,
    PRIMARY KEY (env, options)
);

CREATE TABLE IF NOT EXISTS rollbacks (
    campaign VARCHAR, rolled_back_at TIMESTAMPTZ, from_version INTEGER, to_version INTEGER, reason VARCHAR,
    PRIMARY KEY (campaign, rolled_back_at)
);

CREATE TABLE IF NOT EXISTS sandbox_runs (
    run_id VARCHAR PRIMARY KEY, campaign VARCHAR, iteration INTEGER, purpose VARCHAR,
    code_sha256 VARCHAR, limits JSON, exit_code INTEGER, signal INTEGER,
    wall_s DOUBLE, cpu_s DOUBLE, peak_rss_kb BIGINT, stdout_bytes BIGINT, stderr_bytes BIGINT,
    limit_hit VARCHAR, started_at TIMESTAMPTZ
);
"""

TABLES = ("problems", "rollouts", "evals", "promotions", "stage_runs", "model_versions",
          "campaigns", "campaign_state", "env_validations", "rollbacks", "sandbox_runs")


class StoreError(RuntimeError):
    """The store cannot be opened or written; the message says why and what to do."""


def now() -> datetime:
    return datetime.now(UTC)


def to_json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


class Store:
    """The DuckDB file of one deployment. Use one instance per process (see :func:`open_store`)."""

    def __init__(self, path: str | Path, read_only: bool = False) -> None:
        self.path = Path(path)
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif not self.path.exists():
            raise StoreError(f"store {self.path} does not exist yet: run a campaign first")
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except duckdb.IOException as error:
            if "lock" in str(error).lower():
                raise StoreError(
                    f"store {self.path} is in use by another process (DuckDB allows one writer): wait for "
                    f"that campaign to finish, or read its Parquet export. DuckDB said: {error}"
                ) from None
            raise StoreError(f"cannot open store {self.path}: {error}") from None
        except duckdb.Error as error:
            raise StoreError(f"{self.path} is not a usable DuckDB store: {error}") from None
        self._lock = threading.RLock()
        if not read_only:
            self.con.execute(SCHEMA)
            if not self.con.execute("SELECT count(*) FROM schema_info").fetchone()[0]:
                self.con.execute("INSERT INTO schema_info VALUES (?)", [SCHEMA_VERSION])

    def close(self) -> None:
        self.con.close()

    # --- reading -------------------------------------------------------------------------------
    def query(self, sql: str, params: list[Any] | None = None) -> pd.DataFrame:
        """Run SQL and return the whole result as a frame (results must be fetched before the next call)."""
        with self._lock:
            return self.con.execute(sql, params or []).df()

    def scalar(self, sql: str, params: list[Any] | None = None) -> Any:
        with self._lock:
            row = self.con.execute(sql, params or []).fetchone()
        return None if row is None else row[0]

    def counts(self) -> dict[str, int]:
        """Row count of every table: what rerun-safety tests compare."""
        return {table: int(self.scalar(f"SELECT count(*) FROM {table}")) for table in TABLES}

    # --- writing -------------------------------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._lock:
            self.con.execute("BEGIN TRANSACTION")
            try:
                yield self.con
            except BaseException:
                self.con.execute("ROLLBACK")
                raise
            faults.maybe_kill("before_commit")
            self.con.execute("COMMIT")

    def replace(self, table: str, scope: Mapping[str, Any], rows: pd.DataFrame | list[dict[str, Any]]) -> int:
        """Delete the rows of ``table`` matching ``scope`` and insert ``rows``, atomically."""
        frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
        where = " AND ".join(f"{column} = ?" for column in scope) or "TRUE"
        with self.transaction() as con:
            con.execute(f"DELETE FROM {table} WHERE {where}", list(scope.values()))
            if len(frame):
                _insert(con, table, frame, "INSERT")
        return len(frame)

    def append(self, table: str, rows: pd.DataFrame | list[dict[str, Any]]) -> int:
        """Insert rows whose keys are new (the audit tables), replacing any with the same key."""
        frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
        if not len(frame):
            return 0
        with self.transaction() as con:
            _insert(con, table, frame, "INSERT OR REPLACE")
        return len(frame)

    def update_rollout_scores(self, campaign: str, iteration: int, scores: pd.DataFrame) -> int:
        """Write rewards and verdicts onto existing rollout rows (keys: problem_id, sample)."""
        with self.transaction() as con:
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
        return len(scores)

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

    def model_version(self, campaign: str, version: int) -> dict[str, Any]:
        frame = self.query("SELECT * FROM model_versions WHERE campaign = ? AND version = ?",
                           [campaign, version])
        if frame.empty:
            raise StoreError(f"campaign {campaign!r} has no model version {version} in the store")
        return frame.iloc[0].to_dict()


_open: dict[Path, Store] = {}
_open_lock = threading.Lock()


def open_store(path: str | Path) -> Store:
    """The process's one writable connection to the store at ``path`` (opened on first use)."""
    key = Path(path).resolve()
    with _open_lock:
        if key not in _open:
            _open[key] = Store(key)
        return _open[key]


def close_store(path: str | Path) -> None:
    """Close the process's connection to ``path`` so another process may open the file."""
    with _open_lock:
        store = _open.pop(Path(path).resolve(), None)
    if store is not None:
        store.close()


def _insert(con: duckdb.DuckDBPyConnection, table: str, frame: pd.DataFrame, verb: str) -> None:
    """``verb`` (INSERT, INSERT OR REPLACE) every row of ``frame`` into ``table``, matching columns by name."""
    columns = ", ".join(frame.columns)
    con.register("_incoming", frame)
    try:
        con.execute(f"{verb} INTO {table} ({columns}) SELECT {columns} FROM _incoming")
    finally:
        con.unregister("_incoming")
