"""``gsm8k``: grade-school math word problems (OpenAI, MIT licence), vendored in ``data/gsm8k``.

The held-out split is fixed by content: a problem is held out when its id (a content hash) falls in
one tenth of the hash space, so the split never depends on file order and never overlaps training.
"""

from __future__ import annotations

import json
import re
from functools import cached_property, lru_cache
from pathlib import Path
from typing import ClassVar

from evertrain.envs.answers import MathEnvironment
from evertrain.envs.base import FixedSplits, Problem, Split, vendored_path

_CALCULATOR = re.compile(r"<<[^>]*>>")


class GSM8K(FixedSplits, MathEnvironment):
    name: ClassVar[str] = "gsm8k"
    source: ClassVar[str] = "data/gsm8k/train.jsonl (OpenAI grade-school-math, MIT)"
    system_prompt: ClassVar[str] = (
        "Solve the math word problem step by step. "
        "Give the final answer on the last line as '#### <number>'."
    )
    examples: ClassVar[tuple[tuple[str, str], ...]] = (
        (
            "Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?",
            "3 boxes * 4 apples = 12 apples.\n12 - 2 = 10 apples are left.\n#### 10",
        ),
    )

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        path = vendored_path("gsm8k", "train.jsonl")
        stat = path.stat()
        # the parsed file is kept per process (a campaign, a test session opens the environment many times);
        # each instance gets Problems of its own, with payloads of its own
        return {split: [Problem(self.name, pid, question, {"answer": answer, "solution": solution}, split)
                        for pid, question, answer, solution in rows]
                for split, rows in _parsed(self.name, path, stat.st_mtime_ns, stat.st_size).items()}

    def reference(self, problem: Problem) -> str | None:
        return problem.payload["solution"]


@lru_cache(maxsize=4)
def _parsed(name: str, path: Path, _mtime_ns: int, _size: int) -> dict[str, tuple[tuple[str, str, str, str], ...]]:
    """GSM8K's rows split by content hash: (id, question, answer, solution without calculator marks) per split.
    Keyed by the file's modification time and size too: a file replaced in place is read again."""
    splits: dict[str, list[tuple[str, str, str, str]]] = {"train": [], "eval": []}
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                question, solution = row["question"], row["answer"]
                answer = solution.rsplit("####", 1)[1].strip()
            except (json.JSONDecodeError, KeyError, IndexError, AttributeError) as error:
                raise ValueError(f"{path}:{number}: not a GSM8K row ({error!r})") from None
            payload = {"answer": answer, "solution": _CALCULATOR.sub("", solution)}
            problem = Problem.make(name, question, payload)
            split: Split = "eval" if int(problem.id, 16) % 10 == 0 else "train"
            splits[split].append((problem.id, question, answer, payload["solution"]))
    return {split: tuple(rows) for split, rows in splits.items()}
