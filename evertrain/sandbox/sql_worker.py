"""The SQL tool's worker: policy-written SQL runs here, in a child process with hard limits, never in the
rollout or grading process.

Why: DuckDB's own ``memory_limit`` and an ``interrupt()`` timer do not bound everything a query can do
in-process (single function calls ignore both: one query grew the rollout process by 2-5 GB and ran
10 s). So each query runs in a process of its own that the kernel bounds:

- the worker (``python sql_worker.py``, started once per :class:`SqlWorker`) imports duckdb and opens
  nothing; for every request it forks a child, which sets ``RLIMIT_AS`` (address space),
  ``RLIMIT_CPU`` and ``RLIMIT_FSIZE`` (0: no file is ever written), opens a fresh locked-down in-memory
  single-thread database, runs the one statement and writes the formatted reply to a pipe;
- the worker kills the child at the wall-clock limit and reports why a child died (a signal, the memory
  limit, the CPU limit);
- the parent (:class:`SqlWorker`) talks to the worker over pipes with a deadline of its own, and
  starts a fresh worker if the old one is gone or late. Nothing a query does can grow the parent.

Protocol: one JSON object per line in each direction. A request ``{"setup": [sql, ...], "query": sql,
"max_rows", "timeout_s", "memory_mb", "threads"}``; a reply ``{"ok": true, "columns": [...], "rows":
[[text, ...]], "more": bool}`` or ``{"ok": false, "error": text}``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from decimal import Decimal
from typing import Any

WORKER_FILE = os.path.abspath(__file__)


# ---------------------------------------------------------------------------------------------------
# The parent side


class SqlWorker:
    """A long-lived worker process; ``run`` is thread-safe (one query at a time per worker)."""

    def __init__(self, grace_s: float = 5.0) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        # -s: no user site; the virtualenv's interpreter so duckdb imports; its own session, so a kill
        # of the worker takes any child with it
        return subprocess.Popen([sys.executable, "-s", WORKER_FILE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request; a worker that dies or misses ``timeout_s + grace_s`` is replaced."""
        deadline = float(request["timeout_s"]) + self.grace_s
        with self._lock:
            for _attempt in range(2):  # a worker that died since the last call is restarted once
                if self._proc is None or self._proc.poll() is not None:
                    self._stop()
                    self._proc = self._start()
                proc = self._proc
                assert proc.stdin is not None and proc.stdout is not None
                try:
                    proc.stdin.write(json.dumps(request).encode() + b"\n")
                    proc.stdin.flush()
                except OSError:
                    self._stop()
                    continue
                reply = _read_line(proc.stdout.fileno(), deadline)
                if reply is None:  # late or dead: this worker is not trusted with another query
                    self._stop()
                    return {"ok": False, "error": f"stopped: the query ran longer than {request['timeout_s']:g} s"}
                try:
                    return json.loads(reply)
                except ValueError:
                    self._stop()
                    return {"ok": False, "error": "the SQL worker sent a garbled reply"}
            return {"ok": False, "error": "the SQL worker could not be started"}

    def close(self) -> None:
        with self._lock:
            self._stop()


def _read_line(fd: int, timeout_s: float, limit: int = 4 << 20) -> bytes | None:
    """One line from ``fd`` within ``timeout_s`` seconds and ``limit`` bytes (None: late, closed or too long)."""
    end = time.monotonic() + timeout_s
    data = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in data:
            left = end - time.monotonic()
            if left <= 0 or not selector.select(left):
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            data += chunk
            if len(data) > limit:
                return None
    return data.split(b"\n", 1)[0]


# ---------------------------------------------------------------------------------------------------
# The worker side (this file run as a script)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    if isinstance(value, (Decimal, int)):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    text = str(value)
    return text if len(text) <= 100 else text[:100] + "…"


def _error_text(error: BaseException) -> str:
    lines = []
    for line in str(error).splitlines():
        if line.startswith("LINE "):
            break
        if line.strip():
            lines.append(line.strip())
    return " ".join(lines)[:300] or type(error).__name__


_READ_KEYWORDS = ("SELECT", "WITH", "VALUES", "FROM", "DESCRIBE", "SHOW", "SUMMARIZE", "TABLE", "(")


def _first_word(query: str) -> str:
    """The statement's first keyword, after leading whitespace and comments."""
    text = query.lstrip()
    while text.startswith(("--", "/*")):
        end = text.find("\n") if text.startswith("--") else text.find("*/")
        text = "" if end < 0 else text[end + (1 if text.startswith("--") else 2):].lstrip()
    if text.startswith("("):
        return "("
    return text.split(None, 1)[0].upper() if text else ""


def _reads_only(query: str) -> bool:
    return _first_word(query) in _READ_KEYWORDS


def _child(request: dict[str, Any], write_fd: int) -> None:
    """In the forked child: limits, a fresh locked-down database, one statement, the reply, exit."""
    # late: already loaded by main before the fork; the parent side imports this module without duckdb
    import duckdb

    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (request["memory_mb"] * mb,) * 2)
    cpu = int(request["timeout_s"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # it writes no file, whatever the query says
    reply: dict[str, Any]
    try:
        con = duckdb.connect(":memory:", config={"threads": request["threads"],
                                                 "memory_limit": f"{request['duckdb_memory_mb']}MB"})
        for statement in request["setup"]:
            con.execute(statement)
        for setting in ("SET temp_directory = ''", "SET autoinstall_known_extensions = false",
                        "SET autoload_known_extensions = false", "SET enable_external_access = false",
                        "SET lock_configuration = true"):
            con.execute(setting)
        statements = con.extract_statements(request["query"])
        if len(statements) != 1:
            reply = {"ok": False, "error": f"refused: write exactly one SQL statement (got {len(statements)})"}
        elif statements[0].type != duckdb.StatementType.SELECT or not _reads_only(request["query"]):
            kind = str(statements[0].type).rsplit(".", 1)[-1]
            if kind == "SELECT":  # DuckDB 1.4 rewrites PRAGMA (and CALL) into a SELECT: judge the text
                kind = _first_word(request["query"]) or kind
            reply = {"ok": False, "error": f"refused: only read-only SELECT queries are allowed (got {kind})"}
        else:
            timer = threading.Timer(request["timeout_s"], con.interrupt)
            timer.start()
            try:
                cursor = con.execute(statements[0].query)
                rows = cursor.fetchmany(request["max_rows"] + 1)
                columns = [d[0] for d in cursor.description or []]
            finally:
                timer.cancel()
            reply = {"ok": True, "columns": columns, "more": len(rows) > request["max_rows"],
                     "rows": [[_cell(v) for v in row] for row in rows[:request["max_rows"]]]}
    except duckdb.InterruptException:
        reply = {"ok": False, "error": f"stopped: the query ran longer than {request['timeout_s']:g} s"}
    except MemoryError:
        reply = {"ok": False, "error": "stopped: the query ran out of memory"}
    except Exception as error:  # a DuckDB error (its out-of-memory included), or a value Python cannot convert
        reply = {"ok": False, "error": _error_text(error)}
    data = json.dumps(reply).encode() + b"\n"
    while data:
        data = data[os.write(write_fd, data):]
    os._exit(0)


def _serve_one(request: dict[str, Any]) -> dict[str, Any]:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            _child(request, write_fd)
        finally:
            os._exit(1)
    os.close(write_fd)
    deadline = float(request["timeout_s"]) + 1.0
    line = _read_line(read_fd, deadline)
    os.close(read_fd)
    if line is None:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if line is not None:
        try:
            return json.loads(line)
        except ValueError:
            pass
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL) and line is None:
        return {"ok": False, "error": f"stopped: the query ran longer than {request['timeout_s']:g} s"}
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU,):
        return {"ok": False, "error": "stopped: the query used up its CPU time"}
    return {"ok": False, "error": "stopped: the query ran out of memory or crashed"}


def main() -> None:
    # late: only the worker loads duckdb, once here, before any fork (each child starts with it loaded); the
    # parent side (SqlWorker, verifiers_worker's _read_line) imports this module without it
    import duckdb  # noqa: F401

    for raw in sys.stdin.buffer:
        try:
            request = json.loads(raw)
        except ValueError:
            reply: dict[str, Any] = {"ok": False, "error": "malformed request"}
        else:
            reply = _serve_one(request)
        sys.stdout.buffer.write(json.dumps(reply).encode() + b"\n")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
