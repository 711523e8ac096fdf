"""Real servers on one machine: PostgreSQL, a Prefect server on it, an MLflow tracking server on it.

``evertrain services start`` (``make services``) starts, under one state folder (default ``.services/``):

- Debian's PostgreSQL 15 (``/usr/lib/postgresql/15/bin``) on a free port, with three databases:
  ``prefect`` (the Prefect server's), ``mlflow`` (MLflow's backend store) and ``evertrain`` (the
  trajectory store's DuckLake catalog);
- ``prefect server start`` with ``PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://...``;
- ``mlflow server --backend-store-uri postgresql://... --artifacts-destination <folder>``;

and writes ``<folder>/env``, the three settings a campaign, a worker or a notebook needs
(``PREFECT_API_URL``, ``MLFLOW_TRACKING_URI``, ``EVERTRAIN_STORE``): ``source .services/env``.
On a team the same three settings point at servers elsewhere; nothing else changes.

PostgreSQL refuses to run as root, so as root (CI, this machine) the cluster runs as the ``postgres``
user, in a folder that user owns. The servers are started in their own sessions: they outlive the
command that started them until ``evertrain services stop``.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from evertrain import processes
from evertrain.data.databases import create_postgres_databases

PG_BIN = Path(os.environ.get("EVERTRAIN_PG_BIN", "/usr/lib/postgresql/15/bin"))
DATABASES = ("prefect", "mlflow", "evertrain")


class ServiceError(RuntimeError):
    """A server could not be started; the message says which and where its log is."""


def _as_postgres() -> list[str]:
    """The command prefix that runs a PostgreSQL binary as a user it accepts (never root)."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


def _pg_owned_dir(path: Path) -> None:
    """A folder the postgres user owns and can reach (every parent must be traversable by it)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(path, user.pw_uid, user.pw_gid)
        os.chmod(path, 0o700)
        for parent in path.parents:
            if not os.stat(parent).st_mode & 0o001:
                raise ServiceError(f"the postgres user cannot reach {path}: {parent} is not traversable by "
                                   "others (chmod o+x it, or pick a state folder elsewhere, e.g. under /tmp)")


def start_postgres(root: Path, host: str = "127.0.0.1", port: int | None = None) -> dict[str, Any]:
    """Start (initializing on first use) a PostgreSQL cluster in ``root/postgres``; create the databases."""
    if not (PG_BIN / "postgres").exists():
        raise ServiceError(f"PostgreSQL is not installed ({PG_BIN / 'postgres'} missing): "
                           "apt-get install postgresql (or set EVERTRAIN_PG_BIN to its bin folder)")
    data = root / "postgres"
    port = port or processes.free_port()
    if not (data / "PG_VERSION").exists():
        _pg_owned_dir(data)
        _run([*_as_postgres(), str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
              "--no-sync", "-E", "UTF8"], "initdb")
    log = data / "server.log"
    stop_postgres(data)  # a cluster left running by an earlier start that failed half-way
    _run([*_as_postgres(), str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "120",
          "-o", f"-p {port} -k {data} -c listen_addresses={host} -c max_connections=200", "start"],
         f"PostgreSQL (log {log})")
    create_postgres_databases(host, port, DATABASES)
    return {"data": str(data), "host": host, "port": port, "log": str(log)}


def stop_postgres(data: Path) -> None:
    if (data / "postmaster.pid").exists():
        subprocess.run([*_as_postgres(), str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                       capture_output=True, text=True, check=False)


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ServiceError(f"{what} failed (exit {result.returncode}): {(result.stderr or result.stdout)[-2000:]}")


def _wait_http(url: str, process: subprocess.Popen, what: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServiceError(f"{what} exited with status {process.returncode} before answering; "
                               f"its log: {log}\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    processes.stop([process], first=signal.SIGKILL, timeout=0)
    raise ServiceError(f"{what} did not answer on {url} within {timeout:.0f} s; its log: {log}\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else ""


def _spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A server in its own session (it outlives this command), output to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def quiet_env() -> dict[str, str]:
    """This environment without telemetry (nothing here reaches the internet)."""
    return {**os.environ, "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "true"}


def mlflow_server_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for an MLflow server without MLflow 3's job runner, unless the caller's environment asks for it:
    on a SQL backend the server otherwise starts seven ``huey_consumer`` processes for jobs evertrain never
    submits (GenAI evaluation, trace roll-ups), about 2.4 CPU-seconds each to start (measured in the servers'
    test on a 2-core Intel Xeon) and resident all the time beside it."""
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **env}


def start_prefect(root: Path, database_url: str, host: str = "127.0.0.1", port: int | None = None,
                  timeout: float = 300.0) -> dict[str, Any]:
    """``prefect server start`` on ``database_url`` (postgresql+asyncpg://...), with its scheduler."""
    port = port or processes.free_port()
    home = root / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    env = {**quiet_env(), "PREFECT_HOME": str(home), "PREFECT_API_DATABASE_CONNECTION_URL": database_url,
           "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5"}
    env.pop("PREFECT_API_URL", None)
    log = root / "prefect.log"
    prefect = Path(sys.executable).with_name("prefect")
    process = _spawn([str(prefect), "server", "start", "--host", host, "--port", str(port)], env, log)
    url = f"http://{host}:{port}/api"
    _wait_http(f"{url}/health", process, "the Prefect server", log, timeout)
    return {"pid": process.pid, "url": url, "log": str(log)}


def start_mlflow(root: Path, backend_uri: str, host: str = "127.0.0.1", port: int | None = None,
                 timeout: float = 300.0) -> dict[str, Any]:
    """``mlflow server`` on ``backend_uri`` (postgresql://...), proxying artifacts to ``root/mlflow-artifacts``."""
    port = port or processes.free_port()
    artifacts = root / "mlflow-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    log = root / "mlflow.log"
    mlflow = Path(sys.executable).with_name("mlflow")
    process = _spawn([str(mlflow), "server", "--backend-store-uri", backend_uri,
                      "--artifacts-destination", str(artifacts), "--host", host, "--port", str(port),
                      "--workers", "1"], mlflow_server_env(quiet_env()), log)
    url = f"http://{host}:{port}"
    _wait_http(f"{url}/health", process, "the MLflow server", log, timeout)
    return {"pid": process.pid, "url": url, "log": str(log), "artifacts": str(artifacts)}


def start(root: Path, host: str = "127.0.0.1") -> dict[str, Any]:
    """Start all three (PostgreSQL, Prefect, MLflow) under ``root``; write ``root/services.json`` and ``root/env``."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    if (existing := status(root)) is not None:
        return existing
    os.chmod(root, 0o755)  # the postgres user must reach root/postgres
    pg = start_postgres(root, host)
    base = f"postgres@{host}:{pg['port']}"
    info: dict[str, Any] = {"root": str(root), "postgres": pg}
    try:
        info["prefect"] = start_prefect(root, f"postgresql+asyncpg://{base}/prefect", host)
        info["mlflow"] = start_mlflow(root, f"postgresql+psycopg2://{base}/mlflow", host)
    except BaseException:
        _save(root, info)
        stop(root)
        raise
    lake = root / "lake"
    lake.mkdir(exist_ok=True)
    info["env"] = {
        "PREFECT_API_URL": info["prefect"]["url"],
        "MLFLOW_TRACKING_URI": info["mlflow"]["url"],
        "EVERTRAIN_STORE": f"ducklake:postgres:dbname=evertrain host={host} port={pg['port']} user=postgres"
                           f"?data_path={lake}/",
    }
    _save(root, info)
    return info


def _save(root: Path, info: dict[str, Any]) -> None:
    (root / "services.json").write_text(json.dumps(info, indent=2))
    if "env" in info:
        (root / "env").write_text("".join(f"export {k}='{v}'\n" for k, v in info["env"].items()))


def status(root: Path) -> dict[str, Any] | None:
    """The running services under ``root`` (None if none are, or any of them died)."""
    state = root / "services.json"
    if not state.exists():
        return None
    info = json.loads(state.read_text())
    alive = all(processes.alive(info.get(name, {}).get("pid")) for name in ("prefect", "mlflow"))
    pg_alive = (Path(info["postgres"]["data"]) / "postmaster.pid").exists()
    return info if alive and pg_alive and "env" in info else None


def stop(root: Path) -> None:
    """Stop whatever ``root/services.json`` says was started (servers by their session, then PostgreSQL)."""
    state = root / "services.json"
    if not state.exists():
        return
    info = json.loads(state.read_text())
    # both servers told at once, then awaited together: each takes seconds to shut down gracefully
    processes.stop([pid for name in ("prefect", "mlflow") if (pid := info.get(name, {}).get("pid"))], timeout=20)
    if "postgres" in info:
        stop_postgres(Path(info["postgres"]["data"]))
    state.unlink()


def remove(root: Path) -> None:
    """Stop the services and delete their state (tests)."""
    stop(root)
    shutil.rmtree(root, ignore_errors=True)


def describe(info: dict[str, Any]) -> str:
    env = info["env"]
    return "\n".join([
        f"PostgreSQL  {info['postgres']['host']}:{info['postgres']['port']} (data {info['postgres']['data']})",
        f"Prefect     {env['PREFECT_API_URL'].removesuffix('/api')}  (UI; database postgres/prefect)",
        f"MLflow      {env['MLFLOW_TRACKING_URI']}  (database postgres/mlflow, "
        f"artifacts {info['mlflow']['artifacts']})",
        f"store       {env['EVERTRAIN_STORE']}",
        f"point a shell (campaigns, workers, notebooks) at them: source {info['root']}/env",
    ])
