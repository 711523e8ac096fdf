"""The loop as Prefect flows.

``iteration_flow`` is the outline of one pass: curate → rollout → score → update → evaluate → promote.
Stages already completed for that iteration (in ``stage_runs``) are skipped, so a killed iteration
resumes at its first unfinished stage. ``campaign_flow`` runs N iterations, or forever, continuing
after the campaign's last finished iteration.

In async mode (``update.mode = "async"``) the update of iteration i runs beside the curate, rollout
and score stages of iteration i+1, which therefore sample from the trainee as it was before that
update: one version old, within the staleness bound the update corrects for. Iteration i+1 then finds
those stages completed and skips them.

``campaign_flow`` takes the config (a deployment's form in the Prefect UI) and opens the campaign context
(:class:`evertrain.runtime.Runtime`: the store connection, claimed as the campaign's one writer) once; every
iteration subflow and stage task receives that context, and it is closed when the flow ends, however it ends.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, tags
from prefect.context import FlowRunContext

from evertrain import interrupts, promises
from evertrain.config import CampaignConfig
from evertrain.data.lineage import iteration_report
from evertrain.drift import campaign_run_name
from evertrain.report import iteration_line
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_TASKS, STAGES

COMPACT_EVERY = 5  # iterations between compactions of the store (measured: benchmarks/store.py)
# snapshots younger than this survive a compaction (a reader's running query reads its snapshot's files): longer
# than any read evertrain makes, and short, because every snapshot kept is catalog rows each query reads
# (measured, benchmarks/growth.py: kept for an hour, a tiny campaign's stage CPU per iteration rose from 1.9 to
# 3.4 s by iteration 120, its queries 2-3x slower than after expiring them)
COMPACT_KEEP_SECONDS = 300.0


def next_iteration(rt: Runtime) -> int:
    """The first iteration with an unfinished stage (0 for a new campaign)."""
    # only the six stages count: an optional stage (sft) is not one of them
    frame = rt.store.completed_stages(rt.campaign, list(STAGES))
    for row in frame.itertuples(index=False):
        if row.done < len(STAGES):
            return int(row.iteration)
    return int(frame["iteration"].max()) + 1 if len(frame) else 0


# the context is not JSON: Prefect records it as "<Runtime>" in the subflow's parameters (the campaign's config
# is the parent run's parameter), and does not validate it (pydantic has no schema for a store connection)
@flow(name="evertrain-iteration", flow_run_name="{rt.campaign}-iteration-{iteration}", log_prints=True,
      validate_parameters=False)
def iteration_flow(rt: Runtime, iteration: int) -> dict[str, Any]:
    """One pass of the loop for ``iteration``, resuming at its first unfinished stage, in the open context ``rt``."""
    config = rt.config
    done = rt.store.stage_status(rt.campaign, iteration)
    metrics: dict[str, Any] = {}
    for stage in STAGES:
        interrupts.check()  # a stop signal whose KeyboardInterrupt was swallowed (evertrain.interrupts)
        if (stage == "update" and config.sft.runs_in(iteration) and done.get("sft") != "completed"
                and done.get("update") != "completed"):
            # late: the optional stage between score and update brings trl and datasets (~1.5 s): a campaign
            # without it does not load them
            from evertrain.tasks.sft import sft_task

            metrics["sft"] = sft_task(rt, iteration)
        if done.get(stage) == "completed":
            continue
        if stage == "update" and config.update.mode == "async":
            # the next iteration samples from the trainee as it is now, before this update: read here, not when its
            # rollout starts (a quick update could finish first, and the lag would depend on which thread won)
            before = rt.trainee_version()
            future = STAGE_TASKS["update"].submit(rt, iteration)
            ahead = rt.store.stage_status(rt.campaign, iteration + 1)
            for early in ("curate", "rollout", "score"):  # the next iteration's sampling overlaps this update
                if ahead.get(early) != "completed":
                    extra = {"version": before} if early == "rollout" else {}
                    metrics[f"next_{early}"] = STAGE_TASKS[early](rt, iteration + 1, **extra)
            metrics[stage] = future.result()
            continue
        metrics[stage] = STAGE_TASKS[stage](rt, iteration)
    return metrics


@flow(name="evertrain-campaign", flow_run_name=campaign_run_name, log_prints=True)
def campaign_flow(config: CampaignConfig, iterations: int | None = None) -> list[int]:
    """Run ``iterations`` iterations of the campaign (None: forever), after its last finished one."""
    with Runtime.open(config) as rt:  # once per run: every stage shares it, and it is closed however the run ends
        if _from_a_deployment():  # a run through Prefect's API or UI may not change what the campaign promises
            promises.check(rt.store, config)
        return run_campaign(rt, iterations)


def _from_a_deployment() -> bool:
    """Whether this flow run was created from a deployment (its form in the UI, the API, a schedule, a worker)."""
    context = FlowRunContext.get()
    return context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None


def run_campaign_flow(rt: Runtime, iterations: int | None = None) -> list[int]:
    """:func:`campaign_flow` in a context the caller has already opened (``evertrain run``: a campaign another
    process runs is refused before any flow run exists), with the same name and parameters in the Prefect UI: the
    config is the context's, passed once (the flow run records it as its parameter, as a deployment's form does)."""

    @flow(name="evertrain-campaign", flow_run_name=campaign_run_name, log_prints=True)
    def campaign_flow(config: CampaignConfig, iterations: int | None = None) -> list[int]:
        return run_campaign(rt, iterations)

    return campaign_flow(rt.config, iterations)


def _report_iteration(rt: Runtime, iteration: int) -> None:
    """One line on the terminal as an iteration ends (reward, groups with signal, the gate, cost): written to
    stderr itself, not printed, so Prefect's log formatting does not widen it past 100 columns."""
    row = next(iter(iteration_report(rt.store, rt.campaign, only=iteration)), None)
    if row is not None:
        sys.stderr.write(iteration_line(row) + "\n")
        sys.stderr.flush()


def run_campaign(rt: Runtime, iterations: int | None = None) -> list[int]:
    """The body of :func:`campaign_flow`, in an open context ``rt`` (which the caller closes)."""
    # a rollout backend that cannot run the model refuses now, not when its engine dies mid-rollout
    rt.inference.check(rt.base_model)
    finished: list[int] = []
    while iterations is None or len(finished) < iterations:
        interrupts.check()
        iteration = next_iteration(rt)
        # the subflow's parameters hold the context, not the config: the tag names its campaign (the Prefect UI's
        # filter, and how `evertrain approve` finds a paused promotion of the campaign)
        with tags(f"campaign:{rt.campaign}"):
            iteration_flow(rt, iteration)
        finished.append(iteration)
        _report_iteration(rt, iteration)
        if (iteration + 1) % COMPACT_EVERY == 0:
            # every stage write adds Parquet files to a DuckLake store: merge them so readers (and the
            # next curate, which reads the whole pass-rate history) do not slow down as a campaign runs
            rt.store.compact(keep_seconds=COMPACT_KEEP_SECONDS)
    return finished
