"""Scheduled deployments: a campaign that runs unattended, one iteration per scheduled run.

``serve`` builds one Prefect deployment per campaign config, with an interval or cron schedule and a
deployment concurrency limit of one (a run scheduled while the previous one still works waits in the
queue), and serves them from this process. The Prefect UI shows each deployment with the campaign
config as a typed form, so a person can trigger a run with changed settings (not the ones the campaign promises:
:mod:`evertrain.promises`). The store's per-campaign
claim stays the last line of defence: a second process that tries to run the same campaign is refused
with a clear message before it writes anything.

``deploy`` registers the same deployments in a Prefect work pool instead, for workers to run
(``prefect worker start --pool ...``), on this machine or any other that has evertrain installed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from evertrain import processes, promises
from evertrain.config import CampaignConfig
from evertrain.processes import free_port

# Prefect is imported late, inside the functions below: it reads its settings (PREFECT_API_URL) when imported, and
# `evertrain serve` imports this module for start_server, then points PREFECT_API_URL at the server it started
# (imported here, the served flow runs asked for a temporary server of their own and lost their concurrency slot)


def start_server(port: int = 4200, scheduler_seconds: float = 10.0, timeout: float = 180.0,
                 ) -> tuple[str, subprocess.Popen]:
    """Start a real Prefect server (with its scheduler service) on localhost and wait until it answers.

    The temporary server Prefect starts on its own runs no scheduler, so scheduled deployments would
    never fire without a real one.
    """
    port = free_port(port)
    env = {**os.environ, "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": str(scheduler_seconds),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    prefect = Path(sys.executable).with_name("prefect")
    # a session of its own: stopping it stops its uvicorn workers too (evertrain.processes)
    process = subprocess.Popen([str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with status {process.returncode} before answering")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return url, process
        except OSError:
            time.sleep(1)
    processes.stop([process], signal.SIGKILL, timeout=0)
    raise RuntimeError(f"the Prefect server did not answer on {url} within {timeout:.0f} s")


def start_temporary_server() -> Any | None:
    """Prefect's temporary server for a run without ``PREFECT_API_URL`` (what Prefect would start on its first API
    call), started now and tied to this process: a SIGKILLed ``evertrain run`` no longer leaves
    it running, and a Ctrl-C no longer stops it before the run has reported its end. Prefect's own client finds and
    uses it (one temporary server per process). None when a server is configured (``PREFECT_API_URL``, a profile)
    or temporary servers are off. Call it from the main thread: the tie is to the thread that starts it."""
    # late: Prefect (the note at the top)
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    server = _tied_server_class()()
    server.start()
    return server


def _tied_server_class() -> type:
    # late: Prefect (the note at the top); its server package (~3 s) only the temporary server uses
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class TiedServer(SubprocessASGIServer):
        """Prefect's SubprocessASGIServer (prefect 3.9's command, unchanged) started with :func:`processes.tied_to`."""

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                   "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)}
            return subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                 "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "error", "--lifespan", "on"],
                env=env, preexec_fn=functools.partial(processes.tied_to, os.getpid()))

    return TiedServer


def stop_temporary_server() -> None:
    """Stop the temporary server this process started (a second stop signal: nothing is reported any more)."""
    with contextlib.suppress(Exception):
        # late: Prefect's server package (~3 s); only the temporary server uses it
        from prefect.server.api.server import SubprocessASGIServer

        for server in list(SubprocessASGIServer._instances.values()):
            server.stop()


def stop_server(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a server :func:`start_server` started: SIGTERM to it and its workers, then SIGKILL to what is left
    after ``timeout`` seconds."""
    processes.stop([process], timeout=timeout)


def build_deployment(config: CampaignConfig, *, interval: float | None = None, cron: str | None = None,
                     iterations_per_run: int = 1) -> Any:
    """The Prefect deployment of ``config``'s campaign on a schedule."""
    # late: Prefect (the note at the top)
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.deployments.runner import EntrypointType

    # late: torch and Prefect (the campaign flow; the note at the top)
    from evertrain.flows.campaign import campaign_flow

    if interval is not None and cron is not None:
        raise ValueError("give one schedule: an interval in seconds or a cron expression, not both")
    return campaign_flow.to_deployment(
        name=f"campaign-{config.name}",
        interval=interval,
        cron=cron,
        parameters={"config": config.resolved().model_dump(mode="json"), "iterations": iterations_per_run},
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        description=f"evertrain campaign {config.name!r}: {iterations_per_run} iteration(s) per scheduled run.",
        tags=["evertrain", f"campaign:{config.name}"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )


def serve(configs: list[CampaignConfig], *, interval: float | None = None, cron: str | None = None,
          iterations_per_run: int = 1) -> None:
    """Serve every campaign's deployment from this process until interrupted."""
    # late: Prefect (the note at the top)
    from prefect import serve as prefect_serve

    if interval is None and cron is None:
        raise ValueError("give exactly one schedule: an interval in seconds or a cron expression")
    for config in configs:  # the operator's config, what runs from the deployment must keep (evertrain.promises)
        promises.record(config)
    deployments = [build_deployment(c, interval=interval, cron=cron, iterations_per_run=iterations_per_run)
                   for c in configs]
    deployments += [build_drift_deployment(c) for c in configs if c.drift.enabled]
    prefect_serve(*deployments, limit=len(deployments))


def ensure_work_pool(pool: str, pool_type: str = "process", concurrency: int | None = None) -> None:
    """Create work pool ``pool`` of ``pool_type`` (process here; docker or kubernetes in production) if missing."""
    # late: Prefect (the note at the top)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    # already there: keep it as its owner configured it
    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
        client.create_work_pool(WorkPoolCreate(name=pool, type=pool_type, concurrency_limit=concurrency))


def deploy(configs: list[CampaignConfig], *, pool: str, interval: float | None = None, cron: str | None = None,
           iterations_per_run: int = 1) -> list[Any]:
    """Register each campaign's deployment in work pool ``pool``; workers (``prefect worker start --pool``) run them.

    Without a schedule the deployment runs only when triggered (the UI's "Run" form, the API, or
    ``prefect deployment run``). Each keeps the deployment concurrency limit of one, so two runs of a
    campaign never overlap however many workers poll the pool; the store's per-campaign claim is the
    last line of defence. The entrypoint is the installed module ``evertrain.flows.campaign``, so a
    worker needs only this package installed (a Docker or Kubernetes pool: an image with it).
    """
    ensure_work_pool(pool)
    ids = []
    for config in configs:
        promises.record(config)  # the operator's config, what runs from the deployment must keep
        deployment = build_deployment(config, interval=interval, cron=cron, iterations_per_run=iterations_per_run)
        ids.append(deployment.apply(work_pool_name=pool))
        if config.drift.enabled:
            ids.append(build_drift_deployment(config).apply(work_pool_name=pool))
    return ids


def build_endpoint_deployment(config: CampaignConfig, *, host: str | None = None, port: int | None = None) -> Any:
    """The Prefect deployment of ``config``'s endpoint (evertrain.serving): run it once, it serves until cancelled.

    No schedule: a run is started from the UI, the API or ``prefect deployment run 'endpoint/endpoint-<name>'``.
    A concurrency limit of one keeps a second endpoint of the campaign from starting on the same port.
    """
    # late: Prefect (the note at the top)
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.deployments.runner import EntrypointType

    # late: this module imports Prefect (the note at the top)
    from evertrain.serving.flow import endpoint_flow

    return endpoint_flow.to_deployment(
        name=f"endpoint-{config.name}",
        parameters={"config": config.resolved().model_dump(mode="json"), "host": host, "port": port},
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
        description=f"evertrain endpoint of campaign {config.name!r}: OpenAI-compatible chat completions from its "
                    "champion, hot-swapped on promotion, traced into the store.",
        tags=["evertrain", "endpoint", f"campaign:{config.name}"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )


def build_drift_deployment(config: CampaignConfig, interval: float | None = None) -> Any:
    """The drift monitor of ``config``'s campaign (evertrain.drift) as a deployment checking every
    ``drift.interval_seconds``: on a drop of the live pass rate it runs the campaign's deployment, with the reason.

    A concurrency limit of one, cancelling a new check while one runs: checks never pile up behind a slow store.
    """
    # late: Prefect (the note at the top)
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.deployments.runner import EntrypointType

    # late: this module imports Prefect (the note at the top)
    from evertrain.drift import drift_flow

    drift = config.drift
    return drift_flow.to_deployment(
        name=f"drift-{config.name}",
        interval=interval or drift.interval_seconds,
        parameters={"config": config.resolved().model_dump(mode="json")},
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
        description=f"evertrain drift monitor of campaign {config.name!r}: when an environment's live pass rate "
                    f"over {drift.window_minutes:g} min falls below {drift.threshold:.2f} (n >= {drift.min_requests}), "
                    f"runs {drift.iterations} iteration(s) of the campaign.",
        tags=["evertrain", "drift", f"campaign:{config.name}"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )


def serve_flywheel(config: CampaignConfig, *, monitor_interval: float | None = None) -> None:
    """Serve the campaign's deployment without a schedule (only the drift monitor starts it) and the drift
    monitor on its interval, from this process until interrupted (the drift demo, evertrain.flywheel)."""
    # late: Prefect (the note at the top)
    from prefect import serve as prefect_serve

    promises.record(config)  # what the drift runs of the deployment must keep
    prefect_serve(build_deployment(config, iterations_per_run=config.drift.iterations),
                  build_drift_deployment(config, interval=monitor_interval), limit=2)
