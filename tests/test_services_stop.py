"""`services.stop` returns as soon as the servers it stops have exited, also when this process started them."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from evertrain import services


def test_stop_does_not_wait_out_its_deadline_for_servers_this_process_started(tmp_path: Path) -> None:
    # two stand-ins for the Prefect and MLflow servers, started as services.start starts them: children of
    # this process, each in its own session; they exit at once on SIGTERM (Python's default action)
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    servers = {name: services._spawn(sleeper, services.quiet_env(), tmp_path / f"{name}.log")
               for name in ("prefect", "mlflow")}
    (tmp_path / "services.json").write_text(json.dumps({name: {"pid": p.pid} for name, p in servers.items()}))
    started = time.monotonic()
    services.stop(tmp_path)
    took = time.monotonic() - started
    # before: an exited child stays a zombie until reaped, signal 0 still reached it, and stop() waited
    # 20 s for each server
    assert took < 10, f"stop() took {took:.1f} s for two servers that exit on SIGTERM"
    assert not (tmp_path / "services.json").exists()
    for process in servers.values():
        assert process.poll() is not None
