"""`make demo`, measured: the README's demo numbers come from here, never typed by hand.

Runs `make demo`'s command (`evertrain run --config configs/default.toml --iterations 6`) in a scratch project home
(EVERTRAIN_HOME), the embedded SmolLM2 converted beforehand, outside the timing. Saves to
benchmarks/results/demo.json the wall time, the line `evertrain run` printed as each iteration ended, the
report's rows and the champion-against-base lines. `--readme` then rewrites the README's demo block from that file
(tests/test_docs.py fails when the two differ). `--screenshots` also saves docs/assets/demo-lines.svg (the lines
at 100 columns) and docs/assets/mlflow-curve.png (MLflow's chart of the campaign over its iterations, taken in
headless Chromium).

    .venv/bin/python benchmarks/demo.py [--iterations 6] [--screenshots]   # about 10 minutes on 2 cores
    .venv/bin/python benchmarks/demo.py --readme                           # README from the saved results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "benchmarks" / "results" / "demo.json"
README = ROOT / "README.md"
START = "<!-- demo numbers: written by `benchmarks/demo.py --readme` from benchmarks/results/demo.json -->"
END = "<!-- end of demo numbers -->"
ASSETS = ROOT / "docs" / "assets"


def readme_block(result: dict[str, Any]) -> str:
    """The README's demo block, from a saved result: what the run printed, and how long it took where."""
    minutes, seconds = divmod(round(result["wall_s"]), 60)
    machine = result["machine"]
    lines = [
        START,
        f"A run on the development machine ({machine['cpu']}, {machine['cores']} cores, nothing else running; venv "
        f"built, model converted) took **{minutes} min {seconds} s** and printed, as each iteration ended:",
        "```", *result["iteration_lines"], "```",
        "and, after the table, the champion against the base model:",
        "```", *result["versus"], "```",
        END,
    ]
    return "\n".join(lines)


def update_readme(result: dict[str, Any]) -> None:
    text = README.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{README}: no demo block ({START!r} ... {END!r}) to replace")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(head + readme_block(result) + tail)


def screenshot_lines(result: dict[str, Any]) -> Path:
    """The per-iteration lines at 100 columns, as a terminal draws them (an SVG rich records)."""
    from rich.console import Console

    console = Console(record=True, width=100, force_terminal=True)
    console.print("$ make demo", style="bold")
    console.print("...", style="dim")
    for line in result["iteration_lines"]:
        console.print(line, highlight=False)
    path = ASSETS / "demo-lines.svg"
    console.save_svg(str(path), title="make demo: a line per iteration")
    return path


def check_screenshot_tools() -> None:
    """Before the ten-minute run, not after it: Playwright and the system's Chromium."""
    import importlib.util

    if importlib.util.find_spec("playwright") is None:
        raise SystemExit("--screenshots drives Chromium with Playwright: `.venv/bin/pip install playwright` (the "
                         "system's Chromium is used, no browser is downloaded)")
    if shutil.which("chromium") is None:
        raise SystemExit("--screenshots needs Chromium on PATH (Debian: apt-get install chromium)")


def screenshot_mlflow(home: Path, campaign: str, path: Path = ASSETS / "mlflow-curve.png") -> Path:
    """MLflow's model-metrics charts of the campaign's run (every iteration a step): the score stage's, taken
    in headless Chromium driven by Playwright (`pip install playwright`; the system's Chromium, no download)."""
    from playwright.sync_api import sync_playwright

    import mlflow
    from evertrain import processes
    from evertrain.services import start_mlflow

    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"  # where the demo's config puts it, under the project home
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name(f"evertrain/{campaign}")
    run = client.search_runs([experiment.experiment_id], f"tags.mlflow.runName = 'campaign-{campaign}'")[0]
    server = start_mlflow(home / "screenshot", uri)  # the project's own start: waits until it answers
    try:
        url = f"{server['url']}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}/model-metrics"
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 2400})  # tall: every score chart drawn
            page.goto(url)
            page.wait_for_selector("svg.main-svg", timeout=60_000)  # the first chart drawn: the page is ready
            headers = page.locator("[data-testid='experiment-view-compare-runs-section-header']")
            for stage in ("curate", "evaluate", "promote", "rollout", "sft", "update"):  # folded: score's alone
                header = headers.filter(has_text=re.compile(rf"^{stage}\s*\("))
                if header.count():
                    header.first.click()
                    page.wait_for_timeout(500)
            page.wait_for_timeout(4000)  # the charts draw after their data arrive
            top = page.get_by_text("grader_error_share", exact=True).first.bounding_box()
            # the rows of grader errors, reward and pass rate, without the side bars
            page.screenshot(path=str(path), clip={"x": top["x"] - 45, "y": top["y"] - 25, "width": 820, "height": 720})
            browser.close()
    finally:
        processes.stop([server["pid"]], timeout=20)
    return path


def run_demo(iterations: int, home: Path) -> dict[str, Any]:
    os.environ["EVERTRAIN_HOME"] = str(home)
    from evertrain.config import load_config
    from evertrain.data.lineage import champion_vs_base, iteration_report
    from evertrain.data.store import Store
    from evertrain.models.checkpoint import resolve_base
    from evertrain.report import NARROW, format_versus, iteration_line

    config = load_config(ROOT / "configs" / "default.toml")
    models_dir = ROOT / "state" / "models"
    resolve_base(config.model.model_copy(update={"models_dir": str(models_dir)}))  # converted outside the timing
    command = [str(ROOT / ".venv" / "bin" / "evertrain"), "run", "--config", str(ROOT / "configs" / "default.toml"),
               "--iterations", str(iterations), "--set", f"model.models_dir='{models_dir}'"]
    env = {**os.environ, "COLUMNS": "100", "EVERTRAIN_HOME": str(home)}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=home, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (home / "demo.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"the demo failed (exit {done.returncode}); its output: {home / 'demo.log'}")
    printed = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("iteration ")]
    store = Store(config.paths.store, read_only=True)
    try:
        rows = iteration_report(store, config.name)
        versus = [format_versus(s) for s in champion_vs_base(store, config.name)]
    finally:
        store.close()
    expected = [iteration_line(row) for row in rows]
    if printed != expected:  # the lines are the report's rows: a difference is a defect, not a detail
        raise SystemExit(f"the printed lines differ from the report's:\n{printed}\n{expected}")
    return {"iterations": iterations, "wall_s": wall, "iteration_lines": printed, "versus": versus,
            "rows": [{key: row.get(key) for key in NARROW} for row in rows],
            "demo_command": "make demo (evertrain run --config configs/default.toml --iterations 6)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--readme", action="store_true", help="only rewrite the README from the saved result")
    parser.add_argument("--screenshots", action="store_true", help="also save the two screenshots under docs/")
    parser.add_argument("--keep", action="store_true", help="keep the scratch project home")
    args = parser.parse_args()
    if args.readme:
        update_readme(json.loads(RESULT.read_text()))
        print(f"rewrote the demo block of {README.relative_to(ROOT)} from {RESULT.relative_to(ROOT)}")
        return
    from benchmarks.common import print_table, save

    if args.screenshots:
        check_screenshot_tools()

    home = Path(tempfile.mkdtemp(prefix="evertrain-demo-"))
    try:
        result = run_demo(args.iterations, home)
        print_table(result["rows"], ["iteration", "mean_reward", "zero_variance_share", "gate_challenger_pass1",
                                     "gate_champion_pass1", "promoted", "wall_s", "cpu_s"])
        print("\n".join(["", *result["versus"], "", f"wall {result['wall_s']:.0f} s"]))
        path = save("demo", result)
        print(f"saved {path.relative_to(ROOT)}")
        if args.screenshots:
            for shot in (screenshot_lines(result), screenshot_mlflow(home, "demo")):
                print(f"saved {shot.relative_to(ROOT)}")
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
        else:
            print(f"kept {home}")


if __name__ == "__main__":
    main()
