"""``evertrain`` processes started by fork from one that has already imported what a run imports.

A fresh ``python -m evertrain.cli run`` spends about 12 CPU-seconds importing torch, transformers, peft,
Prefect, MLflow, scipy and matplotlib before its first stage; the crash test starts nine of them. Here one
process (the *preloader*, started by :class:`Preloader` with the runs' environment) imports them once, and
each run is a child forked from it: a process of its own (its own pid, files, store connection and MLflow
client, opened from nothing), killed or exiting as a fresh one would, which then runs ``evertrain.cli``'s
``main`` exactly as ``python -m evertrain.cli`` does and exits through the interpreter's normal shutdown
(threads joined, ``atexit`` handlers run).

What a fork cannot give a child: an environment read at import time other than the preloader's. So every run
must have the preloader's environment, except the variables read when used (:data:`LATE`); a run asking for
anything else is refused (a new :class:`Preloader` is needed for it). ``EVERTRAIN_TEST_FORK=0`` starts every
run as a plain ``python -m evertrain.cli`` subprocess instead, to compare.

Protocol (JSON lines on the preloader's stdin and stdout): ``{"start": {...}}`` forks a run and answers its
pid; ``{"wait": pid, "timeout": s}`` answers its exit status (negative: the signal that ended it).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FORK = os.environ.get("EVERTRAIN_TEST_FORK", "1") != "0"

# read when used, not when imported (or, pytest's, not read by a run at all): a run may set them to its own values
LATE = frozenset({"EVERTRAIN_KILL_AT", "PYTEST_CURRENT_TEST"})

# what a smoke iteration of `evertrain run` imports (python -X importtime), the costliest first
PRELOAD = ("evertrain.cli", "evertrain.flows.campaign", "evertrain.report", "evertrain.runtime",
           "evertrain.models.checkpoint", "evertrain.tracking", "evertrain.plots", "evertrain.envs.answers",
           "mlflow", "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.model_registry.sqlalchemy_store",
           "mlflow.tracing.processor.base_mlflow", "transformers.models.auto.auto_factory",
           "transformers.models.llama.modeling_llama", "peft", "matplotlib.pyplot", "prefect.flow_engine",
           "prefect.task_engine", "prefect.utilities.visualization", "sqlalchemy.dialects.sqlite", "tabulate")


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in LATE}


class Preloader:
    """One preloading process for runs with ``env`` (give every run the same, up to :data:`LATE`)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.plain: dict[int, subprocess.Popen] = {}  # EVERTRAIN_TEST_FORK=0: the runs as plain subprocesses
        self.process: subprocess.Popen | None = None
        self._outputs = Path(tempfile.mkdtemp(prefix="evertrain-preloaded-"))  # run()'s captured output
        if FORK:
            self.process = subprocess.Popen([sys.executable, "-m", "tests.preloaded"], cwd=ROOT, env=self.env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, request: dict[str, Any]) -> Any:
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the preloader exited ({self.process.wait()}) on {request}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["result"]

    def start(self, args: list[str], *, cwd: Path, env: dict[str, str], stdout: Path,
              stderr: Path | None = None, session: bool = False) -> int:
        """Start ``evertrain ARGS`` in ``cwd``, its output to ``stdout`` (and its errors to ``stderr``, else to
        the same file); returns its pid. ``session``: in a session (and process group) of its own, as
        ``subprocess.Popen(..., start_new_session=True)`` starts one."""
        if _comparable(env) != _comparable(self.env):
            differ = sorted(k for k in set(env) | set(self.env) if k not in LATE and env.get(k) != self.env.get(k))
            raise ValueError(f"a run's environment differs from its preloader's in {differ}: start another")
        if self.process is None:
            with open(stdout, "w") as out, open(stderr or os.devnull, "w") as err:
                run = subprocess.Popen([sys.executable, "-m", "evertrain.cli", *args], cwd=cwd, env=env,
                                       stdout=out, stderr=err if stderr else subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=session)
            self.plain[run.pid] = run
            return run.pid
        late = {k: env[k] for k in LATE if k in env}
        return int(self._ask({"start": {"args": args, "cwd": str(cwd), "late": late, "stdout": str(stdout),
                                        "stderr": str(stderr or stdout), "session": session}}))

    def poll(self, pid: int) -> int | None:
        """The run's exit status if it has ended, else None."""
        if self.process is None:
            return self.plain[pid].poll()
        return self._ask({"poll": pid})

    def wait(self, pid: int, timeout: float = 600) -> int:
        """The run's exit status (negative: killed by that signal); killed if still running after ``timeout``."""
        if self.process is None:
            run = self.plain[pid]
            try:
                return run.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                run.kill()
                return run.wait()
        return int(self._ask({"wait": pid, "timeout": timeout}))

    def run(self, args: list[str], *, cwd: Path, env: dict[str, str],
            timeout: float = 600) -> subprocess.CompletedProcess:
        """Run ``evertrain ARGS`` to its end, as ``subprocess.run(..., capture_output=True, text=True)``."""
        out, err = (Path(tempfile.mkstemp(dir=self._outputs, suffix=suffix)[1]) for suffix in (".out", ".err"))
        status = self.wait(self.start(args, cwd=cwd, env=env, stdout=out, stderr=err), timeout)
        return subprocess.CompletedProcess(args, status, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))

    def close(self) -> None:
        for run in self.plain.values():
            if run.poll() is None:
                run.kill()
                run.wait()
        if self.process is not None and self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()  # the preloader kills the runs it still has, then exits
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._outputs, ignore_errors=True)

    def __enter__(self) -> Preloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Preloaders:
    """One :class:`Preloader` per environment asked for, all closed together (a session fixture's)."""

    def __init__(self) -> None:
        self._by_env: dict[tuple, Preloader] = {}

    def __call__(self, env: dict[str, str]) -> Preloader:
        key = tuple(sorted(_comparable(env).items()))
        if key not in self._by_env:
            self._by_env[key] = Preloader(env)
        return self._by_env[key]

    def close(self) -> None:
        for preloader in self._by_env.values():
            preloader.close()
        self._by_env.clear()


def _status(code: int) -> int:
    return -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)


def _child(request: dict[str, Any]) -> list[str]:
    """In the forked run: its own working directory, output, late variables, random state (and session)."""
    if request.get("session"):
        os.setsid()
    os.chdir(request["cwd"])
    for key in LATE:
        os.environ.pop(key, None)
    os.environ.update(request["late"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out if request["stderr"] == request["stdout"] else \
        os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {devnull, out, err}:
        os.close(fd)
    # a fresh process seeds these from the OS; a forked one would repeat the preloader's sequence
    random.seed()
    import numpy

    numpy.random.seed()
    sys.argv = [str(ROOT / "evertrain" / "cli.py"), *request["args"]]
    sys.path[0] = request["cwd"]  # as `python -m` puts its working directory first
    return request["args"]


def serve() -> list[str] | None:
    """The preloader's loop. Returns (in a forked child only) the arguments of the run to become."""
    protocol = os.fdopen(os.dup(1), "w")  # the answers; fd 1 itself is the imports' stderr, then each run's output
    os.dup2(2, 1)
    # what the runs would read at start: set the same way as `evertrain.cli` sets it, before the imports
    from evertrain.cli import _environment

    _environment()
    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # another version's module layout: the run imports what it needs
            importlib.import_module(name)
    running: set[int] = set()
    ended: dict[int, int] = {}  # pid -> exit status, kept for a wait after a poll

    def reap(pid: int, block: bool) -> int | None:
        if pid not in ended:
            done, code = os.waitpid(pid, 0 if block else os.WNOHANG)
            if done == 0:
                return None
            running.discard(pid)
            ended[pid] = _status(code)
        return ended[pid]

    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "start" in request:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    protocol.close()
                    return _child(request["start"])
                running.add(pid)
                result: Any = pid
            elif "poll" in request:
                result = reap(int(request["poll"]), block=False)
            else:
                pid, deadline = int(request["wait"]), time.monotonic() + float(request["timeout"])
                while (result := reap(pid, block=False)) is None:
                    if time.monotonic() > deadline:
                        os.kill(pid, signal.SIGKILL)
                        result = reap(pid, block=True)
                        break
                    time.sleep(0.05)
            protocol.write(json.dumps({"result": result}) + "\n")
        except Exception as error:  # reported to the test, which raises it
            protocol.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
        protocol.flush()
    for pid in running:  # the test ended (or failed) with runs still going
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return None


def _become(args: list[str]) -> None:
    """Run ``evertrain ARGS`` in this forked child, and exit as ``python -m evertrain.cli ARGS`` would."""
    import atexit
    import threading
    import traceback

    from evertrain.cli import main

    try:
        code: object = main(args)
    except SystemExit as exit:
        code = exit.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # the interpreter's shutdown up to its last step: threads joined, atexit handlers run, output flushed; the
    # last step (freeing every module) is skipped: native libraries' teardown in a forked copy of the preloader
    # crashed (SIGSEGV after a whole run had finished and reported)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    run = serve()
    if run is not None:
        _become(run)
