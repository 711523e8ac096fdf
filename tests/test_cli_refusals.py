"""Every command refuses bad input (a campaign, an iteration, a stage) with one ``evertrain: error:`` line and
exit status 2, before anything runs, and writes nothing; a reader that closes stdout early ends it quietly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evertrain.cli import main
from evertrain.data.store import Store, now
from tests.conftest import smoke_config_in

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    """A store holding campaign ``demo``: its stored config and iteration 0 with curate and rollout completed
    (written directly: nothing here trains, the commands must refuse before they would)."""
    directory = tmp_path_factory.mktemp("refusals")
    config = smoke_config_in(directory, directory / "no-models", name="demo")
    store = Store(config.paths.store)
    store.replace("campaigns", {"campaign": "demo"},
                  [{"campaign": "demo", "config": config.model_dump_json(), "updated_at": now()}])
    for stage in ("curate", "rollout"):
        store.record_stage("demo", 0, stage, "completed", started_at=now(), wall_s=0.1, metrics={"problems": 4})
    store.close()
    config_file = directory / "demo.json"
    config_file.write_text(json.dumps(config.model_dump(mode="json")))
    return config, config_file


def _state(uri: str) -> tuple[dict[str, int], list[tuple]]:
    store = Store(uri, read_only=True)
    try:
        rows = store.query("SELECT campaign, iteration, stage, status, finished_at FROM stage_runs ORDER BY ALL")
        return store.counts(), [tuple(r) for r in rows.itertuples(index=False)]
    finally:
        store.close()


def _refused(argv: list[str], uri: str, cwd: Path, capsys: pytest.CaptureFixture, monkeypatch) -> str:
    """Run ``evertrain argv`` in ``cwd``; assert the refusal and that nothing was written; return stderr."""
    monkeypatch.chdir(cwd)
    before = _state(uri)
    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as exit:  # argparse's own refusals exit from parse_args
        status = exit.code
    out, err = capsys.readouterr()
    assert status == 2, (status, out, err)
    assert err.startswith("evertrain: error:"), err
    assert "Traceback" not in err and out == ""
    assert _state(uri) == before, "a refused command wrote to the store"
    assert list(cwd.iterdir()) == [], f"a refused command wrote {list(cwd.iterdir())}"
    return err


STAGE_CASES = {
    "bad campaign": (["stage", "score", "--campaign", "nope", "--iteration", "0"], "campaign 'nope' not found"),
    "bad iteration": (["stage", "score", "--campaign", "demo", "--iteration", "99"], "no iteration 99"),
    "bad stage": (["stage", "nosuch", "--campaign", "demo", "--iteration", "0"], "invalid choice: 'nosuch'"),
    "stage before its inputs": (["stage", "update", "--campaign", "demo", "--iteration", "0"], "needs score"),
}


@pytest.mark.parametrize("case", list(STAGE_CASES))
def test_stage_refuses_bad_input_from_the_store(case, demo, tmp_path, capsys, monkeypatch):
    config, _ = demo
    argv, message = STAGE_CASES[case]
    err = _refused([*argv, "--store", config.paths.store], config.paths.store, tmp_path, capsys, monkeypatch)
    assert message in err


@pytest.mark.parametrize("case", ["bad campaign", "bad iteration", "stage before its inputs"])
def test_stage_refuses_bad_input_with_a_config(case, demo, tmp_path, capsys, monkeypatch):
    """With --config the store is the config's: an unknown campaign there is refused, not started."""
    config, config_file = demo
    argv, message = STAGE_CASES[case]
    err = _refused([*argv, "--config", str(config_file)], config.paths.store, tmp_path, capsys, monkeypatch)
    assert message in err


@pytest.mark.parametrize("argv, message", [
    (["report", "--campaign", "nope"], "campaign 'nope' not found"),
    (["report", "--campaign", "demo", "--iteration", "0"], "unrecognized arguments"),
    (["show", "--campaign", "nope", "--iteration", "0"], "campaign 'nope' not found"),
    (["show", "--campaign", "demo", "--iteration", "99"], "no iteration 99"),
    (["show", "--campaign", "demo", "--iteration", "zero"], "invalid int value"),
    (["rollback", "--campaign", "nope"], "campaign 'nope' not found"),
    (["export", "out", "--campaign", "nope"], "campaign 'nope' not found"),
    (["endpoint", "--campaign", "nope"], "campaign 'nope' not found"),
], ids=lambda value: "-".join(value) if isinstance(value, list) else "")
def test_commands_refuse_an_unknown_campaign_or_iteration(argv, message, demo, tmp_path, capsys, monkeypatch):
    config, _ = demo
    err = _refused([*argv, "--store", config.paths.store], config.paths.store, tmp_path, capsys, monkeypatch)
    assert message in err


def test_a_missing_store_is_refused_and_not_created(tmp_path, capsys, monkeypatch):
    """No store at all (a newcomer's first command): refused, and no data/ appears."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EVERTRAIN_STORE", raising=False)
    for argv in (["report", "--campaign", "demo"], ["show", "--campaign", "demo", "--iteration", "0"],
                 ["stage", "score", "--campaign", "demo", "--iteration", "5", "--store",
                  f"ducklake:sqlite:{tmp_path / 'nowhere' / 'evertrain.sqlite'}"]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.startswith("evertrain: error:")
        assert list(tmp_path.iterdir()) == []


def test_report_json_into_a_closed_pipe_ends_quietly(demo, tmp_path):
    """`evertrain report --json | head -0`: the reader is gone before the report is written; no traceback."""
    config, _ = demo
    process = subprocess.Popen(
        [sys.executable, "-m", "evertrain.cli", "report", "--campaign", "demo", "--json",
         "--store", config.paths.store],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "EVERTRAIN_PROGRESS": "0", "PYTHONPATH": str(ROOT)})
    process.stdout.close()  # the only reader: every write to the pipe fails (EPIPE)
    err = process.stderr.read()
    status = process.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert status in (0, 141), (status, err)
