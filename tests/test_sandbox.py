"""The sandbox itself: isolation, limits, output caps and the audit record, on the real bwrap."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest

from evertrain.sandbox import Limits, SandboxRunRecord, SandboxUnavailable, bwrap, cgroup, run_command, run_python

FAST = Limits(timeout_s=3, cpu_s=1, memory_mb=256, nproc=16)
CPU_HOG = Limits(timeout_s=10, cpu_s=1)  # wall-clock room: the CPU limit must fire first, even under load
ROW_KEYS = {"run_id", "purpose", "code_sha256", "limits", "exit_code", "signal", "wall_s", "cpu_s",
            "peak_rss_kb", "stdout_bytes", "stderr_bytes", "limit_hit", "started_at"}


def test_runs_python_and_records_it() -> None:
    record = run_python("import sys\nprint('hello'); print('oops', file=sys.stderr)", purpose="unit")
    assert (record.exit_code, record.signal, record.limit_hit) == (0, None, None)
    assert record.stdout == "hello\n" and record.stderr == "oops\n"
    assert (record.stdout_bytes, record.stderr_bytes) == (6, 5)
    assert record.purpose == "unit" and record.sandboxed
    assert 0 < record.wall_s < 5 and record.cpu_s > 0 and record.peak_rss_kb > 1000
    row = record.to_row()
    assert set(row) == ROW_KEYS
    assert json.loads(row["limits"])["cpu_s"] == Limits().cpu_s
    assert isinstance(row["started_at"], datetime) and row["started_at"].tzinfo is not None
    assert uuid.UUID(row["run_id"])
    assert len(row["code_sha256"]) == 64
    assert run_python("print('hello')").code_sha256 != run_python("print('world')").code_sha256


def test_exit_code_stdin_and_files() -> None:
    record = run_python("import sys\ndata = sys.stdin.read()\nprint(open('/sandbox/x.txt').read() + data)\n"
                        "sys.exit(3)", stdin=b"-in", files={"x.txt": "file"})
    assert record.exit_code == 3 and record.stdout == "file-in\n"


def test_run_command() -> None:
    record = run_command(["/bin/sh", "-c", "echo $HOME; id -u"])
    lines = record.stdout.split()
    assert record.exit_code == 0 and lines[0] == "/tmp" and lines[1] != "0"


FS_PROBE = """
import json, os, sys
mine, host_dir = sys.argv[1:]
out = {"root": sorted(os.listdir("/"))}
out["home"] = sorted(os.listdir("/root")) if os.path.exists("/root") else None
for path in ("/usr/pwned", "/etc/pwned", "/sandbox/pwned"):
    try:
        open(path, "w").write("x")
        out[path] = "written"
    except OSError as error:
        out[path] = type(error).__name__
open("/tmp/" + mine, "w").write("x")
out["tmp"] = os.listdir("/tmp")
out["exists"] = {p: os.path.exists(p) for p in (host_dir, "/work", "/home", "/etc/passwd", "/etc/shadow")}
print(json.dumps(out))
"""
ROOT_ENTRIES = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "root", "sandbox", "sbin",
                "tmp", "usr"}


def test_filesystem_is_minimal_and_read_only(tmp_path: Path) -> None:
    mine = f"mine-{uuid.uuid4()}"
    record = run_python(FS_PROBE, args=(mine, str(tmp_path)))
    out = json.loads(record.stdout)
    assert set(out["root"]) <= ROOT_ENTRIES
    assert out["home"] in (None, [".pyenv"])  # only the path to the interpreter, when it lives there
    assert all(out[p] != "written" for p in ("/usr/pwned", "/etc/pwned", "/sandbox/pwned"))
    assert out["tmp"] == [mine]  # a private /tmp: empty at the start, and the host never sees it
    assert not any(out["exists"].values())
    assert not Path("/tmp", mine).exists()


def test_environment_is_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"secret-{uuid.uuid4()}"
    monkeypatch.setenv("EVERTRAIN_TEST_SECRET", secret)
    record = run_python("import os, json\nprint(json.dumps(dict(os.environ)))")
    env = json.loads(record.stdout)
    assert secret not in record.stdout
    allowed = {"PATH", "HOME", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "LANG", "PWD", "LC_CTYPE"}
    assert set(env) <= allowed
    assert env["HOME"] == "/tmp" and env["PYTHONHASHSEED"] == "0"


def test_unprivileged_and_no_new_privileges() -> None:
    record = run_python("import os\nstatus = open('/proc/self/status').read()\n"
                        "print(os.getuid(), os.getgid(), os.getpid())\n"
                        "print([l for l in status.splitlines() if l.startswith(('CapEff', 'NoNewPrivs'))])")
    uid, gid, pid = (int(x) for x in record.stdout.splitlines()[0].split())
    assert uid != 0 and gid != 0
    assert pid == 2  # a fresh PID namespace: the watchdog is 1, the job is 2
    assert "CapEff:\\t0000000000000000" in record.stdout and "NoNewPrivs:\\t1" in record.stdout


def test_no_network() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    record = run_python(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), 1)\n"
                        "    print('connected')\nexcept OSError as e:\n    print('refused', e)")
    assert record.stdout.startswith("refused")
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def test_cpu_limit() -> None:
    record = run_python("while True: pass", limits=CPU_HOG)
    assert record.limit_hit == "cpu" and record.signal is not None and record.cpu_s >= 0.9


def test_cpu_limit_when_sigxcpu_is_ignored() -> None:
    record = run_python("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass",
                        limits=CPU_HOG)
    assert record.limit_hit == "cpu" and record.signal == 9


def test_memory_limit() -> None:
    record = run_python("blocks = []\nwhile True: blocks.append(bytearray(10**7))", limits=FAST)
    assert record.limit_hit == "memory" and record.exit_code == 1
    assert record.peak_rss_kb < FAST.memory_mb * 1024


def test_fork_bomb_is_contained() -> None:
    bomb = "import os, time\nwhile True:\n    os.fork()\n"
    started = time.monotonic()
    record = run_python(bomb, limits=FAST)
    assert record.limit_hit == "nproc"
    assert time.monotonic() - started < FAST.timeout_s + 1
    # the host can still start processes, and nothing of the bomb is left
    assert subprocess.run(["true"]).returncode == 0
    uids = subprocess.run(["ps", "-eo", "uid="], capture_output=True, text=True).stdout.split()
    assert record.uid is None or str(record.uid) not in uids  # (other sandboxes may run beside this test)


def test_file_size_limit() -> None:
    record = run_python("open('/tmp/big', 'wb').write(b'x' * (2 * 1024 * 1024))",
                        limits=Limits(fsize_mb=1))
    assert record.limit_hit == "fsize" and record.exit_code == 1


def test_wall_clock_timeout_kills_the_tree() -> None:
    tag = f"{time.time() % 1000:.6f}"
    source = (f"import os, time\nif os.fork() == 0:\n    os.execv('/bin/sleep', ['sleep', '{tag}'])\n"
              "time.sleep(60)")
    record = run_python(source, limits=Limits(timeout_s=1))
    assert record.limit_hit == "timeout" and record.signal == 9
    assert 1 <= record.wall_s < 3
    time.sleep(0.2)
    assert tag not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_output_is_capped_and_floods_killed() -> None:
    limits = Limits(output_keep_bytes=1000, output_kill_bytes=100_000, timeout_s=10)
    record = run_python("print('x' * 5000)", limits=limits)
    assert record.exit_code == 0 and record.stdout_bytes == 5001 and len(record.stdout) == 1000
    record = run_python("import sys\nwhile True: sys.stdout.write('y' * 65536)", limits=limits)
    assert record.limit_hit == "output" and record.stdout_bytes > 100_000 and len(record.stdout) == 1000
    assert record.wall_s < 5


def test_parallel_runs_from_threads() -> None:
    with ThreadPoolExecutor(4) as pool:
        records = list(pool.map(lambda i: run_python(f"print({i} * 2)"), range(12)))
    assert [r.stdout for r in records] == [f"{i * 2}\n" for i in range(12)]


def test_audit_sink_sees_every_record(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[SandboxRunRecord] = []
    monkeypatch.setattr(bwrap, "audit_sink", seen.append)
    record = run_python("pass", purpose="audited")
    assert seen == [record]


def test_missing_bwrap_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no bwrap on PATH
    problem = bwrap._probe()
    assert isinstance(problem, SandboxUnavailable)
    assert "apt-get install bubblewrap" in str(problem)


def test_unsafe_escape_hatch_warns_on_every_use(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(bwrap.UNSAFE_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="evertrain.sandbox.bwrap"):
        first = run_python("print(1)")
        second = run_python("print(2)")
    assert (first.stdout, second.stdout) == ("1\n", "2\n")
    assert not first.sandboxed
    assert sum("WITHOUT A SANDBOX" in message for message in caplog.messages) == 2


def test_sandbox_is_on_by_default() -> None:
    assert os.environ.get(bwrap.UNSAFE_ENV) != "1"
    bwrap.check_available()
    assert run_python("pass").sandboxed


def test_threads_and_fds_do_not_leak() -> None:
    # one run first: it may start the process's one cgroup-cleaner thread, which lives as long as the
    # process by design; drain() waits for it to remove the released groups (it reads their files)
    run_python("print('x')")
    cgroup.drain()
    before = len(os.listdir("/proc/self/fd")), threading.active_count()
    for _ in range(5):
        run_python("print('x')")
    cgroup.drain()
    assert (len(os.listdir("/proc/self/fd")), threading.active_count()) == before


def test_peak_memory_is_the_jobs_even_from_a_large_parent():
    # a process started from a big parent inherits the parent's peak RSS across exec; the audit must
    # report the sandboxed job's own peak, not the grader's
    ballast = bytearray(400 * 1024 * 1024)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touch every page: 400 MB resident here
    record = run_python("data = bytearray(30 * 1024 * 1024)")
    assert record.exit_code == 0
    assert 30 * 1024 < record.peak_rss_kb < 200 * 1024
    del ballast


# ---------------------------------------------------------------------------------------------------
# Whole-tree limits: memory and CPU count for every process of the sandbox (a cgroup per run, or the
# tree watcher where no cgroup can be made). Before, each child got its own RLIMIT_AS: six children of
# 200 MB under a 256 MB limit raised host memory by over a gigabyte and the audit said a few MB.

TREE = Limits(timeout_s=20, cpu_s=5, memory_mb=256, nproc=32)
FORK_HOGS = {
    "fork": """
import os, time
kids = []
for i in range(6):
    pid = os.fork()
    if pid == 0:
        block = bytearray(150 * 1024 * 1024)
        block[::4096] = b"x" * len(block[::4096])
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
print([os.waitpid(k, 0)[1] for k in kids])
""",
    "grandchildren": """
import os, time
def hog(depth):
    if depth and os.fork() == 0:
        hog(depth - 1)
        os._exit(0)
    block = bytearray(120 * 1024 * 1024)
    block[::4096] = b"x" * len(block[::4096])
    time.sleep(2)
hog(4)
""",
    "threads": """
import threading, time
blocks = []
def hog():
    block = bytearray(100 * 1024 * 1024)
    block[::4096] = b"x" * len(block[::4096])
    blocks.append(block)
    time.sleep(2)
threads = [threading.Thread(target=hog) for _ in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
""",
}


def _tree_limit_holds(record: SandboxRunRecord, limits: Limits) -> None:
    assert record.limit_hit == "memory", record
    assert record.peak_rss_kb is not None
    assert record.peak_rss_kb <= limits.memory_mb * 1024 * 1.05  # the tree's peak, held at the limit


@pytest.mark.parametrize("name", sorted(FORK_HOGS))
def test_memory_limit_holds_for_the_whole_process_tree(name: str) -> None:
    from evertrain.sandbox import cgroup

    record = run_python(FORK_HOGS[name], limits=TREE)
    if name == "threads":  # one address space: RLIMIT_AS refuses the third block, inside its thread
        assert "MemoryError" in record.stderr
        if cgroup.backend() is not None:
            assert record.peak_rss_kb is not None and record.peak_rss_kb <= TREE.memory_mb * 1024 * 1.05
        return
    _tree_limit_holds(record, TREE)


def test_tree_watcher_holds_where_no_cgroup_can_be_made(monkeypatch: pytest.MonkeyPatch) -> None:
    from evertrain.sandbox import cgroup

    monkeypatch.setenv(cgroup.DISABLE_ENV, "1")
    cgroup.backend.cache_clear()
    try:
        assert cgroup.backend() is None
        record = run_python(FORK_HOGS["fork"], limits=TREE)
        assert record.limit_hit == "memory" and record.signal == 9  # the watcher killed the whole run
        assert record.peak_rss_kb is not None and record.peak_rss_kb > 100 * 1024
    finally:
        monkeypatch.delenv(cgroup.DISABLE_ENV)
        cgroup.backend.cache_clear()


def test_cpu_of_children_is_counted() -> None:
    spin = """
import os, time
def spin():
    end = time.process_time() + 0.6
    while time.process_time() < end:
        pass
kids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        spin(); os._exit(0)
    kids.append(pid)
for k in kids:
    os.waitpid(k, 0)
"""
    record = run_python(spin, limits=TREE)
    assert record.exit_code == 0 and record.cpu_s >= 1.1


def test_each_run_gets_its_own_cgroup_and_it_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    from evertrain.sandbox import cgroup

    backend = cgroup.backend()
    if backend is None:
        pytest.skip("no writable cgroup here: the tree watcher stands in (tested above)")
    made: list[cgroup.Group] = []
    create = cgroup.Group.create

    def recording(backend: cgroup.Backend, memory_mb: int, nproc: int) -> cgroup.Group:
        made.append(create(backend, memory_mb, nproc))
        return made[-1]

    # this run's own groups, by name: other processes' sandboxes (a parallel test run) come and go meanwhile
    monkeypatch.setattr(cgroup.Group, "create", staticmethod(recording))
    record = run_python("import os; print(open('/proc/self/cgroup').read())")
    assert record.exit_code == 0
    paths = [path for group in made for path in group.dirs.values()]
    assert made and all(path.name.startswith("evertrain-") for path in paths)
    assert len({group.dirs["pids"].name for group in made}) == len(made)  # one group per sandboxed process
    cgroup.drain()  # groups are removed by a background thread, off the grade's critical path
    assert not any(path.exists() for path in paths)
