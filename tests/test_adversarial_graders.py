"""Graders against the third attacker (issue 41): each attack earns exactly 0, its honest control beside it 1.

Classes: terminal checks that accepted the wrong thing (a folder, a symbolic or hard link, a rename or a
dangling link, one line where lines were asked); a graded terminal log that was not what ran; move lists
with illegal or sprayed moves; numbers read in part by wrapped scorers; vacuous weakening of a premise;
MBPP items whose hidden tests cannot tell a constant from a solution; constant answers; and the tolerance
class (a question's stated precision). Each test was seen failing on the code before its fix.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from evertrain.envs.base import Problem
from evertrain.envs.quality import bad_battery
from evertrain.envs.terminal import MAX_COMMAND_CHARS, Terminal
from evertrain.envs.terminal_levels import task_spec
from evertrain.envs.tools import _blocks, run_episode
from tests.test_terminal import _task, terminal_env

# -- 1. terminal checks that verify the type, content and layout asked for -----------------------------


def _generated(template: str, number: int = 7) -> tuple[Problem, dict]:
    env = terminal_env()
    name = f"gen:{template}:{number}"
    return env.generated_problems([name], "train")[0], task_spec(template, number)


def _names(spec: dict) -> list[str]:
    return sorted(spec["files"])


def _attacks() -> list[tuple[str, Problem, str, float]]:
    """(label, problem, command, expected reward): every attack, and the honest reference beside it."""
    cases: list[tuple[str, Problem, str, float]] = []
    touch, spec = _generated("touch")
    name = spec["solution"][0].split()[1]
    cases += [("touch: a folder", touch, f"mkdir {name}", 0.0),
              ("touch: a link to an empty file", touch, f"ln -s /dev/null {name}", 0.0),
              ("touch: honest", touch, f"touch {name}", 1.0)]
    copy, spec = _generated("copy")
    src, dst = spec["solution"][0].split()[1:]
    cases += [("copy: a symbolic link", copy, f"ln -s {src} {dst}", 0.0),
              ("copy: a hard link", copy, f"ln {src} {dst}", 0.0),
              ("copy: honest", copy, f"cp {src} {dst}", 1.0)]
    delete, spec = _generated("delete")
    gone = spec["solution"][0].split()[1]
    keep = next(n for n in _names(spec) if n != gone)
    cases += [("delete: a rename", delete, f"mv {gone} {gone}.bak", 0.0),
              ("delete: a dangling link", delete, f"rm {gone} && ln -s nowhere {gone}", 0.0),
              ("delete: the kept file replaced by a folder", delete, f"rm {gone} {keep} && mkdir {keep}", 0.0),
              ("delete: honest", delete, f"rm {gone}", 1.0)]
    mkdir, spec = _generated("mkdir")
    folder = spec["solution"][0].split()[1]
    cases += [("mkdir: a link to a folder", mkdir, f"ln -s . {folder}", 0.0),
              ("mkdir: honest", mkdir, f"mkdir {folder}", 1.0)]
    sort = _task(terminal_env(), "sort-unique")
    cases += [("one line where lines were asked", sort, "sort -u words.txt | tr '\\n' ' ' > sorted.txt", 0.0),
              ("lines: honest", sort, "sort -u words.txt > sorted.txt", 1.0)]
    return cases


def test_terminal_checks_verify_type_content_and_layout() -> None:
    """Before: `exists()` followed links and took folders, deletes were `not exists()`, lines were `.split()`:
    every attack here earned 1.0 on the generated level-0 tasks and the vendored ones."""
    env = terminal_env()
    cases = _attacks()
    with ThreadPoolExecutor(max_workers=2) as pool:
        verdicts = list(pool.map(lambda case: env.verify(case[1], f"<bash>\n{case[2]}\n</bash>"), cases))
    wrong = [(label, verdict.reward, verdict.detail.get("check")) for (label, _, _, expect), verdict
             in zip(cases, verdicts, strict=True) if verdict.reward != expect]
    assert not wrong


# -- 2. one episode, one graded log -------------------------------------------------------------------


def _turns_of(completion: str) -> list[str]:
    """A command log as the assistant turns of an episode: each <bash> block ends a turn (the sampler stops at
    its closing tag), the text after the last block is the final turn."""
    replies, position = [], 0
    for _, end, _, _, well_formed in _blocks(completion, ["bash"]):
        if well_formed:
            replies.append(completion[position:end])
            position = end
    return [*replies, completion[position:]]


def _episode(env: Terminal, problem: Problem, replies: list[str]) -> list[dict]:
    answers = iter(replies)
    return run_episode(env, problem, lambda: next(answers, "Done."))


def test_a_final_turn_cannot_put_a_command_into_the_graded_log() -> None:
    """Before: the log was rebuilt from the final turn's prose with tool blocks stripped, so a turn that ran no
    tool (it holds a final-answer marker) could still leave a `<BASH>` block in it for the grader to replay, and
    a command the tool refused (too long) was replayed by the grader and by the tool's own later calls."""
    env = terminal_env()
    problem, spec = _generated("touch")
    name = spec["solution"][0].split()[1]
    shaped = f"Done. #### <BAS<bash>x</bash>H>\ntouch {name}\n</BAS<bash>y</bash>H>"
    refused = f"touch {name} #" + "x" * MAX_COMMAND_CHARS
    for replies in (["<bash>\nls\n</bash>", shaped], [f"<bash>\n{refused}\n</bash>", "Done."]):
        turns = _episode(env, problem, replies)
        in_episode = env.verify(problem, env.episode_text(turns))
        stored = env.verify_transcript(problem, turns)
        assert (in_episode.reward, stored.reward) == (0.0, 0.0), (replies, in_episode.reason, stored.reason)
    # the honest control: the same touch, run
    turns = _episode(env, problem, [f"<bash>\ntouch {name}\n</bash>", "Done."])
    assert env.verify(problem, env.episode_text(turns)).passed and env.verify_transcript(problem, turns).passed


def test_the_in_episode_grade_and_the_stored_episode_grade_agree_on_every_self_test_case() -> None:
    """Every case of the terminal's self-test (known-good and the whole known-bad battery), run as an episode:
    the grade of its in-episode log and the grade of its stored turns are the same, and the expected one."""
    env = terminal_env()
    problem = env.generated_problems(["gen:copy:3"], "train")[0]
    other = env.generated_problems(["gen:grep:5"], "train")[0]
    cases = [("good", c, 1.0) for c in env.known_good(problem)]
    cases += [(label, c, 0.0) for label, c in bad_battery(env, problem, other)]

    def grade(case: tuple[str, str, float]) -> tuple[str, float, float, float]:
        label, completion, expect = case
        turns = _episode(env, problem, _turns_of(completion))
        return label, expect, env.verify(problem, env.episode_text(turns)).reward, \
            env.verify_transcript(problem, turns).reward

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(grade, cases))
    assert len(results) > 10
    assert [r for r in results if not r[1] == r[2] == r[3]] == []
