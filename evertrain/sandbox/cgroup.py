"""Whole-sandbox limits: one cgroup per sandboxed run, so memory, processes and CPU count for the tree.

RLIMIT_AS bounds each process's address space, not their sum: a candidate that forks children, each
under the limit, could take the host's memory (measured before this module: +2.7 GB from one run whose
audit row said 8.8 MB). A cgroup counts every process of the sandbox together, children included,
whatever they do, and the kernel enforces its limits:

- ``memory``: the tree's memory is capped at ``Limits.memory_mb`` (swap too, where the kernel accounts
  it); past it the kernel's OOM killer kills inside the group only. The group's peak is the audit row's
  ``peak_rss_kb``.
- ``pids``: at most ``Limits.nproc`` tasks in the tree (a fork bomb stops there even as root).
- CPU: the tree's CPU time is the audit row's ``cpu_s`` (v2: the group's ``cpu.stat``; v1: the rusage of
  everything the sandbox's PID 1 reaped, which is every process of the namespace).

Both cgroup versions are handled: v2 (a unified ``/sys/fs/cgroup`` with the memory and pids
controllers enabled for our own group) and v1 (separate ``memory`` and ``pids`` hierarchies,
as on this repository's machine, where ``/sys/fs/cgroup/unified`` has no controllers). A group is made
under this process's own group in each hierarchy (so any limit on the grader still holds for its
sandboxes); after the run its usage is read, and a background thread kills anything left and removes it.

Where neither is writable (not root, a read-only /sys), :func:`backend` returns None and the sandbox
falls back to RLIMIT_AS per process plus :class:`TreeWatcher`, which sums the resident memory of the
sandbox's processes every few milliseconds and kills the whole run past the limit. That is weaker (a
burst faster than the polling interval can overshoot, bounded by RLIMIT_AS per process) and logged once.

The process enters its group before it starts bwrap (a tiny ``sh`` writes its own pid into the group,
then execs bwrap), so nothing of the sandbox ever runs outside it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
DISABLE_ENV = "EVERTRAIN_NO_CGROUP"  # "1": use the fallback watcher even where cgroups work (tests)


@dataclass(frozen=True)
class Backend:
    version: int  # 1 or 2
    bases: dict[str, Path]  # controller ("memory", "pids", "cpu") -> the folder our groups go under


def _own_paths() -> dict[str, str]:
    """controller -> this process's cgroup path, from /proc/self/cgroup ('' is the v2 entry)."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _writable_base(base: Path) -> bool:
    probe = base / f"evertrain-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError:
        return False
    with contextlib.suppress(OSError):
        probe.rmdir()
    return True


@cache
def backend() -> Backend | None:
    """The cgroup setup usable here (checked once), or None when only the fallback watcher is left."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    paths = _own_paths()
    controllers = ROOT / "cgroup.controllers"
    if controllers.exists() and "" in paths:  # v2 mounted at /sys/fs/cgroup
        own = ROOT / paths[""].lstrip("/")
        available = set(controllers.read_text().split())
        if {"memory", "pids"} <= available:
            with contextlib.suppress(OSError):
                enabled = set((own / "cgroup.subtree_control").read_text().split())
                if not {"memory", "pids"} <= enabled:
                    (own / "cgroup.subtree_control").write_text("+memory +pids")
            if _writable_base(own) and {"memory", "pids"} <= set((own / "cgroup.subtree_control").read_text().split()):
                return Backend(2, {"memory": own, "pids": own, "cpu": own})
    bases: dict[str, Path] = {}
    # v1: memory and pids only. The tree's CPU comes from the sandbox's PID 1, which reaps every process
    # of the namespace and reports their rusage; a third hierarchy would cost every run a mkdir and rmdir.
    for controller, folder in (("memory", "memory"), ("pids", "pids")):
        mount = ROOT / folder
        if not mount.is_dir():
            return None
        key = "cpuacct" if controller == "cpu" else controller
        base = mount / paths.get(key, "/").lstrip("/")
        if not base.is_dir() or not _writable_base(base):
            return None
        bases[controller] = base
    return Backend(1, bases)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as file:
        file.write(value)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_keyed(path: Path) -> dict[str, int]:
    values: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                values[key] = int(value)
    return values


@dataclass
class Usage:
    """What a group used, read after the run."""

    peak_kb: int | None
    cpu_s: float | None
    memory_hit: bool  # the kernel OOM-killed a process of the group (the tree reached its memory limit)
    pids_hit: bool  # a fork or thread start failed at the group's pids limit


@dataclass
class Group:
    """One sandbox's cgroup (one folder per hierarchy in v1, one folder in v2)."""

    backend: Backend
    dirs: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def create(cls, backend: Backend, memory_mb: int, nproc: int) -> Group:
        name = f"evertrain-{uuid.uuid4().hex}"
        group = cls(backend)
        try:
            for controller, base in backend.bases.items():
                path = base / name
                if path not in group.dirs.values():
                    path.mkdir()
                group.dirs[controller] = path
            limit = memory_mb * 1024 * 1024
            if backend.version == 2:
                _write(group.dirs["memory"] / "memory.max", str(limit))
                with contextlib.suppress(OSError):
                    _write(group.dirs["memory"] / "memory.swap.max", "0")
                _write(group.dirs["pids"] / "pids.max", str(nproc))
            else:
                _write(group.dirs["memory"] / "memory.limit_in_bytes", str(limit))
                with contextlib.suppress(OSError):  # only where swap accounting is on
                    _write(group.dirs["memory"] / "memory.memsw.limit_in_bytes", str(limit))
                _write(group.dirs["pids"] / "pids.max", str(nproc))
        except BaseException:
            group.remove()
            raise
        return group

    def procs_files(self) -> list[str]:
        """The cgroup.procs files the starting process writes its pid to (one per distinct folder)."""
        return [str(path / "cgroup.procs") for path in dict.fromkeys(self.dirs.values())]

    def usage(self) -> Usage:
        memory, pids = self.dirs["memory"], self.dirs["pids"]
        cpu = self.dirs.get("cpu", memory)
        if self.backend.version == 2:
            peak = _read_int(memory / "memory.peak")
            events = _read_keyed(memory / "memory.events")
            usec = _read_keyed(cpu / "cpu.stat").get("usage_usec")
            cpu_s = None if usec is None else usec / 1e6
            memory_hit = events.get("oom_kill", 0) > 0
        else:
            peak = _read_int(memory / "memory.max_usage_in_bytes")
            cpu_s = None  # from the sandbox's PID 1 (see backend())
            memory_hit = _read_keyed(memory / "memory.oom_control").get("oom_kill", 0) > 0
        pids_hit = _read_keyed(pids / "pids.events").get("max", 0) > 0
        return Usage(None if peak is None else peak // 1024, cpu_s, memory_hit, pids_hit)

    def kill_all(self) -> None:
        """SIGKILL whatever is left in the group (v2: cgroup.kill; v1: every listed pid, until none)."""
        if self.backend.version == 2:
            with contextlib.suppress(OSError):
                _write(self.dirs["pids"] / "cgroup.kill", "1")
                return
        for _ in range(50):
            try:
                pids = [int(p) for p in (self.dirs["pids"] / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def release(self) -> None:
        """Kill what is left and remove the group later, off the grade's critical path (a v1 group can
        be removed only once its last task is gone, a moment after the kill)."""
        _cleanup.put(self)
        _start_cleaner()

    def remove(self) -> None:
        self.kill_all()
        for path in dict.fromkeys(self.dirs.values()):
            for _ in range(100):  # a killed task leaves its group a moment after the signal
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
            else:
                log.warning("could not remove cgroup %s", path)


_cleanup: queue.Queue[Group | None] = queue.Queue()
_cleaner: list[threading.Thread] = []
_cleaner_lock = threading.Lock()


def _clean() -> None:
    while (group := _cleanup.get()) is not None:
        try:
            group.remove()
        except Exception:  # never let one stuck group stop the removal of the others
            log.warning("could not remove cgroup %s", group.dirs, exc_info=True)
        finally:
            _cleanup.task_done()


def _start_cleaner() -> None:
    with _cleaner_lock:
        if not _cleaner:
            thread = threading.Thread(target=_clean, daemon=True, name="evertrain-cgroup-cleaner")
            thread.start()
            _cleaner.append(thread)
            atexit.register(drain)


def drain() -> None:
    """Wait until every released group is removed (at exit, and in tests)."""
    if _cleaner:
        _cleanup.join()


# A shell that puts itself into the group's cgroup.procs files, then becomes the sandbox (exec keeps
# the pid), so bwrap and everything it starts are born inside the group.
ENTER = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'


def enter_argv(group: Group, argv: list[str]) -> list[str]:
    files = group.procs_files()
    return ["/bin/sh", "-c", ENTER, "sh", str(len(files)), *files, *argv]


# ---------------------------------------------------------------------------------------------------
# The fallback: a process-tree memory watcher


def _tree(root: int) -> list[int]:
    """``root`` and all its descendants, from /proc (children lists where the kernel has them)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as file:
                    todo += [int(child) for child in file.read().split()]
        except OSError:
            continue
    return found


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as file:
            return int(file.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)
    except (OSError, ValueError, IndexError):
        return 0


class TreeWatcher:
    """Sums the resident memory of a process tree every ``interval_s`` and calls ``kill`` past the limit."""

    def __init__(self, root: int, limit_kb: int, kill: object, interval_s: float = 0.02) -> None:
        self.root, self.limit_kb, self.kill, self.interval_s = root, limit_kb, kill, interval_s
        self.peak_kb = 0
        self.hit = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"tree-watcher-{root}")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = sum(_rss_kb(pid) for pid in _tree(self.root))
            self.peak_kb = max(self.peak_kb, total)
            if total > self.limit_kb:
                self.hit = True
                self.kill()  # type: ignore[operator]
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
