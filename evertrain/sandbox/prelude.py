"""The first code that runs inside every sandbox: a watchdog init, then the job under limits as nobody.

Invoked as ``python -S -s -B -P /sandbox/prelude.py UID WATCHDOG_S REPORT_FD LIMITS MODE TARGET [ARG ...]``:
UID is the uid to drop to (``-`` to keep the current one), REPORT_FD is a pipe on which PID 1 reports
the resource usage of everything it reaped (the job never holds it), LIMITS is ``RLIMIT_X=soft:hard,...``, MODE
is ``exec`` (TARGET and ARGs are an argv to exec) or ``main`` (TARGET is a Python file to run as
``__main__`` with ARGs as its arguments). Plain argv and no ``json``: every import here is paid on
every sandboxed run. Standard library only.

It forks. The parent stays root and is the sandbox's PID 1 (bwrap runs with ``--as-pid-1``):

- it waits for the job, writes ``maxrss_kb utime stime`` of everything it reaped to REPORT_FD, and
  exits with the job's status. (bwrap's own rusage is no good for this: a process started from a
  large parent, such as a grader with torch loaded, inherits that parent's peak RSS across exec.)
- it keeps the parent-death signal bwrap's ``--die-with-parent`` set (any change of uid clears it), so
  when bwrap is killed, PID 1 dies and the kernel kills everything left in the namespace;
- it ends the job at WATCHDOG_S even if the grader that should have killed it is gone.

The child sets the resource limits, then drops from root to a fresh unprivileged uid that nothing
else on the host uses: the kernel counts ``RLIMIT_NPROC`` per real uid and never enforces it for root,
so only the drop makes a fork bomb hit the limit. Limits are set here rather than in a
``preexec_fn``, which is unsafe in a threaded parent (graders run on a thread pool). The job cannot
signal or trace PID 1, which belongs to another uid.
"""

import _signal  # the C module: `signal` itself imports enum, 5 ms on every sandboxed run
import os
import resource
import sys


def _watch(job: int, watchdog_s: float, report_fd: int) -> None:
    def expire(signum: int, frame: object) -> None:
        os._exit(128 + _signal.SIGKILL)  # PID 1 exits: the namespace, job included, goes down

    try:  # noqa: SIM105 - the job's stdin (a grader may send it secrets) is not PID 1's to keep open
        os.close(0)
    except OSError:
        pass
    _signal.signal(_signal.SIGALRM, expire)
    _signal.setitimer(_signal.ITIMER_REAL, watchdog_s)
    while True:  # as init, also reap orphans the job leaves behind
        pid, status = os.waitpid(-1, 0)
        if pid == job:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:  # noqa: SIM105 - contextlib is one more import on every sandboxed run
        os.write(report_fd, f"{usage.ru_maxrss} {usage.ru_utime} {usage.ru_stime}\n".encode())
    except OSError:
        pass
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))  # an init cannot die of its own signal; bwrap's convention
    os._exit(os.WEXITSTATUS(status))


def main() -> None:
    uid, watchdog_s, report_fd, limits, mode, target, *args = sys.argv[1:]
    job = os.fork()
    if job:
        _watch(job, float(watchdog_s), int(report_fd))
    os.close(int(report_fd))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for limit in limits.split(","):
        name, _, values = limit.partition("=")
        soft, _, hard = values.partition(":")
        resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
    if uid != "-":
        os.setgroups([])
        os.setgid(int(uid))
        os.setuid(int(uid))  # as root this sets real, effective and saved uid and clears every capability
    if mode == "exec":
        os.execv(target, [target, *args])
    sys.argv = [target, *args]
    sys.path.insert(0, os.path.dirname(target))
    with open(target, encoding="utf-8") as file:
        code = compile(file.read(), target, "exec")
    exec(code, {"__name__": "__main__", "__file__": target, "__builtins__": __builtins__})


main()
