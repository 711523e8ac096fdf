"""Quality control before a problem reaches training: validation, deduplication, decontamination.

- ``validate``: an environment earns trust only if its references earn 1, empty, trivial and known
  hack completions earn 0, and grading the same completion twice gives the same verdict.
- ``NgramIndex``: word n-gram fingerprints for near-duplicate and contamination checks (a problem
  whose text shares an n-gram with any held-out problem never reaches training).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from evertrain.envs.base import Environment, Problem

_WORD = re.compile(r"[a-z0-9]+")

# what a reward hacker tries first, by environment kind; {answer} is the problem's answer if it has one
GENERIC_HACKS = ["", "   ", "I don't know.", "#### 0\n#### 1", "The answer is one of 1, 2, 3, 4, 5."]
MATH_HACKS = ["#### {answer} or {wrong}", "#### {wrong}\n#### {answer}", "\\boxed{{{answer}}} \\boxed{{{wrong}}}",
              "#### {answer}, {wrong}", "#### {answer}\nor maybe {wrong}? #### {wrong}"]
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


@dataclass
class ValidationReport:
    env: str
    checked: int = 0
    failures: list[str] = field(default_factory=list)
    sandbox_runs: list[dict[str, Any]] = field(default_factory=list)  # audit rows of sandboxed verifications

    @property
    def ok(self) -> bool:
        return self.checked > 0 and not self.failures

    def as_dict(self) -> dict[str, Any]:
        return {"env": self.env, "ok": self.ok, "checked": self.checked, "failures": self.failures}


def _hacks(env: Environment, problem: Problem) -> list[str]:
    answer = str(problem.payload.get("answer", "42"))
    wrong = "7" if answer.strip() != "7" else "8"
    if env.kind == "toy":  # toy rewards are partial credit by design: only the empty reply must earn 0
        return ["", *env.hack_completions(problem)]
    hacks = list(GENERIC_HACKS)
    if env.kind in ("math", "reasoning", "tool"):
        hacks += [h.format(answer=answer, wrong=wrong) for h in MATH_HACKS]
    if env.kind == "code":
        entry = problem.payload.get("entry_point") or "solution"
        hacks += [h.replace("{entry}", entry) for h in CODE_HACKS]
    return hacks + list(env.hack_completions(problem))


def validate(env: Environment, problems: int = 3, seed: int = 0) -> ValidationReport:
    """Check ``env`` on a few train and eval problems: references 1, junk and hacks 0, stable verdicts."""
    report = ValidationReport(env.name)
    try:
        sample = env.problems("train", problems, seed) + env.problems("eval", problems, seed)
    except Exception as error:
        report.failures.append(f"cannot produce problems: {type(error).__name__}: {error}")
        return report
    for problem in sample:
        report.checked += 1

        def verify(completion: str, problem: Problem = problem) -> Any:
            verdict = env.verify(problem, completion)
            report.sandbox_runs += verdict.detail.pop("sandbox_runs", None) or []
            return verdict

        reference = env.reference(problem)
        if reference is not None:
            first, second = verify(reference), verify(reference)
            if first.reward != 1.0:
                report.failures.append(f"{problem.id}: the reference earned {first.reward} ({first.reason})")
            if (first.reward, first.reason) != (second.reward, second.reason):
                report.failures.append(f"{problem.id}: the reference got two different verdicts")
        for hack in _hacks(env, problem):
            verdict = verify(hack)
            if verdict.reward != 0.0:
                report.failures.append(f"{problem.id}: junk/hack completion earned {verdict.reward}: {hack[:60]!r}")
    return report
