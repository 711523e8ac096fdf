"""Write a model folder so that no reader sees it half-written and no two writers spoil each other."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def publish_folder(dest: Path, write: Callable[[Path], None], done: Callable[[Path], bool]) -> Path:
    """Fill a fresh folder with ``write`` and rename it to ``dest``; return ``dest``.

    The temporary folder is this process's own (``<dest>.partial-<pid>``), so two processes building the same
    model at once (two test workers, two campaigns started together) never delete each other's half-written
    files. When ``done(dest)`` holds after writing, another process finished first and its folder is kept.
    """
    tmp = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        if done(dest):
            return dest
        shutil.rmtree(dest, ignore_errors=True)
        try:
            tmp.rename(dest)
        except OSError:
            if not done(dest):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
