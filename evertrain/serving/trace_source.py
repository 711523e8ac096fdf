"""Curation from traces: the endpoint's verifiable traces turned into training problems.

A trace is verifiable when the client named its task (environment and problem) and it has an outcome:
the environment's verifier's, else the client's feedback. With ``serving.curate_from_traces`` on, each
iteration's curation adds up to ``serving.trace_problems`` of them: failures first (what the deployed
model got wrong is what there is to learn), and ``serving.trace_success_share`` of the places for passed
ones, so training keeps problems the model already solves; either side fills what the other lacks. No client
(API key) gives more than ``serving.trace_client_share`` of the places: one client's traffic cannot fill an
iteration (``dropped_trace_client_cap``).

A trace's task becomes a training problem only as the environment itself sets it
(:meth:`~evertrain.envs.base.Environment.rebuild`: the answer it computes or holds, never the one the request
carried, so a client that claims a wrong answer cannot make the loop train toward it); a task the environment
cannot vouch for (a reasoning-gym item, generated without end) is dropped as ``trace_unverifiable``.

They pass the same gates as curated problems: a problem already taken this iteration is a duplicate, and
one that is any environment's held-out problem (the gate's or a sealed split's, by id, by its prompt after
normalisation: Unicode forms folded, invisible characters, punctuation, spacing and case ignored; or for
natural-language data sets by a shared word n-gram) is contaminated and never trained on,
so a client that sends the gate's questions cannot leak them into training. Only environments of the
campaign count. Each problem keeps its id (the content hash of the task, so one problem asked by many
clients is trained on once) and carries its provenance in its payload: ``payload["provenance"] =
{"source": "trace", "trace_id", "model_version", "passed", "outcome_source"}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from functools import cache
from typing import Any

from evertrain.config import CampaignConfig
from evertrain.curriculum import gate_problems
from evertrain.data.store import now
from evertrain.envs import registry
from evertrain.envs.base import SEALED_SPLITS, Problem
from evertrain.envs.quality import normal_prompt
from evertrain.runtime import Runtime


def _normal(prompt: str) -> str:
    return normal_prompt(prompt)


@cache
def _held_prompts(config_json: str) -> frozenset[tuple[str, str]]:
    """(environment, normalized prompt) of every held-out problem: a client may phrase the payload differently
    (a content hash then differs), but the gate's question itself must never be trained on.

    Cached by the config's JSON: a pure function of it (environments built here, no store or connection kept)."""
    config = CampaignConfig.model_validate_json(config_json)
    held = set()
    for spec in config.environments:
        env, gate = registry.get(spec.name, **spec.options), config.held_out_size(spec.name)
        sealed = [p for split in SEALED_SPLITS
                  for p in env.sealed_problems(split, config.sealed_size(spec.name), config.seed, gate)]
        held |= {(spec.name, _normal(p.prompt)) for p in gate_problems(env, config) + sealed}
    return frozenset(held)


def trace_problems(rt: Runtime, taken: set[str], held_out: tuple[set[str], Any], limit: int | None = None,
                   dropped: dict[str, int] | None = None) -> list[Problem]:
    """Up to ``limit`` (default ``serving.trace_problems``) training problems from verifiable traces, failures
    first; ``taken`` (problem ids already chosen) grows with each one kept; ``dropped`` counts why others were not.
    ``held_out`` is curation's (ids, n-gram index) of the gate's and sealed problems, which no trace may enter."""
    serving = rt.config.serving
    limit = serving.trace_problems if limit is None else limit
    dropped = {} if dropped is None else dropped
    if limit <= 0:
        return []
    since = now() - timedelta(hours=serving.trace_window_hours)
    frame = rt.store.verifiable_traces(rt.campaign, since)
    held_ids, held_index = held_out
    held_prompts = _held_prompts(rt.config.model_dump_json())
    campaign_envs = {spec.name for spec in rt.config.environments}
    want_passed = round(limit * serving.trace_success_share)
    per_client = max(1, math.ceil(limit * serving.trace_client_share))  # no client fills the iteration alone
    clients: dict[Any, int] = {}
    pools: dict[bool, list[Problem]] = {False: [], True: []}
    seen: set[str] = set()
    for row in frame.itertuples(index=False):
        reason = None
        client = row.key_id if isinstance(row.key_id, str) else None
        if clients.get(client, 0) >= per_client:
            reason = "trace_client_cap"
        elif row.env not in campaign_envs:
            reason = "trace_other_env"
        else:
            env = rt.env(row.env)
            try:
                data = json.loads(row.problem)
                sent = env.parse_problem(data)
                # the same task under the generator's own payload: its id is what the held-out set lists
                raw = {k: v for k, v in data.items() if k not in ("prompt", "question")} \
                    if isinstance(data, dict) else {}
                ids = {sent.id, Problem.make(row.env, sent.prompt, raw).id}
            except (ValueError, KeyError, TypeError):
                reason = "trace_unparseable"
            else:
                # the environment's own problem: its answer, never the one the request carried
                problem = env.rebuild(sent)
                if problem is not None:
                    ids.add(problem.id)
                if ids & held_ids or any((row.env, _normal(p.prompt)) in held_prompts for p in (sent, problem) if p) \
                        or (not env.templated and held_index.overlaps(sent.prompt)):
                    reason = "trace_contaminated"
                elif problem is None:
                    reason = "trace_unverifiable"
                elif problem.id in taken or problem.id in seen:
                    reason = "trace_duplicate"
        if reason is not None:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        seen.add(problem.id)
        clients[client] = clients.get(client, 0) + 1
        provenance = {"source": "trace", "trace_id": row.trace_id, "model_version": _int(row.model_version),
                      "passed": bool(row.passed), "outcome_source": row.source, "answer_from": "environment"}
        pools[bool(row.passed)].append(replace(problem, split="train",
                                               payload={**problem.payload, "provenance": provenance}))
    passed = pools[True][:want_passed]
    failed = pools[False][:limit - len(passed)]
    passed = pools[True][:limit - len(failed)]  # too few failures: successes fill the rest
    chosen = failed + passed
    taken.update(p.id for p in chosen)
    return chosen


def trace_rows(rt: Runtime, taken: set[str], metrics: dict[str, Any], held_out: tuple[set[str], Any],
               to_row: Callable[[Problem], dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``problems`` rows (made by curation's ``to_row``) of this iteration's trace problems, with their counts
    in ``metrics``: trace_problems, trace_failures and dropped_trace_<reason>. Curation passes its own held-out
    index and row maker in, so this module never imports the stage (no import cycle)."""
    dropped: dict[str, int] = {}
    chosen = trace_problems(rt, taken, held_out, dropped=dropped)
    metrics["trace_problems"] = len(chosen)
    metrics["trace_failures"] = sum(not p.payload["provenance"]["passed"] for p in chosen)
    metrics.update({f"dropped_{reason}": count for reason, count in dropped.items()})
    return [to_row(p) for p in chosen]


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
