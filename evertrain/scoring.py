"""Grading many completions at once, in parallel, never crashing on what a completion contains.

Sandboxed verifiers spend their time waiting on subprocesses, so a thread pool sized to the machine's
cores keeps every core busy; in-process verifiers (math) are cheap and run on the same pool.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from evertrain.envs.base import Environment, Problem, Verdict


def verify_safely(env: Environment, problem: Problem, completion: str) -> Verdict:
    """``env.verify``, with any exception turned into a zero reward that names it."""
    try:
        verdict = env.verify(problem, completion)
    except Exception as error:
        return Verdict.fail("grader_error", error=f"{type(error).__name__}: {error}"[:500])
    if not isinstance(verdict, Verdict):
        return Verdict.fail("grader_error", error=f"verify returned {type(verdict).__name__}, not a Verdict")
    return verdict


def verify_many(items: Sequence[tuple[Environment, Problem, str]], workers: int | None = None,
                progress: Any = None) -> list[Verdict]:
    """Verdicts for (environment, problem, completion) items, in input order."""
    workers = workers or len(os.sched_getaffinity(0))

    def one(item: tuple[Environment, Problem, str]) -> Verdict:
        verdict = verify_safely(*item)
        if progress is not None:
            progress.update(1)
        return verdict

    if workers <= 1 or len(items) <= 1:
        return [one(item) for item in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, items))


def pop_sandbox_runs(verdict: Verdict) -> list[dict[str, Any]]:
    """Take the sandbox audit rows a sandboxed verifier left in ``verdict.detail``."""
    return list(verdict.detail.pop("sandbox_runs", []) or [])
