"""Stop signals that are never lost: a SIGINT or SIGTERM that reached ``evertrain run`` stops it, in order, even where
the exception its handler raised was swallowed.

A Python signal handler runs between two bytecodes of the main thread, wherever that thread is. When that is
inside a finalizer (``__del__``, called by the garbage collector in the middle of any code: an asyncio
transport's, an HTTP client's), Python prints "Exception ignored in ..." and drops the exception, and the run went
on as if no signal had come (a fresh-clone CI run: Ctrl-C and two SIGTERMs in a row each ignored, the run killed
after a minute; reproduced here, a SIGINT landing in ``_SelectorTransport.__del__``). The same holds for
Prefect's ``TerminationSignal``, which Prefect's own SIGTERM handler raises while a flow runs.

So a signal is recorded twice over: by the handler (:func:`record`), and below Python's handlers, by the
interpreter's C-level handler, which writes each signal's number to a wakeup file descriptor
(:func:`signal.set_wakeup_fd`) before any Python code runs; a thread reads it (:func:`watch`). The stages then
ask (:func:`check`) at every stage boundary and every step of a progress bar, and a recorded stop raises
KeyboardInterrupt there: in the main thread, in ordinary code, where nothing swallows it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_recorded: list[int] = []  # stop signals this process received, in order (by a handler or the watcher)
_watcher: list[threading.Thread] = []


def record(signum: int) -> None:
    """Note that stop signal ``signum`` arrived (a signal handler's first act)."""
    _recorded.append(signum)


def requested() -> bool:
    """Whether a stop signal has reached this process."""
    return bool(_recorded)


def forget() -> None:
    """Forget the stop signals recorded so far (a process that has handled its stop and goes on: a test)."""
    _recorded.clear()


def check() -> None:
    """Raise KeyboardInterrupt if a stop signal has reached this process, in its main thread (elsewhere it would
    end a worker thread, not the run: the main thread raises at its next check)."""
    if _recorded and threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt(f"signal {_recorded[0]} (a stop signal recorded earlier)")


def watch() -> bool:
    """Record every stop signal at the C level from now on (call from the main thread, once Python handlers are
    installed for :data:`STOP_SIGNALS`: the wakeup descriptor is written only for signals with a Python handler).
    Returns False where the interpreter cannot (not the main thread)."""
    if _watcher:
        return True
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # the interpreter's handler must never block
    try:
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        reader.close()
        writer.close()
        return False

    def read() -> None:
        with contextlib.suppress(OSError):
            while data := reader.recv(64):
                for signum in data:
                    if signum in STOP_SIGNALS:
                        _recorded.append(signum)

    thread = threading.Thread(target=read, name="evertrain-stop-signals", daemon=True)
    thread.start()
    _watcher.append(thread)
    _keep.extend((reader, writer))
    os.register_at_fork(after_in_child=_forget_in_child)
    return True


def _forget_in_child() -> None:
    """A child forked from the run (no exec) would share the wakeup socket: its own signals would stop the run."""
    with contextlib.suppress(ValueError):  # not the main thread of the child
        signal.set_wakeup_fd(-1)
    _recorded.clear()
    _watcher.clear()


_keep: list[socket.socket] = []  # the watcher's sockets live as long as the process
