"""The layering, checked on every test run (so in CI): a change that breaks it fails here.

evertrain's code lives in four top-level folders imported under one namespace (``flows/`` is
``evertrain.flows``, ``tasks/`` is ``evertrain.tasks``, ``models/`` is ``evertrain.models``, the rest is
``evertrain/``), a mapping that generic import tools (import-linter's grimp) do not follow, so the contracts
are read here from the source with ``ast``, function-local imports included:

- layers, highest first: flows (the orchestration) > tasks (the stages) > models (trainer and inference) >
  envs (environments and verifiers) > sandbox (isolated execution). A module may import only its own layer or
  those below it.
- nothing imports the CLI (it is the outermost shell).
- no import cycles between modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"evertrain": "evertrain", "flows": "evertrain.flows", "tasks": "evertrain.tasks",
           "models": "evertrain.models"}
LAYERS = ("evertrain.flows", "evertrain.tasks", "evertrain.models", "evertrain.envs", "evertrain.sandbox")
CLI = "evertrain.cli"
# the docs generator renders the CLI reference from the parser itself: reading the CLI is its job
CLI_READERS = {"evertrain.docs_reference"}


def modules(root: Path) -> dict[str, Path]:
    """Every module of the project, by its import name."""
    found: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in (root / folder).rglob("*.py"):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module or name, line) for every import in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def layer_of(module: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return index
    return None


def violations(root: Path) -> list[str]:
    """Every broken contract, as 'module:line -> imported (why)'."""
    found = modules(root)
    broken: list[str] = []
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        graph[name] = set()
        for imported, line in imports(name, path):
            if not imported.startswith("evertrain"):
                continue
            mine, theirs = layer_of(name), layer_of(imported)
            if mine is not None and theirs is not None and theirs < mine:
                broken.append(f"{name}:{line} -> {imported} (imports a higher layer: {LAYERS[theirs]})")
            if (imported == CLI or imported.startswith(CLI + ".")) and name != CLI and name not in CLI_READERS:
                broken.append(f"{name}:{line} -> {imported} (nothing imports the CLI)")
            target = imported
            while target and target not in found:
                target = target.rpartition(".")[0]
            # a package's own __init__ is not a dependency of its modules
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    broken += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    return sorted(set(broken))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def test_the_layering_holds() -> None:
    assert violations(ROOT) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for folder in FOLDERS:
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent != tmp_path and not (path.parent / "__init__.py").exists():
            (path.parent / "__init__.py").write_text("")
        path.write_text(text)
    return tmp_path


def test_a_violating_change_fails(tmp_path: Path) -> None:
    """The checker catches each kind of violation (a test of the test: it can fail)."""
    root = _tree(tmp_path, {
        "evertrain/sandbox/run.py": "def f():\n    from evertrain.envs.code import grade\n",  # upward, local
        "evertrain/envs/code.py": "from evertrain.sandbox import run\n",  # downward: fine
        "evertrain/report.py": "from evertrain.cli import main\n",  # the CLI imported
        "evertrain/a.py": "import evertrain.b\n",
        "evertrain/b.py": "from evertrain import a\n",  # a cycle
        "tasks/score.py": "from ..models import policy\n",  # relative, downward: fine
        "models/policy.py": "from evertrain.tasks import score\n",  # upward
    })
    found = violations(root)
    assert any(v.startswith("evertrain.sandbox.run:2 -> evertrain.envs") for v in found), found
    assert any("evertrain.report:1 -> evertrain.cli" in v for v in found), found
    assert any(v.startswith("import cycle:") and "evertrain.a" in v and "evertrain.b" in v for v in found), found
    assert any(v.startswith("evertrain.models.policy:1 -> evertrain.tasks") for v in found), found
    layer_breaks = [v for v in found if not v.startswith("import cycle:")]
    assert not any(v.startswith("evertrain.envs.code") for v in layer_breaks), found
    assert not any(v.startswith("evertrain.tasks.score") for v in found), found
