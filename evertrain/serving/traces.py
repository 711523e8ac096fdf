"""Traces: the batched writer, what a request costs, and the live pass rate read back from the store.

The store is DuckLake: one commit writes at least one Parquet file per table it touches, so one commit per
request would leave a file per request. The writer therefore queues rows (already redacted) and commits
them in batches, ``serving.trace_batch_rows`` rows or every ``serving.trace_flush_seconds``, whichever comes
first, and merges the small files every ``serving.compact_seconds`` (:meth:`Store.compact`). A failed
commit is retried with the next batch (the rows stay queued). Each row is first written to the writer's
journal (:mod:`evertrain.serving.journal`, beside a local store), so a process that dies before the commit loses
none: the next writer on the host replays it.

One bad row never blocks the others: every string is made storable before it is queued (an unpaired
surrogate, which UTF-8 cannot encode, is kept as the text of its escape, ``\\udXXX``:
:func:`~evertrain.serving.redact.storable`), and a batch that still fails is split in halves until the rows
that fail alone are found. When any other row of that commit was written (so the store itself works), those
rows are set aside: counted (``failed_rows``), logged with their trace id, and appended to the failed-row
file (JSON lines, ``<store>.trace_failures.jsonl`` beside a local store) instead of being dropped. When
nothing could be written (the store is down), everything stays queued, the rows refused alone moved
last (so a run of bad rows cannot hide the good ones behind it); rows still unwritten when the writer
closes go to that file too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd

from evertrain.config import CampaignConfig
from evertrain.data.store import Store, now, to_json
from evertrain.serving.journal import REPLAY_KEYS, Journal
from evertrain.serving.redact import storable

log = logging.getLogger("evertrain.serving")

TRACE_COLUMNS = ("trace_id", "campaign", "model_version", "model", "env", "problem_id", "problem", "request",
                 "response", "tool_calls", "tools", "status", "http_status", "error", "finish_reason", "latency_ms",
                 "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd", "created_at", "key_id")
FEEDBACK_COLUMNS = ("trace_id", "campaign", "source", "passed", "reward", "detail", "created_at")
SANDBOX_COLUMNS = ("run_id", "campaign", "iteration", "purpose", "code_sha256", "limits", "exit_code", "signal",
                   "wall_s", "cpu_s", "peak_rss_kb", "stdout_bytes", "stderr_bytes", "limit_hit", "started_at")
# JSON text, not plain text
JSON_COLUMNS = frozenset({"problem", "request", "response", "tool_calls", "detail", "limits"})


def request_cost(config: CampaignConfig, *, computed_tokens: int, cached_tokens: int, forward_seconds: float,
                 on_gpu: bool, threads: int) -> float:
    """Dollars one request cost at the campaign's prices (``config.prices``, as the stages' costs are counted):
    the tokens computed and served from cache at their per-million prices, plus the compute time the
    sampler spent on it (GPU-hours on a GPU, else CPU-core-hours for the torch threads it used)."""
    prices = config.prices
    compute = (forward_seconds / 3600 * prices.gpu_hour if on_gpu
               else forward_seconds * threads / 3600 * prices.cpu_core_hour)
    return compute + computed_tokens / 1e6 * prices.million_tokens + cached_tokens / 1e6 * prices.million_cached_tokens


def failed_rows_path(store: Store) -> Path | None:
    """Where the writer keeps rows the store refused: beside a local store (None for a remote data path)."""
    where = str(store.path)
    if "://" in where:
        return None
    return Path(where.rstrip("/") + ".trace_failures.jsonl")


def journal_root(store: Store) -> Path | None:
    """Where trace writers keep their journals: beside a local store (None for a remote data path: no journal)."""
    where = str(store.path)
    if "://" in where:
        return None
    return Path(where.rstrip("/") + ".trace_journal")


class TraceWriter:
    """A background thread that commits queued trace, feedback and sandbox audit rows to the store in batches."""

    def __init__(self, store: Store, *, batch_rows: int = 256, flush_seconds: float = 1.0,
                 compact_seconds: float = 300.0, compact_keep_seconds: float = 600.0,
                 failed_path: Path | None = None, journal: bool = True) -> None:
        self.store = store
        self.failed_path = failed_path if failed_path is not None else failed_rows_path(store)
        root = journal_root(store) if journal else None
        self.journal: Journal | None = None
        if root is not None:
            try:
                self.journal = Journal(root)
            except OSError as error:
                log.error("trace writer: no journal (%s): rows queued when this process dies will be lost", error)
        self.batch_rows, self.flush_seconds = batch_rows, flush_seconds
        self.compact_seconds, self.compact_keep_seconds = compact_seconds, compact_keep_seconds
        self._queue: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._pending: dict[str, list[dict[str, Any]]] = {"traces": [], "trace_feedback": [], "sandbox_runs": []}
        # rows of dead writers' journals, inserted only where the store lacks them (Store.append_missing)
        self._replay: dict[str, list[dict[str, Any]]] = {table: [] for table in self._pending}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self.commits = 0
        self.rows_written = 0
        self.compactions = 0
        self.errors = 0
        self.failed_rows = 0  # rows the store refused alone while others were written: in failed_path, not stored
        self.replayed_rows = 0  # rows of dead writers' journals taken for replay (some may have been stored already)
        if self.journal is not None:
            self._replay = self.journal.adopt()
            self.replayed_rows = sum(len(rows) for rows in self._replay.values())
            if self.replayed_rows:
                log.warning("trace writer: replaying %d rows that a writer which died before committing them left in "
                            "%s", self.replayed_rows, self.journal.root)
        self._thread = threading.Thread(target=self._run, name="evertrain-trace-writer", daemon=True)
        self._thread.start()

    def add_trace(self, row: dict[str, Any]) -> None:
        self._put("traces", {c: row.get(c) for c in TRACE_COLUMNS})

    def add_feedback(self, row: dict[str, Any]) -> None:
        self._put("trace_feedback", {c: row.get(c) for c in FEEDBACK_COLUMNS})

    def add_sandbox_run(self, row: dict[str, Any]) -> None:
        """An audit row of a sandboxed process the endpoint ran (its verifiers' graders)."""
        self._put("sandbox_runs", {c: row.get(c) for c in SANDBOX_COLUMNS})

    def _put(self, table: str, row: dict[str, Any]) -> None:
        row = {k: storable(v, json_text=k in JSON_COLUMNS) if isinstance(v, str) else v for k, v in row.items()}
        if self.journal is None:
            self._queue.put((table, row))
        else:
            with self.journal.lock:  # on disk before it is queued (and so before the response is sent)
                self.journal.write(table, row)
                self._queue.put((table, row))
        if self._queue.qsize() >= self.batch_rows:
            self._wake.set()

    def backlog(self) -> int:
        """Rows queued or waiting for a commit (replayed ones included)."""
        return self._queue.qsize() + sum(len(rows) for pending in (self._pending, self._replay)
                                         for rows in pending.values())

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every row queued so far is committed (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.backlog() and time.monotonic() < deadline:
            self._wake.set()
            with self._idle:
                self._idle.wait(0.05)
        return not self.backlog()

    def close(self, timeout: float = 30.0) -> None:
        """Commit what is queued and stop; rows the store still refuses then go to the failed-row file."""
        self.flush(timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._drain()
            for pending in (self._pending, self._replay):
                for table, rows in pending.items():
                    self._quarantine(table, [(row, "not written when the writer closed") for row in rows])
                    rows.clear()
            if self.journal is not None:
                self.journal.close()

    def _run(self) -> None:
        last_compact = time.monotonic()
        while not self._stop.is_set():
            self._wake.wait(self.flush_seconds)
            self._wake.clear()
            self._drain()
            self._commit()
            if time.monotonic() - last_compact >= self.compact_seconds and self.commits:
                last_compact = time.monotonic()
                self.compact()
        self._drain()
        self._commit()

    def _drain(self) -> None:
        with self.journal.lock if self.journal is not None else contextlib.nullcontext():
            if self.journal is not None:  # every row taken below is in a closed segment
                self.journal.rotate()
            while True:
                try:
                    table, row = self._queue.get_nowait()
                except queue.Empty:
                    return
                self._pending[table].append(row)

    def _commit(self) -> None:
        self._commit_all(self._replay, replay=True)
        self._commit_all(self._pending, replay=False)
        if self.journal is not None and not any(rows for pending in (self._pending, self._replay)
                                                for rows in pending.values()):
            self.journal.release()
        with self._idle:
            self._idle.notify_all()

    def _write(self, table: str, rows: list[dict[str, Any]], replay: bool) -> None:
        if replay:
            self.store.append_missing(table, pd.DataFrame(rows), REPLAY_KEYS[table])
        else:
            self.store.append(table, pd.DataFrame(rows))

    def _commit_all(self, pending: dict[str, list[dict[str, Any]]], replay: bool) -> None:
        for table, rows in pending.items():
            if not rows:
                continue
            batch = list(rows)
            try:
                self._write(table, batch, replay)
            except Exception as error:
                self.errors += 1
                log.warning("trace writer: writing %d %s rows failed (%s); looking for the rows at fault", len(batch),
                            table, error)
                written, refused = self._isolate(table, batch, error, replay)
                done = {id(row) for row in written}
                if written:  # the store works: the rows it refuses alone are bad, set aside rather than retried
                    done |= {id(row) for row, _ in refused}
                    self._quarantine(table, refused)
                rows[:] = [row for row in rows if id(row) not in done]  # the rest stays queued, tried again
                if not written:  # the rows refused alone go last, so a run of bad rows cannot hide good ones
                    last = {id(row) for row, _ in refused}
                    rows[:] = [row for row in rows if id(row) not in last] + [row for row, _ in refused]
                self.commits += 1 if written else 0
                self.rows_written += len(written)
                continue
            del rows[:len(batch)]
            self.commits += 1
            self.rows_written += len(batch)

    def _isolate(self, table: str, batch: list[dict[str, Any]], error: Exception, replay: bool = False) -> tuple[
            list[dict[str, Any]], list[tuple[dict[str, Any], str]]]:
        """Write a batch that failed whole in halves, down to single rows: (rows written, [(row refused alone,
        error)]). Gives up (the rest stays queued) once ``2 + log2(rows)`` writes in a row failed with none
        written: the store is down rather than a row bad."""
        written: list[dict[str, Any]] = []
        refused: list[tuple[dict[str, Any], str]] = []
        limit, failures = math.ceil(math.log2(max(len(batch), 2))) + 2, 1
        parts = [batch[:len(batch) // 2], batch[len(batch) // 2:]] if len(batch) > 1 else []
        while parts and failures <= limit:
            part = parts.pop(0)
            if not part:
                continue
            try:
                self._write(table, part, replay)
            except Exception as failure:
                failures += 1
                if len(part) == 1:
                    refused.append((part[0], f"{type(failure).__name__}: {failure}"))
                else:
                    parts[:0] = [part[:len(part) // 2], part[len(part) // 2:]]
                continue
            failures = 0
            written += part
        if len(batch) == 1:
            refused.append((batch[0], f"{type(error).__name__}: {error}"))
        return written, refused

    def _quarantine(self, table: str, refused: list[tuple[dict[str, Any], str]]) -> None:
        for row, error in refused:
            self.failed_rows += 1
            log.error("trace writer: the store refused %s row %s alone (%s); kept in %s", table,
                      row.get("trace_id") or row.get("run_id"), error, self.failed_path or "the log only")
            if self.failed_path is None:
                log.error("trace writer: refused row: %s", json.dumps(row, default=str, ensure_ascii=True))
                continue
            try:
                self.failed_path.parent.mkdir(parents=True, exist_ok=True)
                with self.failed_path.open("a", encoding="utf-8") as out:
                    out.write(json.dumps({"table": table, "error": error, "at": time.time(), "row": row}, default=str,
                                         ensure_ascii=True) + "\n")
            except OSError as failure:
                log.error("trace writer: could not keep the refused row in %s (%s): %s", self.failed_path, failure,
                          json.dumps(row, default=str, ensure_ascii=True))

    def compact(self, keep_seconds: float | None = None) -> dict[str, Any]:
        """Merge the store's small files now (also called every ``compact_seconds``)."""
        try:
            result = self.store.compact(self.compact_keep_seconds if keep_seconds is None else keep_seconds)
        except Exception as error:
            log.warning("trace writer: compaction failed (%s); the next one will try again", error)
            return {}
        self.compactions += 1
        return result


def feedback_row(trace_id: str, campaign: str, source: str, passed: bool, reward: float | None,
                 detail: Any) -> dict[str, Any]:
    return {"trace_id": trace_id, "campaign": campaign, "source": source, "passed": bool(passed),
            "reward": None if reward is None else float(reward), "detail": to_json(detail), "created_at": now()}
