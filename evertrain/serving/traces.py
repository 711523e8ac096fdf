"""Traces: the batched writer, what a request costs, and the live pass rate read back from the store.

The store is DuckLake: one commit writes at least one Parquet file per table it touches, so one commit per
request would leave a file per request. The writer therefore queues rows (already redacted) and commits
them in batches, ``serving.trace_batch_rows`` rows or every ``serving.trace_flush_seconds``, whichever comes
first, and merges the small files every ``serving.compact_seconds`` (:meth:`Store.compact`). A failed
commit is retried with the next batch (the rows stay queued); rows are lost only if the process dies
within one flush interval of their request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import pandas as pd

from evertrain.config import CampaignConfig
from evertrain.data.store import Store, now

log = logging.getLogger("evertrain.serving")

TRACE_COLUMNS = ("trace_id", "campaign", "model_version", "model", "env", "problem_id", "problem", "request",
                 "response", "tool_calls", "tools", "status", "http_status", "error", "finish_reason", "latency_ms",
                 "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd", "created_at", "key_id")
FEEDBACK_COLUMNS = ("trace_id", "campaign", "source", "passed", "reward", "detail", "created_at")


def request_cost(config: CampaignConfig, *, computed_tokens: int, cached_tokens: int, forward_seconds: float,
                 on_gpu: bool, threads: int) -> float:
    """Dollars one request cost at the campaign's prices (``config.prices``, as the stages' costs are counted):
    the tokens computed and served from cache at their per-million prices, plus the compute time the
    sampler spent on it (GPU-hours on a GPU, else CPU-core-hours for the torch threads it used)."""
    prices = config.prices
    compute = (forward_seconds / 3600 * prices.gpu_hour if on_gpu
               else forward_seconds * threads / 3600 * prices.cpu_core_hour)
    return compute + computed_tokens / 1e6 * prices.million_tokens + cached_tokens / 1e6 * prices.million_cached_tokens


class TraceWriter:
    """A background thread that commits queued trace and feedback rows to the store in batches."""

    def __init__(self, store: Store, *, batch_rows: int = 256, flush_seconds: float = 1.0,
                 compact_seconds: float = 300.0, compact_keep_seconds: float = 600.0) -> None:
        self.store = store
        self.batch_rows, self.flush_seconds = batch_rows, flush_seconds
        self.compact_seconds, self.compact_keep_seconds = compact_seconds, compact_keep_seconds
        self._queue: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._pending: dict[str, list[dict[str, Any]]] = {"traces": [], "trace_feedback": []}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self.commits = 0
        self.rows_written = 0
        self.compactions = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="evertrain-trace-writer", daemon=True)
        self._thread.start()

    def add_trace(self, row: dict[str, Any]) -> None:
        self._put("traces", {c: row.get(c) for c in TRACE_COLUMNS})

    def add_feedback(self, row: dict[str, Any]) -> None:
        self._put("trace_feedback", {c: row.get(c) for c in FEEDBACK_COLUMNS})

    def _put(self, table: str, row: dict[str, Any]) -> None:
        self._queue.put((table, row))
        if self._queue.qsize() >= self.batch_rows:
            self._wake.set()

    def backlog(self) -> int:
        """Rows queued or waiting for a commit."""
        return self._queue.qsize() + sum(len(rows) for rows in self._pending.values())

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every row queued so far is committed (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.backlog() and time.monotonic() < deadline:
            self._wake.set()
            with self._idle:
                self._idle.wait(0.05)
        return not self.backlog()

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

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
        while True:
            try:
                table, row = self._queue.get_nowait()
            except queue.Empty:
                return
            self._pending[table].append(row)

    def _commit(self) -> None:
        for table, rows in self._pending.items():
            if not rows:
                continue
            batch = list(rows)
            try:
                self.store.append(table, pd.DataFrame(batch))
            except Exception as error:  # kept queued, tried again with the next batch: a trace is never dropped here
                self.errors += 1
                log.warning("trace writer: writing %d %s rows failed (%s); retrying", len(batch), table, error)
                continue
            del rows[:len(batch)]
            self.commits += 1
            self.rows_written += len(batch)
        with self._idle:
            self._idle.notify_all()

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
    from evertrain.data.store import to_json

    return {"trace_id": trace_id, "campaign": campaign, "source": source, "passed": bool(passed),
            "reward": None if reward is None else float(reward), "detail": to_json(detail), "created_at": now()}
