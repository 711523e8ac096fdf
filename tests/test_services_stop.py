"""`services.stop` returns as soon as the servers it stops have exited, also when this process started them;
`processes.stop` leaves none of their children behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from evertrain import processes, services


def test_stop_does_not_wait_out_its_deadline_for_servers_this_process_started(tmp_path: Path) -> None:
    # two stand-ins for the Prefect and MLflow servers, started as services.start starts them: children of
    # this process, each in its own session; they exit at once on SIGTERM (Python's default action)
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    servers = {name: services._spawn(sleeper, services.quiet_env(), tmp_path / f"{name}.log")
               for name in ("prefect", "mlflow")}
    (tmp_path / "services.json").write_text(json.dumps({name: {"pid": p.pid} for name, p in servers.items()}))
    started = time.monotonic()
    services.stop(tmp_path)
    took = time.monotonic() - started
    # before: an exited child stays a zombie until reaped, signal 0 still reached it, and stop() waited
    # 20 s for each server
    assert took < 10, f"stop() took {took:.1f} s for two servers that exit on SIGTERM"
    assert not (tmp_path / "services.json").exists()
    for process in servers.values():
        assert process.poll() is not None


def test_stop_leaves_no_child_of_a_server_behind(tmp_path: Path) -> None:
    # a server whose worker outlives it on SIGTERM (the leader exits at once, its child ignores the signal): the
    # group is killed once the leader is gone, so the worker is not left orphaned
    pid_file = tmp_path / "worker.pid"
    worker = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    leader = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {worker!r}]); time.sleep(120)"],
                              start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the stand-in server's worker did not start"
        time.sleep(0.1)
    worker_pid = int(pid_file.read_text())
    assert processes.stop([leader], signal.SIGTERM, timeout=10) == []  # the leader exited on SIGTERM
    assert leader.poll() is not None
    deadline = time.monotonic() + 10
    while _running(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(worker_pid), "the server's worker was left running"
    assert processes.stop([leader]) == []  # stopping what has stopped is a no-op


def test_stop_stops_a_process_that_leads_no_group() -> None:
    # started without a session of its own: its process group is this test's, which must not be signalled, and
    # the process itself must still be stopped (before, killpg found no group of its pid and stop did nothing)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    assert os.getpgid(child.pid) == os.getpgrp()
    assert processes.stop([child], signal.SIGTERM, timeout=10) == []
    assert child.poll() == -signal.SIGTERM


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie: an orphan is reaped by init, not by this process)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split(")")[-1].split()[0] != "Z"


def test_free_port_keeps_a_free_preferred_port_and_skips_a_taken_one() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        other = processes.free_port(busy)
        assert other != busy
        with socket.socket() as probe:  # the port it gave is one nobody listens on
            assert probe.connect_ex(("127.0.0.1", other)) != 0
    assert processes.free_port(other) == other
