"""Graders against the third attacker (issue 41): each attack earns exactly 0, its honest control beside it 1.

Classes: terminal checks that accepted the wrong thing (a folder, a symbolic or hard link, a rename or a
dangling link, one line where lines were asked); a graded terminal log that was not what ran; move lists
with illegal or sprayed moves; numbers read in part by wrapped scorers; vacuous weakening of a premise;
MBPP items whose hidden tests cannot tell a constant from a solution; constant answers; and the tolerance
class (a question's stated precision). Each test was seen failing on the code before its fix.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from evertrain.envs.base import Problem
from evertrain.envs.quality import bad_battery
from evertrain.envs.terminal import MAX_COMMAND_CHARS, Terminal
from evertrain.envs.terminal_levels import task_spec
from evertrain.envs.tools import _blocks, _clean_input, run_episode
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
    # the log reads back exactly the commands the tool was given (what the rollout's parser made of a call),
    # whatever they look like: a fenced block inside a fence, indentation, a lone tag-like string
    calls = ["```\n```bash\nrm -f x\n```\n```", "  echo indented\n  ls", "printf '<b>'", "```\n```\nls\n```\n```"]
    given = [_clean_input(call) for call in calls]
    assert env.commands(env.log(given)) == given
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


# -- 3. move lists validated move by move ------------------------------------------------------------


def _rush_hour_solution(config: str, limit: int = 50_000) -> list[str] | None:
    """A shortest solution by breadth-first search over the board (test data for the honest control; its own
    small simulator of reasoning-gym's rules: cars lettered in sorted label order, the red car A to cell 16)."""
    from collections import deque

    cells: dict[str, list[int]] = {}
    for i, label in enumerate(config):
        cells.setdefault(label, []).append(i)
    walls = set(cells.pop("x", []))
    cells.pop("o", None)
    cars = [(cells[k][0], len(cells[k]), cells[k][1] - cells[k][0]) for k in sorted(cells)]

    def step(positions: list[int], index: int, direction: int) -> int | None:
        _, size, stride = cars[index]
        new = positions[index] + direction * stride
        body = [new + k * stride for k in range(size)]
        if any(c < 0 or c >= 36 or (stride == 1 and c // 6 != positions[index] // 6) for c in body):
            return None
        taken = walls | {positions[j] + k * cars[j][2] for j in range(len(cars)) if j != index
                         for k in range(cars[j][1])}
        return None if taken.intersection(body) else new

    start = tuple(position for position, _, _ in cars)
    seen: dict[tuple[int, ...], tuple[tuple[int, ...], str] | None] = {start: None}
    queue = deque([start])
    while queue and len(seen) < limit:
        state = queue.popleft()
        if state[0] == 16:
            moves = []
            while (back := seen[state]) is not None:
                state, move = back
                moves.append(move)
            return moves[::-1]
        for index in range(len(cars)):
            for direction in (1, -1):
                positions = list(state)
                for steps in range(1, 6):
                    moved = step(positions, index, direction)
                    if moved is None:
                        break
                    positions[index] = moved
                    if tuple(positions) not in seen:
                        seen[tuple(positions)] = (state, f"{chr(65 + index)}{'+' if direction > 0 else '-'}{steps}")
                        queue.append(tuple(positions))
    return None


def _sokoban_blocked(payload: dict, move: str) -> bool:
    """Whether the player's first move ``move`` is one the board refuses (reasoning-gym's own game)."""
    import numpy as np
    from reasoning_gym.games.contrib.sokoban.src.game import Game

    rows = [list(line) for line in payload["metadata"]["gamestr"].replace(" ", "").strip().split("\n")]
    game = Game(height=len(rows), width=len(rows[0]))
    game.load_puzzle_matrix(np.array(rows))
    return game.player.update(key=move) == 0


def test_move_lists_fail_on_an_illegal_move_or_a_spray() -> None:
    """Before: rush_hour and sokoban skipped the moves they could not make and never counted moves: a real
    solution behind impossible moves, or behind a long spray, earned 1.0."""
    from evertrain.envs.reasoning_gym import ReasoningGym

    sokoban = ReasoningGym("sokoban", eval_size=1)  # its generator is slow: a pool of one
    problem = sokoban.problems("eval", 1, 0)[0]
    oracle = problem.payload["answer"]
    blocked = next(move for move in "LRUD" if _sokoban_blocked(problem.payload, move))
    cases = [(sokoban, problem, "#### " + oracle, 1.0),
             (sokoban, problem, "#### " + blocked + oracle, 0.0),  # a move into a wall, skipped before
             (sokoban, problem, "#### X" + oracle, 0.0),  # a letter that is no move
             (sokoban, problem, "#### " + "LR" * (len(oracle) + 10) + oracle, 0.0)]  # a spray in front
    # a move into a wall, then the solution: the wall is found by trying each direction from the start
    rush = ReasoningGym("rush_hour", eval_size=20)
    # the held-out item with the fewest moves: its breadth-first search takes about a second
    item = min(rush.problems("eval", 20, 0), key=lambda p: p.payload["metadata"]["min_moves"])
    solution = _rush_hour_solution(item.payload["metadata"]["board_config"]) or []
    assert len(solution) == item.payload["metadata"]["min_moves"]
    cars = sorted({move[0] for move in solution})
    spray = " ".join(f"{car}+1 {car}-1" for car in cars) * 20
    cases += [(rush, item, "#### " + " ".join(solution), 1.0),
              (rush, item, "#### Z+1 " + " ".join(solution), 0.0),  # a car that does not exist
              (rush, item, "#### A-9 " + " ".join(solution), 0.0),  # past the edge
              (rush, item, "#### " + spray + " " + " ".join(solution), 0.0)]
    wrong = [(env.name, text[:60], v.reward, v.reason) for env, p, text, expect in cases
             if (v := env.verify(p, text)).reward != expect]
    assert not wrong


# -- 4. numbers read whole by the one reader; the tolerance class ------------------------------------


def test_wrapped_scorers_read_a_number_whole() -> None:
    """Before: gsm_symbolic's scorer skipped a sign or point and ignored a unit after the number, chain_sum's
    deleted a misplaced comma, and number_sorting's fix took half a unit of the oracle's last digit as the
    precision where the question states none ('98.04' for '98.0'): all of these earned 1.0."""
    from evertrain.envs.reasoning_gym import ReasoningGym

    gsm = ReasoningGym("gsm_symbolic")
    problem = next(p for p in gsm.problems("eval", 10, 0) if len(p.payload["answer"]) >= 2
                   and p.payload["answer"].isdigit())
    oracle = problem.payload["answer"]
    chain = ReasoningGym("chain_sum")
    item = next(p for p in chain.problems("eval", 20, 0) if len(p.payload["answer"]) >= 3
                and p.payload["answer"].isdigit())
    sorting = ReasoningGym("number_sorting", config={"min_decimals": 0, "max_decimals": 0})
    listed = sorting.problems("eval", 1, 0)[0]
    numbers = listed.payload["answer"]
    first = numbers.split("'")[1]  # written '98.0': the question states no precision, so 98.04 is not 98.0
    moved = numbers.replace(f"'{first}'", f"'{first}4'", 1)
    cases = [(gsm, problem, oracle, 1.0), (gsm, problem, f"-{oracle}", 0.0), (gsm, problem, f".{oracle}", 0.0),
             (gsm, problem, f"{oracle} apples", 0.0),
             (chain, item, item.payload["answer"], 1.0),
             (chain, item, item.payload["answer"][:-2] + "," + item.payload["answer"][-2:], 0.0),  # '46,19'

             (sorting, listed, numbers, 1.0), (sorting, listed, moved, 0.0)]
    # kakurasu's scorer kept only the characters 0 and 1 of a line: '-1' was a 1 (found by the quality check)
    kakurasu = ReasoningGym("kakurasu", eval_size=1)
    grid = kakurasu.problems("eval", 1, 0)[0]
    oracle_grid = grid.payload["answer"].replace("\n", "\\n")
    cases += [(kakurasu, grid, oracle_grid, 1.0), (kakurasu, grid, oracle_grid.replace("1", "-1", 1), 0.0)]
    wrong = [(env.name, answer, v.reward, v.reason) for env, p, answer, expect in cases
             if (v := env.verify(p, "#### " + answer)).reward != expect]
    assert not wrong


# -- 5. vacuous weakening of a premise (propositional logic) -----------------------------------------


def test_weakening_a_premise_is_as_trivial_as_restating_it() -> None:
    """Before: a premise weakened by a literal ('(P ∨ Q)' from P, the old reference itself) or a conjunct of a
    premise ('P' from '(Q ∧ P)') was a non-trivial conclusion and earned 1.0."""
    from evertrain.envs.reasoning_gym import ReasoningGym

    env = ReasoningGym("propositional_logic")
    problem = env.problems("eval", 1, 0)[0]
    meta = problem.payload["metadata"]
    weakened = [f"({premise} ∨ {v})" for premise in meta["premises"] for v in meta["variables"][:2]]
    weakened += [f"({v} → ({premise}))" for premise in meta["premises"][:2] for v in meta["variables"][:1]]
    verdicts = [env.verify(problem, "#### " + text) for text in weakened]
    assert [v.reward for v in verdicts] == [0.0] * len(weakened), [v.reason for v in verdicts]
    assert env.verify(problem, env.reference(problem) or "").reward == 1.0


# -- 6. MBPP: hidden tests that cannot tell a constant from a solution -------------------------------


def test_mbpp_items_a_constant_passes_are_left_out() -> None:
    """Before: items whose three tests all expect the visible test's value were in the pools, and a function
    returning that value earned 1.0 on them. They are left out now; on a kept item the same attack earns 0."""
    import json
    from pathlib import Path

    from evertrain.envs import registry
    from evertrain.envs.code import MBPP, constant_answer, grade_code, visible_constant

    mbpp = registry.get("mbpp")
    assert isinstance(mbpp, MBPP)
    dropped = MBPP.constant_ids()
    pools = {p.payload["task_id"] for split in ("train", "eval") for p in mbpp.problems(split, 10_000, 0)}
    assert dropped and not set(dropped) & pools
    rows = {r["task_id"]: r for r in map(json.loads, Path("data/mbpp/mbpp.jsonl").read_text().splitlines())}
    hacked = rows[dropped[0]]
    payload = {"tests": hacked["test_list"], "entry_point": "", "test_setup": hacked["test_setup_code"]}
    from evertrain.envs.code import mbpp_entry_point

    payload["entry_point"] = mbpp_entry_point(hacked["code"], hacked["test_list"][0])
    assert constant_answer(hacked["test_list"]) is not None
    assert grade_code(payload, visible_constant(payload) or "")[0].reward == 1.0  # it was hackable
    kept = mbpp.problems("eval", 1, 0)[0]
    assert mbpp.verify(kept, visible_constant(kept.payload) or "").reward == 0.0
    assert mbpp.verify(kept, mbpp.reference(kept) or "").reward == 1.0
    docs = Path("docs/concepts/threat-model.md").read_text()
    assert f"{len(dropped)} MBPP items" in docs and all(str(i) in docs for i in dropped)


# -- 7. constant answers that need no solving ---------------------------------------------------------


def test_constant_answers_earn_nothing_strict_or_partial() -> None:
    """Before: game_of_life items whose next board is empty were in the pools (an all-zero grid earned 1.0 on
    them unsolved), and under reward = "score" an all-zero grid earned 0.92-0.99 on every other item."""
    import re

    import reasoning_gym

    from evertrain.envs.reasoning_gym import ReasoningGym, encode_answer

    def zero(oracle: str) -> str:
        return re.sub(r"[0-9]+", "0", oracle)

    raw = reasoning_gym.create_dataset("game_of_life", seed=20_260_611, size=30)
    assert any(zero(raw[i]["answer"]) == raw[i]["answer"] for i in range(30))  # such items exist ...
    env = ReasoningGym("game_of_life", reward="score", eval_size=30)
    pool = env.problems("eval", 30, 0)
    assert pool and not any(zero(p.payload["answer"]) == p.payload["answer"] for p in pool)  # ... and are left out
    problem = pool[0]
    verdict = env.verify(problem, "#### " + encode_answer("game_of_life", zero(problem.payload["answer"])))
    assert verdict.detail["rg_score"] > 0.5 and verdict.reward == 0.0  # the scorer's partial credit, taken back
    assert env.verify(problem, env.reference(problem) or "").reward == 1.0


# -- the environment quality check --------------------------------------------------------------------


def test_the_quality_check_flags_what_a_lenient_grader_pays_and_passes_the_fixed_ones() -> None:
    """The probes on a grader that compares magnitudes only (a sign skipped): the sign probe passes every item
    and flags the kind, and drop_flagged empties the training pool; the fixed graders pass no probe."""
    from evertrain.envs import registry
    from evertrain.envs.answers import MathEnvironment, extract_final_answer, parse_number
    from evertrain.envs.base import Verdict
    from evertrain.envs.quality import drop_flagged, probe

    class Lenient(MathEnvironment):
        name, source = "lenient", "test"

        def problems(self, split, n, seed):  # type: ignore[override]
            return [Problem.make(self.name, f"What is {i} * 7?", {"answer": str(i * 7)}, split)
                    for i in range(1, n + 1)]

        def verify(self, problem, completion):  # type: ignore[override]
            answer, _ = extract_final_answer(completion)
            value = parse_number(answer or "")
            ok = value is not None and abs(value) == abs(parse_number(problem.payload["answer"]) or 0)
            return Verdict.ok() if ok else Verdict.fail("wrong_answer")

    lenient = Lenient()
    problems = lenient.problems("train", 8, 0)
    report = probe(lenient, problems)
    assert report.probes["sign_changed"].share == 1.0 and report.kind_flagged
    assert report.probes["digit_changed"].passed == 0 and drop_flagged(lenient, problems, report) == []
    honest = registry.get("arithmetic")
    fixed = probe(honest, honest.problems("train", 8, 0))
    assert not fixed.kind_flagged and fixed.probes["sign_changed"].passed == 0
    mbpp = registry.get("mbpp")
    assert probe(mbpp, mbpp.problems("eval", 3, 0)).probes["visible_value"].passed == 0
    terminal = terminal_env()
    tasks = terminal.generated_problems(["gen:copy:3", "gen:delete:4", "gen:grep:5"], "train")
    report = probe(terminal, tasks)
    assert {"symlinked", "wrong_type", "one_line", "dangling_link", "renamed"} <= set(report.probes)
    assert report.flagged_items() == {}
