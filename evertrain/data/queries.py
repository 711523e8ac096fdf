"""The store's named queries: every read (and the few targeted writes) the library makes, by what it means.

The store is the one module that speaks SQL (tests/test_layering.py fails on SQL anywhere else); a stage asks
``store.rollouts_for_update(...)``, not a SELECT. Grouped by table. Each method says what it returns: a
frame (its columns named in the docstring) where the caller works on columns, a plain value otherwise.
The methods are a mixin of :class:`evertrain.data.store.Store`, which supplies ``query``, ``scalar``,
``records`` and ``transaction``.
"""

from __future__ import annotations

import json
import re
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import duckdb
    import pandas as pd

# sft.select's default (config.py shows it; the user may replace it with their own SQL over the store)
DEFAULT_SFT_SELECT = (
    "SELECT iteration, problem_id, sample FROM rollouts "
    "WHERE campaign = $campaign AND iteration = $iteration AND passed")

# what the dpo method selects when sft.select is left at its default (passed rollouts only form no pair):
# this iteration's scored rollouts of the groups holding both a pass and a fail
DEFAULT_DPO_SELECT = (
    "SELECT iteration, problem_id, sample FROM rollouts "
    "WHERE campaign = $campaign AND iteration = $iteration AND passed IS NOT NULL "
    "QUALIFY bool_or(passed) OVER (PARTITION BY iteration, problem_id) "
    "AND bool_or(NOT passed) OVER (PARTITION BY iteration, problem_id)")

# the champion after each decision: a promotion's winner, or a rollback's target (the store's lineage events)
# (prior: the champion before the event: the one a gate judged against, the one a rollback replaced)
_CHAMPION_EVENTS = """
    SELECT decided_at AS stamp, CASE WHEN promoted THEN challenger_version ELSE champion_version END AS v,
           champion_version AS prior
    FROM promotions WHERE campaign = $campaign
    UNION ALL SELECT rolled_back_at, to_version, from_version FROM rollbacks WHERE campaign = $campaign"""

# the outcome of each trace: the verifier's when there is one (it graded the real task), else the client's latest
_TRACE_OUTCOMES = """
    SELECT t.trace_id, t.campaign, t.model_version, t.env, coalesce(t.tools, '') AS tools, t.created_at,
           t.problem, t.status, t.key_id, o.passed, o.reward, o.source
    FROM traces t JOIN (
        SELECT trace_id, passed, reward, source, row_number() OVER (
            PARTITION BY trace_id ORDER BY (source = 'verifier') DESC, created_at DESC) AS pick
        FROM trace_feedback) o ON o.trace_id = t.trace_id AND o.pick = 1
    WHERE t.campaign = ?"""

_GATE = "coalesce(split, 'gate') = 'gate'"  # rows stored before the split column existed are the gate's


def _iteration_bounds(campaign: str, iteration: int | None, since: int | None) -> tuple[str, list[Any]]:
    """A WHERE clause and its parameters: the campaign's rows, of ``iteration`` only or from ``since`` on."""
    if iteration is not None:
        return "campaign = ? AND iteration = ?", [campaign, iteration]
    if since is not None:
        return "campaign = ? AND iteration >= ?", [campaign, since]
    return "campaign = ?", [campaign]


def _number(value: Any) -> int | None:
    """An integer column's value, None for NULL (DuckDB returns None, pandas NaN or NA)."""
    if value is None:
        return None
    try:
        if value != value:  # NaN
            return None
    except TypeError:  # pandas.NA: its comparisons are NA, whose truth is an error
        return None
    return int(value)


class Queries:
    """The named queries (a mixin: :class:`~evertrain.data.store.Store` provides the connection)."""

    if TYPE_CHECKING:
        def query(self, sql: str, params: list[Any] | dict[str, Any] | None = None) -> pd.DataFrame: ...
        def scalar(self, sql: str, params: list[Any] | dict[str, Any] | None = None) -> Any: ...
        def records(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]: ...
        def transaction(self) -> AbstractContextManager[duckdb.DuckDBPyConnection]: ...

    # --- problems ----------------------------------------------------------------------------------------
    def curated_problems(self, campaign: str, iteration: int) -> pd.DataFrame:
        """The iteration's curated problems (not dynamic sampling's refills): problem_id, env, prompt, payload,
        messages, ordered by env and problem_id."""
        return self.query(
            """SELECT problem_id, env, prompt, payload, messages FROM problems
               WHERE campaign = ? AND iteration = ? AND coalesce(refill_round, 0) = 0
               ORDER BY env, problem_id""", [campaign, iteration])

    def refill_row_count(self, campaign: str, iteration: int) -> int:
        """How many refill rows (``refill_round >= 1``) of ``iteration`` the store holds, problems and rollouts."""
        return int(self.scalar(
            """SELECT (SELECT count(*) FROM problems WHERE campaign = $1 AND iteration = $2 AND refill_round >= 1)
                    + (SELECT count(*) FROM rollouts WHERE campaign = $1 AND iteration = $2 AND refill_round >= 1)""",
            [campaign, iteration]))

    # --- rollouts ----------------------------------------------------------------------------------------
    def rollouts_for_update(self, campaign: str, first: int, last: int) -> pd.DataFrame:
        """The rollouts of iterations ``first..last`` the update trains on: iteration, problem_id, sample, env,
        policy_version, prompt_ids, completion_ids, logprobs, loss_mask, finish_reason, reward, temperature,
        top_p; ordered by iteration, problem_id, sample."""
        return self.query(
            """SELECT iteration, problem_id, sample, env, policy_version, prompt_ids, completion_ids, logprobs,
                      loss_mask, finish_reason, reward, temperature, top_p
               FROM rollouts WHERE campaign = ? AND iteration BETWEEN ? AND ?
               ORDER BY iteration, problem_id, sample""", [campaign, first, last])

    def first_policy_version(self, campaign: str, iteration: int) -> int | None:
        """The policy version the iteration's (non-refill) rollouts were sampled with; None before any."""
        return _number(self.scalar(
            """SELECT min(policy_version) FROM rollouts
               WHERE campaign = ? AND iteration = ? AND coalesce(refill_round, 0) = 0""", [campaign, iteration]))

    def sampling_history(self, campaign: str, iteration: int) -> list[dict[str, Any]]:
        """Of the (non-refill) rollouts of ``iteration`` and the one before it, latest first: iteration, temperature
        (what they were sampled at; None in a store older than the column) and entropy (the mean token entropy
        estimated from their sampling log-probs, nats; None without policy tokens). Two iterations only: read at
        every rollout, it must not grow with the campaign."""
        # logprobs are 0.0 on tool tokens (not the policy's), so their sum is the policy tokens' sum
        return self.records(
            """SELECT iteration, min(temperature) AS temperature,
                      -sum(coalesce(list_sum(logprobs), 0)) / nullif(sum(coalesce(list_sum(loss_mask), 0)), 0)
                          AS entropy
               FROM rollouts WHERE campaign = ? AND iteration BETWEEN ? AND ? AND coalesce(refill_round, 0) = 0
               GROUP BY iteration ORDER BY iteration DESC""", [campaign, iteration - 1, iteration])

    def rollouts_to_score(self, campaign: str, iteration: int) -> pd.DataFrame:
        """The iteration's (non-refill) rollouts with their problem: problem_id, sample, env, completion,
        finish_reason, prompt, payload; ordered by problem_id, sample."""
        return self.query(
            """SELECT r.problem_id, r.sample, r.env, r.completion, r.finish_reason, p.prompt, p.payload
               FROM rollouts r JOIN problems p USING (campaign, iteration, problem_id)
               WHERE r.campaign = ? AND r.iteration = ? AND coalesce(r.refill_round, 0) = 0
               ORDER BY r.problem_id, r.sample""", [campaign, iteration])

    def attempt_history(self, campaign: str, before: int, ids: list[str], k: int) -> dict[str, tuple[int, int]]:
        """(attempts, passes) over each problem's last ``k`` scored bare attempts (no frontier hint) in iterations
        before ``before``."""
        frame = self.query(
            """SELECT problem_id, count(*) AS attempts, sum(passed::INTEGER) AS passes FROM (
                   SELECT problem_id, passed, row_number() OVER (
                       PARTITION BY problem_id ORDER BY iteration DESC, sample) AS recent
                   FROM rollouts r
                   WHERE campaign = ? AND iteration < ? AND passed IS NOT NULL
                     AND problem_id IN (SELECT unnest(?::VARCHAR[])) AND NOT EXISTS (
                         SELECT 1 FROM problems p WHERE p.campaign = r.campaign AND p.iteration = r.iteration
                           AND p.problem_id = r.problem_id AND p.guidance > 0))
               WHERE recent <= ? GROUP BY problem_id""", [campaign, before, ids, k])
        return {row.problem_id: (int(row.attempts), int(row.passes)) for row in frame.itertuples(index=False)}

    def problem_pass_rates(self, campaign: str, before: int, ids: list[str]) -> dict[str, float]:
        """Each given problem's pass rate over its scored rollouts in iterations before ``before``."""
        frame = self.query(
            """SELECT problem_id, avg(passed::INTEGER) AS rate FROM rollouts
               WHERE campaign = ? AND iteration < ? AND passed IS NOT NULL
                 AND problem_id IN (SELECT unnest(?::VARCHAR[])) GROUP BY problem_id""", [campaign, before, ids])
        return dict(zip(frame["problem_id"], frame["rate"].astype(float), strict=True))

    def env_group_history(self, campaign: str, first: int, before: int) -> dict[str, tuple[int, float, float]]:
        """Per environment over iterations [first, before): (scored groups, mean pass rate, informative share)."""
        frame = self.query(
            """SELECT env, count(*) AS groups, avg(pass_rate) AS pass_rate, avg(informative::INTEGER) AS informative
               FROM (SELECT env, iteration, problem_id, avg(passed::INTEGER) AS pass_rate,
                            max(reward) > min(reward) AS informative
                     FROM rollouts
                     WHERE campaign = ? AND iteration < ? AND iteration >= ? AND reward IS NOT NULL
                     GROUP BY env, iteration, problem_id)
               GROUP BY env""", [campaign, before, first])
        return {row.env: (int(row.groups), float(row.pass_rate), float(row.informative))
                for row in frame.itertuples(index=False)}

    def kind_groups(self, campaign: str, env: str, before: int, kinds: list[str]) -> pd.DataFrame:
        """Every scored group of ``env``'s problems of the given kinds in iterations before ``before``, newest first:
        kind, guidance (0: bare), iteration, problem_id, pass_rate, informative (its rewards disagree)."""
        return self.query(
            """SELECT p.kind, coalesce(p.guidance, 0) AS guidance, r.iteration, r.problem_id,
                      avg(r.passed::INTEGER) AS pass_rate, max(r.reward) > min(r.reward) AS informative
               FROM rollouts r JOIN problems p
                 ON p.campaign = r.campaign AND p.iteration = r.iteration AND p.problem_id = r.problem_id
               WHERE r.campaign = ? AND r.env = ? AND r.iteration < ? AND r.reward IS NOT NULL
                 AND p.kind IN (SELECT unnest(?::VARCHAR[]))
               GROUP BY p.kind, coalesce(p.guidance, 0), r.iteration, r.problem_id
               ORDER BY r.iteration DESC, r.problem_id""", [campaign, env, before, kinds])

    def frontier_levels(self, campaign: str, env: str, before: int, kinds: list[str]) -> dict[str, tuple[int, int]]:
        """Each given kind's (level, since) as the latest ``frontier`` row before ``before`` left it."""
        frame = self.query(
            """SELECT kind, level, since FROM (
                   SELECT kind, level, since, row_number() OVER (PARTITION BY kind ORDER BY iteration DESC) AS recent
                   FROM frontier WHERE campaign = ? AND env = ? AND iteration < ?
                     AND kind IN (SELECT unnest(?::VARCHAR[])))
               WHERE recent = 1""", [campaign, env, before, kinds])
        return {row.kind: (int(row.level), int(row.since)) for row in frame.itertuples(index=False)}

    def recent_group_pass_rates(self, campaign: str, env: str, first: int, before: int, limit: int) -> pd.DataFrame:
        """The pass rates of ``env``'s last ``limit`` scored bare groups (no frontier hint) in iterations [first,
        before), newest first: iteration, problem_id, pass_rate."""
        return self.query(
            """SELECT iteration, problem_id, avg(passed::INTEGER) AS pass_rate FROM rollouts r
               WHERE campaign = ? AND env = ? AND iteration >= ? AND iteration < ? AND passed IS NOT NULL
                 AND NOT EXISTS (SELECT 1 FROM problems p WHERE p.campaign = r.campaign
                                   AND p.iteration = r.iteration AND p.problem_id = r.problem_id AND p.guidance > 0)
               GROUP BY iteration, problem_id ORDER BY iteration DESC, problem_id LIMIT ?""",
            [campaign, env, first, before, limit])

    def sample_rollouts(self, campaign: str, iteration: int, env: str | None, per_env: int) -> pd.DataFrame:
        """Up to ``per_env`` rollouts of each environment (of ``env`` only, when given), passed ones first: env,
        problem_id, sample, policy_version, prompt_text, turns, completion, reward, passed, reason, finish_reason."""
        return self.query(
            """SELECT env, problem_id, sample, policy_version, prompt_text, turns, completion, reward, passed, reason,
                      finish_reason FROM (
                   SELECT *, row_number() OVER (PARTITION BY env ORDER BY passed DESC NULLS LAST, problem_id, sample)
                       AS pick
                   FROM rollouts WHERE campaign = ? AND iteration = ? AND (? IS NULL OR env = ?))
               WHERE pick <= ? ORDER BY env, pick""", [campaign, iteration, env, env, per_env])

    def group_diversity(self, campaign: str, iteration: int | None = None) -> pd.DataFrame:
        """One row per scored group (of ``iteration``, or all): iteration, samples, distinct_completions,
        informative, neg_logprob (minus the summed sampling log-probs), tokens (policy tokens), temperature (the
        lowest it was sampled at; None in a store older than the column)."""
        where, params = ("AND iteration = ?", [campaign, iteration]) if iteration is not None else ("", [campaign])
        # logprobs are 0.0 on tool tokens (not the policy's), so their sum is the policy tokens' sum
        return self.query(
            f"""SELECT iteration, count(*) AS samples, count(DISTINCT completion) AS distinct_completions,
                       max(reward) > min(reward) AS informative,
                       -sum(coalesce(list_sum(logprobs), 0)) AS neg_logprob,
                       sum(coalesce(list_sum(loss_mask), 0)) AS tokens, min(temperature) AS temperature
                FROM rollouts WHERE campaign = ? AND reward IS NOT NULL {where}
                GROUP BY iteration, problem_id""", params)

    def rollout_summary(self, campaign: str, last: int) -> pd.DataFrame:
        """Per environment over iterations up to ``last``: env, problems, rollouts, mean_reward."""
        return self.query(
            """SELECT env, count(DISTINCT problem_id) AS problems, count(*) AS rollouts, avg(reward) AS mean_reward
               FROM rollouts WHERE campaign = ? AND iteration <= ? GROUP BY env ORDER BY env""", [campaign, last])

    def _with_selection(self, campaign: str, iteration: int, chosen: str, sql: str) -> pd.DataFrame:
        """Run ``sql``, which wraps the user's selection SQL ``chosen`` (sft.select) as the CTE ``chosen``,
        with ``$campaign`` (and ``$iteration`` where ``chosen`` uses it) bound."""
        params: dict[str, Any] = {"campaign": campaign}
        if re.search(r"\$iteration\b", chosen):
            params["iteration"] = iteration
        return self.query(sql, params)

    def sft_rollouts(self, campaign: str, iteration: int, chosen: str, max_examples: int) -> pd.DataFrame:
        """The rollouts the selection SQL ``chosen`` picks, one per group first, at most ``max_examples``:
        iteration, problem_id, sample, env, prompt_ids, completion_ids, loss_mask, messages, rank_in_group. Bare
        rollouts only: a guided one (evertrain.frontier) continued a start the policy did not write."""
        return self._with_selection(campaign, iteration, chosen, f"""
            WITH chosen AS ({chosen}),
            picked AS (
                SELECT r.iteration, r.problem_id, r.sample, r.env, r.prompt_ids, r.completion_ids, r.loss_mask,
                       p.messages,
                       row_number() OVER (PARTITION BY r.iteration, r.problem_id ORDER BY r.sample) AS rank_in_group
                FROM rollouts r JOIN chosen c
                  ON r.iteration = c.iteration AND r.problem_id = c.problem_id AND r.sample = c.sample
                LEFT JOIN problems p
                  ON p.campaign = r.campaign AND p.iteration = r.iteration AND p.problem_id = r.problem_id
                WHERE r.campaign = $campaign AND coalesce(p.guidance, 0) = 0)
            SELECT * FROM picked ORDER BY rank_in_group, iteration, problem_id, sample LIMIT {int(max_examples)}""")

    def dpo_pairs(self, campaign: str, iteration: int, chosen: str, max_examples: int) -> pd.DataFrame:
        """Preference pairs within the groups of the rollouts ``chosen`` picks (the k-th pass against the k-th
        fail, one pair per group first, at most ``max_examples``), two rows each: pair, role ('chosen' then
        'rejected'), iteration, problem_id, sample, env, passed, prompt_ids, completion_ids, loss_mask, messages.
        Bare rollouts only, as :meth:`sft_rollouts`."""
        return self._with_selection(campaign, iteration, chosen, f"""
            WITH chosen AS ({chosen}),
            picked AS (
                SELECT r.iteration, r.problem_id, r.sample, r.env, r.passed, r.prompt_ids, r.completion_ids,
                       r.loss_mask, p.messages,
                       row_number() OVER (PARTITION BY r.iteration, r.problem_id, r.passed ORDER BY r.sample) AS rank
                FROM rollouts r JOIN (SELECT DISTINCT iteration, problem_id, sample FROM chosen) c
                  ON r.iteration = c.iteration AND r.problem_id = c.problem_id AND r.sample = c.sample
                LEFT JOIN problems p
                  ON p.campaign = r.campaign AND p.iteration = r.iteration AND p.problem_id = r.problem_id
                WHERE r.campaign = $campaign AND r.passed IS NOT NULL AND coalesce(p.guidance, 0) = 0),
            pairs AS (
                SELECT w.iteration, w.problem_id, w.sample AS chosen_sample, l.sample AS rejected_sample,
                       row_number() OVER (ORDER BY w.rank, w.iteration, w.problem_id) - 1 AS pair
                FROM picked w JOIN picked l
                  ON l.iteration = w.iteration AND l.problem_id = w.problem_id AND l.rank = w.rank
                WHERE w.passed AND NOT l.passed
                QUALIFY pair < {int(max_examples)})
            SELECT p.pair, CASE WHEN r.passed THEN 'chosen' ELSE 'rejected' END AS role, r.* EXCLUDE (rank)
            FROM pairs p JOIN picked r
              ON r.iteration = p.iteration AND r.problem_id = p.problem_id
             AND r.sample IN (p.chosen_sample, p.rejected_sample)
            ORDER BY p.pair, r.passed DESC""")

    # --- model versions (the lineage) ------------------------------------------------------------------
    def base_version(self, campaign: str) -> int | None:
        """The campaign's base model version (None before the campaign registered it)."""
        return _number(self.scalar("SELECT min(version) FROM model_versions WHERE campaign = ? AND kind = 'base'",
                                   [campaign]))

    def iteration_versions(self, campaign: str, iteration: int) -> pd.DataFrame:
        """The versions ``iteration``'s update registered: version, parent_version."""
        return self.query("SELECT version, parent_version FROM model_versions WHERE campaign = ? AND iteration = ?",
                          [campaign, iteration])

    def model_versions(self, campaign: str) -> pd.DataFrame:
        """Every version of the campaign, oldest first: version, kind, path."""
        return self.query("SELECT version, kind, path FROM model_versions WHERE campaign = ? ORDER BY version",
                          [campaign])

    def lineage(self, campaign: str, version: int) -> list[dict[str, Any]]:
        """``version`` and its ancestors, newest first: version, iteration, kind (the chain of parent links)."""
        chain: list[dict[str, Any]] = []
        current: int | None = version
        while current is not None:
            found = self.query("SELECT version, iteration, kind, parent_version FROM model_versions "
                               "WHERE campaign = ? AND version = ?", [campaign, current])
            if found.empty:
                break
            link = found.iloc[0]
            chain.append({"version": int(link["version"]), "iteration": int(link["iteration"]), "kind": link["kind"]})
            current = _number(link["parent_version"])  # None, NaN or NA: the base model has no parent
        return chain

    def drop_iteration_versions(self, campaign: str, iteration: int) -> None:
        """Delete the model versions ``iteration``'s update registered (a rerun replaces them)."""
        with self.transaction() as con:
            con.execute("DELETE FROM model_versions WHERE campaign = ? AND iteration = ?", [campaign, iteration])

    # --- promotions and rollbacks -----------------------------------------------------------------------
    def champion_history(self, campaign: str) -> tuple[int | None, int | None]:
        """(champion, previous champion) as the store's lineage events say: the champion after the last
        promotion decision or rollback (the base model before any), and the last different champion before it
        (None before any change). MLflow's aliases are projected from this (tracking.py)."""
        # one query (the endpoint's watcher asks every poll): the events newest first, then the base model's row
        frame = self.query(
            f"""SELECT v, prior FROM (
                    SELECT stamp, v, prior, false AS base FROM ({_CHAMPION_EVENTS})
                    UNION ALL SELECT NULL, min(version), NULL, true FROM model_versions
                    WHERE campaign = $campaign AND kind = 'base')
                ORDER BY base, stamp DESC NULLS LAST""", {"campaign": campaign})
        # each event's champion then the one before it, the base model last: the champions in the order they held
        chain = [v for row in frame.itertuples(index=False) for v in (_number(row.v), _number(row.prior))
                 if v is not None]
        if not chain:
            return None, None
        champion = chain[0]
        return champion, next((v for v in chain[1:] if v != champion), None)

    def was_champion(self, campaign: str, version: int) -> bool:
        """Whether ``version`` is or was the campaign's champion: its base model, a challenger the gate promoted,
        or a version a rollback restored."""
        if self.base_version(campaign) == version:
            return True
        count = self.scalar(f"SELECT count(*) FROM ({_CHAMPION_EVENTS}) WHERE v = $version",
                            {"campaign": campaign, "version": version})
        return bool(count)

    def promotions(self, campaign: str, iteration: int | None = None, since: int | None = None) -> pd.DataFrame:
        """Every promotion decision of the campaign (all columns), or only ``iteration``'s, or those from
        iteration ``since`` on."""
        where, params = _iteration_bounds(campaign, iteration, since)
        return self.query(f"SELECT * FROM promotions WHERE {where}", params)

    def promotions_until(self, campaign: str, last: int) -> pd.DataFrame:
        """The gate decisions up to iteration ``last``, in order: iteration, challenger_version, champion_version,
        promoted, challenger_pass1, champion_pass1, gain_low, gain_high, reason."""
        return self.query(
            """SELECT iteration, challenger_version, champion_version, promoted, challenger_pass1, champion_pass1,
                      gain_low, gain_high, reason FROM promotions WHERE campaign = ? AND iteration <= ?
               ORDER BY iteration""", [campaign, last])

    def last_promotion(self, campaign: str) -> dict[str, Any] | None:
        """The campaign's latest decision (iteration, challenger_version, champion_version, promoted, reason)."""
        frame = self.query(
            """SELECT iteration, challenger_version, champion_version, promoted, reason FROM promotions
               WHERE campaign = ? ORDER BY decided_at DESC LIMIT 1""", [campaign])
        return None if frame.empty else frame.iloc[0].to_dict()

    def decided_champion(self, campaign: str, iteration: int) -> int | None:
        """The champion ``iteration``'s gate decision was made against (None: not decided yet)."""
        frame = self.query("SELECT champion_version FROM promotions WHERE campaign = ? AND iteration = ?",
                           [campaign, iteration])
        return None if frame.empty else int(frame["champion_version"].iloc[0])

    def latest_challenger(self, campaign: str) -> int | None:
        """The newest version an update registered and retention has not deleted (None before any): what MLflow's
        ``challenger`` alias projects."""
        return _number(self.scalar(
            """SELECT max(version) FROM model_versions
               WHERE campaign = ? AND kind <> 'base' AND NOT ends_with(kind, '-deleted')""", [campaign]))

    def gate_history(self, campaign: str, before: int) -> pd.DataFrame:
        """The gate decisions before ``before``, newest first, with a person's refusal: promoted, reset_trainee,
        challenger_pass1, champion_pass1, per_env, refused_by_person."""
        return self.query(
            """SELECT p.promoted, p.reset_trainee, p.challenger_pass1, p.champion_pass1, p.per_env,
                      coalesce(a.decision IN ('rejected', 'timeout'), false) AS refused_by_person
               FROM promotions p LEFT JOIN approvals a ON a.campaign = p.campaign AND a.iteration = p.iteration
               WHERE p.campaign = ? AND p.iteration < ? ORDER BY p.iteration DESC""", [campaign, before])

    # --- evaluations ------------------------------------------------------------------------------------
    def gate_answers(self, campaign: str, iteration: int, versions: tuple[int, ...] | None = None) -> pd.DataFrame:
        """The greedy answers on ``iteration``'s gate (of ``versions`` only, when given): problem_id, env,
        model_version, completion, reward."""
        frame = self.query(
            f"""SELECT problem_id, env, model_version, completion, reward FROM evals
                WHERE campaign = ? AND iteration = ? AND sample = 0 AND {_GATE}""", [campaign, iteration])
        return frame if versions is None else frame[frame["model_version"].isin(versions)]

    def reusable_evals(self, campaign: str, version: int, iteration: int, samples: int, ids: list[str],
                       keys: list[str]) -> pd.DataFrame:
        """``version``'s answers from other iterations to the problems ``ids`` generated as ``keys`` say, the
        latest of each (problem, sample < ``samples``, key); all columns."""
        return self.query(
            """SELECT * FROM evals WHERE campaign = ? AND model_version = ? AND iteration <> ? AND sample < ?
               AND problem_id IN (SELECT unnest(?::VARCHAR[])) AND gen_key IN (SELECT unnest(?::VARCHAR[]))
               QUALIFY row_number() OVER (PARTITION BY problem_id, sample, gen_key ORDER BY iteration DESC) = 1""",
            [campaign, version, iteration, samples, ids, keys])

    def last_gate_per_env(self, campaign: str, before: int) -> pd.DataFrame:
        """Per environment, its latest gate before ``before``: env, iteration, best (the best greedy reward),
        versions (how many versions answered)."""
        return self.query(
            f"""SELECT env, iteration, max(reward) AS best, count(DISTINCT model_version) AS versions FROM evals
                WHERE campaign = ? AND {_GATE} AND sample = 0 AND iteration < ?
                GROUP BY env, iteration QUALIFY row_number() OVER (PARTITION BY env ORDER BY iteration DESC) = 1""",
            [campaign, before])

    def greedy_answers(self, campaign: str, versions: tuple[int, int], gate_only: bool = False) -> pd.DataFrame:
        """The greedy answer of each of ``versions`` to every problem it answered (any iteration), per split:
        model_version, env, split, problem_id, reward, passed, tool_calls, rework, turns."""
        where = f"AND {_GATE}" if gate_only else ""
        return self.query(
            f"""SELECT model_version, env, coalesce(split, 'gate') AS split, problem_id,
                       any_value(reward) AS reward, any_value(passed) AS passed,
                       any_value(tool_calls) AS tool_calls, any_value(rework) AS rework, any_value(turns) AS turns
                FROM evals WHERE campaign = ? AND sample = 0 AND model_version IN (?, ?) {where}
                GROUP BY model_version, env, coalesce(split, 'gate'), problem_id""",
            [campaign, int(versions[0]), int(versions[1])])

    def sealed_pass_counts(self, campaign: str) -> pd.DataFrame:
        """Every version's greedy results on the sealed splits (test, transfer, broad): model_version, split,
        iteration (the first it was measured at), problems, passed."""
        return self.query(
            """SELECT model_version, split, min(iteration) AS iteration, count(*) AS problems,
                      sum(CAST(passed AS INTEGER)) AS passed
                FROM (SELECT model_version, split, problem_id, min(iteration) AS iteration,
                             any_value(coalesce(passed, false)) AS passed
                      FROM evals WHERE campaign = ? AND sample = 0 AND split IN ('test', 'transfer', 'broad')
                      GROUP BY model_version, split, problem_id)
                GROUP BY model_version, split ORDER BY model_version, split""", [campaign])

    def refused_gate_answers(self, campaign: str, iteration: int, challenger: int, champion: int) -> pd.DataFrame:
        """A refused gate's greedy answers: the challenger's at ``iteration`` and the champion's at or before it:
        model_version, env, split ('gate'), problem_id, reward."""
        return self.query(
            f"""SELECT model_version, env, 'gate' AS split, problem_id, any_value(reward) AS reward FROM evals
                WHERE campaign = ? AND sample = 0 AND {_GATE}
                  AND ((iteration = ? AND model_version = ?) OR (iteration <= ? AND model_version = ?))
                GROUP BY ALL""", [campaign, iteration, challenger, iteration, champion])

    def compared_gate_verdicts(self, campaign: str) -> pd.DataFrame:
        """The greedy verdicts of every gate that compared two different versions: iteration, problem_id, role,
        passed."""
        return self.query(
            """SELECT e.iteration, e.problem_id, e.role, any_value(e.passed) AS passed FROM evals e
                JOIN promotions p ON p.campaign = e.campaign AND p.iteration = e.iteration
                WHERE e.campaign = ? AND e.sample = 0 AND coalesce(e.split, 'gate') = 'gate'
                  AND p.challenger_version <> p.champion_version
                GROUP BY ALL""", [campaign])

    def champion_gate_pass1(self, campaign: str) -> float | None:
        """The champions' mean greedy reward over every gate (None: no gate yet)."""
        value = self.scalar(f"SELECT avg(reward) FROM evals WHERE campaign = ? AND sample = 0 AND role = 'champion' "
                            f"AND {_GATE}", [campaign])
        return None if value is None else float(value)

    # --- stage runs -------------------------------------------------------------------------------------
    def stage_metrics(self, campaign: str, iteration: int, stage: str) -> dict[str, Any]:
        """The recorded metrics of ``stage`` for ``iteration`` ({} when it has not completed)."""
        raw = self.scalar("SELECT metrics FROM stage_runs WHERE campaign = ? AND iteration = ? AND stage = ? "
                          "AND status = 'completed'", [campaign, iteration, stage])
        return json.loads(raw) if raw else {}

    def stage_runs(self, campaign: str, iteration: int | None = None, since: int | None = None) -> pd.DataFrame:
        """Every stage run of the campaign (or of ``iteration`` only, or from iteration ``since`` on), by
        iteration: iteration, stage, status, wall_s, cpu_s, metrics."""
        where, params = _iteration_bounds(campaign, iteration, since)
        return self.query(f"SELECT iteration, stage, status, wall_s, cpu_s, metrics FROM stage_runs WHERE {where} "
                          "ORDER BY iteration, stage", params)

    def iteration_dollars(self, campaign: str, iteration: int, excluding: str) -> float:
        """What ``iteration``'s stages other than ``excluding`` cost (their ``dollars`` metric)."""
        return float(self.scalar(
            """SELECT coalesce(sum(json_extract(metrics, '$.dollars')::DOUBLE), 0) FROM stage_runs
               WHERE campaign = ? AND iteration = ? AND stage <> ?""", [campaign, iteration, excluding]))

    def cost_until(self, campaign: str, last: int) -> dict[str, float]:
        """The compute spent on iterations up to ``last``: wall_s, cpu_s, gpu_s, dollars."""
        frame = self.query(
            """SELECT coalesce(sum(wall_s), 0) AS wall_s, coalesce(sum(cpu_s), 0) AS cpu_s,
                      coalesce(sum(json_extract(metrics, '$.gpu_s')::DOUBLE), 0) AS gpu_s,
                      coalesce(sum(json_extract(metrics, '$.dollars')::DOUBLE), 0) AS dollars
               FROM stage_runs WHERE campaign = ? AND iteration <= ?""", [campaign, last])
        return {key: float(value) for key, value in frame.iloc[0].items()}

    # --- campaigns and environments ---------------------------------------------------------------------
    def campaign_config(self, campaign: str) -> str | None:
        """The campaign's stored configuration (its JSON text; None for an unknown campaign)."""
        return self.scalar("SELECT config FROM campaigns WHERE campaign = ?", [campaign])

    def env_validation(self, env: str, options: str) -> pd.DataFrame:
        """The stored self-test verdict of ``env`` with ``options`` (JSON): ok, failures (empty: never run)."""
        return self.query("SELECT ok, failures FROM env_validations WHERE env = ? AND options = ?", [env, options])

    # --- the adaptive mix and the curriculum ------------------------------------------------------------
    def mix_rows(self, campaign: str) -> list[dict[str, Any]]:
        """The adaptive mix of every iteration (empty for a store without the table): iteration, env, share,
        problems, pass_rate, informative_share, learnability, reason."""
        return self.records(
            """SELECT iteration, env, share, problems, pass_rate, informative_share, learnability, reason
               FROM mix WHERE campaign = ? ORDER BY iteration, env""", [campaign])

    def curriculum_history(self, campaign: str, env: str, before: int) -> pd.DataFrame:
        """``env``'s stored levels before iteration ``before``, newest first: iteration, level."""
        return self.query("SELECT iteration, level FROM curriculum WHERE campaign = ? AND env = ? AND iteration < ? "
                          "ORDER BY iteration DESC", [campaign, env, before])

    def curriculum_level(self, campaign: str, iteration: int, env: str) -> int | None:
        """The level stored for ``env`` at ``iteration`` (None: no curriculum row)."""
        return _number(self.scalar("SELECT level FROM curriculum WHERE campaign = ? AND iteration = ? AND env = ?",
                                   [campaign, iteration, env]))

    def curriculum_rows(self, campaign: str) -> list[dict[str, Any]]:
        """Every iteration's curriculum rows (empty for a store without the table): iteration, env, level,
        max_level, groups, pass_rate, action, reason."""
        return self.records("SELECT iteration, env, level, max_level, groups, pass_rate, action, reason "
                            "FROM curriculum WHERE campaign = ? ORDER BY iteration, env", [campaign])

    def broad_sealed_count(self, campaign: str) -> int:
        return int(self.scalar("SELECT count(*) FROM broad_sealed WHERE campaign = ?", [campaign]) or 0)

    def broad_sealed_ids(self, campaign: str) -> frozenset[str]:
        frame = self.query("SELECT problem_id FROM broad_sealed WHERE campaign = ?", [campaign])
        return frozenset(frame["problem_id"])

    def broad_sealed_problems(self, campaign: str) -> pd.DataFrame:
        """The broad sealed set, by environment and level: problem_id, env, prompt, payload."""
        return self.query("SELECT problem_id, env, prompt, payload FROM broad_sealed WHERE campaign = ? "
                          "ORDER BY env, level NULLS LAST, source, problem_id", [campaign])

    # -- traces (the endpoint's requests) and their outcomes -------------------------------------------------

    def stored_problem(self, campaign: str, env: str, problem_id: str) -> dict[str, Any] | None:
        """A curated problem's prompt and payload (JSON text) by id, None when the campaign has no such problem."""
        rows = self.records("SELECT prompt, payload FROM problems WHERE campaign = ? AND env = ? AND problem_id = ? "
                            "LIMIT 1", [campaign, env, problem_id])
        return rows[0] if rows else None

    def trace_outcome_counts(self, campaign: str, bucket_seconds: int | None = None) -> pd.DataFrame:
        """Requests with an outcome and how many passed, per environment ('(none)' for no named task), tools and
        model version (and per ``bucket_seconds`` time bucket, its start in ``bucket``): env, tools,
        model_version, [bucket,] requests, passed."""
        bucket = ""
        if bucket_seconds:
            seconds = max(1, int(bucket_seconds))
            bucket = f"to_timestamp(floor(epoch(created_at) / {seconds}) * {seconds}) AS bucket, "
        return self.query(f"""SELECT coalesce(env, '(none)') AS env, tools, model_version, {bucket}
                                     count(*) AS requests, sum(passed::INTEGER) AS passed
                              FROM ({_TRACE_OUTCOMES}) GROUP BY ALL ORDER BY ALL""", [campaign])

    def trace_outcome_span(self, campaign: str) -> tuple[Any, Any]:
        """The first and last creation time of the traces with an outcome ((None, None) when there are none)."""
        rows = self.records(f"SELECT min(created_at) AS first, max(created_at) AS last FROM ({_TRACE_OUTCOMES})",
                            [campaign])
        return (rows[0]["first"], rows[0]["last"]) if rows else (None, None)

    def verifiable_traces(self, campaign: str, since: Any) -> pd.DataFrame:
        """Answered traces since ``since`` that name a task and have an outcome (the verifier's first, else the
        client's latest), failures first, newest first: trace_id, env, problem, model_version, created_at,
        passed, source, key_id (the API key that made it)."""
        return self.query(f"""SELECT trace_id, env, problem, model_version, created_at, passed, source, key_id
                               FROM ({_TRACE_OUTCOMES}) WHERE env IS NOT NULL AND problem IS NOT NULL
                                 AND status = 'ok' AND created_at >= ?
                               ORDER BY passed, created_at DESC, trace_id""", [campaign, since])

    def live_window_counts(self, campaign: str, since: Any, by_client: bool = False) -> pd.DataFrame:
        """Graded traces since ``since``, for each environment and tool only the model version that served it
        last (so a new champion is judged on its own answers): env, tools, model_version, [client,] requests,
        passed, last_at. ``by_client``: one row per API key too (``client``: its key id, '(no key)' without)."""
        client = ", coalesce(o.key_id, '(no key)') AS client" if by_client else ""
        return self.query(f"""
            WITH o AS ({_TRACE_OUTCOMES} AND t.created_at >= ?),
            latest AS (SELECT env, tools, arg_max(model_version, created_at) AS served FROM o GROUP BY env, tools)
            SELECT coalesce(o.env, '(none)') AS env, o.tools, o.model_version{client}, count(*) AS requests,
                   sum(o.passed::INTEGER) AS passed, max(o.created_at) AS last_at
            FROM o JOIN latest ON o.env IS NOT DISTINCT FROM latest.env AND o.tools = latest.tools
            WHERE o.model_version IS NOT DISTINCT FROM latest.served
            GROUP BY ALL ORDER BY ALL""", [campaign, since])

    def verifier_outcomes(self, campaign: str, trace_ids: list[str]) -> dict[str, bool]:
        """The verifier's outcome of each of ``trace_ids`` that has one."""
        if not trace_ids:
            return {}
        frame = self.query("SELECT trace_id, bool_or(passed) AS passed FROM trace_feedback WHERE campaign = ? AND "
                           "source = 'verifier' AND trace_id IN (SELECT unnest(?)) GROUP BY trace_id",
                           [campaign, trace_ids])
        return dict(zip(frame["trace_id"], frame["passed"].astype(bool), strict=True))

    # -- the endpoint's API keys ------------------------------------------------------------------------------

    def api_key_by_hash(self, key_sha256: str) -> dict[str, Any] | None:
        """The API key whose secret hashes to ``key_sha256`` (revoked ones included: ``revoked_at`` says), or
        None. Errors are raised (a key that cannot be checked is not taken as valid or as unknown)."""
        frame = self.query("SELECT key_id, name, prefix, scopes, created_at, revoked_at FROM api_keys "
                           "WHERE key_sha256 = ? ORDER BY created_at DESC LIMIT 1", [key_sha256])
        return None if frame.empty else frame.iloc[0].to_dict()

    def api_keys(self, include_revoked: bool = True) -> pd.DataFrame:
        """Every API key, newest first, without its hash: key_id, name, prefix, scopes, created_at, created_by,
        revoked_at, revoked_by."""
        where = "" if include_revoked else "WHERE revoked_at IS NULL "
        return self.query("SELECT key_id, name, prefix, scopes, created_at, created_by, revoked_at, revoked_by "
                          f"FROM api_keys {where}ORDER BY created_at DESC, key_id")

    def api_key_events(self) -> pd.DataFrame:
        """The API keys' audit, oldest first: key_id, name, action, scopes, actor, host, happened_at."""
        return self.query("SELECT key_id, name, action, scopes, actor, host, happened_at FROM api_key_events "
                          "ORDER BY happened_at, key_id")

    # -- the flow -------------------------------------------------------------------------------------------

    def completed_stages(self, campaign: str, stages: list[str]) -> pd.DataFrame:
        """Per iteration that has stage runs, how many of ``stages`` completed: iteration, done."""
        return self.query(
            """SELECT iteration, count(*) FILTER (WHERE status = 'completed' AND stage IN (SELECT unnest(?))) AS done
               FROM stage_runs WHERE campaign = ? GROUP BY iteration ORDER BY iteration""", [stages, campaign])

    # --- what the CLI checks before it runs anything, and the endpoint before it takes feedback ------------

    def stage_statuses(self, campaign: str) -> pd.DataFrame:
        """Every stage run of ``campaign``: iteration, stage, status."""
        return self.query("SELECT iteration, stage, status FROM stage_runs WHERE campaign = ?", [campaign])

    def campaign_known(self, campaign: str) -> bool:
        """Whether ``campaign`` has a stored config or a model version (a campaign before its first stage run)."""
        return bool(self.scalar(
            "SELECT count(*) FROM (SELECT campaign FROM campaigns WHERE campaign = ? UNION ALL "
            "SELECT campaign FROM model_versions WHERE campaign = ?)", [campaign, campaign]))

    def campaign_names(self) -> list[str]:
        """Every campaign the store knows of, sorted."""
        return self.query("SELECT DISTINCT campaign FROM stage_runs UNION SELECT campaign FROM campaigns "
                          "UNION SELECT campaign FROM model_versions ORDER BY 1")["campaign"].tolist()

    def trace_exists(self, trace_id: str) -> bool:
        """Whether a trace with this id is stored."""
        return bool(self.scalar("SELECT count(*) FROM traces WHERE trace_id = ?", [trace_id]))

    def trace_owner(self, trace_id: str) -> tuple[bool, str | None]:
        """Whether a trace with this id is stored, and the API key id it was answered for (None: no key)."""
        frame = self.query("SELECT key_id FROM traces WHERE trace_id = ? LIMIT 1", [trace_id])
        if frame.empty:
            return False, None
        value = frame["key_id"].iloc[0]
        return True, (None if value is None or value != value else str(value))
