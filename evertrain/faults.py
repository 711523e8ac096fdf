"""Fault injection for crash-safety tests: SIGKILL this process at a named point of a named stage.

Set ``EVERTRAIN_KILL_AT=<stage>:<point>``; points are ``start`` (the stage is marked running),
``before_commit`` (inside the stage's first write transaction, its rows written but not committed)
and ``end`` (the work is done and stored, the stage not yet marked completed). Unset, it costs one
dictionary lookup.
"""

from __future__ import annotations

import contextvars
import os
import signal

current_stage: contextvars.ContextVar[str | None] = contextvars.ContextVar("evertrain_stage", default=None)


def maybe_kill(point: str) -> None:
    target = os.environ.get("EVERTRAIN_KILL_AT")
    if target and target == f"{current_stage.get()}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)
