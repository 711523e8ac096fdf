"""What one store call costs: opening the store, a one-row replace (a stage's record), a small read.

Each is timed (CPU and wall, per call) on a DuckLake store with a SQLite catalog, for the settings of the store's
own connections and for DuckDB's defaults: the extension signature check on load (``allow_unsigned_extensions``)
and the thread count. The stages of a test campaign spent 56% of their in-process CPU in such calls (py-spy over
the whole suite, docs/benchmarks/tests.md), so their cost per call is what the suite and a campaign's bookkeeping
pay again and again.

    .venv/bin/python benchmarks/store_ops.py [--calls 200] [--save store_ops_<machine>]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, save
from evertrain.data.store import LAKE, extension_dir


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _per_call(calls: int, body: Callable[[int], Any]) -> tuple[float, float]:
    """(CPU ms, wall ms) per call of ``body(i)``, over ``calls`` calls."""
    cpu, wall = _cpu(), time.perf_counter()
    for i in range(calls):
        body(i)
    return 1000 * (_cpu() - cpu) / calls, 1000 * (time.perf_counter() - wall) / calls


def _connect(folder: Path, check_signatures: bool, threads: int | None) -> duckdb.DuckDBPyConnection:
    config: dict[str, Any] = {"autoinstall_known_extensions": False, "autoload_known_extensions": False,
                              "allow_unsigned_extensions": not check_signatures}
    if threads:
        config["threads"] = threads
    con = duckdb.connect(config=config)
    for name in ("ducklake", "sqlite_scanner"):
        con.execute(f"LOAD '{extension_dir() / f'{name}.duckdb_extension'}'")
    con.execute(f"ATTACH 'ducklake:sqlite:{folder / 'catalog.sqlite'}' AS {LAKE} "
                f"(DATA_PATH '{folder / 'files'}', META_JOURNAL_MODE 'WAL')")
    con.execute(f"USE {LAKE}")
    return con


def measure(calls: int, check_signatures: bool, threads: int | None) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="evertrain-store-ops-"))
    con = _connect(folder, check_signatures, threads)
    con.execute("CREATE TABLE stage_runs (campaign VARCHAR, iteration INTEGER, stage VARCHAR, status VARCHAR, "
                "metrics VARCHAR)")

    def replace(i: int) -> None:  # what Store.record_stage does: one transaction, delete then insert
        con.execute("BEGIN TRANSACTION")
        con.execute("DELETE FROM stage_runs WHERE campaign = 'c' AND iteration = ? AND stage = 's'", [i % 50])
        con.execute("INSERT INTO stage_runs VALUES ('c', ?, 's', 'completed', '{}')", [i % 50])
        con.execute("COMMIT")

    write_cpu, write_wall = _per_call(calls, replace)
    read_cpu, read_wall = _per_call(calls, lambda i: con.execute(
        "SELECT * FROM stage_runs WHERE campaign = 'c' AND iteration = ?", [i % 50]).fetchall())
    con.close()
    opens = max(5, calls // 20)
    open_cpu, open_wall = _per_call(opens, lambda i: _connect(folder, check_signatures, threads).close())
    return {"signatures_checked": check_signatures, "threads": threads or "default",
            "open_cpu_ms": open_cpu, "open_wall_ms": open_wall, "replace_cpu_ms": write_cpu,
            "replace_wall_ms": write_wall, "read_cpu_ms": read_cpu, "read_wall_ms": read_wall,
            "data_files": sum(1 for _ in (folder / "files").rglob("*.parquet"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls timed per operation and setting")
    parser.add_argument("--save", default=None, help="benchmarks/results/<name>.json (default: do not save)")
    args = parser.parse_args()
    rows = [measure(args.calls, check, threads) for check, threads in ((True, None), (False, None), (False, 1))]
    print_table(rows, ["signatures_checked", "threads", "open_cpu_ms", "open_wall_ms", "replace_cpu_ms",
                       "replace_wall_ms", "read_cpu_ms", "read_wall_ms", "data_files"])
    if args.save:
        print(save(args.save, {"calls": args.calls, "rows": rows,
                               "store_connections": "signatures not checked, threads 1 (evertrain.data.store)"}))


if __name__ == "__main__":
    main()
