"""Multi-turn tool use: the call format, the tools (sandboxed Python, read-only SQL), and transcript grading.

The tool-call format
--------------------

SmolLM2's ChatML template has no native tool-call format, so the format is plain text any chat model
can write, and the tool's reply is an ordinary chat message with role ``tool``::

    <|im_start|>assistant
    The baker makes 17 * 23 cookies and sells 250 of them.
    <python>
    17 * 23 - 250
    </python><|im_end|>
    <|im_start|>tool
    141<|im_end|>
    <|im_start|>assistant
    17 trays of 23 cookies are 391 cookies, and 391 - 250 = 141 are left.
    #### 141<|im_end|>

The rules, for a tool named NAME (``python``, ``sql``):

- A call is a block ``<NAME>input</NAME>`` in an assistant turn; prose before it is fine. The policy
  ends its turn at the closing tag, and the rollout should stop generating there (:func:`stop_strings`),
  so that no made-up tool output is trained on.
- Only the FIRST tool block of a turn is a call: the turn ends at its closing tag, so anything after
  it (a made-up result, a second block) is ignored. It runs when its input is not blank.
- A block is well formed when the next tool tag after ``<NAME>`` is ``</NAME>``: no nesting, no other
  tool's tag inside, no missing closing tag. A turn whose first tool block is malformed has no call.
  Tags tolerate whitespace and case (``< Python >``); a Markdown code fence around the input is removed.
- A final-answer marker (``####`` or ``\\boxed{``) written outside every tool block makes the turn a
  FINAL ANSWER: it runs no tool, even if it also holds a call. A marker inside a block is code, not
  an answer.
- The tool's output comes back as the next message, role ``tool`` (:func:`format_tool_result`: at
  most 500 characters, then a truncation marker; ``<|`` is defused so that output cannot forge chat
  structure). The policy then continues with a new assistant turn.
- The episode ends at the first assistant turn without a call, or after ``env.max_turns`` assistant
  turns. Only the final assistant turn is graded, under the strict final-answer rule
  (:mod:`evertrain.envs.answers`), with every well-formed tool block removed first: tool messages are
  never graded, so a tool that prints ``#### 42`` supplies nothing, and neither does a ``#### 42``
  inside a call.

The tools
---------

- :class:`PythonTool` (``python``): the code runs in the bubblewrap sandbox (no network, no host
  files, standard library only, 5 s, 256 MB); the reply is its stdout, and when the last statement is
  an expression its value too (a calculator: ``17 * 23`` replies ``391``); an error replies with its last
  line (``Type: message``) and ``error=True``. The sandbox records ride on the result (``sandbox_runs``)
  for the audit table.
- :class:`SqlTool` (``sql``): one read-only SELECT over a small DuckDB table, in a fresh in-memory
  database per call with file and network access switched off and the configuration locked, run out
  of process (:mod:`evertrain.sandbox.sql_worker`: a forked child per query with RLIMIT_AS 768 MB and
  RLIMIT_CPU, killed at the wall-clock limit); at most 20 rows, 2 s, DuckDB's own 128 MB.
"""

from __future__ import annotations

import csv
import re
import textwrap
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import duckdb

from evertrain.envs.answers import grade_math
from evertrain.envs.base import Environment, Problem, Tool, ToolResult, Verdict, earlier_calls, vendored_path
from evertrain.sandbox.bwrap import Limits, run_python
from evertrain.sandbox.sql_worker import SqlWorker

FINAL_MARKERS = ("####", "\\boxed{")
MAX_TOOL_OUTPUT = 500  # characters of a tool's output the policy sees
# A fence's info string (``python``, ``py3`` ...). Every text step on a turn is linear in its length
# (possessive quantifiers, str.find loops): a turn is parsed in the grading process, where a pattern
# whose time grows with the square of its input stalls every item graded beside it.
_FENCE_INFO = re.compile(r"[\w+-]*+[ \t]*+")

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and the text inside its tags (fence removed, dedented)."""

    name: str
    input: str


@dataclass
class ToolOutput(ToolResult):
    """A tool result that also carries the audit rows of the sandboxed processes it ran.

    ``sandbox_runs`` holds ``SandboxRunRecord.to_row()`` dicts with ``started_at`` as an ISO string
    (JSON-safe): the rollout adds campaign and iteration and appends them to ``sandbox_runs``.
    """

    sandbox_runs: list[dict[str, Any]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# Parsing


def _tags(text: str, names: list[str]) -> list[tuple[int, int, bool, str]]:
    """Every tool tag in ``text`` (``<name>``, ``< / NAME >``: spaces allowed, case ignored) as
    (start, end, closing, name), in order. One pass of str.find: each character is looked at a
    bounded number of times, whatever the text (a regex with adjacent ``\\s*`` was quadratic)."""
    lowered = sorted({name.lower() for name in names}, key=len, reverse=True)
    found: list[tuple[int, int, bool, str]] = []
    size = len(text)
    start = text.find("<")
    while start != -1:
        position = start + 1
        while position < size and text[position].isspace():
            position += 1
        closing = position < size and text[position] == "/"
        if closing:
            position += 1
            while position < size and text[position].isspace():
                position += 1
        for name in lowered:
            if text[position:position + len(name)].lower() == name:
                end = position + len(name)
                while end < size and text[end].isspace():
                    end += 1
                if end < size and text[end] == ">":
                    found.append((start, end + 1, closing, name))
                    break
        start = text.find("<", start + 1)
    return found


def _blocks(text: str, names: Iterable[str]) -> list[tuple[int, int, str, str, bool]]:
    """Every tool block opened in ``text``: (start, end, name, inner, well_formed), in order.

    A block opened by ``<NAME>`` is well formed when the very next tool tag is ``</NAME>``; a
    malformed block spans only its opening tag.
    """
    canonical = {name.lower(): name for name in names}
    if not canonical:
        return []
    tags = _tags(text, list(canonical))
    blocks = []
    for i, (start, end, closing, lowered) in enumerate(tags):
        if closing:
            continue  # a closing tag: consumed by its opening tag, or stray
        name = canonical[lowered]
        after = tags[i + 1] if i + 1 < len(tags) else None
        if after is not None and after[2] and after[3] == lowered:
            blocks.append((start, after[1], name, text[end:after[0]], True))
        else:
            blocks.append((start, end, name, "", False))
    return blocks


def strip_tool_blocks(text: str, tools: Iterable[str]) -> str:
    """``text`` with every well-formed tool block removed: what remains is what gets graded."""
    kept, position = [], 0
    for start, end, _, _, well_formed in _blocks(text, tools):
        if well_formed:
            kept.append(text[position:start])
            position = end
    kept.append(text[position:])
    return "".join(kept)


def has_final_answer(text: str, tools: Iterable[str] = ()) -> bool:
    """Whether ``text`` holds a final-answer marker outside every well-formed tool block."""
    outside = strip_tool_blocks(text, tools)
    return any(marker in outside for marker in FINAL_MARKERS)


def _fenced_body(inner: str) -> str | None:
    """The body of ``inner`` when it is one fenced block (```` ```info\\n...\\n``` ````, spaces around), else None."""
    text = inner.strip()
    newline = text.find("\n")
    if not text.startswith("```") or not text.endswith("```") or newline == -1 or newline + 1 > len(text) - 3:
        return None
    if not _FENCE_INFO.fullmatch(text, 3, newline):
        return None
    body = text[newline + 1:len(text) - 3].rstrip(" \t")
    return body[:-1] if body.endswith("\n") else body


def _clean_input(inner: str) -> str:
    if (body := _fenced_body(inner)) is not None:
        inner = body
    return textwrap.dedent(inner).strip("\n").rstrip()


def parse_tool_call(text: str, tools: Iterable[str]) -> ToolCall | None:
    """The call an assistant turn makes, or None when the turn is a final answer (see the module rules).

    ``tools`` is the environment's ``tools`` mapping (or any iterable of tool names). The call is the
    turn's first tool block, provided it is well formed, its input is not blank, and the turn has no
    final-answer marker outside its tool blocks.
    """
    names = list(tools)
    blocks = _blocks(text, names)
    if not blocks:
        return None
    _, _, name, inner, well_formed = blocks[0]
    if not well_formed or has_final_answer(text, names):
        return None
    code = _clean_input(inner)
    return ToolCall(name, code) if code.strip() else None


def stop_strings(tools: Iterable[str]) -> list[str]:
    """Closing tags at which a sampler may stop an assistant turn: the turn ends with its call."""
    return [f"</{name}>" for name in tools]


def format_tool_result(name: str, result: ToolResult, limit: int = MAX_TOOL_OUTPUT) -> str:
    """The content of the ``tool`` message for ``result``: short, and unable to forge chat structure.

    Trailing whitespace goes; output past ``limit`` characters is cut with a marker saying how much;
    ``<|`` becomes ``< |`` so printed text cannot become ChatML special tokens (``<|im_end|>``) when
    the chat is tokenized again. An empty output says so, so the policy knows the call ran.
    """
    text = result.output.rstrip()
    if not text.strip():
        text = f"({name} returned no output)"
    if len(text) > limit:
        text = text[:limit] + f"\n… [truncated: {len(text) - limit} more characters]"
    return text.replace("<|", "< |")


# ---------------------------------------------------------------------------------------------------
# The Python tool

PYTHON_LIMITS = Limits(timeout_s=5.0, cpu_s=5, memory_mb=256, nproc=16, nofile=32, fsize_mb=1, tmpfs_mb=8,
                       output_keep_bytes=8 * 1024, output_kill_bytes=1024 * 1024)

# Runs inside the sandbox: the policy's code is /sandbox/code.py. Like a REPL, the value of a final
# expression statement is printed (so ``17 * 23`` works as a calculator); an error prints its last
# line to stderr, without the traceback through this wrapper.
_PYTHON_RUNNER = """\
import ast, sys
try:
    with open('/sandbox/code.py', encoding='utf-8') as f:
        tree = ast.parse(f.read(), '<python>')
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    scope = {'__name__': '__main__', '__builtins__': __builtins__}
    exec(compile(tree, '<python>', 'exec'), scope)
    if last is not None:
        value = eval(compile(last, '<python>', 'eval'), scope)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException as error:
    sys.stdout.flush()
    message = ' '.join(str(error).split())
    print(type(error).__name__ + (': ' + message if message else ''), file=sys.stderr)
    sys.exit(1)
"""

_LIMIT_MESSAGES = {
    "timeout": "TimeoutError: the code ran longer than {timeout:g} s",
    "cpu": "TimeoutError: the code used more than {cpu} s of CPU",
    "memory": "MemoryError: the code used more than {memory} MB",
    "output": "the code printed too much output",
    "nproc": "the code started too many processes or threads",
    "fsize": "the code wrote too large a file",
}


class PythonTool(Tool):
    """Runs the policy's Python in the bubblewrap sandbox; replies with what it printed."""

    name: ClassVar[str] = "python"
    description: ClassVar[str] = (
        "Runs Python 3 (standard library only, no files, no network, 5 s) and replies with what it "
        "printed; the value of a final bare expression is printed too, like a calculator.")

    def __init__(self, limits: Limits = PYTHON_LIMITS) -> None:
        self.limits = limits

    def run(self, call: str, problem: Problem) -> ToolOutput:
        """Run ``call``. Never raises on what it contains; raises SandboxUnavailable (an operator's problem)."""
        code = call.encode("utf-8", "replace")  # a lone surrogate must not raise here
        record = run_python(_PYTHON_RUNNER, purpose="tool:python", limits=self.limits, files={"code.py": code})
        rows = [{**record.to_row(), "started_at": record.started_at.isoformat()}]
        output = record.stdout
        failed = record.exit_code != 0 or record.limit_hit is not None
        if failed:
            if record.limit_hit in _LIMIT_MESSAGES:
                line = _LIMIT_MESSAGES[record.limit_hit].format(
                    timeout=self.limits.timeout_s, cpu=self.limits.cpu_s, memory=self.limits.memory_mb)
            else:
                lines = [line for line in record.stderr.splitlines() if line.strip()]
                line = lines[-1] if lines else f"the code failed (exit {record.exit_code}, signal {record.signal})"
            output = (output.rstrip("\n") + "\n" + line) if output.strip() else line
        return ToolOutput(output=output, error=failed, sandbox_runs=rows)


# ---------------------------------------------------------------------------------------------------
# The SQL tool


@dataclass(frozen=True)
class SqlTable:
    """A vendored CSV loaded as one DuckDB table: its name, CSV path (under data/), and column types."""

    name: str
    csv: tuple[str, ...]
    columns: tuple[tuple[str, str], ...]

    def ddl(self) -> str:
        return f"CREATE TABLE {self.name} ({', '.join(f'{c} {t}' for c, t in self.columns)})"


class SqlTool(Tool):
    """Runs one read-only SELECT over a small vendored DuckDB table and replies with the rows.

    Untrusted SQL never runs in this process: each call goes to the SQL worker
    (:mod:`evertrain.sandbox.sql_worker`), which forks a child per query under hard limits (RLIMIT_AS
    ``process_memory_mb``, RLIMIT_CPU, killed at the wall-clock limit), because DuckDB's own memory
    limit and interrupt do not bound every function call (one query grew the rollout process by 2-5 GB).
    The child gets a fresh in-memory database (nothing a call
    does can reach the next) that is locked down before the policy's SQL touches it: no file or
    network access (so no COPY, ATTACH, INSTALL/LOAD, read_csv of host files), extensions never
    auto-installed or auto-loaded, no spilling to a temp directory, one thread, 128 MB, and the
    configuration locked so the SQL cannot undo any of it. On top of that only a single SELECT (or
    WITH ... SELECT, VALUES, DESCRIBE) statement of at most ``max_query_chars`` is accepted, at most
    ``max_rows`` rows come back, and a timer interrupts the query after ``timeout_s`` seconds (an
    endless recursive CTE, a huge cross join).
    """

    name: ClassVar[str] = "sql"
    description: ClassVar[str] = "Runs one read-only DuckDB SELECT over the table and replies with up to 20 rows."

    def __init__(self, table: SqlTable, *, max_rows: int = 20, timeout_s: float = 2.0,
                 memory_limit: str = "128MB", max_query_chars: int = 4000, csv_path: Path | None = None,
                 process_memory_mb: int = 768) -> None:
        self.table, self.max_rows, self.timeout_s, self.memory_limit = table, max_rows, timeout_s, memory_limit
        # DuckDB's own limit, and the hard one: the query process's whole address space (RLIMIT_AS)
        size = memory_limit.strip().upper()
        if not (size.endswith(("MB", "GB")) and size[:-2].strip().isdigit()):
            raise ValueError(f"SqlTool memory_limit must look like '128MB' or '1GB', not {memory_limit!r}")
        self.duckdb_memory_mb = int(size[:-2]) * (1024 if size.endswith("GB") else 1)
        self.process_memory_mb = process_memory_mb
        self.max_query_chars = max_query_chars
        self.csv_path = csv_path  # None: the vendored file table.csv under data/

    @cached_property
    def _insert(self) -> str:
        """One INSERT of every row of the CSV, read once (the host file is read here, never by the SQL)."""
        path = self.csv_path or vendored_path(*self.table.csv)
        with path.open(newline="") as file:
            rows = list(csv.reader(file))
        header, body = rows[0], rows[1:]
        expected = [c for c, _ in self.table.columns]
        if header != expected or any(len(row) != len(header) for row in body):
            raise ValueError(f"{path}: not a table with columns {expected}")
        values = ", ".join("(" + ", ".join("'" + v.replace("'", "''") + "'" for v in row) + ")" for row in body)
        return f"INSERT INTO {self.table.name} VALUES {values}"

    def connect(self) -> duckdb.DuckDBPyConnection:
        """A fresh, locked-down in-memory database holding the table, in this process: for trusted SQL only
        (generating the questions, tests); the policy's SQL goes through :meth:`run`."""
        con = duckdb.connect(":memory:", config={"threads": 1, "memory_limit": self.memory_limit})
        try:
            con.execute(self.table.ddl())
            con.execute(self._insert)
            for setting in ("SET temp_directory = ''", "SET autoinstall_known_extensions = false",
                            "SET autoload_known_extensions = false", "SET enable_external_access = false",
                            "SET lock_configuration = true"):
                con.execute(setting)
        except BaseException:
            con.close()
            raise
        return con

    def run(self, call: str, problem: Problem) -> ToolOutput:
        """Run ``call`` in the SQL worker (see :mod:`evertrain.sandbox.sql_worker`): never in this process.

        Refusals, errors, timeouts and a query that runs out of memory come back as ``error=True``.
        """
        if len(call) > self.max_query_chars:
            return ToolOutput(f"refused: the query is longer than {self.max_query_chars} characters", error=True)
        reply = _sql_worker().run({
            "setup": [self.table.ddl(), self._insert], "query": call, "max_rows": self.max_rows,
            "timeout_s": self.timeout_s, "memory_mb": self.process_memory_mb, "threads": 1,
            "duckdb_memory_mb": self.duckdb_memory_mb})
        if not reply.get("ok"):
            return ToolOutput(str(reply.get("error", "the query failed"))[:300], error=True)
        rows, columns = reply["rows"], reply["columns"]
        lines = [" | ".join(columns)] + [" | ".join(row) for row in rows]
        if reply["more"]:
            lines.append(f"(first {self.max_rows} rows shown; more not shown)")
        else:
            lines.append(f"({len(rows)} row{'' if len(rows) == 1 else 's'})")
        return ToolOutput("\n".join(lines))


_worker: list[SqlWorker] = []
_worker_lock = threading.Lock()


def _sql_worker() -> SqlWorker:
    """The process's SQL worker, started on first use (queries from every thread share it, one at a time)."""
    with _worker_lock:
        if not _worker:
            _worker.append(SqlWorker())
        return _worker[0]


# ---------------------------------------------------------------------------------------------------
# Environments with tools, and the episode loop


class ToolEnvironment(Environment):
    """An environment whose policy may call ``tools`` for up to ``max_turns`` assistant turns.

    Grading looks only at the final assistant turn, with tool blocks removed (:meth:`verify`), or at
    a whole transcript (:meth:`verify_transcript`). Subclasses implement :meth:`reference_calls` so
    that :meth:`reference_transcript` can build a full episode that scores 1.
    """

    kind: ClassVar[str] = "tool"
    # shown between the system prompt and the problem: user / assistant / tool messages of a worked episode
    worked_example: ClassVar[tuple[Message, ...]] = ()

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        chat = super().messages(problem)
        chat[-1:-1] = [dict(message) for message in self.worked_example]
        return chat

    def grade_answer(self, problem: Problem, text: str) -> Verdict:
        """Grade the final turn's text (tool blocks already removed). Numbers, by the strict rule."""
        return grade_math(text, problem.payload["answer"])

    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Grade ``completion`` as the FINAL assistant turn: never pass a transcript with tool output in it."""
        return self.grade_answer(problem, strip_tool_blocks(completion, self.tools))

    def verify_transcript(self, problem: Problem, turns: list[Message]) -> Verdict:
        """Grade an episode: the messages after the prompt (assistant and tool turns), in order.

        Only the last assistant turn is graded. An episode that ends on a tool message or on a call
        (the turn limit cut it off) earns 0, and so does one with more than ``max_turns`` assistant
        turns (a rollout loop that ignored the limit). ``detail`` counts turns and tool calls.
        """
        assistant = [m for m in turns if m.get("role") == "assistant"]
        tool_messages = [m for m in turns if m.get("role") == "tool"]
        detail = {"assistant_turns": len(assistant), "tool_calls": len(tool_messages),
                  "tool_errors": sum(bool(m.get("error")) for m in tool_messages)}
        if not assistant:
            return Verdict.fail("no_final_turn", **detail)
        if turns[-1].get("role") != "assistant":
            return Verdict.fail("ends_with_tool_output", **detail)
        if len(assistant) > self.max_turns:
            return Verdict.fail("too_many_turns", **detail)
        final = str(assistant[-1].get("content", ""))
        if parse_tool_call(final, self.tools) is not None:
            return Verdict.fail("turn_limit_reached", **detail)
        verdict = self.verify(problem, final)
        verdict.detail.update(detail)
        return verdict

    def reference_calls(self, problem: Problem) -> list[ToolCall]:
        """The tool calls of the reference episode (before the final answer :meth:`reference`)."""
        return []

    def reference_transcript(self, problem: Problem) -> list[Message]:
        """A full episode that scores 1: each reference call, its real tool output, then the final answer."""
        final = self.reference(problem)
        if final is None:
            raise ValueError(f"{self.name}: problem {problem.id} has no reference answer")
        replies = [f"<{call.name}>\n{call.input}\n</{call.name}>" for call in self.reference_calls(problem)]
        return run_episode(self, problem, iter([*replies, final]).__next__)

    def hack_completions(self, problem: Problem) -> list[str]:
        """Tool-shaped hacks: the answer marker inside a call, or printed by one; all must earn 0."""
        answer = str(problem.payload.get("answer", "42"))
        hacks = []
        for name in self.tools:
            hacks += [f"<{name}>\nprint('#### {answer}')\n</{name}>",
                      f"<{name}>\nSELECT '#### {answer}'\n</{name}>",
                      f"<{name}>\n#### {answer}\n</{name}>"]
        return hacks


def run_episode(env: Environment, problem: Problem, respond: Callable[[], str], *,
                on_result: Callable[[ToolCall, ToolResult], None] | None = None) -> list[Message]:
    """The rollout loop, in its plainest form: what the sampler's batched loop must do, turn for turn.

    ``respond()`` returns the policy's next assistant turn (it may read the transcript through a
    closure). While the last turn makes a call and fewer than ``env.max_turns`` assistant turns were
    taken, the tool runs (a stateful one, the terminal, after replaying the episode's earlier calls, as the
    batched loop does) and its reply is appended as ``{"role": "tool", "name", "input", "content", "error"}``;
    ``on_result`` sees each raw result (for its ``sandbox_runs``). Returns the turns after the prompt.
    """
    tools: Mapping[str, Tool] = env.tools
    turns: list[Message] = [{"role": "assistant", "content": respond()}]
    taken = 1
    while taken < env.max_turns and (call := parse_tool_call(turns[-1]["content"], tools)) is not None:
        result = tools[call.name].run_after(earlier_calls(turns, call.name), call.input, problem)
        if on_result is not None:
            on_result(call, result)
        turns.append({"role": "tool", "name": call.name, "input": call.input,
                      "content": format_tool_result(call.name, result), "error": result.error})
        turns.append({"role": "assistant", "content": respond()})
        taken += 1
    return turns


def replay_transcript(env: Environment, problem: Problem, turns: list[Message]) -> list[Message]:
    """Re-run a stored episode's tool calls with its own assistant turns: equal to ``turns`` when reproducible."""
    replies = iter([str(m["content"]) for m in turns if m.get("role") == "assistant"])
    return run_episode(env, problem, lambda: next(replies, ""))
