"""The terminal environment, with real bubblewrap: tasks, sandbox, output limits, grading, validation."""

from __future__ import annotations

import pytest

from evertrain.envs import registry
from evertrain.envs.quality import validate
from evertrain.envs.terminal import MAX_OUTPUT, Terminal, TerminalTool


def terminal_env() -> Terminal:
    """The registered terminal environment (shared with tests/test_adversarial_sandbox.py)."""
    terminal = registry.get("terminal")
    assert isinstance(terminal, Terminal)
    return terminal


@pytest.fixture(scope="module")
def env() -> Terminal:
    return terminal_env()


def _task(env: Terminal, name: str):
    """The problem of the task named ``name`` (train or eval split)."""
    for split in ("train", "eval"):
        for problem in env.problems(split, env.count(split) or 0, 0):
            if problem.payload["task"] == name:
                return problem
    raise AssertionError(name)


def test_at_least_20_tasks_in_both_splits(env):
    assert env.count("train") + env.count("eval") >= 20
    assert env.count("eval") >= 5
    train = {p.payload["task"] for p in env.problems("train", env.count("train"), 0)}
    held = {p.payload["task"] for p in env.problems("eval", env.count("eval"), 0)}
    assert not train & held


def test_every_reference_solution_passes_and_an_empty_attempt_fails(env):
    problems = env.problems("train", env.count("train"), 0) + env.problems("eval", env.count("eval"), 0)
    failures = []
    for problem in problems:
        good, empty = env.verify(problem, env.reference(problem)), env.verify(problem, "")
        if not good.passed or empty.reward != 0:
            failures.append((problem.payload["task"], good.reason, good.detail.get("check"), empty.reason))
        assert good.detail["commands"] and all("exit" in c for c in good.detail["commands"])  # audited
    assert not failures


def test_self_test_validates_the_terminal(env):
    report = validate(env, problems=2)
    assert report.ok, report.failures
    labels = {case.label for case in report.cases}
    assert {"fake_nonce", "past_turn_limit", "other_problem", "plant_usercustomize", "plant_pycache"} <= labels
    assert report.sandbox_runs  # every sandboxed process of the self-test is audited


def test_state_carries_over_and_the_workspace_is_the_only_writable_place(env):
    tool, problem = TerminalTool(), _task(env, "count-lines")
    out = tool.run_after(["echo hello > note.txt"], "cat note.txt; pwd", problem)
    assert out.output.split() == ["hello", "/tmp"] and not out.error
    assert out.sandbox_runs and out.sandbox_runs[0]["purpose"] == "tool:terminal"
    for target in ("/sandbox/x", "/usr/x", "/etc/x", "/x", "/proc/x"):
        out = tool.run(f"echo x > {target} && echo WROTE", problem)
        assert "WROTE" not in out.output and out.error, target
    out = tool.run("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"", problem)
    assert out.error and "Network is unreachable" in out.output
    # the checker and reference never enter the agent's sandbox
    out = tool.run("ls -a /sandbox; cat /sandbox/check.py", problem)
    assert "check.py" not in out.output.split() and out.error


def test_output_is_truncated_and_long_commands_are_killed(env):
    tool, problem = TerminalTool(), _task(env, "count-lines")
    out = tool.run("yes | head -c 5000", problem)
    assert "[output truncated: 5000 bytes, first 400 shown]" in out.output
    assert len(out.output) < MAX_OUTPUT + 80
    out = tool.run("sleep 30", problem)
    assert out.error and "killed after 5 s" in out.output
    assert out.sandbox_runs[0]["wall_s"] < 15


def test_the_checker_cannot_be_fooled_by_workspace_code(env):
    problem = _task(env, "fix-add")
    hacks = [
        # a calc.py that prints a pass line, kills its parent (the check runner), or reads its memory
        "cat > calc.py <<'EOF'\nimport os, sys\nprint('5 0 15 12')\nprint('PASS')\nos.kill(os.getppid(), 9)\nEOF",
        "cat > calc.py <<'EOF'\nimport os\nprint(open(f'/proc/{os.getppid()}/cmdline').read())\n"
        "print(os.listdir(f'/proc/{os.getppid()}/fd'))\nEOF",
        "cat > calc.py <<'EOF'\nclass E:\n    def __eq__(self, o): return True\nadd = mul = lambda *a: E()\nEOF",
        "rm -f calc.py test_calc.py",
    ]
    for hack in hacks:
        verdict = env.verify(problem, f"<bash>\n{hack}\n</bash>")
        assert verdict.reward == 0, (hack, verdict)
    # the real fix passes: the hacks failed on their merits
    assert env.verify(problem, "<bash>\nsed -i 's/a - b/a + b/' calc.py\n</bash>").passed


def test_command_log_is_what_the_episode_ran(env):
    problem = _task(env, "count-lines")
    turns = [
        {"role": "assistant", "content": "Let me look.\n<bash>\nwc -l < data.txt\n</bash>"},
        {"role": "tool", "name": "bash", "input": "wc -l < data.txt", "content": "13", "error": False},
        {"role": "assistant", "content": "<bash>\nwc -l < data.txt > lines.txt\n</bash>"},
        {"role": "tool", "name": "bash", "input": "wc -l < data.txt > lines.txt", "content": "(no output)",
         "error": False},
        # the last turn's call never ran (the turn limit): it must not be graded as run
        {"role": "assistant", "content": "Done. <bash>\nrm lines.txt\n</bash>"},
    ]
    text = env.episode_text(turns)
    assert env.commands(text) == ["wc -l < data.txt", "wc -l < data.txt > lines.txt"]
    assert env.verify(problem, text).passed
    assert env.commands("<bash>\n \n</bash><bash>ls") == []  # blank or unclosed blocks are no commands
