"""Curriculum levels an environment package declares for itself, read from its source without importing it.

A package written for another system (a verifiers taskset, an OpenEnv server) can bring its own curriculum: a
module-level ``CURRICULUM``, a literal list of option tables, easiest first::

    CURRICULUM = [{"digits": 1}, {"digits": 2}, {"digits": 2, "terms": 3}]

Level ``k`` is the environment with the ``k``-th table laid over its configured options (for a verifiers taskset,
fields of its ``TasksetConfig``; for an OpenEnv server, keyword arguments of its ``reset``). The list is read with
``ast.literal_eval`` from the module's file, so naming a package here runs none of its code (its code runs in the
rubric worker's jail or its server's), and anything but a literal is refused with the package's name.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
from pathlib import Path
from typing import Any

NAME = "CURRICULUM"


def module_file(module: str, path: str | None = None) -> Path | None:
    """The source file of ``module`` (``package.sub``), found without importing it or its parents: looked up under
    ``path`` when given, else on the import path (None when there is no such module or it has no Python source)."""
    top, *rest = module.split(".")
    try:
        spec = (importlib.machinery.PathFinder.find_spec(top, [path]) if path
                else importlib.util.find_spec(top))  # a top-level name: finding it runs nothing
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    for folder in spec.submodule_search_locations or []:
        base = Path(folder).joinpath(*rest[:-1])
        for candidate in (base / f"{rest[-1]}.py", base / rest[-1] / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def declared_levels(modules: list[str], path: str | None = None, *, owner: str = "",
                    reserved: frozenset[str] = frozenset()) -> list[dict[str, Any]] | None:
    """The ``CURRICULUM`` of the first of ``modules`` that declares one (None when none does). Raises ValueError,
    naming ``owner`` and the file, for a declaration that is not a non-empty literal list of tables with string
    keys, or whose tables set a ``reserved`` option (one the adapter keeps for itself)."""
    for module in modules:
        file = module_file(module, path)
        if file is None:
            continue
        tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
            if not any(isinstance(t, ast.Name) and t.id == NAME for t in targets):
                continue
            where = f"{owner or module}: {NAME} in {file}"
            try:
                value = ast.literal_eval(node.value)  # type: ignore[arg-type]
            except ValueError:
                raise ValueError(f"{where} must be a literal list of option tables (it is read without importing "
                                 f"the package), got {ast.unparse(node.value)[:80]!r}") from None  # type: ignore[arg-type]
            if not isinstance(value, list) or not value or not all(
                    isinstance(level, dict) and all(isinstance(key, str) for key in level) for level in value):
                raise ValueError(f"{where} must be a non-empty list of option tables (dicts with string keys), easiest "
                                 f"first, got {value!r:.80}")
            for level in value:
                if clash := set(level) & reserved:
                    raise ValueError(f"{owner or module}: a CURRICULUM level sets options the adapter keeps for itself "
                                     f"({', '.join(sorted(clash))})")
            return [dict(level) for level in value]
    return None


def level_options(levels: list[dict[str, Any]] | None, level: Any, owner: str) -> dict[str, Any]:
    """The options of declared ``level`` (a problem's ``payload["level"]``); ValueError for any other value."""
    count = len(levels or [])
    if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level < count:
        raise ValueError(f"{owner}: no curriculum level {level!r} (the package declares {count})")
    return levels[level]  # type: ignore[index]


def describe(options: dict[str, Any]) -> str:
    """A level's options in a few words."""
    return ", ".join(f"{key} {value}" for key, value in sorted(options.items()))[:120] or "as configured"
