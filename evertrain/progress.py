"""Progress bars on stderr: its own module, so a command that shows one (``evertrain score``) imports tqdm and
nothing else (the stages' shared module, :mod:`evertrain.tasks.base`, brings torch, transformers and Prefect:
about 5 CPU-seconds of imports)."""

from __future__ import annotations

import os
import sys
from typing import Any

from evertrain import interrupts


class _Bar:
    """A tqdm bar whose every step is also a place where a recorded stop signal stops the run
    (:func:`evertrain.interrupts.check`), where the step is counted on the main thread (rollout, evaluation,
    update); a bar counted from pool threads (grading) stops at the stage's end."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def update(self, n: float = 1) -> Any:
        interrupts.check()
        return self._bar.update(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)

    def __enter__(self) -> _Bar:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._bar.__exit__(*exc)


def progress(total: int, desc: str, unit: str = "it") -> Any:
    """A progress bar on stderr (off when EVERTRAIN_PROGRESS=0)."""
    # late: tqdm; the CLI imports this module at its top and `evertrain --help` loads no third-party library
    from tqdm.auto import tqdm

    disable = os.environ.get("EVERTRAIN_PROGRESS", "1") == "0"
    return _Bar(tqdm(total=total, desc=desc, unit=unit, disable=disable, file=sys.stderr, leave=False,
                     dynamic_ncols=True))
