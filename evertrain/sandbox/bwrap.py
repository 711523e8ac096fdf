"""Run untrusted Python (or a command) under bubblewrap, with limits, and audit every run.

What a sandbox is here, and why each part:

- ``bwrap`` with fresh PID, network, IPC, UTS (and cgroup) namespaces: no network at all (not even the
  host's loopback), no view of the host's processes, and when the sandbox's PID 1 dies the kernel
  kills everything left inside, so a daemonized grandchild cannot outlive its run.
- A root filesystem built from nothing: ``/usr`` (and the ``/bin``, ``/lib`` links) read-only, the
  interpreter and its standard library read-only with ``site-packages`` hidden, ``/etc/ld.so.cache``
  for the loader, a fresh ``/dev`` and ``/proc``, a size-capped private tmpfs on ``/tmp``. Nothing
  else of the host: no home folder (when the interpreter lives under one, as pyenv's does under
  /root, only the folders on its path exist), no project checkout, no data sets, no credentials. The
  job's own files are copied in through memfds (``--ro-bind-data``), so nothing of the host is
  written either.
- A cleared environment (``--clearenv`` plus PATH, HOME=/tmp, PYTHONDONTWRITEBYTECODE, PYTHONHASHSEED).
- ``--die-with-parent`` and ``--new-session``; bwrap is started in its own session, so a wall-clock
  timeout kills its whole process group, and the PID namespace takes the rest down.
- CPU, address-space, process-count, open-file and file-size limits, set by :mod:`prelude` inside the
  sandbox. As root, bwrap needs no user namespace, and the prelude drops the job to a fresh random
  uid (which is what makes RLIMIT_NPROC count only the job's processes); as any other user, bwrap
  makes an unprivileged user namespace, whose own process count RLIMIT_NPROC bounds.
- stdout and stderr are read as they come, stored up to a cap, counted beyond it, and a flood past a
  second cap kills the run.

Every run yields a :class:`SandboxRunRecord` (one row of the ``sandbox_runs`` audit table); callers
get them back, and :data:`audit_sink`, when set, sees every one.

Starting cost (``benchmarks/sandbox.py`` measures it): Python starts in about 8 ms with ``-S`` (no
``site``, so no site-packages and no ``.pth`` files, against about 35 ms for this venv's base
interpreter with ``site``); bwrap's namespaces and mounts add about 10 ms; the in-sandbox code avoids
``json``, ``re``, ``enum`` and ``ast``, each of which would add milliseconds to every run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

from evertrain.sandbox import cgroup

log = logging.getLogger(__name__)

UNSAFE_ENV = "EVERTRAIN_UNSAFE_NO_SANDBOX"
SANDBOX_DIR = "/sandbox"  # where a job's files appear inside the sandbox
PRELUDE_SOURCE = (Path(__file__).parent / "prelude.py").read_bytes()
INSTALL_HINT = "install bubblewrap (`apt-get install bubblewrap`, or `dnf install bubblewrap`)"

# Called with every record as it is made (e.g. to buffer rows for the store); None: nobody listens.
audit_sink: Callable[[SandboxRunRecord], None] | None = None


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here; the message says what to do."""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed process may use. Defaults suit grading one short program."""

    timeout_s: float = 15.0  # wall clock; the tree is killed. Generous: a loaded machine slows CPU-bound jobs
    cpu_s: int = 5  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL 1 s later; the whole tree dies past cpu_s + 1
    memory_mb: int = 512  # RLIMIT_AS, address space per process
    nproc: int = 32  # RLIMIT_NPROC: processes and threads of the sandbox's own uid
    nofile: int = 64  # RLIMIT_NOFILE
    fsize_mb: int = 16  # RLIMIT_FSIZE, the largest file a process may write
    tmpfs_mb: int = 64  # size of the private /tmp
    output_keep_bytes: int = 64 * 1024  # stdout / stderr bytes stored per stream; the rest is counted
    output_kill_bytes: int = 8 * 1024 * 1024  # a stream past this is a flood: kill the run
    cpu_cores: float = 1.0  # the tree's CPU bandwidth (cgroup cpu.max): at most this many cores at any instant

    def __post_init__(self) -> None:
        if not self.cpu_cores > 0:
            raise ValueError(f"Limits.cpu_cores must be positive, not {self.cpu_cores!r}")

    def rlimits(self) -> dict[str, list[int]]:
        """The setrlimit calls the prelude makes: name -> [soft, hard]."""
        mb = 1024 * 1024
        return {
            "RLIMIT_CPU": [self.cpu_s, self.cpu_s + 1],
            "RLIMIT_AS": [self.memory_mb * mb] * 2,
            "RLIMIT_NPROC": [self.nproc] * 2,
            "RLIMIT_NOFILE": [self.nofile] * 2,
            "RLIMIT_FSIZE": [self.fsize_mb * mb] * 2,
        }

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass
class SandboxRunRecord:
    """What happened in one sandboxed process: the audit trail of a grade."""

    run_id: str
    purpose: str  # who asked: "candidate", "tests", "scorer" ...
    code_sha256: str  # what ran
    limits: Limits
    exit_code: int | None  # None when the process died of a signal
    signal: int | None
    wall_s: float
    cpu_s: float  # CPU time of the whole process tree (its cgroup), also when killed from here
    peak_rss_kb: int | None  # peak memory of the whole process tree (its cgroup: page cache included); None if unknown
    stdout_bytes: int  # bytes written, including any beyond the stored cap
    stderr_bytes: int
    stdout: str  # the first limits.output_keep_bytes, decoded leniently
    stderr: str
    limit_hit: str | None  # None, "timeout", "cpu", "memory", "nproc", "fsize" or "output"
    started_at: datetime
    sandboxed: bool = True  # False only under EVERTRAIN_UNSAFE_NO_SANDBOX
    uid: int | None = None  # the host uid the job ran as (a fresh one per run when the host is root)

    def to_row(self) -> dict[str, Any]:
        """The row for the ``sandbox_runs`` audit table (the store adds campaign and iteration)."""
        return {
            "run_id": self.run_id, "purpose": self.purpose, "code_sha256": self.code_sha256,
            "limits": self.limits.to_json(), "exit_code": self.exit_code, "signal": self.signal,
            "wall_s": self.wall_s, "cpu_s": self.cpu_s, "peak_rss_kb": self.peak_rss_kb,
            "stdout_bytes": self.stdout_bytes, "stderr_bytes": self.stderr_bytes,
            "limit_hit": self.limit_hit, "started_at": self.started_at,
        }


@dataclass
class Job:
    """One program to run in a sandbox: Python ``source`` run as ``__main__``, or a command ``argv``.

    ``files`` appear read-only under ``/sandbox`` (the main source is ``/sandbox/main.py``, and that
    folder is first on ``sys.path``). ``ro_binds`` are host folders shown read-only at the same paths
    (e.g. a virtualenv's site-packages for a third-party scorer); nothing else of the host is.
    ``pass_fds`` are inherited by the sandboxed process; the caller keeps ownership of them.
    ``code_sha256`` defaults to a hash of the source, argv and files.
    """

    purpose: str
    source: str | None = None
    argv: Sequence[str] | None = None
    args: Sequence[str] = ()
    files: Mapping[str, bytes | str] = field(default_factory=dict)
    stdin: bytes = b""
    pass_fds: Sequence[int] = ()
    limits: Limits = field(default_factory=Limits)
    code_sha256: str | None = None
    ro_binds: Sequence[str] = ()

    def digest(self) -> str:
        """The ``code_sha256`` of the audit row: what ran, so that runs of the same code can be joined."""
        if self.code_sha256:
            return self.code_sha256
        h = hashlib.sha256()
        h.update((self.source or "").encode())
        h.update(json.dumps(list(self.argv or [])).encode())
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + _as_bytes(self.files[name]))
        return h.hexdigest()


def _as_bytes(data: bytes | str) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else data


# ---------------------------------------------------------------------------------------------------
# The sandbox's filesystem and command line


def interpreter() -> str:
    """The real (non-venv) Python executable the sandbox runs: the standard library is all it needs."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return os.path.realpath(os.path.join(sys.base_prefix, "bin", f"python{version}"))


@cache
def _mounts() -> tuple[str, ...]:
    """The bwrap arguments that build the read-only part of the sandbox's filesystem."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for etc in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", etc, etc]
    stdlib = sysconfig.get_paths()["stdlib"]  # in a venv this is still the base interpreter's
    python = interpreter()
    needed = [python, stdlib]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
        needed.append(os.path.join(libdir, soname))
    args += ro_bind_args([path for path in needed if not path.startswith("/usr/")])
    if os.path.isdir(os.path.join(stdlib, "site-packages")):
        args += ["--tmpfs", os.path.join(stdlib, "site-packages")]  # only the standard library
    return tuple(args)


def ro_bind_args(paths: Sequence[str]) -> list[str]:
    """bwrap arguments that show ``paths`` read-only at the same place inside the sandbox.

    bwrap copies the host's modes onto the folders it creates: /root would be 0700 and the unprivileged
    uid could not reach an interpreter (or a virtualenv) under it, so every parent is made 0755 first.
    """
    args: list[str] = []
    made: set[str] = set()
    for path in paths:
        for parent in reversed(Path(path).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
    return args


def _python_argv(prelude: str, uid: int | None, limits: Limits, target: list[str], mode: str,
                 report_fd: int) -> list[str]:
    """The command line that starts the prelude (see prelude.py for its arguments)."""
    rlimits = ",".join(f"{name}={soft}:{hard}" for name, (soft, hard) in limits.rlimits().items())
    watchdog_s = limits.timeout_s + 1.0  # the grader kills first; the watchdog is the backstop
    # -S: no site (no site-packages, no .pth files, much faster start); -s: no user site;
    # -B: write no bytecode; -P: put no unsafe path (cwd, script dir) on sys.path.
    return [interpreter(), "-S", "-s", "-B", "-P", prelude,
            "-" if uid is None else str(uid), str(watchdog_s), str(report_fd), rlimits, mode, *target]


def _bwrap_argv(job: Job, file_fds: dict[str, int], uid: int | None) -> list[str]:
    limits = job.limits
    argv = [
        "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--hostname", "sandbox",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONHASHSEED", "0",
        "--setenv", "LANG", "C.UTF-8",
        *_mounts(),
        "--dev", "/dev", "--proc", "/proc",
        "--perms", "1777", "--size", str(limits.tmpfs_mb * 1024 * 1024), "--tmpfs", "/tmp",
        "--dir", SANDBOX_DIR,
    ]
    for name, fd in file_fds.items():
        argv += ["--perms", "0444", "--ro-bind-data", str(fd), f"{SANDBOX_DIR}/{name}"]
    argv += ro_bind_args(job.ro_binds)
    if uid is not None:  # the prelude needs these two to drop root; setuid clears them
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # not root: an unprivileged user namespace, whose own process count RLIMIT_NPROC bounds
        argv += ["--unshare-user", "--disable-userns"]
    # --as-pid-1: the prelude's watchdog is PID 1 instead of bwrap's init (see prelude.py for why)
    argv += ["--as-pid-1", "--chdir", "/tmp", "--"]
    return argv


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _unsafe() -> bool:
    return os.environ.get(UNSAFE_ENV) == "1"


_available: SandboxUnavailable | bool | None = None
_available_lock = threading.Lock()


def check_available() -> None:
    """Raise :class:`SandboxUnavailable` unless bwrap can build a sandbox here. Checked once, cached."""
    global _available
    if _unsafe():
        return
    with _available_lock:
        if _available is None:
            _available = _probe()
    if isinstance(_available, SandboxUnavailable):
        raise _available


def _probe() -> SandboxUnavailable | bool:
    if shutil.which("bwrap") is None:
        return SandboxUnavailable(f"bubblewrap (bwrap) is not on PATH: {INSTALL_HINT}.")
    record = _run_group([Job(purpose="probe", source="pass", limits=Limits(timeout_s=20))], None, 0.0, [])[0]
    if record.exit_code != 0:
        return SandboxUnavailable(
            f"bubblewrap cannot create a sandbox here (exit {record.exit_code}, signal {record.signal}): "
            f"{record.stderr.strip()[:500]}. It needs user or PID namespaces (run as root, or enable "
            f"unprivileged user namespaces), and {INSTALL_HINT}.")
    return True


# ---------------------------------------------------------------------------------------------------
# Running jobs


def run_python(source: str, *, purpose: str = "python", limits: Limits | None = None,
               files: Mapping[str, bytes | str] | None = None, stdin: bytes = b"",
               args: Sequence[str] = (), ro_binds: Sequence[str] = ()) -> SandboxRunRecord:
    """Run Python ``source`` as ``__main__`` in a sandbox and return its record."""
    job = Job(purpose=purpose, source=source, args=args, files=dict(files or {}), stdin=stdin,
              limits=limits or Limits(), ro_binds=tuple(ro_binds))
    return run_group([job])[0]


def run_command(argv: Sequence[str], *, purpose: str = "command", limits: Limits | None = None,
                files: Mapping[str, bytes | str] | None = None, stdin: bytes = b"") -> SandboxRunRecord:
    """Run a command (an absolute path inside the sandbox, e.g. ``/usr/bin/sh``) in a sandbox."""
    job = Job(purpose=purpose, argv=list(argv), files=dict(files or {}), stdin=stdin,
              limits=limits or Limits())
    return run_group([job])[0]


def run_group(jobs: Sequence[Job], *, primary: int | None = None, grace_s: float = 1.0,
              own_fds: bool = False) -> list[SandboxRunRecord]:
    """Run ``jobs`` side by side, each in its own sandbox, and return their records in order.

    Each job has its own wall-clock limit. When ``primary`` (an index) is given, the others get
    ``grace_s`` seconds to finish once it has exited, then are killed: a server process has no
    reason to outlive its only client. With ``own_fds``, the jobs' ``pass_fds`` are closed here as
    soon as every job has started (or on any error), so that pipes between jobs see end-of-file
    when one side exits. Records also go to :data:`audit_sink`.
    """
    owned = [fd for job in jobs for fd in job.pass_fds] if own_fds else []
    try:
        check_available()
        records = _run_group(jobs, primary, grace_s, owned)
    finally:
        _close_all(owned)
    if audit_sink is not None:
        for record in records:
            audit_sink(record)
    return records


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


@dataclass
class _Process:
    job: Job
    popen: subprocess.Popen[bytes]
    pidfd: int
    t0: float
    started_at: datetime
    stored: tuple[bytearray, bytearray] = field(default_factory=lambda: (bytearray(), bytearray()))
    tails: list[bytes] = field(default_factory=lambda: [b"", b""])
    counts: list[int] = field(default_factory=lambda: [0, 0])
    uid: int | None = None
    kill_reason: str | None = None
    killed: bool = False
    inits: list[int] = field(default_factory=list)  # pidfds of bwrap's children (the sandbox's PID 1)
    record: SandboxRunRecord | None = None
    report_fd: int = -1  # read end of the pipe on which the sandbox's PID 1 reports the job's rusage
    group: cgroup.Group | None = None  # the run's own cgroup: limits and counts the whole tree
    watcher: cgroup.TreeWatcher | None = None  # the fallback where no cgroup (or no CPU count) can be made
    cpu_check_at: float | None = None  # when to next read the group's CPU time (None: the group cannot)
    cpu_cores: float = 1.0  # the most cores the tree can run on at once (its cpu.max, or the machine's)

    def take(self, stream: int, chunk: bytes) -> None:
        keep = self.job.limits.output_keep_bytes
        self.counts[stream] += len(chunk)
        room = keep - len(self.stored[stream])
        if room > 0:
            self.stored[stream].extend(chunk[:room])
        self.tails[stream] = (self.tails[stream] + chunk)[-4096:]

    def kill(self, reason: str | None) -> None:
        if self.killed or self.record is not None:
            return
        self.killed, self.kill_reason = True, reason
        # The sandbox's PID 1 dies of bwrap's death (its parent-death signal), a moment after bwrap:
        # hold pidfds to it, so that reaping can wait until it, and so the namespace, is gone.
        self.inits = _children_pidfds(self.popen.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # bwrap leads its own group
        if self.group is not None:
            self.group.kill_all()


def _children_pidfds(pid: int) -> list[int]:
    """pidfds of the children of ``pid``; used only to wait on, never to signal (pids can be reused)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            children = file.read().split()
    except OSError:  # no CONFIG_PROC_CHILDREN, or already gone: nothing to wait for
        return []
    fds = []
    for child in children:
        with contextlib.suppress(OSError):
            fds.append(os.pidfd_open(int(child)))
    return fds


def _spawn(job: Job, sandboxed: bool) -> tuple[_Process, list[int], str | None]:
    """Start one job; returns the process, the fds to close once it has started, and a temp dir."""
    if (job.source is None) == (job.argv is None):
        raise ValueError("a Job needs exactly one of source and argv")
    files = {name: _as_bytes(data) for name, data in job.files.items()}
    if job.source is not None:
        files["main.py"] = job.source.encode("utf-8")
    files["prelude.py"] = PRELUDE_SOURCE
    uid = 100_000 + secrets.randbelow(1 << 30) if sandboxed and os.geteuid() == 0 else None
    to_close: list[int] = []
    tmpdir = None
    if sandboxed:
        file_fds = {name: _memfd(name, data) for name, data in files.items()}
        to_close += file_fds.values()
        base, cwd, env = SANDBOX_DIR, None, None
    else:
        log.warning("%s=1: running %r code WITHOUT A SANDBOX (no namespaces, no uid drop); development only",
                    UNSAFE_ENV, job.purpose)
        tmpdir = tempfile.mkdtemp(prefix="evertrain-unsafe-")
        for name, data in files.items():
            Path(tmpdir, name).write_bytes(data)
        file_fds, base, cwd = {}, tmpdir, tmpdir
        env = {"PATH": "/usr/bin:/bin", "HOME": tmpdir, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    report_r, report_w = os.pipe()
    to_close.append(report_w)
    if job.argv is not None:
        argv = _python_argv(f"{base}/prelude.py", uid, job.limits, list(job.argv), "exec", report_w)
    else:
        argv = _python_argv(f"{base}/prelude.py", uid, job.limits, [f"{base}/main.py", *job.args], "main",
                            report_w)
    group, bandwidth_bound = None, False
    if sandboxed:
        argv = _bwrap_argv(job, file_fds, uid) + argv
        tree_backend = cgroup.backend()
        if tree_backend is not None:
            # room for bwrap, its monitor and the sandbox's PID 1 besides the job's own processes
            group = cgroup.Group.create(tree_backend, job.limits.memory_mb, job.limits.nproc + 4)
            bandwidth_bound = group.limit_cpu(job.limits.cpu_cores)
            if not bandwidth_bound:
                _warn_once("no writable cgroup cpu controller here: a sandbox tree's CPU is bounded in total "
                           "(cpu_s + 1 seconds), not in bandwidth")
            argv = cgroup.enter_argv(group, argv)
        else:
            _warn_no_cgroup()
    stdin: Any = subprocess.DEVNULL
    if job.stdin:
        stdin_fd = _memfd("stdin", job.stdin)
        to_close.append(stdin_fd)
        stdin = stdin_fd
    started_at = datetime.now(UTC)
    t0 = time.monotonic()
    try:
        popen = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 pass_fds=(*file_fds.values(), *job.pass_fds, report_w), start_new_session=True,
                                 cwd=cwd, env=env)
    except BaseException:
        for fd in (*to_close, report_r):
            os.close(fd)
        if group is not None:
            group.remove()
        raise
    pidfd = os.pidfd_open(popen.pid)
    proc = _Process(job, popen, pidfd, t0, started_at, uid=uid, report_fd=report_r, group=group)
    if group is not None and group.counts_cpu:
        proc.cpu_cores = job.limits.cpu_cores if bandwidth_bound else float(os.cpu_count() or 1)
        proc.cpu_check_at = t0 + _cpu_budget(job.limits) / proc.cpu_cores
    elif sandboxed:  # the watcher: memory too where there is no group at all
        proc.watcher = cgroup.TreeWatcher(
            popen.pid, job.limits.memory_mb * 1024 if group is None else None, lambda: proc.kill("memory"),
            interval_s=0.05, cpu_budget_s=_cpu_budget(job.limits), kill_cpu=lambda: proc.kill("cpu"))
    return proc, to_close, tmpdir


def _cpu_budget(limits: Limits) -> float:
    """CPU seconds the whole tree may use: one process's hard RLIMIT_CPU, however many processes it has."""
    return limits.cpu_s + 1.0


def _check_cpu(proc: _Process, now: float) -> None:
    """Kill the run once its tree's CPU time passes the budget; else schedule the next look for the
    earliest moment it could (the tree uses at most cpu_cores cores), so a short run is never polled."""
    assert proc.group is not None
    used = proc.group.cpu_s()
    budget, cores = _cpu_budget(proc.job.limits), proc.cpu_cores
    if used is not None and used >= budget:
        proc.kill("cpu")
        proc.cpu_check_at = None
    else:
        proc.cpu_check_at = now + max(0.05, (budget - (used or 0.0)) / cores)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def _warn_no_cgroup() -> None:
    _warn_once("no writable cgroup here (see evertrain.sandbox.cgroup): sandbox memory and CPU are bounded by "
               "RLIMIT_AS and RLIMIT_CPU per process and a process-tree watcher, not by the kernel")


def _run_group(jobs: Sequence[Job], primary: int | None, grace_s: float,
               owned: list[int]) -> list[SandboxRunRecord]:
    sandboxed = not _unsafe()
    procs: list[_Process] = []
    tmpdirs: list[str] = []
    selector = selectors.DefaultSelector()
    try:
        for job in jobs:
            proc, to_close, tmpdir = _spawn(job, sandboxed)
            procs.append(proc)
            if tmpdir:
                tmpdirs.append(tmpdir)
            for fd in to_close:
                os.close(fd)
            for stream, pipe in enumerate((proc.popen.stdout, proc.popen.stderr)):
                assert pipe is not None
                os.set_blocking(pipe.fileno(), False)
                selector.register(pipe.fileno(), selectors.EVENT_READ, (proc, stream))
            selector.register(proc.pidfd, selectors.EVENT_READ, (proc, "exit"))
        _close_all(owned)  # every job has its copies now
        _pump(selector, procs, primary, grace_s, sandboxed)
    finally:
        for proc in procs:
            if proc.record is None:  # an exception got us here: leave nothing running
                proc.kill(None)
                _reap(proc, selector, sandboxed)
        selector.close()
        for tmpdir in tmpdirs:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return [proc.record for proc in procs if proc.record is not None]


def _pump(selector: selectors.BaseSelector, procs: list[_Process], primary: int | None, grace_s: float,
          sandboxed: bool) -> None:
    grace_deadline: float | None = None
    while any(proc.record is None for proc in procs):
        now = time.monotonic()
        wakeups = [p.t0 + p.job.limits.timeout_s for p in procs if p.record is None and not p.killed]
        wakeups += [p.cpu_check_at for p in procs if p.record is None and not p.killed and p.cpu_check_at]
        if grace_deadline is not None:
            wakeups.append(grace_deadline)
        timeout = max(0.0, min(wakeups) - now) if wakeups else 0.5
        for key, _ in selector.select(timeout):
            proc, what = key.data
            if what == "exit":
                _reap(proc, selector, sandboxed)
            elif proc.record is None:
                _read(selector, key.fd, proc, what)
        now = time.monotonic()
        for proc in procs:
            if proc.record is None and now >= proc.t0 + proc.job.limits.timeout_s:
                proc.kill("timeout")
            if proc.record is None and not proc.killed and proc.cpu_check_at and now >= proc.cpu_check_at:
                _check_cpu(proc, now)
        if primary is not None and procs[primary].record is not None:
            if grace_deadline is None:
                grace_deadline = now + grace_s
            elif now >= grace_deadline:
                for proc in procs:
                    proc.kill(None)


def _read(selector: selectors.BaseSelector, fd: int, proc: _Process, stream: int) -> None:
    """Read what is there; unregister the stream at its end; kill the run on a flood."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return
    if not chunk:
        selector.unregister(fd)
        return
    proc.take(stream, chunk)
    if proc.counts[stream] > proc.job.limits.output_kill_bytes:
        proc.kill("output")


def _reap(proc: _Process, selector: selectors.BaseSelector, sandboxed: bool) -> None:
    _, status, usage = os.wait4(proc.popen.pid, 0)
    for init in proc.inits:  # killed from here: return once nothing of the sandbox is left
        with selectors.DefaultSelector() as gone:
            gone.register(init, selectors.EVENT_READ)
            gone.select(5.0)
        os.close(init)
    wall = time.monotonic() - proc.t0
    proc.popen.returncode = os.waitstatus_to_exitcode(status)
    with contextlib.suppress(KeyError):
        selector.unregister(proc.pidfd)
    os.close(proc.pidfd)
    for stream, pipe in enumerate((proc.popen.stdout, proc.popen.stderr)):
        assert pipe is not None
        if pipe.fileno() in selector.get_map():  # drain what the sandbox left in the pipe
            while proc.counts[stream] <= proc.job.limits.output_kill_bytes:
                try:
                    chunk = os.read(pipe.fileno(), 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                proc.take(stream, chunk)
            selector.unregister(pipe.fileno())
        pipe.close()
    exit_code: int | None = None
    sig: int | None = None
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
    else:
        exit_code = os.WEXITSTATUS(status)
        if sandboxed and 128 < exit_code <= 128 + 64:  # bwrap reports a child killed by signal N as 128+N
            exit_code, sig = None, exit_code - 128
    limits = proc.job.limits
    cpu = usage.ru_utime + usage.ru_stime
    peak_rss: int | None = None
    reported = _read_report(proc.report_fd)
    if reported is not None:  # the job's own numbers, from the sandbox's PID 1
        peak_rss, cpu = reported
    tree: cgroup.Usage | None = None
    if proc.group is not None:  # the whole tree's numbers, from the kernel, even when killed
        tree = proc.group.usage()
        proc.group.release()
        peak_rss = tree.peak_kb if tree.peak_kb is not None else peak_rss
        # the group counts every process of the tree; the reaped rusage is tick-based and can exceed the
        # scheduler's exact count on a loaded machine (1.0 s at SIGXCPU against 0.82 s): the larger holds
        cpu = max(cpu, tree.cpu_s) if tree.cpu_s is not None else cpu
    if proc.watcher is not None:
        proc.watcher.stop()
        peak_rss = max(peak_rss or 0, proc.watcher.peak_kb) or None
        cpu = max(cpu, proc.watcher.cpu_s)  # the reaped rusage misses orphans killed with the namespace
    stdout, stderr = (bytes(b).decode("utf-8", "replace") for b in proc.stored)
    proc.record = SandboxRunRecord(
        run_id=str(uuid.uuid4()), purpose=proc.job.purpose, code_sha256=proc.job.digest(), limits=limits,
        exit_code=exit_code, signal=sig, wall_s=round(wall, 4), cpu_s=round(cpu, 4),
        peak_rss_kb=peak_rss, stdout_bytes=proc.counts[0], stderr_bytes=proc.counts[1],
        stdout=stdout, stderr=stderr,
        limit_hit=_limit_hit(proc, exit_code, sig, cpu, tree), started_at=proc.started_at, sandboxed=sandboxed,
        uid=proc.uid,
    )


def _read_report(fd: int) -> tuple[int, float] | None:
    """Peak RSS (kB) and CPU seconds reported by the sandbox's PID 1; None when it died first (a kill)."""
    if fd < 0:
        return None
    try:
        os.set_blocking(fd, False)
        data = os.read(fd, 256)
    except OSError:
        data = b""
    finally:
        os.close(fd)
    try:
        maxrss, utime, stime = data.decode().split()
        return int(maxrss), float(utime) + float(stime)
    except ValueError:
        return None


def _limit_hit(proc: _Process, exit_code: int | None, sig: int | None, cpu: float,
               tree: cgroup.Usage | None = None) -> str | None:
    """Which limit ended the run. Signals and our own kills are certain; the rest reads stderr.

    A process that hits RLIMIT_AS, RLIMIT_NPROC or (in Python, which ignores SIGXFSZ) RLIMIT_FSIZE
    sees a failed system call, not a signal, and usually dies of the exception; its message is the
    only trace. Untrusted code can print such a message itself: that only changes the label of a run
    that earns nothing anyway.
    """
    if proc.kill_reason:
        return proc.kill_reason
    if proc.killed:
        return None  # stopped by the caller (the primary had finished), not by a limit
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= proc.job.limits.cpu_s * 0.95):
        return "cpu"
    if sig == signal.SIGXFSZ:
        return "fsize"
    if tree is not None and tree.memory_hit:  # the kernel's count, not the candidate's stderr; reported
        return "memory"  # even when the job survived the loss of a child
    if tree is not None and tree.pids_hit:
        return "nproc"
    if exit_code == 0 and sig is None:
        return None
    tail = proc.tails[1].decode("utf-8", "replace")
    for needles, name in ((("MemoryError", "Cannot allocate memory", "std::bad_alloc"), "memory"),
                          (("BlockingIOError", "Resource temporarily unavailable"), "nproc"),
                          (("File too large",), "fsize")):
        if any(needle in tail for needle in needles):
            return name
    return None
