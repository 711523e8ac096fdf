"""A person approves each promotion (``promotion.approval = "required"``).

After the gate has passed a challenger, the promote stage pauses its Prefect flow run (the iteration's)
with :func:`prefect.flow_runs.pause_flow_run` and a typed input form, :class:`ApprovalInput`, whose
description is the gate's evidence in Markdown (:func:`evidence_markdown`). A reviewer answers in the
Prefect UI, or with ``evertrain approve|reject --campaign C``, which resumes the paused run with the same
input through the same API the UI calls (:func:`answer`). No answer within ``promotion.approval_timeout_s``
rejects. Each answer (who, when, why, and the evidence shown) is a row of the ``approvals`` table and
tags on the iteration's MLflow run.

While it waits the campaign is paused: the pause is a blocking one, so the process that runs the campaign
keeps its memory and nothing trains, samples or evaluates until the answer. Training on while a promotion
waits would let the next iteration's challenger overtake the one under review and leave the reviewer
judging a stale model; a blocking pause also needs no deployment to resume (a suspended flow run, which
frees the process, can only be resumed by a worker re-running a deployment).
"""

from __future__ import annotations

import hashlib
import html
import logging
import math
import os
import socket
import time
from typing import Any

import pandas as pd
from markdown_it import MarkdownIt
from prefect import get_client
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType
from prefect.exceptions import FlowPauseTimeout, NotPausedError
from prefect.flow_runs import pause_flow_run, resume_flow_run
from prefect.input import RunInput
from prefect.input.actions import delete_flow_run_input, read_flow_run_input
from prefect.input.run_input import keyset_from_base_key, keyset_from_paused_state
from prefect.settings import PREFECT_API_URL
from prefect.states import Running
from pydantic import Field, SecretStr

from evertrain.config import ConfigError
from evertrain.data.lineage import champion_vs_base
from evertrain.data.store import now
from evertrain.serving.auth import ENV_VAR, actor_name, check_secret
from evertrain.stats import mean_interval

log = logging.getLogger("evertrain.approval")
POLL_S = 2  # how often the paused stage asks the Prefect server whether it was resumed (one small GET)
EXAMPLES = 3  # completions of champion and challenger shown side by side
EXAMPLE_CHARS = 400


class ApprovalError(ConfigError):
    """Approval cannot happen here: no flow run to pause, or no paused promotion to answer."""


class ApprovalInput(RunInput):
    """The reviewer's answer to a promotion the gate passed (the form in the Prefect UI)."""

    approve: bool = Field(description="Tick to promote the challenger; leave unticked to keep the champion.")
    api_key: SecretStr = Field(description="Your evertrain API key with the 'approve' scope (`evertrain keys "
                               "create --name YOU --scopes approve`): the decision is recorded under its name. "
                               "Prefect's own server has no user accounts, so the key is how an answer proves who "
                               "gave it; it is checked against the campaign's store and removed from Prefect as "
                               "soon as it is read.")
    evidence_sha256: str = Field(description="The SHA-256 of the evidence you were shown (filled in: leave it). "
                                 "An answer naming other evidence is refused.")
    reason: str = Field("", description="Why (recorded beside the decision).")
    answered_from: str = Field("", description="Where you answer from (the CLI fills in user@host).")


def _cell(text: Any) -> str:
    """``text`` as an inline code span that survives a Markdown table cell (pipes escaped, one line)."""
    text = str(text if text is not None else "")
    if len(text) > EXAMPLE_CHARS:
        text = text[:EXAMPLE_CHARS] + " …"
    text = text.replace("\r", "").replace("\n", " ⏎ ").replace("|", "\\|")
    longest = max((len(r) for r in "".join(c if c == "`" else " " for c in text).split()), default=0)
    fence = "`" * (longest + 1)
    return f"{fence} {text} {fence}" if text.strip() else "(empty)"


def _env_gains(scores: pd.DataFrame, seed: int, samples: int = 2000) -> list[dict[str, Any]]:
    """Per environment: pass@1 of champion and challenger on the gate's paired problems, and the gain with a
    95% paired bootstrap interval (resampling problems)."""
    rows = []
    for env, group in scores.groupby("env"):
        diff = (group["challenger"] - group["champion"]).to_numpy(dtype=float)
        low, high = mean_interval(diff, samples=samples, seed=seed)
        rows.append({"env": env, "problems": len(diff), "champion": float(group["champion"].mean()),
                     "challenger": float(group["challenger"].mean()), "gain": float(diff.mean()),
                     "low": low, "high": high})
    return rows


def _sealed_lines(rt: Any) -> list[str]:
    rows = [r for r in champion_vs_base(rt.store, rt.campaign) if r["split"] != "gate"]
    lines = ["#### Sealed splits (so far: base model and current champion)", ""]
    if not rows:
        lines.append("No sealed results yet (no sealed problems configured, or no champion measured on them).")
    else:
        lines += ["| environment | split | base | champion | gain | 95% interval | problems |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['env']} | {r['split']} | v{r['base_version']} {r['base_pass1']:.3f} | "
                  f"v{r['champion_version']} {r['champion_pass1']:.3f} | {r['gain']:+.3f} | "
                  f"[{r['gain_low']:+.3f}, {r['gain_high']:+.3f}] | {r['problems']} |" for r in rows]
    lines += ["", "The challenger is measured on the sealed splits only after it is promoted: no decision, this "
              "one included, looks at them.", ""]
    return lines


def _example_lines(rt: Any, iteration: int, challenger: int, champion: int) -> list[str]:
    """A few gate problems with both models' answers, those where they differ first (challenger ahead first)."""
    rows = rt.store.gate_answers(rt.campaign, iteration, (challenger, champion))
    if rows.empty:
        return []
    wide = rows.pivot_table(index=["problem_id", "env"], columns="model_version",
                            values=["completion", "reward"], aggfunc="first").dropna()
    if wide.empty or challenger == champion:
        return []
    margin = wide[("reward", challenger)].astype(float) - wide[("reward", champion)].astype(float)
    order = sorted(range(len(wide)), key=lambda i: (-abs(margin.iloc[i]) if margin.iloc[i] else 1, -margin.iloc[i]))
    lines = ["#### Completions side by side (the gate's problems)", ""]
    for i in order[:EXAMPLES]:
        (problem_id, env), row = wide.index[i], wide.iloc[i]
        lines += [f"**{env}**, problem `{problem_id}`", "",
                  f"| | champion v{champion} | challenger v{challenger} |", "|---|---|---|",
                  f"| reward | {float(row[('reward', champion)]):.2f} | {float(row[('reward', challenger)]):.2f} |",
                  f"| completion | {_cell(row[('completion', champion)])} | {_cell(row[('completion', challenger)])} |",
                  ""]
    return lines


def evidence_markdown(rt: Any, iteration: int, decision: dict[str, Any], scores: pd.DataFrame,
                      challenger: int, champion: int) -> str:
    """What the reviewer sees: the gate's verdict and numbers, per-environment gains with intervals, the sealed
    results so far, and a few completions of champion and challenger side by side."""
    lines = [f"### Promote challenger v{challenger} over champion v{champion}?",
             f"Campaign `{rt.campaign}`, iteration {iteration}. The gate passed the challenger: "
             f"{decision['reason']}", "",
             "| gain (pass@1) | 95% interval | P(better) | problems |", "|---|---|---|---|",
             f"| {decision['gain']:+.3f} | [{decision['gain_low']:+.3f}, {decision['gain_high']:+.3f}] | "
             f"{decision['p_better']:.3f} | {len(scores)} |", "",
             "#### Per environment (the gate's problems)", "",
             "| environment | problems | champion | challenger | gain | 95% interval |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['env']} | {r['problems']} | {r['champion']:.3f} | {r['challenger']:.3f} | {r['gain']:+.3f} | "
              f"[{r['low']:+.3f}, {r['high']:+.3f}] |" for r in _env_gains(scores, rt.config.seed + iteration)]
    lines.append("")
    lines += _sealed_lines(rt)
    lines += _example_lines(rt, iteration, challenger, champion)
    timeout = rt.config.promotion.approval_timeout_s
    lines += [f"Approve or reject here, or run `evertrain approve --campaign {rt.campaign} --reason ...` (or "
              f"`evertrain reject ...`). With no answer within {timeout:g} s the challenger is rejected."]
    return "\n".join(lines)


def _record(rt: Any, iteration: int, row: dict[str, Any]) -> None:
    rt.store.replace("approvals", {"campaign": rt.campaign, "iteration": iteration},
                     [{"campaign": rt.campaign, "iteration": iteration, **row}])


def _resume_after_timeout(flow_run_id: str) -> None:
    """Pause timed out: the server holds the run Paused past its deadline and refuses a plain resume, so set it
    Running by force; the stage then records the rejection and the campaign goes on with the champion."""
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Running(), force=True)


def _publish(rt: Any, iteration: int, evidence: str) -> None:
    key = f"{rt.campaign}-iteration-{iteration}-approval".lower().replace("_", "-")
    create_markdown_artifact(evidence, key=key, description=f"Approval requested, iteration {iteration}")


def request_approval(rt: Any, iteration: int, decision: dict[str, Any], scores: pd.DataFrame,
                     challenger: int, champion: int) -> dict[str, Any]:
    """The promote stage's step after the gate: with ``promotion.approval = "required"`` and a passed gate, wait
    for a person's answer; a rejection or a timeout turns the decision into 'kept champion'."""
    if rt.config.promotion.approval != "required" or not decision["promoted"]:
        return decision
    # late: breaks the cycle approval -> evertrain.tasks (its __init__) -> tasks.promote -> approval
    from evertrain.tasks.base import current_flow_run_id

    flow_run_id = current_flow_run_id()
    if flow_run_id is None:
        raise ApprovalError(
            f"promotion.approval = 'required': iteration {iteration}'s challenger v{challenger} passed the gate, "
            "but this promote stage runs outside a Prefect flow, so it has no flow run to pause for a reviewer. "
            "Run the iteration as a flow (`evertrain run`) and answer with `evertrain approve|reject --campaign "
            f"{rt.campaign}`, or set promotion.approval = 'auto' (e.g. --set promotion.approval=auto).")
    evidence = evidence_markdown(rt, iteration, decision, scores, challenger, champion)
    digest = evidence_digest(evidence)
    requested, began = now(), time.monotonic()
    base = {"challenger_version": challenger, "champion_version": champion, "requested_at": requested,
            "flow_run_id": str(flow_run_id), "evidence": evidence, "evidence_sha256": digest}
    _record(rt, iteration, {**base, "decision": "pending", "reviewer": None, "reason": None, "decided_at": None,
                            "waited_s": None})
    _publish(rt, iteration, evidence)
    timeout = max(1, math.ceil(rt.config.promotion.approval_timeout_s))
    answer, key = _authenticated_answer(rt, iteration, str(flow_run_id), evidence, digest, began, timeout)
    verdict = "timeout" if answer is None else "approved" if answer.approve else "rejected"
    reviewer = key.name if key is not None else None
    why = answer.reason if answer is not None else f"no answer within {timeout} s"
    _record(rt, iteration, {**base, "decision": verdict, "reviewer": reviewer, "reason": why, "decided_at": now(),
                            "waited_s": time.monotonic() - began, "reviewer_key_id": key.key_id if key else None,
                            "answered_from": answer.answered_from if answer is not None else None})
    rt.tracker.set_tags(rt.tracker.run_id(iteration), {
        "approval.decision": verdict, "approval.reviewer": reviewer or "", "approval.reason": why,
        "approval.reviewer_key_id": key.key_id if key else "", "approval.evidence_sha256": digest,
        "approval.requested_at": requested.isoformat(), "approval.decided_at": now().isoformat()})
    gate = decision["reason"]
    if verdict == "approved":
        return {**decision, "reason": f"{gate}; approved by {reviewer}" + (f": {why}" if why else "")}
    said = f"rejected by {reviewer}" + (f": {why}" if why else "") if verdict == "rejected" else f"timeout, {why}"
    return {**decision, "promoted": False, "refused_by_person": True,
            "reason": f"kept champion: {said} (the gate had passed it: {gate})"}


def evidence_digest(evidence: str) -> str:
    """The hex SHA-256 of the evidence Markdown: what an answer must name to show it answers this evidence."""
    return hashlib.sha256(evidence.encode("utf-8", "surrogatepass")).hexdigest()


def _authenticated_answer(rt: Any, iteration: int, flow_run_id: str, evidence: str, digest: str, began: float,
                          timeout: int) -> tuple[ApprovalInput | None, Any]:
    """Wait for an answer that carries a working API key with the ``approve`` scope and names this evidence:
    (the answer, its key), or (None, None) at the timeout. Every answer is recorded in ``approval_attempts``; a
    refused one pauses the run again (a fresh pause key) for the rest of the time. The key is deleted from
    Prefect's run input as soon as it is read."""
    attempt = 0
    while True:
        left = math.ceil(timeout - (time.monotonic() - began))
        if left <= 0:
            return None, None
        pause_key = f"approval-{iteration}" + (f"-{attempt}" if attempt else "")
        form = ApprovalInput.with_initial_data(description=evidence, evidence_sha256=digest)
        try:
            answer = pause_flow_run(wait_for_input=form, timeout=left, poll_interval=min(POLL_S, left),
                                    key=pause_key)
        except FlowPauseTimeout:
            _resume_after_timeout(flow_run_id)
            return None, None
        _forget_input(flow_run_id, pause_key)
        key, why = check_secret(rt.store, answer.api_key.get_secret_value(), "approve")
        if not why and answer.evidence_sha256 != digest:
            why = (f"the answer names evidence {answer.evidence_sha256[:12] or '(none)'}, not the evidence shown "
                   f"({digest[:12]}): read it again (`evertrain approve --show`)")
        rt.store.append("approval_attempts", [{
            "campaign": rt.campaign, "iteration": iteration, "outcome": "refused" if why else "accepted",
            "decision": "approved" if answer.approve else "rejected", "key_id": key.key_id if key else None,
            "key_name": key.name if key else None, "answered_from": answer.answered_from, "why": why or None,
            "happened_at": now()}])
        if not why:
            return answer, key
        log.warning(
            "iteration %d: an answer to the approval was refused (%s); still waiting", iteration, why)
        attempt += 1


def _forget_input(flow_run_id: str, pause_key: str) -> None:
    """Delete the answer (it holds an API key) from the Prefect server's run input once it is read."""
    try:
        delete_flow_run_input(keyset_from_base_key(f"paused-{pause_key}")["response"], flow_run_id)
    except Exception as error:  # the decision stands; say the key may still be readable there
        log.warning(
            "could not delete the approval answer from the Prefect server (%s): revoke the key it carried if the "
            "Prefect API is readable by others", error)


def paused_promotions(campaign: str) -> list[dict[str, Any]]:
    """The campaign's flow runs paused for an approval, on the Prefect server this process talks to."""
    paused = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED])))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=paused)
    found = []
    for run in runs:
        # an iteration subflow takes the campaign's context (recorded as "<Runtime>"), and is tagged with its campaign
        config = run.parameters.get("config")
        name = config.get("name") if isinstance(config, dict) else getattr(config, "name", None)
        key = str(run.state.state_details.pause_key or "") if run.state else ""
        if (name == campaign or f"campaign:{campaign}" in (run.tags or [])) and key.startswith("approval-"):
            found.append({"flow_run_id": run.id, "iteration": run.parameters.get("iteration"), "name": run.name,
                          "state": run.state})
    return sorted(found, key=lambda r: (r["iteration"] is None, r["iteration"]))


def waiting(campaign: str, iteration: int | None = None) -> dict[str, Any]:
    """The campaign's one promotion waiting for approval (``iteration``: when several wait), with the evidence
    its form shows; a clear error when there is none."""
    if not PREFECT_API_URL.value():  # else Prefect starts a throwaway server of its own, which holds no paused run
        raise ApprovalError("PREFECT_API_URL is not set: point it at the Prefect server the campaign runs on "
                            "(e.g. http://127.0.0.1:4200/api, the server `evertrain ui` starts)")
    runs = paused_promotions(campaign)
    if iteration is not None:
        runs = [r for r in runs if r["iteration"] == iteration]
    if not runs:
        where = f" iteration {iteration} of" if iteration is not None else ""
        raise ApprovalError(
            f"no promotion of{where} campaign {campaign!r} is waiting for approval on the Prefect server at "
            f"{PREFECT_API_URL.value()} "
            "(`evertrain sql \"SELECT * FROM approvals\"` lists the decisions so far)")
    if len(runs) > 1:
        raise ApprovalError(f"{len(runs)} promotions of campaign {campaign!r} wait for approval (iterations "
                            f"{', '.join(str(r['iteration']) for r in runs)}): choose one with --iteration")
    run = runs[0]
    evidence = read_flow_run_input(keyset_from_paused_state(run["state"])["description"], run["flow_run_id"])
    return {**run, "evidence": evidence or ""}


def answer(campaign: str, approve: bool, reason: str = "", api_key: str | None = None,
           iteration: int | None = None, answered_from: str | None = None) -> dict[str, Any]:
    """Resume the campaign's paused promotion with a reviewer's answer, as the Prefect UI's form does. The
    answer carries ``api_key`` (default: ``$EVERTRAIN_API_KEY``), which needs the ``approve`` scope: the stage
    that waits checks it against the store and records the decision under the key's name."""
    secret = api_key or os.environ.get(ENV_VAR, "")
    if not secret:
        raise ApprovalError(f"an answer needs an API key with the 'approve' scope: set {ENV_VAR} or give "
                            "--key-file (make one with `evertrain keys create --name YOU --scopes approve`)")
    run = waiting(campaign, iteration)
    where = answered_from or f"{actor_name()}@{socket.gethostname()} (evertrain CLI)"
    try:
        resume_flow_run(run["flow_run_id"], run_input={
            "approve": approve, "api_key": secret, "evidence_sha256": evidence_digest(run["evidence"]),
            "reason": reason, "answered_from": where})
    except FlowPauseTimeout as error:
        raise ApprovalError(f"too late: the wait of iteration {run['iteration']} timed out, which rejected the "
                            "challenger") from error
    except (NotPausedError, RuntimeError) as error:  # answered meanwhile, or the server refused the input
        raise ApprovalError(f"iteration {run['iteration']} of campaign {campaign!r} could not be resumed: "
                            f"{error}") from error
    return {**run, "approve": approve, "reason": reason, "answered_from": where}


def approval_page(evidence: str, title: str = "Promotion waiting for approval") -> str:
    """The evidence Markdown as a self-contained HTML page (what `evertrain approve --html` writes), rendered
    with the CommonMark parser plus tables, as the Prefect UI renders a form's description."""
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(evidence)
    style = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #bbb;padding:4px 8px;"
             "vertical-align:top}code{white-space:pre-wrap;font-size:90%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>{body}</body></html>")
