"""The scheduler's tables and their migrations, for both stores.

`preloop_schema_version` holds one row: the number of migrations applied.
Each migration is a list of statements written once with `{id}`, `{json}`,
`{real}` placeholders that each dialect fills in. PostgreSQL applies them
under a transaction-scoped advisory lock so two nodes starting together
migrate once; SQLite applies them inside `BEGIN IMMEDIATE`.

Counters kept in rows (so no path reads the whole run):
- `runs.remaining_jobs` / `failed_jobs`: when the run concludes.
- `jobs.remaining_needs`: need units (base ids) of the job not yet ended.
- `jobs.anc_fail` / `anc_bad`: some ancestor failed / did not succeed.
- `units`: one row per base id (a plain job, every leg of a matrix, a caller
  fold, and `^<caller>` for a caller's start) counting members still to end.
- `cohorts.active`: legs of a max-parallel matrix holding a slot.
- `jobs.remaining_inner`: a caller's direct inner jobs still to end.
"""

from __future__ import annotations

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "render"]

_V1 = [
    """CREATE TABLE IF NOT EXISTS runs (
        id {id} PRIMARY KEY,
        workflow TEXT NOT NULL,
        name TEXT NOT NULL,
        event TEXT NOT NULL,
        status TEXT NOT NULL,
        conclusion TEXT,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        remaining_jobs INTEGER NOT NULL,
        failed_jobs INTEGER NOT NULL DEFAULT 0,
        conc_group TEXT,
        conc_cancel INTEGER NOT NULL DEFAULT 0,
        conc_queue_max INTEGER NOT NULL DEFAULT 0,
        wait_seq BIGINT,
        context TEXT NOT NULL,
        created_at {real} NOT NULL,
        completed_at {real}
    )""",
    "CREATE INDEX IF NOT EXISTS runs_waiting ON runs (conc_group, wait_seq) WHERE status = "
    "'pending'",
    """CREATE TABLE IF NOT EXISTS jobs (
        run_id BIGINT NOT NULL,
        id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        base_id TEXT NOT NULL,
        name TEXT NOT NULL,
        kind TEXT NOT NULL,
        needs TEXT NOT NULL,
        if_expr TEXT,
        runs_on TEXT NOT NULL,
        cohort TEXT,
        matrix TEXT,
        strategy TEXT,
        continue_on_error INTEGER NOT NULL,
        timeout_minutes {real} NOT NULL,
        conc_group TEXT,
        conc_group_expr TEXT,
        conc_cancel INTEGER NOT NULL DEFAULT 0,
        conc_queue_max INTEGER NOT NULL DEFAULT 0,
        outputs_expr TEXT NOT NULL,
        caller TEXT,
        inner_job_ids TEXT NOT NULL,
        deferred_matrix TEXT,
        spec TEXT NOT NULL,
        status TEXT NOT NULL,
        conclusion TEXT,
        outputs TEXT,
        reason TEXT,
        remaining_needs INTEGER NOT NULL,
        anc_fail INTEGER NOT NULL DEFAULT 0,
        anc_bad INTEGER NOT NULL DEFAULT 0,
        force_skip INTEGER NOT NULL DEFAULT 0,
        holds_slot INTEGER NOT NULL DEFAULT 0,
        holds_group TEXT,
        wait_seq BIGINT,
        remaining_inner INTEGER NOT NULL DEFAULT 0,
        capped INTEGER NOT NULL DEFAULT 0,
        runner TEXT,
        lease_token TEXT,
        lease_expires {real},
        attempt INTEGER NOT NULL DEFAULT 0,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        started_at {real},
        completed_at {real},
        PRIMARY KEY (run_id, id)
    )""",
    "CREATE INDEX IF NOT EXISTS jobs_queued ON jobs (run_id, seq) WHERE status = 'queued'",
    "CREATE INDEX IF NOT EXISTS jobs_parked ON jobs (run_id, cohort, seq) WHERE status = 'parked'",
    "CREATE INDEX IF NOT EXISTS jobs_waiting ON jobs (conc_group, wait_seq) WHERE status = "
    "'waiting'",
    "CREATE INDEX IF NOT EXISTS jobs_leases ON jobs (lease_expires) WHERE status = 'running'",
    "CREATE INDEX IF NOT EXISTS jobs_run_status ON jobs (run_id, status)",
    "CREATE INDEX IF NOT EXISTS jobs_cohort ON jobs (run_id, cohort, status)",
    """CREATE TABLE IF NOT EXISTS deps (
        run_id BIGINT NOT NULL,
        need TEXT NOT NULL,
        job_id TEXT NOT NULL,
        PRIMARY KEY (run_id, need, job_id)
    )""",
    """CREATE TABLE IF NOT EXISTS units (
        run_id BIGINT NOT NULL,
        base_id TEXT NOT NULL,
        caller TEXT,
        remaining INTEGER NOT NULL,
        n_success INTEGER NOT NULL DEFAULT 0,
        n_failure INTEGER NOT NULL DEFAULT 0,
        n_cancelled INTEGER NOT NULL DEFAULT 0,
        n_skipped INTEGER NOT NULL DEFAULT 0,
        anc_fail INTEGER NOT NULL DEFAULT 0,
        anc_bad INTEGER NOT NULL DEFAULT 0,
        outputs TEXT NOT NULL DEFAULT '{{}}',
        result TEXT,
        PRIMARY KEY (run_id, base_id)
    )""",
    "CREATE INDEX IF NOT EXISTS units_caller ON units (run_id, caller)",
    """CREATE TABLE IF NOT EXISTS cohorts (
        run_id BIGINT NOT NULL,
        id TEXT NOT NULL,
        max_parallel INTEGER,
        fail_fast INTEGER NOT NULL,
        active INTEGER NOT NULL DEFAULT 0,
        admitted INTEGER NOT NULL DEFAULT 0,
        total INTEGER NOT NULL,
        PRIMARY KEY (run_id, id)
    )""",
    """CREATE TABLE IF NOT EXISTS conc_groups (
        name TEXT PRIMARY KEY,
        holder_run BIGINT,
        holder_job TEXT
    )""",
    """CREATE TABLE IF NOT EXISTS wait_seq (
        id INTEGER PRIMARY KEY,
        value BIGINT NOT NULL
    )""",
    "INSERT INTO wait_seq (id, value) VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
]

MIGRATIONS: list[list[str]] = [_V1]
SCHEMA_VERSION = len(MIGRATIONS)

_DIALECT = {
    "lite": {"id": "INTEGER", "real": "REAL"},
    "pg": {"id": "BIGINT GENERATED BY DEFAULT AS IDENTITY", "real": "DOUBLE PRECISION"},
}


def render(statement: str, dialect: str) -> str:
    """`statement` with the dialect's column types filled in."""
    return statement.format(**_DIALECT[dialect])
