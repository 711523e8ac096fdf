"""The rubric worker of a ``verifiers:<taskset>`` environment: the environment package's code (its ``load()`` and
its reward functions) runs here, never in the trainer or the grading process.

Why a process of its own: a community reward function parses a policy's answer however it likes (a regular
expression that backtracks for minutes, ``eval``, sympy's parser, math-verify), so an answer can make it hang,
crash, or eat memory. So:

- the worker (``python -m evertrain.sandbox.verifiers_worker``, one per environment, started by
  :class:`RubricWorker`) runs in a bubblewrap jail: the file system read-only (the interpreter, the virtualenv,
  the project, the package's ``path``), a private ``/tmp``, no network (its own network namespace), its own
  PID namespace, gone when its parent goes. It imports ``verifiers.v1`` and loads the taskset once;
- every grade is a child forked from it (the imports already done) under ``RLIMIT_AS``, ``RLIMIT_CPU`` and
  ``RLIMIT_FSIZE`` = 0, killed at the wall-clock limit; one answer that hangs or crashes its reward function
  costs that rollout a ``grader_error``, never the batch;
- the parent talks to the worker over pipes with a deadline of its own and starts a fresh worker if the old
  one died or is late.

Protocol: one JSON object per line in each direction. ``{"op": "tasks"}`` answers ``{"ok": true, "tasks":
[{"key", "data"}, ...]}`` (the taskset as loaded: the task's key and its data as JSON); ``{"op": "score", "key",
"messages", "timeout_s", "memory_mb"}`` answers ``{"ok": true, "reward", "rewards": {name: [score, weight]},
"metrics": {...}}`` or ``{"ok": false, "error"}``. A package that brings an environment of its own (a ``vf.Env``
whose ``run`` speaks between the policy's turns: multi-turn) is replayed: ``{"op": "episode", "key", "opening",
"replies", "score"}`` runs its ``run`` with the policy's replies so far, in order, and answers the transcript,
the environment's next message (``next``; None once it has nothing more to say) and whether the episode
``ended``, with the rewards of that transcript when ``score`` is set. Nothing of an episode but the policy's own
replies crosses: the environment's messages are made again by the environment, never read back from a rollout.
The task scored is the worker's own, found by its key: what a problem's payload says (an answer a client claims)
never changes what the rubric checks against.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from evertrain.processes import in_spawner
from evertrain.sandbox.bwrap import _mounts, _unsafe, check_available, ro_bind_args
from evertrain.sandbox.sql_worker import _read_line

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0  # importing verifiers.v1 takes about 3.5 s here; a large taskset's load() more
START_COOLDOWN_S = 60.0  # after a failed start, requests fail at once for this long (then one start is tried again)
LISTING_LIMIT = 512 << 20  # the taskset's listing is one line: a large taskset's is many megabytes


class RubricError(RuntimeError):
    """The worker could not be started or could not load the taskset (the message says why)."""


# ---------------------------------------------------------------------------------------------------
# The parent side


def jail_argv(paths: list[str], writable: list[str] | None = None) -> list[str]:
    """The bubblewrap command line the worker runs under (see the module's docstring; ``paths`` visible read-only,
    ``writable`` folders bound read-write, e.g. one holding a server's Unix socket); [] where the sandbox is off
    (``EVERTRAIN_UNSAFE_NO_SANDBOX=1``, tests of machines without bwrap)."""
    if _unsafe():
        return []
    check_available()
    visible = [sys.prefix, str(ROOT), *paths]
    argv = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--setenv", "HF_HUB_OFFLINE", "1", "--setenv", "HF_DATASETS_OFFLINE", "1",
            *_mounts(), "--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
            *ro_bind_args(sorted({str(Path(p).resolve()) for p in visible}))]
    for folder in writable or []:
        argv += ["--bind", folder, folder]
    if os.getuid() != 0:
        argv += ["--unshare-user", "--disable-userns"]
    return [*argv, "--chdir", "/tmp", "--"]


class RubricWorker:
    """The long-lived worker of one taskset; ``request`` is thread-safe (one request at a time per worker)."""

    def __init__(self, taskset: str, knobs: dict[str, Any], path: str | None = None, grace_s: float = 5.0) -> None:
        self.taskset, self.knobs, self.path, self.grace_s = taskset, knobs, path, grace_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._failed: tuple[float, str] | None = None  # when the last start failed, and why

    def _start(self) -> subprocess.Popen[bytes]:
        paths = [self.path] if self.path else []
        argv = [*jail_argv(paths), sys.executable, "-s", "-m", "evertrain.sandbox.verifiers_worker",
                "--taskset", self.taskset, "--knobs", json.dumps(self.knobs)]
        if self.path:
            argv += ["--path", str(Path(self.path).resolve())]
        # started from the process's spawner thread: bwrap's --die-with-parent (PR_SET_PDEATHSIG) fires when the
        # thread that started it ends, and a grade may come from a pool thread that is about to
        proc = in_spawner(lambda: subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, start_new_session=True, cwd="/tmp"))
        assert proc.stdout is not None
        tail: collections.deque[bytes] = collections.deque(maxlen=64)  # stderr read from the start: never blocks it
        threading.Thread(target=_drain, args=(proc.stderr, tail), daemon=True).start()
        ready = _read_line(proc.stdout.fileno(), START_TIMEOUT_S)
        answer = None
        with contextlib.suppress(ValueError, TypeError):
            answer = json.loads(ready or b"")
        if not isinstance(answer, dict) or not answer.get("ok"):
            why = answer.get("error") if isinstance(answer, dict) else None
            if ready is None and proc.poll() is None:
                why = f"its load() did not finish within {START_TIMEOUT_S:g} s"
            self._stop(proc)
            err = b"".join(tail).decode(errors="replace")[-1500:]
            raise RubricError(f"verifiers taskset {self.taskset!r} could not be loaded: "
                              f"{why or err.strip() or 'the worker exited'}")
        return proc

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is None:
            return
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def request(self, request: dict[str, Any], timeout_s: float, limit: int = 4 << 20) -> dict[str, Any]:
        """Send one request; a worker that dies or misses ``timeout_s + grace_s`` is replaced. Never raises: a
        worker that cannot start answers ``{"ok": False, "error"}`` (and, for ``START_COOLDOWN_S``, so does every
        later request, at once, instead of each paying another start)."""
        with self._lock:
            for _attempt in range(2):  # a worker that died since the last call is restarted once
                if self._proc is None or self._proc.poll() is not None:
                    self._stop(self._proc)
                    self._proc = None
                    if self._failed is not None and time.monotonic() - self._failed[0] < START_COOLDOWN_S:
                        return {"ok": False, "error": self._failed[1]}
                    try:
                        self._proc = self._start()
                    except (RubricError, OSError) as error:
                        self._failed = (time.monotonic(), str(error))
                        return {"ok": False, "error": str(error)}
                    self._failed = None
                proc = self._proc
                assert proc.stdin is not None and proc.stdout is not None
                try:
                    proc.stdin.write(json.dumps(request).encode() + b"\n")
                    proc.stdin.flush()
                except OSError:
                    self._stop(proc)
                    self._proc = None
                    continue
                reply = _read_line(proc.stdout.fileno(), timeout_s + self.grace_s, limit)
                if reply is None:  # late, dead or too long: this worker is not trusted with another request
                    alive = proc.poll() is None
                    self._stop(proc)
                    self._proc = None
                    return {"ok": False, "error": f"the rubric worker gave no answer within {timeout_s:g} s" if alive
                            else "the rubric worker died (or its answer was over the size limit)"}
                try:
                    answer = json.loads(reply)
                except ValueError:
                    answer = None
                if not isinstance(answer, dict):
                    self._stop(proc)
                    self._proc = None
                    return {"ok": False, "error": "the rubric worker sent a garbled reply"}
                return answer
            return {"ok": False, "error": "the rubric worker could not be started"}

    def close(self) -> None:
        with self._lock:
            self._stop(self._proc)
            self._proc = None


def _drain(stream: Any, tail: collections.deque[bytes]) -> None:
    """Read the worker's stderr away from its start (verifiers logs there, and so does what a package prints), so a
    full pipe never blocks it; the last lines are kept for an error message."""
    with contextlib.suppress(Exception):
        for line in iter(stream.readline, b""):
            tail.append(line[-2000:])


# ---------------------------------------------------------------------------------------------------
# The worker side (this module run with -m)


def _load(taskset_id: str, knobs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The package's environment (its ``vf.Env`` subclass, or verifiers' single-agent one) and its tasks by key."""
    # late: verifiers (heavy) loads only in the worker process; its parent imports this module for jail_argv
    import verifiers.v1 as vf

    env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": taskset_id, **knobs}}))
    tasks: dict[str, Any] = {}
    for task in env.taskset:
        key = str(task.key)
        if key in tasks:
            raise ValueError(f"two tasks share the key {key!r}: a taskset's keys must be unique")
        tasks[key] = task
    return env, tasks


def multi_turn(env: Any) -> bool:
    """Whether the package brings an environment of its own (its ``run`` speaks between the policy's turns)."""
    # late: verifiers (heavy) loads only in the worker process; its parent imports this module for jail_argv
    from verifiers.v1.envs.single_agent.env import SingleAgentEnv

    return not isinstance(env, SingleAgentEnv)


class _OutOfReplies(BaseException):
    """The replay has used every reply it was given: ``message`` is what the environment said next. A
    BaseException, so an environment's ``except Exception`` around its turns does not swallow it."""

    def __init__(self, message: str | None) -> None:
        self.message = message


def _content(message: Any) -> str:
    return message if isinstance(message, str) else str(getattr(message, "content", "") or "")


class _Interaction:
    """One role's exchange in a replay: the environment's messages are recorded, the policy's replies are the
    ones given, in order; when they run out the replay stops, holding what the environment said last. Its
    ``trace`` is a real ``vf.Trace`` of the exchange so far (an environment may record rewards on it in ``run``)."""

    def __init__(self, task: Any, opening: list[dict[str, str]], replies: list[str]) -> None:
        self.messages, self.replies = list(opening), list(replies)
        self.trace = _trace(task, self.messages)

    def _add(self, message: dict[str, str]) -> None:
        self.messages.append(message)
        _append(self.trace, message)

    async def turn(self, message: Any = None) -> Any:
        # late: verifiers (heavy) loads only in the worker process; its parent imports this module for jail_argv
        import verifiers.v1 as vf

        said: str | None = None
        if message is not None:
            said = "\n".join(_content(m) for m in message) if isinstance(message, list) else _content(message)
        if not self.replies:
            raise _OutOfReplies(said)
        if said is not None:
            self._add({"role": "user", "content": said})
        reply = self.replies.pop(0)
        self._add({"role": "assistant", "content": reply})
        return vf.Segment(messages=[vf.AssistantMessage(content=reply)])


class _Agent:
    def __init__(self, opening: list[dict[str, str]], replies: list[str], runs: list[_Interaction]) -> None:
        self.opening, self.replies, self.runs, self.trainable = opening, replies, runs, True

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **_: Any) -> Any:
        if self.runs:
            raise RuntimeError("the environment opened a second interaction: one per episode is supported")
        interaction = _Interaction(task, self.opening, self.replies)
        self.runs.append(interaction)
        yield interaction

    async def run(self, task: Any, **_: Any) -> None:
        async with self.interaction(task) as interaction:
            await interaction.turn()


class _Agents:
    def __init__(self, roles: list[str], agent: _Agent) -> None:
        if len(roles) != 1:
            raise RuntimeError(f"the environment has {len(roles)} roles ({', '.join(roles)}): one is supported")
        self._by_role = {roles[0]: agent}

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_by_role"][name]
        except KeyError:
            raise AttributeError(name) from None


def replay(env: Any, task: Any, opening: list[dict[str, str]], replies: list[str]) -> tuple[Any, str | None, bool]:
    """Run the environment's ``run`` on ``task`` with the policy's ``replies``: (the exchange's trace, the
    environment's next message once the replies ran out (None: it said nothing more), whether the episode ended)."""
    runs: list[_Interaction] = []
    agents = _Agents(list(env.config.agent_harnesses()), _Agent(opening, replies, runs))
    try:
        asyncio.run(env.run(task, agents))
    except _OutOfReplies as stop:
        return (runs[0].trace if runs else _trace(task, opening)), stop.message, False
    return (runs[0].trace if runs else _trace(task, opening)), None, True


def _trace(task: Any, messages: list[dict[str, Any]]) -> Any:
    # late: verifiers (heavy) loads only in the worker process; its parent imports this module for jail_argv
    import verifiers.v1 as vf
    from verifiers.v1.state import state_cls

    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     state=state_cls(type(task))(), agent=vf.AgentInfo(config=vf.AgentConfig(model="evertrain")))
    for message in messages:
        _append(trace, message)
    return trace


def _append(trace: Any, message: dict[str, Any]) -> None:
    # late: verifiers (heavy) loads only in the worker process; its parent imports this module for jail_argv
    import verifiers.v1 as vf

    node = vf.MessageNode.model_validate({"message": message}).message
    index = len(trace.nodes)
    trace.nodes.append(vf.MessageNode(parent=index - 1 if index else None, message=node,
                                      sampled=node.role == "assistant"))


def _transcript(trace: Any) -> list[dict[str, str]]:
    return [{"role": str(node.message.role), "content": _content(node.message)} for node in trace.nodes]


_STDERR = 2  # a grading child's stdout goes where the worker's stderr goes (read away by the parent)
# what no reward function needs and an answer it runs (eval, sympy's parser) could use to outlive its grade
_REFUSED_EVENTS = frozenset(("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                             "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen",
                             "ctypes.dlsym", "ctypes.call_function"))


def _refuse_processes() -> None:
    """In a grading child, for good (an audit hook cannot be removed): no process started, none signalled, no C
    function called through ctypes. A reward function that tries raises, and that rollout gets a grader error."""

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in _REFUSED_EVENTS:
            raise RuntimeError(f"refused in a grade: {event}")

    sys.addaudithook(hook)


class _Done(Exception):
    """The child's reply is ready before any scoring (a replay that was not asked to score)."""


def _score_child(env: Any, task: Any, request: dict[str, Any], write_fd: int) -> None:
    """In the forked child: limits, the task's rewards on the messages (or on the episode replayed), the reply,
    exit."""
    logging.disable(logging.CRITICAL)  # the reply is the only output that counts
    _refuse_processes()
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (int(request["memory_mb"]) * mb,) * 2)
    cpu = int(request["timeout_s"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    reply: dict[str, Any]
    try:
        episode: dict[str, Any] = {}
        if "replies" in request:  # a multi-turn episode: the environment replayed with the policy's replies
            trace, said, ended = replay(env, task, request["opening"], list(request["replies"]))
            episode = {"next": said, "ended": ended, "messages": _transcript(trace)}
            if not request.get("score"):
                reply = {"ok": True, **episode}
                raise _Done
        else:
            trace = _trace(task, request["messages"])
        asyncio.run(task.score(trace))
        rewards = {name: [float(r.score), float(r.weight)] for name, r in trace.rewards.items()}
        metrics = {name: float(value) for name, value in trace.metrics.items()
                   if isinstance(value, (int, float)) and math.isfinite(value)}
        if not rewards:
            reply = {"ok": False, "error": "the task has no reward function that runs without a runtime"}
        elif not all(math.isfinite(s) and math.isfinite(w) for s, w in rewards.values()):
            reply = {"ok": False, "error": f"a reward is not a finite number: {rewards}"}
        else:
            reply = {"ok": True, "reward": sum(s * w for s, w in rewards.values()), "rewards": rewards,
                     "metrics": metrics, **episode}
    except _Done:
        pass
    except MemoryError:
        reply = {"ok": False, "error": "the reward functions ran out of memory"}
    except BaseException as error:  # a reward function's own error: this rollout's grader error
        cause = error.__cause__ or error
        reply = {"ok": False, "error": f"{type(cause).__name__}: {cause}"[:500]}
    data = json.dumps(reply).encode() + b"\n"
    while data:
        data = data[os.write(write_fd, data):]
    os._exit(0)


def _score(env: Any, tasks: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    task = tasks.get(str(request.get("key")))
    if task is None:
        return {"ok": False, "error": f"no task with key {request.get('key')!r} in this taskset"}
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:
        try:
            # a process group of its own (killed whole after the grade: nothing an answer starts outlives it), and
            # no descriptor but its reply pipe: the worker's request and protocol pipes stay out of its reach
            os.setpgid(0, 0)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(_STDERR, 1)
            os.closerange(3, write_fd)
            os.closerange(write_fd + 1, 1 << 16)
            _score_child(env, task, request, write_fd)
        finally:
            os._exit(1)
    os.close(write_fd)
    line = _read_line(read_fd, float(request["timeout_s"]))
    os.close(read_fd)
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)  # the child and whatever it started, however the grade ended
    _, status = os.waitpid(pid, 0)
    if line is not None:
        with contextlib.suppress(ValueError):
            return json.loads(line)
    if line is None and (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        return {"ok": False, "error": f"the reward functions ran longer than {request['timeout_s']:g} s"}
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
        return {"ok": False, "error": "the reward functions used up their CPU time"}
    return {"ok": False, "error": "the reward functions crashed or ran out of memory"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--taskset", required=True)
    parser.add_argument("--knobs", default="{}")
    parser.add_argument("--path")
    args = parser.parse_args(argv)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the package prints goes to stderr; the protocol has its own descriptor
    os.set_inheritable(2, True)
    if args.path:
        sys.path.insert(0, args.path)
    try:
        env, tasks = _load(args.taskset, json.loads(args.knobs))
        if tasks:  # a first trace here: what verifiers caches on it (its own git commit, found by running git)
            _trace(next(iter(tasks.values())), [])  # is looked up once, before any grading child refuses processes
    except BaseException as error:
        out.write(json.dumps({"ok": False, "error": f"{type(error).__name__}: {error}"[:1500]}).encode() + b"\n")
        out.flush()
        return
    out.write(json.dumps({"ok": True, "tasks": len(tasks), "multi_turn": multi_turn(env)}).encode() + b"\n")
    out.flush()
    for raw in sys.stdin.buffer:
        try:
            request = json.loads(raw)
            if request.get("op") == "tasks":
                reply: dict[str, Any] = {"ok": True, "multi_turn": multi_turn(env), "tasks": [
                    {"key": key, "data": task.data.model_dump(mode="json", exclude_none=True)}
                    for key, task in tasks.items()]}
            elif request.get("op") in ("score", "episode"):
                reply = _score(env, tasks, request)
            else:
                reply = {"ok": False, "error": f"unknown op {request.get('op')!r}"}
        except Exception as error:
            reply = {"ok": False, "error": f"malformed request: {type(error).__name__}: {error}"[:500]}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
