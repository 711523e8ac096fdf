"""Quality control before a problem reaches training: validation, deduplication, decontamination.

- ``validate``: the verifier self-test. An environment earns trust only if its known-good completions
  (``Environment.known_good``, by default the reference) earn 1, twice, and a battery of known-bad
  ones earns exactly 0: empty, junk, ``nan``/``inf`` in any spelling, 0, 1, another problem's answer, the
  question's own text or expression restated, hedges of several answers, over-long numbers however
  written, inputs that stalled quadratic parsers (:func:`bad_battery`),
  plus the environment's own (``Environment.known_bad``: for code, constant functions, another
  problem's solution, StopIteration, the tests restated, the classic harness hacks). `evertrain envs
  --validate` runs it for every environment; a campaign refuses an environment that fails it.
- ``NgramIndex``: word n-gram fingerprints for near-duplicate and contamination checks (a problem
  whose text shares an n-gram with any held-out problem never reaches training).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from evertrain.envs.base import Environment, Problem

_WORD = re.compile(r"[a-z0-9]+")

# what a reward hacker tries first against a code grader; {entry} is the problem's entry point
CODE_HACKS = [
    "```python\nclass AlwaysEqual:\n    def __eq__(self, other):\n        return True\n"
    "    def __ne__(self, other):\n        return False\n"
    "def {entry}(*args, **kwargs):\n    return AlwaysEqual()\n```",
    "```python\nimport sys\nsys.exit(0)\n```",
    "```python\nimport os\nos._exit(0)\n```",
    "```python\nprint('all tests passed')\n```",
    "```python\nimport unittest\nraise unittest.SkipTest('skip')\n```",
]


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shingles(text: str, n: int) -> set[int]:
    """Hashes of the word n-grams of ``text`` (the whole normalized text when it is shorter than n)."""
    tokens = words(text)
    grams = [" ".join(tokens[i:i + n]) for i in range(max(1, len(tokens) - n + 1))]
    return {int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little") for g in grams}


@dataclass
class NgramIndex:
    """Shingle sets of a collection of texts: does a new text overlap any of them?"""

    n: int = 8
    grams: set[int] = field(default_factory=set)
    sets: list[set[int]] = field(default_factory=list)

    def add(self, text: str) -> None:
        fingerprint = shingles(text, self.n)
        self.grams |= fingerprint
        self.sets.append(fingerprint)

    def drop_boilerplate(self, sample: list[str], max_share: float = 0.02, min_count: int = 2) -> None:
        """Forget n-grams found in more than ``max_share`` (and more than ``min_count``) of ``sample``'s texts:
        instructions repeated in every prompt of a data set are not evidence of a leaked problem."""
        from collections import Counter

        counts = Counter(g for text in sample for g in shingles(text, self.n))
        limit = max(min_count, int(max_share * len(sample)))
        common = {g for g, c in counts.items() if c > limit}
        self.grams -= common
        self.sets = [fingerprint - common for fingerprint in self.sets]

    def overlaps(self, text: str) -> bool:
        """True when ``text`` shares at least one n-gram with an indexed text (contamination)."""
        return not self.grams.isdisjoint(shingles(text, self.n))

    def max_jaccard(self, text: str) -> float:
        """The largest Jaccard similarity of ``text``'s n-grams with any indexed text (near-duplicates)."""
        mine = shingles(text, self.n)
        if not self.sets or mine.isdisjoint(self.grams):
            return 0.0
        return max(len(mine & other) / len(mine | other) for other in self.sets if not mine.isdisjoint(other))


# Bump when the battery or a verifier changes: cached self-test verdicts (the store's env_validations,
# keyed with it) are then redone instead of trusted.
SELFTEST_VERSION = 3

# Over-long numbers: a grader that converts them without a bound stalls (Decimal("1e999999999") is
# instant, Fraction of it is not), and no oracle answer looks like them.
OVERLONG_NUMBERS = ("9" * 5000, "1e999999999", "-1e-999999999", "1" + "0" * 20000, "0." + "0" * 20000 + "1",
                    "1" * 4400 + "/7",
                    # the same bound read on the whole value, however its exponent is spelled
                    "1e9_99", "1E+0000999", "1e0000000099999999999", "10**999", "10\u2079\u2079\u2079",
                    "\uff11e\uff19\uff19\uff19", "1" + "0" * 150 + "e200", "9_" * 200 + "9")
NON_FINITE = ("nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e400",
              # other spellings a scorer's float()/complex() reads as nan or inf
              "-inF", "sNaN", "\uff4e\uff41\uff4e", "\u2212inf", "n a n", "+INFINITY")
# Input that stalled the grading process's old quadratic parsing (a tool tag's blanks, fences, closing
# tags, blanks before a number's exponent), in one completion (each grade of it may cost a sandbox run):
# it must be graded in bounded time, and earn 0 (it ends on a wrong answer).
STALLING = "<" + " " * 50_000 + "x " + "```" * 15_000 + " < / " * 8_000 + "1" + " " * 50_000 + "e"


@dataclass
class CaseResult:
    """One completion of the self-test: what it was, what it had to earn, what it earned."""

    problem_id: str
    label: str  # "good", "empty", "non_finite", "other_problem", "restated", "hedge", "over_long_number" ...
    completion: str
    expect: float  # 1.0 for known-good, 0.0 for known-bad
    reward: float
    reason: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.reward == self.expect

    def as_dict(self) -> dict[str, Any]:
        return {"problem_id": self.problem_id, "label": self.label, "completion": self.completion[:80],
                "expect": self.expect, "reward": self.reward, "reason": self.reason, "ok": self.ok,
                "seconds": round(self.seconds, 3)}


@dataclass
class ValidationReport:
    env: str
    checked: int = 0
    failures: list[str] = field(default_factory=list)
    sandbox_runs: list[dict[str, Any]] = field(default_factory=list)  # audit rows of sandboxed verifications
    cases: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.checked > 0 and not self.failures

    def by_label(self) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = {}
        for case in self.cases:
            entry = counts.setdefault(case.label, {"cases": 0, "failed": 0})
            entry["cases"] += 1
            entry["failed"] += not case.ok
        return counts

    def as_dict(self, cases: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"env": self.env, "ok": self.ok, "status": "ok" if self.ok else "failed",
                               "checked": self.checked, "cases": len(self.cases), "by_label": self.by_label(),
                               "failures": self.failures, "seconds": round(self.seconds, 2),
                               "selftest_version": SELFTEST_VERSION}
        if cases:
            out["case_results"] = [case.as_dict() for case in self.cases]
        return out


def _same_answer(a: str, b: str | None) -> bool:
    """Whether two answers are the same after normalisation (then a 'wrong' answer would be right)."""
    from evertrain.envs.answers import parse_number

    if b is None:
        return False
    if a.strip().lower() == b.strip().lower():
        return True
    x, y = parse_number(a), parse_number(b)
    return x is not None and x == y


def _restatements(problem: Problem) -> list[str]:
    """The question's own text and expression, as one-line answers: a grader that evaluates what an
    answer says would credit the question restated for it to compute."""
    lines = [line.strip() for line in problem.prompt.splitlines() if line.strip()]
    found: list[str] = []
    for line in lines[-2:]:
        found.append(line)
        for part in (line.rsplit(":", 1)[-1], line.split("=", 1)[0], line.removeprefix("What is")):
            part = part.strip().rstrip("?.= ").strip()
            if part:
                found.append(part)
    meta = problem.payload.get("metadata")
    if isinstance(meta, dict):
        for key in ("expression", "polynomial_expr", "integrand", "equation", "problem"):
            if isinstance(meta.get(key), str):
                found.append(meta[key])
    return list(dict.fromkeys(x for x in found if 0 < len(x) <= 2000))


def bad_battery(env: Environment, problem: Problem, other: Problem | None) -> list[tuple[str, str]]:
    """The generic known-bad completions for ``problem``: each must earn exactly 0 (label, completion)."""
    cases: list[tuple[str, str]] = [("empty", ""), ("empty", "   ")]
    if env.kind == "toy":  # toy rewards are partial credit by design: only the empty reply must earn 0
        return cases + env.known_bad(problem, other)
    cases += [("junk", "I don't know."), ("junk", "The answer is one of 1, 2, 3, 4, 5.")]
    if env.write_answer("0") is None:
        return cases + env.known_bad(problem, other)
    oracle = env.oracle_answer(problem)
    # Another problem's answer is wrong here only when answers are unique: where the problem has no single
    # oracle (any valid solution counts) it may be right, so it is not part of the battery then.
    others = [env.oracle_answer(other)] if other is not None and oracle is not None else []
    wrong = next((w for w in (*others, "7", "8") if w and not _same_answer(w, oracle) and "\n" not in w), "8")
    answers: list[tuple[str, str]] = [("non_finite", x) for x in NON_FINITE]
    answers += [("zero", "0"), ("one", "1")]
    answers += [("over_long_number", x) for x in OVERLONG_NUMBERS]
    answers += [("other_problem", x) for x in others if x]
    answers += [("restated", x) for x in _restatements(problem)]
    if oracle:
        answers += [("hedge", f"{oracle} or {wrong}"), ("hedge", f"{wrong} or {oracle}"),
                    ("hedge", f"{oracle}, {wrong}"), ("hedge", f"{wrong}; {oracle}")]
    for label, answer in answers:
        if label == "hedge" or not _same_answer(answer, oracle):
            completion = env.write_answer(answer)
            if completion is not None:
                cases.append((label, completion))
    cases.append(("stalling", f"{STALLING}\n#### {wrong}"))
    if oracle:
        cases += [("hedge", f"#### {oracle}\n#### {wrong}"), ("hedge", f"#### {wrong}\n#### {oracle}"),
                  ("hedge", f"\\boxed{{{oracle}}} \\boxed{{{wrong}}}"), ("hedge", "#### 0\n#### 1")]
    if other is not None and oracle is not None:
        cases += [("other_problem", completion) for completion in env.known_good(other)
                  if not _same_answer(env.oracle_answer(other) or "", oracle)]
    return cases + env.known_bad(problem, other)


def validate(env: Environment, problems: int = 2, seed: int = 0, workers: int = 2,
             on_case: Callable[[CaseResult], None] | None = None) -> ValidationReport:
    """The verifier self-test of ``env`` on ``problems`` train and ``problems`` eval problems: every
    known-good completion earns 1 (graded twice: verdicts must be stable), every known-bad one
    (:func:`bad_battery` plus the environment's ``known_bad``) exactly 0. Cases are graded on
    ``workers`` threads (sandboxed verifiers mostly wait on their sandboxes)."""
    report = ValidationReport(env.name)
    started = time.monotonic()
    try:
        sample = env.problems("train", problems, seed) + env.problems("eval", problems, seed)
    except Exception as error:
        report.failures.append(f"cannot produce problems: {type(error).__name__}: {error}")
        return report
    todo: list[tuple[Problem, str, str, float]] = []
    for index, problem in enumerate(sample):
        report.checked += 1
        others = sample[index + 1:] + sample[:index]
        other = next((p for p in others if p.payload != problem.payload), None)
        for good in env.known_good(problem):
            todo += [(problem, "good", good, 1.0), (problem, "good_again", good, 1.0)]
        seen: set[str] = set()
        for label, completion in bad_battery(env, problem, other):
            if completion not in seen:
                seen.add(completion)
                todo.append((problem, label, completion, 0.0))

    def run(case: tuple[Problem, str, str, float]) -> tuple[CaseResult, list[dict[str, Any]]]:
        problem, label, completion, expect = case
        t0 = time.monotonic()
        try:
            verdict = env.verify(problem, completion)
        except Exception as error:  # a verifier must never raise on a completion: that is a failure too
            return CaseResult(problem.id, label, completion, expect, -1.0,
                              f"verifier_raised {type(error).__name__}: {error}"[:200], time.monotonic() - t0), []
        runs = verdict.detail.pop("sandbox_runs", None) or []
        return CaseResult(problem.id, label, completion, expect, verdict.reward, verdict.reason,
                          time.monotonic() - t0), runs

    if workers > 1 and len(todo) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(run, todo))
    else:
        results = [run(case) for case in todo]
    first_good: dict[tuple[str, str], CaseResult] = {}
    for (problem, label, completion, expect), (result, runs) in zip(todo, results, strict=True):
        report.cases.append(result)
        report.sandbox_runs.extend(runs)
        if on_case is not None:
            on_case(result)
        if not result.ok:
            what = "the known-good reference" if expect else f"a known-bad ({label}) completion"
            report.failures.append(f"{problem.id}: {what} earned {result.reward} ({result.reason}): "
                                   f"{completion[:60]!r}")
        if label == "good":
            first_good[(problem.id, completion)] = result
        elif label == "good_again":
            first = first_good.get((problem.id, completion))
            if first is not None and (first.reward, first.reason) != (result.reward, result.reason):
                report.failures.append(f"{problem.id}: the known-good completion got two different verdicts")
    report.seconds = time.monotonic() - started
    return report
