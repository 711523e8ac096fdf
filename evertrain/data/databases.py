"""SQL against the databases beside the store: MLflow's SQLite registry and a PostgreSQL server's catalog.

Kept here so that the data package stays the only code that speaks SQL (tests/test_layering.py checks it);
the callers (evertrain.portable, evertrain.services) say when and why, these functions say how.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

# the MLflow columns holding artifact locations (MLflow makes them absolute on write)
_MLFLOW_LOCATIONS = (("experiments", "artifact_location"), ("runs", "artifact_uri"), ("model_versions", "source"),
                     ("model_versions", "storage_location"), ("logged_models", "artifact_location"))


def rebase_mlflow_locations(db_file: Path, old: str, new: str) -> int:
    """Rewrite every artifact location in MLflow's SQLite database ``db_file`` that is ``old`` or lies under it
    to lie under ``new``, in one transaction; the number of rows changed."""
    changed = 0
    con = sqlite3.connect(db_file)
    try:
        with con:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            for table, column in _MLFLOW_LOCATIONS:
                if table not in tables:
                    continue
                columns = {row[1] for row in con.execute(f"PRAGMA table_info({table})")}
                if column not in columns:
                    continue
                # exact match or a child path only: /a/demo must not rewrite /a/demo2
                cursor = con.execute(
                    f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                    f"WHERE {column} = ? OR substr({column}, 1, ?) = ?",
                    [new, len(old) + 1, old, len(old) + 1, old + "/"])
                changed += cursor.rowcount
    finally:
        con.close()
    return changed


def create_postgres_databases(host: str, port: int, names: tuple[str, ...] | list[str]) -> None:
    """Create each database of ``names`` the PostgreSQL server at ``host:port`` lacks (as user postgres)."""
    # late: psycopg2, for a PostgreSQL store only; the CLI imports this module through services
    import psycopg2

    con = psycopg2.connect(host=host, port=port, user="postgres", dbname="postgres")
    con.autocommit = True  # CREATE DATABASE refuses to run inside a transaction
    try:
        with con.cursor() as cursor:
            for name in names:
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
                if cursor.fetchone() is None:
                    cursor.execute(f'CREATE DATABASE "{name}"')
    finally:
        con.close()
