"""Stopping the servers and runners evertrain starts: one way, for all of them (and the one free-port helper).

Every long-lived child evertrain starts (the Prefect and MLflow servers of ``evertrain services``, the Prefect
server ``evertrain serve`` and the flywheel start, the flywheel's deployment runner) is started in a session of
its own, so it and the processes it starts in turn (uvicorn workers, flow-run subprocesses) form one process
group. :func:`stop` signals whole groups, waits for their leaders, then kills what is left: nothing is
orphaned, and a child that has already exited costs no waiting.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

Process = subprocess.Popen | int


def _pid(process: Process) -> int:
    return process if isinstance(process, int) else process.pid


def alive(process: Process | None) -> bool:
    """Whether ``process`` (a ``Popen`` or a pid) is still running. A child of this process that has exited is
    reaped here: a zombie still answers signal 0, which would make every wait for it run out its deadline."""
    if process is None:
        return False
    if not isinstance(process, int):
        return process.poll() is None
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(process, os.WNOHANG)[0] == process:
            return False
    try:
        os.kill(process, 0)
    except OSError:
        return False
    return True


def _signal(pid: int, signum: int, group: bool) -> None:
    """``signum`` to the process group ``pid`` leads, or to ``pid`` alone when it leads none."""
    with contextlib.suppress(OSError):
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def stop(processes: Iterable[Process], first: int = signal.SIGTERM, timeout: float = 30.0) -> list[int]:
    """Stop each of ``processes`` (session leaders: ``Popen(..., start_new_session=True)`` or their pids) with
    its whole process group: ``first`` to every group at once (SIGTERM, or SIGINT for a Prefect runner, which
    then cancels its flow runs as on Ctrl-C), up to ``timeout`` seconds for the leaders to exit, then SIGKILL to
    every group that still has a member. A process that leads no group of its own (started without a session)
    is signalled alone: its group is its parent's. Returns the pids of the leaders that had to be killed."""
    leaders = [p for p in processes if alive(p)]
    groups = {_pid(p): _leads_group(_pid(p)) for p in leaders}
    for pid, group in groups.items():
        _signal(pid, first, group)
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in leaders) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = [_pid(p) for p in leaders if alive(p)]
    for pid, group in groups.items():  # also the leaders that exited: their children may not have
        if group or pid in killed:
            _signal(pid, signal.SIGKILL, group)
    for process in leaders:
        if not isinstance(process, int):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        else:
            alive(process)  # reaps it if it is this process's child
    return killed



def free_port(preferred: int | None = None) -> int:
    """A TCP port on localhost nobody listens on now: ``preferred`` when it is free, else one the kernel picks."""
    if preferred:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", preferred)) != 0:
                return preferred
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tied_to(parent: int) -> None:
    """``preexec_fn`` of a helper server: SIGTERM it when ``parent`` dies, however it dies (Linux's
    PR_SET_PDEATHSIG; SIGKILL included), and give it a session of its own, so the terminal's Ctrl-C (sent to the
    whole foreground group) reaches the run, which stops in order, and not the server it still reports to."""
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above: nobody will tell us
        os.kill(os.getpid(), signal.SIGTERM)


_spawner: list[Any] = []  # the spawner thread's queue of (function, future), once started
_spawner_lock = threading.Lock()


def in_spawner(function: Callable[[], T]) -> T:
    """``function()`` run on the process's spawner thread, a daemon thread that lives as long as the process.

    Linux's parent-death signal (PR_SET_PDEATHSIG: :func:`tied_to`, bwrap's ``--die-with-parent``) fires when the
    THREAD that started a child ends, not the process: a helper server started from a pool thread (a grade, an
    environment's reply) died with that pool. Started from here, it dies with the process alone."""
    if threading.current_thread() is threading.main_thread():
        return function()  # the main thread ends with the process: no need to hand over
    with _spawner_lock:
        if not _spawner:
            jobs: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()

            def serve() -> None:
                while True:
                    job, future = jobs.get()
                    try:
                        future.set_result(job())
                    except BaseException as error:  # handed to the caller, who raises it
                        future.set_exception(error)

            threading.Thread(target=serve, name="evertrain-spawner", daemon=True).start()
            _spawner.append(jobs)
    future: Future[T] = Future()
    _spawner[0].put((function, future))
    return future.result()
