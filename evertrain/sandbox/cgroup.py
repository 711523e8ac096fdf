"""Whole-sandbox limits: one cgroup per sandboxed run, so memory, processes and CPU count for the tree.

RLIMIT_AS bounds each process's address space, not their sum: a candidate that forks children, each
under the limit, could take the host's memory (measured before this module: +2.7 GB from one run whose
audit row said 8.8 MB). A cgroup counts every process of the sandbox together, children included,
whatever they do, and the kernel enforces its limits:

- ``memory``: the tree's memory is capped at ``Limits.memory_mb`` (swap too, where the kernel accounts
  it); past it the kernel's OOM killer kills inside the group only. The group's peak is the audit row's
  ``peak_rss_kb``.
- ``pids``: at most ``Limits.nproc`` tasks in the tree (a fork bomb stops there even as root).
- ``cpu``: the tree may use at most ``Limits.cpu_cores`` cores at any instant (v2 ``cpu.max``, v1
  ``cpu.cfs_quota_us``: a bandwidth bound, however many processes it forks), and the grader kills it once
  the group's CPU time (v2 ``cpu.stat`` ``usage_usec``, v1 ``cpuacct.usage``) passes ``cpu_s + 1``
  seconds (see ``bwrap._pump``). That group count is the audit row's ``cpu_s``: every process of the tree,
  detached or not, reaped or killed. (The rusage of what the sandbox's PID 1 reaped misses the orphans
  the kernel kills when the namespace goes down: it recorded a fraction of what a tree of detached busy
  children burned.)

Both cgroup versions are handled: v2 (a unified ``/sys/fs/cgroup`` with the memory and pids
controllers enabled for our own group) and v1 (separate ``memory`` and ``pids`` hierarchies,
as on this repository's machine, where ``/sys/fs/cgroup/unified`` has no controllers). A group is made
under this process's own group in each hierarchy (so any limit on the grader still holds for its
sandboxes); after the run its usage is read, and a background thread kills anything left and removes it.

Where neither is writable (not root, a read-only /sys), :func:`backend` returns None and the sandbox
falls back to RLIMIT_AS per process plus :class:`TreeWatcher`, which sums the resident memory and CPU
time of the sandbox's processes (psutil) every few milliseconds and kills the whole run past either
limit. That is weaker (a burst faster than the polling interval can overshoot, bounded by RLIMIT_AS and
RLIMIT_CPU per process; no bandwidth bound) and logged once. Where a cgroup can be made but its CPU
controllers cannot, the watcher runs beside it for CPU alone.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import psutil

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


def _v1_base(folder: str, key: str, paths: dict[str, str]) -> Path | None:
    """The writable folder our groups go under in the v1 hierarchy mounted at ``folder``, or None."""
    mount = ROOT / folder
    if not mount.is_dir():
        return None
    # resolved: co-mounted hierarchies ("cpu" and "cpuacct" links to "cpu,cpuacct") must be one folder
    base = (mount / paths.get(key, "/").lstrip("/")).resolve()
    return base if base.is_dir() and _writable_base(base) else None


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
            enabled: set[str] = set()
            with contextlib.suppress(OSError):
                enabled = set((own / "cgroup.subtree_control").read_text().split())
                if not {"memory", "pids"} <= enabled:
                    (own / "cgroup.subtree_control").write_text("+memory +pids")
            with contextlib.suppress(OSError):  # cpu.max needs the cpu controller; usage_usec is always there
                if "cpu" in available and "cpu" not in enabled:
                    (own / "cgroup.subtree_control").write_text("+cpu")
            if _writable_base(own) and {"memory", "pids"} <= set((own / "cgroup.subtree_control").read_text().split()):
                return Backend(2, {"memory": own, "pids": own, "cpu": own})
    bases: dict[str, Path] = {}
    for controller in ("memory", "pids"):  # required
        base = _v1_base(controller, controller, paths)
        if base is None:
            return None
        bases[controller] = base
    # optional: "cpu" bounds the tree's bandwidth, "cpuacct" counts its CPU time (each about 0.5 ms of
    # mkdir and rmdir per run, the rmdir off the grade's path). Co-mounted, both are the same folder.
    for controller, folder in (("cpu", "cpu"), ("cpuacct", "cpuacct")):
        base = _v1_base(folder, controller, paths)
        if base is not None:
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

    def limit_cpu(self, cores: float, period_us: int = 100_000) -> bool:
        """Bound the tree's CPU bandwidth to ``cores`` cores; False where no cpu controller is writable.

        The group keeps the default weight (a nice-0 process's), whatever the grader's nice level: a group
        weighted down to nice 10 (110) made a short sandbox 6 to 8 times slower on a loaded machine
        (measured: 1.8-2.4 s against 0.28-0.36 s per run), as a fresh group's load average starts at zero.
        The bandwidth bound caps what the tree can take all the same."""
        quota = max(1000, int(cores * period_us))
        try:
            if self.backend.version == 2:
                _write(self.dirs["cpu"] / "cpu.max", f"{quota} {period_us}")
            elif "cpu" in self.dirs:
                _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(period_us))
                _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(quota))
            else:
                return False
        except OSError:
            return False
        return True

    @property
    def counts_cpu(self) -> bool:
        """Whether :meth:`cpu_s` reads the tree's CPU time from the kernel."""
        return self.backend.version == 2 or "cpuacct" in self.dirs

    def cpu_s(self) -> float | None:
        """CPU seconds the whole tree has used so far (every process, alive, reaped or killed)."""
        if self.backend.version == 2:
            usec = _read_keyed(self.dirs["cpu"] / "cpu.stat").get("usage_usec")
            return None if usec is None else usec / 1e6
        if "cpuacct" in self.dirs:
            nsec = _read_int(self.dirs["cpuacct"] / "cpuacct.usage")
            return None if nsec is None else nsec / 1e9
        return None

    def usage(self) -> Usage:
        memory, pids = self.dirs["memory"], self.dirs["pids"]
        if self.backend.version == 2:
            peak = _read_int(memory / "memory.peak")
            events = _read_keyed(memory / "memory.events")
            memory_hit = events.get("oom_kill", 0) > 0
        else:
            peak = _read_int(memory / "memory.max_usage_in_bytes")
            memory_hit = _read_keyed(memory / "memory.oom_control").get("oom_kill", 0) > 0
        pids_hit = _read_keyed(pids / "pids.events").get("max", 0) > 0
        return Usage(None if peak is None else peak // 1024, self.cpu_s(), memory_hit, pids_hit)

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
# The fallback: a process-tree watcher (memory and CPU)


def _tree_usage(root: psutil.Process) -> tuple[int, float]:
    """Resident kB and CPU seconds of ``root`` and its descendants. A process's ``children_*`` times hold
    what it reaped (so the CPU of finished children counts too); no process is counted twice."""
    rss, cpu = 0, 0.0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error), proc.oneshot():
            rss += proc.memory_info().rss // 1024
            times = proc.cpu_times()
            cpu += times.user + times.system + times.children_user + times.children_system
    return rss, cpu


class TreeWatcher:
    """Sums the resident memory and CPU time of a process tree every ``interval_s``; past ``limit_kb``
    (None: not watched) calls ``kill``, past ``cpu_budget_s`` (None: not watched) calls ``kill_cpu``."""

    def __init__(self, root: int, limit_kb: int | None, kill: Callable[[], None], interval_s: float = 0.02,
                 cpu_budget_s: float | None = None, kill_cpu: Callable[[], None] | None = None) -> None:
        self.limit_kb, self.kill, self.interval_s = limit_kb, kill, interval_s
        self.cpu_budget_s, self.kill_cpu = cpu_budget_s, kill_cpu
        self.peak_kb = 0
        self.cpu_s = 0.0  # the most CPU seconds the tree was seen to have used
        self.hit = False
        try:
            self.root: psutil.Process | None = psutil.Process(root)
        except psutil.Error:
            self.root = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"tree-watcher-{root}")
        self._thread.start()

    def _run(self) -> None:
        while self.root is not None and not self._stop.is_set():
            rss, cpu = _tree_usage(self.root)
            self.peak_kb, self.cpu_s = max(self.peak_kb, rss), max(self.cpu_s, cpu)
            if self.limit_kb is not None and rss > self.limit_kb:
                self.hit = True
                self.kill()
                return
            if self.cpu_budget_s is not None and cpu > self.cpu_budget_s and self.kill_cpu is not None:
                self.kill_cpu()
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
