"""``terminal``: the agent works in a shell, one command per turn, on a workspace of files.

The episode
-----------

Each problem is a small task from ``data/terminal/tasks/*.toml`` (fix a failing test, write a file in
a format, find a value in a log ...): a prompt, the files of its workspace, a checker, and a reference
solution. The policy issues one shell command per assistant turn as a tool call ``<bash>cmd</bash>``;
the command's output (stdout and stderr together, cut to :data:`MAX_OUTPUT` characters with a note of
how much was cut) comes back as the ``tool`` message. The episode ends at the first turn without a
command (the agent says it is done) or after ``max_turns`` assistant turns.

Where commands run
------------------

In the bubblewrap sandbox (:mod:`evertrain.sandbox.bwrap`): no network (a fresh network namespace),
``/usr`` read-only, a fresh uid, CPU, memory, process and file-size limits. The workspace is the
sandbox's private tmpfs, ``/tmp``, which is also the working directory and ``HOME``: it is the ONLY
writable place (``/sandbox``, where the runner lives, is read-only, and so is everything else). The
task's checker and reference solution never enter this sandbox.

A tool call carries no state, so each call replays the episode's earlier commands in a fresh
workspace, then runs the new one, and shows only the new one's output: the workspace a command sees is
exactly the one the earlier commands left, and an episode can be replayed from its transcript alone.
Each command gets :data:`COMMAND_TIMEOUT_S` seconds of wall time.

Grading
-------

The graded completion is the episode's command log: the executed commands, in order, as ``<bash>``
blocks (:meth:`Terminal.episode_text` builds it from the turns; ``evertrain score`` takes the same
text). The grader replays the commands in a fresh sandbox, takes the resulting workspace out as a tar
archive, and runs the task's checker in ANOTHER fresh sandbox on a copy of it. The checker never
imports workspace code: it reads files and runs workspace programs as subprocesses and compares what
they print. The runner around it reads a per-grade nonce AND the checker itself from stdin, closes stdin
and marks itself non-dumpable before anything of the workspace runs, so a workspace program can neither
read the nonce or the hidden check (neither is ever a file in the sandbox; ``/proc/<pid>/mem``,
``/proc/<pid>/fd`` are closed to it) nor write to the runner's stdout; the task passes only when the
runner prints ``PASS <nonce>`` after every check held. The workspace is data only: the programs the
checker runs get a fixed environment (no HOME in the workspace, no user site, no bytecode read from the
workspace), so files the agent planted to configure them (``usercustomize``, ``.pth``, ``__pycache__``,
dotfiles) do nothing; the self-test plants them on every problem (``plant_usercustomize``,
``plant_pycache``).

Audit: every sandboxed process is a ``sandbox_runs`` row (purpose ``tool:terminal``,
``terminal:replay``, ``terminal:check``); every command of a graded episode, with its exit status,
seconds and output size, is in the verdict's ``detail["commands"]`` (the rollout's ``detail`` column),
and every command the policy issued is in the rollout's ``turns``.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import random
import re
import secrets
import tarfile
import tomllib
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any, ClassVar

from evertrain.envs.base import Environment, Problem, Split, Tool, Verdict, vendored_path
from evertrain.envs.terminal_levels import generated_spec, task_names
from evertrain.envs.tools import Message, ToolOutput, _blocks, _clean_input, _fenced_body, parse_tool_call
from evertrain.sandbox.bwrap import Limits, run_python

TOOL = "bash"
MAX_OUTPUT = 400  # characters of one command's output the policy sees (then a note of how much was cut)
COMMAND_TIMEOUT_S = 5.0  # wall-clock seconds per command
MAX_COMMAND_CHARS = 2000  # a longer command is refused without running

# one sandbox per tool call or replay: the whole episode's commands; the workspace is the tmpfs
_EPISODE_LIMITS = dict(cpu_s=20, memory_mb=512, nproc=64, nofile=64, fsize_mb=4, tmpfs_mb=16,
                       output_keep_bytes=4 * 1024 * 1024, output_kill_bytes=8 * 1024 * 1024)
CHECK_LIMITS = Limits(timeout_s=30.0, cpu_s=20, memory_mb=512, nproc=64, nofile=64, fsize_mb=4, tmpfs_mb=16,
                      output_keep_bytes=64 * 1024, output_kill_bytes=1024 * 1024)


# Known-bad workspaces for the self-test: files that would run inside the checker's programs if the checker
# let the workspace configure them. The hook reads the hidden check and prints the output it expects,
# then exits: any task whose check runs Python would pass unsolved.
_HOOK = r"""import os, re, sys
try:
    src = open('/sandbox/check.py').read()
except OSError:
    src = ''
m = re.search(r"out\.split\(\) == (\[[^\]]*\])", src) or re.search(r"out\.strip\(\) == ('[^']*')", src)
if m:
    value = eval(m.group(1))
    print(' '.join(value) if isinstance(value, list) else value)
    sys.stdout.flush()
    os._exit(0)
"""
# ... as a user-site usercustomize, sitecustomize and .pth file (HOME was the workspace), and a sitecustomize
# in the workspace itself
PLANT_USERCUSTOMIZE = f"""d=$(python3 -m site --user-site); mkdir -p "$d"; cat > "$d/usercustomize.py" <<'HOOK'
{_HOOK}HOOK
cp "$d/usercustomize.py" "$d/sitecustomize.py"; cp "$d/usercustomize.py" sitecustomize.py
echo "import usercustomize" > "$d/evertrain.pth"
"""
# ... and as the cached bytecode of every module of the workspace, its header matching the unchanged source
PLANT_PYCACHE = f"""cat > .hook.py <<'HOOK'
{_HOOK}HOOK
for f in *.py; do python3 -c '
import importlib.util as u, marshal, os, sys
path = sys.argv[1]
st = os.stat(path)
code = compile(open(".hook.py").read() + open(path).read(), path, "exec")
size = (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
head = u.MAGIC_NUMBER + bytes(4) + int(st.st_mtime).to_bytes(4, "little") + size
os.makedirs(os.path.dirname(u.cache_from_source(path)), exist_ok=True)
open(u.cache_from_source(path), "wb").write(head + marshal.dumps(code))
' "$f"; done"""


def _fence_kept(command: str) -> str:
    return f"```\n{command}\n```" if _fenced_body(command) is not None else command


def refusal(command: str) -> str | None:
    """Why the terminal refuses ``command`` without running it, or None: the ONE rule of what runs, applied by
    the tool during an episode and by every replay of its log (the tool's own later calls and the grader's)."""
    if len(command) > MAX_COMMAND_CHARS:
        return f"the command is longer than {MAX_COMMAND_CHARS} characters"
    return None


# The quality check's terminal probes (Terminal.probe_completions): a snapshot of the workspace's files before
# the reference solution runs, then the files it created or changed ($changed) and the paths it removed
# ($removed), each transformed into what a task's check must refuse.
_PROBE_SNAPSHOT = "mkdir -p .p && find . -path ./.p -prune -o -type f -print | sort > .p/paths && " \
                  "find . -path ./.p -prune -o -type f -exec md5sum {} + | sort > .p/sums"
_PROBE_CHANGED = ("changed=$(find . -path ./.p -prune -o -type f -exec md5sum {} + | sort | comm -13 .p/sums - "
                  "| cut -c35-); removed=$(find . -path ./.p -prune -o -type f -print | sort | comm -23 .p/paths -); ")
_PROBE_WIPE = ' || find . -mindepth 1 -delete'
_PROBE_TRANSFORMS: dict[str, str] = {
    "symlinked": 'for f in $changed; do mkdir -p ".p/$(dirname "$f")" && mv "$f" ".p/$f" && ln -sr ".p/$f" "$f"; '
                 'done; [ -n "$changed" ]' + _PROBE_WIPE,
    "wrong_type": 'rm -rf .p; for f in $changed; do rm -f "$f" && mkdir -p "$f"; done; [ -n "$changed" ]' + _PROBE_WIPE,
    # not Python sources: a fix joined on one line can still be the same program
    "one_line": 'rm -rf .p; n=0; for f in $changed; do case "$f" in *.py) continue;; esac; '
                'if [ "$(wc -l < "$f")" -gt 1 ]; then n=1; '
                'tr "\\n" " " < "$f" > "$f.1" && mv "$f.1" "$f"; fi; done; [ "$n" = 1 ]' + _PROBE_WIPE,
    "dangling_link": 'rm -rf .p; for f in $removed; do ln -s nowhere "$f"; done; [ -n "$removed" ]' + _PROBE_WIPE,
    "renamed": 'mkdir -p .p/r && for f in $removed; do touch "$f.bak"; done; rm -rf .p; [ -n "$removed" ]'
               + _PROBE_WIPE,
}


def episode_limits(commands: int) -> Limits:
    """Limits for a sandbox that runs ``commands`` commands back to back."""
    return Limits(timeout_s=5.0 + COMMAND_TIMEOUT_S * commands, **_EPISODE_LIMITS)


# The programs that run inside the sandbox, as /sandbox/main.py: real modules, read once
_IN_SANDBOX = Path(__file__).resolve().parent.parent / "sandbox"
_EPISODE_RUNNER = (_IN_SANDBOX / "terminal_episode.py").read_text()
_CHECK_RUNNER = (_IN_SANDBOX / "terminal_check.py").read_text()


@dataclass(frozen=True)
class TerminalTask:
    """One task file: what the agent is asked, its workspace, its checker, and a reference solution."""

    name: str
    split: Split
    prompt: str
    files: dict[str, str]
    check: str
    solution: list[str]
    # the task is about links: its workspace may hold symbolic or hard links (every other task's check fails
    # on one, see evertrain/sandbox/terminal_check.py), and read() follows them
    links: bool = False

    @classmethod
    def load(cls, path: Path) -> TerminalTask:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise ValueError(f"terminal task {path}: cannot read it: {error}") from error
        missing = [key for key in ("prompt", "files", "check", "solution") if key not in data]
        if missing:
            raise ValueError(f"terminal task {path}: missing {', '.join(missing)}")
        split = data.get("split", "train")
        if split not in ("train", "eval"):
            raise ValueError(f"terminal task {path}: split must be 'train' or 'eval', not {split!r}")
        files = data["files"]
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise ValueError(f"terminal task {path}: [files] must map relative paths to text")
        for name in files:
            if name.startswith("/") or ".." in Path(name).parts:
                raise ValueError(f"terminal task {path}: file {name!r} must be a relative path inside the workspace")
        if not isinstance(data["solution"], list) or not all(isinstance(c, str) for c in data["solution"]):
            raise ValueError(f"terminal task {path}: solution must be a list of shell commands")
        links = data.get("links", False)
        if not isinstance(links, bool):
            raise ValueError(f"terminal task {path}: links must be true or false, not {links!r}")
        return cls(name=path.stem, split=split, prompt=data["prompt"].strip(), files=dict(files),
                   check=data["check"], solution=list(data["solution"]), links=links)


def workspace_tar(files: dict[str, str]) -> bytes:
    """The task's files as an uncompressed tar archive (mode 0644; 0755 for files starting with #!)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name in sorted(files):
            data = files[name].encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            info.mode = 0o755 if files[name].startswith("#!") else 0o644
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()



@cache
def bashrc() -> str:
    """Shell functions standing in for the /usr/bin links that go through /etc/alternatives (awk, vi ...).

    The sandbox shows /usr but not /etc/alternatives, so `awk` (a link to /etc/alternatives/awk, a
    link to mawk) would be missing; bash reads this file (BASH_ENV) before every command.
    """
    lines = []
    for folder in ("/usr/bin", "/usr/sbin"):
        for link in sorted(Path(folder).glob("*")):
            with contextlib.suppress(OSError):
                if link.is_symlink() and os.readlink(link).startswith("/etc/alternatives/"):
                    target = os.path.realpath(link)
                    if target.startswith("/usr/") and re.fullmatch(r"[A-Za-z0-9_.+-]+", link.name):
                        lines.append(f'{link.name}() {{ {target} "$@"; }}; export -f {link.name}')
    return "\n".join(lines) + "\n"


def _audit(record: Any) -> dict[str, Any]:
    return {**record.to_row(), "started_at": record.started_at.isoformat()}


def run_commands(tar: bytes, commands: list[str], *, purpose: str, want_tar: bool = False,
                 ) -> tuple[dict[str, Any] | None, dict[str, Any], str]:
    """Run ``commands`` in a fresh sandbox on the workspace ``tar``: (runner's JSON or None, audit row, error)."""
    args = [str(MAX_OUTPUT), str(COMMAND_TIMEOUT_S)] + (["--tar"] if want_tar else [])
    record = run_python(_EPISODE_RUNNER, purpose=purpose, limits=episode_limits(len(commands)), args=args,
                        files={"workspace.tar": tar, "commands.json": json.dumps(commands), "bashrc": bashrc()})
    last = record.stdout.rstrip("\n").rsplit("\n", 1)[-1] if record.stdout else ""
    try:
        data = json.loads(last)
        if not isinstance(data, dict) or len(data.get("results", [])) != len(commands):
            raise ValueError("wrong shape")
    except ValueError:
        error = record.limit_hit or (record.stderr.strip().splitlines() or [f"exit {record.exit_code}"])[-1]
        return None, _audit(record), f"the terminal failed ({error[:200]})"
    return data, _audit(record), ""


def describe(result: dict[str, Any]) -> str:
    """A command's result as the policy sees it: its output, cut, and a line when it failed or was cut."""
    text = result["output"]
    if result["bytes"] > MAX_OUTPUT:
        text = text.rstrip("\n") + f"\n[output truncated: {result['bytes']} bytes, first {MAX_OUTPUT} shown]"
    if result["exit"] is None:
        text = text.rstrip("\n") + f"\n[killed after {COMMAND_TIMEOUT_S:g} s]"
    elif result["exit"] != 0:
        text = text.rstrip("\n") + f"\n[exit status {result['exit']}]"
    return text.strip("\n") or "(no output)"


class TerminalTool(Tool):
    """One shell command in the sandboxed workspace; earlier commands of the episode are replayed first."""

    name: ClassVar[str] = TOOL
    description: ClassVar[str] = (
        "Runs one bash command in the task's workspace (no network) and replies with its output.")
    def run(self, call: str, problem: Problem) -> ToolOutput:
        return self.run_after([], call, problem)

    def run_after(self, earlier: list[str], call: str, problem: Problem) -> ToolOutput:
        """Run ``call`` after replaying ``earlier`` (this episode's earlier commands) in a fresh workspace.

        A command :func:`refusal` refuses never runs, here or in a replay: the earlier commands are replayed
        by the same rule the grader replays the episode's log with (:meth:`Terminal.replayed`)."""
        if why := refusal(call):
            return ToolOutput(f"refused: {why}", error=True)
        tar = base64.b64decode(problem.payload["workspace"])
        ran = [command for command in earlier if refusal(command) is None]
        data, audit, error = run_commands(tar, [*ran, call], purpose="tool:terminal")
        if data is None:
            return ToolOutput(error, error=True, sandbox_runs=[audit])
        result = data["results"][-1]
        return ToolOutput(describe(result), error=result["exit"] != 0, sandbox_runs=[audit])


class Terminal(Environment):
    """Shell tasks in a sandboxed workspace; done when the task's checker passes in a fresh sandbox."""

    name: ClassVar[str] = "terminal"
    kind: ClassVar[str] = "terminal"
    source: ClassVar[str] = "data/terminal/tasks (written for this project, Apache-2.0 like the code)"
    tools: ClassVar[dict[str, Tool]] = {TOOL: TerminalTool()}
    max_turns: ClassVar[int] = 6
    system_prompt: ClassVar[str] = (
        "You work in a Linux terminal, in a folder holding the task's files. Run one bash command per turn: "
        "write it between <bash> and </bash> and stop. Its output comes back in the next message. "
        "There is no network. When the task is done, reply without a command. You have 5 turns of commands.")
    examples: ClassVar[tuple[tuple[str, str], ...]] = ()
    worked_example: ClassVar[tuple[Message, ...]] = (
        {"role": "user", "content": "Write the number of lines of notes.txt into count.txt."},
        {"role": "assistant", "content": "<bash>\nwc -l < notes.txt\n</bash>"},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "<bash>\necho 3 > count.txt\n</bash>"},
        {"role": "tool", "content": "(no output)"},
        {"role": "assistant", "content": "count.txt now holds 3. Done."},
    )

    def __init__(self, path: str | None = None, held_out: str = "vendored") -> None:
        if held_out not in ("vendored", "generated"):
            raise ValueError(f"terminal: held_out must be 'vendored' or 'generated', not {held_out!r}")
        self.path = path  # a folder of task files; None: the vendored data/terminal/tasks
        # "generated": the gate's and the sealed test split's tasks are generated one-command tasks (the
        # curriculum's level 0) from a number range no training draw uses, so a campaign that starts at level 0
        # is measured on tasks of the kind it learns; "vendored": the vendored held-out tasks
        self.held_out = held_out
        # generated tasks are stamped from templates: kept apart from their held-out set by exact ids and their
        # own vocabulary (terminal_levels), not by word n-grams, which every "Delete the file ..." shares
        self.templated = held_out == "generated"  # type: ignore[misc]

    @cached_property
    def tasks(self) -> list[TerminalTask]:
        folder = Path(self.path) if self.path else vendored_path("terminal", "tasks")
        found = sorted(folder.glob("*.toml"))
        if not found:
            raise ValueError(f"terminal: no task files (*.toml) in {folder}")
        return [TerminalTask.load(path) for path in found]

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        splits: dict[str, list[Problem]] = {"train": [], "eval": []}
        for task in self.tasks:
            payload = {"task": task.name, "workspace": base64.b64encode(workspace_tar(task.files)).decode(),
                       "files": sorted(task.files)}
            splits[task.split].append(Problem.make(self.name, task.prompt, payload, task.split))
        return splits

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        if split == "eval" and self.held_out == "generated":
            return self.generated_problems(task_names(n, seed, held_out=True), "eval")
        pool = self._splits[split]
        if split == "eval":
            return pool[:n]
        # a small pool: draw with replacement beyond its size (curation drops the repeats as duplicates)
        rng = random.Random(seed)
        return rng.sample(pool, min(n, len(pool))) + [rng.choice(pool) for _ in range(max(0, n - len(pool)))]

    def count(self, split: Split) -> int | None:
        if split == "eval" and self.held_out == "generated":
            return None  # generated without end: the sealed test split is the tasks after the gate's
        return len(self._splits[split])

    def generated_problems(self, names: list[str], split: Split) -> list[Problem]:
        """Problems of the generated one-command tasks named ``names`` (``gen:<template>:<number>``)."""
        out = []
        for name in names:
            task = generated_task(name)
            payload = {"task": name, "workspace": base64.b64encode(workspace_tar(task.files)).decode(),
                       "files": sorted(task.files)}
            out.append(Problem.make(self.name, task.prompt, payload, split))
        return out

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        chat = super().messages(problem)
        chat[-1:-1] = [dict(message) for message in self.worked_example]
        files = ", ".join(problem.payload.get("files", []))
        chat[-1] = {"role": "user", "content": f"{problem.prompt}\n(Files here: {files}.)"}
        return chat

    def task(self, problem: Problem) -> TerminalTask:
        name = problem.payload.get("task")
        if isinstance(name, str) and name.startswith("gen:"):  # a curriculum level-0 task: rebuilt from its name
            return generated_task(name)
        for task in self.tasks:
            if task.name == name:
                return task
        raise ValueError(f"terminal: no task named {name!r}")

    # -- the graded text: the command log ---------------------------------------------------------

    def commands(self, completion: str) -> list[str]:
        """The commands of a command log: every well-formed, non-blank <bash> block, in order, at most
        ``max_turns - 1`` of them (an episode's last turn never runs a command), refused ones included (they
        are logged as the tool refused them, and :meth:`replayed` skips them as the tool did)."""
        found = [_clean_input(inner) for _, _, _, inner, well_formed in _blocks(completion, [TOOL]) if well_formed]
        return [command for command in found if command.strip()][:self.max_turns - 1]

    @staticmethod
    def replayed(commands: list[str]) -> list[str]:
        """The commands of a log that ran: those :func:`refusal` lets through, in order."""
        return [command for command in commands if refusal(command) is None]

    @staticmethod
    def log(commands: list[str]) -> str:
        """The graded text of an episode that issued ``commands``: each as a <bash> block, and nothing else.
        :meth:`commands` reads back exactly ``commands``: a command that itself looks like a fenced block gets
        one more fence, which the reading removes (it removes one, as the rollout's parser did)."""
        return "\n".join(f"<bash>\n{_fence_kept(command)}\n</bash>" for command in commands)

    def episode_text(self, turns: list[Message]) -> str:
        """The command log of an episode: the commands the tool was given (the ``input`` of its tool turns), in
        order, as <bash> blocks, and nothing else. The assistant's prose is not part of the graded text: text
        rebuilt from prose after tool blocks are stripped could put a command into the log that never ran."""
        return self.log([turn["input"] for turn in turns
                         if turn.get("role") == "tool" and isinstance(turn.get("input"), str)])

    def transcript_commands(self, turns: list[Message]) -> list[str] | None:
        """The commands of a stored episode, derived from its assistant turns alone: the call of every assistant
        turn that a tool turn answers (the rollout ran it), by the rollout's own parser. None when the tool turns
        do not match (a transcript the rollout could not have written)."""
        commands: list[str] = []
        for turn, after in zip(turns, [*turns[1:], None], strict=True):
            if turn.get("role") == "tool" and not isinstance(turn.get("input"), str):
                return None
            if turn.get("role") != "assistant" or after is None or after.get("role") != "tool":
                continue
            call = parse_tool_call(str(turn.get("content", "")), self.tools)
            if call is None or call.input != after.get("input"):
                return None
            commands.append(call.input)
        return commands

    def verify_transcript(self, problem: Problem, turns: list[Message]) -> Verdict:
        """Grade a stored episode (its turns after the prompt): the commands its assistant turns made the tool run
        (:meth:`transcript_commands`), replayed as :meth:`verify` replays the in-episode log, so the two grades of
        one episode agree."""
        commands = self.transcript_commands(turns)
        if commands is None:
            return Verdict.fail("transcript_mismatch", sandbox_runs=[])
        if sum(turn.get("role") == "assistant" for turn in turns) > self.max_turns:
            return Verdict.fail("too_many_turns", sandbox_runs=[])
        return self.verify(problem, self.log(commands))

    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Replay the command log in a fresh sandbox, then run the task's checker in another fresh one."""
        task = self.task(problem)
        logged = self.commands(completion)
        commands = self.replayed(logged)
        tar = base64.b64decode(problem.payload["workspace"])
        runs: list[dict[str, Any]] = []
        detail: dict[str, Any] = {"commands": [], "sandbox_runs": runs}
        if len(commands) < len(logged):
            detail["refused"] = [{"command": c[:200], "why": refusal(c)} for c in logged if refusal(c)]
        if commands:
            data, audit, error = run_commands(tar, commands, purpose="terminal:replay", want_tar=True)
            runs.append(audit)
            if data is None or "workspace" not in data:
                return Verdict.fail("terminal_failed", error=error, **detail)
            detail["commands"] = [{"command": c[:200], "exit": r["exit"], "seconds": r["seconds"], "bytes": r["bytes"]}
                                  for c, r in zip(commands, data["results"], strict=True)]
            try:
                tar = base64.b64decode(data["workspace"], validate=True)
            except ValueError:
                return Verdict.fail("terminal_failed", error="the workspace did not come back", **detail)
        nonce = secrets.token_hex(16)
        record = run_python(_CHECK_RUNNER, purpose="terminal:check", limits=CHECK_LIMITS,
                            files={"workspace.tar": tar, "bashrc": bashrc()},
                            stdin=(nonce + (" links" if task.links else "") + "\n" + task.check).encode())
        runs.append(_audit(record))
        lines = [line for line in record.stdout.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        if last == f"PASS {nonce}" and record.exit_code == 0:
            return Verdict.ok("tests_passed", **detail)
        if last.startswith("FAIL "):
            return Verdict.fail("tests_failed", check=last[5:], **detail)
        return Verdict.fail("checker_error", limit=record.limit_hit, exit=record.exit_code,
                            stderr=record.stderr[-300:], **detail)

    def reference(self, problem: Problem) -> str | None:
        return "\n".join(f"<bash>\n{command}\n</bash>" for command in self.task(problem).solution) + "\nDone."

    def known_bad(self, problem: Problem, other: Problem | None) -> list[tuple[str, str]]:
        """The verifier self-test's terminal battery (each must earn 0): claims, faked success, commands
        past the turn limit, and another task's reference solution."""
        labels = ("claim", "fake_pass", "fake_nonce", "read_checker", "past_turn_limit", "plant_usercustomize",
                  "plant_pycache")
        cases = list(zip(labels, self.hack_completions(problem), strict=True))
        if other is not None and self.task(other).name != self.task(problem).name:
            cases.append(("other_problem", self.reference(other) or ""))
        return cases

    def probe_completions(self, problem: Problem) -> list[tuple[str, str]]:
        """The quality check's terminal probes: the reference solution, then every file it created or changed
        made a symbolic link to a hidden copy, a folder, or its lines joined on one line, and every path it
        removed a dangling link or a renamed copy; each leaves the task undone as asked. A probe that finds
        nothing to change empties the workspace (it then fails, as a wrong answer should)."""
        solution = self.task(problem).solution
        if len(solution) + 2 > self.max_turns - 1:
            return []
        return [(label, self.log([_PROBE_SNAPSHOT, *solution, _PROBE_CHANGED + transform]))
                for label, transform in _PROBE_TRANSFORMS.items()]

    def hack_completions(self, problem: Problem) -> list[str]:
        """Claims without work, commands that fake success, and commands past the turn limit: all earn 0."""
        return [
            "The task is done. All tests pass.",
            "<bash>\necho PASS\n</bash>",
            "<bash>\necho 'PASS 0'; exit 0\n</bash>",
            "<bash>\ncat /sandbox/check.py\n</bash>",
            # the reference, but only after max_turns - 1 useless commands: those alone run
            "\n".join(["<bash>\ntrue\n</bash>"] * (self.max_turns - 1))
            + "\n" + (self.reference(problem) or ""),
            f"<bash>\n{PLANT_USERCUSTOMIZE}\n</bash>",
            f"<bash>\n{PLANT_PYCACHE}\n</bash>",
        ]


def generated_task(name: str) -> TerminalTask:
    """The curriculum's level-0 task named ``gen:<template>:<number>`` (:mod:`evertrain.envs.terminal_levels`)."""
    return TerminalTask(name=name, split="train", **generated_spec(name))
