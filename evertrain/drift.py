"""The drift monitor: when the deployed model's live pass rate drops, start the loop.

Every ``drift.interval_seconds`` (a Prefect deployment beside the campaign's, ``flows/deploy.py``) the monitor
reads the endpoint's graded traces of the last ``drift.window_minutes`` from the store, per environment and tool
(the tool a request declared is the tool's version: ``python`` before the calculator's interface changed,
``calc`` after), counting only the model version that served that environment and tool last, so a champion
swapped in after a drop is judged on its own answers. An environment and tool is *dropped* when it has at least
``drift.min_requests`` graded requests and its pass rate is below ``drift.threshold`` (with ``drift.confident``,
the whole 95% Wilson interval below it). Where several clients (API keys) sent an environment and tool's requests,
each client's slice is read too, and a drop in any slice counts: one client's burst of easy, passing requests
cannot hide another client's drop inside the pooled rate.

On a drop, with ``drift.action = "run"``, the monitor runs the campaign's deployment (Prefect's
``run_deployment``, ``drift.iterations`` iterations) under a flow run name and tags that say why (``drift:
calculator[calc] 0.04 < 0.50``), and publishes a Markdown artifact with each dropped environment's rate, its
interval, n and the threshold, so the Prefect UI shows the reason beside the run. One drop starts one run:
nothing starts while a run of that deployment is scheduled, running or paused (an approval waits), nor within
``drift.cooldown_minutes`` of the last run the monitor started; both are read from the Prefect server, so
monitors in several processes agree. A run the monitor started that failed or crashed (the store locked, a worker
lost) is retried at the next check that still finds the drop, without waiting out the cooldown, up to
``drift.retries`` times in a row; after that the cooldown applies and the check's outcome names the failed run.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.sorting import FlowRunSort
from prefect.context import FlowRunContext
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from evertrain.config import CampaignConfig
from evertrain.data.store import Store
from evertrain.stats import wilson

log = logging.getLogger("evertrain.drift")

DRIFT_TAG = "evertrain-drift"  # on every campaign run the monitor starts
ACTIVE_STATES = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING")
FAILED_STATES = ("FAILED", "CRASHED")  # a run the monitor started that ended so is retried (drift.retries)


@dataclass
class Reading:
    """The live pass rate of one environment and tool over the window, and what the monitor made of it."""

    env: str
    tools: str
    model_version: int | None
    requests: int
    passed: int
    rate: float
    low: float
    high: float
    dropped: bool
    client: str | None = None  # one client's slice (its API key id); None: every client's requests pooled

    def label(self) -> str:
        return f"{self.env}[{self.tools or 'no tool'}]" + (f" client {self.client}" if self.client else "")


def live_window(store: Store, campaign: str, window_minutes: float, threshold: float, min_requests: int,
                confident: bool = True, at: datetime | None = None) -> list[Reading]:
    """The live pass rate per environment and tool over the last ``window_minutes`` (before ``at``, default now), and
    per client of each environment and tool that several clients used."""
    since = (at or datetime.now(UTC)) - timedelta(minutes=window_minutes)

    def reading(row: Any, client: str | None = None) -> Reading:
        n, k = int(row.requests), int(row.passed)
        low, high = wilson(k, n)
        rate = k / n if n else 0.0
        below = high < threshold if confident else rate < threshold
        return Reading(env=row.env, tools=row.tools or "", model_version=_int(row.model_version), requests=n,
                       passed=k, rate=rate, low=low, high=high, dropped=n >= min_requests and below, client=client)

    readings = [reading(row) for row in store.live_window_counts(campaign, since).itertuples(index=False)]
    slices = store.live_window_counts(campaign, since, by_client=True)
    shared = slices.groupby(["env", "tools"], dropna=False)["client"].transform("nunique") > 1
    readings += [reading(row, row.client) for row in slices[shared].itertuples(index=False)]
    return readings


def campaign_run_name() -> str:
    """The name of a campaign flow run: the campaign's, except that a run the monitor started keeps the name that
    says why (``drift: calculator[calc] 0.04 < 0.50``) for the Prefect UI, instead of being renamed when it starts."""
    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    if run is not None and DRIFT_TAG in (run.tags or []) and run.name:
        return run.name
    config = (context.parameters or {}).get("config") if context is not None else None
    name = config.get("name") if isinstance(config, dict) else getattr(config, "name", None)
    return str(name or "campaign")


def deployment_name(config: CampaignConfig) -> str:
    """The deployment a drop runs: ``drift.deployment``, else the campaign's own (flows/deploy.py)."""
    return config.drift.deployment or f"evertrain-campaign/campaign-{config.name}"


def blocking_run(config: CampaignConfig, at: datetime | None = None) -> str | None:
    """Why a drop may not start a run now (a run in flight, or the cooldown), or None when it may."""
    name = deployment_name(config)
    at = at or datetime.now(UTC)
    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise LookupError(f"drift: no deployment {name!r} on the Prefect server: serve the campaign's deployment "
                              "(`evertrain serve`) or set drift.deployment") from None
        active = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(ACTIVE_STATES)))), limit=1)
        if active:
            run = active[0]
            return f"in flight: run {run.name!r} of {name} is {run.state.type.value.lower()}"
        last = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[DRIFT_TAG, f"campaign:{config.name}"])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=config.drift.retries + 1)
        if last and last[0].created is not None:
            failed = 0  # the monitor's latest runs that failed, in a row
            for run in last:
                if run.state is None or run.state.type.value not in FAILED_STATES:
                    break
                failed += 1
            if 0 < failed <= config.drift.retries:
                log.warning("drift: the monitor's last run %r %s: retried (%d of drift.retries = %d)", last[0].name,
                            last[0].state.type.value.lower(), failed, config.drift.retries)
                return None
            since = at - last[0].created
            if since < timedelta(minutes=config.drift.cooldown_minutes):
                why = (f"; its last {failed} runs failed, more than drift.retries = {config.drift.retries}: see "
                       f"{last[0].name!r}") if failed else ""
                return (f"cooldown: the monitor started {last[0].name!r} {since.total_seconds() / 60:.1f} min ago "
                        f"(drift.cooldown_minutes = {config.drift.cooldown_minutes:g}){why}")
    return None


def reason_markdown(config: CampaignConfig, readings: list[Reading], outcome: str) -> str:
    """The artifact the Prefect UI shows: every environment and tool measured, the drops marked."""
    drift = config.drift
    rule = "its 95% interval wholly below" if drift.confident else "its pass rate below"
    lines = [f"# Drift check of campaign `{config.name}`", "",
             f"A drop: at least {drift.min_requests} graded requests in the last {drift.window_minutes:g} min and "
             f"{rule} the threshold {drift.threshold:.2f}.", "",
             "| environment [tool] | model version | live pass rate | 95% interval | n | threshold | drop |",
             "|---|---|---|---|---|---|---|"]
    for r in readings:
        lines.append(f"| {r.label()} | {r.model_version} | {r.rate:.3f} | [{r.low:.3f}, {r.high:.3f}] | {r.requests} "
                     f"| {drift.threshold:.2f} | {'**yes**' if r.dropped else 'no'} |")
    if not readings:
        lines.append("| (no graded traces in the window) | | | | 0 | | |")
    lines += ["", f"**Outcome:** {outcome}"]
    return "\n".join(lines)


def check(config: CampaignConfig, store: Store | None = None, at: datetime | None = None) -> dict[str, Any]:
    """One check: measure, and on a drop start the campaign's deployment unless a run is in flight or cooling down.

    Returns ``{"readings", "dropped", "blocked", "flow_run_id", "flow_run_name", "outcome"}``.
    """
    drift = config.drift
    if store is None:
        with Store(config.paths.store) as own:  # its own connection, closed before a run is started
            return check(config, own, at)
    readings = live_window(store, config.name, drift.window_minutes, drift.threshold, drift.min_requests,
                           drift.confident, at)
    dropped = [r for r in readings if r.dropped]
    result: dict[str, Any] = {"readings": [asdict(r) for r in readings], "dropped": [r.label() for r in dropped],
                              "blocked": None, "flow_run_id": None, "flow_run_name": None}
    if not dropped:
        result["outcome"] = "no drop"
    elif drift.action == "alert":
        result["outcome"] = "drop recorded (drift.action = 'alert': nothing started)"
    elif (blocked := blocking_run(config, at)) is not None:
        result["blocked"] = blocked
        result["outcome"] = f"drop, nothing started ({blocked})"
    else:
        run = start_run(config, dropped)
        result["flow_run_id"], result["flow_run_name"] = str(run.id), run.name
        result["outcome"] = f"drop: started {run.name!r} ({drift.iterations} iteration(s) of {deployment_name(config)})"
    return result


def start_run(config: CampaignConfig, dropped: list[Reading]) -> Any:
    """Run the campaign's deployment now, its name and tags saying which drop started it; returns the flow run."""
    threshold = config.drift.threshold
    reason = ", ".join(f"{r.label()} {r.rate:.2f} < {threshold:.2f}" for r in dropped)
    tags = [DRIFT_TAG, f"campaign:{config.name}",
            *dict.fromkeys(f"drift:{r.env}/{r.tools or 'no-tool'}" for r in dropped)]
    # timeout 0: return once the run is created; the deployment's runner or worker runs it
    return run_deployment(deployment_name(config), parameters={"iterations": config.drift.iterations},
                          flow_run_name=f"drift: {reason}"[:200], tags=tags, timeout=0)


@flow(name="evertrain-drift", flow_run_name="{config.name}-drift-check", log_prints=True)
def drift_flow(config: CampaignConfig) -> dict[str, Any]:
    """One drift check of ``config``'s campaign (the monitor's deployment runs it every drift.interval_seconds)."""
    result = check(config)
    readings = [Reading(**r) for r in result["readings"]]
    if result["dropped"]:
        create_markdown_artifact(reason_markdown(config, readings, result["outcome"]),
                                 key=f"drift-{_key(config.name)}",
                                 description=f"Drift check of {config.name}: {result['outcome']}")
    print(f"drift check of {config.name}: " + "; ".join(
        f"{r.label()} v{r.model_version} {r.rate:.2f} [{r.low:.2f}, {r.high:.2f}] n={r.requests}" for r in readings)
        + f" -> {result['outcome']}")
    return result


def _key(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
