"""Paths that survive moving a campaign's state (data/, mlflow/, state/) to another folder.

Nothing evertrain writes holds an absolute path when a relative one will do: store rows name checkpoints
relative to the checkpoints folder, manifests name the base model relative to the working directory
(the same rule the config's paths follow). MLflow is the exception it cannot avoid: its stores make every
local artifact location absolute on write (``resolve_uri_if_local``), so :func:`rebase_mlflow_artifacts`
rewrites those locations when the tracker finds the artifacts under a new root.
"""

from __future__ import annotations

import logging
from pathlib import Path

from evertrain.data.databases import rebase_mlflow_locations

log = logging.getLogger("evertrain")


def portable(path: str | Path, root: str | Path | None = None) -> str:
    """``path`` relative to ``root`` (default: the working directory) when it lies inside it, else unchanged.

    A hub id or a path outside ``root`` is returned as given: it does not move with the state.
    """
    candidate = Path(path).expanduser()
    if not candidate.is_absolute():
        return str(path)
    base = Path(root).resolve() if root is not None else Path.cwd().resolve()
    try:
        return str(candidate.resolve().relative_to(base))
    except ValueError:
        return str(path)


def resolve_under(path: str | Path, root: str | Path) -> Path:
    """The absolute form of a path stored by :func:`portable` against ``root`` (absolute paths pass through)."""
    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() else Path(root).resolve() / candidate


def rebase_mlflow_artifacts(db_file: Path, old: str, new: str) -> int:
    """Rewrite every artifact location in MLflow's SQLite database that starts with ``old`` to start with ``new``.

    MLflow offers no API to move an experiment's artifact root; its rows are plain strings, so a
    prefix replacement in one transaction is the whole move. Returns the number of rows changed.
    """
    old, new = old.rstrip("/"), new.rstrip("/")
    changed = rebase_mlflow_locations(db_file, old, new)
    if changed:
        log.warning("MLflow artifacts moved: %d location(s) rebased from %s to %s", changed, old, new)
    return changed
