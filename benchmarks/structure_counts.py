"""Counts of the code's structure, for a refactor's before and after (issue 42's closing note).

- **function-local imports**: ``import`` statements inside a function (any depth) of the library (``evertrain/``,
  ``flows/``, ``tasks/``, ``models/``), first-party (``evertrain`` or relative) and the rest (third-party and the
  standard library);
- **statistics outside stats.py**: functions of the library and of ``benchmarks/`` that compute a statistic
  themselves (call ``NormalDist``, ``np.quantile``/``np.percentile``/``statistics.quantiles``, a bootstrap's
  resampling, or are named for one: wilson, z statistic, alpha spending, power, percentile, bootstrap, and do
  not hand the arithmetic to ``evertrain.stats``), listed so a reader can judge each;
- **hand-written process stops**: calls that signal or kill a process (a Popen's ``.kill()``, ``.terminate()``,
  ``.send_signal()``; ``os.kill``, ``os.killpg``) in the library outside ``evertrain/processes.py`` (whose ``stop``
  is the one way to stop a child), listed so a reader can judge each (a sandbox killing its jail's group at once,
  a fault injection signalling itself);
- **files over 600 lines** in the library.

Run ``python benchmarks/structure_counts.py [--root PATH] [--save NAME]``: prints a table; ``--save`` writes the
numbers to ``benchmarks/results/structure_counts_<NAME>.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

LIBRARY = ("evertrain", "flows", "tasks", "models")
STATS_HOME = Path("evertrain/stats.py")
LONG_FILE = 600
STAT_NAME = re.compile(r"wilson|z_statistic|alpha_spent|gate_power|detectable|percentile|bootstrap|quantile",
                       re.IGNORECASE)
STAT_CALLS = {"NormalDist", "quantile", "percentile", "quantiles", "inv_cdf"}


def _files(root: Path, folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for folder in folders for p in (root / folder).rglob("*.py") if ".venv" not in p.parts)


def local_imports(root: Path) -> dict[str, int]:
    """Function-local import statements of the library (each counted once, however deep): first-party and the
    rest."""
    first = other = 0
    for path in _files(root, LIBRARY):
        tree = ast.parse(path.read_text(), str(path))
        seen: set[int] = set()
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if id(node) in seen or not isinstance(node, ast.Import | ast.ImportFrom):
                    continue
                seen.add(id(node))
                if isinstance(node, ast.Import):
                    mine = any(alias.name.split(".")[0] == "evertrain" for alias in node.names)
                else:
                    mine = bool(node.level) or (node.module or "").split(".")[0] == "evertrain"
                first += mine
                other += not mine
    return {"first_party": first, "third_party": other, "total": first + other}


def statistics_outside(root: Path) -> list[str]:
    """'file:function' for each function outside stats.py that computes a statistic itself."""
    found = []
    for path in _files(root, (*LIBRARY, "benchmarks")):
        relative = path.relative_to(root)
        if relative == STATS_HOME:
            continue
        tree = ast.parse(path.read_text(), str(path))
        from_stats = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and node.module == "evertrain.stats" for alias in node.names}
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            # a call of a library's statistic (np.quantile, NormalDist().inv_cdf ...), not of stats.py's own
            calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                     for node in ast.walk(function) if isinstance(node, ast.Call)} - from_stats
            # named for a statistic and not handing its arithmetic to stats.py (a call of a name imported from
            # evertrain.stats, or of ``stats.<name>``)
            delegates = any(isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Name) and node.func.id in from_stats)
                or (isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "stats")) for node in ast.walk(function))
            named = STAT_NAME.search(function.name) and not function.name.startswith(("format_", "_format"))
            if (named and not delegates) or calls & STAT_CALLS:
                found.append(f"{relative}:{function.name}")
    return sorted(set(found))


PROCESSES_HOME = Path("evertrain/processes.py")
STOP_FUNCTIONS = {"kill", "killpg"}  # of os


def process_stops(root: Path) -> list[str]:
    """'file:line' of each call that signals or kills a process, outside processes.py."""
    found = []
    for path in _files(root, LIBRARY):
        relative = path.relative_to(root)
        if relative == PROCESSES_HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value
            by_os = isinstance(owner, ast.Name) and owner.id == "os"
            # a Popen's own: kill() and terminate() take no argument (the jail's kill(reason) and ray.kill(actor)
            # are not process stops written by hand)
            popen = not by_os and ((node.func.attr in {"kill", "terminate"} and not node.args)
                                   or node.func.attr == "send_signal")
            if (by_os and node.func.attr in STOP_FUNCTIONS) or popen:
                found.append(f"{relative}:{node.lineno}")
    return sorted(found, key=lambda item: (item.rpartition(":")[0], int(item.rpartition(":")[2])))


def long_files(root: Path) -> list[tuple[str, int]]:
    out = []
    for path in _files(root, LIBRARY):
        lines = len(path.read_text().splitlines())
        if lines > LONG_FILE:
            out.append((str(path.relative_to(root)), lines))
    return sorted(out, key=lambda item: -item[1])


def counts(root: Path) -> dict[str, object]:
    stats = statistics_outside(root)
    longs = long_files(root)
    stops = process_stops(root)
    return {"local_imports": local_imports(root), "statistics_outside_stats": len(stats), "statistics": stats,
            "process_stops_outside_processes": len(stops), "process_stops": stops,
            "files_over_600_lines": len(longs), "long_files": longs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--save", help="write benchmarks/results/structure_counts_<SAVE>.json")
    args = parser.parse_args()
    found = counts(args.root)
    imports = found["local_imports"]
    assert isinstance(imports, dict)
    print(f"{'function-local imports (first-party / other)':<48} {imports['first_party']} / {imports['third_party']}")
    print(f"{'statistics outside evertrain/stats.py':<48} {found['statistics_outside_stats']}")
    for name in found["statistics"]:  # type: ignore[union-attr]
        print(f"    {name}")
    print(f"{'process stops outside evertrain/processes.py':<48} {found['process_stops_outside_processes']}")
    for name in found["process_stops"]:  # type: ignore[union-attr]
        print(f"    {name}")
    print(f"{'library files over 600 lines':<48} {found['files_over_600_lines']}")
    for name, lines in found["long_files"]:  # type: ignore[union-attr]
        print(f"    {name} ({lines})")
    if args.save:
        commit = subprocess.run(["git", "-C", str(args.root), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        out = Path(__file__).resolve().parent / "results" / f"structure_counts_{args.save}.json"
        out.write_text(json.dumps({**found, "commit": commit, "command": " ".join(sys.argv),
                                   "machine": platform.node()}, indent=2) + "\n")
        print(f"saved {out}")


if __name__ == "__main__":
    main()
