"""Two processes building the same model folder at once (two test workers, two campaigns started together) both
succeed and leave one whole folder: each writes into a temporary folder of its own. A shared temporary folder
made one process delete the other's half-written weights (a fresh-clone CI run failed so)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from evertrain.models.folders import publish_folder


def _write_slowly(dest: str, tag: str) -> None:
    def write(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        time.sleep(0.5)  # the other process starts and finishes its own write meanwhile
        (folder / "weights.bin").write_text(tag)

    publish_folder(Path(dest), write, lambda folder: (folder / "weights.bin").exists())


def test_two_processes_publish_one_folder_at_once(tmp_path):
    dest = tmp_path / "model"
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_write_slowly, args=(str(dest), tag)) for tag in ("a", "b")]
    for worker in workers:
        worker.start()
        time.sleep(0.1)
    for worker in workers:
        worker.join(30)
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert (dest / "weights.bin").read_text() in {"a", "b"} and (dest / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "a temporary folder was left behind"


def test_a_failed_write_leaves_nothing(tmp_path):
    def write(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    try:
        publish_folder(tmp_path / "model", write, lambda folder: (folder / "config.json").exists())
    except OSError as error:
        assert "disk full" in str(error)
    else:
        raise AssertionError("the write's error was swallowed")
    assert list(tmp_path.iterdir()) == []
