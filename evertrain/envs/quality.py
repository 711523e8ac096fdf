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
import logging
import re
import time
import unicodedata
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from evertrain.envs.answers import parse_number
from evertrain.envs.base import Environment, Problem
from evertrain.envs.code import visible_constant

_WORD = re.compile(r"[a-z0-9]+")
_log = logging.getLogger(__name__)


def plain(text: str) -> str:
    """``text`` as a reader sees it: Unicode compatibility forms folded (NFKC: full-width digits, ligatures),
    invisible format characters dropped (zero-width spaces and joiners, bidi marks: they would split a word in
    two), case folded. Near-copies that differ only in these compare equal."""
    folded = unicodedata.normalize("NFKC", text)
    return "".join(c for c in folded if unicodedata.category(c) != "Cf").casefold()


def words(text: str) -> list[str]:
    return _WORD.findall(plain(text))


def normal_prompt(text: str) -> str:
    """``text``'s words only (:func:`plain`, punctuation and spacing gone): what decides that two prompts are the
    same question (a trailing dot, a zero-width character or doubled spaces make no new problem)."""
    return " ".join(words(text))


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
    sample: list[Problem] = field(default_factory=list)  # the problems checked (the quality check reuses them)
    checked: int = 0
    failures: list[str] = field(default_factory=list)
    # known-bad probes the environment's config accepts by name (``accept``): paid, reported, not refused
    accepted: list[str] = field(default_factory=list)
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
                               "failures": self.failures, "accepted": self.accepted,
                               "seconds": round(self.seconds, 2),
                               "selftest_version": SELFTEST_VERSION}
        if cases:
            out["case_results"] = [case.as_dict() for case in self.cases]
        return out


def _same_answer(a: str, b: str | None) -> bool:
    """Whether two answers are the same after normalisation (then a 'wrong' answer would be right)."""
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
    report.sample = sample
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

    together = _together(env, todo) if env.probes_together else None
    if together is not None:
        results = together
    elif workers > 1 and len(todo) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(run, todo))
    else:
        results = [run(case) for case in todo]
    first_good: dict[tuple[str, str], CaseResult] = {}
    recorded: set[object] = set()  # cases graded together share their sandbox's record: stored once
    for (problem, label, completion, expect), (result, runs) in zip(todo, results, strict=True):
        report.cases.append(result)
        report.sandbox_runs.extend(row for row in runs if row.get("run_id") not in recorded)
        recorded.update(row.get("run_id") for row in runs if row.get("run_id") is not None)
        if on_case is not None:
            on_case(result)
        if not result.ok:
            what = "the known-good reference" if expect else f"a known-bad ({label}) completion"
            line = f"{problem.id}: {what} earned {result.reward} ({result.reason}): {completion[:60]!r}"
            accepted = getattr(env, "accepted_probes", frozenset())
            (report.accepted if not expect and label in accepted else report.failures).append(line)
        if label == "good":
            first_good[(problem.id, completion)] = result
        elif label == "good_again":
            first = first_good.get((problem.id, completion))
            if first is not None and (first.reward, first.reason) != (result.reward, result.reason):
                report.failures.append(f"{problem.id}: the known-good completion got two different verdicts")
    report.seconds = time.monotonic() - started
    return report


def _together(env: Environment, todo: list[tuple[Problem, str, str, float]],
              ) -> list[tuple[CaseResult, list[dict[str, Any]]]] | None:
    """The self-test's cases graded together (:meth:`Environment.verify_probes`: its own known-good and known-bad
    completions, never a policy's), each case's time the batch's mean; None where that fails (graded one by one)."""
    started = time.monotonic()
    try:
        verdicts = env.verify_probes([(problem, completion) for problem, _, completion, _ in todo])
    except Exception:
        return None
    if len(verdicts) != len(todo):
        return None
    seconds = (time.monotonic() - started) / max(len(todo), 1)
    out = []
    for (problem, label, completion, expect), verdict in zip(todo, verdicts, strict=True):
        runs = verdict.detail.pop("sandbox_runs", None) or []
        out.append((CaseResult(problem.id, label, completion, expect, verdict.reward, verdict.reason, seconds), runs))
    return out


# ---------------------------------------------------------------------------------------------------
# The environment quality check: generic probes that find hackable items before a policy does

PROBE_THRESHOLD = 0.05  # a probe passing more than this share of an environment's items flags the whole kind ...
PROBE_MIN_PASSED = 3  # ... when it passed at least this many (two items of eight sharing an answer is no pattern)
FIXED_STRING = "yes"
_DIGIT = re.compile(r"[0-9]")
_SIGNED = re.compile(r"(?<![0-9.])(-?)([0-9]+(?:\.[0-9]+)?)")


@dataclass
class ProbeResult:
    """How one probe fared on an environment's items: on how many it applied, how many it passed (reward 1)."""

    probe: str
    items: int = 0
    passed: int = 0
    reward: float = 0.0  # summed reward (partial credit included, for ``reward = "score"`` environments)
    passed_ids: list[str] = field(default_factory=list)

    @property
    def share(self) -> float:
        return self.passed / self.items if self.items else 0.0

    @property
    def mean_reward(self) -> float:
        return self.reward / self.items if self.items else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"probe": self.probe, "items": self.items, "passed": self.passed, "share": round(self.share, 4),
                "mean_reward": round(self.mean_reward, 4), "passed_ids": self.passed_ids}


@dataclass
class ProbeReport:
    """The quality check of one environment on a set of items. An item any probe passes is flagged (a wrong or
    constant answer earns full reward on it); a probe whose share of items (or mean reward, partial credit
    included) passes ``threshold``, on at least :data:`PROBE_MIN_PASSED` items, flags the whole kind: then every
    item is flagged."""

    env: str
    items: int
    threshold: float = PROBE_THRESHOLD
    probes: dict[str, ProbeResult] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    graded: int = 0

    @property
    def flagged_probes(self) -> list[str]:
        return sorted(name for name, result in self.probes.items() if result.passed >= PROBE_MIN_PASSED
                      and (result.share > self.threshold or result.mean_reward > self.threshold))

    @property
    def kind_flagged(self) -> bool:
        return bool(self.flagged_probes)

    def flagged_items(self) -> dict[str, list[str]]:
        """item id -> the probes that passed it."""
        found: dict[str, list[str]] = {}
        for name, result in sorted(self.probes.items()):
            for item in result.passed_ids:
                found.setdefault(item, []).append(name)
        return found

    def drop_ids(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` leave the training pool: all of them when the kind is flagged, else the flagged items."""
        return set(ids) if self.kind_flagged else set(ids) & set(self.flagged_items())

    def as_dict(self) -> dict[str, Any]:
        return {"env": self.env, "items": self.items, "threshold": self.threshold, "graded": self.graded,
                "kind_flagged": self.kind_flagged, "flagged_probes": self.flagged_probes,
                "flagged_items": len(self.flagged_items()), "errors": self.errors, "seconds": round(self.seconds, 2),
                "probes": {name: result.as_dict() for name, result in sorted(self.probes.items())}}


def _changed_digit(text: str) -> str | None:
    """``text`` with its leading significant digit changed (9 becomes 0, any other one more): wrong at any
    precision a question may state (a last digit changed is right where fewer digits are asked)."""
    digits = [m.start() for m in _DIGIT.finditer(text)]
    if not digits:
        return None
    at = next((i for i in digits if text[i] != "0"), digits[0])
    return text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:]


def _changed_sign(text: str) -> str | None:
    """``text`` with the sign of its first non-zero number flipped."""
    for match in _SIGNED.finditer(text):
        if match.group(2).strip("0.") == "":
            continue
        sign = "" if match.group(1) else "-"
        return text[:match.start()] + sign + match.group(2) + text[match.end():]
    return None


def answer_probes(env: Environment, problem: Problem, common: str | None) -> list[tuple[str, str]]:
    """The generic probes of an environment graded on a final answer: constants (the most common oracle answer
    of the sample, zero, empty, a fixed string, the oracle's layout with every number zero), and the oracle
    with its sign or a digit changed. Every one is a wrong answer, or one that needs no solving."""
    oracle = env.oracle_answer(problem)
    answers: list[tuple[str, str | None]] = [("most_common", common), ("zero", "0"), ("empty", ""),
                                             ("fixed_string", FIXED_STRING)]
    if oracle:
        zeros = _SIGNED.sub("0", oracle)
        answers += [("all_zero", zeros if zeros not in (oracle, "0") else None),
                    ("sign_changed", _changed_sign(oracle)), ("digit_changed", _changed_digit(oracle))]
    out = []
    for label, answer in answers:
        if answer is None or (label in ("sign_changed", "digit_changed") and _same_answer(answer, oracle)):
            continue
        completion = env.write_answer(answer)
        if completion is not None:
            out.append((label, completion))
    return out


def code_probes(problem: Problem) -> list[tuple[str, str]]:
    """The generic probe of a code problem: a function returning the visible test's value (hard-coding)."""
    completion = visible_constant(problem.payload) if problem.payload.get("tests") else None
    return [] if completion is None else [("visible_value", completion)]


def probes_for(env: Environment, problem: Problem, common: str | None,
               answers: frozenset[str] | None = None) -> list[tuple[str, str]]:
    """Every probe of ``problem``: the generic ones for its kind (of the answer probes, only ``answers`` when
    given), then the environment's own (``Environment.probe_completions``: move sprays, symlinked or wrongly typed
    files ...)."""
    generic = answer_probes(env, problem, common) if env.write_answer("0") is not None else []
    if answers is not None:
        generic = [(label, completion) for label, completion in generic if label in answers]
    if env.kind == "code":
        generic += code_probes(problem)
    return generic + env.probe_completions(problem)


def probe(env: Environment, problems: list[Problem], *, threshold: float = PROBE_THRESHOLD,
          workers: int = 2, graded: dict[tuple[str, str], float] | None = None,
          answers: frozenset[str] | None = None) -> ProbeReport:
    """The quality check of ``env`` on ``problems``: every probe (:func:`probes_for`) graded on every item,
    and the share of items each passes. Reusable on any :class:`Environment` (imported verifiers included).

    Cost: one grade per probe and item (about 7 for an answer environment, 1 for code, 5 for the terminal),
    graded on ``workers`` threads, or with ``workers=1`` together through :meth:`Environment.verify_probes` (a
    reasoning-gym environment scores them in one sandbox, a forked process each: 2.1 against 35.6 CPU-seconds
    for 467 probes of 17 generators, benchmarks/probe_batch.py on an Intel Xeon); ``graded`` ((problem id,
    completion) -> reward, e.g. the self-test's cases) holds grades already made, which are reused; ``answers``:
    only these of the generic answer probes."""
    report = ProbeReport(env.name, len(problems), threshold)
    started = time.monotonic()
    oracles = [a for a in (env.oracle_answer(p) for p in problems) if a]
    # the most common answer is a constant only where it is common: an answer that one item has is that item's
    most = Counter(oracles).most_common(1)
    common = most[0][0] if most and most[0][1] >= 2 else None
    todo = [(p, label, completion) for p in problems for label, completion in probes_for(env, p, common, answers)]

    def run(case: tuple[Problem, str, str]) -> tuple[float, str | None]:
        problem, _, completion = case
        if graded is not None and (problem.id, completion) in graded:
            return graded[(problem.id, completion)], None
        try:
            verdict = env.verify(problem, completion)
        except Exception as error:  # a verifier must not raise on a completion: reported, never a pass
            return 0.0, f"{problem.id}: {type(error).__name__}: {error}"[:200]
        return float(verdict.reward), None

    if workers > 1 and len(todo) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(run, todo))
    else:  # together (one sandbox for an environment's sandboxed scorer runs where it batches them), else one by one
        fresh = [case for case in todo if graded is None or (case[0].id, case[2]) not in graded]
        try:
            verdicts = env.verify_probes([(problem, completion) for problem, _, completion in fresh])
            together = {id(case): (float(v.reward), None) for case, v in zip(fresh, verdicts, strict=True)}
        except Exception:  # graded one by one, where each error is reported against its item
            together = {}
        results = [together[id(case)] if id(case) in together else run(case) for case in todo]
    for (problem, label, _), (reward, error) in zip(todo, results, strict=True):
        result = report.probes.setdefault(label, ProbeResult(label))
        result.items += 1
        result.reward += reward
        if reward >= 1.0:
            result.passed += 1
            result.passed_ids.append(problem.id)
        if error:
            report.errors.append(error)
    report.graded = sum(graded is None or (p.id, c) not in graded for p, _, c in todo)
    report.seconds = time.monotonic() - started
    return report


# the probes curation runs on every candidate: each is a wrong answer, or a constant that needs no solving, on
# its own (most_common is left out: one item sharing the sample's most common answer is no pattern; a whole kind
# whose answers are a few classes is answer_majority's business, measured over a large sample)
CURATION_PROBES = frozenset({"zero", "empty", "fixed_string", "all_zero", "sign_changed", "digit_changed"})


def hackable(env: Environment, problems: list[Problem]) -> set[str]:
    """The ids of ``problems`` that a wrong or constant answer passes (reward 1: :data:`CURATION_PROBES` and the
    environment's own probes), which curation keeps out of training (``curation.quality_check``). Only for
    built-in environments graded on a final answer without running anything (a code or terminal problem's probes
    run in the sandbox, and their pools are cleaned once by the environments themselves; an imported rubric is
    audited before it trains, `accept_probes`); a grader that raises on a probe
    flags nothing (the self-test reports it)."""
    if env.write_answer("0") is None or env.kind in ("code", "terminal", "openenv", "verifiers"):
        return set()
    return set(probe(env, problems, workers=1, answers=CURATION_PROBES).flagged_items())


# the training items answer_majority counts, and the fewest with an answer it needs to say anything
MAJORITY_SAMPLE = 200
MAJORITY_MIN_ITEMS = 50


@dataclass(frozen=True)
class Majority:
    """The most common expected answer of an environment's items and its share: a constant answer, that one,
    earns at least that share of strict reward on the kind without solving anything."""

    answer: str
    share: float
    items: int  # items with an expected answer counted
    classes: int  # distinct answers among them


def answer_majority(env: Environment, seed: int = 0, sample: int = MAJORITY_SAMPLE) -> Majority | None:
    """The most common expected answer (:meth:`Environment.oracle_answer`, spacing and case folded) among
    ``sample`` training items of ``env``; None where it grades no final answer or fewer than
    :data:`MAJORITY_MIN_ITEMS` items carry one (verifier-graded kinds: their answers are not compared as text).

    Measured over every shipped environment (``python benchmarks/answer_majority.py``, 2-core AMD EPYC):
    ``circuit_logic`` answers 1 on every item; ``syllogism``, ``game_of_life_halting``, ``isomorphic_strings``,
    ``ransom_note`` and ``course_schedule`` are yes/no kinds at 51-72% for one side; ``acre``, ``self_reference``,
    ``letter_counting``, ``mahjong_puzzle``, ``shortest_path``, ``gcd``, ``rotten_oranges`` and ``zebra_puzzles`` have
    one answer on 30-42% of their items; the built-in environments 4-6%."""
    if env.write_answer("0") is None or env.kind in ("code", "terminal", "openenv", "verifiers"):
        return None
    answers = [" ".join(answer.split()).casefold() for problem in env.problems("train", sample, seed)
               if (answer := env.oracle_answer(problem)) is not None]
    if len(answers) < MAJORITY_MIN_ITEMS:
        return None
    counts = Counter(answers)
    answer, count = counts.most_common(1)[0]
    return Majority(answer=answer, share=count / len(answers), items=len(answers), classes=len(counts))


def drop_flagged(env: Environment, problems: list[Problem], report: ProbeReport) -> list[Problem]:
    """``problems`` without those the quality check flagged (every one, when it flagged the kind); the count
    dropped is logged."""
    dropped = report.drop_ids([p.id for p in problems])
    if dropped:
        _log.warning(
            "%s: the quality check drops %d of %d training problems (probes flagged: %s)", env.name, len(dropped),
            len(problems), ", ".join(report.flagged_probes) or "per item")
    return [p for p in problems if p.id not in dropped]
