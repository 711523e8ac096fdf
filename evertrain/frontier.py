"""The frontier: spend samples where a group can teach, and give a foothold where none could.

A GRPO group teaches only when its rewards disagree. In the long campaign most groups without signal are groups
where every sample failed (56% from iteration 6 on), and about a quarter of its problems (negative differences)
were never solved by any model here: sampled again and again, they cost rollout CPU and teach nothing. With
``frontier.enabled`` curation does two things, both computed from the store alone (the ``rollouts`` of earlier
iterations, joined to their ``problems`` rows), so a rerun of curate or a campaign resumed after a SIGKILL
decides the same:

**Kinds.** Every problem belongs to a kind (:meth:`Environment.problem_kind`): for generators, what makes their
problems hard (arithmetic: the operator, the operands' digits and the answer's sign, e.g. ``- 2d neg``); for
fixed pools, the problem itself (it comes back, so its own history predicts it).

**Guidance** (``frontier.guidance``). A kind whose last ``window`` groups at its guidance level (at least
``min_groups``, scored since it entered that level) passed at most ``raise_below`` of their samples gets the next
guidance level; one at ``withdraw_above`` or more loses a level, until its problems are asked bare again. The
environment states the guidance: a hint added to the problem's message (:meth:`Environment.hint`) and the start
of the answer, which the policy continues (:meth:`Environment.answer_prefix`; arithmetic writes the working's
first steps, left open where the model must compute, never the final answer). Both are prompt: the chat's
assistant turn is left open after the prefix (``encode_chat``), so the update computes log-probs only of the
tokens the policy sampled after it, and guidance tokens carry no policy-gradient weight (masking by
construction: the stored prompt says plainly what the policy was conditioned on). The policy thus learns to
finish the guided answer; once a kind's guidance works (its guided pass rate above ``raise_below``) a
``bare_share`` of its problems (by a hash of the problem) is asked bare and never skipped: they measure what
carries over. Guidance lives only in curated training problems (the payload's ``guidance`` and the
``problems.guidance`` column): the gate's, the sealed and the broad sets are built by their environments
directly, never through curation, and carry none; sft and dpo imitate bare rollouts only.

**Selection.** Each candidate's chance of an informative group is predicted as ``(informative + 1) /
(groups + 2)`` over its kind's last ``window`` groups at the guidance level it would be asked at (a uniform
prior: an unseen kind, or one that just changed level, predicts 0.5). A candidate predicted below
``skip_below`` is skipped (``dropped_uninformative``) unless a hash of (seed, iteration, problem) falls within
``explore``: those few keep the estimates honest, since a skipped kind would otherwise never be measured again.
With ``weighted``, each remaining candidate is kept with probability its prediction over the best among its
environment's candidates: kinds likelier to teach get more of the iteration, and every kind keeps a share.

With the other mechanisms: the curriculum (:mod:`evertrain.curriculum`) chooses an environment's level, and the
frontier works among that level's candidates; the curriculum's pass rate counts bare groups only, so a hint
never makes a level look mastered. The adaptive mix (:mod:`evertrain.mix`) chooses how many problems each
environment gets from its informative share, guided groups included: that share is what guidance raises.
Dynamic sampling's refill draws pass through the same selection, so both skip the same candidates. The
per-problem ``too_easy`` / ``too_hard`` rules of curation count bare attempts only.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from evertrain.data.store import now

if TYPE_CHECKING:
    import pandas as pd

    from evertrain.config import FrontierConfig
    from evertrain.envs.base import Environment, Problem


@dataclass
class KindState:
    """A kind's guidance level for one iteration, and why (a row of the ``frontier`` table)."""

    env: str
    kind: str
    level: int
    previous_level: int
    since: int
    groups: int
    pass_rate: float | None
    informative_share: float | None
    predicted_informative: float
    action: str
    reason: str
    bare_predicted: float = 0.5  # the prediction for its problems asked bare (a guided kind's probes): not stored


@dataclass(frozen=True)
class Plan:
    """What the frontier decided for one candidate."""

    kind: str
    guidance: int  # the hint level of its prompt (0: bare)
    predicted: float  # predicted chance of an informative group
    skip: bool
    explored: bool = False  # predicted uninformative, kept by the exploration share
    probe: bool = False  # a guided kind's problem asked bare


@dataclass
class Selection:
    """The frontier's decisions of one curate (or refill) call: per problem id, and per kind."""

    plans: dict[str, Plan] = field(default_factory=dict)
    states: dict[str, KindState] = field(default_factory=dict)
    seconds: float = 0.0  # spent deciding (the store's queries and the plans): what the frontier costs


def _unit(*key: Any) -> float:
    """A number in [0, 1) fixed by ``key``: the same on every rerun."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def predicted(groups: int, informative: int) -> float:
    """The chance that the next group disagrees: ``(informative + 1) / (groups + 2)`` (a uniform prior)."""
    return (informative + 1) / (groups + 2)


def decide(kind: str, env: str, history: pd.DataFrame, level: int, since: int, iteration: int,
           cfg: FrontierConfig, max_level: int) -> KindState:
    """A kind's level for ``iteration`` from its scored groups (``history``: kind_groups' rows of this kind, newest
    first), its level and the iteration it entered it."""
    at = history[(history["guidance"] == level) & (history["iteration"] >= since)].head(cfg.window)
    n = len(at)
    rate = float(at["pass_rate"].mean()) if n else None
    share = float(at["informative"].astype(bool).mean()) if n else None
    new, action = level, "hold"
    if rate is not None and n >= cfg.min_groups and cfg.guidance:
        if rate <= cfg.raise_below and level < max_level:
            new, action = level + 1, "raise"
        elif rate >= cfg.withdraw_above and level > 0:
            new, action = level - 1, "withdraw"
    where = f"level {level}" if level else "bare"
    if rate is None:
        reason = f"no scored group {where} yet" if not since else f"no scored group {where} since iteration {since}"
    else:
        reason = f"{n} groups {where}: pass rate {rate:.2f}, informative {share:.2f}"
        if action == "raise":
            reason += f" <= {cfg.raise_below}: guidance level {new}"
        elif action == "withdraw":
            reason += f" >= {cfg.withdraw_above}: " + ("asked bare again" if new == 0 else f"down to level {new}")
        elif level >= max_level and rate <= cfg.raise_below and cfg.guidance and max_level:
            reason += " (the strongest guidance already)"
    if new != level:
        prediction = predicted(0, 0)
    else:
        prediction = predicted(n, int(at["informative"].astype(bool).sum()) if n else 0)
    return KindState(env=env, kind=kind, level=new, previous_level=level, since=iteration if new != level else since,
                     groups=n, pass_rate=rate, informative_share=share, predicted_informative=prediction,
                     action=action, reason=reason)


def plan(rt: Any, iteration: int, env: Environment, candidates: list[Problem], selection: Selection) -> None:
    """Decide every candidate's kind, guidance level, prediction and whether it is skipped, into ``selection``."""
    began = time.perf_counter()
    cfg = rt.config.frontier
    kinds = {p.id: env.problem_kind(p) for p in candidates}
    wanted = sorted(set(kinds.values()) - set(selection.states))
    if wanted:
        history = rt.store.kind_groups(rt.campaign, env.name, iteration, wanted)
        levels = rt.store.frontier_levels(rt.campaign, env.name, iteration, wanted)
        by_kind = {k: frame for k, frame in history.groupby("kind", sort=False)} if not history.empty else {}
        empty = history.iloc[0:0]
        for kind in wanted:
            level, since = levels.get(kind, (0, 0))
            selection.states[kind] = decide(kind, env.name, by_kind.get(kind, empty), level, since, iteration, cfg,
                                            env.hint_levels if cfg.guidance else 0)
            bare = by_kind.get(kind, empty)
            bare = bare[bare["guidance"] == 0].head(cfg.window)
            selection.states[kind].bare_predicted = predicted(len(bare), int(bare["informative"].astype(bool).sum()))
    seed = rt.config.seed
    best = max((selection.states[k].predicted_informative for k in set(kinds.values())), default=0.5)
    for problem in candidates:
        state = selection.states[kinds[problem.id]]
        # a guided kind's problems are asked bare now and then, once its guidance works (what it taught is measured
        # where there is something to measure; a kind still failing with guidance gets no bare probe)
        working = state.pass_rate is not None and state.pass_rate > cfg.raise_below
        probe = state.level > 0 and working and _unit(seed, "probe", problem.id) < cfg.bare_share
        level = 0 if probe else state.level
        while level > 0 and not _guidance(env, problem, level):
            level -= 1
        chance = state.bare_predicted if probe else state.predicted_informative
        explored = chance < cfg.skip_below and _unit(seed, iteration, "explore", problem.id) < cfg.explore
        skip = not probe and chance < cfg.skip_below and not explored
        if cfg.weighted and not probe and not skip and not explored:
            skip = _unit(seed, iteration, "keep", problem.id) >= chance / best
        selection.plans[problem.id] = Plan(kind=state.kind, guidance=level, predicted=round(chance, 4), skip=skip,
                                           explored=explored, probe=probe)
    selection.seconds += time.perf_counter() - began


def _guidance(env: Environment, problem: Problem, level: int) -> dict[str, Any]:
    """The hint and the answer's prefix ``env`` states for ``problem`` at ``level`` (empty: none). A prefix only in
    single-turn environments: a tool episode's later turns are rebuilt from the chat, not continued."""
    out: dict[str, Any] = {}
    hint = env.hint(problem, level)
    if hint:
        out["hint"] = hint
    agentic = bool(env.tools) and env.max_turns > 1
    prefix = None if agentic else env.answer_prefix(problem, level)
    if prefix:
        out["prefix"] = prefix
    return out


def guide(env: Environment, problem: Problem, chosen: Plan | None) -> Problem:
    """``problem`` as trained: with its guidance in the payload (``guidance``: level, hint, prefix) when the plan
    guides it."""
    if chosen is None or chosen.guidance <= 0:
        return problem
    stated = _guidance(env, problem, chosen.guidance)
    if not stated:
        return problem
    return replace(problem, payload={**problem.payload, "guidance": {"level": chosen.guidance, **stated}})


def record(rt: Any, iteration: int, selections: list[Selection]) -> dict[str, Any]:
    """Store the kinds' levels of ``iteration`` (one selection per environment; replacing a rerun's rows); the
    metrics for MLflow."""
    stamp = now()
    states = [s for selection in selections for s in selection.states.values()]
    rows = [{"campaign": rt.campaign, "iteration": iteration,
             **{k: v for k, v in vars(s).items() if k != "bare_predicted"}, "created_at": stamp} for s in states]
    rt.store.replace("frontier", {"campaign": rt.campaign, "iteration": iteration}, rows)
    return {"frontier_kinds": len(rows), "frontier_guided_kinds": sum(s.level > 0 for s in states),
            "frontier_s": round(sum(selection.seconds for selection in selections), 4),
            "frontier_raised": sum(s.action == "raise" for s in states),
            "frontier_withdrawn": sum(s.action == "withdraw" for s in states)}


def curated_metrics(rows: list[dict[str, Any]], selections: list[Selection]) -> dict[str, Any]:
    """What the frontier did to the iteration's curated problems: guided share and level, predictions."""
    if not rows:
        return {}
    levels = [int(r.get("guidance") or 0) for r in rows]
    predictions = [r["predicted_informative"] for r in rows if r.get("predicted_informative") is not None]
    every = {pid: p for selection in selections for pid, p in selection.plans.items()}
    plans = [every[r["problem_id"]] for r in rows if r["problem_id"] in every]
    return {
        "guided_share": round(sum(level > 0 for level in levels) / len(levels), 4),
        "guidance_level_mean": round(sum(levels) / len(levels), 4),
        "predicted_informative_share": round(sum(predictions) / len(predictions), 4) if predictions else None,
        "frontier_explored": sum(p.explored for p in plans),
        "frontier_probes": sum(p.probe for p in plans),
    }


def score_metrics(frame: pd.DataFrame) -> dict[str, Any]:
    """Informative share and pass rate of the scored groups, bare and guided apart (``frame``: rollouts with
    payload, reward, passed)."""
    level = frame["payload"].map(lambda p: int((json.loads(p) if isinstance(p, str) else p or {})
                                               .get("guidance", {}).get("level", 0)))
    out: dict[str, Any] = {}
    for name, part in (("bare", frame[level == 0]), ("guided", frame[level > 0])):
        if part.empty:
            continue
        spread = part.groupby("problem_id")["reward"].agg(lambda r: r.max() - r.min())
        out[f"informative_share_{name}"] = round(float((spread > 0).mean()), 4)
        out[f"pass_rate_{name}"] = round(float(part["passed"].astype(float).mean()), 4)
        out[f"groups_{name}"] = int(spread.size)
    return out
