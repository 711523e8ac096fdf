"""``rg:<generator>``: every reasoning-gym generator (``reasoning-gym==0.1.25``) as an environment.

Problems are reasoning-gym items ``{"question", "answer", "metadata"}``, generated from seeds; each is
graded by its own generator's ``score_answer``, run inside the sandbox, because several scorers ``eval``
the answer (``binary_matrix``, ``n_queens``, ``spiral_matrix``, ``string_insertion``) or hand it to
sympy's parser, which evals too.

Splits. The eval split is the first ``eval_size`` items (option, default 100) of the generator's dataset
built with the fixed seed :data:`EVAL_SEED`: the same held-out problems in every process and
iteration, whatever the campaign seed. Train problems come from a dataset seeded from the caller's
seed (:func:`train_seed`, never :data:`EVAL_SEED`); reasoning-gym draws item ``i`` of seed ``s`` from
``Random(s + i)``, so seeds near each other share items: every train candidate whose id is in the
eval pool is dropped, as is a repeat within one call. A problem's id is the content hash of its
question and answer only (:func:`rg_problem_id`), so the same item drawn from two seeds, or from two
indices, has one id (the ``source_index`` in its metadata does not count).

Reward (option ``reward``). ``"strict"`` (the default): 1.0 exactly when the generator's scorer returns
1.0 (its full-credit value), else 0. ``"score"``: reasoning-gym's own float in [0, 1], partial credit
included (many scorers give 0.01-0.1 for a well-formed wrong answer, or a share of the cells right).
``verdict.passed`` is true only at 1.0 in both modes, so pass@1 means the same thing.

The final answer is taken with the project's strict rule (:func:`evertrain.envs.answers.extract_final_answer`:
one ``#### <answer>`` or ``\\boxed{<answer>}`` on the last non-empty line). That rule allows no line
break in an answer, so for the generators whose answers span lines (:data:`MULTILINE_GENERATORS`:
grids, boards, move lists) the answer writes each line break as the two characters ``\\n``, which are
turned back into line breaks before the scorer sees the answer; the prompt says so.

Corrections to reasoning-gym's scorers (found by the verifier self-test, :mod:`evertrain.envs.quality`),
each documented where it is defined: hedged answers ("<answer> or 7", "<answer>, 7"), which several
lenient scorers credit, earn 0 (:func:`hedged`); non-finite, over-long and over-precise answers are
refused in bounded time before any scorer (:func:`precheck`); symbolic answers must be plain
expressions and are reduced to plain data where no oracle is (:data:`SYMBOLIC`); puzzles must use their
own numbers and are evaluated exactly here (:data:`INPUT_CHECKS`, :func:`arithmetic_value`); items whose
oracle is itself unevaluated are left out (:data:`_ITEM_FILTERS`); and the few scorers that credit what
they should not get a check after them (:data:`SCORER_FIXES`). Generators whose reference completion
cannot be built are listed in :data:`RG_REFERENCE_EXCEPTIONS`.

Nothing of an answer is evaluated in a process that holds the oracle: the scorer process's ``eval`` is
literal-only (an answer is data or it is nothing; strings of the item itself keep the real ``eval``), and
the sympy-based scorers get the answer as a plain-data tree from a first sandbox that never saw the item
(``mode: reduce``), rebuilt from an allowlist of constructors in the second.

Scoring in the sandbox (:func:`score_in_sandbox`). One sandboxed Python process per grade runs
:data:`SCORER_SOURCE` (the program :mod:`evertrain.sandbox.rg_scorer`) with a JSON request on stdin: a
fresh random nonce, the generator's module, the config, the answer and the item. It imports only that
generator's module (not the ``reasoning_gym`` package, whose ``__init__`` imports all 106 generators and
costs about a second), builds the dataset, and calls ``score_answer``. Before it does, the scorer
process

- moves its stdout to /dev/null and keeps the real one on a private descriptor, so nothing the scorer
  or the answer prints reaches the channel the grade is read from;
- installs an audit hook (PEP 578, cannot be removed) that refuses any code compiled from a string
  (``eval``/``exec`` of the answer, directly or through sympy) naming a private or dunder name or an
  escape primitive (``open``, ``getattr``, ``exec``, ``print``, ``os``, ``sys``, ``gc``, ``format`` ...) or
  holding a brace in a string constant (``str.format`` fields walk attributes by name), and
  refuses process, signal, tracing, ``gc`` and ``/proc`` events; a refused answer earns 0
  (``answer_blocked``) even if the scorer swallowed the error;

then reports one line ``<nonce> score <float>`` (or ``<nonce> error <code>``) and exits with
``os._exit(0)``. The parent accepts exactly one nonce line from a process that exited 0 within its
limits. An answer cannot print a line the parent believes: it would need the nonce, which exists
only in the trusted part of that one process and which the hook keeps out of reach of evaluated
code. (In-process Python is not a security boundary: the sandbox is. An answer that escaped the
hook could at most forge the grade of its own completion; it still could not leave the sandbox.)

Importing ``reasoning_gym`` inside the sandbox needs the virtualenv's site-packages, which the sandbox
hides by default: scorer jobs alone get them bound read-only (``ro_binds``).

Cost of one grade (2-core machine, wall clock): a bare sandboxed ``pass`` takes about 35 ms; a grade
about 45-130 ms for most generators (importing one generator module, not the package), 0.3-0.4 s for
the sympy-based ones (sympy's import) and about 0.4 s for arc_agi (its dataset loads the ARC tasks).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, localcontext
from fractions import Fraction
from functools import cache, cached_property
from importlib import metadata as importlib_metadata
from importlib import util as importlib_util
from pathlib import Path
from typing import Any, ClassVar, Literal

from evertrain.envs.answers import (
    MAX_DIGITS,
    canonical_number,
    extract_final_answer,
    normalize_numeric_text,
    number_hazard,
    parse_number,
)
from evertrain.envs.base import Environment, Problem, Split, Verdict, problem_id
from evertrain.sandbox import Limits, SandboxRunRecord, run_python

RG_VERSION = "0.1.25"
EVAL_SEED = 20_260_611  # the held-out pool's dataset seed; train seeds never equal it
DEFAULT_EVAL_SIZE = 100
SCORER_PURPOSE = "rg-scorer"  # the sandbox_runs audit rows' purpose
# sympy, numpy and matplotlib imports need room; no scorer needs more than a few seconds of CPU
SCORER_LIMITS = Limits(timeout_s=30.0, cpu_s=10, memory_mb=1024, nproc=16)

Reward = Literal["strict", "score"]

# generator -> module under reasoning_gym that defines and registers it (reasoning-gym 0.1.25; checked
# against reasoning_gym.factory.DATASETS by tests/test_reasoning_gym.py). Knowing it without importing
# reasoning_gym keeps generator_names() and grading cheap, and tells the scorer the one module to load.
RG_MODULES: dict[str, str] = {
    "ab": "algorithmic.ab",
    "acre": "induction.acre.acre",
    "advanced_geometry": "geometry.advanced_geometry",
    "aiw": "logic.aiw",
    "arc_1d": "arc.arc_1d",
    "arc_agi": "arc.arc_agi",
    "base_conversion": "algorithmic.base_conversion",
    "basic_arithmetic": "arithmetic.basic_arithmetic",
    "bf": "code.bf",
    "binary_alternation": "algorithmic.binary_alternation",
    "binary_matrix": "algorithmic.binary_matrix",
    "bitwise_arithmetic": "arithmetic.bitwise_arithmetic",
    "boxnet": "games.boxnet",
    "caesar_cipher": "algorithmic.caesar_cipher",
    "calendar_arithmetic": "arithmetic.calendar_arithmetic",
    "chain_sum": "arithmetic.chain_sum",
    "circuit_logic": "logic.circuit_logic",
    "codeio": "code.codeio",
    "coin_flip": "probability.coin_flip",
    "color_cube_rotation": "cognition.color_cube_rotation",
    "complex_arithmetic": "algebra.complex_arithmetic",
    "composite": "composite",
    "count_bits": "arithmetic.count_bits",
    "count_primes": "algorithmic.count_primes",
    "countdown": "games.countdown",
    "course_schedule": "graphs.course_schedule",
    "cryptarithm": "algorithmic.cryptarithm",
    "decimal_arithmetic": "arithmetic.decimal_arithmetic",
    "decimal_chain_sum": "arithmetic.decimal_chain_sum",
    "dice": "arithmetic.dice",
    "emoji_mystery": "games.emoji_mystery",
    "family_relationships": "graphs.family_relationships",
    "figlet_font": "cognition.figlet_fonts",
    "fraction_simplification": "arithmetic.fraction_simplification",
    "futoshiki": "games.futoshiki",
    "game_of_life": "algorithmic.game_of_life",
    "game_of_life_halting": "algorithmic.game_of_life_halting",
    "gcd": "arithmetic.gcd",
    "graph_color": "algorithmic.graph_color",
    "group_anagrams": "algorithmic.group_anagrams",
    "gsm_symbolic": "arithmetic.gsm_symbolic.gsm_symbolic",
    "intermediate_integration": "algebra.intermediate_integration",
    "isomorphic_strings": "algorithmic.isomorphic_strings",
    "jugs": "algorithmic.jugs",
    "kakurasu": "games.kakurasu",
    "knight_swap": "games.knight_swap",
    "knights_knaves": "logic.knights_knaves",
    "largest_island": "graphs.largest_island",
    "lcm": "arithmetic.lcm",
    "leg_counting": "arithmetic.leg_counting",
    "letter_counting": "algorithmic.letter_counting",
    "letter_jumble": "algorithmic.letter_jumble",
    "list_functions": "induction.list_functions.list_functions",
    "mahjong_puzzle": "games.mahjong",
    "manipulate_matrix": "algorithmic.manipulate_matrix",
    "maze": "games.maze",
    "mini_sudoku": "games.mini_sudoku",
    "modulo_grid": "cognition.modulo_grid",
    "n_queens": "games.n_queens",
    "needle_haystack": "cognition.needle_haystack",
    "number_filtering": "algorithmic.number_filtering",
    "number_format": "arithmetic.number_format",
    "number_sequence": "cognition.number_sequences",
    "number_sorting": "algorithmic.number_sorting",
    "palindrome_generation": "algorithmic.palindrome_generation",
    "palindrome_partitioning": "algorithmic.palindrome_partitioning",
    "path_star": "graphs.path_star",
    "polynomial_equations": "algebra.polynomial_equations",
    "polynomial_multiplication": "algebra.polynomial_multiplication",
    "pool_matrix": "algorithmic.pool_matrix",
    "power_function": "arithmetic.power_function",
    "prime_factorization": "arithmetic.prime_factorization",
    "products": "arithmetic.products",
    "propositional_logic": "logic.propositional_logic",
    "puzzle24": "games.puzzle24",
    "quantum_lock": "graphs.quantum_lock",
    "ransom_note": "algorithmic.ransom_note",
    "rearc": "arc.rearc",
    "rectangle_count": "cognition.rectangle_count",
    "rotate_matrix": "algorithmic.rotate_matrix",
    "rotten_oranges": "algorithmic.rotten_oranges",
    "rubiks_cube": "cognition.rubiks_cube",
    "rush_hour": "games.rush_hour",
    "self_reference": "logic.self_reference",
    "sentence_reordering": "algorithmic.sentence_reordering",
    "shortest_path": "graphs.shortest_path",
    "simple_equations": "algebra.simple_equations",
    "simple_geometry": "geometry.simple_geometry",
    "simple_integration": "algebra.simple_integration",
    "sokoban": "games.sokoban",
    "spell_backward": "algorithmic.spell_backward",
    "spiral_matrix": "algorithmic.spiral_matrix",
    "string_insertion": "algorithmic.string_insertion",
    "string_manipulation": "algorithmic.string_manipulation",
    "string_splitting": "algorithmic.string_splitting",
    "string_synthesis": "algorithmic.string_synthesis",
    "sudoku": "games.sudoku",
    "survo": "games.survo",
    "syllogism": "logic.syllogisms",
    "time_intervals": "arithmetic.time_intervals",
    "tower_of_hanoi": "games.tower_of_hanoi",
    "tsumego": "games.tsumego",
    "word_ladder": "algorithmic.word_ladder",
    "word_sequence_reversal": "algorithmic.word_sequence_reversal",
    "word_sorting": "algorithmic.word_sorting",
    "zebra_puzzles": "logic.zebra_puzzles",
}

# Generators whose answers span lines (found by generating 300 items of each; tests check the
# reference of every generator): their final answer writes line breaks as the two characters "\n".
MULTILINE_GENERATORS: frozenset[str] = frozenset({
    "arc_agi", "binary_matrix", "futoshiki", "kakurasu", "manipulate_matrix", "mini_sudoku", "modulo_grid",
    "n_queens", "pool_matrix", "rearc", "rotate_matrix", "sudoku", "survo", "tower_of_hanoi",
})

# Metadata the scorer compares as tuples of tuples; JSON turns them into lists, the scorer gets them back.
TUPLE_METADATA: dict[str, tuple[str, ...]] = {"arc_agi": ("input", "output"), "rearc": ("input", "output")}

# Modules that generator modules import but no scorer uses: the scorer loads them only if touched
# (cellpylib pulls in matplotlib: about 0.5 s of every game_of_life grade otherwise).
LAZY_MODULES: tuple[str, ...] = ("cellpylib",)

# Generators whose items have no oracle answer (``answer`` is None) but carry one valid solution in
# their metadata, which the reference completion uses.
_METADATA_SOLUTION: dict[str, str] = {
    "graph_color": "possible_answer", "propositional_logic": "example_answer", "rubiks_cube": "example_correct_answer",
}

# Generators whose reference completion cannot be built, and why (reference() returns None for them).
RG_REFERENCE_EXCEPTIONS: dict[str, str] = {
    "boxnet": "no oracle answer: the item's answer is None and the scorer simulates the plan of moves the answer "
              "gives; the metadata holds only the initial state, and no planner ships with reasoning-gym",
    "rush_hour": "no oracle answer: the item's answer is None and the scorer simulates the moves; the metadata "
                 "holds only the board and the minimum number of moves, not a solution",
}

# Scorers of reasoning-gym 0.1.25 that give credit they should not, and the check added after them
# (the rg score stands only if the check passes; found by grading wrong answers of every generator).
SCORER_FIXES: dict[str, str] = {
    "game_of_life_halting": "rg's scorer returns 1.0 when bool(answer) == bool(oracle); both are non-empty strings, "
                            "so every answer scored 1.0. The answer must also be the oracle 'True'/'False' "
                            "(case and surrounding space ignored)",
}
_FIX_CHECKS: dict[str, Callable[[str, dict[str, Any]], bool]] = {
    "game_of_life_halting": lambda answer, entry: answer.strip().lower() == str(entry["answer"]).strip().lower(),
}


def _exact_number(answer: str, entry: dict[str, Any]) -> bool:
    """The answer is the oracle's number exactly (decimals and fractions compared as fractions)."""
    # the one number reader on the whole answer: '2,45' is no number (deleting its comma made it 245)
    value, oracle = parse_number(answer), parse_number(str(entry["answer"]))
    return value is not None and value == oracle


_LOGIC_OPERATORS = {"↔": 0, "→": 1, "∨": 2, "∧": 3}  # precedence, lowest first, as reasoning-gym parses
MAX_LOGIC_CHARS = 2000
MAX_LOGIC_DEPTH = 100
MAX_LOGIC_VARIABLES = 12  # truth tables of 4096 rows at most, as bit masks


def logic_truth_table(text: str, variables: list[str]) -> int | None:
    """The truth table of a propositional formula (``¬ ∧ ∨ → ↔``, parentheses, the given one-letter
    variables) as a bit mask over all assignments, or None when it is not such a formula.

    Parsed like reasoning-gym's ``parse_expr`` (``↔`` binds loosest, then ``→``, ``∨``, ``∧``; equal
    operators group to the left) by a bounded, linear recursive descent; nothing is evaluated.
    """
    if len(text) > MAX_LOGIC_CHARS or not 0 < len(variables) <= MAX_LOGIC_VARIABLES:
        return None
    rows = 1 << len(variables)
    full = (1 << rows) - 1
    masks = {name: sum(1 << row for row in range(rows) if row >> i & 1) for i, name in enumerate(variables)}
    tokens = [c for c in text if not c.isspace()]
    position = 0

    def combine(op: str, left: int, right: int) -> int:
        if op == "∧":
            return left & right
        if op == "∨":
            return left | right
        if op == "→":
            return (full ^ left) | right
        return full ^ (left ^ right)

    def binary(level: int, depth: int) -> int:
        nonlocal position
        if depth > MAX_LOGIC_DEPTH:
            raise ValueError("too deep")
        if level == len(_LOGIC_OPERATORS):
            return unary(depth)
        value = binary(level + 1, depth + 1)
        while position < len(tokens) and _LOGIC_OPERATORS.get(tokens[position]) == level:
            op = tokens[position]
            position += 1
            value = combine(op, value, binary(level + 1, depth + 1))
        return value

    def unary(depth: int) -> int:
        nonlocal position
        if position >= len(tokens):
            raise ValueError("truncated")
        token = tokens[position]
        position += 1
        if token == "¬":
            if depth > MAX_LOGIC_DEPTH:
                raise ValueError("too deep")
            return full ^ unary(depth + 1)
        if token == "(":
            value = binary(0, depth + 1)
            if position >= len(tokens) or tokens[position] != ")":
                raise ValueError("unbalanced")
            position += 1
            return value
        if token in masks:
            return masks[token]
        raise ValueError(f"unexpected {token!r}")

    try:
        value = binary(0, 0)
    except ValueError:
        return None
    return value if position == len(tokens) else None


def _logic_tables(entry: dict[str, Any]) -> tuple[list[str], list[int]] | None:
    meta = entry.get("metadata") or {}
    variables, premises = meta.get("variables"), meta.get("premises")
    if not isinstance(variables, list) or not isinstance(premises, list) or not premises:
        return None
    variables = [v for v in variables if isinstance(v, str) and len(v) == 1]
    tables = [logic_truth_table(str(p), variables) for p in premises]
    return (variables, tables) if all(t is not None for t in tables) else None  # type: ignore[return-value]


def premises_consistent(entry: dict[str, Any]) -> bool:
    """Some assignment makes every premise true: from contradictory premises anything follows."""
    found = _logic_tables(entry)
    if found is None:
        return False
    conjunction = -1
    for table in found[1]:
        conjunction &= table
    return conjunction != 0


def _premise_conjunctions(tables: list[int]) -> set[int]:
    """The truth tables of every conjunction of a non-empty set of the premises (each premise included)."""
    found: set[int] = set()
    for table in dict.fromkeys(tables):
        found |= {table & other for other in found} | {table}
    return found


def _forall(table: int, bit: int, rows: int) -> int:
    """The truth table of ``∀v. C`` for the variable on ``bit`` of the row index: C holds whatever v is."""
    found = 0
    for row in range(rows):
        low, high = row & ~(1 << bit), row | (1 << bit)
        if table >> low & 1 and table >> high & 1:
            found |= 1 << row
    return found


def vacuous_weakening(table: int, tables: list[int], variables: list[str]) -> bool:
    """Whether a conclusion (truth table ``table``) is trivially entailed: a tautology; a weakening of one
    premise (entailed by it alone: 'P' from '(Q ∧ P)', '(P ∨ x)' from 'P'); or a weakening, by some variable v
    it depends on, of what the premises settle without v (they entail ``∀v. C``: '(A ∧ B) ∨ x' from the
    premises A and B). A conclusion that needs two premises and every variable it mentions ('Q' from P and
    P → Q) is not one."""
    rows = 1 << len(variables)
    full = (1 << rows) - 1
    if table == full or any(premise & ~table == 0 for premise in tables):  # a tautology, or one premise says it
        return True
    premises = full
    for premise in tables:
        premises &= premise
    for bit in range(len(variables)):
        forall = _forall(table, bit, rows)
        if forall != table and premises & ~forall == 0:
            return True
    return False


def _not_a_premise(answer: str, entry: dict[str, Any]) -> bool:
    """A conclusion that says something the premises do not already say as they stand: not equivalent
    (same truth table) to any premise or any conjunction of premises, and no vacuous weakening of what
    they say (:func:`vacuous_weakening`), from consistent premises."""
    premises = entry.get("metadata", {}).get("premises") or []
    squeeze = "".join
    if squeeze(answer.split()) in {squeeze(str(p).split()) for p in premises}:
        return False
    found = _logic_tables(entry)
    if found is None or not premises_consistent(entry):
        return False
    table = logic_truth_table(answer, found[0])
    return (table is not None and table not in _premise_conjunctions(found[1])
            and not vacuous_weakening(table, found[1], found[0]))


def logic_restatements(entry: dict[str, Any]) -> list[str]:
    """Premises trivially transformed (double negation, doubled or extra parentheses, reordered or
    repeated conjuncts) or weakened by a literal ('(P ∨ x)'): the self-test's known-bad conclusions."""
    meta = entry.get("metadata") or {}
    premises = [str(p) for p in meta.get("premises") or []]
    if not premises:
        return []
    found = []
    variables = [v for v in meta.get("variables") or [] if isinstance(v, str)]
    for premise in dict.fromkeys(premises):
        found += [f"¬¬{premise}", f"(({premise}))", f"({premise} ∧ {premise})", f"¬(¬{premise})"]
        found += [f"({premise} ∨ {v})" for v in variables[:2]]
    found.append(" ∧ ".join(f"({p})" for p in reversed(premises)))
    return found


def logic_reference(entry: dict[str, Any]) -> str | None:
    """A conclusion the grade accepts: the item's example answer, unless it only restates or weakens premises
    (it often does: '(Q ∧ Q)' from the premise Q); else the first negated variable, or two literals joined by
    ∨, ∧ or →, that the premises entail and that is neither a restatement nor a vacuous weakening. None: the item
    has no non-trivial conclusion this check can tell from a trivial one (it is left out of both splits)."""
    meta = entry.get("metadata") or {}
    example = meta.get("example_answer")
    found = _logic_tables(entry)
    if found is None or not premises_consistent(entry):
        return None
    variables, tables = found
    premises = (1 << (1 << len(variables))) - 1
    for table in tables:
        premises &= table

    def accepted(candidate: str) -> bool:
        table = logic_truth_table(candidate, variables)
        return table is not None and premises & ~table == 0 and _not_a_premise(candidate, entry)

    if isinstance(example, str) and accepted(example):
        return example
    literals = [literal for v in variables for literal in (v, f"¬{v}")]
    # rg's scorer calls a bare variable trivial (0.25): a negated one, or two literals joined, is a formula
    candidates = [f"¬{v}" for v in variables]
    candidates += [f"({a} {op} {b})" for i, a in enumerate(literals) for b in literals[i + 1:]
                   for op in ("∨", "∧", "→") if a.lstrip("¬") != b.lstrip("¬")]
    return next((candidate for candidate in candidates if accepted(candidate)), None)


SCORER_FIXES["propositional_logic"] = (
    "rg's scorer credits any non-trivial conclusion the premises entail, so a premise copied from the "
    "question ('(Q → P)') scored 1.0, and so did the same premise transformed ('¬¬(Q → P)', '(P ∧ Q)' for "
    "'(Q ∧ P)'). A conclusion equivalent (same truth table) to a premise or to a conjunction of premises "
    "now earns 0, and items whose premises contradict each other are left out of the pool")
_FIX_CHECKS["propositional_logic"] = _not_a_premise

SCORER_FIXES["coin_flip"] = (
    "rg's partial credit compares the printed digits as prefixes and divides by the shorter length, so '0' "
    "matched any oracle starting with 0 ('0.0009765625') for 1.0. Full credit now needs the oracle's number "
    "exactly (as a fraction)")
_FIX_CHECKS["coin_flip"] = _exact_number

# Move lists. rush_hour's and sokoban's scorers simulate the answer's moves but skip what they cannot do
# (a move into a wall, a car that does not exist, a letter that is no move) and never count the moves, so a
# spray of thousands of moves, or impossible moves in front of a real solution, was paid. The answer is now
# validated move by move: every move must be one the board allows where it is made, and the list at most
# MOVE_SLACK times the shortest (rush_hour: the item's min_moves) or the oracle's length (sokoban), plus
# MOVE_EXTRA moves.
MOVE_SLACK = 2
MOVE_EXTRA = 10
_RUSH_SIZE = 6
_RUSH_TARGET = 2 * _RUSH_SIZE + _RUSH_SIZE - 2  # the red car's leftmost cell at the exit
_RUSH_MOVE = re.compile(r"([A-Z])([+-])([0-9]{1,2})")


def rush_hour_pieces(config: str) -> tuple[list[tuple[int, int, int]], set[int]]:
    """The cars of a rush_hour board (position, size, stride), lettered A, B ... in the order reasoning-gym
    letters them (sorted labels), and the walls' cells."""
    cells: dict[str, list[int]] = {}
    walls: set[int] = set()
    for i, label in enumerate(config):
        if label == "x":
            walls.add(i)
        elif label != "o":
            cells.setdefault(label, []).append(i)
    return [(cells[k][0], len(cells[k]), cells[k][1] - cells[k][0]) for k in sorted(cells)], walls


def rush_hour_step(pieces: list[tuple[int, int, int]], positions: list[int], walls: set[int], index: int,
                   direction: int) -> int | None:
    """Car ``index``'s position after one step in ``direction`` (+1 right/down, -1 left/up), or None when the
    board does not allow it (the edge, a wall, another car)."""
    _, size, stride = pieces[index]
    new = positions[index] + direction * stride
    cells = [new + k * stride for k in range(size)]
    row = positions[index] // _RUSH_SIZE
    if any(c < 0 or c >= _RUSH_SIZE ** 2 or (stride == 1 and c // _RUSH_SIZE != row) for c in cells):
        return None
    occupied = set(walls)
    for j, (_, other_size, other_stride) in enumerate(pieces):
        if j != index:
            occupied.update(positions[j] + k * other_stride for k in range(other_size))
    return None if occupied.intersection(cells) else new


def rush_hour_legal(answer: str, entry: dict[str, Any]) -> bool:
    """Every move of ``answer`` ('F+1 K+1 M-1 ...', nothing else) is allowed where it is made, there are at most
    MOVE_SLACK * min_moves + MOVE_EXTRA of them, and the red car (A) ends at the exit."""
    meta = entry.get("metadata") or {}
    tokens = answer.split()
    if not tokens or len(tokens) > MOVE_SLACK * int(meta.get("min_moves", 0)) + MOVE_EXTRA:
        return False
    pieces, walls = rush_hour_pieces(str(meta.get("board_config", "")))
    positions = [position for position, _, _ in pieces]
    for token in tokens:
        move = _RUSH_MOVE.fullmatch(token)
        if move is None or ord(move[1]) - ord("A") >= len(pieces) or int(move[3]) == 0:
            return False
        index, direction = ord(move[1]) - ord("A"), 1 if move[2] == "+" else -1
        for _ in range(int(move[3])):
            step = rush_hour_step(pieces, positions, walls, index, direction)
            if step is None:
                return False
            positions[index] = step
    return bool(pieces) and positions[0] == _RUSH_TARGET


def sokoban_legal(answer: str, entry: dict[str, Any]) -> bool:
    """Every move of ``answer`` (L, R, U, D; blanks between them allowed) is one the player can make where it
    is made (not into a wall, not a box that cannot move), at most MOVE_SLACK times the oracle's length plus
    MOVE_EXTRA, and the boxes end on the goals; simulated with reasoning-gym's own game (plain data only)."""
    # late: with reasoning_gym's sokoban, for this one generator's check
    # late: reasoning_gym (~1 s: every generator registers on import); listing names and config validation do without it
    import numpy as np
    from reasoning_gym.games.contrib.sokoban.src.game import Game
    from reasoning_gym.games.contrib.sokoban.src.utils import is_solved

    moves = "".join(answer.split())
    oracle = str(entry.get("answer") or "")
    if not moves or set(moves) - set("LRUD") or len(moves) > MOVE_SLACK * len(oracle) + MOVE_EXTRA:
        return False
    rows = [list(line) for line in str(entry["metadata"]["gamestr"]).replace(" ", "").strip().split("\n")]
    matrix = np.array(rows)
    game = Game(height=matrix.shape[0], width=matrix.shape[1])
    game.load_puzzle_matrix(matrix)
    return all(game.player.update(key=move) == 1 for move in moves) and is_solved(game.get_curr_state())


for _name, _check in (("rush_hour", rush_hour_legal), ("sokoban", sokoban_legal)):
    SCORER_FIXES[_name] = ("rg's scorer skips the moves it cannot make and never counts them, so a spray of "
                           "moves, or impossible moves before a real solution, scored 1.0. Every move must now "
                           f"be legal where it is made, and the list at most {MOVE_SLACK} times the shortest "
                           f"(or the oracle's) length plus {MOVE_EXTRA}")
    _FIX_CHECKS[_name] = _check


SCORER_FIXES["kakurasu"] = (
    "rg's scorer keeps only the characters 0 and 1 of each line and drops the rest, so '-1' was read as 1 and any "
    "junk between the cells was ignored (found by the quality check's sign probe: 4 of 4 items). The answer must "
    "now be 0s and 1s and blanks only, so what the scorer reads is what was written")
_FIX_CHECKS["kakurasu"] = lambda answer, entry: set(answer) <= set("01 \t\n")


# Scorers whose tolerance is looser than the precision the question asks for (or, where the question
# states none, than the digits the generator wrote in its oracle): their full credit stands only if
# every number of the answer is within half a unit of that precision's last digit of the oracle's
# (:func:`within_stated_precision`). The self-test holds a case just outside that bound for each.
TOLERANCE_FIXES: dict[str, str] = {
    "decimal_arithmetic": "rg's scorer accepts |answer - oracle| <= 10**-max_num_decimal_places (0.001) while the "
                          "question asks for 12 significant digits: '6.321' scored 1.0 for 6.32098837209",
    "number_format": "rg's scorer accepts |answer - oracle| < 0.01 while the candidates are written to 3 decimals, "
                     "so a number that is none of the candidates scored 1.0",
    "number_sorting": "rg's scorer accepts each number within 1 of the oracle's while the numbers are written to "
                      "one decimal: a sorted list of other numbers scored 1.0",
    "pool_matrix": "rg's scorer accepts a relative error of 1% (np.allclose rtol=1e-2) while the question asks for "
                   "2 decimal places: 8.07 scored as 8",
}
# how each reads the numbers of an answer: one number, or every number of a list or grid
_TOLERANCE_READ: dict[str, str] = {"decimal_arithmetic": "one", "number_format": "one",
                                   "number_sorting": "list", "pool_matrix": "list"}
_SIGNIFICANT = re.compile(r"([0-9]{1,3})\s+significant\s+(?:digits|figures)", re.IGNORECASE)
_DECIMAL_PLACES = re.compile(r"([0-9]{1,3})\s+decimal\s+places", re.IGNORECASE)
_PLAIN_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")


def stated_unit(question: str, oracle_number: str) -> Fraction:
    """One unit of the last digit the question asks for (its significant digits or decimal places), or,
    where it states none, of the last digit the oracle number is written with."""
    oracle = Decimal(oracle_number)
    if match := _SIGNIFICANT.search(question):
        leading = oracle.adjusted() if oracle else 0
        return Fraction(10) ** (leading - int(match.group(1)) + 1)
    if match := _DECIMAL_PLACES.search(question):
        return Fraction(1, 10 ** int(match.group(1)))
    exponent = oracle.as_tuple().exponent
    return Fraction(10) ** exponent if isinstance(exponent, int) else Fraction(1)


def _numbers(text: str, read: str, limit: int = 10_000) -> list[tuple[str, Fraction]] | None:
    """The numbers of ``text`` read by the one number reader: ``read == "one"``: the whole text is one number;
    ``"list"``: every number of a list or grid, each a whole token (a sign, point or suffix stuck to it is part
    of it, so '1.5kg' or '-+3' is no number)."""
    text = normalize_numeric_text(text)
    if read == "one":
        value = canonical_number(text)[0]
        return None if value is None else [(text.strip(), value)]
    found = []
    for match in _PLAIN_NUMBER.finditer(text):
        token = match.group(0)
        before, after = text[match.start() - 1:match.start()], text[match.end():match.end() + 1]
        value = canonical_number(token)[0]
        if value is None or len(found) >= limit or _stuck(before) or _stuck(after):
            return None  # more numbers than the oracle's, or a number read in part: no need to read on
        found.append((token, value))
    return found


def _stuck(char: str) -> bool:
    """A character that, next to a number, makes it part of a longer token (not a separator)."""
    return bool(char) and (char.isalnum() or char in "+-._")


def _skeleton(text: str) -> str:
    """``text`` with every number replaced by ``#`` and blanks removed: the layout a list answer must share
    with its oracle (a unit or word beside a number, a missing bracket, changes it)."""
    return "".join(_PLAIN_NUMBER.sub("#", text).split())


def stated_precision(question: str, oracle_number: str) -> Fraction | None:
    """One unit of the last digit the question asks for (its significant digits or decimal places), or None
    when it states none (then a number is right only as the oracle writes its value)."""
    if _SIGNIFICANT.search(question) or _DECIMAL_PLACES.search(question):
        return stated_unit(question, oracle_number)
    return None


# Generators whose oracle writes more digits than the question's numbers (number_format's candidates are
# printed with 3 decimals, its oracle is a float's repr): without a stated precision, the unit of the oracle's
# last digit stands in, as before.
_ORACLE_DIGIT_PRECISION = frozenset({"number_format"})


def within_stated_precision(generator: str, answer: str, entry: dict[str, Any]) -> bool:
    """Every number of ``answer`` is the oracle's, read whole, laid out as the oracle lays them out, and within
    half a unit of the precision the question states (none stated: the oracle's value exactly)."""
    read = _TOLERANCE_READ.get(generator, "one")
    oracle = str(entry["answer"])
    oracles = _numbers(oracle, read)
    answers = _numbers(answer, read, limit=len(oracles)) if oracles else None
    if not answers or not oracles or len(answers) != len(oracles):
        return False
    if read == "list" and _skeleton(answer) != _skeleton(oracle):
        return False
    question = str(entry.get("question", ""))
    for (_, value), (text, target) in zip(answers, oracles, strict=True):
        unit = stated_precision(question, text)
        if unit is None and generator in _ORACLE_DIGIT_PRECISION:
            unit = stated_unit(question, text)
        if not (value == target if unit is None else 2 * abs(value - target) <= unit):
            return False
    return True


def numeric_oracle(entry: dict[str, Any]) -> bool:
    """Whether the item's oracle answer is one number by the project's reader (then so must the answer be)."""
    oracle = entry.get("answer")
    return isinstance(oracle, str) and canonical_number(oracle)[0] is not None


def just_outside_precision(generator: str, entry: dict[str, Any]) -> str | None:
    """The oracle with its last number moved by 0.6 of the stated unit (outward, so a sorted list stays
    sorted): the self-test's case just outside the tolerance, which the old scorers credited."""
    read = _TOLERANCE_READ.get(generator)
    oracle = entry.get("answer")
    if read is None or not isinstance(oracle, str):
        return None
    numbers = _numbers(oracle, read)
    if not numbers:
        return None
    text, value = numbers[-1]
    step = Fraction(6, 10) * stated_unit(str(entry.get("question", "")), text)
    descending = (entry.get("metadata") or {}).get("direction") == "descending"
    moved = value - step if descending else value + step
    written = _decimal_text(moved)
    start = oracle.rfind(text)
    return oracle[:start] + written + oracle[start + len(text):]


def _decimal_text(value: Fraction) -> str:
    """A terminating fraction (a sum of decimals) written out as a plain decimal."""
    with localcontext() as context:
        context.prec = 60
        return format(Decimal(value.numerator) / Decimal(value.denominator), "f").rstrip("0").rstrip(".") or "0"


# the reason a fixed scorer's credit is taken back with (others: "wrong_answer")
_FIX_REASONS: dict[str, str] = {"propositional_logic": "restates_premises", "rush_hour": "illegal_moves",
                                "sokoban": "illegal_moves"}
for _name, _why in TOLERANCE_FIXES.items():
    _FIX_REASONS[_name] = "outside_stated_precision"
    SCORER_FIXES[_name] = _why
    _FIX_CHECKS[_name] = lambda answer, entry, _name=_name: within_stated_precision(_name, answer, entry)

# Scorers that evaluate what the answer says with sympy (parse_expr runs eval): their answers are
# checked against a token allowlist here, reduced to a plain-data expression tree in one sandbox that
# holds no oracle, and only the tree reaches the scoring sandbox (see SYMBOLIC_WHY). The value is the
# kind of answer: an "expression" in the problem's variables, or "arithmetic" on the puzzle's numbers.
SYMBOLIC: dict[str, str] = {
    "simple_integration": "expression", "intermediate_integration": "expression",
    "polynomial_multiplication": "expression", "countdown": "arithmetic", "puzzle24": "arithmetic",
}
SYMBOLIC_WHY = (
    "sympy's parse_expr evals the answer, so restating the question for the scorer to compute scored as a "
    "solution: an unevaluated Integral(...) of the integrand (its derivative is the integrand), or "
    "expand(...) of the given product; and an evaluated answer could walk to the scorer's frames and "
    "read the oracle. Answers are now plain expressions only (numbers, the problem's variables, + - * / ** "
    "and a few elementary functions), parsed where no oracle is, and compared as data"
)
_FUNCTIONS = frozenset(("sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "sinh", "cosh",
                        "tanh", "asinh", "acosh", "atanh", "exp", "log", "sqrt", "Abs", "E", "pi"))
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|([A-Za-z_][A-Za-z_0-9]*)|(\*\*|[-+*/(),]))")
MAX_EXPRESSION_TOKENS = 400

# Puzzles whose scorer checks the value of the answer's expression but not that the puzzle's own
# numbers were used (puzzle24 takes any four numbers in range that make 24, so another puzzle's
# answer scored 1.0): the answer must use exactly the puzzle's numbers, each once.
INPUT_CHECKS: dict[str, str] = {
    "countdown": "numbers", "puzzle24": "numbers",
}

# The value a puzzle's expression must reach.
PUZZLE_TARGETS: dict[str, Callable[[dict[str, Any]], Fraction]] = {
    "countdown": lambda entry: Fraction(int(entry["metadata"]["target"])),
    "puzzle24": lambda entry: Fraction(24),
}

# Items whose oracle itself is not a solution, left out of both splits (the eval pool draws more to
# keep its size): sympy could not integrate them, so the oracle answer is an unevaluated Integral.
_ITEM_FILTERS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "intermediate_integration": lambda item: "Integral" not in str(item.get("answer")),
    # premises that contradict each other entail every conclusion: no answer can be wrong; and an item whose
    # every checkable conclusion is a restatement or a vacuous weakening has no answer to train on
    "propositional_logic": lambda item: logic_reference(item) is not None,
}

def zero_layout(oracle: Any) -> str | None:
    """The oracle's layout with every number written as 0 (an all-zero grid, list or number), or None when the
    oracle has no number or already is that layout."""
    if not isinstance(oracle, str) or not _PLAIN_NUMBER.search(oracle):
        return None
    zero = _PLAIN_NUMBER.sub("0", oracle)
    return None if zero == oracle else zero


def constant_oracle(item: dict[str, Any]) -> bool:
    """Whether the item's answer is a constant that needs no solving: numbers only (a number, a grid, a list, a
    time) and every one of them zero. Such items are left out of both splits: an all-zero answer earned strict
    reward on them unsolved."""
    oracle = item.get("answer")
    if not isinstance(oracle, str) or not _PLAIN_NUMBER.search(oracle):
        return False
    rest = _PLAIN_NUMBER.sub("", oracle)
    if any(char.isalpha() for char in rest):
        return False
    return all(float(number) == 0 for number in _PLAIN_NUMBER.findall(oracle))


# Bounds of the in-process checks: nothing of an answer is converted or evaluated before them.
MAX_ANSWER_CHARS = 20_000
# Numbers in an answer are read by the one canonical rule (evertrain.envs.answers.number_hazard): any
# spelling of nan or inf, and any number past the digit or value bounds however its exponent is spelled.
MAX_NUMBER_DIGITS = MAX_DIGITS


def expression_symbols(generator: str, entry: dict[str, Any]) -> list[str]:
    """The names a symbolic answer may use besides the functions: the problem's variables (and C)."""
    meta = entry.get("metadata") or {}
    names = [meta["variable"]] if isinstance(meta.get("variable"), str) else []
    variables = meta.get("variables")
    if isinstance(variables, list):
        names += [v for v in variables if isinstance(v, str)]
    if "integration" in generator:
        names.append("C")
    return [name for name in dict.fromkeys(names) if name.isidentifier()]


def precheck(generator: str, answer: str, entry: dict[str, Any]) -> str | None:
    """Why ``answer`` earns 0 before any scorer sees it (None: let the scorer decide). Bounded work.

    Refused: an answer far longer than any oracle; a non-finite number (``nan``, ``inf``), which some
    partial-credit formulas turn into full credit, in any spelling; a number with more than MAX_DIGITS
    digits or a value past 10**MAX_EXPONENT (:func:`evertrain.envs.answers.number_hazard`); for
    symbolic scorers, anything but a plain expression; for puzzles, an expression that does not use
    exactly the puzzle's numbers.
    """
    oracle = entry.get("answer") if isinstance(entry.get("answer"), str) else ""
    if len(answer) > max(MAX_ANSWER_CHARS, 20 * len(oracle)):
        return "answer_too_long"
    if hazard := number_hazard(answer, oracle):
        return hazard
    if generator in SYMBOLIC:
        allowed = set(expression_symbols(generator, entry)) | (_FUNCTIONS if SYMBOLIC[generator] == "expression"
                                                              else set())
        tokens = tokenize_expression(answer, allowed)
        if tokens is None or (SYMBOLIC[generator] == "arithmetic" and "**" in tokens):
            return "answer_not_plain_expression"
        if generator in INPUT_CHECKS:
            numbers = entry.get("metadata", {}).get("numbers")
            used = [token for token in tokens if token[:1].isdigit()]
            if not isinstance(numbers, list) or any("." in token for token in used) or \
                    sorted(int(token) for token in used) != sorted(int(n) for n in numbers):
                return "puzzle_inputs_not_used"
    return None


def arithmetic_value(tokens: list[str]) -> Fraction | None:
    """The exact value of an arithmetic expression of integers, + - * / and parentheses, or None.

    Used for the puzzles (countdown, puzzle24) instead of their scorers' sympy: the expression is plain
    data once tokenized, so it is evaluated here, exactly, by this small parser (no eval, no powers).
    """
    position = 0

    def peek() -> str | None:
        return tokens[position] if position < len(tokens) else None

    def take() -> str:
        nonlocal position
        position += 1
        return tokens[position - 1]

    def atom() -> Fraction:
        token = take() if peek() is not None else ""
        if token in ("+", "-"):
            value = atom()
            return value if token == "+" else -value
        if token == "(":
            value = expression()
            if peek() != ")":
                raise ValueError("unbalanced")
            take()
            return value
        if token.isdigit() and len(token) <= 6:
            return Fraction(int(token))
        raise ValueError(f"unexpected token {token!r}")

    def term() -> Fraction:
        value = atom()
        while peek() in ("*", "/"):
            op, right = take(), atom()
            value = value * right if op == "*" else value / right
        return value

    def expression() -> Fraction:
        value = term()
        while peek() in ("+", "-"):
            op, right = take(), term()
            value = value + right if op == "+" else value - right
        return value

    try:
        value = expression()
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    return value if position == len(tokens) else None


def tokenize_expression(text: str, names: set[str]) -> list[str] | None:
    """The tokens of a plain expression (numbers, ``names``, + - * / ** parentheses, commas), or None."""
    tokens: list[str] = []
    position, depth = 0, 0
    text = text.strip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or len(tokens) >= MAX_EXPRESSION_TOKENS:
            return None
        number, name, op = match.groups()
        if name is not None and name not in names:
            return None
        token = number or name or op
        depth += (op == "(") - (op == ")")
        if depth < 0 or depth > 50:
            return None
        tokens.append(token)
        position = match.end()
    return tokens if tokens and depth == 0 else None


_HEDGE_WORD = re.compile(r"\bor\b", re.IGNORECASE)
_SEPARATORS = ",;/|"


def hedged(answer: str, oracle: str | None) -> str | None:
    """Why ``answer`` hedges between candidates (None when it does not); such an answer earns 0.

    Several reasoning-gym scorers parse leniently and give full credit to "<oracle> or 7" or
    "<oracle>, 7" (fraction_simplification, gsm_symbolic, knights_knaves, quantum_lock, sokoban,
    time_intervals, word_sorting, the sympy-based integration and polynomial scorers ...). The project's
    rule is that a hedge earns nothing, so two hedges are refused before scoring: the word "or" when the
    oracle answer has none, and the oracle answer with another candidate joined to it by a separator
    (one of ``,;/|``). An answer equal to the oracle is never refused.
    """
    if oracle is not None and answer.strip() == oracle.strip():
        return None
    if _HEDGE_WORD.search(answer) and not (oracle and _HEDGE_WORD.search(oracle)):
        return "or"
    target = (oracle or "").strip()
    if target and target in answer:
        before, _, after = answer.partition(target)
        before, after = before.strip(), after.strip().rstrip(".").strip()
        if (after and after[0] in _SEPARATORS) or (before and before[-1] in _SEPARATORS):
            return "another_candidate"
    return None


# The composite generator needs a list of datasets; this one is used when the config gives none.
DEFAULT_COMPOSITE_CONFIG: dict[str, Any] = {"datasets": [
    {"name": "basic_arithmetic", "weight": 1.0, "config": {}},
    {"name": "spell_backward", "weight": 1.0, "config": {}},
    {"name": "word_sorting", "weight": 1.0, "config": {}},
]}

# Every reason a grade can give. Only "correct" passes; in "score" mode "partial_credit" earns its score.
REASONS: dict[str, str] = {
    "correct": "the generator's scorer gave full credit (1.0)",
    "partial_credit": "the scorer gave a score strictly between 0 and 1 (0 reward in strict mode)",
    "wrong_answer": "the scorer gave 0",
    "no_final_answer": "no '#### ' or '\\boxed{}' marker",
    "multiple_answers": "more than one marker",
    "answer_not_on_last_line": "the marker is not on the last non-empty line",
    "unbalanced_boxed": "\\boxed{ without its closing brace",
    "hedged_answer": "the answer hedges between candidates (see hedged()); refused before scoring",
    "answer_too_long": "the answer is far longer than any oracle (refused before scoring)",
    "non_finite_answer": "the answer is or holds nan or inf (refused before scoring)",
    "over_long_number": "a number with too many digits or too large an exponent (refused before scoring)",
    "answer_not_plain_expression": "a symbolic answer that is not a plain expression in the problem's variables",
    "puzzle_inputs_not_used": "the expression does not use exactly the puzzle's numbers, each once",
    "outside_stated_precision": "the scorer's tolerance credited a number off by more than the precision the question "
                                "states (see TOLERANCE_FIXES)",
    "restates_premises": "a conclusion equivalent to a premise or a conjunction of premises, or drawn from "
                         "premises that contradict each other",
    "not_the_number": "a numeric item's full credit for an answer that is not the oracle's number read whole by the "
                      "project's one number reader (within the precision the question states, if it states one)",
    "illegal_moves": "a move list with a move the board does not allow where it is made, or far longer than the "
                     "shortest solution (see MOVE_SLACK)",
    "not_exact": "a wrapped scorer's partial credit stands for no full answer: exact comparison failed",
    "answer_blocked": "evaluating the answer tried something the scorer's audit hook refuses (0 whatever the score)",
    "scorer_load_failed": "the generator's module or dataset could not be loaded in the sandbox",
    "scorer_raised": "score_answer raised",
    "scorer_bad_score": "score_answer returned something that is not a number in [0, 1]",
    "scorer_crashed": "the scorer process exited without a clean report",
    "scorer_report_garbled": "the scorer process's report was missing, repeated or malformed",
    "timeout": "the scorer ran past the wall-clock limit",
    "limit_cpu": "the scorer used up its CPU time",
    "limit_memory": "the scorer ran out of address space",
    "limit_nproc": "the scorer hit the process-count limit",
    "limit_fsize": "the scorer tried to write a file past the size limit",
    "limit_output": "the scorer flooded stdout or stderr",
}

SYSTEM_PROMPT = "Solve the task. End your reply with the final answer alone on the last line, as '#### <answer>'."
MULTILINE_NOTE = " If the answer has several lines, keep it on that one line and write each line break as \\n."
EXAMPLE = ("Write the word 'stone' backwards.", "s-t-o-n-e reversed is e-n-o-t-s.\n#### enots")
MULTILINE_EXAMPLE = ("Write the 2x2 identity matrix, one row per line.", "#### 1 0\\n0 1")


# ---------------------------------------------------------------------------------------------------
# Names and modules


@cache
def installed_version() -> str | None:
    """The installed reasoning-gym version, or None when it is not installed."""
    try:
        return importlib_metadata.version("reasoning-gym")
    except importlib_metadata.PackageNotFoundError:
        return None


@cache
def _registry() -> dict[str, str]:
    """generator -> module (under reasoning_gym): the pinned table, or the live registry of another version."""
    if installed_version() == RG_VERSION:
        return dict(RG_MODULES)
    # late: reasoning_gym (~1 s: every generator registers on import); listing names and config validation do without it
    import reasoning_gym  # noqa: F401  (a different version: ask it; importing registers every generator, ~1 s)
    from reasoning_gym.factory import DATASETS

    return {name: cls.__module__.removeprefix("reasoning_gym.") for name, (cls, _) in DATASETS.items()}


def generator_names() -> list[str]:
    """Every reasoning-gym generator name, sorted. Cheap: reasoning_gym is not imported for the pinned version."""
    return sorted(_registry())


# ---------------------------------------------------------------------------------------------------
# Items: ids, JSON-safe metadata, answers


def rg_problem_id(env: str, question: str, answer: str | None) -> str:
    """The id of an item: a content hash of question and answer (metadata such as source_index ignored)."""
    return problem_id(env, {"question": question, "answer": answer})


def _plain(value: Any) -> Any:
    """``value`` as plain JSON: tuples become lists, sets sorted lists, keys strings, the rest a string."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(item) for item in value), key=repr)
    return str(value)


def encode_answer(generator: str, answer: str) -> str:
    """An answer as the one line the strict rule allows (line breaks as backslash-n where they are used)."""
    return answer.replace("\n", "\\n") if generator in MULTILINE_GENERATORS else answer


def decode_answer(generator: str, answer: str) -> str:
    """The extracted final answer as the scorer expects it: the inverse of :func:`encode_answer`."""
    return answer.replace("\\n", "\n") if generator in MULTILINE_GENERATORS else answer


def _entry(problem: Problem) -> dict[str, Any]:
    payload = problem.payload
    question = payload.get("question", problem.prompt)
    answer, meta = payload.get("answer"), payload.get("metadata", {})
    if not isinstance(question, str) or not (answer is None or isinstance(answer, str)) or not isinstance(meta, dict):
        raise ValueError(f"problem {problem.id}: not a reasoning-gym item (question, answer, metadata)")
    return {"question": question, "answer": answer, "metadata": meta}


# ---------------------------------------------------------------------------------------------------
# The sandbox side

# The scorer program (it runs inside the sandbox): evertrain/sandbox/rg_scorer.py
SCORER_SOURCE = (Path(__file__).resolve().parent.parent / "sandbox" / "rg_scorer.py").read_text()


@cache
def _package_dir() -> str:
    """The folder of the reasoning_gym package, found without importing it."""
    spec = importlib_util.find_spec("reasoning_gym")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("reasoning-gym is not installed: pip install reasoning-gym==" + RG_VERSION)
    return str(Path(next(iter(spec.submodule_search_locations))).resolve())


@cache
def site_dirs() -> tuple[str, ...]:
    """The folders the scorer imports from: reasoning_gym's site-packages and this interpreter's."""
    dirs = [str(Path(_package_dir()).parent)]
    for key in ("purelib", "platlib"):
        path = str(Path(sysconfig.get_paths()[key]).resolve())
        if path not in dirs and os.path.isdir(path):
            dirs.append(path)
    return tuple(dirs)


@dataclass
class ScoreResult:
    """What the sandboxed scorer said: the rg score (None when there is none) and a reason code."""

    score: float | None
    reason: str
    record: SandboxRunRecord | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    earlier: list[SandboxRunRecord] = field(default_factory=list)  # a symbolic grade's reducing run


def _scoring_request(generator: str, config: dict[str, Any] | None) -> dict[str, Any]:
    """What every scoring request of ``generator`` holds (its module, config and where to import from)."""
    modules = _registry()
    if generator not in modules or generator == "composite":
        raise ValueError(f"not a reasoning-gym generator that scores items: {generator!r}")
    return {"site": list(site_dirs()), "package_dir": _package_dir(), "generator": generator,
            "module": modules[generator], "config": dict(config or {}),
            "revive": list(TUPLE_METADATA.get(generator, ())), "lazy": list(LAZY_MODULES)}


def score_in_sandbox(generator: str, answer: str, entry: dict[str, Any], *, config: dict[str, Any] | None = None,
                     limits: Limits | None = None) -> ScoreResult:
    """Run ``generator``'s ``score_answer(answer, entry)`` in a sandbox; see the module docstring for how.

    ``answer`` is what the scorer sees (already extracted and decoded). ``config`` is the generator's
    config (the same overrides its problems were generated with).
    """
    base = _scoring_request(generator, config)
    earlier: list[SandboxRunRecord] = []
    tree = None
    symbols = expression_symbols(generator, entry)
    if SYMBOLIC.get(generator) == "expression":
        # phase one: the answer alone (no entry, no oracle) becomes a plain-data tree
        nonce = secrets.token_hex(16)
        request = {"nonce": nonce, "mode": "reduce", "site": list(site_dirs()), "answer": answer,
                   "symbols": symbols}
        record = run_python(SCORER_SOURCE, purpose=SCORER_PURPOSE, limits=limits or SCORER_LIMITS,
                            stdin=json.dumps(request).encode(), ro_binds=site_dirs())
        reduced = _result(record, nonce)
        if reduced.reason != "reduced":
            reduced.reason = "answer_not_plain_expression" if reduced.reason == "answer_not_plain" else reduced.reason
            return reduced
        earlier, tree, answer = [record], reduced.detail.pop("tree"), ""
    nonce = secrets.token_hex(16)
    request = {**base, "nonce": nonce, "answer": answer, "entry": entry, "tree": tree, "symbols": symbols,
               "literal_eval": SYMBOLIC.get(generator) != "expression"}
    stdin = json.dumps(request).encode()
    record = run_python(SCORER_SOURCE, purpose=SCORER_PURPOSE, limits=limits or SCORER_LIMITS, stdin=stdin,
                        ro_binds=site_dirs())
    result = _result(record, nonce)
    result.earlier = earlier
    return result


def score_many_in_sandbox(generator: str, items: list[tuple[str, dict[str, Any]]], *,
                          config: dict[str, Any] | None = None) -> list[ScoreResult]:
    """:func:`score_in_sandbox` for many ``(answer, entry)`` of one generator in one sandbox: its module is loaded
    once and each answer is scored in a process forked from that one (alone, as a single run scores it), so an
    answer costs a fork instead of an interpreter and an import (about 5 CPU-milliseconds against 75:
    benchmarks/probe_batch.py, Intel Xeon).
    For the project's own answers only (the quality check's probes), never a policy's: every result shares the
    batch's sandbox record. Symbolic generators (graded in two runs), and every item of a batch whose sandbox hit
    a limit or failed, are scored one run each."""
    base = _scoring_request(generator, config)
    if SYMBOLIC.get(generator) == "expression" or len(items) < 2:
        return [score_in_sandbox(generator, answer, entry, config=config) for answer, entry in items]
    nonces = [secrets.token_hex(16) for _ in items]
    request = {**base, "mode": "batch", "literal_eval": True,
               "items": [{"nonce": nonce, "answer": answer, "entry": entry}
                         for nonce, (answer, entry) in zip(nonces, items, strict=True)]}
    # each answer has its own CPU limit (a forked process's own); the wall clock is the batch's, so it grows
    limits = Limits(timeout_s=SCORER_LIMITS.timeout_s + 2.0 * len(items), cpu_s=SCORER_LIMITS.cpu_s,
                    memory_mb=SCORER_LIMITS.memory_mb, nproc=SCORER_LIMITS.nproc)
    record = run_python(SCORER_SOURCE, purpose=SCORER_PURPOSE, limits=limits, stdin=json.dumps(request).encode(),
                        ro_binds=site_dirs())
    if record.limit_hit or record.exit_code != 0:
        return [score_in_sandbox(generator, answer, entry, config=config) for answer, entry in items]
    return [_result(record, nonce) for nonce in nonces]


def _result(record: SandboxRunRecord, nonce: str) -> ScoreResult:
    """The score from the record: one nonce line from a process that exited cleanly, or a reason for 0."""
    lines = [line[len(nonce) + 1:] for line in record.stdout.splitlines() if line.startswith(nonce + " ")]
    if record.limit_hit:
        return ScoreResult(None, "timeout" if record.limit_hit == "timeout" else f"limit_{record.limit_hit}", record)
    if record.exit_code != 0:
        return ScoreResult(None, "scorer_crashed", record, {"stderr": record.stderr[-500:]})
    if len(lines) != 1:
        return ScoreResult(None, "scorer_report_garbled", record, {"report_lines": len(lines)})
    kind, _, rest = lines[0].partition(" ")
    if kind == "tree":
        tree = _json_or_text(rest)
        return ScoreResult(None, "reduced" if isinstance(tree, list) else "scorer_report_garbled", record,
                           {"tree": tree})
    if kind == "blocked":
        return ScoreResult(None, "answer_blocked", record, {"blocked": _json_or_text(rest)})
    if kind == "error":
        code, _, text = rest.partition(" ")
        reason = code if code in REASONS or code == "answer_not_plain" else "scorer_report_garbled"
        return ScoreResult(None, reason, record, {"error": _json_or_text(text), "stderr": record.stderr[-500:]})
    if kind != "score":
        return ScoreResult(None, "scorer_report_garbled", record)
    try:
        score = float(rest)
    except ValueError:
        return ScoreResult(None, "scorer_report_garbled", record)
    if not (math.isfinite(score) and 0.0 <= score <= 1.0):
        return ScoreResult(None, "scorer_bad_score", record, {"score": rest[:40]})
    return ScoreResult(score, "correct" if score == 1.0 else "partial_credit" if score > 0 else "wrong_answer", record)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---------------------------------------------------------------------------------------------------
# The environment


def train_seed(seed: int) -> int:
    """The train dataset's seed for a caller's seed: spread over 32 bits, never :data:`EVAL_SEED`."""
    digest = hashlib.sha256(f"evertrain-rg-train:{seed}".encode()).digest()
    value = int.from_bytes(digest[:4], "big")
    return value + 1 if value == EVAL_SEED else value


@dataclass(frozen=True)
class _Scoring:
    """What the sandboxed scorer needs for one completion: the generator, the decoded answer it sees, the item, the
    generator's config, and the answer as written."""

    generator: str
    decoded: str
    entry: dict[str, Any]
    config: dict[str, Any]
    answer: str


class ReasoningGym(Environment):
    """``rg:<generator>``: one reasoning-gym generator; see the module docstring.

    Options: ``reward`` ("strict" or "score"), ``config`` (the generator's config overrides, passed to
    ``reasoning_gym.create_dataset``; seed and size are the environment's), ``eval_size`` (the held-out
    pool's size, default 100), ``examples`` ([user, assistant] worked examples of the domain's own kind,
    each ending in the ``#### <answer>`` line, in place of the one generic example).
    """

    kind: ClassVar[str] = "reasoning"
    source: ClassVar[str] = f"reasoning-gym {RG_VERSION} (generated)"
    templated: ClassVar[bool] = True

    def __init__(self, generator: str, *, reward: Reward = "strict", config: dict[str, Any] | None = None,
                 eval_size: int = DEFAULT_EVAL_SIZE, examples: list[list[str]] | None = None,
                 **options: Any) -> None:
        self.name = f"rg:{generator}"  # type: ignore[misc]  (an instance attribute: one class, many names)
        super().__init__(**options)
        if generator not in _registry():
            raise ValueError(f"unknown reasoning-gym generator {generator!r}")
        if reward not in ("strict", "score"):
            raise ValueError(f"{self.name}: reward must be 'strict' or 'score', not {reward!r}")
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"{self.name}: config must be a table (dict) of the generator's settings")
        config = dict(config or {})
        if {"seed", "size"} & set(config):
            raise ValueError(f"{self.name}: config must not set seed or size: the environment chooses them")
        if generator == "composite" and "datasets" not in config:
            config = {**DEFAULT_COMPOSITE_CONFIG, **config}
        if isinstance(eval_size, bool) or not isinstance(eval_size, int) or eval_size < 1:
            raise ValueError(f"{self.name}: eval_size must be a positive integer, not {eval_size!r}")
        self.generator, self.reward_mode, self.config, self.eval_size = generator, reward, config, eval_size
        json.dumps(config)  # a TypeError here names a config that cannot be stored with the campaign
        # worked examples of this domain's own kind, replacing the one generic example (option ``examples``:
        # [user, assistant] pairs, each assistant turn ending in the '#### <answer>' line the grader reads)
        self.worked_examples = self._check_examples(examples) if examples is not None else None
        self._baselines: dict[str, float] = {}  # problem id -> the all-zero answer's score (reward = "score")

    def _check_examples(self, examples: Any) -> tuple[tuple[str, str], ...]:
        if not isinstance(examples, list | tuple) or not examples:
            raise ValueError(f"{self.name}: examples must be a non-empty list of [user, assistant] pairs")
        pairs = []
        for i, pair in enumerate(examples):
            if (not isinstance(pair, list | tuple) or len(pair) != 2
                    or not all(isinstance(x, str) and x.strip() for x in pair)):
                raise ValueError(f"{self.name}: examples[{i}] must be a pair of non-empty strings [user, assistant], "
                                 f"not {pair!r}")
            if extract_final_answer(pair[1])[0] is None:
                raise ValueError(f"{self.name}: examples[{i}]'s assistant turn must end with the final answer line "
                                 f"'#### <answer>' (the format the grader reads), not {pair[1]!r}")
            pairs.append((pair[0], pair[1]))
        return tuple(pairs)

    # --- problems

    def _dataset(self, seed: int, size: int) -> Any:
        # late: reasoning_gym (~1 s: every generator registers on import); listing names and config validation do
        # without it
        import reasoning_gym

        config = dict(self.config)
        if self.generator == "composite":
            # late: reasoning_gym (~1 s: every generator registers on import); listing names and config validation do
            # without it
            from reasoning_gym.composite import DatasetSpec

            config["datasets"] = [spec if isinstance(spec, DatasetSpec) else DatasetSpec(**spec)
                                  for spec in config["datasets"]]
        return reasoning_gym.create_dataset(self.generator, seed=seed, size=size, **config)

    def _problem(self, item: dict[str, Any], split: Split) -> Problem:
        question, answer = str(item["question"]), item["answer"]
        answer = answer if answer is None or isinstance(answer, str) else str(answer)
        payload = {"question": question, "answer": answer, "metadata": _plain(item.get("metadata") or {})}
        return Problem(env=self.name, id=rg_problem_id(self.name, question, answer), prompt=question,
                       payload=payload, split=split)

    def _usable(self, item: dict[str, Any]) -> bool:
        keep = _ITEM_FILTERS.get(self.generator)
        return not constant_oracle(item) and (keep is None or keep(item))

    @cached_property
    def _eval_pool(self) -> list[Problem]:
        # items are filtered (constant oracles everywhere; 4 in 5 propositional-logic items): the dataset is
        # drawn lazily, so a generous bound costs only the draws the pool needs
        size = 8 * self.eval_size + 32
        dataset = self._dataset(EVAL_SEED, size)
        pool: list[Problem] = []
        seen: set[str] = set()
        for index in range(size):
            if len(pool) == self.eval_size:
                break
            item = dataset[index]
            if not self._usable(item):
                continue
            problem = self._problem(item, "eval")
            if problem.id not in seen:
                seen.add(problem.id)
                pool.append(problem)
        return pool

    @cached_property
    def _eval_ids(self) -> frozenset[str]:
        return frozenset(problem.id for problem in self._eval_pool)

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        """Eval: the first ``n`` of the fixed pool (``seed`` unused). Train: ``n`` from ``seed``, none held out.

        Train may return fewer than ``n`` when the generator has few distinct items: it stops after
        ``4n + 32`` draws.
        """
        if split == "eval":
            if n > self.eval_size:
                raise ValueError(f"{self.name}: {n} eval problems asked, the pool holds {self.eval_size}; "
                                 f"raise the environment's eval_size option")
            return self._eval_pool[:n]
        if n <= 0:
            return []
        held = self._eval_ids
        attempts = 4 * n + 32
        dataset = self._dataset(train_seed(seed), attempts)
        chosen: list[Problem] = []
        seen: set[str] = set()
        for index in range(attempts):
            if not self._usable(dataset[index]):
                continue
            problem = self._problem(dataset[index], "train")
            if problem.id in held or problem.id in seen:
                continue
            seen.add(problem.id)
            chosen.append(problem)
            if len(chosen) == n:
                break
        return chosen

    def count(self, split: Split) -> int | None:
        return None

    # --- prompts

    def _multiline(self) -> bool:
        if self.generator == "composite":
            return any(spec["name"] in MULTILINE_GENERATORS for spec in self._composite_specs())
        return self.generator in MULTILINE_GENERATORS

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """A short system prompt with the answer format, worked examples (one generic by default), the question."""
        multiline = self._multiline()
        examples = self.worked_examples or (MULTILINE_EXAMPLE if multiline else EXAMPLE,)
        chat = [{"role": "system", "content": SYSTEM_PROMPT + (MULTILINE_NOTE if multiline else "")}]
        for user, assistant in examples:
            chat += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return [*chat, {"role": "user", "content": problem.prompt}]

    # --- grading

    def _composite_specs(self) -> list[dict[str, Any]]:
        return [spec if isinstance(spec, dict) else vars(spec) for spec in self.config.get("datasets", [])]

    def scoring_generator(self, entry: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The generator whose scorer grades ``entry``, and its config (a composite's item: its source's)."""
        if self.generator != "composite":
            return self.generator, self.config
        source = entry["metadata"].get("source_dataset")
        if not isinstance(source, str) or source == "composite" or source not in _registry():
            raise ValueError(f"{self.name}: item metadata.source_dataset {source!r} is not a generator")
        for spec in self._composite_specs():
            if spec.get("name") == source:
                config = dict(spec.get("config") or {})
                return source, {k: v for k, v in config.items() if k not in ("seed", "size")}
        return source, {}

    def verify(self, problem: Problem, completion: str) -> Verdict:
        step = self._before_scoring(problem, completion)
        if isinstance(step, Verdict):
            return step
        return self._after_scoring(problem, step, score_in_sandbox(step.generator, step.decoded, step.entry,
                                                                   config=step.config))

    probes_together = True

    def verify_probes(self, items: list[tuple[Problem, str]]) -> list[Verdict]:
        """:meth:`verify` of the project's own probe completions (the quality check's), the sandboxed scorer runs of
        one generator batched into one sandbox (:func:`score_many_in_sandbox`): the same verdicts, for a fork
        each instead of an interpreter each. Never for a policy's completions."""
        steps = [self._before_scoring(problem, completion) for problem, completion in items]
        verdicts = [step if isinstance(step, Verdict) else None for step in steps]
        pending: dict[tuple[str, str], list[tuple[int, _Scoring]]] = {}  # by generator and its config
        for index, step in enumerate(steps):
            if isinstance(step, _Scoring):
                key = (step.generator, json.dumps(step.config, sort_keys=True, default=str))
                pending.setdefault(key, []).append((index, step))
        for group in pending.values():
            results = score_many_in_sandbox(group[0][1].generator, [(step.decoded, step.entry) for _, step in group],
                                            config=group[0][1].config)
            for (index, step), result in zip(group, results, strict=True):
                verdicts[index] = self._after_scoring(items[index][0], step, result)
        return [verdict for verdict in verdicts if verdict is not None]

    def _before_scoring(self, problem: Problem, completion: str) -> Verdict | _Scoring:
        """A verdict reached without the scorer, or what the scorer needs."""
        entry = _entry(problem)
        generator, config = self.scoring_generator(entry)
        answer, reason = extract_final_answer(completion)
        if answer is None:
            return Verdict.fail(reason, sandbox_runs=[])
        decoded = decode_answer(generator, answer)
        if hedge := hedged(decoded, entry["answer"]):
            return Verdict.fail("hedged_answer", answer=answer[:200], hedge=hedge, sandbox_runs=[])
        if refused := precheck(generator, decoded, entry):
            return Verdict.fail(refused, answer=answer[:200], sandbox_runs=[])
        if SYMBOLIC.get(generator) == "arithmetic":  # plain data now: evaluated exactly here, see arithmetic_value
            tokens = tokenize_expression(decoded, set()) or []
            value, target = arithmetic_value(tokens), PUZZLE_TARGETS[generator](entry)
            if value is None or value != target:
                return Verdict.fail("wrong_answer", answer=answer[:200], rg_score=0.0, sandbox_runs=[])
            return Verdict.ok("correct", answer=answer[:200], rg_score=1.0, sandbox_runs=[])
        return _Scoring(generator, decoded, entry, config, answer)

    def _after_scoring(self, problem: Problem, step: _Scoring, result: ScoreResult) -> Verdict:
        generator, decoded, entry, config, answer = step.generator, step.decoded, step.entry, step.config, step.answer
        # a tolerance fix takes back full credit only: a scorer's partial credit for a wrong value stands
        checked = result.score == 1.0 if generator in TOLERANCE_FIXES else bool(result.score)
        if checked and generator in SCORER_FIXES and not _FIX_CHECKS[generator](decoded, entry):
            result.detail["rg_score_before_fix"] = result.score
            full = result.score == 1.0
            result.score, result.reason = 0.0, _FIX_REASONS.get(generator, "wrong_answer") if full else "wrong_answer"
        # every scorer of a numeric item: full credit only for the oracle's number read whole by the project's
        # one reader (scorers that skipped a sign or point, a unit after the number, or deleted commas paid)
        if result.score == 1.0 and numeric_oracle(entry) and not within_stated_precision(generator, decoded, entry):
            result.detail["rg_score_before_fix"] = result.score
            result.score, result.reason = 0.0, "not_the_number"
        detail: dict[str, Any] = {"answer": answer[:200], "rg_score": result.score, **result.detail}
        if generator != self.generator:
            detail["generator"] = generator
        if result.record is not None:
            detail["run_id"] = result.record.run_id
            detail["sandbox_runs"] = [{**record.to_row(), "started_at": record.started_at.isoformat()}
                                      for record in (*result.earlier, result.record)]
        score = result.score or 0.0
        reward = score if self.reward_mode == "score" else float(score == 1.0)
        if self.reward_mode == "score" and 0.0 < score < 1.0:
            # partial credit counts only above what the constant all-zero answer already gets on this item
            baseline = self._constant_baseline(problem.id, generator, entry, config)
            detail["constant_baseline"] = baseline
            reward = max(0.0, (score - baseline) / (1.0 - baseline)) if baseline < 1.0 else 0.0
        return Verdict(reward=reward, passed=score == 1.0, reason=result.reason, detail=detail)

    def _constant_baseline(self, problem_id: str, generator: str, entry: dict[str, Any],
                           config: dict[str, Any]) -> float:
        """The scorer's partial credit for the oracle's layout with every number zero (an all-zero grid), once
        per item; 0 where the oracle has no numbers to zero."""
        zero = zero_layout(entry.get("answer"))
        if zero is None:
            return 0.0
        if problem_id not in self._baselines:
            self._baselines[problem_id] = score_in_sandbox(generator, zero, entry, config=config).score or 0.0
        return self._baselines[problem_id]

    def reference(self, problem: Problem) -> str | None:
        """``#### <the oracle answer>`` (line breaks encoded), or a solution kept in the metadata."""
        entry = _entry(problem)
        generator, _ = self.scoring_generator(entry)
        answer = entry["answer"]
        if answer is None and generator == "propositional_logic":
            answer = logic_reference(entry)
        elif answer is None and generator in _METADATA_SOLUTION:
            solution = entry["metadata"].get(_METADATA_SOLUTION[generator])
            answer = solution if isinstance(solution, str) or solution is None else json.dumps(solution)
        if answer is None:
            return None
        return "#### " + encode_answer(generator, answer)

    def oracle_answer(self, problem: Problem) -> str | None:
        """The oracle answer, encoded as a final answer would be; None where items have no unique answer
        (their scorer accepts any valid solution, so another problem's answer may be right here too)."""
        answer = problem.payload.get("answer")
        return None if answer is None else encode_answer(self.generator, answer)

    def known_bad(self, problem: Problem, other: Problem | None) -> list[tuple[str, str]]:
        """The question restated for a scorer that evaluates it (an unevaluated integral, an expand() of
        the given product, a premise as the conclusion), plus the forging hacks."""
        meta = problem.payload.get("metadata") or {}
        restated: list[str] = []
        variable = meta.get("variable") if isinstance(meta.get("variable"), str) else "x"
        if isinstance(meta.get("integrand"), str):
            integrand = meta["integrand"]
            restated += [f"Integral({integrand}, {variable}) + C", f"integrate({integrand}, {variable})",
                         f"∫ {integrand} d{variable}", f"Integral({integrand}, {variable}).doit()"]
        if isinstance(meta.get("polynomial_expr"), str):
            expression = meta["polynomial_expr"]
            restated += [f"expand({expression})", expression, f"simplify({expression})", f"({expression})*1"]
        for premise in meta.get("premises") or []:
            restated.append(str(premise))
        restated += logic_restatements({"metadata": meta})
        if isinstance(meta.get("numbers"), list) and "target" in meta:
            restated += [str(meta["target"]), f"{meta['target']} + 0"]
        entry = _entry(problem)
        generator, _ = self.scoring_generator(entry)
        outside = just_outside_precision(generator, entry)
        loose = [("tolerance", "#### " + encode_answer(generator, outside))] if outside else []
        return ([("restated", "#### " + encode_answer(self.generator, text)) for text in restated] + loose
                + [("hack", completion) for completion in self.hack_completions(problem)])

    def probe_completions(self, problem: Problem) -> list[tuple[str, str]]:
        """The quality check's move sprays for move-list generators: the oracle behind a long spray of back-and-forth
        moves (sokoban), or every car moved back and forth many times (rush_hour, which has no oracle)."""
        entry = _entry(problem)
        generator, _ = self.scoring_generator(entry)
        if generator == "sokoban" and entry["answer"]:
            return [("move_spray", "#### " + "LR" * (len(entry["answer"]) + MOVE_EXTRA) + entry["answer"])]
        if generator == "rush_hour":
            pieces, _ = rush_hour_pieces(str(entry["metadata"].get("board_config", "")))
            moves = [f"{chr(65 + i)}{sign}{steps}" for i in range(len(pieces)) for steps in (1, 2, 3)
                     for sign in "+-"]
            return [("move_spray", "#### " + " ".join(moves * 20))]
        return []

    def hack_completions(self, problem: Problem) -> list[str]:
        """Answers that try to take over a scorer that evals them, or to print a grade: all must earn 0."""
        return ["#### __import__('os')._exit(0)", "#### [print('score 1.0'), exit(0)]",
                "#### [x for x in ().__class__.__base__.__subclasses__()]",
                "#### (lambda: open('/proc/self/fd/1', 'w').write('score 1.0'))()"]

    def parse_problem(self, data: dict[str, Any]) -> Problem:
        """The reasoning-gym item itself: ``{"question": str, "answer": str | null, "metadata": {...}}``."""
        if not isinstance(data, dict):
            raise ValueError(f"problem must be a JSON object (a reasoning-gym item), not {type(data).__name__}")
        question, answer, meta = data.get("question"), data.get("answer"), data.get("metadata", {})
        if not isinstance(question, str):
            raise ValueError("problem.question must be a string")
        if answer is not None and not isinstance(answer, str):
            raise ValueError("problem.answer must be a string or null")
        if not isinstance(meta, dict):
            raise ValueError("problem.metadata must be an object")
        problem = self._problem({"question": question, "answer": answer, "metadata": meta}, "train")
        if self.generator == "composite":
            self.scoring_generator(problem.payload)  # a bad source_dataset is a bad problem: say so now
        return problem
