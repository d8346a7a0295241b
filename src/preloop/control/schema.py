"""The scheduler's tables and their migrations, for both stores.

`preloop_schema_version` holds one row: the number of migrations applied.
Each migration is a list of statements written once with `{id}`, `{json}`,
`{real}` placeholders that each dialect fills in. PostgreSQL applies them
under a transaction-scoped advisory lock so two nodes starting together
migrate once; SQLite applies them inside `BEGIN IMMEDIATE`.

Counters kept in rows (so no path reads the whole run):
- `runs.remaining_jobs` / `failed_jobs` / `cancelled_jobs`: when the run
  concludes, and how.
- `jobs.remaining_needs`: need units (base ids) of the job not yet ended.
- `jobs.anc_fail` / `anc_bad`: some ancestor failed / did not succeed.
- `units`: one row per base id (a plain job, every leg of a matrix, a caller
  fold, and `^<caller>` for a caller's start) counting members still to end.
- `cohorts.active`: legs of a max-parallel matrix holding a slot.
- `jobs.remaining_inner`: a caller's direct inner jobs still to end.
"""

from __future__ import annotations

import re

from preloop.workflow.plan import TRUE_WHEN_CLEAN

__all__ = [
    "MIGRATIONS",
    "QUEUE_MAX",
    "SCHEMA_VERSION",
    "Statement",
    "if_true_when_clean",
    "render",
]

QUEUE_MAX = 100  # GitHub's `queue: max` pending limit


def if_true_when_clean(column: str) -> str:
    """SQL: the `if:` in `column` is none, or one of `TRUE_WHEN_CLEAN`
    (admitted like a job without one when its ancestry is clean)."""
    listed = ", ".join(f"'{expr}'" for expr in TRUE_WHEN_CLEAN)
    return f"({column} IS NULL OR {column} IN ({listed}))"


# A migration is a list of statements; a dict holds one per dialect (None: nothing).
Statement = str | dict[str, str | None]

_V1: list[Statement] = [
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
    # A run's jobs that may start (submit, a run resumed by its group).
    "CREATE INDEX IF NOT EXISTS jobs_roots ON jobs (run_id, seq) "
    "WHERE status = 'blocked' AND remaining_needs = 0",
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

# PostgreSQL only: the settle fast path as one server-side call, so the run
# lock is held for one round trip instead of three to five. It takes the run
# row first (lock order), ends the job (guarded as in Python), counts it in its
# unit and hands a freed cohort slot to the next parked leg without a
# concurrency group. Everything else (a unit that ended, a group to release,
# fail-fast) continues in Python in the same transaction.
_SETTLE_TEMPLATE = """CREATE OR REPLACE FUNCTION preloop_settle(
    p_run BIGINT, p_job TEXT, p_conclusion TEXT, p_outputs TEXT, p_reason TEXT,
    p_token TEXT, p_now DOUBLE PRECISION)
RETURNS TABLE (run_row JSON, job_row JSON, unit_row JSON, admitted TEXT, wait_us BIGINT)
LANGUAGE plpgsql AS $fn$
DECLARE
    r RECORD; j jobs%ROWTYPE; u units%ROWTYPE; eff TEXT; nxt TEXT;
    t0 TIMESTAMPTZ := clock_timestamp(); waited BIGINT;
BEGIN
    UPDATE runs SET remaining_jobs = remaining_jobs - 1 WHERE id = p_run
        RETURNING @RUN_COLS@ INTO r;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    waited := (extract(epoch FROM clock_timestamp() - t0) * 1000000)::BIGINT;
    UPDATE jobs SET status = 'completed',
        conclusion = CASE WHEN cancel_requested = 1 AND p_conclusion <> 'skipped'
                          THEN 'cancelled' ELSE p_conclusion END,
        outputs = p_outputs, reason = p_reason, completed_at = p_now, lease_token = NULL
        WHERE run_id = p_run AND id = p_job
          AND status NOT IN ('completed', 'expanded', 'folding')
          AND (p_token IS NULL OR (status = 'running' AND lease_token = p_token))
        RETURNING * INTO j;
    IF NOT FOUND THEN
        UPDATE runs SET remaining_jobs = remaining_jobs + 1 WHERE id = p_run;
        RETURN QUERY SELECT row_to_json(r), NULL::JSON, NULL::JSON, NULL::TEXT, waited;
        RETURN;
    END IF;
    eff := CASE WHEN j.conclusion = 'failure' AND j.continue_on_error = 1
                THEN 'success' ELSE j.conclusion END;
    UPDATE units SET remaining = remaining - 1,
        n_success = n_success + (eff = 'success')::INT,
        n_failure = n_failure + (eff = 'failure')::INT,
        n_cancelled = n_cancelled + (eff = 'cancelled')::INT,
        n_skipped = n_skipped + (eff NOT IN ('success', 'failure', 'cancelled'))::INT,
        anc_fail = GREATEST(anc_fail, j.anc_fail),
        anc_bad = GREATEST(anc_bad, j.anc_bad),
        outputs = CASE WHEN p_outputs = '{{}}' THEN outputs
                       ELSE (outputs::JSONB || p_outputs::JSONB)::TEXT END
        WHERE run_id = p_run AND base_id = j.base_id
        RETURNING * INTO u;
    IF j.holds_slot = 1 THEN
        UPDATE jobs SET status = 'queued', holds_slot = 1
            WHERE (run_id, id) = (SELECT p.run_id, p.id FROM jobs p
                                  WHERE p.run_id = p_run AND p.cohort = j.cohort
                                    AND p.status = 'parked' ORDER BY p.seq LIMIT 1)
              AND conc_group IS NULL AND conc_group_expr IS NULL@SLOT_GUARD@
            RETURNING id INTO nxt;
    END IF;
    RETURN QUERY SELECT row_to_json(r), row_to_json(j), row_to_json(u), nxt, waited;
END
$fn$"""


def _settle_fn(run_cols: str, slot_guard: str, reason: str = "p_reason") -> str:
    return (
        _SETTLE_TEMPLATE.replace("@RUN_COLS@", run_cols)
        .replace("@SLOT_GUARD@", slot_guard)
        .replace("reason = p_reason", f"reason = {reason}")
    )


_SETTLE_FN = _settle_fn("id, status, cancel_requested, conc_group, remaining_jobs, failed_jobs", "")

# Migration 4.
# - Ids are matched by range (`id >= 'call/' AND id < 'call0'`: every job
#   inside a reusable caller), which holds only in byte order: a database
#   whose default collation ignores punctuation (ICU, glibc en_US) would miss
#   inner jobs. Every id column is C-collated (SQLite compares bytes already).
# - `runs.cancelled_jobs`: a run with cancelled jobs and no failed one
#   concludes cancelled, as on GitHub.
# - `conc_actions`: a cancellation a concurrency group owes (replace an older
#   waiter, cancel-in-progress) that could not lock the other run at once; it
#   is carried out after commit and by the reaper, never dropped.
# - The settle function returns `cancelled_jobs`, and hands a freed cohort
#   slot only to a plain job (a reusable caller starts in Python).
_C_COLUMNS = {
    "jobs": ("id", "base_id", "cohort", "caller"),
    "units": ("base_id", "caller"),
    "deps": ("need", "job_id"),
    "cohorts": ("id",),
}
_V4: list[Statement] = [
    *(
        {
            "pg": f"ALTER TABLE {table} "
            + ", ".join(f'ALTER COLUMN {col} TYPE TEXT COLLATE "C"' for col in cols),
            "lite": None,
        }
        for table, cols in _C_COLUMNS.items()
    ),
    "ALTER TABLE runs ADD COLUMN cancelled_jobs INTEGER NOT NULL DEFAULT 0",
    """CREATE TABLE IF NOT EXISTS conc_actions (
        id {id} PRIMARY KEY,
        group_name TEXT NOT NULL,
        action TEXT NOT NULL,
        queue_max INTEGER NOT NULL DEFAULT 0,
        holder_run BIGINT,
        holder_job TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS conc_actions_group ON conc_actions (group_name, id)",
    {
        "pg": _settle_fn(
            "id, status, cancel_requested, conc_group, remaining_jobs, failed_jobs, cancelled_jobs",
            " AND kind = 'job'",
        ),
        "lite": None,
    },
]

# Migration 5, PostgreSQL only: a runner's completions and its next claims as
# one statement in autocommit (one round trip, one transaction): the common
# path of a batch of one run's jobs. It takes the run row first (lock order),
# ends the jobs (lease-guarded), counts them in their units and hands freed
# cohort slots to the next parked plain legs, then claims up to `p_limit`
# queued jobs (`FOR UPDATE SKIP LOCKED`, never waiting). Anything the cascade
# must decide in Python (a unit or the run ending, a failure, a concurrency
# group, a caller, a lease not held, two legs of one unit setting outputs)
# raises SQLSTATE PLSLO, which undoes the whole statement; the store then
# runs the batch as an ordinary transaction.
_COMPLETE_CLAIM_FN = """CREATE OR REPLACE FUNCTION preloop_complete_claim(
    p_run BIGINT, p_jobs TEXT[], p_conclusions TEXT[], p_outputs TEXT[], p_tokens TEXT[],
    p_now DOUBLE PRECISION, p_runner TEXT, p_labels TEXT[], p_limit INT,
    p_expires DOUBLE PRECISION, p_only_run BIGINT)
RETURNS TABLE (settled JSON, claimed JSON, wait_us BIGINT)
LANGUAGE plpgsql AS $fn$
DECLARE
    n INT := coalesce(cardinality(p_jobs), 0);
    t0 TIMESTAMPTZ := clock_timestamp();
    waited BIGINT := 0;
    left_jobs INT;
    n_done INT; n_slow INT; n_ended INT; n_multi INT; n_cancelled INT;
    v_settled JSON; v_slots JSON; v_groups JSON; v_claimed JSON;
    c RECORD; g RECORD; leg RECORD; got INT; odd INT;
BEGIN
    IF n > 0 THEN
        UPDATE runs SET remaining_jobs = remaining_jobs - n WHERE id = p_run
            RETURNING remaining_jobs INTO left_jobs;
        IF NOT FOUND OR left_jobs <= 0 THEN
            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
        END IF;
        waited := (extract(epoch FROM clock_timestamp() - t0) * 1000000)::BIGINT;
        WITH i AS (
            SELECT * FROM unnest(p_jobs, p_conclusions, p_outputs, p_tokens)
                AS i(id, conclusion, outputs, token)
        ), d AS (
            UPDATE jobs j SET status = 'completed',
                conclusion = CASE WHEN j.cancel_requested = 1 AND i.conclusion <> 'skipped'
                                  THEN 'cancelled' ELSE i.conclusion END,
                outputs = i.outputs, completed_at = p_now, lease_token = NULL
            FROM i
            WHERE j.run_id = p_run AND j.id = i.id AND j.status = 'running'
              AND j.lease_token = i.token
            RETURNING j.id, j.base_id, j.cohort, j.kind, j.holds_slot, j.holds_group,
                j.continue_on_error, j.anc_fail, j.anc_bad, j.conclusion, i.outputs
        ), e AS (
            SELECT d.*, CASE WHEN d.conclusion = 'failure' AND d.continue_on_error = 1
                             THEN 'success' ELSE d.conclusion END AS eff FROM d
        ), a AS (
            SELECT base_id, count(*) AS cnt,
                count(*) FILTER (WHERE eff = 'success') AS ns,
                count(*) FILTER (WHERE eff = 'cancelled') AS nc,
                count(*) FILTER (WHERE eff NOT IN ('success', 'failure', 'cancelled')) AS nk,
                max(anc_fail) AS af, max(anc_bad) AS ab,
                count(*) FILTER (WHERE outputs <> '{{}}') AS n_out,
                max(outputs) FILTER (WHERE outputs <> '{{}}') AS outs
            FROM e GROUP BY base_id
        ), u AS (
            UPDATE units SET remaining = units.remaining - a.cnt,
                n_success = units.n_success + a.ns,
                n_cancelled = units.n_cancelled + a.nc,
                n_skipped = units.n_skipped + a.nk,
                anc_fail = GREATEST(units.anc_fail, a.af),
                anc_bad = GREATEST(units.anc_bad, a.ab),
                outputs = CASE WHEN a.outs IS NULL THEN units.outputs
                               ELSE (units.outputs::JSONB || a.outs::JSONB)::TEXT END
            FROM a WHERE units.run_id = p_run AND units.base_id = a.base_id
            RETURNING units.remaining
        )
        SELECT (SELECT count(*) FROM e),
               (SELECT count(*) FROM e WHERE kind <> 'job' OR eff = 'failure'),
               (SELECT count(*) FROM u WHERE remaining <= 0),
               (SELECT count(*) FROM a WHERE n_out > 1),
               (SELECT count(*) FROM e WHERE eff = 'cancelled'),
               (SELECT json_agg(json_build_array(id, conclusion)) FROM e),
               (SELECT json_agg(s) FROM (SELECT cohort, count(*) AS freed FROM e
                                          WHERE holds_slot = 1 GROUP BY cohort) s),
               (SELECT json_agg(json_build_object('job', id, 'grp', holds_group)
                                ORDER BY id) FROM e WHERE holds_group IS NOT NULL)
          INTO n_done, n_slow, n_ended, n_multi, n_cancelled, v_settled, v_slots, v_groups;
        IF n_done < n OR n_slow > 0 OR n_ended > 0 OR n_multi > 0 THEN
            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
        END IF;
        IF n_cancelled > 0 THEN
            UPDATE runs SET cancelled_jobs = cancelled_jobs + n_cancelled WHERE id = p_run;
        END IF;
        -- A group a job held goes to its oldest waiter (as the cascade's
        -- release_group), before freed slots admit parked legs.
        FOR g IN SELECT x.job, x.grp
                   FROM json_to_recordset(coalesce(v_groups, '[]'::JSON)) AS x(job TEXT, grp TEXT)
        LOOP
            UPDATE conc_groups SET holder_run = NULL, holder_job = NULL
                WHERE name = g.grp AND holder_run = p_run AND holder_job = g.job;
            IF FOUND THEN
                PERFORM preloop_promote_group(p_run, g.grp);
            END IF;
        END LOOP;
        FOR c IN SELECT x.cohort, x.freed
                   FROM json_to_recordset(coalesce(v_slots, '[]'::JSON))
                     AS x(cohort TEXT, freed INT)
        LOOP
            got := 0;
            FOR leg IN SELECT p.id, p.kind, p.conc_group, p.conc_group_expr, p.conc_cancel,
                              p.conc_queue_max
                         FROM jobs p WHERE p.run_id = p_run AND p.cohort = c.cohort
                          AND p.status = 'parked' ORDER BY p.seq LIMIT c.freed
            LOOP
                got := got + 1;
                IF leg.kind <> 'job' OR leg.conc_group_expr IS NOT NULL
                   OR leg.conc_cancel = 1 THEN
                    RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
                END IF;
                IF leg.conc_group IS NULL THEN
                    UPDATE jobs SET status = 'queued', holds_slot = 1
                        WHERE run_id = p_run AND id = leg.id;
                ELSE
                    PERFORM preloop_through_group(p_run, leg.id, leg.conc_group,
                                                  leg.conc_queue_max);
                END IF;
            END LOOP;
            IF got < c.freed THEN
                UPDATE cohorts SET active = active - (c.freed - got)
                    WHERE run_id = p_run AND id = c.cohort;
            END IF;
        END LOOP;
    END IF;
    IF p_limit > 0 THEN
        IF p_only_run IS NULL THEN
            WITH q AS (
                SELECT j.run_id, j.id FROM jobs j
                WHERE j.status = 'queued' AND NOT EXISTS (
                    SELECT 1 FROM json_array_elements_text(j.runs_on::JSON) AS l(v)
                    WHERE l.v <> ALL (p_labels))
                ORDER BY j.run_id, j.seq LIMIT p_limit FOR UPDATE SKIP LOCKED
            ), w AS (
                UPDATE jobs j SET status = 'running', runner = p_runner,
                    lease_token = replace(gen_random_uuid()::TEXT, '-', ''),
                    lease_expires = p_expires, started_at = p_now, attempt = j.attempt + 1
                FROM q WHERE j.run_id = q.run_id AND j.id = q.id
                RETURNING j.run_id, j.id, j.seq, j.name, j.attempt, j.spec, j.matrix,
                    j.strategy, j.timeout_minutes, j.lease_token
            )
            SELECT json_agg(w ORDER BY w.run_id, w.seq) INTO v_claimed FROM w;
        ELSE
            WITH q AS (
                SELECT j.run_id, j.id FROM jobs j
                WHERE j.status = 'queued' AND j.run_id = p_only_run AND NOT EXISTS (
                    SELECT 1 FROM json_array_elements_text(j.runs_on::JSON) AS l(v)
                    WHERE l.v <> ALL (p_labels))
                ORDER BY j.run_id, j.seq LIMIT p_limit FOR UPDATE SKIP LOCKED
            ), w AS (
                UPDATE jobs j SET status = 'running', runner = p_runner,
                    lease_token = replace(gen_random_uuid()::TEXT, '-', ''),
                    lease_expires = p_expires, started_at = p_now, attempt = j.attempt + 1
                FROM q WHERE j.run_id = q.run_id AND j.id = q.id
                RETURNING j.run_id, j.id, j.seq, j.name, j.attempt, j.spec, j.matrix,
                    j.strategy, j.timeout_minutes, j.lease_token
            )
            SELECT json_agg(w ORDER BY w.run_id, w.seq) INTO v_claimed FROM w;
        END IF;
    END IF;
    RETURN QUERY SELECT v_settled, v_claimed, waited;
END
$fn$"""

_COMPLETE_CLAIM_SLOW_CHECK = """\
        IF n_done < n OR n_slow > 0 OR n_ended > 0 OR n_multi > 0 THEN
            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
        END IF;
"""
assert _COMPLETE_CLAIM_SLOW_CHECK in _COMPLETE_CLAIM_FN

# The concurrency-group half of `preloop_complete_claim`, as the cascade's
# promote_group and through_group do it, for the case that stays inside the
# locked run: the oldest waiter is a plain job of this run, no cancellation is
# owed or needed. Anything else raises PLSLO (the Python cascade decides).
_PROMOTE_GROUP_FN = """CREATE OR REPLACE FUNCTION preloop_promote_group(p_run BIGINT, p_group TEXT)
RETURNS VOID LANGUAGE plpgsql AS $fn$
DECLARE
    w RECORD;
BEGIN
    IF EXISTS (SELECT 1 FROM conc_actions WHERE group_name = p_group) THEN
        RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
    END IF;
    SELECT q.run_id, q.id, q.is_run INTO w FROM (
        SELECT run_id, id, wait_seq, 0 AS is_run FROM jobs
            WHERE conc_group = p_group AND status = 'waiting'
        UNION ALL SELECT id, NULL, wait_seq, 1 FROM runs
            WHERE conc_group = p_group AND status = 'pending') q
        ORDER BY q.wait_seq LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF w.is_run = 1 OR w.run_id <> p_run THEN
        RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
    END IF;
    UPDATE jobs SET status = 'queued', holds_group = p_group, conc_group = p_group
        WHERE run_id = p_run AND id = w.id AND status = 'waiting' AND kind = 'job';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
    END IF;
    UPDATE conc_groups SET holder_run = p_run, holder_job = w.id WHERE name = p_group;
END
$fn$"""

_THROUGH_GROUP_FN = """CREATE OR REPLACE FUNCTION preloop_through_group(
    p_run BIGINT, p_job TEXT, p_group TEXT, p_queue_max INT)
RETURNS VOID LANGUAGE plpgsql AS $fn$
DECLARE
    v_seq BIGINT;
BEGIN
    INSERT INTO conc_groups (name, holder_run, holder_job) VALUES (p_group, p_run, p_job)
        ON CONFLICT (name) DO UPDATE SET holder_run = excluded.holder_run,
            holder_job = excluded.holder_job
        WHERE conc_groups.holder_run IS NULL
          AND NOT EXISTS (SELECT 1 FROM jobs w WHERE w.conc_group = p_group
                          AND w.status = 'waiting')
          AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.conc_group = p_group
                          AND r.status = 'pending');
    IF FOUND THEN
        UPDATE jobs SET status = 'queued', holds_slot = 1, holds_group = p_group,
            conc_group = p_group WHERE run_id = p_run AND id = p_job;
        RETURN;
    END IF;
    UPDATE wait_seq SET value = value + 1 WHERE id = 1 RETURNING value INTO v_seq;
    UPDATE jobs SET status = 'waiting', holds_slot = 1, conc_group = p_group, wait_seq = v_seq
        WHERE run_id = p_run AND id = p_job;
    -- make_room: a waiter beyond the queue limit is cancelled by the cascade.
    IF EXISTS (SELECT 1 FROM (
            SELECT run_id, id, wait_seq FROM jobs
                WHERE conc_group = p_group AND status = 'waiting'
            UNION ALL SELECT id, NULL, wait_seq FROM runs
                WHERE conc_group = p_group AND status = 'pending'
            ORDER BY wait_seq DESC
            OFFSET CASE WHEN p_queue_max = 1 THEN @QUEUE_MAX@ ELSE 1 END) x
        WHERE x.run_id IS DISTINCT FROM p_run OR x.id IS DISTINCT FROM p_job) THEN
        RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
    END IF;
    UPDATE conc_groups SET holder_run = holder_run
        WHERE name = p_group AND holder_run IS NULL;
    IF FOUND THEN
        PERFORM preloop_promote_group(p_run, p_group);
    END IF;
END
$fn$"""

# Wake-ups (preloop.control.wakeups): a job that becomes queued, by any path,
# (and a run that completes) sends a NOTIFY, delivered at commit; duplicates within one transaction
# collapse into one. The WHEN clauses keep every other write trigger-free.
_NOTIFY_QUEUED_FN = """CREATE OR REPLACE FUNCTION preloop_notify_queued() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify('preloop_jobs', '');
    RETURN NULL;
END
$fn$"""

_NOTIFY_COMPLETED_FN = """CREATE OR REPLACE FUNCTION preloop_notify_completed() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify('preloop_runs', '');
    RETURN NULL;
END
$fn$"""

_V6: list[Statement] = [
    {"pg": _NOTIFY_QUEUED_FN, "lite": None},
    {"pg": _NOTIFY_COMPLETED_FN, "lite": None},
    {
        "pg": "CREATE TRIGGER preloop_runs_completed AFTER UPDATE OF status ON runs "
        "FOR EACH ROW WHEN (NEW.status = 'completed' AND OLD.status IS DISTINCT FROM "
        "'completed') EXECUTE FUNCTION preloop_notify_completed()",
        "lite": None,
    },
    {
        "pg": "CREATE TRIGGER preloop_jobs_queued_insert AFTER INSERT ON jobs FOR EACH ROW "
        "WHEN (NEW.status = 'queued') EXECUTE FUNCTION preloop_notify_queued()",
        "lite": None,
    },
    {
        "pg": "CREATE TRIGGER preloop_jobs_queued_update AFTER UPDATE OF status ON jobs "
        "FOR EACH ROW WHEN (NEW.status = 'queued' AND OLD.status IS DISTINCT FROM 'queued') "
        "EXECUTE FUNCTION preloop_notify_queued()",
        "lite": None,
    },
]

# Content-addressed blobs (preloop.control.blobs): snapshot bundles,
# artifacts and cache archives for machines that share only the store. A blob
# row is visible to readers once `complete`; its chunks are rows of at most
# `BlobStore.CHUNK` bytes; a pin keeps a blob from eviction.
_V7_BLOBS: list[Statement] = [
    """CREATE TABLE IF NOT EXISTS preloop_blobs (
        digest TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        size BIGINT NOT NULL,
        complete INTEGER NOT NULL DEFAULT 0,
        created_at {real} NOT NULL,
        used_at {real} NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS preloop_blobs_lru ON preloop_blobs (kind, used_at)",
    """CREATE TABLE IF NOT EXISTS preloop_blob_chunks (
        digest TEXT NOT NULL,
        seq INTEGER NOT NULL,
        data {bytes} NOT NULL,
        PRIMARY KEY (digest, seq)
    )""",
    """CREATE TABLE IF NOT EXISTS preloop_blob_pins (
        digest TEXT NOT NULL,
        holder TEXT NOT NULL,
        PRIMARY KEY (digest, holder)
    )""",
    "CREATE INDEX IF NOT EXISTS preloop_blob_pins_holder ON preloop_blob_pins (holder)",
]

# Job logs and results in the store (preloop.control.joblogs): what `preloop
# logs` and the submitting `preloop run` read of jobs that ran on other
# machines. A row holds one batch of lines of one job, numbered by its writer.
_V8_JOB_LOGS: list[Statement] = [
    """CREATE TABLE IF NOT EXISTS preloop_job_logs (
        run_id BIGINT NOT NULL,
        job_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        lines TEXT NOT NULL,
        at {real} NOT NULL,
        PRIMARY KEY (run_id, job_id, seq)
    )""",
    """CREATE TABLE IF NOT EXISTS preloop_job_results (
        run_id BIGINT NOT NULL,
        job_id TEXT NOT NULL,
        result TEXT NOT NULL,
        at {real} NOT NULL,
        PRIMARY KEY (run_id, job_id)
    )""",
]

# A job told to stop (fail-fast, a concurrency group, a cancelled run) keeps
# the reason the cascade stored with the request: the settle of a result
# without a reason (a runner's batch) no longer clears it. SQLite's settle is
# in Python (`Store._settle_tx`).
_V9_CANCEL_REASON: list[Statement] = [
    {
        "pg": _settle_fn(
            "id, status, cancel_requested, conc_group, remaining_jobs, failed_jobs, cancelled_jobs",
            " AND kind = 'job'",
            "COALESCE(p_reason, reason)",
        ),
        "lite": None,
    },
]

# Artifacts and actions-cache entries kept in the store
# (preloop.services.store_storage): the bytes are blobs (`blob`, pinned by
# `artifact:<id>` / `cache:<id>`), these rows say what they are. An artifact
# row exists only once its upload was finalized; a cache entry is `pending`
# from its reservation to its finalization. Both dialects.
_V10_SERVICES: list[Statement] = [
    """CREATE TABLE IF NOT EXISTS preloop_artifacts (
        id {id} PRIMARY KEY,
        run TEXT NOT NULL,
        job TEXT NOT NULL,
        name TEXT NOT NULL,
        size BIGINT NOT NULL,
        digest TEXT NOT NULL,
        blob TEXT NOT NULL,
        created_at TEXT NOT NULL,
        created {real} NOT NULL,
        expires_at TEXT
    )""",
    "CREATE UNIQUE INDEX IF NOT EXISTS preloop_artifacts_name ON preloop_artifacts (run, name)",
    """CREATE TABLE IF NOT EXISTS preloop_cache_entries (
        id {id} PRIMARY KEY,
        repo TEXT NOT NULL,
        ref TEXT NOT NULL,
        key TEXT NOT NULL,
        version TEXT NOT NULL,
        size BIGINT NOT NULL DEFAULT 0,
        state TEXT NOT NULL,
        upload TEXT,
        blob TEXT,
        created {real} NOT NULL,
        last_used {real} NOT NULL
    )""",
    "CREATE UNIQUE INDEX IF NOT EXISTS preloop_cache_entries_key "
    "ON preloop_cache_entries (repo, ref, key, version)",
    "CREATE INDEX IF NOT EXISTS preloop_cache_entries_lru "
    "ON preloop_cache_entries (state, last_used)",
]

# Snapshot bundles (preloop.snapshot.bundles): a run's snapshot reaches runners
# that share only the store as a chain of git bundles, each thin against the
# one before it (`parent`, NULL for a full bundle), all blobs of kind
# 'bundle'. A hold is one `preloop run`'s claim on its chain: its blobs are
# pinned as `run:<run_key>` until the run ends (or the reaper sees it ended).
_V11_BUNDLES: list[Statement] = [
    """CREATE TABLE IF NOT EXISTS preloop_bundles (
        digest TEXT PRIMARY KEY,
        repo_key TEXT NOT NULL,
        tip TEXT NOT NULL,
        parent TEXT,
        depth INTEGER NOT NULL,
        created_at {real} NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS preloop_bundles_repo ON preloop_bundles (repo_key, created_at)",
    "CREATE INDEX IF NOT EXISTS preloop_bundles_parent ON preloop_bundles (parent)",
    """CREATE TABLE IF NOT EXISTS preloop_bundle_holds (
        run_key TEXT PRIMARY KEY,
        repo_key TEXT NOT NULL,
        head TEXT NOT NULL,
        created_at {real} NOT NULL
    )""",
]

# Migration 12, PostgreSQL only: `preloop_complete_claim` takes GitHub's limit
# on a run's job outputs (`p_outputs_max`, the length of their stored JSON)
# and leaves a batch with outputs that take the run's over it to the Python
# cascade (PLSLO), which refuses them (`Store._settle_tx`). The check reads
# the run's outputs in a statement after the one that locked the run row, so
# it sees every completion that committed before: two jobs of one run
# completing at once cannot both pass it. Batches without outputs skip it.
_OUTPUTS_CHECK = """        IF p_outputs_max IS NOT NULL
           AND EXISTS (SELECT 1 FROM unnest(p_outputs) AS o(v) WHERE o.v <> '{{}}')
           AND (SELECT coalesce(sum(length(outputs)), 0) FROM jobs WHERE run_id = p_run)
               > p_outputs_max THEN
            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
        END IF;
"""
# Migration 12 also gives the settle function (the Python cascade's first
# call, as migration 9 left it) the same check, made after its first write
# took the run row: outputs that would take the run's over `p_outputs_max` are
# not written, the job ends as a failure, and `refused_used` (the others'
# length) tells the store why. No extra statement.
_SETTLE_V9 = _settle_fn(
    "id, status, cancel_requested, conc_group, remaining_jobs, failed_jobs, cancelled_jobs",
    " AND kind = 'job'",
    "COALESCE(p_reason, reason)",
)


def _edited(text: str, edits: list[tuple[str, str]], times: int = 1) -> str:
    """`text` with each edit's `old` replaced by its `new`. Each `old` must occur
    exactly `times` times, so an edit whose anchor moved fails at import rather
    than producing different SQL."""
    for old, new in edits:
        assert text.count(old) == times, old
        text = text.replace(old, new)
    return text


def _settle_v12() -> str:
    edits = [
        (
            "p_token TEXT, p_now DOUBLE PRECISION)",
            "p_token TEXT, p_now DOUBLE PRECISION, p_outputs_max BIGINT)",
        ),
        (
            "admitted TEXT, wait_us BIGINT)",
            "admitted TEXT, wait_us BIGINT, refused_used BIGINT)",
        ),
        (
            "t0 TIMESTAMPTZ := clock_timestamp(); waited BIGINT;",
            "t0 TIMESTAMPTZ := clock_timestamp(); waited BIGINT; used BIGINT; refused BIGINT;",
        ),
        (
            "    waited := (extract(epoch FROM clock_timestamp() - t0) * 1000000)::BIGINT;\n",
            "    waited := (extract(epoch FROM clock_timestamp() - t0) * 1000000)::BIGINT;\n"
            "    IF p_outputs_max IS NOT NULL AND p_outputs <> '{{}}' THEN\n"
            "        SELECT coalesce(sum(length(outputs)), 0) INTO used FROM jobs\n"
            "            WHERE run_id = p_run AND id <> p_job;\n"
            "        IF used + length(p_outputs) > p_outputs_max THEN\n"
            "            refused := used; p_outputs := '{{}}'; p_conclusion := 'failure';\n"
            "        END IF;\n"
            "    END IF;\n",
        ),
        (
            "NULL::JSON, NULL::JSON, NULL::TEXT, waited;",
            "NULL::JSON, NULL::JSON, NULL::TEXT, waited, NULL::BIGINT;",
        ),
        (
            "row_to_json(u), nxt, waited;",
            "row_to_json(u), nxt, waited, refused;",
        ),
    ]
    text = _SETTLE_V9
    return _edited(text, edits)


_COMPLETE_CLAIM_V12 = _COMPLETE_CLAIM_FN.replace(
    "p_expires DOUBLE PRECISION, p_only_run BIGINT)",
    "p_expires DOUBLE PRECISION, p_only_run BIGINT, p_outputs_max BIGINT)",
).replace(_COMPLETE_CLAIM_SLOW_CHECK, _COMPLETE_CLAIM_SLOW_CHECK + _OUTPUTS_CHECK)

_V12_OUTPUTS_LIMIT: list[Statement] = [
    {
        "pg": "DROP FUNCTION IF EXISTS preloop_settle(BIGINT, TEXT, TEXT, TEXT, TEXT, TEXT, "
        "DOUBLE PRECISION)",
        "lite": None,
    },
    {"pg": _settle_v12(), "lite": None},
    {
        "pg": "DROP FUNCTION IF EXISTS preloop_complete_claim(BIGINT, TEXT[], TEXT[], TEXT[], "
        "TEXT[], DOUBLE PRECISION, TEXT, TEXT[], INT, DOUBLE PRECISION, BIGINT)",
        "lite": None,
    },
    {"pg": _COMPLETE_CLAIM_V12, "lite": None},
]


# Migration 13, PostgreSQL only: `preloop_complete_claim` also returns
# `hold_us`, how long it held the run row's lock, measured by the server from
# the moment the lock was taken (after `wait_us`) to the function's end, which
# in autocommit is the statement's commit. Measured in the client, the figure
# also counted the answer's trip back and its decoding, time in which the
# server no longer held the lock. (The commit's own WAL flush comes after.)
#
# Its claim also runs with `enable_sort = off`: it must walk `jobs_queued` in
# its (run_id, seq) order and stop after `p_limit` claimable rows. A run's
# jobs are inserted (and queued) faster than autovacuum's ANALYZE follows, so
# the planner thought a few rows were queued and chose to fetch every queued
# row, test its labels and sort them: 42 ms with 20,000 legs queued, with the
# run lock held, against 0.1 ms for the index walk. Only the claim: set for
# the whole function, the group functions it calls planned without sorts too,
# and a concurrency group's completion took 270 ms instead of 4.
def _complete_claim_v13() -> str:
    edits = [
        (
            "    c RECORD; g RECORD; leg RECORD; got INT; odd INT;\n",
            "    c RECORD; g RECORD; leg RECORD; got INT; odd INT; sort_was TEXT;\n",
        ),
        (
            "    IF p_limit > 0 THEN\n",
            "    IF p_limit > 0 THEN\n"
            "        sort_was := current_setting('enable_sort');\n"
            "        PERFORM set_config('enable_sort', 'off', true);\n",
        ),
        (
            "        END IF;\n    END IF;\n    RETURN QUERY SELECT v_settled, v_claimed, waited;\n",
            "        END IF;\n        PERFORM set_config('enable_sort', sort_was, true);\n"
            "    END IF;\n    RETURN QUERY SELECT v_settled, v_claimed, waited;\n",
        ),
        (
            "RETURNS TABLE (settled JSON, claimed JSON, wait_us BIGINT)",
            "RETURNS TABLE (settled JSON, claimed JSON, wait_us BIGINT, hold_us BIGINT)",
        ),
        (
            "    RETURN QUERY SELECT v_settled, v_claimed, waited;\n",
            "    RETURN QUERY SELECT v_settled, v_claimed, waited, CASE WHEN n > 0 THEN\n"
            "        (extract(epoch FROM clock_timestamp() - t0) * 1000000)::BIGINT - waited\n"
            "        ELSE 0 END;\n",
        ),
    ]
    text = _COMPLETE_CLAIM_V12
    return _edited(text, edits)


_V13_HOLD_MEASURED: list[Statement] = [
    {
        "pg": "DROP FUNCTION IF EXISTS preloop_complete_claim(BIGINT, TEXT[], TEXT[], TEXT[], "
        "TEXT[], DOUBLE PRECISION, TEXT, TEXT[], INT, DOUBLE PRECISION, BIGINT, BIGINT)",
        "lite": None,
    },
    {"pg": _complete_claim_v13(), "lite": None},
]


# Migration 14, PostgreSQL only: `preloop_complete_claim` holds the run row's
# lock only for the batch's cascade, not for its per-job writes. It ends the
# batch's jobs first (each row is this runner's, lease-guarded, so no other
# writer of the batch path contends for it) and, when none of them held a
# cohort slot or a concurrency group (so the cascade cannot queue a job the
# claim would have to see), claims before taking the run row too (`SKIP
# LOCKED`, never waiting). Then it takes the run row, waiting at most
# `lock_timeout` (`COMPLETE_LOCK_WAIT`): a transaction that holds a run row and waits
# for one of those job rows (cancelling a run, fail-fast, the reaper) would
# otherwise wait on us while we wait on it. On that timeout (SQLSTATE 55P03)
# the statement undoes itself and the store reruns it with `p_lock_first`
# (migration 17 raises that as SQLSTATE PLLCK),
# which takes the run row before anything else, as migration 13 did. Under
# the run row: the run's and the units' counters, the outputs limit,
# released groups, freed slots, and the claim when it had to wait for them.
_COMPLETE_CLAIM_V14 = """CREATE OR REPLACE FUNCTION preloop_complete_claim(
    p_run BIGINT, p_jobs TEXT[], p_conclusions TEXT[], p_outputs TEXT[], p_tokens TEXT[],
    p_now DOUBLE PRECISION, p_runner TEXT, p_labels TEXT[], p_limit INT,
    p_expires DOUBLE PRECISION, p_only_run BIGINT, p_outputs_max BIGINT,
    p_lock_first BOOLEAN)
RETURNS TABLE (settled JSON, claimed JSON, wait_us BIGINT, hold_us BIGINT)
LANGUAGE plpgsql AS $fn$
DECLARE
    n INT := coalesce(cardinality(p_jobs), 0);
    t0 TIMESTAMPTZ; t1 TIMESTAMPTZ;
    waited BIGINT := 0;
    left_jobs INT;
    n_done INT; n_slow INT; n_ended INT; n_multi INT; n_cancelled INT;
    v_settled JSON; v_units JSON; v_slots JSON; v_groups JSON; v_claimed JSON;
    claim_later BOOLEAN := false;
    c RECORD; g RECORD; leg RECORD; got INT; lock_was TEXT;
BEGIN
    IF n > 0 AND p_lock_first THEN
        t0 := clock_timestamp();
        PERFORM 1 FROM runs WHERE id = p_run FOR UPDATE;
        t1 := clock_timestamp();
    END IF;
    IF n > 0 THEN
        WITH i AS (
            SELECT * FROM unnest(p_jobs, p_conclusions, p_outputs, p_tokens)
                AS i(id, conclusion, outputs, token)
        ), d AS (
            UPDATE jobs j SET status = 'completed',
                conclusion = CASE WHEN j.cancel_requested = 1 AND i.conclusion <> 'skipped'
                                  THEN 'cancelled' ELSE i.conclusion END,
                outputs = i.outputs, completed_at = p_now, lease_token = NULL
            FROM i
            WHERE j.run_id = p_run AND j.id = i.id AND j.status = 'running'
              AND j.lease_token = i.token
            RETURNING j.id, j.base_id, j.cohort, j.kind, j.holds_slot, j.holds_group,
                j.continue_on_error, j.anc_fail, j.anc_bad, j.conclusion, i.outputs
        ), e AS (
            SELECT d.*, CASE WHEN d.conclusion = 'failure' AND d.continue_on_error = 1
                             THEN 'success' ELSE d.conclusion END AS eff FROM d
        ), a AS (
            SELECT base_id, count(*) AS cnt,
                count(*) FILTER (WHERE eff = 'success') AS ns,
                count(*) FILTER (WHERE eff = 'cancelled') AS nc,
                count(*) FILTER (WHERE eff NOT IN ('success', 'failure', 'cancelled')) AS nk,
                max(anc_fail) AS af, max(anc_bad) AS ab,
                count(*) FILTER (WHERE outputs <> '{{}}') AS n_out,
                max(outputs) FILTER (WHERE outputs <> '{{}}') AS outs
            FROM e GROUP BY base_id
        )
        SELECT (SELECT count(*) FROM e),
               (SELECT count(*) FROM e WHERE kind <> 'job' OR eff = 'failure'),
               (SELECT count(*) FROM a WHERE n_out > 1),
               (SELECT count(*) FROM e WHERE eff = 'cancelled'),
               (SELECT json_agg(json_build_array(id, conclusion)) FROM e),
               (SELECT json_agg(a) FROM a),
               (SELECT json_agg(s) FROM (SELECT cohort, count(*) AS freed FROM e
                                          WHERE holds_slot = 1 GROUP BY cohort) s),
               (SELECT json_agg(json_build_object('job', id, 'grp', holds_group)
                                ORDER BY id) FROM e WHERE holds_group IS NOT NULL)
          INTO n_done, n_slow, n_multi, n_cancelled, v_settled, v_units, v_slots, v_groups;
        IF n_done < n OR n_slow > 0 OR n_multi > 0 THEN
            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
        END IF;
        -- A freed slot or a released group may queue a job: the claim must see it.
        claim_later := v_slots IS NOT NULL OR v_groups IS NOT NULL;
    END IF;
    IF p_limit > 0 AND NOT claim_later THEN
        v_claimed := preloop_claim(p_runner, p_labels, p_limit, p_now, p_expires, p_only_run);
    END IF;
    IF n > 0 THEN
        IF NOT p_lock_first THEN
            lock_was := current_setting('lock_timeout');
            PERFORM set_config('lock_timeout', '@LOCK_WAIT@', true);
            t0 := clock_timestamp();
        END IF;
        UPDATE runs SET remaining_jobs = remaining_jobs - n,
                cancelled_jobs = cancelled_jobs + n_cancelled
            WHERE id = p_run RETURNING remaining_jobs INTO left_jobs;
        IF NOT p_lock_first THEN
            t1 := clock_timestamp();
            PERFORM set_config('lock_timeout', lock_was, true);
        END IF;
        IF NOT FOUND OR left_jobs <= 0 THEN
            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
        END IF;
        waited := (extract(epoch FROM t1 - t0) * 1000000)::BIGINT;
        WITH u AS (
            UPDATE units SET remaining = units.remaining - a.cnt,
                n_success = units.n_success + a.ns,
                n_cancelled = units.n_cancelled + a.nc,
                n_skipped = units.n_skipped + a.nk,
                anc_fail = GREATEST(units.anc_fail, a.af),
                anc_bad = GREATEST(units.anc_bad, a.ab),
                outputs = CASE WHEN a.outs IS NULL THEN units.outputs
                               ELSE (units.outputs::JSONB || a.outs::JSONB)::TEXT END
            FROM json_to_recordset(v_units) AS a(base_id TEXT, cnt INT, ns INT, nc INT,
                                                 nk INT, af INT, ab INT, outs TEXT)
            WHERE units.run_id = p_run AND units.base_id = a.base_id
            RETURNING units.remaining
        )
        SELECT count(*) FILTER (WHERE remaining <= 0) INTO n_ended FROM u;
        IF n_ended > 0 THEN
            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
        END IF;
        IF p_outputs_max IS NOT NULL
           AND EXISTS (SELECT 1 FROM unnest(p_outputs) AS o(v) WHERE o.v <> '{{}}')
           AND (SELECT coalesce(sum(length(outputs)), 0) FROM jobs WHERE run_id = p_run)
               > p_outputs_max THEN
            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
        END IF;
        -- A group a job held goes to its oldest waiter (as the cascade's
        -- release_group), before freed slots admit parked legs.
        FOR g IN SELECT x.job, x.grp
                   FROM json_to_recordset(coalesce(v_groups, '[]'::JSON)) AS x(job TEXT, grp TEXT)
        LOOP
            UPDATE conc_groups SET holder_run = NULL, holder_job = NULL
                WHERE name = g.grp AND holder_run = p_run AND holder_job = g.job;
            IF FOUND THEN
                PERFORM preloop_promote_group(p_run, g.grp);
            END IF;
        END LOOP;
        FOR c IN SELECT x.cohort, x.freed
                   FROM json_to_recordset(coalesce(v_slots, '[]'::JSON))
                     AS x(cohort TEXT, freed INT)
        LOOP
            got := 0;
            FOR leg IN SELECT p.id, p.kind, p.conc_group, p.conc_group_expr, p.conc_cancel,
                              p.conc_queue_max
                         FROM jobs p WHERE p.run_id = p_run AND p.cohort = c.cohort
                          AND p.status = 'parked' ORDER BY p.seq LIMIT c.freed
            LOOP
                got := got + 1;
                IF leg.kind <> 'job' OR leg.conc_group_expr IS NOT NULL
                   OR leg.conc_cancel = 1 THEN
                    RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
                END IF;
                IF leg.conc_group IS NULL THEN
                    UPDATE jobs SET status = 'queued', holds_slot = 1
                        WHERE run_id = p_run AND id = leg.id;
                ELSE
                    PERFORM preloop_through_group(p_run, leg.id, leg.conc_group,
                                                  leg.conc_queue_max);
                END IF;
            END LOOP;
            IF got < c.freed THEN
                UPDATE cohorts SET active = active - (c.freed - got)
                    WHERE run_id = p_run AND id = c.cohort;
            END IF;
        END LOOP;
    END IF;
    IF p_limit > 0 AND claim_later THEN
        v_claimed := preloop_claim(p_runner, p_labels, p_limit, p_now, p_expires, p_only_run);
    END IF;
    RETURN QUERY SELECT v_settled, v_claimed, waited, CASE WHEN n > 0 THEN
        (extract(epoch FROM clock_timestamp() - t1) * 1000000)::BIGINT ELSE 0 END;
END
$fn$"""

# The claim of migration 13's `preloop_complete_claim`, as its own function:
# up to `p_limit` queued jobs whose labels `p_labels` cover, in (run, seq)
# order, `FOR UPDATE SKIP LOCKED` (never waiting), walking `jobs_queued` in
# order (`enable_sort` off for this statement only: see migration 13).
_CLAIM_FN = """CREATE OR REPLACE FUNCTION preloop_claim(
    p_runner TEXT, p_labels TEXT[], p_limit INT, p_now DOUBLE PRECISION,
    p_expires DOUBLE PRECISION, p_only_run BIGINT)
RETURNS JSON LANGUAGE plpgsql AS $fn$
DECLARE
    v_claimed JSON; sort_was TEXT;
BEGIN
    sort_was := current_setting('enable_sort');
    PERFORM set_config('enable_sort', 'off', true);
    IF p_only_run IS NULL THEN
        WITH q AS (
            SELECT j.run_id, j.id FROM jobs j
            WHERE j.status = 'queued' AND NOT EXISTS (
                SELECT 1 FROM json_array_elements_text(j.runs_on::JSON) AS l(v)
                WHERE l.v <> ALL (p_labels))
            ORDER BY j.run_id, j.seq LIMIT p_limit FOR UPDATE SKIP LOCKED
        ), w AS (
            UPDATE jobs j SET status = 'running', runner = p_runner,
                lease_token = replace(gen_random_uuid()::TEXT, '-', ''),
                lease_expires = p_expires, started_at = p_now, attempt = j.attempt + 1
            FROM q WHERE j.run_id = q.run_id AND j.id = q.id
            RETURNING j.run_id, j.id, j.seq, j.name, j.attempt, j.spec, j.matrix,
                j.strategy, j.timeout_minutes, j.lease_token
        )
        SELECT json_agg(w ORDER BY w.run_id, w.seq) INTO v_claimed FROM w;
    ELSE
        WITH q AS (
            SELECT j.run_id, j.id FROM jobs j
            WHERE j.status = 'queued' AND j.run_id = p_only_run AND NOT EXISTS (
                SELECT 1 FROM json_array_elements_text(j.runs_on::JSON) AS l(v)
                WHERE l.v <> ALL (p_labels))
            ORDER BY j.run_id, j.seq LIMIT p_limit FOR UPDATE SKIP LOCKED
        ), w AS (
            UPDATE jobs j SET status = 'running', runner = p_runner,
                lease_token = replace(gen_random_uuid()::TEXT, '-', ''),
                lease_expires = p_expires, started_at = p_now, attempt = j.attempt + 1
            FROM q WHERE j.run_id = q.run_id AND j.id = q.id
            RETURNING j.run_id, j.id, j.seq, j.name, j.attempt, j.spec, j.matrix,
                j.strategy, j.timeout_minutes, j.lease_token
        )
        SELECT json_agg(w ORDER BY w.run_id, w.seq) INTO v_claimed FROM w;
    END IF;
    PERFORM set_config('enable_sort', sort_was, true);
    RETURN v_claimed;
END
$fn$"""

#: How long the batch path waits for its run row after writing its jobs
#: before it undoes itself and reruns taking the run row first (migration 14).
COMPLETE_LOCK_WAIT = "50ms"

_V14_LOCK_LATE: list[Statement] = [
    {
        "pg": "DROP FUNCTION IF EXISTS preloop_complete_claim(BIGINT, TEXT[], TEXT[], TEXT[], "
        "TEXT[], DOUBLE PRECISION, TEXT, TEXT[], INT, DOUBLE PRECISION, BIGINT, BIGINT)",
        "lite": None,
    },
    {"pg": _CLAIM_FN, "lite": None},
    {"pg": _COMPLETE_CLAIM_V14.replace("@LOCK_WAIT@", COMPLETE_LOCK_WAIT), "lite": None},
]


# Migration 15, PostgreSQL only: the claim returns each job's spec, matrix and
# strategy as JSON values inside its answer, not as JSON text in JSON, so the
# store decodes one document per batch instead of three more per job.
def _claim_v15() -> str:
    old = "RETURNING j.run_id, j.id, j.seq, j.name, j.attempt, j.spec, j.matrix,\n"
    new = (
        "RETURNING j.run_id, j.id, j.seq, j.name, j.attempt, j.spec::JSON AS spec,\n"
        "                j.matrix::JSON AS matrix,\n"
    )
    text = _CLAIM_FN
    text = _edited(text, [(old, new)], times=2)
    old = "                j.strategy, j.timeout_minutes, j.lease_token\n"
    new = "                j.strategy::JSON AS strategy, j.timeout_minutes, j.lease_token\n"
    return _edited(text, [(old, new)], times=2)


_V15_CLAIM_JSON: list[Statement] = [{"pg": _claim_v15(), "lite": None}]


# Migration 16, PostgreSQL only: the slots a batch frees go to the next parked
# plain legs in one write, by the row addresses the read of the parked legs
# returned (the run row is held, and parked rows change only under it, so
# they stay put until commit). Written one by one by run and id, the planner,
# without statistics on a run's fresh rows, could look each leg up through
# `jobs_run_status` (every row of the run) instead of the primary key.
def _complete_claim_v16() -> str:
    edits = [
        (
            "    c RECORD; g RECORD; leg RECORD; got INT; lock_was TEXT;\n",
            "    c RECORD; g RECORD; leg RECORD; got INT; lock_was TEXT; tids TID[];\n",
        ),
        (
            "            got := 0;\n            FOR leg IN SELECT p.id, p.kind,",
            "            got := 0;\n            tids := '{{}}';\n"
            "            FOR leg IN SELECT p.ctid AS tid, p.id, p.kind,",
        ),
        (
            "                IF leg.conc_group IS NULL THEN\n"
            "                    UPDATE jobs SET status = 'queued', holds_slot = 1\n"
            "                        WHERE run_id = p_run AND id = leg.id;\n",
            "                IF leg.conc_group IS NULL THEN\n"
            "                    tids := tids || leg.tid;\n",
        ),
        (
            "            END LOOP;\n            IF got < c.freed THEN\n",
            "            END LOOP;\n"
            "            IF cardinality(tids) > 0 THEN\n"
            "                UPDATE jobs SET status = 'queued', holds_slot = 1\n"
            "                    WHERE ctid = ANY (tids);\n"
            "            END IF;\n"
            "            IF got < c.freed THEN\n",
        ),
    ]
    text = _COMPLETE_CLAIM_V14
    text = _edited(text, edits)
    return text.replace("@LOCK_WAIT@", COMPLETE_LOCK_WAIT)


_V16_SLOTS_AT_ONCE: list[Statement] = [{"pg": _complete_claim_v16(), "lite": None}]


# Migration 17, PostgreSQL only: the batch's wait for its run row running out
# is raised as SQLSTATE PLLCK, not as the server's lock timeout (55P03), so
# the store tells it from a lock timeout of the database's own settings on
# every path (a retry after a lost connection runs the call in a transaction,
# which reports those as errors).
def _complete_claim_v17() -> str:
    old = (
        "        UPDATE runs SET remaining_jobs = remaining_jobs - n,\n"
        "                cancelled_jobs = cancelled_jobs + n_cancelled\n"
        "            WHERE id = p_run RETURNING remaining_jobs INTO left_jobs;\n"
    )
    new = (
        "        IF p_lock_first THEN\n"
        "            UPDATE runs SET remaining_jobs = remaining_jobs - n,\n"
        "                    cancelled_jobs = cancelled_jobs + n_cancelled\n"
        "                WHERE id = p_run RETURNING remaining_jobs INTO left_jobs;\n"
        "        ELSE\n"
        "            BEGIN\n"
        "                UPDATE runs SET remaining_jobs = remaining_jobs - n,\n"
        "                        cancelled_jobs = cancelled_jobs + n_cancelled\n"
        "                    WHERE id = p_run RETURNING remaining_jobs INTO left_jobs;\n"
        "            EXCEPTION WHEN lock_not_available THEN\n"
        "                RAISE EXCEPTION 'preloop: run row busy' USING ERRCODE = 'PLLCK';\n"
        "            END;\n"
        "        END IF;\n"
    )
    text = _complete_claim_v16()
    return _edited(text, [(old, new)])


_V17_LOCK_BUSY: list[Statement] = [{"pg": _complete_claim_v17(), "lite": None}]


# Migration 18, PostgreSQL only: migration 15 undone. A job's spec, matrix and
# strategy are the JSON text Python wrote, which may hold numbers JSON has no
# literal for (`Infinity`, a `timeout-minutes` too big for a float): cast to
# PostgreSQL's JSON they failed the claim. They come back as text again.
_V18_CLAIM_TEXT: list[Statement] = [{"pg": _CLAIM_FN, "lite": None}]


# Migration 19, PostgreSQL only: a batch whose jobs are the last of their unit
# (a need: a plain job, or every leg of a matrix) ends the unit itself when the
# unit succeeded with clean ancestry in a run not being cancelled and every
# dependent still blocked is a plain job (no `if`, no concurrency group, no
# max-parallel cap): it decrements their needs and queues those this was the
# last need of, as the Python cascade's `_do_end_unit` does on that path. Any
# other unit end is still the Python cascade's (PLSLO, nothing written).
#
# The dependents are written before the run row is taken, like the batch's own
# jobs (migration 14): a need that admits 20,000 legs no longer holds the run
# row for the ~0.4 s the cascade's transaction did. That the unit ends is read
# before the lock (its remaining members are this batch's jobs, whose rows the
# batch holds, so no other transaction can end them) and checked again under
# it: the unit's counters as updated, and the run's `cancel_requested`; on any
# difference the statement undoes itself (PLSLO) and the cascade does it. A
# dependent row another transaction holds is waited for at most
# COMPLETE_LOCK_WAIT (then PLLCK: rerun with the run row first).
#
# The queued-job trigger fires once per row (a PL/pgSQL call each, 70 ms for
# 20,000 legs); for this write it is switched off by a transaction-local
# setting its WHEN clause reads, and the function sends the one notification.
#
# Any other unit end (or the run's) raises PLSLO with the message ending in
# ": a unit ends". The store then calls the function again in its cascade mode
# (`p_cascade`), inside the transaction that runs the Python cascade, taking
# the run row first: it writes the batch's jobs, counters, freed slots and
# groups in that one call and returns the run row and the units that ended,
# which the cascade takes from there (before, the cascade settled the batch
# one `preloop_settle` call per job, all of them with the run row held).
_NOTIFY_QUIET = "current_setting('preloop.queued_notified', true) IS DISTINCT FROM 'on'"

_END_UNITS = """        -- Units this batch ends, admitted here when clean (migration 19).
        SELECT array_agg(u.base_id),
               count(*) FILTER (WHERE NOT (u.caller IS NULL AND u.n_failure = 0
                   AND u.n_cancelled + a.nc = 0 AND u.n_success + a.ns > 0
                   AND GREATEST(u.anc_fail, a.af) = 0 AND GREATEST(u.anc_bad, a.ab) = 0))
          INTO v_ending, n_unclean
          FROM units u
          JOIN json_to_recordset(v_units) AS a(base_id TEXT, cnt INT, ns INT, nc INT,
                                               af INT, ab INT)
            ON u.base_id = a.base_id
         WHERE u.run_id = p_run AND u.remaining = a.cnt AND NOT p_cascade;
        IF v_ending IS NOT NULL THEN
            -- Hash joins: without statistics on the run's fresh rows the planner
            -- would look up each dependent by walking every blocked job of the run.
            loop_was := current_setting('enable_nestloop');
            PERFORM set_config('enable_nestloop', 'off', true);
        END IF;
        IF n_unclean > 0 OR (v_ending IS NOT NULL AND EXISTS (
                SELECT 1 FROM runs WHERE id = p_run AND cancel_requested <> 0))
           OR (v_ending IS NOT NULL AND EXISTS (
                SELECT 1 FROM deps d JOIN jobs j ON j.run_id = p_run AND j.id = d.job_id
                 WHERE d.run_id = p_run AND d.need = ANY (v_ending) AND j.status = 'blocked'
                   AND NOT (j.kind = 'job' AND j.if_expr IS NULL AND j.anc_fail = 0
                            AND j.anc_bad = 0 AND j.conc_group IS NULL
                            AND j.conc_group_expr IS NULL AND j.capped = 0))) THEN
            RAISE EXCEPTION 'preloop: slow path: a unit ends' USING ERRCODE = 'PLSLO';
        END IF;
        IF v_ending IS NOT NULL THEN
            IF NOT p_lock_first THEN
                lock_was := current_setting('lock_timeout');
                PERFORM set_config('lock_timeout', '@LOCK_WAIT@', true);
            END IF;
            BEGIN
                PERFORM set_config('preloop.queued_notified', 'on', true);
                WITH x AS MATERIALIZED (
                    SELECT d.job_id, count(*)::INT AS k FROM deps d
                     WHERE d.run_id = p_run AND d.need = ANY (v_ending) GROUP BY d.job_id
                ), w AS (
                    UPDATE jobs j SET remaining_needs = j.remaining_needs - x.k,
                        status = CASE WHEN j.remaining_needs = x.k AND j.kind = 'job'
                                           AND j.if_expr IS NULL AND j.anc_fail = 0
                                           AND j.anc_bad = 0 AND j.conc_group IS NULL
                                           AND j.conc_group_expr IS NULL AND j.capped = 0
                                      THEN 'queued' ELSE j.status END
                      FROM x WHERE j.run_id = p_run AND j.id = x.job_id
                       AND j.status = 'blocked'
                    RETURNING j.status, j.remaining_needs
                )
                SELECT count(*) FILTER (WHERE w.status = 'queued'),
                       count(*) FILTER (WHERE w.status <> 'queued' AND w.remaining_needs <= 0)
                  INTO n_queued, n_unclean FROM w;
                PERFORM set_config('preloop.queued_notified', '', true);
            EXCEPTION WHEN lock_not_available THEN
                IF p_lock_first THEN
                    RAISE;
                END IF;
                RAISE EXCEPTION 'preloop: run row busy' USING ERRCODE = 'PLLCK';
            END;
            IF NOT p_lock_first THEN
                PERFORM set_config('lock_timeout', lock_was, true);
            END IF;
            -- A dependent that changed since the check (another need ended at
            -- once) and now needs a gate: the cascade's.
            IF n_unclean > 0 THEN
                RAISE EXCEPTION 'preloop: slow path: a unit ends' USING ERRCODE = 'PLSLO';
            END IF;
            PERFORM set_config('enable_nestloop', loop_was, true);
            IF n_queued > 0 THEN
                PERFORM pg_notify('preloop_jobs', '');
            END IF;
        END IF;
"""


def _complete_claim_v19() -> str:
    edits = [
        (
            "    c RECORD; g RECORD; leg RECORD; got INT; lock_was TEXT; tids TID[];\n",
            "    c RECORD; g RECORD; leg RECORD; got INT; lock_was TEXT; tids TID[];\n"
            "    v_ending TEXT[]; n_unclean INT; n_queued INT; run_cancel INT; loop_was TEXT;\n",
        ),
        (
            "        claim_later := v_slots IS NOT NULL OR v_groups IS NOT NULL;\n",
            "        claim_later := v_slots IS NOT NULL OR v_groups IS NOT NULL;\n"
            + _END_UNITS.replace("@LOCK_WAIT@", COMPLETE_LOCK_WAIT),
        ),
        (
            "            RETURNING units.remaining\n        )\n"
            "        SELECT count(*) FILTER (WHERE remaining <= 0) INTO n_ended FROM u;\n",
            "            RETURNING units.*\n        )\n"
            "        -- Ended units: exactly those admitted above, as clean as they were read.\n"
            "        SELECT count(*) FILTER (WHERE (u.remaining <= 0) IS DISTINCT FROM (\n"
            "                   u.base_id = ANY (coalesce(v_ending, '{{}}')) AND u.caller IS NULL\n"
            "                   AND u.n_failure = 0 AND u.n_cancelled = 0 AND u.n_success > 0\n"
            "                   AND u.anc_fail = 0 AND u.anc_bad = 0))\n"
            "          INTO n_ended FROM u;\n",
        ),
        (
            "        IF n_ended > 0 THEN\n",
            "        IF n_ended > 0 OR (v_ending IS NOT NULL AND run_cancel <> 0) THEN\n",
        ),
        (
            "        IF n_ended > 0 OR (v_ending IS NOT NULL AND run_cancel <> 0) THEN\n"
            "            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';\n"
            "        END IF;\n",
            "        IF n_ended > 0 OR (v_ending IS NOT NULL AND run_cancel <> 0) THEN\n"
            "            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';\n"
            "        END IF;\n"
            "        IF v_ending IS NOT NULL THEN\n"
            "            UPDATE units SET result = 'success'\n"
            "                WHERE run_id = p_run AND base_id = ANY (v_ending);\n"
            "        END IF;\n",
        ),
    ]
    edits += [
        (
            "    p_lock_first BOOLEAN)\n"
            "RETURNS TABLE (settled JSON, claimed JSON, wait_us BIGINT, hold_us BIGINT)\n",
            "    p_lock_first BOOLEAN, p_cascade BOOLEAN DEFAULT false)\n"
            "RETURNS TABLE (settled JSON, claimed TEXT, wait_us BIGINT, hold_us BIGINT,\n"
            "               run_row JSON, ended JSON)\n",
        ),
        (
            "    v_settled JSON; v_units JSON; v_slots JSON; v_groups JSON; v_claimed JSON;\n",
            "    v_settled JSON; v_units JSON; v_slots JSON; v_groups JSON; v_claimed TEXT;\n"
            "    v_run JSON; v_ended JSON;\n",
        ),
        (
            "        IF NOT FOUND OR left_jobs <= 0 THEN\n"
            "            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';\n",
            "        IF NOT FOUND THEN\n"
            "            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';\n"
            "        END IF;\n"
            "        IF left_jobs <= 0 AND NOT p_cascade THEN\n"
            "            RAISE EXCEPTION 'preloop: slow path: a unit ends'\n"
            "                USING ERRCODE = 'PLSLO';\n",
        ),
        (
            "          INTO n_ended FROM u;\n",
            "                 , json_agg(u) FILTER (WHERE u.remaining <= 0)\n"
            "          INTO n_ended, v_ended FROM u;\n",
        ),
        (
            "        IF n_ended > 0 OR (v_ending IS NOT NULL AND run_cancel <> 0) THEN\n",
            "        IF (n_ended > 0 AND NOT p_cascade)\n"
            "           OR (v_ending IS NOT NULL AND run_cancel <> 0) THEN\n"
            "            RAISE EXCEPTION 'preloop: slow path: a unit ends'\n"
            "                USING ERRCODE = 'PLSLO';\n",
        ),
        (
            "    RETURN QUERY SELECT v_settled, v_claimed, waited, CASE WHEN n > 0 THEN\n"
            "        (extract(epoch FROM clock_timestamp() - t1) * 1000000)::BIGINT ELSE 0 END;\n",
            "    IF p_cascade THEN\n"
            "        SELECT row_to_json(r) INTO v_run FROM (\n"
            "            SELECT id, status, cancel_requested, conc_group, remaining_jobs,\n"
            "                   failed_jobs, cancelled_jobs FROM runs WHERE id = p_run) r;\n"
            "    END IF;\n"
            "    RETURN QUERY SELECT v_settled, v_claimed, waited, CASE WHEN n > 0 THEN\n"
            "        (extract(epoch FROM clock_timestamp() - t1) * 1000000)::BIGINT ELSE 0 END,\n"
            "        v_run, v_ended;\n",
        ),
    ]
    edits.append(
        (
            "                    PERFORM preloop_through_group(p_run, leg.id, leg.conc_group,\n"
            "                                                  leg.conc_queue_max);\n",
            "                    PERFORM preloop_through_group(p_run, leg.id, leg.conc_group,\n"
            "                                                  leg.conc_queue_max, leg.tid);\n",
        )
    )
    text = _complete_claim_v17()
    text = _edited(text, edits)
    old = "WHERE id = p_run RETURNING remaining_jobs INTO left_jobs;\n"
    new = (
        "WHERE id = p_run RETURNING remaining_jobs, cancel_requested\n"
        "                INTO left_jobs, run_cancel;\n"
    )
    return _edited(text, [(old, new)], times=2)


# Migration 19 also has the claim write the rows it locked by their address
# (`ctid`, stable while it holds them). Joined back by run and id, the planner
# without statistics on a run's fresh rows could look each one up through
# `jobs_run_status`, a pass over the run's rows per claimed job. And the claim
# answers one JSON text, `[[run_id, id, seq, name, attempt, timeout_minutes,
# lease_token], spec, matrix, strategy]` per job, with the spec, matrix and
# strategy texts Python wrote embedded as they are (never cast to PostgreSQL's
# JSON, which refuses `Infinity`: migration 18), so the store decodes one
# document per batch instead of one more per field per job.
def _claim_v19() -> str:
    text = _CLAIM_FN
    text = _edited(
        text,
        [
            ("RETURNS JSON LANGUAGE plpgsql AS $fn$\n", "RETURNS TEXT LANGUAGE plpgsql AS $fn$\n"),
            ("    v_claimed JSON; sort_was TEXT;\n", "    v_claimed TEXT; sort_was TEXT;\n"),
        ],
    )
    return _edited(
        text,
        [
            (
                "        SELECT json_agg(w ORDER BY w.run_id, w.seq) INTO v_claimed FROM w;\n",
                "        SELECT '[' || string_agg('[' || json_build_array(w.run_id, w.id, w.seq,\n"
                "                   w.name, w.attempt, w.timeout_minutes, w.lease_token)::TEXT\n"
                "                   || ',' || w.spec || ',' || coalesce(w.matrix, 'null')\n"
                "                   || ',' || coalesce(w.strategy, 'null') || ']',\n"
                "                   ',' ORDER BY w.run_id, w.seq) || ']'\n"
                "          INTO v_claimed FROM w;\n",
            ),
            (
                "            SELECT j.run_id, j.id FROM jobs j\n",
                "            SELECT j.ctid AS tid FROM jobs j\n",
            ),
            (
                "            FROM q WHERE j.run_id = q.run_id AND j.id = q.id\n",
                "            FROM q WHERE j.ctid = q.tid\n",
            ),
        ],
        times=2,
    )


# Migration 19, last: the group functions take the job rows they write by
# address too. `preloop_promote_group` picks the group's oldest waiter by
# walking `jobs_waiting` (and `runs_waiting`) in `wait_seq` order for one row
# instead of sorting every waiter, and writes it by the `ctid` that read
# returned; `preloop_through_group` gets the parked leg's `ctid` from the
# batch's read of its parked legs (the run row is held: those rows stay put).
# By run and id, the planner without statistics on a run's fresh rows looked
# the leg up through `jobs_run_status`, a pass over the run's rows per leg.
def _promote_group_v19() -> str:
    edits = [
        (
            """    SELECT q.run_id, q.id, q.is_run INTO w FROM (
        SELECT run_id, id, wait_seq, 0 AS is_run FROM jobs
            WHERE conc_group = p_group AND status = 'waiting'
        UNION ALL SELECT id, NULL, wait_seq, 1 FROM runs
            WHERE conc_group = p_group AND status = 'pending') q
        ORDER BY q.wait_seq LIMIT 1;
""",
            """    SELECT q.run_id, q.id, q.is_run, q.tid INTO w FROM (
        (SELECT run_id, id, wait_seq, 0 AS is_run, ctid AS tid FROM jobs
            WHERE conc_group = p_group AND status = 'waiting' ORDER BY wait_seq LIMIT 1)
        UNION ALL (SELECT id, NULL, wait_seq, 1, NULL::TID FROM runs
            WHERE conc_group = p_group AND status = 'pending' ORDER BY wait_seq LIMIT 1)) q
        ORDER BY q.wait_seq LIMIT 1;
""",
        ),
        (
            "        WHERE run_id = p_run AND id = w.id AND status = 'waiting' AND kind = 'job';\n",
            "        WHERE ctid = w.tid AND run_id = p_run AND id = w.id AND status = 'waiting'\n"
            "          AND kind = 'job';\n",
        ),
    ]
    text = _PROMOTE_GROUP_FN
    return _edited(text, edits)


def _through_group_v19() -> str:
    text = _THROUGH_GROUP_FN.replace("@QUEUE_MAX@", str(QUEUE_MAX))
    edits = [
        (
            "    p_run BIGINT, p_job TEXT, p_group TEXT, p_queue_max INT)\n",
            "    p_run BIGINT, p_job TEXT, p_group TEXT, p_queue_max INT, p_tid TID)\n",
        ),
        (
            "            conc_group = p_group WHERE run_id = p_run AND id = p_job;\n",
            "            conc_group = p_group\n"
            "            WHERE ctid = p_tid AND run_id = p_run AND id = p_job;\n",
        ),
        (
            "        WHERE run_id = p_run AND id = p_job;\n",
            "        WHERE ctid = p_tid AND run_id = p_run AND id = p_job;\n",
        ),
    ]
    return _edited(text, edits)


_V19_END_UNITS: list[Statement] = [
    {"pg": _promote_group_v19(), "lite": None},
    {
        "pg": "DROP FUNCTION IF EXISTS preloop_through_group(BIGINT, TEXT, TEXT, INT)",
        "lite": None,
    },
    {"pg": _through_group_v19(), "lite": None},
    {
        "pg": "DROP FUNCTION IF EXISTS preloop_claim(TEXT, TEXT[], INT, DOUBLE PRECISION, "
        "DOUBLE PRECISION, BIGINT)",
        "lite": None,
    },
    {"pg": _claim_v19(), "lite": None},
    {
        "pg": "DROP FUNCTION IF EXISTS preloop_complete_claim(BIGINT, TEXT[], TEXT[], TEXT[], "
        "TEXT[], DOUBLE PRECISION, TEXT, TEXT[], INT, DOUBLE PRECISION, BIGINT, BIGINT, BOOLEAN)",
        "lite": None,
    },
    {"pg": _complete_claim_v19(), "lite": None},
    {"pg": "DROP TRIGGER IF EXISTS preloop_jobs_queued_update ON jobs", "lite": None},
    {
        "pg": "CREATE TRIGGER preloop_jobs_queued_update AFTER UPDATE OF status ON jobs "
        "FOR EACH ROW WHEN (NEW.status = 'queued' AND OLD.status IS DISTINCT FROM 'queued' "
        f"AND {_NOTIFY_QUIET}) EXECUTE FUNCTION preloop_notify_queued()",
        "lite": None,
    },
]


# Migration 20, PostgreSQL only: a batch that ends a need admits the
# dependents whose `if:` holds whenever their ancestry is clean (`always()`,
# `success()`, `!cancelled()`, `!failure()`, as the planner spells them) the
# way it admits those without one; the cascade's `ready` does the same. A
# merge or report job under `if: always()` no longer sends the unit's end to
# the Python cascade, which held the run row for several ms.
def _complete_claim_v20() -> str:
    text = _complete_claim_v19()
    old = "j.if_expr IS NULL"  # the check before the lock and the write
    return _edited(text, [(old, if_true_when_clean("j.if_expr"))], times=2)


_V20_IF_TRUE_WHEN_CLEAN: list[Statement] = [{"pg": _complete_claim_v20(), "lite": None}]

# Migration 21, PostgreSQL only: whether a run has a job with a concurrency
# group, without reading the run's other jobs. A batch of such a run is
# settled job by job (`Store._pg_cascade`); the index holds grouped jobs only.
_V21_GROUPED_JOBS: list[Statement] = [
    {
        "pg": "CREATE INDEX IF NOT EXISTS jobs_grouped ON jobs (run_id) "
        "WHERE conc_group IS NOT NULL OR conc_group_expr IS NOT NULL",
        "lite": None,
    }
]

# Migration 22, PostgreSQL only: the batch does more of what migration 19 left
# to the Python cascade, each of which was a transaction of its own holding the
# run row for several ms.
# - A unit that ends only under the run row (another batch of the run committed
#   its other jobs while this one wrote its own: the usual end of a matrix two
#   runners share) is admitted there by migration 19's rule when it ended
#   clean, and the runner's capacity left after its first claim claims what
#   that queued (`preloop_claim` says how many it took in `preloop.claimed`).
# - A batch whose jobs are the run's last concludes the run (as the cascade's
#   `end_run`), unless a workflow-level concurrency group waits on the run.
# - Both admissions take the legs of a max-parallel matrix too (parked, then
#   the cap's worth queued), as the cascade's `end_unit` and `fill_cohort` do.
# - The function plans its statements once per connection
#   (`plan_cache_mode = force_generic_plan`) instead of on each of its first
#   five calls: a fresh runner's batches held the run row while planning.
_CLEAN_UNIT = (
    "u.caller IS NULL AND u.n_failure = 0 AND u.n_cancelled = 0 AND u.n_success > 0 "
    "AND u.anc_fail = 0 AND u.anc_bad = 0"
)


def _complete_claim_v22() -> str:
    text = _complete_claim_v20()
    start = text.index("                WITH x AS MATERIALIZED (")
    end_mark = "INTO n_queued, n_unclean FROM w;\n"
    admit = text[start : text.index(end_mark, start) + len(end_mark)]
    plain_start = text.index("                SELECT 1 FROM deps d JOIN jobs j")
    plain = text[plain_start : text.index(")) THEN\n", plain_start) + 1]
    assert admit.count("ANY (v_ending)") == 1 and plain.count("ANY (v_ending)") == 1
    check_start = text.index("        IF n_unclean > 0 OR (v_ending IS NOT NULL AND EXISTS (\n")
    check_end = text.index("        END IF;\n", check_start) + len("        END IF;\n")
    edits = [
        # A plan is made once per connection (below), with the planner
        # settings of the call that first runs the statement: the checks
        # that want hash joins run only where they are switched on.
        (
            text[check_start:check_end],
            """        IF n_unclean > 0 THEN
            RAISE EXCEPTION 'preloop: slow path: a unit ends' USING ERRCODE = 'PLSLO';
        END IF;
        IF v_ending IS NOT NULL THEN
            IF EXISTS (SELECT 1 FROM runs WHERE id = p_run AND cancel_requested <> 0)
               OR EXISTS (
"""
            + "".join("    " + line for line in plain.splitlines(True))
            + """ THEN
                RAISE EXCEPTION 'preloop: slow path: a unit ends' USING ERRCODE = 'PLSLO';
            END IF;
        END IF;
""",
        ),
        (
            "    v_ending TEXT[]; n_unclean INT;",
            "    v_late TEXT[]; v_more TEXT; n_claimed INT; v_ending TEXT[]; n_unclean INT;",
        ),
        (
            "        IF left_jobs <= 0 AND NOT p_cascade THEN\n",
            "        IF left_jobs <= 0 AND NOT p_cascade AND EXISTS (\n"
            "                SELECT 1 FROM runs WHERE id = p_run\n"
            "                   AND conc_group IS NOT NULL) THEN\n",
        ),
        (
            """        SELECT count(*) FILTER (WHERE (u.remaining <= 0) IS DISTINCT FROM (
                   u.base_id = ANY (coalesce(v_ending, '{{}}')) AND u.caller IS NULL
                   AND u.n_failure = 0 AND u.n_cancelled = 0 AND u.n_success > 0
                   AND u.anc_fail = 0 AND u.anc_bad = 0))
                 , json_agg(u) FILTER (WHERE u.remaining <= 0)
          INTO n_ended, v_ended FROM u;
        IF (n_ended > 0 AND NOT p_cascade)
           OR (v_ending IS NOT NULL AND run_cancel <> 0) THEN
            RAISE EXCEPTION 'preloop: slow path: a unit ends'
                USING ERRCODE = 'PLSLO';
            RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
""",
            f"""        -- And those that ended only now (v_late), which must have ended clean.
        SELECT count(*) FILTER (WHERE CASE
                   WHEN u.base_id = ANY (coalesce(v_ending, '{{{{}}}}'))
                       THEN NOT (u.remaining <= 0 AND {_CLEAN_UNIT})
                   WHEN u.remaining <= 0 THEN NOT ({_CLEAN_UNIT})
                   ELSE false END)
                 , json_agg(u) FILTER (WHERE u.remaining <= 0)
                 , array_agg(u.base_id) FILTER (WHERE u.remaining <= 0
                       AND NOT u.base_id = ANY (coalesce(v_ending, '{{{{}}}}')))
          INTO n_ended, v_ended, v_late FROM u;
        IF (n_ended > 0 AND NOT p_cascade)
           OR ((v_ending IS NOT NULL OR (v_late IS NOT NULL AND NOT p_cascade))
               AND run_cancel <> 0) THEN
            RAISE EXCEPTION 'preloop: slow path: a unit ends'
                USING ERRCODE = 'PLSLO';
""",
        ),
        (
            """        IF v_ending IS NOT NULL THEN
            UPDATE units SET result = 'success'
                WHERE run_id = p_run AND base_id = ANY (v_ending);
        END IF;
""",
            """        IF v_ending IS NOT NULL THEN
            UPDATE units SET result = 'success'
                WHERE run_id = p_run AND base_id = ANY (v_ending);
        END IF;
        IF v_late IS NOT NULL AND NOT p_cascade THEN
            loop_was := current_setting('enable_nestloop');
            PERFORM set_config('enable_nestloop', 'off', true);
            IF EXISTS (
"""
            + plain.replace("ANY (v_ending)", "ANY (v_late)")
            + """ THEN
                RAISE EXCEPTION 'preloop: slow path: a unit ends' USING ERRCODE = 'PLSLO';
            END IF;
            PERFORM set_config('preloop.queued_notified', 'on', true);
"""
            + "".join(
                line[4:]
                for line in admit.replace("ANY (v_ending)", "ANY (v_late)").splitlines(True)
            )
            + """            PERFORM set_config('preloop.queued_notified', '', true);
            PERFORM set_config('enable_nestloop', loop_was, true);
            IF n_unclean > 0 THEN
                RAISE EXCEPTION 'preloop: slow path: a unit ends' USING ERRCODE = 'PLSLO';
            END IF;
            IF n_queued > 0 THEN
                PERFORM pg_notify('preloop_jobs', '');
            END IF;
            UPDATE units SET result = 'success'
                WHERE run_id = p_run AND base_id = ANY (v_late);
            -- The claim ran before the run row was had: what is left of the
            -- runner's capacity takes the jobs just queued (the leases are
            -- put in claim order by the store). A runner the first claim
            -- filled leaves them to the next claim.
            n_claimed := coalesce(nullif(current_setting('preloop.claimed', true), '')::INT, 0);
            IF n_queued > 0 AND p_limit > n_claimed AND NOT claim_later THEN
                v_more := preloop_claim(p_runner, p_labels, p_limit - n_claimed, p_now, p_expires,
                                        p_only_run);
                v_claimed := CASE WHEN v_claimed IS NULL THEN v_more
                                  WHEN v_more IS NULL THEN v_claimed
                                  ELSE left(v_claimed, -1) || ',' || substr(v_more, 2) END;
            END IF;
        END IF;
""",
        ),
        (
            """    IF p_limit > 0 AND claim_later THEN""",
            """    IF n > 0 AND left_jobs <= 0 AND NOT p_cascade THEN
        UPDATE runs SET status = 'completed',
                conclusion = CASE WHEN failed_jobs > 0 THEN 'failure'
                                  WHEN cancel_requested <> 0 OR cancelled_jobs > 0
                                      THEN 'cancelled'
                                  ELSE 'success' END,
                completed_at = p_now
            WHERE id = p_run AND status <> 'completed';
    END IF;
    IF p_limit > 0 AND claim_later THEN""",
        ),
    ]
    text = _edited(text, edits)
    text = _with_capped_admission(text)
    return text.replace(
        "LANGUAGE plpgsql AS $fn$",
        "LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $fn$",
    )


_FILL_COHORTS = """FOR c IN SELECT co.id AS cohort, co.max_parallel - co.active AS free
           FROM cohorts co WHERE co.run_id = p_run AND co.id = ANY (v_cohorts)
LOOP
    IF c.free > 0 THEN
        -- By address, as the slots' hand-over does: no join (hash joins are on).
        SELECT array_agg(l.tid) INTO tids FROM (
            SELECT p.ctid AS tid FROM jobs p
             WHERE p.run_id = p_run AND p.cohort = c.cohort AND p.status = 'parked'
             ORDER BY p.seq LIMIT c.free) l;
        got := coalesce(cardinality(tids), 0);
        IF got > 0 THEN
            UPDATE jobs SET status = 'queued', holds_slot = 1 WHERE ctid = ANY (tids);
            UPDATE cohorts SET active = active + got WHERE run_id = p_run AND id = c.cohort;
            n_queued := n_queued + got;
        END IF;
    END IF;
END LOOP;
"""

# The admission's write, at whatever indentation it has.
_ADMISSION_WRITE = re.compile(
    r"(?P<i> *)AND j\.conc_group_expr IS NULL AND j\.capped = 0\n"
    r"(?P<t> *)THEN 'queued' ELSE j\.status END\n"
    r"(?P<rest>(?:.*\n)*?)"
    r"(?P<r> *)RETURNING j\.status, j\.remaining_needs\n"
    r"(?P<close>(?:.*\n)*?)"
    r"(?P<s> *)SELECT count\(\*\) FILTER \(WHERE w\.status = 'queued'\),\n"
    r" *count\(\*\) FILTER \(WHERE w\.status <> 'queued' AND w\.remaining_needs <= 0\)\n"
    r" *INTO n_queued, n_unclean FROM w;\n"
)


def _with_capped_admission(text: str) -> str:
    """Both admissions (before the run row, and under it for a late unit)
    also take the legs of a max-parallel matrix, as the cascade's `end_unit`
    and `fill_cohort` do: parked, then the cohort's free slots (seq order)
    queued holding a slot. The cohort is the need's own and fresh: no other
    transaction has seen its legs."""
    old = "    v_late TEXT[];"
    text = _edited(text, [(old, "    v_cohorts TEXT[]; v_late TEXT[];")])
    old = "AND j.conc_group_expr IS NULL AND j.capped = 0)) THEN"  # the checks
    text = _edited(text, [(old, "AND j.conc_group_expr IS NULL)) THEN")], times=2)

    def capped(m: re.Match[str]) -> str:
        s = m["s"]
        return (
            f"{m['i']}AND j.conc_group_expr IS NULL\n"
            f"{m['t']}THEN CASE WHEN j.capped <> 0 THEN 'parked' ELSE 'queued' END\n"
            f"{m['t']}ELSE j.status END\n"
            f"{m['rest']}"
            f"{m['r']}RETURNING j.status, j.remaining_needs, j.cohort\n"
            f"{m['close']}"
            f"{s}SELECT count(*) FILTER (WHERE w.status = 'queued'),\n"
            f"{s}       count(*) FILTER (WHERE w.status NOT IN ('queued', 'parked')\n"
            f"{s}                        AND w.remaining_needs <= 0),\n"
            f"{s}       array_agg(DISTINCT w.cohort) FILTER (WHERE w.status = 'parked')\n"
            f"{s}  INTO n_queued, n_unclean, v_cohorts FROM w;\n"
            + "".join(s + line for line in _FILL_COHORTS.splitlines(True))
        )

    text, n = _ADMISSION_WRITE.subn(capped, text)
    assert n == 2, n
    return text


def _claim_v22() -> str:
    """`preloop_claim`, also leaving how many jobs it claimed in the
    transaction-local setting `preloop.claimed` (its answer is text that
    PostgreSQL's JSON type may refuse: `Infinity` in a matrix)."""
    text = _claim_v19()
    old = "    v_claimed TEXT; sort_was TEXT;\n"
    text = _edited(text, [(old, "    v_claimed TEXT; sort_was TEXT; v_n INT;\n")])
    old = "',' ORDER BY w.run_id, w.seq) || ']'\n          INTO v_claimed FROM w;\n"
    new = (
        "',' ORDER BY w.run_id, w.seq) || ']', count(*)\n"
        "          INTO v_claimed, v_n FROM w;\n"
        "        PERFORM set_config('preloop.claimed', v_n::TEXT, true);\n"
    )
    return _edited(text, [(old, new)], times=2)


_V22_ENDS_IN_BATCH: list[Statement] = [
    {"pg": _claim_v22(), "lite": None},
    {"pg": _complete_claim_v22(), "lite": None},
]


_LABELS_MATCH = """NOT EXISTS (
                SELECT 1 FROM json_array_elements_text(j.runs_on::JSON) AS l(v)
                WHERE l.v <> ALL (p_labels))"""


def _claim_handed_v23() -> str:
    """`preloop_claim_handed`: `preloop_claim` over the queued jobs and the
    parked legs `p_handed` (a max-parallel matrix's, just handed a freed slot
    under the run row) together, in the claim's order; a leg it takes goes
    from parked to running holding its slot. The same jobs as queueing the
    legs and then claiming, with one write a leg instead of two. Queued jobs
    it locked but left for a handed leg ahead of them in that order are
    announced (`preloop_jobs`): a runner that skipped them while they were
    locked would otherwise wait for a notice nobody sends."""
    text = _claim_v22()
    edits = [
        (
            "CREATE OR REPLACE FUNCTION preloop_claim(",
            "CREATE OR REPLACE FUNCTION preloop_claim_handed(",
        ),
        (
            "    p_expires DOUBLE PRECISION, p_only_run BIGINT)\n",
            "    p_expires DOUBLE PRECISION, p_only_run BIGINT, p_handed TID[])\n",
        ),
        # The sort of the two sets (at most p_limit rows each) is costed as
        # disabled (enable_sort is off for the queue's index order), which would
        # have the plan compiled by JIT: 250 ms a call.
        (
            "RETURNS TEXT LANGUAGE plpgsql AS $fn$",
            "RETURNS TEXT LANGUAGE plpgsql SET jit = off AS $fn$",
        ),
        (
            "    v_claimed TEXT; sort_was TEXT; v_n INT;\n",
            "    v_claimed TEXT; sort_was TEXT; v_n INT; v_handed INT; v_locked INT;\n",
        ),
    ]
    text = _edited(text, edits)
    edits = [
        (
            "            SELECT j.ctid AS tid FROM jobs j\n            WHERE j.status = 'queued'",
            "            SELECT j.ctid AS tid, j.run_id, j.seq FROM jobs j\n"
            "            WHERE j.status = 'queued'",
        ),
        (
            "LIMIT p_limit FOR UPDATE SKIP LOCKED\n        ), w AS (\n",
            "LIMIT p_limit FOR UPDATE SKIP LOCKED\n"
            "        ), h AS (\n"
            "            SELECT j.ctid AS tid, j.run_id, j.seq FROM jobs j\n"
            # By address alone, so that it is a TID scan: a parked-status test
            # would let the planner walk the partial index of every parked leg.
            "            WHERE j.ctid = ANY (p_handed)\n"
            f"              AND (p_only_run IS NULL OR j.run_id = p_only_run) AND {_LABELS_MATCH}\n"
            "        ), p AS (\n"
            "            SELECT u.tid, u.handed FROM (\n"
            "                SELECT q.*, false AS handed FROM q\n"
            "                UNION ALL SELECT h.*, true FROM h) u\n"
            "            ORDER BY u.run_id, u.seq LIMIT p_limit\n"
            "        ), w AS (\n",
        ),
        (
            "UPDATE jobs j SET status = 'running', runner = p_runner,",
            "UPDATE jobs j SET status = 'running', runner = p_runner,\n"
            "                holds_slot = CASE WHEN j.status = 'parked' THEN 1\n"
            "                                  ELSE j.holds_slot END,",
        ),
        ("FROM q WHERE j.ctid = q.tid", "FROM p WHERE j.ctid = p.tid"),
        (
            "                j.strategy, j.timeout_minutes, j.lease_token\n",
            "                j.strategy, j.timeout_minutes, j.lease_token, p.handed\n",
        ),
        (
            "',' ORDER BY w.run_id, w.seq) || ']', count(*)\n"
            "          INTO v_claimed, v_n FROM w;\n"
            "        PERFORM set_config('preloop.claimed', v_n::TEXT, true);\n",
            "',' ORDER BY w.run_id, w.seq) || ']', count(*),\n"
            "               count(*) FILTER (WHERE w.handed), (SELECT count(*) FROM q)\n"
            "          INTO v_claimed, v_n, v_handed, v_locked FROM w;\n"
            "        PERFORM set_config('preloop.claimed', v_n::TEXT, true);\n"
            "        IF v_locked > v_n - v_handed THEN\n"
            "            PERFORM pg_notify('preloop_jobs', '');\n"
            "        END IF;\n",
        ),
    ]
    return _edited(text, edits, times=2)


def _complete_claim_v23() -> str:
    """Migration 22's batch, whose freed slots' legs are claimed by
    `preloop_claim_handed` straight from parked when no group was released
    (a released group may queue a job the claim must see after it): the run
    row is held for one write of each such leg, not two; the legs left over
    are queued with one notice, not one a leg."""
    text = _complete_claim_v22()
    edits = [
        (
            "    v_cohorts TEXT[]; v_late TEXT[];",
            "    v_handed TID[] := '{{}}'; v_cohorts TEXT[]; v_late TEXT[];",
        ),
        (
            """            IF cardinality(tids) > 0 THEN
                UPDATE jobs SET status = 'queued', holds_slot = 1
                    WHERE ctid = ANY (tids);
            END IF;
            IF got < c.freed THEN
                UPDATE cohorts SET active = active - (c.freed - got)
                    WHERE run_id = p_run AND id = c.cohort;
            END IF;
        END LOOP;
""",
            """            v_handed := v_handed || tids;
            IF got < c.freed THEN
                UPDATE cohorts SET active = active - (c.freed - got)
                    WHERE run_id = p_run AND id = c.cohort;
            END IF;
        END LOOP;
        IF cardinality(v_handed) > 0 THEN
            IF p_limit > 0 AND v_groups IS NULL THEN
                v_claimed := preloop_claim_handed(p_runner, p_labels, p_limit, p_now,
                                                  p_expires, p_only_run, v_handed);
                claim_later := false;
            END IF;
            PERFORM set_config('preloop.queued_notified', 'on', true);
            -- By address alone (a TID scan), as in the claim: a leg the claim
            -- took was rewritten, and this statement no longer sees the old row.
            UPDATE jobs SET status = 'queued', holds_slot = 1
                WHERE ctid = ANY (v_handed);
            IF FOUND THEN
                PERFORM pg_notify('preloop_jobs', '');
            END IF;
            PERFORM set_config('preloop.queued_notified', '', true);
        END IF;
""",
        ),
    ]
    return _edited(text, edits)


_V23_CLAIM_HANDED: list[Statement] = [
    {"pg": _claim_handed_v23(), "lite": None},
    {"pg": _complete_claim_v23(), "lite": None},
]


def _complete_claim_v24() -> str:
    """Migration 23's batch, whose write of the finished jobs joins them to
    the batch's results by hash. Without statistics on a run's fresh rows the
    generic plan was a nested loop over the run's running jobs, rescanning the
    results for each: running x results comparisons, about half of the
    statement's time at 64 running and 32 results."""
    old = "    IF n > 0 THEN\n        WITH i AS (\n"
    new = (
        "    IF n > 0 THEN\n"
        "        loop_was := current_setting('enable_nestloop');\n"
        "        PERFORM set_config('enable_nestloop', 'off', true);\n"
        "        WITH i AS (\n"
    )
    after = (
        "          INTO n_done, n_slow, n_multi, n_cancelled,"
        " v_settled, v_units, v_slots, v_groups;\n"
    )
    restore = "        PERFORM set_config('enable_nestloop', loop_was, true);\n"
    return _edited(_complete_claim_v23(), [(old, new), (after, after + restore)])


_V24_RESULTS_BY_HASH: list[Statement] = [{"pg": _complete_claim_v24(), "lite": None}]


_EARLY_HAND_OVER = """\
    -- Freed slots handed over before the run row (migration 25), when no job
    -- of the run has a concurrency group: the next parked legs of each cohort,
    -- in seq order, locked (SKIP LOCKED: another batch of the run handing over
    -- at the same time takes the legs after them) and claimed from parked.
    -- Run row first (a retry) the same way: a leg another batch holds while
    -- it waits for the run row is skipped, not waited for (that batch hands
    -- it over, or runs again and does).
    IF n > 0 AND NOT p_cascade AND v_slots IS NOT NULL AND v_groups IS NULL
       AND NOT EXISTS (SELECT 1 FROM jobs WHERE run_id = p_run
                        AND (conc_group IS NOT NULL OR conc_group_expr IS NOT NULL)) THEN
        v_early := true;
        FOR c IN SELECT x.cohort, x.freed
                   FROM json_to_recordset(v_slots) AS x(cohort TEXT, freed INT)
        LOOP
            got := 0;
            FOR leg IN SELECT p.ctid AS tid, p.kind, p.conc_cancel
                         FROM jobs p WHERE p.run_id = p_run AND p.cohort = c.cohort
                          AND p.status = 'parked' ORDER BY p.seq LIMIT c.freed
                          FOR UPDATE SKIP LOCKED
            LOOP
                got := got + 1;
                IF leg.kind <> 'job' OR leg.conc_cancel = 1 THEN
                    RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
                END IF;
                v_handed := v_handed || leg.tid;
            END LOOP;
            IF got < c.freed THEN
                v_short := v_short || c.cohort;
                v_short_n := v_short_n || (c.freed - got);
            END IF;
        END LOOP;
        IF cardinality(v_handed) > 0 THEN
            IF p_limit > 0 THEN
                v_claimed := preloop_claim_handed(p_runner, p_labels, p_limit, p_now,
                                                  p_expires, p_only_run, v_handed);
            END IF;
            PERFORM set_config('preloop.queued_notified', 'on', true);
            UPDATE jobs SET status = 'queued', holds_slot = 1 WHERE ctid = ANY (v_handed);
            IF FOUND THEN
                PERFORM pg_notify('preloop_jobs', '');
            END IF;
            PERFORM set_config('preloop.queued_notified', '', true);
        ELSIF p_limit > 0 THEN
            v_claimed := preloop_claim(p_runner, p_labels, p_limit, p_now, p_expires, p_only_run);
        END IF;
        claim_later := false;
    END IF;
"""


def _complete_claim_v25() -> str:
    """Migration 24's batch, which hands the slots its jobs freed to the next
    parked legs and claims them before it takes the run row, when no job of
    the run has a concurrency group (`_EARLY_HAND_OVER`); under the run row
    it then only gives back the slots no parked leg was left for. The run row
    was held for a write of each handed leg (0.5-0.7 ms for 20 legs); the
    legs' own row locks keep two batches from handing over the same leg. A
    run-row holder that writes one of those legs (a cancellation, fail-fast,
    the cascade filling a cohort, `preloop_settle` handing a slot over) waits
    for this batch, which gives up the run row's wait after 50 ms and runs
    again run row first (PLLCK), as for its other writes; run row first, it
    hands over the same way, skipping legs a waiting batch holds, so one slow
    holder does not turn the batches behind it into a chain of such retries."""
    claim = (
        "    IF p_limit > 0 AND NOT claim_later THEN\n"
        "        v_claimed := preloop_claim(p_runner, p_labels, p_limit, p_now, p_expires,"
        " p_only_run);\n"
        "    END IF;\n"
        "    IF n > 0 THEN\n"
    )
    early_claim = claim.replace("NOT claim_later THEN", "NOT claim_later AND NOT v_early THEN")
    # The hand-over under the run row stays for runs with groups, one level in.
    text = _complete_claim_v24()
    first = text.index("        FOR c IN SELECT x.cohort, x.freed\n")
    last = text.index("    END IF;\n    IF n > 0 AND left_jobs <= 0 AND NOT p_cascade THEN\n")
    under_lock = text[first:last]
    gave_back = (
        "        IF v_early THEN\n"
        "            FOR i IN 1 .. cardinality(v_short) LOOP\n"
        "                UPDATE cohorts SET active = active - v_short_n[i]\n"
        "                    WHERE run_id = p_run AND id = v_short[i];\n"
        "            END LOOP;\n"
        "        ELSE\n"
        + "".join("    " + line for line in under_lock.splitlines(True))
        + "        END IF;\n"
    )
    declare = "    v_handed TID[] := '{{}}';"
    return _edited(
        text,
        [
            (
                declare,
                declare + " v_early BOOLEAN := false; v_short TEXT[] := '{{}}';"
                " v_short_n INT[] := '{{}}'; i INT;",
            ),
            (under_lock, gave_back),
            (claim, _EARLY_HAND_OVER.replace("{}", "{{}}") + early_claim),
        ],
    )


_V25_EARLY_HAND_OVER: list[Statement] = [{"pg": _complete_claim_v25(), "lite": None}]

# Migration 26: a connection's statements of `preloop_complete_claim` planned
# before it first holds a run row. PL/pgSQL plans each statement the first
# time a connection runs it (once: `plan_cache_mode = force_generic_plan`,
# until an ANALYZE or other change of a table it reads invalidates the plan),
# and for the statements after the run row that meant planning under it:
# 0.7-1 ms more on a connection's first batch and 1.5-4 ms on the batch that
# first ends a unit there, against 0.1-0.2 ms steady, on every connection of
# a fleet (an autoscaled `preloop runner --once` has no other batch). The
# store calls `preloop_warm_settle` before a connection's first batch. It
# drives the function through its common paths on two runs of its own: slots
# handed over and given back, a slot given back with no leg left, a batch
# that ends nothing (also run row first), a unit ended under and before the
# run row (each admitting a plain and a capped dependent), the run's end, a
# group handed to its waiter and a parked leg then waiting for it, a group
# handed on with its slot given back; and both claim functions' branch for a
# runner that names no run (limit 0: it locks nothing). Its runs have
# negative ids from the backend's pid and its group is named after it, so
# two connections never meet; everything happens in a block it then rolls
# back, so nothing it wrote, notified or locked outlives the call (the
# shared wait counter, written last, is held for the block's last
# statements). It returns the paths it saw taken; an error is returned, not
# raised (a connection left cold is only slower), except a cancellation.
# Not taken: a group taken at once by a parked leg, a run-level group, the
# cascade mode and the slow paths (those are planned where they first run).
_WARM_BATCH_FN = """\
CREATE OR REPLACE FUNCTION preloop_warm_batch(
    p_run BIGINT, p_jobs TEXT[], p_lock_first BOOLEAN DEFAULT false)
RETURNS VOID LANGUAGE plpgsql AS $fn$
BEGIN
    -- `p_jobs` succeed, on their current leases; the warm-up's runner claims one.
    PERFORM preloop_complete_claim(p_run, p_jobs,
        array_fill('success'::TEXT, ARRAY[cardinality(p_jobs)]),
        array_fill('{}'::TEXT, ARRAY[cardinality(p_jobs)]),
        ARRAY(SELECT j.lease_token FROM unnest(p_jobs) WITH ORDINALITY AS u(id, k)
                JOIN jobs j ON j.run_id = p_run AND j.id = u.id ORDER BY u.k),
        0, 'preloop-warm-up', ARRAY['preloop-warm-up'], 1, 0, p_run, NULL, p_lock_first);
END
$fn$"""

_WARM_SETTLE_FN = """\
CREATE OR REPLACE FUNCTION preloop_warm_settle() RETURNS TEXT[]
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
    r_a BIGINT := -2 * pg_backend_pid()::BIGINT;
    r_b BIGINT := -2 * pg_backend_pid()::BIGINT - 1;
    grp TEXT := 'preloop warm-up ' || pg_backend_pid();
    who TEXT := 'preloop-warm-up';  -- the runner and label of preloop_warm_batch
    lbl TEXT[] := ARRAY['preloop-warm-up'];
    done TEXT[] := '{}';
BEGIN
    BEGIN
        INSERT INTO runs (id, workflow, name, event, status, remaining_jobs, context, created_at)
            VALUES (r_a, '', '', '', 'running', 100, '{}', 0),
                   (r_b, '', '', '', 'running', 100, '{}', 0);
        INSERT INTO units (run_id, base_id, remaining) VALUES
            (r_a, 'c', 6), (r_a, 'a', 2), (r_a, 'l', 2), (r_a, 'b', 1), (r_a, 'm', 1),
            (r_a, 'p', 1), (r_a, 'n', 1), (r_a, 'q', 1), (r_b, 'g', 3);
        INSERT INTO cohorts (run_id, id, max_parallel, fail_fast, active, total) VALUES
            (r_a, 'c', 3, 0, 3, 5), (r_a, 'p', 1, 0, 0, 1), (r_a, 'q', 1, 0, 0, 1),
            (r_b, 'g', 2, 0, 2, 3);
        INSERT INTO deps (run_id, need, job_id) VALUES
            (r_a, 'a', 'm'), (r_a, 'a', 'p1'), (r_a, 'b', 'n'), (r_a, 'b', 'q1');
        INSERT INTO conc_groups (name, holder_run, holder_job) VALUES (grp, r_b, 'g1');
        INSERT INTO jobs (run_id, id, seq, base_id, name, kind, needs, runs_on, cohort,
                          continue_on_error, timeout_minutes, outputs_expr, inner_job_ids,
                          spec, status, remaining_needs, capped, holds_slot, holds_group,
                          conc_group, wait_seq, lease_token)
        SELECT v.run_id, v.id, v.seq, v.base_id, v.id, 'job', '[]', '["preloop-warm-up"]',
               v.cohort, 0, 1, '{}', '[]', '{}', v.status, v.needs, v.capped, v.slot,
               v.holds, v.grp, v.wseq, 't'
          FROM (VALUES
            (r_a, 'c1', 1, 'c', 'c', 'running', 0, 1, 1, NULL, NULL, NULL::BIGINT),
            (r_a, 'c2', 2, 'c', 'c', 'running', 0, 1, 1, NULL, NULL, NULL),
            (r_a, 'c3', 3, 'c', 'c', 'running', 0, 1, 1, NULL, NULL, NULL),
            (r_a, 'c4', 4, 'c', 'c', 'parked', 0, 1, 0, NULL, NULL, NULL),
            (r_a, 'c5', 5, 'c', 'c', 'parked', 0, 1, 0, NULL, NULL, NULL),
            (r_a, 'a1', 6, 'a', NULL, 'running', 0, 0, 0, NULL, NULL, NULL),
            (r_a, 'a2', 7, 'a', NULL, 'running', 0, 0, 0, NULL, NULL, NULL),
            (r_a, 'l1', 8, 'l', NULL, 'running', 0, 0, 0, NULL, NULL, NULL),
            (r_a, 'b', 9, 'b', NULL, 'running', 0, 0, 0, NULL, NULL, NULL),
            (r_a, 'm', 10, 'm', NULL, 'blocked', 1, 0, 0, NULL, NULL, NULL),
            (r_a, 'p1', 11, 'p', 'p', 'blocked', 1, 1, 0, NULL, NULL, NULL),
            (r_a, 'n', 12, 'n', NULL, 'blocked', 1, 0, 0, NULL, NULL, NULL),
            (r_a, 'q1', 13, 'q', 'q', 'blocked', 1, 1, 0, NULL, NULL, NULL),
            (r_b, 'g1', 1, 'g', 'g', 'running', 0, 1, 1, grp, grp, NULL),
            (r_b, 'g2', 2, 'g', 'g', 'waiting', 0, 1, 1, NULL, grp, 0),
            (r_b, 'g3', 3, 'g', 'g', 'parked', 0, 1, 0, NULL, grp, NULL))
            AS v(run_id, id, seq, base_id, cohort, status, needs, capped, slot, holds, grp, wseq);
        -- Three legs free three slots of a capped matrix: the two parked legs
        -- are handed over before the run row (one claimed, one queued), the
        -- third slot is given back under it.
        PERFORM preloop_warm_batch(r_a, ARRAY['c1', 'c2', 'c3']);
        IF EXISTS (SELECT 1 FROM jobs WHERE run_id = r_a AND id = 'c4' AND status = 'running')
           AND EXISTS (SELECT 1 FROM jobs WHERE run_id = r_a AND id = 'c5' AND status = 'queued')
           AND (SELECT active FROM cohorts WHERE run_id = r_a AND id = 'c') = 2 THEN
            done := done || 'slots'::TEXT;
        END IF;
        -- A slot freed with no parked leg left: given back; the claim takes
        -- the queued one.
        PERFORM preloop_warm_batch(r_a, ARRAY['c4']);
        IF EXISTS (SELECT 1 FROM jobs WHERE run_id = r_a AND id = 'c5' AND status = 'running')
           AND (SELECT active FROM cohorts WHERE run_id = r_a AND id = 'c') = 1 THEN
            done := done || 'slot given back'::TEXT;
        END IF;
        -- A leg that ends no unit; and one run again run row first (a retry).
        PERFORM preloop_warm_batch(r_a, ARRAY['a1']);
        PERFORM preloop_warm_batch(r_a, ARRAY['l1'], true);
        IF (SELECT sum(remaining) FROM units WHERE run_id = r_a AND base_id IN ('a', 'l')) = 2 THEN
            done := done || 'plain'::TEXT;
        END IF;
        -- A unit that another batch ended meanwhile (its count already at 0):
        -- it ends under the run row, which admits its dependents (one plain,
        -- one a capped leg) and claims one.
        UPDATE units SET remaining = 0 WHERE run_id = r_a AND base_id = 'a';
        PERFORM preloop_warm_batch(r_a, ARRAY['a2']);
        IF (SELECT count(*) FROM jobs WHERE run_id = r_a AND id IN ('m', 'p1')
              AND status IN ('queued', 'running')) = 2 THEN
            done := done || 'unit ended under the run row'::TEXT;
        END IF;
        -- The run's last job, whose unit ends before the run row.
        UPDATE runs SET remaining_jobs = 1 WHERE id = r_a;
        PERFORM preloop_warm_batch(r_a, ARRAY['b']);
        IF (SELECT count(*) FROM jobs WHERE run_id = r_a AND id IN ('n', 'q1')
              AND status IN ('queued', 'running')) = 2 THEN
            done := done || 'unit ended before the run row'::TEXT;
        END IF;
        IF (SELECT status FROM runs WHERE id = r_a) = 'completed' THEN
            done := done || 'run ended'::TEXT;
        END IF;
        -- A runner's claims take the other branch (no run named): limit 0,
        -- which locks nothing.
        PERFORM preloop_claim(who, lbl, 0, 0, 0, NULL);
        PERFORM preloop_claim_handed(who, lbl, 0, 0, 0, NULL, '{}');
        -- A group handed to its waiter, the freed slot to a parked leg that
        -- then waits for the group (the shared wait counter, locked last).
        PERFORM preloop_warm_batch(r_b, ARRAY['g1']);
        IF EXISTS (SELECT 1 FROM jobs WHERE run_id = r_b AND id = 'g2' AND status = 'running')
           AND EXISTS (SELECT 1 FROM jobs WHERE run_id = r_b AND id = 'g3'
                         AND status = 'waiting')
           AND (SELECT holder_job FROM conc_groups WHERE name = grp) = 'g2' THEN
            done := done || 'group'::TEXT;
        END IF;
        -- The group handed on; its slot given back (no parked leg left).
        PERFORM preloop_warm_batch(r_b, ARRAY['g2']);
        IF EXISTS (SELECT 1 FROM jobs WHERE run_id = r_b AND id = 'g3' AND status = 'running')
           AND (SELECT active FROM cohorts WHERE run_id = r_b AND id = 'g') = 1 THEN
            done := done || 'group slot given back'::TEXT;
        END IF;
        RAISE EXCEPTION 'preloop: warm-up done' USING ERRCODE = 'PLWRM';
    EXCEPTION
        WHEN SQLSTATE 'PLWRM' THEN NULL;
        WHEN OTHERS THEN done := done || ('error: ' || SQLERRM);
    END;
    RETURN done;
END
$fn$"""

_V26_WARM_SETTLE: list[Statement] = [
    {"pg": _WARM_BATCH_FN.replace("{", "{{").replace("}", "}}"), "lite": None},
    {"pg": _WARM_SETTLE_FN.replace("{", "{{").replace("}", "}}"), "lite": None},
]

# Migration 27: a batch that releases a concurrency group hands it over
# before it takes the run row, as migration 25 does for freed slots. Under
# the run row a one-completion batch of a grouped matrix wrote the group's
# release, its oldest waiter (waiting -> queued), the freed slot's parked leg
# through the group (its place in the queue, `waiting`, the check of the
# group's queue) and the claim of the waiter: 0.44-0.51 ms of the hold on a
# quiet host, against ~0.1 ms for the counters the run row guards. Those
# writes lock their own rows (the group's, the waiter's, the leg's; the
# place comes from a sequence, below), so the run row adds nothing to them; what it serialises (the
# run's and units' counters, the cohorts' slots given back, the run's end)
# stays under it. Taken in this order, a group row is held while the batch
# waits for its run row, against the cascade's order (run row, then group);
# so, as for the batch's other writes before the run row, every wait of the
# hand-over is bounded (`lock_timeout` COMPLETE_LOCK_WAIT) and running out
# undoes the batch, which runs again run row first (PLLCK), where the order
# is the cascade's. The group is released before the freed slots admit
# parked legs, as the cascade's release_group does; the legs are taken in
# seq order, skipping (not waiting for) those another batch of the run
# holds. Two batches of a run handing over at once may so put two legs in
# the group's queue in the other order than their seq: both were freed at
# the same moment, and GitHub orders a group's queue by arrival only.
_EARLY_HAND_OVER_V27 = """\
    -- Freed slots and released groups handed over before the run row
    -- (migrations 25 and 27): each group to its oldest waiter, then the next
    -- parked legs of each cohort, in seq order, locked (SKIP LOCKED: another
    -- batch of the run handing over at the same time takes the legs after
    -- them) and claimed from parked, or sent through their group. A wait for
    -- another transaction's row (a group, a waiter) is bounded as the run
    -- row's: run row first (a retry), the order is the cascade's and nothing
    -- is bounded.
    IF n > 0 AND (v_slots IS NOT NULL OR v_groups IS NOT NULL) THEN
        v_early := true;
        IF NOT p_lock_first THEN
            lock_was := current_setting('lock_timeout');
            PERFORM set_config('lock_timeout', '@LOCK_WAIT@', true);
        END IF;
        BEGIN
            FOR g IN SELECT x.job, x.grp
                       FROM json_to_recordset(coalesce(v_groups, '[]'::JSON))
                         AS x(job TEXT, grp TEXT)
            LOOP
                UPDATE conc_groups SET holder_run = NULL, holder_job = NULL
                    WHERE name = g.grp AND holder_run = p_run AND holder_job = g.job;
                IF FOUND THEN
                    PERFORM preloop_promote_group(p_run, g.grp);
                END IF;
            END LOOP;
            FOR c IN SELECT x.cohort, x.freed
                       FROM json_to_recordset(coalesce(v_slots, '[]'::JSON))
                         AS x(cohort TEXT, freed INT)
            LOOP
                got := 0;
                FOR leg IN SELECT p.ctid AS tid, p.id, p.kind, p.conc_group, p.conc_group_expr,
                                  p.conc_cancel, p.conc_queue_max
                             FROM jobs p WHERE p.run_id = p_run AND p.cohort = c.cohort
                              AND p.status = 'parked' ORDER BY p.seq LIMIT c.freed
                              FOR UPDATE SKIP LOCKED
                LOOP
                    got := got + 1;
                    IF leg.kind <> 'job' OR leg.conc_group_expr IS NOT NULL
                       OR leg.conc_cancel = 1 THEN
                        RAISE EXCEPTION 'preloop: slow path' USING ERRCODE = 'PLSLO';
                    END IF;
                    IF leg.conc_group IS NULL THEN
                        v_handed := v_handed || leg.tid;
                    ELSE
                        PERFORM preloop_through_group(p_run, leg.id, leg.conc_group,
                                                      leg.conc_queue_max, leg.tid);
                    END IF;
                END LOOP;
                IF got < c.freed THEN
                    v_short := v_short || c.cohort;
                    v_short_n := v_short_n || (c.freed - got);
                END IF;
            END LOOP;
            -- A released group's waiter is claimed with the rest, in the
            -- claim's order; without one, the handed legs straight from parked.
            IF cardinality(v_handed) > 0 AND p_limit > 0 AND v_groups IS NULL THEN
                v_claimed := preloop_claim_handed(p_runner, p_labels, p_limit, p_now,
                                                  p_expires, p_only_run, v_handed);
            END IF;
            IF cardinality(v_handed) > 0 THEN
                PERFORM set_config('preloop.queued_notified', 'on', true);
                UPDATE jobs SET status = 'queued', holds_slot = 1 WHERE ctid = ANY (v_handed);
                IF FOUND THEN
                    PERFORM pg_notify('preloop_jobs', '');
                END IF;
                PERFORM set_config('preloop.queued_notified', '', true);
            END IF;
            IF p_limit > 0 AND NOT (cardinality(v_handed) > 0 AND v_groups IS NULL) THEN
                v_claimed := preloop_claim(p_runner, p_labels, p_limit, p_now, p_expires,
                                           p_only_run);
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            IF p_lock_first THEN
                RAISE;
            END IF;
            RAISE EXCEPTION 'preloop: run row busy' USING ERRCODE = 'PLLCK';
        END;
        IF NOT p_lock_first THEN
            PERFORM set_config('lock_timeout', lock_was, true);
        END IF;
        claim_later := false;
    END IF;
"""


def _complete_claim_v27() -> str:
    """Migration 25's batch, whose hand-over before the run row also takes
    the groups its jobs held, runs whose jobs have groups and the cascade
    mode (which claims nothing: its run row is taken first, so the early
    hand-over is under it there) (`_EARLY_HAND_OVER_V27`). Under the run row
    only the slots no parked leg was left for are given back: the hand-over
    that was made there is gone."""
    text = _complete_claim_v25()
    first = text.index("        -- A group a job held goes to its oldest waiter")
    last = text.index("    END IF;\n    IF n > 0 AND left_jobs <= 0 AND NOT p_cascade THEN\n")
    gave_back = (
        "        FOR i IN 1 .. cardinality(v_short) LOOP\n"
        "            UPDATE cohorts SET active = active - v_short_n[i]\n"
        "                WHERE run_id = p_run AND id = v_short[i];\n"
        "        END LOOP;\n"
    )
    early = _EARLY_HAND_OVER_V27.replace("@LOCK_WAIT@", COMPLETE_LOCK_WAIT)
    return _edited(
        text,
        [
            (_EARLY_HAND_OVER.replace("{}", "{{}}"), early.replace("{}", "{{}}")),
            (text[first:last], gave_back),
        ],
    )


def _through_group_v27() -> str:
    """Migration 19's `preloop_through_group`, whose waiter takes its place
    from the `wait_order` sequence instead of the `wait_seq` row."""
    return _edited(
        _through_group_v19(),
        [
            (
                "    UPDATE wait_seq SET value = value + 1 WHERE id = 1"
                " RETURNING value INTO v_seq;\n",
                "    v_seq := nextval('wait_order');\n",
            )
        ],
    )


# The places in the groups' queues come from a sequence on PostgreSQL: the
# hand-over before the run row would otherwise hold the one `wait_seq` row,
# which every writer of a waiter of any group of any run takes, while it
# waits for its run row (a review's test: another run's batch, sending a leg
# through an unrelated group, waited 50 ms and ran again run row first). A
# sequence is never held; its numbers increase in the order they are taken,
# and a rolled-back transaction leaves a gap, which an order does not mind.
# It starts after the row's value, so waiters queued before keep their place.
_V27_EARLY_GROUPS: list[Statement] = [
    {"pg": "CREATE SEQUENCE IF NOT EXISTS wait_order", "lite": None},
    {
        "pg": "SELECT setval('wait_order', (SELECT value FROM wait_seq WHERE id = 1) + 1, false)",
        "lite": None,
    },
    {"pg": _through_group_v27(), "lite": None},
    {"pg": _complete_claim_v27(), "lite": None},
]

# What an artifact's client said it uploaded (@actions/artifact 6.x sends a
# file as it is with `archive: false`): its downloads are served with it.
_V28_ARTIFACT_TYPE: list[Statement] = [
    "ALTER TABLE preloop_artifacts ADD COLUMN mime_type TEXT NOT NULL DEFAULT 'application/zip'"
]

# GitHub numbers a workflow's runs in its repository from 1 (`github.run_number`);
# a re-run keeps its run's number and takes the next attempt of the first run
# it repeats (`github.run_attempt`), whichever attempt it re-runs.
_V29_RUN_NUMBERS: list[Statement] = [
    """CREATE TABLE IF NOT EXISTS run_numbers (
        repository TEXT NOT NULL,
        workflow TEXT NOT NULL,
        last BIGINT NOT NULL,
        PRIMARY KEY (repository, workflow)
    )""",
    """CREATE TABLE IF NOT EXISTS run_attempts (
        first_run BIGINT PRIMARY KEY,
        last BIGINT NOT NULL
    )""",
]

# Runs stored before migration 29 count: each workflow's numbering in its
# repository goes on after the runs it already has (re-runs keep theirs), not
# from 1 again.
_SEED_RUN_NUMBERS = """INSERT INTO run_numbers (repository, workflow, last)
    SELECT coalesce({repository}, ''), workflow, count(*) FROM runs
     WHERE rerun_of IS NULL GROUP BY 1, 2
    ON CONFLICT (repository, workflow)
    DO UPDATE SET last = {greatest}(run_numbers.last, excluded.last)"""
_V30_SEED_RUN_NUMBERS: list[Statement] = [
    {
        "pg": _SEED_RUN_NUMBERS.format(
            repository="context::JSON -> 'github' ->> 'repository'", greatest="GREATEST"
        ),
        "lite": _SEED_RUN_NUMBERS.format(
            repository="json_extract(context, '$.github.repository')", greatest="max"
        ),
    }
]

MIGRATIONS: list[list[Statement]] = [
    _V1,
    [{"pg": _SETTLE_FN, "lite": None}],
    # A re-run points at the run it repeats.
    ["ALTER TABLE runs ADD COLUMN rerun_of BIGINT"],
    _V4,
    [
        {"pg": _PROMOTE_GROUP_FN, "lite": None},
        {"pg": _THROUGH_GROUP_FN.replace("@QUEUE_MAX@", str(QUEUE_MAX)), "lite": None},
        {"pg": _COMPLETE_CLAIM_FN, "lite": None},
    ],
    _V6,
    _V7_BLOBS,
    _V8_JOB_LOGS,
    _V9_CANCEL_REASON,
    _V10_SERVICES,
    _V11_BUNDLES,
    _V12_OUTPUTS_LIMIT,
    _V13_HOLD_MEASURED,
    _V14_LOCK_LATE,
    _V15_CLAIM_JSON,
    _V16_SLOTS_AT_ONCE,
    _V17_LOCK_BUSY,
    _V18_CLAIM_TEXT,
    _V19_END_UNITS,
    _V20_IF_TRUE_WHEN_CLEAN,
    _V21_GROUPED_JOBS,
    _V22_ENDS_IN_BATCH,
    _V23_CLAIM_HANDED,
    _V24_RESULTS_BY_HASH,
    _V25_EARLY_HAND_OVER,
    _V26_WARM_SETTLE,
    _V27_EARLY_GROUPS,
    _V28_ARTIFACT_TYPE,
    _V29_RUN_NUMBERS,
    _V30_SEED_RUN_NUMBERS,
]
SCHEMA_VERSION = len(MIGRATIONS)

_DIALECT = {
    "lite": {"id": "INTEGER", "real": "REAL", "bytes": "BLOB"},
    "pg": {
        "id": "BIGINT GENERATED BY DEFAULT AS IDENTITY",
        "real": "DOUBLE PRECISION",
        "bytes": "BYTEA",
    },
}


def render(statement: Statement, dialect: str) -> str | None:
    """`statement` for `dialect` with its column types filled in (None: the
    migration has nothing to do on this dialect)."""
    if isinstance(statement, dict):
        text = statement[dialect]
        if text is None:
            return None
        statement = text
    return statement.format(**_DIALECT[dialect])
