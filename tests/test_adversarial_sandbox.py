"""Attacks on the sandbox around the graders (issue 23, second attacker), with real bubblewrap:

- the terminal task's checker reachable from the agent's files (a planted ``usercustomize`` that reads
  the hidden check and prints what it expects);
- detached busy children of one sandbox tree starving the items graded beside it, and the audit row
  recording a fraction of the CPU the tree burned;
- `evertrain score` input lines that end the batch or lose their result (fuzzed).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from evertrain.envs.terminal import _HOOK, Terminal
from evertrain.sandbox import Limits, run_python
from tests.test_terminal import _task, terminal_env

# -- the terminal checker ---------------------------------------------------------------------------

# Plants a user-site hook that runs inside every Python the checker starts, reads the hidden check and
# prints the output it expects, then exits: full reward on every task whose check runs Python, unsolved.
READ_THE_CHECK = ('d=$(python3 -m site --user-site); mkdir -p "$d"; cat > "$d/usercustomize.py" <<\'EOF\'\n'
                  + _HOOK + "EOF")

PYTHON_CHECKED = ("fix-add", "fix-import", "fix-off-by-one", "fix-syntax")


@pytest.fixture(scope="module")
def terminal() -> Terminal:
    return terminal_env()


def test_terminal_checker_ignores_a_planted_usercustomize_that_reads_the_check(terminal):
    for name in PYTHON_CHECKED:
        problem = _task(terminal, name)
        verdict = terminal.verify(problem, f"<bash>\n{READ_THE_CHECK}\n</bash>")
        assert verdict.reward == 0, (name, verdict)
        # the real solution still passes in the same checker
        assert terminal.verify(problem, terminal.reference(problem) or "").passed, name


def test_terminal_checker_source_is_not_on_the_checkers_filesystem(terminal):
    # the workspace program itself looks for the hidden check: it is nowhere a program can read
    problem = _task(terminal, "fix-syntax")
    hunt = ("cat > greet.py <<'EOF'\nimport os\nfound = []\nfor root in ('/sandbox', '/tmp', '/proc/1'):\n"
            "    for folder, _, names in os.walk(root):\n        for n in names:\n"
            "            try:\n                text = open(os.path.join(folder, n), errors='replace').read()\n"
            "            except OSError:\n                continue\n"
            "            if ('greet.py ' + 'printed') in text:  # a phrase of the check alone\n"
            "                found.append(n)\n"
            "print('Hello, Ada!' if found else 'nothing')\nEOF")
    verdict = terminal.verify(problem, f"<bash>\n{hunt}\n</bash>")
    assert verdict.reward == 0 and "nothing" in str(verdict.detail.get("check")), verdict


def test_terminal_checker_programs_get_a_clean_environment(tmp_path):
    # a task whose check prints the environment its programs see: no HOME in the workspace, no user site
    (tmp_path / "env.toml").write_text(
        'prompt = "Do nothing."\nsolution = ["true"]\n'
        'check = """\ncode, out, err = sh("echo HOME=$HOME; python3 -c \'import site, sys; '
        'print(site.ENABLE_USER_SITE, sys.pycache_prefix)\'")\nassert False, out\n"""\n'
        '[files]\n"a.txt" = "a"\n')
    env = Terminal(str(tmp_path))
    problem = env.problems("train", 1, 0)[0]
    verdict = env.verify(problem, "<bash>\nmkdir -p .local && echo x > .bashrc\n</bash>")
    seen = verdict.detail["check"]
    assert "HOME=/tmp" not in seen and "HOME=/nonexistent" in seen, seen
    assert "False /nonexistent/pycache" in seen, seen


# -- CPU per sandbox tree ---------------------------------------------------------------------------

# Detached (setsid, double fork) busy children: each under RLIMIT_CPU, together many times it.
BUSY_DETACHED = """
import os, time
for _ in range({n}):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                pass
        os._exit(0)
time.sleep(60)
"""

HONEST_WORK = """
import time
end = time.process_time() + 0.5
while time.process_time() < end:
    pass
print('done', round(time.process_time(), 2))
"""


def test_detached_busy_children_do_not_starve_an_honest_run_beside_them():
    # The honest run needs 0.5 CPU seconds. Beside 16 detached busy processes it got about a 17th of
    # its share before, and timed out; now the attacker's tree weighs as one process and uses one core.
    attacker = Limits(timeout_s=30, cpu_s=3, nproc=32)
    honest = Limits(timeout_s=30, cpu_s=5)
    with ThreadPoolExecutor(2) as pool:
        attack = pool.submit(run_python, BUSY_DETACHED.format(n=16), limits=attacker)
        time.sleep(0.5)  # the children are running before the honest run starts
        good = pool.submit(run_python, HONEST_WORK, limits=honest).result()
        bad = attack.result()
    assert good.exit_code == 0 and good.stdout.startswith("done") and good.limit_hit is None, good
    # the attacker's tree got at most its budget (on a loaded machine its wall clock may end it first)
    assert bad.limit_hit in ("cpu", "timeout") and bad.cpu_s <= (attacker.cpu_s + 1) * 1.5, bad
    assert bad.cpu_s <= bad.wall_s * attacker.cpu_cores * 1.1 + 0.1, bad  # never more than one core at once


def test_detached_busy_children_are_killed_at_the_trees_cpu_budget():
    limits = Limits(timeout_s=300, cpu_s=1, nproc=32)  # wall-clock room for a loaded machine
    # each child alone stays under RLIMIT_CPU (1 s); the job exits by itself once they have burned 3 s
    # together, past the tree's budget of 2 s: only a tree-wide bound stops it first
    record = run_python(REPORTING_CHILDREN.format(n=4, until_s=3.0), limits=limits)
    assert record.limit_hit == "cpu" and record.signal is not None, record
    assert limits.cpu_s + 1 <= record.cpu_s <= (limits.cpu_s + 1) * 1.5, record


# Detached busy children that report the CPU they have used; the job exits once they report ``until_s``
# CPU seconds together (however loaded the machine), and the kernel kills them with the namespace.
REPORTING_CHILDREN = """
import os, time
r, w = os.pipe()
for _ in range({n}):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                end = time.process_time() + 0.05
                while time.process_time() < end:
                    pass
                line = f"{{os.getpid()}} {{time.process_time():.3f}}\\n".encode()
                os.write(1, line)
                os.write(w, line)
        os._exit(0)
last = {{}}
buffer = b""
while len(last) < {n} or sum(last.values()) < {until_s}:
    buffer += os.read(r, 4096)
    *lines, buffer = buffer.split(b"\\n")
    for line in lines:
        pid, seconds = line.split()
        last[pid] = float(seconds)
os._exit(0)
"""


def test_audit_row_counts_the_cpu_of_detached_children():
    record = run_python(REPORTING_CHILDREN.format(n=2, until_s=0.4), limits=Limits(timeout_s=300, cpu_s=20))
    last: dict[str, float] = {}
    for line in record.stdout.splitlines():
        pid, _, seconds = line.partition(" ")
        last[pid] = float(seconds)
    burned = sum(last.values())  # what the children themselves measured before the namespace went down
    assert len(last) == 2 and burned >= 0.4, record.stdout
    assert record.cpu_s >= burned, (record.cpu_s, burned)


def test_cpu_cores_must_be_positive():
    with pytest.raises(ValueError, match="cpu_cores"):
        Limits(cpu_cores=0)


# -- `evertrain score` input ------------------------------------------------------------------------

ODD = ["\u2028", "\u2029", "\u0085", "\x1c", "\x00", "\ud800", "\udfff", "\ufeff", "\u202e", "e\u0301",
       "\U0001f600", "\x7f", "\\", "\"", "\u00a0", "\t"]


def _honest(tag: str, a: int, b: int, noise: str = "") -> dict:
    return {"id": tag, "env": "arithmetic", "problem": {"question": f"What is {a} + {b}?{noise}", "answer": str(a + b)},
            "completion": f"#### {a + b}"}


def _fuzz_lines(seed: int) -> list[tuple[bytes, dict | None, bool]]:
    """(line bytes without its newline, the item when the line is a valid one, whether it is honest)."""
    rng = random.Random(seed)
    lines: list[tuple[bytes, dict | None, bool]] = []
    for i in range(120):
        kind = rng.randrange(9)
        if kind == 0:  # odd characters everywhere a string may hold them, raw or escaped
            noise = "".join(rng.choice(ODD) for _ in range(rng.randrange(1, 12)))
            item = _honest(f"odd-{i}{noise}", rng.randrange(100), rng.randrange(100), noise)
            text = json.dumps(item, ensure_ascii=rng.random() < 0.5)
            # raw U+2028, U+0085 ... stay raw; a lone surrogate can only be written escaped in UTF-8
            text = re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", text)
            lines.append((text.encode("utf-8"), item, True))
        elif kind == 1:  # random bytes (no newline inside)
            lines.append((bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b" "),
                          None, False))
        elif kind == 2:  # deep nesting, bare or inside an otherwise valid item
            depth = rng.choice([2_000, 100_000])
            deep = "[" * depth + "]" * depth
            if rng.random() < 0.5:
                lines.append((deep.encode(), None, False))
            else:
                text = json.dumps(_honest(f"deep-{i}", 1, 2))[:-1] + f', "extra": {deep}}}'
                lines.append((text.encode(), None, False))
        elif kind == 3:  # a valid item cut short
            text = json.dumps(_honest(f"cut-{i}", 3, 4))
            lines.append((text[: rng.randrange(1, len(text) - 1)].encode(), None, False))
        elif kind == 4:  # invalid UTF-8 inside a string of an otherwise valid item
            text = json.dumps(_honest(f"utf-{i}", 5, 6)).encode()
            bad = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82"])
            lines.append((text.replace(b"What", b"Wh" + bad + b"at"), None, False))
        elif kind == 5:  # a huge string within the caps (the completion cap refuses it, by name)
            item = _honest(f"huge-{i}", 7, 8)
            item["completion"] = "x" * rng.choice([1_000, 300_000]) + "\n#### 15"
            lines.append((json.dumps(item).encode(), item, False))
        elif kind == 6:  # valid JSON, not an item
            lines.append((rng.choice([b"[]", b"null", b"1e999", b'"\\ud800"', b"{}", b"  "]), None, False))
        elif kind == 7:  # a Windows line ending
            item = _honest(f"crlf-{i}", 9, 10)
            lines.append((json.dumps(item).encode() + b"\r", item, True))
        else:
            item = _honest(f"plain-{i}", rng.randrange(50), rng.randrange(50))
            lines.append((json.dumps(item).encode(), item, True))
    lines.append((b"[" * 40_000_000, None, False))  # past the line cap: refused unread
    return lines


def _score(tmp_path, data: bytes, workers: int = 2) -> tuple[list[dict], float]:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(data)
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "evertrain.cli", "score", "--input", str(source), "--output",
                          str(output), "--workers", str(workers), "--store", str(tmp_path / "audit.duckdb")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in output.read_text(encoding="utf-8").split("\n") if line], \
        time.monotonic() - began


def test_score_cli_fuzzed_input_gets_one_result_per_line_in_order(tmp_path):
    lines = _fuzz_lines(seed=23)
    results, _ = _score(tmp_path, b"\n".join(line for line, _, _ in lines) + b"\n")
    assert len(results) == len(lines)
    for number, ((raw, item, honest), result) in enumerate(zip(lines, results, strict=True), 1):
        if item is None:
            assert result["reason"] == "malformed_input" and result["detail"]["line"] == number, (raw[:80], result)
            assert result["reward"] == 0
            continue
        # a valid line is graded whatever characters it holds (a lone surrogate is read as U+FFFD)
        assert result["reason"] != "malformed_input", (raw[:200], result)
        assert result["id"] == item["id"].encode("utf-8", "surrogatepass").decode("utf-8", "replace") \
            or "\ufffd" in result["id"], (item["id"], result["id"])
        if honest:
            assert result["reward"] == 1.0, (raw[:200], result)


def test_score_cli_mixed_batch_of_attacks_and_honest_items(tmp_path, terminal):
    double = {"prompt": "Write double(x).", "tests": ["assert double(2) == 4", "assert double(5) == 10"]}
    good_code = "```python\ndef double(x):\n    return 2*x\n```"
    stall_code = ("```python\nimport os, time\nfor _ in range(12):\n    if os.fork() == 0:\n        os.setsid()\n"
                  "        if os.fork() == 0:\n            while True:\n                pass\n        os._exit(0)\n"
                  "time.sleep(60)\ndef double(x):\n    return 2*x\n```")
    fix_add = _task(terminal, "fix-add")
    terminal_problem = {"prompt": fix_add.prompt, **fix_add.payload}
    items: list[object] = [
        {"id": "code-stall", "env": "code", "problem": double, "completion": stall_code},
        {"id": "code-ok", "env": "code", "problem": double, "completion": good_code},
        {"id": "term-hack", "env": "terminal", "problem": terminal_problem,
         "completion": f"<bash>\n{READ_THE_CHECK}\n</bash>"},
        "[" * 100_000,
        {"id": "term-ok", "env": "terminal", "problem": terminal_problem, "completion": terminal.reference(fix_add)},
        _honest("math-ok", 2, 2, "\u2028\\ud800"),
        {"id": "code-ok-2", "env": "code", "problem": double, "completion": good_code},
    ]
    data = "".join((item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)) + "\n" for item in items)
    results, seconds = _score(tmp_path, data.encode("utf-8", "surrogatepass"))
    assert [r["id"] for r in results] == ["code-stall", "code-ok", "term-hack", None, "term-ok", "math-ok", "code-ok-2"]
    by_id = {r["id"]: r for r in results}
    assert by_id["code-stall"]["reward"] == 0 and by_id["term-hack"]["reward"] == 0
    assert all(by_id[name]["reward"] == 1.0 for name in ("code-ok", "term-ok", "math-ok", "code-ok-2")), results
    assert results[3]["reason"] == "malformed_input" and "RecursionError" in results[3]["detail"]["error"]
    assert seconds < 120


def test_self_test_plants_checker_configuration_and_it_earns_zero(tmp_path):
    from pathlib import Path

    from evertrain.envs.quality import validate
    from evertrain.envs.terminal import __file__ as terminal_module

    tasks = Path(terminal_module).resolve().parents[2] / "data" / "terminal" / "tasks"
    for name in ("fix-add", "fix-import"):  # a train and an eval task whose checks run Python
        (tmp_path / f"{name}.toml").write_text((tasks / f"{name}.toml").read_text())
    env = Terminal(str(tmp_path))
    assert env.count("eval") == 1
    report = validate(env, problems=1)
    labels = {case.label for case in report.cases}
    assert {"plant_usercustomize", "plant_pycache"} <= labels
    assert report.ok, report.failures


def test_tree_watcher_bounds_the_cpu_of_detached_children_where_no_cgroup_can_be_made(monkeypatch):
    from evertrain.sandbox import cgroup

    monkeypatch.setenv(cgroup.DISABLE_ENV, "1")
    cgroup.backend.cache_clear()
    try:
        assert cgroup.backend() is None
        limits = Limits(timeout_s=20, cpu_s=2, nproc=32)
        record = run_python(BUSY_DETACHED.format(n=4), limits=limits)
    finally:
        monkeypatch.delenv(cgroup.DISABLE_ENV)
        cgroup.backend.cache_clear()
    # killed at the tree's budget (cpu_s + 1), not at the wall clock; the row counts what the tree burned
    assert record.limit_hit == "cpu" and record.wall_s < limits.timeout_s, record
    assert record.cpu_s >= limits.cpu_s + 1, record

