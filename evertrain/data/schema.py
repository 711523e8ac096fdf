"""The store's schema as an ordered list of migrations, and how a store is brought up to date.

Version 1 is the schema every store had before migrations existed (tests/data/store_schema_v1.sql is its
DDL, frozen); each later version is a list of steps (a new table, a new column) applied in order. A store
records its version in ``schema_info`` (one row) and every migration this code applied in
``schema_migrations``. Opening a store for writing applies the migrations it lacks, in one transaction with
the version bump, so two processes opening an old store at once cannot both apply them: DuckLake refuses the
second commit (a conflict), whose retry then finds the store current. A store newer than this code is refused
(what it holds may not be what this code would write).

To change the schema, append a :class:`Migration`; never edit a released one (stores already hold it).
The tables' current shape (:func:`tables`, the docs' store reference, the keys the store keeps) is the fold
of all migrations, so it cannot drift from what an upgraded store holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import duckdb


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    note: str = ""  # what the docs' store reference says beside the column


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...] = ()  # kept by the code (DuckLake has no primary keys): an insert replaces its key's rows
    comment: str = ""

    def ddl(self, keys: bool = True) -> str:
        """``CREATE TABLE IF NOT EXISTS``; with ``keys`` its PRIMARY KEY (DuckLake refuses constraints)."""
        parts = [f"{c.name} {c.type}" for c in self.columns]
        if keys and self.key:
            parts.append(f"PRIMARY KEY ({', '.join(self.key)})")
        return f"CREATE TABLE IF NOT EXISTS {self.name} ({', '.join(parts)})"


@dataclass(frozen=True)
class CreateTable:
    """A new table."""

    table: Table

    def statements(self, con: duckdb.DuckDBPyConnection, lake: bool) -> list[str]:
        return [self.table.ddl(keys=not lake)]

    def fold(self, tables: dict[str, Table]) -> None:
        tables[self.table.name] = self.table


@dataclass(frozen=True)
class AddColumn:
    """A new column of an existing table (NULL in the rows written before)."""

    table: str
    column: Column

    def statements(self, con: duckdb.DuckDBPyConnection, lake: bool) -> list[str]:
        if self.column.name in _existing_columns(con).get(self.table, set()):
            return []
        return [f"ALTER TABLE {self.table} ADD COLUMN {self.column.name} {self.column.type}"]

    def fold(self, tables: dict[str, Table]) -> None:
        old = tables[self.table]
        tables[self.table] = replace(old, columns=(*old.columns, self.column))


@dataclass(frozen=True)
class FillColumns:
    """Add the columns of ``version``'s tables that a store recorded at that version lacks.

    Before migrations, columns were added to version 1's tables without a version bump (an older store got them
    on open, NULL in its rows); a store recorded as version 1 may therefore lack some of them.
    """

    version: int

    def statements(self, con: duckdb.DuckDBPyConnection, lake: bool) -> list[str]:
        have = _existing_columns(con)
        return [f"ALTER TABLE {table.name} ADD COLUMN {column.name} {column.type}"
                for table in tables(self.version).values() if table.name in have
                for column in table.columns if column.name not in have[table.name]]

    def fold(self, tables: dict[str, Table]) -> None:
        return None


Step = CreateTable | AddColumn | FillColumns


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    steps: tuple[Step, ...] = field(default_factory=tuple)


def _existing_columns(con: duckdb.DuckDBPyConnection) -> dict[str, set[str]]:
    have: dict[str, set[str]] = {}
    for table, column in con.execute("SELECT table_name, column_name FROM information_schema.columns "
                                     "WHERE table_catalog = current_database()").fetchall():
        have.setdefault(table, set()).add(column)
    return have


# version 1: the schema of every store made before migrations (its DDL frozen in tests/data/store_schema_v1.sql)
V1_TABLES: tuple[Table, ...] = (
    Table('schema_info', columns=(
        Column('version', 'INTEGER'),
    )),
    Table('problems', key=('campaign', 'iteration', 'problem_id'), columns=(
        Column('campaign', 'VARCHAR'), Column('iteration', 'INTEGER'), Column('problem_id', 'VARCHAR'),
        Column('env', 'VARCHAR'), Column('split', 'VARCHAR'), Column('prompt', 'VARCHAR'), Column('payload', 'JSON'),
        Column('messages', 'JSON'), Column('created_at', 'TIMESTAMPTZ'),
        Column('refill_round', 'INTEGER',
               "0 (or NULL): curated; k >= 1: drawn by dynamic sampling's k-th refill round (score)"),
    )),
    Table('rollouts', key=('campaign', 'iteration', 'problem_id', 'sample'), columns=(
        Column('campaign', 'VARCHAR'), Column('iteration', 'INTEGER'), Column('problem_id', 'VARCHAR'),
        Column('sample', 'INTEGER'), Column('env', 'VARCHAR'), Column('policy_version', 'INTEGER'),
        Column('prompt_text', 'VARCHAR'), Column('completion', 'VARCHAR'), Column('prompt_ids', 'INTEGER[]'),
        Column('completion_ids', 'INTEGER[]'), Column('logprobs', 'FLOAT[]'), Column('loss_mask', 'UTINYINT[]'),
        Column('turns', 'JSON'), Column('finish_reason', 'VARCHAR'), Column('prompt_tokens', 'INTEGER'),
        Column('completion_tokens', 'INTEGER'), Column('tool_calls', 'INTEGER'), Column('tool_errors', 'INTEGER'),
        Column('rework', 'INTEGER'), Column('generated_at', 'TIMESTAMPTZ'), Column('reward', 'DOUBLE'),
        Column('passed', 'BOOLEAN'), Column('reason', 'VARCHAR'), Column('detail', 'JSON'),
        Column('scored_at', 'TIMESTAMPTZ'),
        Column('temperature', 'DOUBLE', 'what the behaviour log-probs were sampled with (replays use them)'),
        Column('top_p', 'DOUBLE', 'what the behaviour log-probs were sampled with (replays use them)'),
        Column('refill_round', 'INTEGER',
               "0 (or NULL): sampled by the rollout stage; k >= 1: dynamic sampling's k-th refill round"),
    )),
    Table('evals', key=('campaign', 'iteration', 'model_version', 'problem_id', 'sample'), columns=(
        Column('campaign', 'VARCHAR'), Column('iteration', 'INTEGER'), Column('model_version', 'INTEGER'),
        Column('role', 'VARCHAR'), Column('problem_id', 'VARCHAR'), Column('sample', 'INTEGER'),
        Column('env', 'VARCHAR'), Column('completion', 'VARCHAR'), Column('completion_tokens', 'INTEGER'),
        Column('turns', 'JSON'), Column('tool_calls', 'INTEGER'), Column('tool_errors', 'INTEGER'),
        Column('rework', 'INTEGER'), Column('reward', 'DOUBLE'), Column('passed', 'BOOLEAN'),
        Column('reason', 'VARCHAR'), Column('reused_from', 'INTEGER'), Column('created_at', 'TIMESTAMPTZ'),
        Column('split', 'VARCHAR',
               'gate (what promotion compares), test or transfer (sealed: never seen by the gate)'),
        Column('gen_key', 'VARCHAR', 'hash of how the answer was generated: rows are reused only when it matches'),
    )),
    Table('promotions', key=('campaign', 'iteration'), columns=(
        Column('campaign', 'VARCHAR'), Column('iteration', 'INTEGER'), Column('challenger_version', 'INTEGER'),
        Column('champion_version', 'INTEGER'), Column('promoted', 'BOOLEAN'), Column('challenger_pass1', 'DOUBLE'),
        Column('champion_pass1', 'DOUBLE'), Column('p_better', 'DOUBLE'), Column('gain_low', 'DOUBLE'),
        Column('gain_high', 'DOUBLE'), Column('per_env', 'JSON'), Column('reason', 'VARCHAR'),
        Column('reset_trainee', 'BOOLEAN'), Column('decided_at', 'TIMESTAMPTZ'),
    )),
    Table('stage_runs', key=('campaign', 'iteration', 'stage'), columns=(
        Column('campaign', 'VARCHAR'), Column('iteration', 'INTEGER'), Column('stage', 'VARCHAR'),
        Column('status', 'VARCHAR'), Column('started_at', 'TIMESTAMPTZ'), Column('finished_at', 'TIMESTAMPTZ'),
        Column('wall_s', 'DOUBLE'), Column('cpu_s', 'DOUBLE'), Column('metrics', 'JSON'),
        Column('flow_run_id', 'VARCHAR'), Column('error', 'VARCHAR'),
    )),
    Table('model_versions', key=('campaign', 'version'), columns=(
        Column('campaign', 'VARCHAR'), Column('version', 'INTEGER'), Column('iteration', 'INTEGER'),
        Column('kind', 'VARCHAR'), Column('path', 'VARCHAR'), Column('parent_version', 'INTEGER'),
        Column('created_at', 'TIMESTAMPTZ'),
    )),
    Table('campaigns', key=('campaign',), columns=(
        Column('campaign', 'VARCHAR'), Column('config', 'JSON'), Column('updated_at', 'TIMESTAMPTZ'),
    )),
    Table('campaign_state', key=('campaign',), columns=(
        Column('campaign', 'VARCHAR'), Column('trainee_version', 'INTEGER'), Column('updated_at', 'TIMESTAMPTZ'),
    )),
    Table('env_validations', key=('env', 'options'), columns=(
        Column('env', 'VARCHAR'), Column('options', 'JSON'), Column('ok', 'BOOLEAN'), Column('checked', 'INTEGER'),
        Column('failures', 'JSON'), Column('validated_at', 'TIMESTAMPTZ'),
    )),
    Table('rollbacks', key=('campaign', 'rolled_back_at'), columns=(
        Column('campaign', 'VARCHAR'), Column('rolled_back_at', 'TIMESTAMPTZ'), Column('from_version', 'INTEGER'),
        Column('to_version', 'INTEGER'), Column('reason', 'VARCHAR'),
    )),
    Table('mix', comment=(
        "the adaptive environment mix: each environment's share, per iteration, and why"
    ), key=('campaign', 'iteration', 'env'), columns=(
        Column('campaign', 'VARCHAR'), Column('iteration', 'INTEGER'), Column('env', 'VARCHAR'),
        Column('weight', 'DOUBLE'), Column('share', 'DOUBLE'), Column('problems', 'INTEGER'),
        Column('groups', 'INTEGER'), Column('pass_rate', 'DOUBLE'), Column('informative_share', 'DOUBLE'),
        Column('learnability', 'DOUBLE'), Column('reason', 'VARCHAR'), Column('created_at', 'TIMESTAMPTZ'),
    )),
    Table('sft_examples', comment=(
        'the rollouts the optional sft stage trained on (sft.select)'
    ), key=('campaign', 'iteration', 'source_iteration', 'problem_id', 'sample'), columns=(
        Column('campaign', 'VARCHAR'), Column('iteration', 'INTEGER'), Column('source_iteration', 'INTEGER'),
        Column('problem_id', 'VARCHAR'), Column('sample', 'INTEGER'), Column('env', 'VARCHAR'),
        Column('pair', 'INTEGER', "sft.method = 'dpo': the pair's number (sft: NULL)"),
        Column('role', 'VARCHAR', "sft.method = 'dpo': 'chosen' or 'rejected' (sft: NULL)"),
    )),
    Table('sandbox_runs', key=('run_id',), columns=(
        Column('run_id', 'VARCHAR'), Column('campaign', 'VARCHAR'), Column('iteration', 'INTEGER'),
        Column('purpose', 'VARCHAR'), Column('code_sha256', 'VARCHAR'), Column('limits', 'JSON'),
        Column('exit_code', 'INTEGER'), Column('signal', 'INTEGER'), Column('wall_s', 'DOUBLE'),
        Column('cpu_s', 'DOUBLE'), Column('peak_rss_kb', 'BIGINT'), Column('stdout_bytes', 'BIGINT'),
        Column('stderr_bytes', 'BIGINT'), Column('limit_hit', 'VARCHAR'), Column('started_at', 'TIMESTAMPTZ'),
    )),
    Table('approvals', comment=(
        "a person's answer to a promotion the gate passed (promotion.approval)"
    ), key=('campaign', 'iteration'), columns=(
        Column('campaign', 'VARCHAR'), Column('iteration', 'INTEGER'), Column('challenger_version', 'INTEGER'),
        Column('champion_version', 'INTEGER'),
        Column('decision', 'VARCHAR',
               'pending, approved, rejected or timeout (no answer within promotion.approval_timeout_s)'),
        Column('reviewer', 'VARCHAR'), Column('reason', 'VARCHAR'), Column('requested_at', 'TIMESTAMPTZ'),
        Column('decided_at', 'TIMESTAMPTZ'), Column('waited_s', 'DOUBLE'),
        Column('flow_run_id', 'VARCHAR', 'the Markdown the reviewer was shown'),
        Column('evidence', 'VARCHAR', 'the Markdown the reviewer was shown'),
    )),
    Table('traces', comment=(
        "the endpoint's requests (evertrain.serving), redacted before they are stored; written in batches. No "
        'key: a trace id is a fresh random id, so a batch is a plain insert (no delete scan of the growing '
        'table per batch)'
    ), columns=(
        Column('trace_id', 'VARCHAR'), Column('campaign', 'VARCHAR'), Column('model_version', 'INTEGER'),
        Column('model', 'VARCHAR'),
        Column('env', 'VARCHAR', "the task, when the client named one (extra body 'evertrain')"),
        Column('problem_id', 'VARCHAR', "the task, when the client named one (extra body 'evertrain')"),
        Column('problem', 'JSON', "the task, when the client named one (extra body 'evertrain')"),
        Column('request', 'JSON', 'tools: the tool names used, comma-separated'),
        Column('response', 'JSON', 'tools: the tool names used, comma-separated'),
        Column('tool_calls', 'JSON', 'tools: the tool names used, comma-separated'),
        Column('tools', 'VARCHAR', 'tools: the tool names used, comma-separated'),
        Column('status', 'VARCHAR'), Column('http_status', 'INTEGER'), Column('error', 'VARCHAR'),
        Column('finish_reason', 'VARCHAR'), Column('latency_ms', 'DOUBLE'), Column('prompt_tokens', 'INTEGER'),
        Column('cached_tokens', 'INTEGER'), Column('completion_tokens', 'INTEGER'), Column('cost_usd', 'DOUBLE'),
        Column('created_at', 'TIMESTAMPTZ'),
    )),
    Table('trace_feedback', comment=(
        "outcomes of traces: the environment's verifier (when the client named the task) or the client (POST "
        '/feedback)'
    ), columns=(
        Column('trace_id', 'VARCHAR'), Column('campaign', 'VARCHAR'), Column('source', 'VARCHAR'),
        Column('passed', 'BOOLEAN'), Column('reward', 'DOUBLE'), Column('detail', 'JSON'),
        Column('created_at', 'TIMESTAMPTZ'),
    )),
    Table('curriculum', comment=(
        "each environment's difficulty level per iteration, and why it moved"
    ), key=('campaign', 'iteration', 'env'), columns=(
        Column('campaign', 'VARCHAR'), Column('iteration', 'INTEGER'), Column('env', 'VARCHAR'),
        Column('level', 'INTEGER'), Column('max_level', 'INTEGER'), Column('previous_level', 'INTEGER'),
        Column('groups', 'INTEGER'), Column('pass_rate', 'DOUBLE'), Column('action', 'VARCHAR'),
        Column('reason', 'VARCHAR'), Column('created_at', 'TIMESTAMPTZ'),
    )),
    Table('broad_sealed', comment=(
        'the broad sealed set: drawn once per campaign across all levels'
    ), key=('campaign', 'problem_id'), columns=(
        Column('campaign', 'VARCHAR'), Column('problem_id', 'VARCHAR'), Column('env', 'VARCHAR'),
        Column('level', 'INTEGER'), Column('source', 'VARCHAR'), Column('prompt', 'VARCHAR'),
        Column('payload', 'JSON'), Column('created_at', 'TIMESTAMPTZ'),
    )),
)

SCHEMA_MIGRATIONS = Table("schema_migrations", comment="the schema migrations applied to this store, and when",
                          columns=(
    Column("version", "INTEGER"), Column("description", "VARCHAR"), Column("applied_at", "TIMESTAMPTZ"),
                          ))

API_KEYS = Table("api_keys", comment=(
    "the endpoint's API keys (`evertrain keys`): only the SHA-256 of each secret is stored, never the secret"
), key=("key_id",), columns=(
    Column("key_id", "VARCHAR"), Column("name", "VARCHAR"),
    Column("prefix", "VARCHAR", "the secret's first characters, to tell keys apart (not enough to use one)"),
    Column("key_sha256", "VARCHAR", "hex SHA-256 of the secret (a 256-bit random token: no salt needed)"),
    Column("scopes", "VARCHAR", "comma-separated: infer, feedback, admin"),
    Column("created_at", "TIMESTAMPTZ"), Column("created_by", "VARCHAR"),
    Column("revoked_at", "TIMESTAMPTZ", "NULL while the key works"), Column("revoked_by", "VARCHAR"),
))
API_KEY_EVENTS = Table("api_key_events", comment=(
    "the audit of the API keys: every create and revoke, who did it, when and from which machine"
), columns=(
    Column("key_id", "VARCHAR"), Column("name", "VARCHAR"), Column("action", "VARCHAR", "create or revoke"),
    Column("scopes", "VARCHAR"), Column("actor", "VARCHAR", "the OS user, or the command's --actor"),
    Column("host", "VARCHAR"), Column("happened_at", "TIMESTAMPTZ"),
))

APPROVAL_ATTEMPTS = Table("approval_attempts", comment=(
    "every answer to a promotion waiting for approval, accepted or refused: the key it carried, from where, why"
), columns=(
    Column("campaign", "VARCHAR"), Column("iteration", "INTEGER"),
    Column("outcome", "VARCHAR", "accepted, or refused (no key, an unknown or revoked key, no 'approve' scope, "
           "stale evidence)"),
    Column("decision", "VARCHAR", "what the answer asked: approved or rejected"),
    Column("key_id", "VARCHAR", "the API key the answer carried (NULL: none, or not a key of this store)"),
    Column("key_name", "VARCHAR"), Column("answered_from", "VARCHAR", "where the answer says it came from"),
    Column("why", "VARCHAR"), Column("happened_at", "TIMESTAMPTZ"),
))

FRONTIER = Table("frontier", comment=(
    "each problem kind's guidance level per iteration and environment, and why it moved (evertrain.frontier)"
), key=("campaign", "iteration", "env", "kind"), columns=(
    Column("campaign", "VARCHAR"), Column("iteration", "INTEGER"), Column("env", "VARCHAR"),
    Column("kind", "VARCHAR", "what the environment calls the problems' kind (Environment.problem_kind)"),
    Column("level", "INTEGER", "the guidance level of the kind's problems this iteration (0: bare)"),
    Column("previous_level", "INTEGER"),
    Column("since", "INTEGER", "the iteration the kind entered this level"),
    Column("groups", "INTEGER", "the kind's groups at its previous level that decided (the window)"),
    Column("pass_rate", "DOUBLE"), Column("informative_share", "DOUBLE"),
    Column("predicted_informative", "DOUBLE", "(informative + 1) / (groups + 2) at the level it is at now"),
    Column("action", "VARCHAR", "raise, withdraw or hold"), Column("reason", "VARCHAR"),
    Column("created_at", "TIMESTAMPTZ"),
))

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "the schema before migrations: problems, rollouts, evals, promotions, lineage, audit, serving, "
                 "curriculum", tuple(CreateTable(table) for table in V1_TABLES)),
    Migration(2, "schema_migrations (the applied migrations); version 1's columns an older store lacks",
              (FillColumns(1), CreateTable(SCHEMA_MIGRATIONS))),
    Migration(3, "API keys of the endpoint (api_keys, hashed; api_key_events, their audit); the key of each trace",
              (CreateTable(API_KEYS), CreateTable(API_KEY_EVENTS),
               AddColumn("traces", Column("key_id", "VARCHAR", "the API key the request was made with (NULL: none)")))),
    Migration(4, "approvals carry an identity: the approving key, where the answer came from, the evidence's hash; "
                 "approval_attempts (every answer, refused ones included); rollbacks record who, where, and "
                 "whether the version had been champion",
              (AddColumn("approvals", Column("reviewer_key_id", "VARCHAR", "the API key (scope approve) that "
                                             "answered; reviewer is that key's name")),
               AddColumn("approvals", Column("answered_from", "VARCHAR", "where the answer says it came from "
                                             "(the CLI: user@host; the Prefect UI: what the form was given)")),
               AddColumn("approvals", Column("evidence_sha256", "VARCHAR", "hex SHA-256 of the evidence shown, "
                                             "which the answer had to name")),
               CreateTable(APPROVAL_ATTEMPTS),
               AddColumn("rollbacks", Column("actor", "VARCHAR", "who rolled back (the OS user of the command)")),
               AddColumn("rollbacks", Column("host", "VARCHAR", "the machine the rollback was made on")),
               AddColumn("rollbacks", Column("unpromoted", "BOOLEAN", "the version restored had never been "
                                             "champion (--allow-unpromoted)")))),
    Migration(5, "the frontier: each problem's kind, guidance level and predicted chance of an informative group; "
                 "each kind's guidance level per iteration (frontier)",
              (AddColumn("problems", Column("kind", "VARCHAR", "Environment.problem_kind, with frontier.enabled")),
               AddColumn("problems", Column("guidance", "INTEGER", "the hint level in its prompt (0 or NULL: bare; "
                                            "never on a gate, sealed or broad problem)")),
               AddColumn("problems", Column("predicted_informative", "DOUBLE", "the frontier's predicted chance "
                                            "that its group's rewards disagree")),
               CreateTable(FRONTIER))),
)
LATEST = MIGRATIONS[-1].version
BOOKKEEPING = ("schema_info", "schema_migrations")  # the schema's own tables, not the campaign's data


class SchemaTooNew(Exception):
    """The store was migrated by a newer evertrain than this one."""

    def __init__(self, found: int, known: int) -> None:
        super().__init__(f"schema version {found}, newer than this evertrain knows (its latest is {known})")
        self.found, self.known = found, known


def tables(version: int = LATEST) -> dict[str, Table]:
    """Every table as migrations up to ``version`` leave it, in creation order."""
    found: dict[str, Table] = {}
    for migration in MIGRATIONS:
        if migration.version > version:
            break
        for step in migration.steps:
            step.fold(found)
    return found


def stored_version(con: duckdb.DuckDBPyConnection) -> int:
    """The schema version the store records (0: a new, empty store)."""
    names = {row[0] for row in con.execute("SELECT table_name FROM information_schema.tables "
                                           "WHERE table_catalog = current_database()").fetchall()}
    if "schema_info" not in names:
        return 0
    value = con.execute("SELECT max(version) FROM schema_info").fetchone()[0]  # type: ignore[index]
    return 0 if value is None else int(value)


def migrate(con: duckdb.DuckDBPyConnection, lake: bool, now: Callable[[], Any]) -> list[int]:
    """Apply the migrations the store lacks, inside the caller's transaction; the versions applied.

    Raises :class:`SchemaTooNew` for a store newer than :data:`LATEST`.
    """
    current = stored_version(con)
    if current > LATEST:
        raise SchemaTooNew(current, LATEST)
    applied = []
    for migration in MIGRATIONS:
        if migration.version <= current:
            continue
        for step in migration.steps:
            for statement in step.statements(con, lake):
                con.execute(statement)
        applied.append(migration)
    if applied:
        con.execute("DELETE FROM schema_info")
        con.execute("INSERT INTO schema_info VALUES (?)", [LATEST])
        stamp = now()
        for migration in applied:
            con.execute("INSERT INTO schema_migrations (version, description, applied_at) VALUES (?, ?, ?)",
                        [migration.version, migration.description, stamp])
    return [m.version for m in applied]


def ddl(version: int = LATEST) -> str:
    """The DDL of the tables at ``version`` (with their keys), one statement per table."""
    return "".join(f"{table.ddl()};\n" for table in tables(version).values())
