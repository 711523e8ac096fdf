"""Code environments (``code``, ``mbpp``) and the grader that does not trust the code it grades.

A code problem's payload is ``{"prompt": str, "tests": [str, ...], "test_setup": str (optional),
"entry_point": str (optional)}``: each test is Python that raises on failure (``assert f(2) == 4``,
``check(f)``). The completion is Python: the last fenced code block if there is one, else the text.

How a completion is graded (:func:`grade_code`), and why:

- The candidate's code runs in one sandbox (:mod:`evertrain.sandbox`), which serves calls to its
  top-level functions. The tests run in a second sandbox that never loads the candidate's code and
  reaches those functions through stubs. Only plain data crosses, in both directions, through a
  strict codec (:mod:`evertrain.sandbox.plain`): an object whose ``__eq__`` always says yes, an
  ``int`` subclass, a generator cannot cross and earn ``non_plain_value``. Whatever the candidate
  patches (builtins, ``AssertionError``, the test runner), it patches in its own process only.
- The tests are only in the test sandbox, so the candidate cannot read them (or the expected answers)
  from disk, the environment or the call stack.
- The parent makes a random nonce per grade that only the test process learns; reward needs the test
  process's final line ``<nonce> ok <number of tests>``, every test reported passed, and the test
  process exiting cleanly within its limits. The candidate's own output is never read for a verdict,
  so exiting early, printing "all tests passed" or raising SkipTest earns nothing.
- Everything else earns 0 with a reason (see :data:`REASONS`); the sandbox records of both processes
  go into ``verdict.detail["sandbox_runs"]`` as rows for the ``sandbox_runs`` audit table.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import hashlib
import json
import os
import re
import secrets
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, ClassVar

from evertrain.envs.base import Environment, FixedSplits, Problem, Split, Verdict, vendored_path
from evertrain.sandbox import Job, Limits, SandboxRunRecord, plain, run_group

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

# the programs that run inside the two sandboxes (standard library only; shipped as files)
_IN_SANDBOX = Path(__file__).resolve().parent.parent / "sandbox"
_PLAIN = (_IN_SANDBOX / "plain.py").read_text()
_SERVE = (_IN_SANDBOX / "serve_candidate.py").read_text()
_RUN_TESTS = (_IN_SANDBOX / "run_tests.py").read_text()

# Every reason a grade can give. Only "correct" earns reward.
REASONS: dict[str, str] = {
    "correct": "every test ran to its end in the test process and passed",
    "no_code": "the completion holds no code",
    "syntax_error": "the code does not compile",
    "candidate_crashed": "the candidate's process raised while loading, exited or died mid-test",
    "missing_function": "the code does not define the function the tests call (the entry point)",
    "tests_failed": "at least one test raised (a wrong answer, or an exception the candidate raised)",
    "non_plain_value": "the candidate returned something that is not plain data, or a garbled reply",
    "non_plain_argument": "the tests pass a value that cannot cross as plain data (a problem the "
                          "grader cannot grade; listed in MBPP_EXCLUDED for MBPP)",
    "setup_failed": "the problem's test setup code raised",
    "timeout": "a process ran past the wall-clock limit",
    "limit_cpu": "the candidate's process used up its CPU time",
    "limit_memory": "the candidate's process ran out of address space",
    "limit_nproc": "the candidate's process hit the process-count limit (e.g. a fork bomb)",
    "limit_fsize": "the candidate's process tried to write a file past the size limit",
    "limit_output": "the candidate's process flooded stdout or stderr",
    "tests_incomplete": "the test process did not report every test as run to its end",
}

# per process; each grade runs two. MBPP's slowest reference (task 123, amicable numbers below 10,000) needs
# 5.2 CPU-seconds bare on this repository's machine: 10 leaves it room, 30 s of wall clock room under load
GRADE_LIMITS = Limits(timeout_s=30.0, cpu_s=10)

# The info string of an opening fence: its tag, and the header of a fence left open (possessive: each
# character is read once). Fences are found with str.find loops, linear in the completion: the old
# regexes (a lazy body per opening, two adjacent [ \t]*) took minutes on a 200k-character reply.
_FENCE_TAG = re.compile(r"[ \t]*+([A-Za-z0-9_+-]*+)")
_OPEN_HEADER = re.compile(r"[ \t]*+(?:python3?|py)?+[ \t]*+\n", re.IGNORECASE)


def fenced_blocks(completion: str) -> list[tuple[str, str]]:
    """Every closed fenced block, left to right: (tag, body). The body runs from the line after the
    opening ``` to the next ```; an opening with no newline or no closing after it ends the search."""
    blocks: list[tuple[str, str]] = []
    position = 0
    while (start := completion.find("```", position)) != -1:
        newline = completion.find("\n", start + 3)
        close = completion.find("```", newline + 1) if newline != -1 else -1
        if close == -1:
            break  # every later opening would need a newline and a closing after this one's
        tag = _FENCE_TAG.match(completion, start + 3, newline)
        blocks.append((tag.group(1) if tag else "", completion[newline + 1:close]))
        position = close + 3
    return blocks


def _open_fence_body(completion: str) -> str | None:
    """The text after the first ``` whose line is a Python (or untagged) fence header, to the end."""
    position = 0
    while (start := completion.find("```", position)) != -1:
        if header := _OPEN_HEADER.match(completion, start + 3):
            return completion[header.end():]
        position = start + 1
    return None


def extract_code(completion: str) -> str:
    """The code in a completion: its last fenced block (untagged or Python), else the whole text.

    A fence that was opened but never closed (a reply cut off at the token limit) counts as a block
    running to the end of the text.
    """
    python = ("", "python", "python3", "py")
    blocks = [body for tag, body in fenced_blocks(completion) if tag.lower() in python]
    if blocks:
        return blocks[-1].strip("\n")
    unclosed = _open_fence_body(completion)
    if unclosed is not None and "```" not in unclosed:
        return unclosed.strip("\n")
    return completion.strip("\n")


@lru_cache(maxsize=4096)
def _referenced_names(sources: tuple[str, ...]) -> frozenset[str]:
    """Every name the tests (trusted code) use; done here so the test sandbox need not import ast."""
    names: set[str] = set()
    for source in sources:
        with contextlib.suppress(SyntaxError, ValueError):  # such a test fails when it runs
            names |= {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}
    return frozenset(names)


def _called_names(payload: dict[str, Any]) -> list[str]:
    """Names the tests call (``f`` in ``assert f(2) == 4``), found with ast; builtins left out."""
    names: set[str] = set()
    for test in payload.get("tests", []):
        with contextlib.suppress(SyntaxError, ValueError):
            for node in ast.walk(ast.parse(test)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    names.add(node.func.id)
    return sorted(name for name in names if not hasattr(builtins, name))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def grade_code(payload: dict[str, Any], completion: str, *,
               limits: Limits | None = None) -> tuple[Verdict, list[SandboxRunRecord]]:
    """Grade ``completion`` against ``payload["tests"]``: see the module docstring for how.

    Returns the verdict and the sandbox records (also in ``verdict.detail["sandbox_runs"]`` as
    table rows, with ``started_at`` as an ISO string so the detail stays JSON).
    """
    tests = list(payload["tests"])
    if not tests or not all(isinstance(test, str) for test in tests):
        raise ValueError("a code problem needs a non-empty list of tests (strings)")  # else any reply passes
    source = extract_code(completion)
    if not source.strip():
        return Verdict.fail("no_code", sandbox_runs=[]), []
    limits = limits or GRADE_LIMITS
    nonce = secrets.token_hex(16)
    setup = payload.get("test_setup") or ""
    spec = {"nonce": nonce, "tests": tests, "setup": setup, "entry_point": payload.get("entry_point"),
            "referenced": sorted(_referenced_names((*tests, setup)))}
    # Two pipes and no shared filesystem: the candidate can send bytes to the test process and nothing
    # else. run_group owns these fds and closes the parent's copies once both processes have started,
    # so each side sees end-of-file when the other is gone.
    to_tests_r, to_tests_w = os.pipe()
    to_cand_r, to_cand_w = os.pipe()
    candidate = Job(purpose="candidate", source=_SERVE, args=(str(to_cand_r), str(to_tests_w)),
                    files={"plain.py": _PLAIN, "candidate.py": source}, pass_fds=(to_cand_r, to_tests_w),
                    limits=limits, code_sha256=_sha256(source))
    tester = Job(purpose="tests", source=_RUN_TESTS, args=(str(to_tests_r), str(to_cand_w)),
                 files={"plain.py": _PLAIN, "spec": plain.encode(spec)},
                 pass_fds=(to_tests_r, to_cand_w), limits=limits,
                 code_sha256=_sha256(json.dumps({**spec, "nonce": ""}, sort_keys=True)))
    records = run_group([candidate, tester], primary=1, grace_s=0.5, own_fds=True)
    verdict = _verdict(tests, nonce, *records)
    verdict.detail["sandbox_runs"] = [
        {**record.to_row(), "started_at": record.started_at.isoformat()} for record in records
    ]
    return verdict, records


def _report(stdout: str, nonce: str) -> list[list[str]]:
    """The test process's report lines (those that start with the nonce), split into words."""
    prefix = nonce + " "
    return [line[len(prefix):].split(" ", 4) for line in stdout.splitlines() if line.startswith(prefix)]


def _verdict(tests: list[str], nonce: str, candidate: SandboxRunRecord, tester: SandboxRunRecord) -> Verdict:
    per_test: dict[int, dict[str, Any]] = {}
    abort: str | None = None
    ok_count: int | None = None
    detail: dict[str, Any] = {}
    for words in _report(tester.stdout, nonce):
        if words[0] == "test" and len(words) >= 3 and words[1].isdigit():
            entry: dict[str, Any] = {"passed": words[2] == "pass"}
            if len(words) > 3:
                entry["reason"] = words[3]
            if len(words) > 4:
                entry["error"] = _json_or_text(words[4])
            per_test[int(words[1])] = entry
        elif words[0] == "abort" and len(words) >= 2:
            abort = words[1]
            if len(words) > 2:
                detail["error"] = _json_or_text(" ".join(words[2:]))
        elif words[0] == "ok" and len(words) == 2 and words[1].isdigit():
            ok_count = int(words[1])
    detail["tests"] = [{"index": i, **per_test.get(i, {"passed": None})} for i in range(len(tests))]
    detail["run_ids"] = [candidate.run_id, tester.run_id]
    passed = (ok_count == len(tests) and all(per_test.get(i, {}).get("passed") for i in range(len(tests)))
              and tester.exit_code == 0 and tester.limit_hit is None)
    if passed:
        return Verdict.ok("correct", **detail)
    return Verdict.fail(_failure_reason(abort, per_test, candidate, tester), **detail)


def _failure_reason(abort: str | None, per_test: dict[int, dict[str, Any]], candidate: SandboxRunRecord,
                    tester: SandboxRunRecord) -> str:
    """Name why a grade failed; the first matching cause wins (the reward is 0 whichever it is)."""
    if abort in ("syntax_error", "missing_function", "setup_failed", "non_plain_argument"):
        return abort
    if "timeout" in (candidate.limit_hit, tester.limit_hit):
        return "timeout"
    if candidate.limit_hit:
        return f"limit_{candidate.limit_hit}"
    if tester.limit_hit:
        return f"limit_{tester.limit_hit}"
    reasons = [entry.get("reason") for entry in per_test.values()]
    for reason in ("non_plain_value", "non_plain_argument", "candidate_crashed"):
        if reason in reasons or abort == reason:
            return reason
    if "tests_failed" in reasons:
        return "tests_failed"
    return "tests_incomplete"


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---------------------------------------------------------------------------------------------------
# Environments


class CodeEnvironment(FixedSplits, Environment):
    """``code``: Python problems in the generic payload format, read from a JSONL file (``path=``).

    Each line is a payload (``prompt``, ``tests``, optional ``test_setup``, ``entry_point``,
    ``reference``, ``split``). Without a ``split`` field a problem is held out when its content-hash id
    falls in one tenth of the hash space, as in ``gsm8k``.
    """

    name: ClassVar[str] = "code"
    kind: ClassVar[str] = "code"
    source: ClassVar[str] = "a JSONL file of code problems (option path=)"
    system_prompt: ClassVar[str] = (
        "You are an expert Python programmer. Reply with the complete solution in one ```python code block."
    )

    def __init__(self, path: str | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.path = path

    def _rows(self) -> list[tuple[str, dict[str, Any], Split | None]]:
        """(prompt, payload, split or None) for every problem."""
        if self.path is None:
            raise ValueError("the code environment reads problems from a JSONL file: pass path=...")
        rows = []
        with open(self.path) as lines:
            for number, line in enumerate(lines, 1):
                try:
                    row = json.loads(line)
                    prompt, tests = row.pop("prompt"), row["tests"]
                    split = row.pop("split", None)
                    if not (isinstance(prompt, str) and isinstance(tests, list) and tests
                            and all(isinstance(test, str) for test in tests)):
                        raise ValueError("prompt must be a string, tests a non-empty list of strings")
                    if split not in (None, "train", "eval"):
                        raise ValueError(f"split must be train or eval, not {split!r}")
                except (json.JSONDecodeError, KeyError, ValueError, AttributeError) as error:
                    raise ValueError(f"{self.path}:{number}: not a code problem ({error})") from None
                rows.append((prompt, row, split))
        return rows

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        splits: dict[str, list[Problem]] = {"train": [], "eval": []}
        for prompt, payload, fixed in self._rows():
            problem_ = Problem.make(self.name, prompt, payload)
            split: Split = fixed or ("eval" if int(problem_.id, 16) % 10 == 0 else "train")
            splits[split].append(Problem(self.name, problem_.id, prompt, payload, split))
        return splits

    def verify(self, problem: Problem, completion: str) -> Verdict:
        verdict, _ = grade_code(problem.payload, completion)
        return verdict

    def reference(self, problem: Problem) -> str | None:
        code = problem.payload.get("reference")
        return f"```python\n{code}\n```" if code else None

    def known_bad(self, problem: Problem, other: Problem | None) -> list[tuple[str, str]]:
        """The code grader's battery: constant answers (0, 1, None, nan, inf, '', a huge number), another
        problem's solution, control-flow exceptions that end the tests' iterators (StopIteration under
        ``map``/``all``), the tests restated as code, and the classic harness hacks; all must earn 0."""
        entry = problem.payload.get("entry_point") or "solution"
        names = sorted({entry} | set(_called_names(problem.payload)))

        def defining(body: str) -> str:
            return "```python\n" + "\n".join(f"def {name}(*args, **kwargs):\n    {body}" for name in names) + "\n```"

        cases = [("hack", hack.replace("{entry}", entry)) for hack in CODE_HACKS]
        cases += [("zero", defining("return 0")), ("one", defining("return 1")), ("none", defining("return None")),
                  ("empty_value", defining("return ''")), ("non_finite", defining("return float('nan')")),
                  ("non_finite", defining("return float('inf')")),
                  ("over_long_number", defining("return 10 ** 100000")),
                  ("stop_iteration", defining("raise StopIteration")),
                  ("stop_iteration", defining("raise StopAsyncIteration")),
                  ("generator_exit", defining("raise GeneratorExit")),
                  ("restated", "```python\n" + "\n".join(problem.payload.get("tests", [])) + "\n```"),
                  ("non_finite", defining("return float('-inF')")), ("non_finite", defining("return float('1e9_99')")),
                  # fences that stalled the old quadratic fence regexes: parsed in bounded time, earning 0
                  ("stalling", "```" * 60_000), ("stalling", "```" + " " * 150_000 + "x")]
        if other is not None:
            cases += [("other_problem", good) for good in self.known_good(other)]
        return cases

    def parse_problem(self, data: dict[str, Any]) -> Problem:
        if not isinstance(data, dict):
            raise ValueError(f"problem must be a JSON object, not {type(data).__name__}")
        prompt, tests = data.get("prompt"), data.get("tests")
        if not isinstance(prompt, str):
            raise ValueError("problem.prompt must be a string")
        if not (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)):
            raise ValueError("problem.tests must be a non-empty list of strings")
        for key in ("test_setup", "entry_point"):
            if key in data and not isinstance(data[key], str):
                raise ValueError(f"problem.{key} must be a string")
        return Problem.make(self.name, prompt, {k: v for k, v in data.items() if k != "prompt"})


# MBPP problems the plain-data grader cannot grade, with why; they are in neither split. Found by
# grading every reference solution (tests/test_code_grader.py, benchmarks/sandbox.py).
MBPP_EXCLUDED: dict[int, str] = {
    40: "the reference returns a collections.Counter (a dict subclass, so not plain data)",
    88: "the reference returns a collections.Counter (a dict subclass, so not plain data)",
    367: "test_setup_code builds a tree of the solution's own Node objects: objects cannot cross",
    533: "the tests pass type objects (int, str, float) as arguments: not plain data",
    601: "the tests build the solution's own Pair objects and pass them back: objects cannot cross",
    653: "the reference returns a collections.defaultdict (a dict subclass, so not plain data)",
    902: "the reference returns a collections.Counter (a dict subclass, so not plain data)",
    927: "test_setup_code builds a tree of the solution's own Node objects: objects cannot cross",
}

def _expectation(test: str) -> tuple[str, Any] | None:
    """What one ``assert`` test asks of the value its call returns: ("eq", value), ("truthy", None) or
    ("falsy", None); None when the test is of another form (then no constant is known to pass it)."""
    try:
        body = ast.parse(test).body
    except SyntaxError:
        return None
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        return None
    node = body[0].test
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.Is)):
        for side, call in ((node.comparators[0], node.left), (node.left, node.comparators[0])):
            if isinstance(call, ast.Call):
                try:
                    return "eq", ast.literal_eval(side)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    return None
        return None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and isinstance(node.operand, ast.Call):
        return "falsy", None
    return ("truthy", None) if isinstance(node, ast.Call) else None


def constant_answer(tests: list[str]) -> tuple[Any] | None:
    """``(value,)`` when one constant return value passes every test (the tests cannot tell a function that
    returns it from a solution: hard-coding the visible test's value passes the hidden ones), else None."""
    wanted = [_expectation(test) for test in tests]
    if not wanted or any(w is None for w in wanted):
        return None
    candidates = [value for kind, value in wanted if kind == "eq"] or [True, False]  # type: ignore[misc]

    def passes(value: Any, kind: str, expected: Any) -> bool:
        try:
            return bool(value == expected) if kind == "eq" else bool(value) == (kind == "truthy")
        except Exception:  # a literal that cannot be compared: no verdict from it
            return False

    for value in candidates:
        if all(passes(value, kind, expected) for kind, expected in wanted):  # type: ignore[misc]
            return (value,)
    return None


def visible_constant(payload: dict[str, Any]) -> str | None:
    """A completion that returns the visible (first) test's expected value whatever it is called with: the
    visible-test hard-coding a policy tries first; None when that test states no value."""
    tests = payload.get("tests") or []
    expected = _expectation(tests[0]) if tests else None
    if expected is None:
        return None
    value = expected[1] if expected[0] == "eq" else expected[0] == "truthy"
    names = sorted({payload.get("entry_point") or "solution"} | set(_called_names(payload)))
    return "```python\n" + "\n".join(f"def {name}(*args, **kwargs):\n    return {value!r}" for name in names) + "\n```"


_MBPP_EXAMPLE = (
    "You are an expert Python programmer, and here is your task: Write a function to find the shared "
    "elements of two tuples, in increasing order.\nYour code should pass this test:\n\n"
    "assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)\n\n"
    "Write the function `similar_elements` and give the complete code in a ```python code block.",
    "```python\ndef similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n```",
)


class MBPP(CodeEnvironment):
    """``mbpp``: Mostly Basic Python Problems (Google Research, CC BY 4.0), vendored in ``data/mbpp``.

    Splits follow MBPP's own convention, by ``task_id``: 11-510 are its test set and our held-out
    ``eval`` split; 511-600 (its validation set) and 601-974 (its training set) are our ``train``
    split; 1-10 are its few-shot prompt problems and in neither split (one of them, task 2, rewritten,
    is the worked example). Problems in :data:`MBPP_EXCLUDED` are in neither split, nor are those whose
    tests one constant passes (:func:`constant_answer`: every test expects the visible test's value, so
    hard-coding it would pass the hidden ones; :meth:`constant_ids` lists them).

    The prompt shows one of the three tests (the MBPP convention) and names the function; the other
    two stay hidden, so a reply that hard-codes the visible test fails. ``challenge_test_list`` is not
    used (it exists for 11 problems only), as in MBPP's standard evaluation.
    """

    name: ClassVar[str] = "mbpp"
    source: ClassVar[str] = "data/mbpp/mbpp.jsonl (Google Research MBPP, CC BY 4.0)"
    examples: ClassVar[tuple[tuple[str, str], ...]] = (_MBPP_EXAMPLE,)

    def __init__(self, **options: Any) -> None:
        Environment.__init__(self, **options)
        self.path = None

    @staticmethod
    def split_of(task_id: int) -> Split | None:
        if 11 <= task_id <= 510:
            return "eval"
        if 511 <= task_id <= 974:
            return "train"
        return None

    @staticmethod
    def constant_ids() -> list[int]:
        """The task ids left out because one constant passes all their tests (counted and listed in the docs)."""
        with vendored_path("mbpp", "mbpp.jsonl").open() as lines:
            rows = [json.loads(line) for line in lines]
        return [row["task_id"] for row in rows if MBPP.split_of(row["task_id"]) is not None
                and row["task_id"] not in MBPP_EXCLUDED and constant_answer(row["test_list"]) is not None]

    def _rows(self) -> list[tuple[str, dict[str, Any], Split | None]]:
        path = vendored_path("mbpp", "mbpp.jsonl")
        rows = []
        with path.open() as lines:
            for number, line in enumerate(lines, 1):
                try:
                    row = json.loads(line)
                    task_id, text, code, tests = row["task_id"], row["text"], row["code"], row["test_list"]
                    entry_point = mbpp_entry_point(code, tests[0])
                except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as error:
                    raise ValueError(f"{path}:{number}: not an MBPP row ({error!r})") from None
                split = self.split_of(task_id)
                # an item whose tests a constant passes (all expect the visible test's value) rewards hard-coding
                if split is None or task_id in MBPP_EXCLUDED or constant_answer(tests) is not None:
                    continue
                prompt = (
                    f"You are an expert Python programmer, and here is your task: {text}\n"
                    f"Your code should pass this test:\n\n{tests[0]}\n\n"
                    f"Write the function `{entry_point}` and give the complete code in a ```python code "
                    "block."
                )
                payload = {"task_id": task_id, "tests": tests, "test_setup": row.get("test_setup_code") or "",
                           "entry_point": entry_point, "reference": code}
                rows.append((prompt, payload, split))
        return rows


def mbpp_entry_point(reference: str, test: str) -> str:
    """The function a test calls that the reference defines: MBPP names it nowhere else."""
    defined = {node.name for node in ast.parse(reference).body
               if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    for node in ast.walk(ast.parse(test)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in defined:
            return node.func.id
    raise ValueError(f"no function of the reference is called by {test!r}")
