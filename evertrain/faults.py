"""Fault injection for crash-safety tests: SIGKILL this process at a named point of a named stage.

Set ``EVERTRAIN_KILL_AT=<stage>:<point>``; points are ``start`` (the stage is marked running),
``before_commit`` (inside the stage's first write transaction, its rows written but not committed)
and ``end`` (the work is done and stored, the stage not yet marked completed). Unset, it costs one
dictionary lookup.

``EVERTRAIN_KILL_AT=<stage>:<point>:<signal>`` (e.g. ``rollout:start:SIGINT``) sends that signal instead, from
inside a finalizer (``__del__``): where Python drops the exception a signal handler raises, as it does when the
garbage collector happens to run one as a signal arrives. Without :mod:`evertrain.interrupts` the run went on.
"""

from __future__ import annotations

import contextvars
import os
import signal

current_stage: contextvars.ContextVar[str | None] = contextvars.ContextVar("evertrain_stage", default=None)


def maybe_kill(point: str) -> None:
    target = os.environ.get("EVERTRAIN_KILL_AT")
    if not target:
        return
    stage, _, rest = target.partition(":")
    at, _, name = rest.partition(":")
    if (stage, at) != (current_stage.get(), point):
        return
    if not name:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    if name not in signal.Signals.__members__:
        raise ValueError(f"EVERTRAIN_KILL_AT={target!r}: {name!r} is no signal name (e.g. SIGINT, SIGTERM)")
    _SignalInFinalizer(signal.Signals[name])  # dropped at once: its finalizer runs now


class _SignalInFinalizer:
    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)
        for _ in range(10_000):  # the handler runs between two of these bytecodes, inside this finalizer
            pass
