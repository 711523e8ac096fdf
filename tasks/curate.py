"""Stage 1, curate: choose this iteration's training problems, and keep out the ones that teach nothing.

For each environment (its share of the iteration follows its weight) candidates are drawn, seeded by
(campaign seed, iteration, environment) so a rerun chooses the same problems, at the environment's curriculum
level for the iteration (``curriculum.enabled``; :mod:`evertrain.curriculum`), then filtered in order:

1. ``duplicate``: the same problem (content hash) already chosen this iteration;
2. ``near_duplicate``: word 3-grams overlapping a chosen problem's beyond ``curation.near_duplicate_jaccard``;
3. ``contaminated``: being any environment's held-out problem (the gate's, a sealed split's or the broad
   sealed set's, :mod:`evertrain.curriculum`), or sharing a word n-gram with the held-out problem of a
   data-set environment;
4. ``guessable``: its environment's most common expected answer is more than ``curation.max_majority_share``
   of its items (:func:`evertrain.envs.quality.answer_majority`, a yes/no kind): a constant answer would be paid
   that often, so the whole environment leaves training (and a warning says why);
5. ``hackable``: a wrong or constant answer passes it (zero, empty, a fixed string, the answer's numbers
   zeroed, its sign or a digit changed; :func:`evertrain.envs.quality.hackable`), in environments graded on a
   final answer (``curation.quality_check``): the policy would learn that answer, not the problem;
6. ``too_easy`` / ``too_hard``: the trainee passed all, or none, of its last ``curation.history_k``
   bare attempts (the pass-rate history is the ``rollouts`` table itself, so it survives restarts and is
   shared by every iteration of the campaign; only earlier iterations count, so reruns are stable);
7. ``uninformative`` (``frontier.enabled``): its kind's recent groups predict rewards that all agree
   (:mod:`evertrain.frontier`, which also puts a hint in the prompts of kinds that keep failing).

The stage records how many candidates each rule dropped. Rules 2 and 3's n-gram checks apply to problems
written in natural language (data sets such as GSM8K or MBPP); problems stamped from templates by a
generator (``Environment.templated``: arithmetic, reasoning-gym, ...) differ in a few numbers, would all
look alike, and are kept apart from their held-out set by their exact ids.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from evertrain.config import CampaignConfig
from evertrain.curriculum import broad_guard, ensure_broad, gate_problems
from evertrain.curriculum import candidates as curriculum_candidates
from evertrain.curriculum import record as record_levels
from evertrain.data.store import now, to_json
from evertrain.envs import registry
from evertrain.envs.base import Environment, Problem
from evertrain.envs.quality import Majority, NgramIndex, answer_majority, hackable
from evertrain.frontier import Plan, Selection, curated_metrics, guide
from evertrain.frontier import plan as frontier_plan
from evertrain.frontier import record as frontier_record
from evertrain.mix import record
from evertrain.runtime import Runtime, seed_for
from evertrain.serving.trace_source import trace_rows
from evertrain.tasks.base import allocate, run_stage

RULES = ("duplicate", "near_duplicate", "contaminated", "guessable", "hackable", "too_easy", "too_hard",
         "uninformative")
_log = logging.getLogger(__name__)


@cache
def _held_out_index(config_json: str) -> tuple[frozenset[str], NgramIndex]:
    # a pure function of the config (environments built here, nothing opened is kept): safe to cache
    config = CampaignConfig.model_validate_json(config_json)
    index = NgramIndex(n=config.curation.decontamination_ngram)
    ids = set()
    for spec in config.environments:
        env = registry.get(spec.name, **spec.options)
        try:
            ids |= _held_out_of(env, spec.name, config, index)
        finally:
            env.close()  # what it started for this (an environment server) is not kept
    return frozenset(ids), index


def _held_out_of(env: Any, name: str, config: CampaignConfig, index: NgramIndex) -> set[str]:
    """The ids of ``env``'s held-out problems (the gate's and the sealed splits'); their n-grams go into ``index``."""
    ids: set[str] = set()
    mine = NgramIndex(n=config.curation.decontamination_ngram)
    gate = config.held_out_size(name)
    # the sealed splits are kept out of training like the gate's set: curation only learns their ids
    # and n-grams to refuse anything that leaks them, never their answers or scores
    sealed = [p for split in ("test", "transfer")
              for p in env.sealed_problems(split, config.sealed_size(name), config.seed, gate)]
    for problem in gate_problems(env, config) + sealed:
        ids.add(problem.id)
        if not env.templated:
            mine.add(problem.prompt)
    if not env.templated:  # the environment's own instructions repeat in every prompt: not a leak
        mine.drop_boilerplate([p.prompt for p in env.problems("train", 200, config.seed)])
    index.grams |= mine.grams
    return ids
    return frozenset(ids), index


_majorities: dict[tuple[str, str], Majority | None] = {}


def _majority(config: CampaignConfig, env: Environment) -> Majority | None:
    # once per process and config: 200 of the environment's items drawn (its generator is seeded: a pure function)
    key = (config.model_dump_json(), env.name)
    if key not in _majorities:
        try:
            majority = answer_majority(env, seed=config.seed)
        except Exception as error:  # a generator that cannot draw 200 items: the per-item checks still run
            _log.warning("%s: its most common answer could not be measured (%s: %s)", env.name,
                         type(error).__name__, error)
            majority = None
        if majority is not None and majority.share > config.curation.max_majority_share:
            _log.warning("%s leaves training: %r is the expected answer of %.0f%% of %d of its items, so a "
                         "constant answer would be paid that often (curation.max_majority_share = %s)", env.name,
                         majority.answer, 100 * majority.share, majority.items, config.curation.max_majority_share)
        _majorities[key] = majority
    return _majorities[key]


def attempt_history(rt: Runtime, iteration: int, ids: list[str], k: int) -> dict[str, tuple[int, int]]:
    """(attempts, passes) over each problem's last ``k`` scored attempts before ``iteration``."""
    if not ids or k <= 0:
        return {}
    return rt.store.attempt_history(rt.campaign, iteration, ids, k)


def select(rt: Runtime, iteration: int, env: Environment, candidates: list[Problem], want: int,
           taken: set[str], chosen: NgramIndex, dropped: dict[str, int],
           selection: Selection | None = None) -> list[Problem]:
    """The first ``want`` of ``candidates`` that pass the rules (module docstring), in order.

    ``taken`` (the iteration's problem ids so far) and ``chosen`` (their natural-language prompts' 3-grams)
    grow with every kept problem; ``dropped`` counts the candidates each rule dropped. With
    ``frontier.enabled`` the frontier (:mod:`evertrain.frontier`) decides last, into ``selection``: it skips
    candidates predicted uninformative (``uninformative``) and returns the kept ones guided where it says. Used
    by curation and by dynamic sampling's refill draws (tasks/dynamic_sampling.py), so both keep out the same
    problems.
    """
    rules = rt.config.curation
    held_ids, held_index = _held_out_index(rt.config.model_dump_json())
    history = attempt_history(rt, iteration, [p.id for p in candidates], rules.history_k)
    broad, broad_index = broad_guard(rt)  # the broad sealed set (evertrain.curriculum): held out like the gate's
    # a problem a wrong or constant answer passes teaches the policy that answer (evertrain.envs.quality)
    # an environment whose answers are a few classes pays a constant answer on each of its items alike
    majority = _majority(rt.config, env) if rules.quality_check and candidates else None
    guessable = majority is not None and majority.share > rules.max_majority_share
    hacked = hackable(env, candidates) if rules.quality_check and not guessable else set()
    if rt.config.frontier.enabled:
        selection = selection if selection is not None else Selection()
        frontier_plan(rt, iteration, env, candidates, selection)
    plans = selection.plans if selection is not None else {}
    kept: list[Problem] = []
    for problem in candidates:
        if len(kept) == want:
            break
        attempts, passes = history.get(problem.id, (0, 0))
        natural = not env.templated
        if problem.id in taken:
            rule = "duplicate"
        elif natural and chosen.max_jaccard(problem.prompt) >= rules.near_duplicate_jaccard:
            rule = "near_duplicate"
        elif problem.id in held_ids or problem.id in broad or (natural and (
                held_index.overlaps(problem.prompt) or broad_index.overlaps(problem.prompt))):
            rule = "contaminated"
        elif guessable:
            rule = "guessable"
        elif problem.id in hacked:
            rule = "hackable"
        elif rules.history_k and attempts >= rules.history_k and passes == attempts:
            rule = "too_easy"
        elif rules.history_k and attempts >= rules.history_k and passes == 0:
            rule = "too_hard"
        elif problem.id in plans and plans[problem.id].skip:
            rule = "uninformative"
        else:
            rule = None
        if rule is not None:
            dropped[rule] += 1
            continue
        kept.append(guide(env, problem, plans.get(problem.id)))
        taken.add(problem.id)
        if natural:
            chosen.add(problem.prompt)
    return kept


def problem_row(rt: Runtime, iteration: int, env: Environment, problem: Problem,
                refill_round: int = 0, chosen: Plan | None = None) -> dict[str, Any]:
    """The ``problems`` row of ``problem`` (``refill_round`` >= 1: drawn by dynamic sampling; ``chosen``: the
    frontier's plan for it, with ``frontier.enabled``)."""
    guidance = problem.payload.get("guidance")
    return {"campaign": rt.campaign, "iteration": iteration, "problem_id": problem.id, "env": env.name,
            "split": problem.split, "prompt": problem.prompt, "payload": to_json(problem.payload),
            "messages": to_json(env.guided_messages(problem)), "created_at": now(), "refill_round": refill_round,
            "kind": None if chosen is None else chosen.kind,
            "guidance": int(guidance["level"]) if isinstance(guidance, dict) else (None if chosen is None else 0),
            "predicted_informative": None if chosen is None else chosen.predicted}


def curate(rt: Runtime, iteration: int) -> dict[str, Any]:
    config, rules = rt.config, rt.config.curation
    mix_metrics: dict[str, Any] = {}
    if config.mix.adaptive:  # shares follow each environment's learnability now (evertrain.mix), logged per iteration
        shares, mix_metrics = record(rt, iteration)
    else:
        shares = allocate(config.problems_per_iteration, [spec.weight for spec in config.environments])
    ensure_broad(rt)  # drawn once, at the campaign's first curate, before anything could train on it
    if config.curriculum.enabled:  # each environment's level for this iteration, stored before the draw
        mix_metrics.update(record_levels(rt, iteration)[1])
    chosen = NgramIndex(n=3)
    taken: set[str] = set()
    dropped = dict.fromkeys(RULES, 0)
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {}
    selections: list[Selection] = []
    for spec, share in zip(config.environments, shares, strict=True):
        env = rt.env(spec.name)
        if not share:
            metrics[f"problems_{spec.name}"] = 0
            continue
        candidates = curriculum_candidates(rt, iteration, env, share * rules.oversample,
                                           seed_for(config.seed, iteration, spec.name))
        selection = Selection()
        kept = select(rt, iteration, env, candidates, share, taken, chosen, dropped, selection)
        selections.append(selection)
        rows += [problem_row(rt, iteration, env, p, chosen=selection.plans.get(p.id)) for p in kept]
        metrics[f"problems_{spec.name}"] = len(kept)
    if config.serving.curate_from_traces:  # the endpoint's verifiable traces, failures first (evertrain.serving)
        held_ids, held_index = _held_out_index(config.model_dump_json())
        broad, broad_index = broad_guard(rt)  # no trace may enter the broad sealed set either
        rows += trace_rows(rt, taken, metrics, (set(held_ids) | set(broad), _EitherIndex(held_index, broad_index)),
                           lambda p: problem_row(rt, iteration, rt.env(p.env), p))
    if config.frontier.enabled:  # each kind's guidance level, from earlier iterations only (evertrain.frontier)
        metrics.update(frontier_record(rt, iteration, selections))
        metrics.update(curated_metrics(rows, selections))
    rt.store.replace("problems", {"campaign": rt.campaign, "iteration": iteration}, rows)
    metrics["problems"] = len(rows)
    metrics.update({f"dropped_{rule}": count for rule, count in dropped.items()})
    metrics.update(mix_metrics)
    return metrics


class _EitherIndex:
    """Two n-gram indexes read as one (the gate's and sealed problems', and the broad sealed set's)."""

    def __init__(self, *indexes: Any) -> None:
        self.indexes = indexes

    def overlaps(self, text: str) -> bool:
        return any(index.overlaps(text) for index in self.indexes)


@task(name="curate", cache_policy=NO_CACHE)
def curate_task(rt: Runtime, iteration: int) -> dict[str, Any]:
    return run_stage(rt, "curate", iteration, curate)
