"""The docs: a short README, a site that builds clean, references that list everything the code has."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from evertrain import docs_reference
from evertrain.cli import build_parser
from evertrain.config import CampaignConfig
from evertrain.data.store import SCHEMA, TABLES, _columns_from_schema

ROOT = Path(__file__).resolve().parents[1]
# folders that name one machine: a README that shows them works only there
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|home|Users|root|tmp|mnt|opt|srv|var|scratch|data)/")


def _walk(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object, type[BaseModel] | None]]:
    """Every (dotted path, FieldInfo, held section model) of a pydantic model, independently of the renderer."""
    found = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        held = None
        stack = [annotation]
        while stack:
            item = stack.pop()
            if isinstance(item, type) and issubclass(item, BaseModel):
                held = item
            stack.extend(getattr(item, "__args__", ()))
        found.append((prefix + name, info, held))
        if held is not None:
            found.extend(_walk(held, f"{prefix}{name}."))
    return found


def test_every_config_field_has_a_description() -> None:
    missing = [path for path, info, held in _walk(CampaignConfig)
               if not (info.description or "").strip() and not (held is not None and (held.__doc__ or "").strip())]
    assert not missing, f"config fields without description= (a section needs a class docstring): {missing}"


def test_config_reference_lists_every_field_with_type_default_and_description() -> None:
    page = docs_reference.config_reference()
    fields = _walk(CampaignConfig)
    assert len(fields) > 90
    for path, info, held in fields:
        if held is not None:
            continue
        row = next((line for line in page.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"config reference has no row for {path}"
        description = " ".join((info.description or "").split())
        shown = description[:40].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        assert shown in row, f"{path}: description missing from {row!r}"
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert len(cells) == 4 and cells[1] and cells[2].strip("`"), f"{path}: type or default missing: {row!r}"
        assert cells[3].strip(), f"{path}: no description in {row!r}"


def test_config_reference_catches_an_undocumented_field() -> None:
    class Section(BaseModel):
        """A section."""

        documented: int = Field(1, description="Has one.")
        bare: int = 2

    class Top(BaseModel):
        section: Section = Field(default_factory=Section)

    fields = {f.path: f for f in docs_reference.config_fields(Top)}
    assert fields["section.documented"].description == "Has one."
    assert fields["section.bare"].description == ""
    assert fields["section"].description == "A section."


def test_config_reference_shows_defaults_without_the_builders_environment(monkeypatch) -> None:
    monkeypatch.setenv("EVERTRAIN_STORE", "ducklake:postgres:dbname=secret host=builder")
    page = docs_reference.config_reference()
    assert "builder" not in page
    assert '`"ducklake:sqlite:data/evertrain.sqlite"`' in page


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[prefix + name] = sub
                found.update(_subcommands(sub, f"{prefix}{name} "))
    return found


def test_cli_reference_lists_every_command_and_option() -> None:
    page = docs_reference.cli_reference()
    subs = _subcommands(build_parser())
    assert {"run", "stage", "report", "sql", "export", "ui"} <= set(subs)
    for name, sub in subs.items():
        assert f"\n## {name}\n" in page, f"CLI reference has no section for {name}"
        section = page.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            label = ", ".join(action.option_strings) if action.option_strings else action.dest
            assert f"| `{label}` |" in section, f"evertrain {name}: {label} missing from the CLI reference"


def test_cli_reference_lists_nested_subcommands() -> None:
    parser = argparse.ArgumentParser(prog="evertrain")
    sub = parser.add_subparsers(dest="command")
    endpoint = sub.add_parser("endpoint", help="serve a model")
    actions = endpoint.add_subparsers(dest="action")
    start = actions.add_parser("start", help="start it")
    start.add_argument("--port", type=int, default=8000, help="where")
    commands = docs_reference.cli_commands(parser)
    assert commands["endpoint start"] == ["--port"]
    page = docs_reference.cli_reference(parser)
    assert "\n## endpoint start\n" in page and "| `--port` | int | `8000` | where |" in page
    assert "[`endpoint start`](#endpoint-start)" in page


def test_store_reference_lists_every_table_and_column() -> None:
    page = docs_reference.store_reference()
    for table, columns in _columns_from_schema(SCHEMA).items():
        assert f"\n## {table}\n" in page, f"store reference has no section for {table}"
        section = page.split(f"\n## {table}\n", 1)[1].split("\n## ", 1)[0]
        for column, kind in columns:
            assert f"| `{column}` | `{kind}` |" in section, f"{table}.{column} missing from the store reference"
    assert set(TABLES) <= set(_columns_from_schema(SCHEMA))


def test_benchmark_reference_renders_every_results_file(tmp_path) -> None:
    (tmp_path / "one.json").write_text('{"command": "python benchmarks/one.py", "machine": {"cpu": "X", "cores": 2},'
                                       ' "rows": [{"mode": "a", "wall_s": 1.5}, {"mode": "b", "wall_s": 2.25}]}')
    page = docs_reference.benchmark_reference(tmp_path)
    assert "`python benchmarks/one.py`" in page and "cpu X, cores 2" in page
    assert "| a | 1.5 |" in page and "| b | 2.25 |" in page
    real = docs_reference.benchmark_reference()
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert f"\n## {path.stem}\n" in real


def test_readme_is_short_and_names_no_machine() -> None:
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200)"
    found = [line for line in lines if MACHINE_PATH.search(line)]
    assert not found, f"README.md shows machine-specific paths: {found}"
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_mkdocs_build_strict_is_clean(tmp_path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    assert mkdocs, "mkdocs is not installed: `make setup` installs the docs extra (pip install -e '.[docs]')"
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("reference/config", "reference/cli", "reference/store", "reference/benchmark-results"):
        assert (tmp_path / "site" / page / "index.html").exists(), f"{page} was not built"
    built = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "update.lora.rank" in built
    _diagram_draws_offline(tmp_path / "site" / "index.html", tmp_path)


def _diagram_draws_offline(page: Path, tmp_path: Path) -> None:
    """The home page's diagram drawn by headless Chromium with every host name unresolvable: its renderer
    must come with the site (a CDN's would leave the diagram's source text on the page)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--host-resolver-rules=MAP * ~NOTFOUND", "--disable-background-networking",
                          f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000",
                          "--allow-file-access-from-files", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    # Material swaps the code block for a <div class="mermaid"> holding the drawn SVG (in its shadow root, which
    # --dump-dom leaves out) once Mermaid has rendered it; without a renderer the source stays on the page
    assert "flowchart LR" not in dom, "the diagram's source is shown instead of the diagram (renderer from a CDN?)"
    assert '<div class="mermaid">' in dom, "the home page's diagram was not drawn offline"


# the project's internal history ("stop 38", "stops 39-40"): a newcomer cannot place it; it belongs in
# docs/benchmarks, the lab notebook. A link's target may name it (the notebook's headings do), not its text.
INTERNAL_HISTORY = re.compile(r"\bstops? \d+", re.IGNORECASE)


def _user_pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [page for page in pages if "benchmarks" not in page.relative_to(ROOT).parts[:2]
            and "reference" not in page.relative_to(ROOT).parts[:2]]


def test_user_pages_speak_no_internal_history() -> None:
    found = []
    for page in _user_pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            text = re.sub(r"\]\([^)]*\)", "]", line)  # link targets may name a notebook heading
            if INTERNAL_HISTORY.search(text):
                found.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "internal history in user pages (it belongs in docs/benchmarks):\n" + "\n".join(found)


def test_score_sample_gives_the_documented_results(tmp_path) -> None:
    """The how-to's command on the shipped sample, compared with the page's table of results."""
    page = (ROOT / "docs" / "how-to" / "score.md").read_text()
    table = page[page.index("## The sample's results"):]
    documented = {m[0]: (float(m[1]), m[2]) for m in re.findall(r"^\| ([\w-]+) \| ([\d.]+) \| (\w+) \|$", table, re.M)}
    sample = ROOT / "data" / "examples" / "score_items.jsonl"
    assert "--input data/examples/score_items.jsonl" in page and len(documented) == len(sample.read_text().splitlines())
    run = subprocess.run([sys.executable, "-m", "evertrain.cli", "score", "--input", str(sample), "--output",
                          str(tmp_path / "results.jsonl"), "--store", str(tmp_path / "audit.duckdb"), "--workers", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = {r["id"]: (r["reward"], r["reason"]) for r in map(json.loads, (tmp_path / "results.jsonl").open())}
    assert got == documented
    passed = sum(reason == "correct" for _, reason in documented.values())
    assert f"scored {len(documented)} item(s): {passed} passed, 1 malformed" in run.stderr


@pytest.mark.parametrize("page", sorted(docs_reference.PAGES))
def test_generated_pages_are_written(tmp_path, page) -> None:
    docs_reference.write_reference(tmp_path)
    assert (tmp_path / page).read_text().startswith("# ")


def test_readme_demo_numbers_are_the_results_file():
    """The README's demo block is what `benchmarks/demo.py --readme` writes from benchmarks/results/demo.json,
    the file the measured run saved: numbers typed by hand, or left from an older run, fail here."""
    from benchmarks.demo import END, README, RESULT, START, readme_block

    result = json.loads(RESULT.read_text())
    text = README.read_text()
    assert START in text and END in text, "the README lost its demo block"
    block = START + text.split(START, 1)[1].split(END, 1)[0] + END
    assert block == readme_block(result), "README's demo numbers differ from benchmarks/results/demo.json: " \
        "run `.venv/bin/python benchmarks/demo.py --readme`"
    assert result["iterations"] == 6 and len(result["iteration_lines"]) == 6 and result["versus"]
    assert all(len(line) <= 100 for line in result["iteration_lines"])
    for shot in ("demo-lines.svg", "mlflow-curve.png"):
        assert (ROOT / "docs" / "assets" / shot).stat().st_size > 1000, shot
