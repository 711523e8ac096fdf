"""Progress bars on stderr: its own module, so a command that shows one (``evertrain score``) imports tqdm and
nothing else (the stages' shared module, :mod:`evertrain.tasks.base`, brings torch, transformers and Prefect:
about 5 CPU-seconds of imports)."""

from __future__ import annotations

import os
import sys
from typing import Any


def progress(total: int, desc: str, unit: str = "it") -> Any:
    """A progress bar on stderr (off when EVERTRAIN_PROGRESS=0)."""
    from tqdm.auto import tqdm

    disable = os.environ.get("EVERTRAIN_PROGRESS", "1") == "0"
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, file=sys.stderr, leave=False,
                dynamic_ncols=True)
