"""The trace writer's write-ahead journal: every queued row is on disk before the response that made it is sent.

The trace writer commits rows in batches (one store commit per batch, see :mod:`evertrain.serving.traces`), so
without a journal a SIGKILLed endpoint loses every row queued since its last commit: the requests it answered in
its last seconds leave no trace. With the journal, :meth:`Journal.write` appends each row as one JSON line to the
writer's current segment file with one ``write`` system call before the row is queued (the endpoint queues a
request's trace before its response leaves: see ``chat`` in :mod:`evertrain.serving.app`). A process that dies
keeps what it wrote: the kernel holds it. It is not synced to the disk (``fsync``) on every row, so a machine
that loses power may lose the last seconds of it.

Layout, beside a local store (``<store>.trace_journal/``): one folder per writer,
``<host>@<pid>-<random>/``, holding the lock file ``owner.lock`` (the writer holds an exclusive ``flock`` on it
while it lives) and numbered segments ``<n>.jsonl``. Each time the writer takes the queued rows for a commit it
closes the current segment (when it holds any row) and opens the next, so every row taken is in a closed
segment; once every row taken has been committed (or set aside in the failed-row file), the closed segments are
deleted. A clean stop deletes the folder.

A writer that starts adopts the folders of dead writers on its host (the ones whose lock it can take): it moves
their segments into its own folder and replays their rows with :meth:`~evertrain.data.store.Store.append_missing`,
which inserts only the rows whose key the store does not hold yet (a writer killed after a commit and before it
deleted the segments left rows that are stored already). Folders of other hosts are left to their own host (a
lock on a shared folder may not work across machines). A line that does not parse (a write cut short) is
counted and logged, never replayed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("evertrain.serving")

LOCK = "owner.lock"
# what identifies a row of each table a journal replays (traces and feedback have no key in the schema)
REPLAY_KEYS = {"traces": ("trace_id",), "trace_feedback": ("trace_id", "source", "created_at"),
               "sandbox_runs": ("run_id",)}


def encode(table: str, row: dict[str, Any]) -> bytes:
    """One journal line: the table, the row, and which of its values were timestamps (JSON has no type for them)."""
    stamps = [key for key, value in row.items() if isinstance(value, datetime)]
    record = {"table": table, "row": {k: v.isoformat() if k in stamps else v for k, v in row.items()}}
    if stamps:
        record["timestamps"] = stamps
    return (json.dumps(record, default=str, ensure_ascii=True) + "\n").encode()


def decode(line: bytes) -> tuple[str, dict[str, Any]]:
    """(table, row) of one journal line; ValueError when it is not one (a write cut short)."""
    try:
        record = json.loads(line)
        table, row = record["table"], record["row"]
        for key in record.get("timestamps", ()):
            row[key] = datetime.fromisoformat(row[key])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"not a journal line ({error})") from None
    if table not in REPLAY_KEYS or not isinstance(row, dict):
        raise ValueError(f"not a journal line (table {table!r})")
    return table, row


class Journal:
    """One writer's journal folder under ``root``: :meth:`write` a row, :meth:`rotate` before taking the queued
    rows, :meth:`release` once they are all committed, :meth:`adopt` dead writers' rows, :meth:`close` at a clean
    stop."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = socket.gethostname()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.folder = root / f"{self.host}@{os.getpid()}-{secrets.token_hex(4)}"
        self.folder.mkdir(mode=0o700)
        self._lock_file = (self.folder / LOCK).open("w")
        fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._mutex = threading.Lock()
        self._number = 0
        self._rows_in_segment = 0
        self._fd = self._open(0)
        self.bad_lines = 0

    def _open(self, number: int) -> int:
        return os.open(self.folder / f"{number:09d}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    @property
    def lock(self) -> threading.Lock:
        """Held around a row's write and its queueing, and around a rotation and the taking of the queue, so a
        row taken for a commit is always in a closed segment."""
        return self._mutex

    def write(self, table: str, row: dict[str, Any]) -> None:
        """Append one row (call with :attr:`lock` held). One ``write`` call: a process killed mid-row leaves a cut
        line, which replay skips."""
        data = encode(table, row)
        os.write(self._fd, data)
        self._rows_in_segment += 1

    def rotate(self) -> None:
        """Close the current segment if it holds a row and open the next (call with :attr:`lock` held)."""
        if not self._rows_in_segment:
            return
        os.close(self._fd)
        self._number += 1
        self._fd = self._open(self._number)
        self._rows_in_segment = 0

    def release(self) -> None:
        """Delete the closed segments (every row taken so far is committed or set aside)."""
        current = f"{self._number:09d}.jsonl"
        for path in self.folder.iterdir():
            if path.name not in (current, LOCK):
                path.unlink(missing_ok=True)

    def adopt(self) -> dict[str, list[dict[str, Any]]]:
        """The rows of this host's dead writers (their folders unlocked), by table; their segments move into this
        writer's folder as closed segments, so they are deleted once :meth:`release` follows their commit, and
        adopted again by the next writer if this one dies first."""
        rows: dict[str, list[dict[str, Any]]] = {table: [] for table in REPLAY_KEYS}
        for folder in sorted(self.root.glob(f"{self.host}@*")):
            if folder == self.folder or not folder.is_dir():
                continue
            try:
                handle = (folder / LOCK).open("a")
            except OSError:  # another writer adopted it meanwhile (and removed it)
                continue
            with handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # its writer lives
                    continue
                if not folder.exists():  # adopted and removed between our open and our lock
                    continue
                for segment in sorted(folder.glob("*.jsonl")):
                    moved = self.folder / f"adopted-{folder.name}-{segment.name}"
                    segment.rename(moved)
                    self._read(moved, rows)
                (folder / LOCK).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    folder.rmdir()
        return rows

    def _read(self, segment: Path, rows: dict[str, list[dict[str, Any]]]) -> None:
        for number, line in enumerate(segment.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                table, row = decode(line)
            except ValueError as error:
                self.bad_lines += 1
                log.error("trace journal: %s line %d skipped: %s", segment, number, error)
                continue
            rows[table].append(row)

    def close(self) -> None:
        """A clean stop, every row committed or set aside: the folder goes."""
        with self._mutex:
            os.close(self._fd)
            for path in self.folder.iterdir():
                if path.name != LOCK:
                    path.unlink(missing_ok=True)
            (self.folder / LOCK).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.folder.rmdir()
            self._lock_file.close()
