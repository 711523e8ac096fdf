"""Grading many completions at once, in parallel, never crashing on what a completion contains.

Sandboxed verifiers spend their time waiting on subprocesses, so a thread pool sized to the machine's
cores keeps every core busy; in-process verifiers (math) are cheap and run on the same pool.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from evertrain.envs import registry
from evertrain.envs.base import Environment, Problem, Verdict

# Completions longer than this are refused before any verifier reads them: every in-process grading step
# (marker counting, answer extraction, number parsing) is linear in the completion and bounded by this,
# so one item cannot hold the GIL long enough to make the sandboxed items graded beside it time out.
MAX_COMPLETION_CHARS = 200_000


# Verdicts that say nothing about the completion: its grader could not run (no sandbox, bubblewrap missing,
# a verifier that crashed). They are scored 0, but counted apart: a worker without a sandbox must not
# silently train on zeros.
GRADER_FAULTS = frozenset({"grader_error"})


def grader_errors(verdicts: Sequence[Verdict]) -> tuple[int, list[tuple[str, int]]]:
    """How many ``verdicts`` are grader faults (:data:`GRADER_FAULTS`), and their causes, most frequent first."""
    causes = Counter(str(v.detail.get("error", v.reason))[:300] for v in verdicts if v.reason in GRADER_FAULTS)
    return sum(causes.values()), causes.most_common()


def verify_safely(env: Environment, problem: Problem, completion: str) -> Verdict:
    """``env.verify``, with any exception turned into a zero reward that names it (reason ``grader_error``:
    the score stage counts these and fails above ``score.max_grader_error_share``)."""
    if len(completion) > MAX_COMPLETION_CHARS:
        return Verdict.fail("completion_too_long", chars=len(completion), limit=MAX_COMPLETION_CHARS)
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


def score_lines(lines: list[str], workers: int | None = None, progress: Any = None,
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Score ``evertrain score`` input lines; returns (one result per line, in order; sandbox audit rows).

    A malformed line gets an error result of its own and the rest are still scored.
    """
    results: list[dict[str, Any] | None] = [None] * len(lines)
    envs: dict[str, Environment] = {}
    todo: list[tuple[int, str, Environment, Problem, str]] = []
    for number, line in enumerate(lines):
        item_id: Any = None
        try:
            item = json.loads(line)
            if "\\u" in line:  # only an escape can make a lone surrogate; nothing can encode one
                item = without_lone_surrogates(item)
            if not isinstance(item, dict):
                raise ValueError("each line must be a JSON object")
            item_id = item.get("id")
            missing = [k for k in ("id", "env", "problem", "completion") if k not in item]
            if missing:
                raise ValueError(f"missing field(s) {', '.join(missing)}")
            if not isinstance(item["id"], str) or not isinstance(item["completion"], str):
                raise ValueError("id and completion must be strings")
            if item["env"] not in envs:
                envs[item["env"]] = registry.get(item["env"])
            env = envs[item["env"]]
            problem = env.parse_problem(item["problem"])
        except Exception as error:  # JSONDecodeError, UnknownEnvironment; RecursionError (deep nesting) ...
            results[number] = {"id": item_id if isinstance(item_id, str) else None, "reward": 0.0, "passed": False,
                               "reason": "malformed_input",
                               "detail": {"line": number + 1, "error": f"{type(error).__name__}: {error}"[:500]}}
            if progress is not None:
                progress.update(1)
            continue
        todo.append((number, item["id"], env, problem, item["completion"]))
    verdicts = verify_many([(env, problem, completion) for _, _, env, problem, completion in todo],
                           workers=workers, progress=progress)
    audit: list[dict[str, Any]] = []
    for (number, item_id, *_), verdict in zip(todo, verdicts, strict=True):
        audit += pop_sandbox_runs(verdict)
        results[number] = {"id": item_id, "reward": verdict.reward, "passed": verdict.passed,
                           "reason": verdict.reason, "detail": verdict.detail}
    return [r for r in results if r is not None], audit


def without_lone_surrogates(value: Any) -> Any:
    """``value`` (parsed JSON) with every lone surrogate in its strings replaced by U+FFFD, as a UTF-8
    decoder would: JSON may escape one (``"\\ud800"``), no grader can encode it. Iterative: no depth limit."""
    surrogate = re.compile("[\ud800-\udfff]")

    def clean(text: str) -> str:
        return surrogate.sub("\ufffd", text)

    if isinstance(value, str):
        return clean(value)
    root = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        container, key = stack.pop()
        item = container[key]
        if isinstance(item, str):
            container[key] = clean(item)
        elif isinstance(item, list):
            stack += [(item, index) for index in range(len(item))]
        elif isinstance(item, dict):
            for name in list(item):
                fixed = clean(name) if isinstance(name, str) else name
                if fixed != name:
                    item[fixed] = item.pop(name)
                stack.append((item, fixed))
    return root[0]
