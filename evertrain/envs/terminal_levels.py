"""Generated level-0 terminal tasks: one command that creates, moves, copies, deletes, searches or prints files.

The vendored terminal tasks (``data/terminal/tasks``) start at "count the errors in a log" and end at code
fixes; SmolLM2-135M solves almost none of them, so a terminal campaign began with no signal. These templates
are the curriculum's level 0 (:mod:`evertrain.curriculum`): each is one short command of the kind the model
has seen in its pre-training (``touch``, ``echo``, ``mv``, ``cp``, ``rm``, ``grep``, ``head``), stamped
with file names and words from small fixed lists, so the pool is large and every task is graded by its own
checker like a vendored one.

A generated task's name, ``gen:<template>:<number>``, is all it takes to rebuild it (:func:`generated_spec`),
so a stored problem is graded again from its name alone, as the vendored tasks are.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

PREFIX = "gen:"
HELD_OUT_FROM = 1_000_000  # task numbers from here on are held out (own vocabulary): task_names never draws them

_NAMES = ("notes", "todo", "report", "draft", "list", "summary", "plan", "log", "data", "memo", "ideas", "tasks")
_EXTS = ("txt", "md", "csv", "log")
_WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "ocean", "piano", "rocket", "amber",
          "cedar", "delta", "ember", "frost", "grape", "honey", "ivory", "jelly", "kiwi")
_DIRS = ("backup", "archive", "docs", "old", "src", "out")


# the held-out tasks' own names, words and folders: none is in the lists above, so no held-out task (a number
# from HELD_OUT_FROM on) has the content of a training one, only its kind
_HELD_OUT_VOCABULARY: dict[tuple[str, ...], tuple[str, ...]] = {
    _NAMES: ("budget", "invoice", "journal", "recipe", "letter", "agenda", "diary", "backlog", "outline", "roster",
             "ledger", "minutes"),
    _WORDS: ("banana", "canyon", "desert", "falcon", "garden", "harbor", "island", "jungle", "lantern", "meadow",
             "nectar", "orchid", "pepper", "quartz", "raven", "saddle", "tulip", "velvet", "walnut", "zebra"),
    _DIRS: ("saved", "vault", "stash", "inbox", "shelf", "final"),
}


class _HeldOutRandom(random.Random):
    """A template's random source for a held-out task: it draws from the held-out vocabulary."""

    def choice(self, seq: Any) -> Any:
        return super().choice(_HELD_OUT_VOCABULARY.get(seq, seq) if isinstance(seq, tuple) else seq)


def _file(rng: random.Random, avoid: set[str]) -> str:
    while True:
        name = f"{rng.choice(_NAMES)}{rng.choice(('', '_1', '_2', '_a'))}.{rng.choice(_EXTS)}"
        if name not in avoid:
            avoid.add(name)
            return name


def _lines(rng: random.Random, count: int) -> list[str]:
    return [f"{rng.choice(_WORDS)} {rng.randint(1, 99)} {rng.choice(_WORDS)}" for _ in range(count)]


Template = Callable[[random.Random], dict[str, Any]]


def _layout(expected: dict[str, str]) -> str:
    """The check line that the whole workspace is ``expected`` (path -> kind), no more, no less: what a one-command
    task asks leaves nothing else behind (a rename where a delete was asked, a link or a folder where a file was)."""
    return f"found = tree()\nassert found == {expected!r}, f'the workspace holds {{found}}'\n"


def _touch(rng: random.Random) -> dict[str, Any]:
    used: set[str] = set()
    other, name = _file(rng, used), _file(rng, used)
    return {"prompt": f"Create an empty file named {name}.", "files": {other: "keep me\n"},
            "solution": [f"touch {name}"],
            "check": _layout({name: "file", other: "file"})
                     + f"assert read({name!r}) == '', '{name} is not empty'\n"
                       f"assert read({other!r}) == 'keep me\\n', '{other} changed'\n"}


def _write_word(rng: random.Random) -> dict[str, Any]:
    used: set[str] = set()
    other, name, word = _file(rng, used), _file(rng, used), rng.choice(_WORDS)
    return {"prompt": f"Write the word {word} into a new file named {name}.", "files": {other: "hello\n"},
            "solution": [f"echo {word} > {name}"],
            "check": _layout({name: "file", other: "file"})
                     + f"assert lines({name!r}) == [{word!r}], 'wrong content'\n"}


def _mkdir(rng: random.Random) -> dict[str, Any]:
    used: set[str] = set()
    other, folder = _file(rng, used), rng.choice(_DIRS)
    return {"prompt": f"Make a folder named {folder}.", "files": {other: "hello\n"},
            "solution": [f"mkdir {folder}"],
            "check": _layout({folder: "dir", other: "file"})}


def _move(rng: random.Random) -> dict[str, Any]:
    used: set[str] = set()
    src, dst = _file(rng, used), _file(rng, used)
    text = "\n".join(_lines(rng, 3)) + "\n"
    return {"prompt": f"Rename the file {src} to {dst}.", "files": {src: text},
            "solution": [f"mv {src} {dst}"],
            "check": _layout({dst: "file"}) + f"assert read({dst!r}) == {text!r}, '{dst} changed'\n"}


def _copy(rng: random.Random) -> dict[str, Any]:
    used: set[str] = set()
    src, dst = _file(rng, used), _file(rng, used)
    text = "\n".join(_lines(rng, 2)) + "\n"
    return {"prompt": f"Make a copy of {src} named {dst}.", "files": {src: text},
            "solution": [f"cp {src} {dst}"],
            "check": _layout({dst: "file", src: "file"})
                     + f"assert read({src!r}) == {text!r}, '{src} changed'\n"
                       f"assert read({dst!r}) == {text!r}, '{dst} is different'\n"}


def _delete(rng: random.Random) -> dict[str, Any]:
    used: set[str] = set()
    gone, keep = _file(rng, used), _file(rng, used)
    return {"prompt": f"Delete the file {gone}.", "files": {gone: "old\n", keep: "keep me\n"},
            "solution": [f"rm {gone}"],
            "check": _layout({keep: "file"}) + f"assert read({keep!r}) == 'keep me\\n', '{keep} changed'\n"}


def _move_into(rng: random.Random) -> dict[str, Any]:
    used: set[str] = set()
    name, folder = _file(rng, used), rng.choice(_DIRS)
    return {"prompt": f"Move the file {name} into the folder {folder}.",
            "files": {name: "move me\n", f"{folder}/.keep": ""},
            "solution": [f"mv {name} {folder}/"],
            "check": _layout({folder: "dir", f"{folder}/.keep": "file", f"{folder}/{name}": "file"})
                     + f"assert read('{folder}/{name}') == 'move me\\n', '{name} changed'\n"}


def _grep(rng: random.Random) -> dict[str, Any]:
    used: set[str] = set()
    src, out = _file(rng, used), _file(rng, used)
    word = rng.choice(_WORDS)
    lines = _lines(rng, 6)
    lines[rng.randrange(6)] = f"{word} {rng.randint(1, 99)} {rng.choice(_WORDS)}"
    wanted = [line for line in lines if word in line]
    return {"prompt": f"Write the lines of {src} that contain the word {word} into {out}.",
            "files": {src: "\n".join(lines) + "\n"}, "solution": [f"grep {word} {src} > {out}"],
            "check": _layout({out: "file", src: "file"}) + f"assert lines({out!r}) == {wanted!r}, 'wrong lines'\n"}


def _head(rng: random.Random) -> dict[str, Any]:
    used: set[str] = set()
    src, out = _file(rng, used), _file(rng, used)
    lines = _lines(rng, 5)
    return {"prompt": f"Write the first line of {src} into {out}.", "files": {src: "\n".join(lines) + "\n"},
            "solution": [f"head -n 1 {src} > {out}"],
            "check": _layout({out: "file", src: "file"}) + f"assert lines({out!r}) == [{lines[0]!r}], 'wrong line'\n"}


TEMPLATES: dict[str, Template] = {
    "touch": _touch, "write": _write_word, "mkdir": _mkdir, "move": _move, "copy": _copy,
    "delete": _delete, "move-into": _move_into, "grep": _grep, "head": _head,
}


def task_spec(template: str, number: int) -> dict[str, Any]:
    """The prompt, files, checker and reference solution of generated task ``number`` of ``template``."""
    if template not in TEMPLATES:
        raise ValueError(f"terminal: unknown generated task template {template!r}; known: {sorted(TEMPLATES)}")
    source = _HeldOutRandom if number >= HELD_OUT_FROM else random.Random
    return TEMPLATES[template](source(f"terminal-level0:{template}:{number}"))


def generated_spec(name: str) -> dict[str, Any]:
    """The fields of the task named ``gen:<template>:<number>`` (prompt, files, check, solution), from which
    :meth:`evertrain.envs.terminal.Terminal.task` builds its ``TerminalTask`` (this module imports nothing of
    the environment's, so the two form no import cycle)."""
    template, _, number = name.removeprefix(PREFIX).rpartition(":")
    if not name.startswith(PREFIX) or not number.isdigit():
        raise ValueError(f"terminal: {name!r} is not a generated task name (gen:<template>:<number>)")
    spec = task_spec(template, int(number))
    return {"prompt": spec["prompt"], "files": spec["files"], "check": spec["check"], "solution": spec["solution"]}


def task_names(n: int, seed: int, held_out: bool = False) -> list[str]:
    """``n`` generated task names drawn from ``seed``: templates in turn, numbers at random. ``held_out``: the
    terminal's gate and sealed test split with ``held_out = "generated"``, numbers from :data:`HELD_OUT_FROM` on
    (their own vocabulary), so no training draw names one of them; a prefix of a longer draw, so the sealed test
    split is the names after the gate's."""
    rng = random.Random(f"terminal-level0-{'held-out' if held_out else 'draw'}:{seed}")
    order = sorted(TEMPLATES)
    rng.shuffle(order)
    start = HELD_OUT_FROM if held_out else 0
    return [f"{PREFIX}{order[i % len(order)]}:{start + rng.randrange(HELD_OUT_FROM)}" for i in range(n)]
