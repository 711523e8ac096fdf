"""The layering, checked on every test run (so in CI): a change that breaks it fails here.

evertrain's code lives in four top-level folders imported under one namespace (``flows/`` is
``evertrain.flows``, ``tasks/`` is ``evertrain.tasks``, ``models/`` is ``evertrain.models``, the rest is
``evertrain/``), a mapping that generic import tools (import-linter's grimp) do not follow, so the contracts
are read here from the source with ``ast``, function-local imports included:

- layers, highest first: flows (the orchestration) > tasks (the stages) > models (the learner) and inference, side
  by side > envs (environments and verifiers) > sandbox (isolated execution). A module may import only its own
  layer or those below it.
- three parts apart (:data:`PARTS`): the **learner** (``evertrain.models``' loss, train step, data-parallel update
  and log-probs) never imports inference, the orchestration or the store; **inference** (``evertrain.inference``)
  never imports the learner, the orchestration or the store; both may import the **model files** they share
  (checkpoints, precision, the shared forward pass, the embedded models), which import neither.
- nothing imports upward across the store and the report: the store (``evertrain.data``) imports no part above
  it, and the report (``evertrain.report``) does not import the endpoint (``evertrain.serving``).
- nothing imports the CLI (it is the outermost shell).
- no import cycles between modules.
- a first-party import inside a function says why it is there: a comment with the word ``late`` on the import's
  line or on the comment lines just above its block of imports (``# late: torch; --help must not import it``,
  ``# late: breaks the cycle a -> b``); every other first-party import is at the module's top
  (:func:`unexplained_local_imports`; :data:`LATE_PENDING` lists the modules not yet held to it).
- no SQL outside the store: only ``evertrain/data/`` holds SQL statements (string literals that begin with
  SELECT, INSERT INTO, UPDATE .. SET, DELETE FROM, CREATE, ALTER, DROP or WITH .. AS), except the modules
  in :data:`SQL_ALLOWED` (SQL that is a task's content, not the store's) and :data:`SQL_PENDING`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"evertrain": "evertrain", "flows": "evertrain.flows", "tasks": "evertrain.tasks",
           "models": "evertrain.models"}
# highest first; a tuple of packages is one layer of parts side by side (neither imports the other: PARTS says so)
LAYERS: tuple[tuple[str, ...], ...] = (("evertrain.flows",), ("evertrain.tasks",),
                                       ("evertrain.models", "evertrain.inference"), ("evertrain.envs",),
                                       ("evertrain.sandbox",))
CLI = "evertrain.cli"
# the docs generator renders the CLI reference from the parser itself: reading the CLI is its job
CLI_READERS = {"evertrain.docs_reference"}


# the store's package: the one place that speaks SQL to the store (named queries, migrations)
SQL_HOME = "evertrain.data"
# SQL that is a task's content, not the store's: the SQL environment's problems, and the sql tool of the tool
# environments (each builds a scratch table and runs the model's query on it; evertrain/sandbox/sql_worker.py,
# which runs them, holds no statement of its own)
SQL_ALLOWED = {"evertrain.envs.sql", "evertrain.envs.tools"}
SQL_PENDING: set[str] = set()  # modules whose SQL is being moved into evertrain/data (none now)
SQL_STATEMENT = re.compile(
    r"\A[\s(]*(?:SELECT\s|INSERT\s+INTO\s|UPDATE\s+\S+\s+SET\s|DELETE\s+FROM\s|"
    r"CREATE\s+(?:OR\s+REPLACE\s+)?(?:TEMP\w*\s+)?(?:TABLE|VIEW|INDEX|UNIQUE|DATABASE|SCHEMA|SEQUENCE|MACRO)\b|"
    r"ALTER\s+TABLE\s|DROP\s+(?:TABLE|VIEW|INDEX|DATABASE|SCHEMA)\b|WITH\s+(?:RECURSIVE\s+)?\w+\s+AS\s*\()")


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


def within(module: str, packages: tuple[str, ...] | frozenset[str] | set[str]) -> bool:
    """Whether ``module`` is one of ``packages`` or inside one."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def layer_of(module: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if within(module, layer):
            return index
    return None


# The parts of the system, by module (the most specific name wins); see part_of. The model files are what the learner
# writes and inference reads (checkpoints, precision, the shared prefix-cached forward pass, the embedded models).
MODEL_FILES = ("evertrain.models.checkpoint", "evertrain.models.precision", "evertrain.models.forward",
               "evertrain.models.tiny", "evertrain.models.convert", "evertrain.models.folders")
PARTS: dict[str, tuple[str, ...]] = {
    "orchestration": ("evertrain.flows", "evertrain.tasks", "evertrain.runtime", "evertrain.cluster",
                      "evertrain.cli", "evertrain.serving", "evertrain.report", "evertrain.tracking",
                      "evertrain.retention", "evertrain.approval", "evertrain.flywheel", "evertrain.drift",
                      "evertrain.curriculum", "evertrain.mix", "evertrain.export", "evertrain.docs_reference",
                      "evertrain.promises"),
    "store": ("evertrain.data",),
    "learner": ("evertrain.models",),
    "model files": MODEL_FILES,
    "inference": ("evertrain.inference",),
    "environments": ("evertrain.envs", "evertrain.scoring"),
    "sandbox": ("evertrain.sandbox",),
}
# (part, parts it must never import, why)
PART_CONTRACTS = (
    ("learner", ("inference", "orchestration", "store"), "the learner trains on what it is given"),
    ("inference", ("learner", "orchestration", "store"), "inference samples what it is asked"),
    ("model files", ("learner", "inference", "orchestration", "store"), "both parts share them"),
    ("store", ("orchestration", "learner", "inference"), "the store answers named questions, it asks none"),
)
# single imports that would run upward between two modules of one part
UPWARD = (("evertrain.report", "evertrain.serving", "the report renders what the store answers, not the endpoint"),)


def part_of(module: str) -> str:
    """The part ``module`` belongs to (the package named most specifically wins); 'common' for the rest (config,
    stats, processes, the small shared helpers)."""
    best, length = "common", -1
    for part, packages in PARTS.items():
        for package in packages:
            if within(module, (package,)) and len(package) > length:
                best, length = part, len(package)
    # the package's own __init__ (its one error, ModelError) is shared by every part that imports a model file
    return "model files" if module == "evertrain.models" else best


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
                broken.append(f"{name}:{line} -> {imported} (imports a higher layer: {', '.join(LAYERS[theirs])})")
            if (imported == CLI or imported.startswith(CLI + ".")) and name != CLI and name not in CLI_READERS:
                broken.append(f"{name}:{line} -> {imported} (nothing imports the CLI)")
            target = imported
            while target and target not in found:
                target = target.rpartition(".")[0]
            module = target or imported  # the module a name was imported from (``evertrain.models.ModelError``)
            for part, forbidden, why in PART_CONTRACTS:
                if part_of(name) == part and part_of(module) in forbidden:
                    broken.append(f"{name}:{line} -> {module} (the {part} imports the {part_of(module)}: {why})")
            for lower, upper, why in UPWARD:
                if within(name, (lower,)) and within(module, (upper,)):
                    broken.append(f"{name}:{line} -> {module} (imports upward: {why})")
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


def _literal_text(node: ast.AST) -> str | None:
    """The text of a string literal, an f-string's placeholders read as ``x`` (so ``f"UPDATE {t} SET"`` is
    seen as ``UPDATE x SET``); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "x" for part in node.values)
    return None


def sql_statements(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, first words) of every string literal in ``source`` that is an SQL statement."""
    found = []
    inside_fstring: set[int] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.JoinedStr):
            inside_fstring.update(id(part) for part in node.values)
        if id(node) in inside_fstring:
            continue  # a piece of an f-string: the whole f-string is what is read
        text = _literal_text(node)
        if text is not None and SQL_STATEMENT.match(text):
            found.append((node.lineno, " ".join(text.split())[:60]))
    return found


def sql_outside_the_store(root: Path, allowed: set[str] = SQL_ALLOWED | SQL_PENDING) -> list[str]:
    """Every SQL statement in a library module outside the store's package, as 'module:line: SQL'."""
    broken = []
    for name, path in sorted(modules(root).items()):
        if name == SQL_HOME or name.startswith(SQL_HOME + ".") or name in allowed:
            continue
        broken += [f"{name}:{line}: {text}" for line, text in sql_statements(path.read_text(), str(path))]
    return broken


LATE_MARK = "late"  # the word a comment beside (or just above) a function-local first-party import carries
# packages another change is editing now, not yet held to the rule (none: the learner's and inference's were the
# last, their imports are at the top or explained)
LATE_PENDING: set[str] = set()


def _first_party(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "evertrain" for alias in node.names)
    return bool(node.level) or (node.module or "").split(".")[0] == "evertrain"


def local_import_comments(source: str, filename: str = "<string>") -> list[tuple[int, bool]]:
    """(line, explained) for every first-party import inside a function: explained when a comment holding
    :data:`LATE_MARK` is on one of its lines or on the comment lines just above the block of imports it is in."""
    lines = source.splitlines()
    tree = ast.parse(source, filename)
    local: dict[int, ast.Import | ast.ImportFrom] = {}
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    local[node.lineno] = node
    by_line = {line: node for node in local.values() for line in range(node.lineno, (node.end_lineno or 0) + 1)}
    found = []
    for node in sorted(local.values(), key=lambda n: n.lineno):
        if not _first_party(node):
            continue
        own = [lines[i - 1] for i in range(node.lineno, (node.end_lineno or node.lineno) + 1)]
        start = node.lineno
        while start - 1 in by_line:  # up the block of imports this one is in
            start = by_line[start - 1].lineno
        above = []
        while start - 1 >= 1 and lines[start - 2].strip().startswith("#"):
            above.append(lines[start - 2])
            start -= 1
        comments = [text.partition("#")[2] for text in own if "#" in text] + above
        found.append((node.lineno, any(LATE_MARK in comment.lower() for comment in comments)))
    return found


def unexplained_local_imports(root: Path, pending: set[str] = LATE_PENDING) -> list[str]:
    """'module:line' of every function-local first-party import without a ``late`` comment."""
    return [f"{name}:{line}" for name, path in sorted(modules(root).items()) if not within(name, pending)
            for line, explained in local_import_comments(path.read_text(), str(path)) if not explained]


def test_every_local_first_party_import_says_why() -> None:
    """A first-party import inside a function breaks a real cycle or keeps something heavy out of a module that
    must stay light (the CLI, config validation, the sandbox's workers), and says so: ``# late: ...``."""
    found = unexplained_local_imports(ROOT)
    assert found == [], ("function-local first-party imports without a `# late: why` comment (move them to the "
                         "module's top, or say why they are late):\n" + "\n".join(found))


def test_an_unexplained_local_import_fails_the_check(tmp_path: Path) -> None:
    """The rule catches an uncommented function-local first-party import (a test of the test: it can fail), and
    passes explained ones, third-party ones and top-level ones."""
    planted = {
        "evertrain/report.py": "def f():\n    from evertrain.data.store import Store\n",  # unexplained
        # a comment that gives no reason, on a relative import
        "tasks/score.py": "def g():\n    # the frontier's metrics\n    from ..frontier import score_metrics\n",
        "evertrain/cli.py": "import json\nfrom evertrain import interrupts\n\n\n"  # top level: fine
                            "def h():\n    # late: torch; --help must not import it\n"
                            "    from evertrain.runtime import Runtime\n"  # explained above its block
                            "    from evertrain.tasks import run_stage\n\n"  # the same block: explained
                            "    import torch\n",  # third-party: not this rule's
        "evertrain/approval.py": "def k():\n    from evertrain.tasks.base import x  # late: breaks a cycle\n"
                                 "    y = 1\n    from evertrain.stats import wilson\n",  # after code: its own block
        "models/grpo.py": "def m():\n    from evertrain.models.checkpoint import load\n",  # pending: not held
    }
    root = _tree(tmp_path, planted)
    found = unexplained_local_imports(root, pending={"evertrain.models"})
    assert found == ["evertrain.approval:4", "evertrain.report:2", "evertrain.tasks.score:3"], found
    assert unexplained_local_imports(root, pending=set())[0] == "evertrain.approval:4"
    assert "evertrain.models.grpo:2" in unexplained_local_imports(root, pending=set())


def test_no_sql_outside_the_store() -> None:
    """Only evertrain/data speaks SQL: a stage asks the store a named question (store.rollouts_for_update(...))."""
    found = sql_outside_the_store(ROOT)
    assert found == [], "SQL outside evertrain/data (add a named query to evertrain/data/queries.py):\n" + \
        "\n".join(found)


def test_the_sql_allow_list_names_real_modules() -> None:
    """An allow-listed module that was renamed or emptied of SQL must leave the list (it would hide new SQL)."""
    found = modules(ROOT)
    assert set(found) >= SQL_ALLOWED | SQL_PENDING
    stale = [name for name in SQL_ALLOWED | SQL_PENDING if not sql_statements(found[name].read_text())]
    assert stale == [], f"allow-listed modules without SQL: {stale}"


def test_sql_outside_the_store_fails_the_check(tmp_path: Path) -> None:
    """The SQL check catches SQL in a library module (a test of the test: it can fail), and only SQL."""
    assert sql_statements('q = "SELECT 1 FROM t"') == [(1, "SELECT 1 FROM t")]
    root = _tree(tmp_path, {
        "tasks/score.py": 'def f(store):\n    return store.query(\n        """\n'
                          '        SELECT * FROM rollouts"""\n    )\n',
        "evertrain/report.py": 'def g(store, t):\n    store.con.execute(f"UPDATE {t} SET x = 1")\n',
        "models/policy.py": 'X = ("WITH w AS (SELECT 1) "\n     "SELECT * FROM w")\n',
        "flows/deploy.py": 'Y = "DELETE FROM stage_runs WHERE campaign = ?"\nZ = "CREATE TABLE t (a INT)"\n',
        "evertrain/data/queries.py": 'Q = "SELECT * FROM rollouts"\n',  # the store's own: fine
        "evertrain/envs/sql.py": 'Q = "SELECT * FROM employees"\n',  # a task's content: allowed
        # prose that names SQL is not SQL: a help text, a message, a docstring
        "evertrain/cli.py": 'H = \'e.g. "SELECT iteration FROM rollouts"\'\n'
                            'M = "(`evertrain sql \\"SELECT *\\"` lists)"\n'
                            '"""Select the rows: SELECT is spelled out in prose here."""\n',
    })
    found = sql_outside_the_store(root)
    assert any(v.startswith("evertrain.tasks.score:3: SELECT * FROM rollouts") for v in found), found
    assert any(v.startswith("evertrain.report:2: UPDATE x SET x = 1") for v in found), found
    assert any(v.startswith("evertrain.models.policy:1: WITH w AS") for v in found), found
    assert any(v.startswith("evertrain.flows.deploy:1: DELETE FROM") for v in found), found
    assert any(v.startswith("evertrain.flows.deploy:2: CREATE TABLE") for v in found), found
    assert not any(v.startswith(("evertrain.data", "evertrain.envs.sql", "evertrain.cli")) for v in found), found
    assert len(found) == 5, found


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


def test_each_part_contract_fails_on_a_planted_violation(tmp_path: Path) -> None:
    """Learner, inference, model files, store and report: each forbidden import is caught (a test of the test), and
    the imports the parts are allowed (the model files, a package's own error) are not."""
    root = _tree(tmp_path, {
        "models/grpo.py": "from evertrain.inference.local import sample\n"  # learner -> inference
                          "from evertrain.models.checkpoint import load_policy\n",  # learner -> model files: fine
        "models/logprobs.py": "def f():\n    from evertrain.runtime import Runtime\n",  # learner -> orchestration
        "models/checkpoint.py": "from evertrain.models import ModelError\n"  # the package's own error: fine
                                "from evertrain.models.grpo import policy_loss\n",  # model files -> learner
        "models/__init__.py": "class ModelError(RuntimeError): ...\n",
        "evertrain/inference/local.py": "from evertrain.models.grpo import train_step\n"  # inference -> learner
                                        "from evertrain.models.forward import prefill\n"  # -> model files: fine
                                        "from evertrain.models import ModelError\n",  # fine
        "evertrain/inference/campaign.py": "from evertrain.data.store import Store\n",  # inference -> store
        "evertrain/inference/ray_workers.py": "from evertrain.tasks import rollout\n",  # inference -> orchestration
        "evertrain/data/store.py": "from evertrain.report import render\n",  # store -> orchestration
        "evertrain/report.py": "from evertrain.serving.traces import wilson\n",  # upward
        "evertrain/serving/traces.py": "",
        "evertrain/runtime.py": "from evertrain.inference.campaign import Inference\n",  # orchestration: fine
        "tasks/rollout.py": "from evertrain.inference.campaign import Inference\n",  # a stage -> inference: fine
    })
    found = violations(root)
    expected = {
        "evertrain.models.grpo:1 -> evertrain.inference.local (the learner imports the inference",
        "evertrain.models.logprobs:2 -> evertrain.runtime (the learner imports the orchestration",
        "evertrain.models.checkpoint:2 -> evertrain.models.grpo (the model files imports the learner",
        "evertrain.inference.local:1 -> evertrain.models.grpo (the inference imports the learner",
        "evertrain.inference.campaign:1 -> evertrain.data.store (the inference imports the store",
        "evertrain.inference.ray_workers:1 -> evertrain.tasks (the inference imports the orchestration",
        "evertrain.data.store:1 -> evertrain.report (the store imports the orchestration",
        "evertrain.report:1 -> evertrain.serving.traces (imports upward",
    }
    for start in expected:
        assert any(v.startswith(start) for v in found), (start, found)
    assert not any(v.startswith(("evertrain.runtime", "evertrain.tasks.rollout")) for v in found), found
    assert not any("ModelError" in v or "evertrain.models.forward" in v or "-> evertrain.models.checkpoint" in v
                   for v in found if not v.startswith("import cycle:")), found
    # the stage importing inference is allowed; inference importing a stage is also an upward layer break
    assert any(v.startswith("evertrain.inference.ray_workers:1 -> evertrain.tasks (imports a higher layer")
               for v in found), found


BACKEND_NAMES = {"hf", "vllm", "vllm-server"}
BACKEND_HOMES = ("evertrain.inference", "evertrain.config")  # where the backends are named and chosen


def backend_name_tests(root: Path) -> list[str]:
    """'module:line' of every comparison with a backend's name outside inference and the config: a caller asks a
    backend's declared capabilities, never its name."""
    found = []
    for name, path in sorted(modules(root).items()):
        if within(name, BACKEND_HOMES):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(
                    isinstance(side, ast.Constant) and side.value in BACKEND_NAMES
                    for side in [node.left, *node.comparators]):
                found.append(f"{name}:{node.lineno}")
    return found


def test_no_caller_tests_a_backends_name(tmp_path: Path) -> None:
    assert backend_name_tests(ROOT) == []
    planted = _tree(tmp_path, {"evertrain/serving/app.py": "def f(config):\n    return resolve(config) == 'vllm'\n",
                               "evertrain/inference/backends.py": "def g(name):\n    return name == 'hf'\n"})
    assert backend_name_tests(planted) == ["evertrain.serving.app:2"]


# --- the structure picture (docs/concepts/layout.md), drawn from the same import graph -------------------------

PICTURE = ROOT / "docs" / "concepts" / "layout.md"
PICTURE_START, PICTURE_END = "<!-- parts: generated by tests/test_layering.py -->", "<!-- end of parts -->"


def part_edges(root: Path) -> dict[tuple[str, str], int]:
    """How many module-to-module imports run from each part to each other part."""
    found = modules(root)
    edges: dict[tuple[str, str], int] = {}
    for name, path in found.items():
        targets = set()
        for imported, _ in imports(name, path):
            target = imported
            while target and target not in found:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                targets.add(target)
        for target in targets:
            pair = (part_of(name), part_of(target))
            if pair[0] != pair[1]:
                edges[pair] = edges.get(pair, 0) + 1
    return edges


def mermaid(root: Path) -> str:
    """The parts and the imports between them as a mermaid flowchart (an arrow: some module of one imports one of
    the other; counts are left out, so the picture changes only when a new dependency between parts appears)."""
    ids = {part: part.replace(" ", "_") for part in [*PARTS, "common"]}
    lines = ["```mermaid", "flowchart TD"]
    lines += [f'    {ids[part]}["{part}"]' for part in ids]
    lines += [f"    {ids[source]} --> {ids[target]}" for source, target in sorted(part_edges(root))]
    return "\n".join([*lines, "```"])


def test_the_structure_picture_is_drawn_from_the_current_imports() -> None:
    """docs/concepts/layout.md's picture is this graph as it is now (regenerate: python tests/test_layering.py)."""
    text = PICTURE.read_text()
    drawn = text.split(PICTURE_START)[1].split(PICTURE_END)[0].strip()
    assert drawn == mermaid(ROOT), "the picture is stale: run python tests/test_layering.py"
    edges = part_edges(ROOT)
    # apart: neither of learner and inference imports the other, and neither imports the orchestration or the store
    for a, b in (("learner", "inference"), ("inference", "learner"), ("learner", "orchestration"),
                 ("inference", "orchestration"), ("learner", "store"), ("inference", "store")):
        assert (a, b) not in edges, (a, b)
    assert ("orchestration", "inference") in edges and ("orchestration", "learner") in edges


MAX_STAGE_FUNCTION_LINES = 80  # a stage's function a reader holds in their head (issue 24)


def long_functions(source: str, limit: int = MAX_STAGE_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function in ``source`` longer than ``limit`` lines, its docstring included."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_in_the_stages_or_flows_is_over_80_lines() -> None:
    found = {str(path.relative_to(ROOT)): long_functions(path.read_text())
             for folder in ("tasks", "flows") for path in sorted((ROOT / folder).glob("*.py"))}
    assert len(found) >= 10, "the stages were not found"
    assert {path: fns for path, fns in found.items() if fns} == {}


def test_a_long_stage_function_fails_the_check() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    assert long_functions(f"def stage() -> None:\n{body}\n") == [("stage", 86)]
    assert long_functions("def short() -> None:\n    return None\n") == []


if __name__ == "__main__":  # redraw the picture in docs/concepts/layout.md
    text = PICTURE.read_text()
    head, rest = text.split(PICTURE_START)
    PICTURE.write_text(f"{head}{PICTURE_START}\n{mermaid(ROOT)}\n{PICTURE_END}{rest.split(PICTURE_END)[1]}")
