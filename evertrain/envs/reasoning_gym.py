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

Two corrections to reasoning-gym's scorers, both before or after the scorer and both documented where
they are defined: hedged answers ("<answer> or 7", "<answer>, 7"), which several lenient scorers
credit, earn 0 (:func:`hedged`); and the few scorers that credit what they should not get a check
after them (:data:`SCORER_FIXES`). Generators whose reference completion cannot be built are listed
in :data:`RG_REFERENCE_EXCEPTIONS`.

Scoring in the sandbox (:func:`score_in_sandbox`). One sandboxed Python process per grade runs
:data:`SCORER_SOURCE` with a JSON request on stdin: a fresh random nonce, the generator's module, the
config, the answer and the item. It imports only that generator's module (not the ``reasoning_gym``
package, whose ``__init__`` imports all 106 generators and costs about a second), builds the dataset,
and calls ``score_answer``. Before it does, the scorer process

- moves its stdout to /dev/null and keeps the real one on a private descriptor, so nothing the scorer
  or the answer prints reaches the channel the grade is read from;
- installs an audit hook (PEP 578, cannot be removed) that refuses any code compiled from a string
  (``eval``/``exec`` of the answer, directly or through sympy) naming a private or dunder name or an
  escape primitive (``open``, ``getattr``, ``exec``, ``print``, ``os``, ``sys``, ``gc`` ...), and
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
from functools import cache, cached_property
from importlib import metadata as importlib_metadata
from importlib import util as importlib_util
from pathlib import Path
from typing import Any, ClassVar, Literal

from evertrain.envs.answers import extract_final_answer
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

# Runs inside the sandbox under `python -S` (standard library only until it extends sys.path).
# Plain text, no f-strings with user data: the request comes as JSON on stdin.
SCORER_SOURCE = r'''
import os
import sys

_BLOCKED_NAMES = frozenset((
    "eval", "exec", "compile", "open", "input", "breakpoint", "globals", "locals", "vars", "getattr",
    "setattr", "delattr", "dir", "help", "exit", "quit", "print", "memoryview", "type", "super", "object",
    "os", "sys", "gc", "io", "posix", "ctypes", "subprocess", "signal", "socket", "shutil", "pathlib",
    "importlib", "builtins", "inspect", "types", "code", "codeop", "runpy", "pickle", "marshal", "threading",
    "multiprocessing", "mmap", "resource", "pty", "operator", "functools", "system", "popen", "spawn",
    "fork", "kill", "load_module", "get_objects", "modules", "f_back", "f_globals", "f_locals", "f_builtins",
    "gi_frame", "gi_code", "cr_frame", "ag_frame", "tb_frame", "tb_next", "co_code", "mro",
))
_BLOCKED_EVENTS = frozenset((
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "os.kill", "os.killpg", "signal.pthread_kill", "sys.settrace", "sys.setprofile", "sys._current_frames",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "code.__new__",
    "function.__new__",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.addressof", "ctypes.cdata", "ctypes.call_function",
    "ctypes.string_at", "ctypes.wstring_at", "mmap.__new__", "_thread.start_new_thread", "socket.__new__",
    "builtins.input", "os.chmod", "os.remove", "os.rename", "os.truncate", "os.putenv",
))


def _names(code, seen):
    seen.add(id(code))
    yield from code.co_names
    yield from code.co_varnames
    for const in code.co_consts:
        if hasattr(const, "co_names") and id(const) not in seen:
            yield from _names(const, seen)


def _arm(blocked):
    """From here on: refuse dangerous code compiled from strings (the answer) and dangerous events."""
    def hook(event, args):
        if event == "exec":
            code = args[0]
            if getattr(code, "co_filename", "<")[:1] != "<":
                return  # a module's own file (an import): trusted, read-only code
            for name in _names(code, set()):
                if name.startswith("_") or name in _BLOCKED_NAMES:
                    blocked.append("name " + name[:40])
                    raise RuntimeError("blocked name")
        elif event in _BLOCKED_EVENTS:
            blocked.append(event)
            raise RuntimeError("blocked event")
        elif event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(
                (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
            hidden = not isinstance(path, (str, bytes)) or os.fsdecode(path).startswith(("/proc", "/dev", "/sandbox"))
            if writes or hidden:
                blocked.append("open " + str(path)[:60])
                raise RuntimeError("blocked open")
    sys.addaudithook(hook)


def _load(request):
    for key, value in (("OPENBLAS_NUM_THREADS", "1"), ("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"),
                       ("MPLBACKEND", "Agg"), ("MPLCONFIGDIR", "/tmp/matplotlib")):
        os.environ[key] = value
    sys.path.extend(request["site"])
    import importlib
    import types
    for name in request["lazy"]:  # imported at module level, used only to generate problems: load on first use
        stub = types.ModuleType(name)

        def load(attr, name=name):
            sys.modules.pop(name, None)
            return getattr(importlib.import_module(name), attr)

        stub.__getattr__ = load
        sys.modules[name] = stub
    base = request["package_dir"]
    module = "reasoning_gym." + request["module"]
    parts = module.split(".")
    # the package __init__ files import every generator: stand empty packages in for them
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [os.path.join(base, *parts[1:i])]
            sys.modules[name] = stub
    coaching = types.ModuleType("reasoning_gym.coaching")
    coaching.__path__ = [os.path.join(base, "coaching")]
    sys.modules["reasoning_gym.coaching"] = coaching
    for sub in ("attributes", "base_curriculum"):
        loaded = importlib.import_module("reasoning_gym.coaching." + sub)
        for key, value in vars(loaded).items():
            if not key.startswith("_"):
                setattr(coaching, key, value)
    importlib.import_module(module)
    from reasoning_gym.factory import DATASETS
    dataset_cls, config_cls = DATASETS[request["generator"]]
    return dataset_cls(config=config_cls(**request["config"]))


def _revive(entry, keys):
    meta = entry.get("metadata")
    for key in keys:
        if isinstance(meta, dict) and isinstance(meta.get(key), list):
            meta[key] = tuple(tuple(row) if isinstance(row, list) else row for row in meta[key])


def main():
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(0)
    import json
    request = json.loads(b"".join(chunks))
    chunks = None
    nonce = request.pop("nonce")
    report_fd = os.dup(1)  # the only channel the grade is read from; the scorer's stdout goes nowhere
    devnull = os.open("/dev/null", os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)

    def report(kind, text):
        os.write(report_fd, ("%s %s %s\n" % (nonce, kind, text)).encode())
        os._exit(0)

    try:
        dataset = _load(request)
        entry, answer = request["entry"], request["answer"]
        _revive(entry, request["revive"])
    except BaseException as error:
        report("error", "scorer_load_failed " + json.dumps(repr(error)[:300]))
    blocked = []
    _arm(blocked)
    try:
        score = dataset.score_answer(answer, entry)
    except BaseException as error:
        if blocked:
            report("blocked", json.dumps(blocked[:5]))
        report("error", "scorer_raised " + json.dumps(repr(error)[:300]))
    if blocked:
        report("blocked", json.dumps(blocked[:5]))
    try:
        value = float(score)
    except BaseException:
        report("error", "scorer_bad_score " + json.dumps(type(score).__name__))
    report("score", repr(value))


main()
'''


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


def score_in_sandbox(generator: str, answer: str, entry: dict[str, Any], *, config: dict[str, Any] | None = None,
                     limits: Limits | None = None) -> ScoreResult:
    """Run ``generator``'s ``score_answer(answer, entry)`` in a sandbox; see the module docstring for how.

    ``answer`` is what the scorer sees (already extracted and decoded). ``config`` is the generator's
    config (the same overrides its problems were generated with).
    """
    modules = _registry()
    if generator not in modules or generator == "composite":
        raise ValueError(f"not a reasoning-gym generator that scores items: {generator!r}")
    nonce = secrets.token_hex(16)
    request = {"nonce": nonce, "site": list(site_dirs()), "package_dir": _package_dir(), "generator": generator,
               "module": modules[generator], "config": dict(config or {}), "answer": answer, "entry": entry,
               "revive": list(TUPLE_METADATA.get(generator, ())), "lazy": list(LAZY_MODULES)}
    stdin = json.dumps(request).encode()
    record = run_python(SCORER_SOURCE, purpose=SCORER_PURPOSE, limits=limits or SCORER_LIMITS, stdin=stdin,
                        ro_binds=site_dirs())
    return _result(record, nonce)


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
    if kind == "blocked":
        return ScoreResult(None, "answer_blocked", record, {"blocked": _json_or_text(rest)})
    if kind == "error":
        code, _, text = rest.partition(" ")
        reason = code if code in REASONS else "scorer_report_garbled"
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


class ReasoningGym(Environment):
    """``rg:<generator>``: one reasoning-gym generator; see the module docstring.

    Options: ``reward`` ("strict" or "score"), ``config`` (the generator's config overrides, passed to
    ``reasoning_gym.create_dataset``; seed and size are the environment's), ``eval_size`` (the held-out
    pool's size, default 100).
    """

    kind: ClassVar[str] = "reasoning"
    source: ClassVar[str] = f"reasoning-gym {RG_VERSION} (generated)"
    templated: ClassVar[bool] = True

    def __init__(self, generator: str, *, reward: Reward = "strict", config: dict[str, Any] | None = None,
                 eval_size: int = DEFAULT_EVAL_SIZE, **options: Any) -> None:
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

    # --- problems

    def _dataset(self, seed: int, size: int) -> Any:
        import reasoning_gym

        config = dict(self.config)
        if self.generator == "composite":
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

    @cached_property
    def _eval_pool(self) -> list[Problem]:
        dataset = self._dataset(EVAL_SEED, self.eval_size)
        pool: list[Problem] = []
        seen: set[str] = set()
        for index in range(self.eval_size):
            problem = self._problem(dataset[index], "eval")
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
        """A short system prompt with the answer format, one worked example, then the question."""
        multiline = self._multiline()
        user, assistant = MULTILINE_EXAMPLE if multiline else EXAMPLE
        return [{"role": "system", "content": SYSTEM_PROMPT + (MULTILINE_NOTE if multiline else "")},
                {"role": "user", "content": user}, {"role": "assistant", "content": assistant},
                {"role": "user", "content": problem.prompt}]

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
        entry = _entry(problem)
        generator, config = self.scoring_generator(entry)
        answer, reason = extract_final_answer(completion)
        if answer is None:
            return Verdict.fail(reason, sandbox_runs=[])
        decoded = decode_answer(generator, answer)
        if hedge := hedged(decoded, entry["answer"]):
            return Verdict.fail("hedged_answer", answer=answer[:200], hedge=hedge, sandbox_runs=[])
        result = score_in_sandbox(generator, decoded, entry, config=config)
        if result.score and generator in SCORER_FIXES and not _FIX_CHECKS[generator](decoded, entry):
            result.detail["rg_score_before_fix"] = result.score
            result.score, result.reason = 0.0, "wrong_answer"
        detail: dict[str, Any] = {"answer": answer[:200], "rg_score": result.score, **result.detail}
        if generator != self.generator:
            detail["generator"] = generator
        if result.record is not None:
            detail["run_id"] = result.record.run_id
            detail["sandbox_runs"] = [{**result.record.to_row(), "started_at": result.record.started_at.isoformat()}]
        score = result.score or 0.0
        reward = score if self.reward_mode == "score" else float(score == 1.0)
        return Verdict(reward=reward, passed=score == 1.0, reason=result.reason, detail=detail)

    def reference(self, problem: Problem) -> str | None:
        """``#### <the oracle answer>`` (line breaks encoded), or a solution kept in the metadata."""
        entry = _entry(problem)
        generator, _ = self.scoring_generator(entry)
        answer = entry["answer"]
        if answer is None and generator in _METADATA_SOLUTION:
            solution = entry["metadata"].get(_METADATA_SOLUTION[generator])
            answer = solution if isinstance(solution, str) or solution is None else json.dumps(solution)
        if answer is None:
            return None
        return "#### " + encode_answer(generator, answer)

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
