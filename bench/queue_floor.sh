#!/usr/bin/env bash
# The floor of a queue that writes one row per job, on this PostgreSQL, with a
# client that costs nothing (pgbench, C): each call completes the client's
# running jobs and claims the next 32 (UPDATE ... FOR UPDATE SKIP LOCKED), the
# work of one `preloop_complete_claim` batch without its semantics. Four
# shapes, each 2 clients for 5 s, printed as jobs/s:
#   bare     a 3-index table, one statement a call;
#   indexes  our index shape: (run_id, id TEXT) key, (run_id, status), the
#            leases index, uuid lease tokens;
#   counters the same plus the unit's and the run's counters, one plpgsql call;
#   ranges   a matrix's legs claimed as ranges of one cohort row: the call ends
#            the client's running batch (one row for its 32 legs, their
#            outcomes an array), moves the cohort's cursor by 32 and writes
#            the next batch's row with its lease, plus the counters: the row
#            writes per job a range model would leave (not what preloop does).
# Compare with bench/control_load.py's completions/s (issue 17: what a 2.5x
# margin over PgQueuer would need). Usage: bench/queue_floor.sh [URL]
# (default $PRELOOP_TEST_PG_URL); the scratch schema is dropped at the end.
set -euo pipefail
url=${1:-${PRELOOP_TEST_PG_URL:?set PRELOOP_TEST_PG_URL or pass a URL}}
schema=queue_floor_$$
work=$(mktemp -d)
cleanup() {
    psql -q "$url" -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

run() {  # run NAME SETUP_SQL CALL_SQL
    psql -q -v ON_ERROR_STOP=1 "$url" >/dev/null <<SQL
SET client_min_messages = warning;
DROP SCHEMA IF EXISTS $schema CASCADE;
CREATE SCHEMA $schema;
SET search_path = $schema;
$2
VACUUM ANALYZE;
SQL
    printf '%s\n' "$3" >"$work/call.sql"
    tps=$(pgbench -n -M prepared -c 2 -j 2 -T 5 -f "$work/call.sql" "$url" 2>/dev/null |
        sed -n 's/^tps = \([0-9.]*\).*/\1/p')
    awk -v name="$1" -v tps="$tps" 'BEGIN { printf "%-9s %8.0f jobs/s (%.0f calls/s of 32 jobs)\n", name, tps * 32, tps }'
}

run bare "
CREATE TABLE jobs (id BIGINT PRIMARY KEY, seq BIGINT NOT NULL, status TEXT NOT NULL,
    runner TEXT, token TEXT, started DOUBLE PRECISION, done DOUBLE PRECISION);
CREATE INDEX jobs_queued ON jobs (seq) WHERE status = 'queued';
CREATE INDEX jobs_running ON jobs (id) WHERE status = 'running';
INSERT INTO jobs SELECT g, g, 'queued' FROM generate_series(1, 600000) g;" "
WITH d AS (
    UPDATE $schema.jobs SET status = 'completed', done = 1
     WHERE status = 'running' AND runner = :client_id::TEXT RETURNING id
), q AS (
    SELECT ctid FROM $schema.jobs WHERE status = 'queued' ORDER BY seq LIMIT 32
       FOR UPDATE SKIP LOCKED
)
UPDATE $schema.jobs j SET status = 'running', runner = :client_id::TEXT,
       token = md5(random()::TEXT), started = 1
  FROM q WHERE j.ctid = q.ctid;"

INDEXED="
CREATE TABLE jobs (run_id BIGINT NOT NULL, id TEXT COLLATE \"C\" NOT NULL, seq BIGINT NOT NULL,
    status TEXT NOT NULL, runner TEXT, token TEXT, started DOUBLE PRECISION,
    done DOUBLE PRECISION, lease_expires DOUBLE PRECISION, PRIMARY KEY (run_id, id));
CREATE INDEX jobs_queued ON jobs (run_id, seq) WHERE status = 'queued';
CREATE INDEX jobs_leases ON jobs (lease_expires) WHERE status = 'running';
CREATE INDEX jobs_run_status ON jobs (run_id, status);
INSERT INTO jobs SELECT 1, 'leg#' || g, g, 'queued' FROM generate_series(1, 600000) g;"
SETTLE="
WITH d AS (
    UPDATE $schema.jobs SET status = 'completed', done = 1, token = NULL
     WHERE run_id = 1 AND status = 'running' AND runner = %RUNNER% RETURNING id
), q AS (
    SELECT ctid FROM $schema.jobs WHERE status = 'queued' ORDER BY run_id, seq LIMIT 32
       FOR UPDATE SKIP LOCKED
), c AS (
    UPDATE $schema.jobs j SET status = 'running', runner = %RUNNER%,
           token = replace(gen_random_uuid()::TEXT, '-', ''), started = 1, lease_expires = 1
      FROM q WHERE j.ctid = q.ctid RETURNING j.id, j.token
)"

run indexes "$INDEXED" "${SETTLE//%RUNNER%/:client_id::TEXT}
SELECT (SELECT count(*) FROM d), (SELECT json_agg(c) FROM c);"

run counters "$INDEXED
CREATE TABLE runs (id BIGINT PRIMARY KEY, remaining BIGINT NOT NULL);
INSERT INTO runs VALUES (1, 600000);
CREATE TABLE units (run_id BIGINT, base_id TEXT, remaining BIGINT NOT NULL,
    n_success BIGINT NOT NULL, PRIMARY KEY (run_id, base_id));
INSERT INTO units VALUES (1, 'leg', 600000, 0);
CREATE FUNCTION complete_claim(p_runner TEXT) RETURNS TEXT LANGUAGE plpgsql AS \$fn\$
DECLARE n INT; v TEXT;
BEGIN
    ${SETTLE//%RUNNER%/p_runner}
    SELECT (SELECT count(*) FROM d), (SELECT json_agg(c)::TEXT FROM c) INTO n, v;
    UPDATE $schema.units SET remaining = remaining - n, n_success = n_success + n
     WHERE run_id = 1 AND base_id = 'leg';
    UPDATE $schema.runs SET remaining = remaining - n WHERE id = 1;
    RETURN v;
END \$fn\$;" "SELECT $schema.complete_claim(:client_id::TEXT);"

run ranges "
CREATE TABLE runs (id BIGINT PRIMARY KEY, remaining BIGINT NOT NULL);
INSERT INTO runs VALUES (1, 600000);
CREATE TABLE cohorts (run_id BIGINT, base_id TEXT COLLATE \"C\", next_leg BIGINT NOT NULL,
    legs BIGINT NOT NULL, remaining BIGINT NOT NULL, n_success BIGINT NOT NULL,
    PRIMARY KEY (run_id, base_id));
INSERT INTO cohorts VALUES (1, 'leg', 0, 600000, 600000, 0);
CREATE TABLE leg_batches (run_id BIGINT NOT NULL, base_id TEXT COLLATE \"C\" NOT NULL,
    first_leg BIGINT NOT NULL, last_leg BIGINT NOT NULL, status TEXT NOT NULL, runner TEXT,
    token TEXT, lease_expires DOUBLE PRECISION, outcomes SMALLINT[],
    PRIMARY KEY (run_id, base_id, first_leg));
CREATE INDEX leg_batches_leases ON leg_batches (lease_expires) WHERE status = 'running';
CREATE FUNCTION complete_claim(p_runner TEXT) RETURNS TEXT LANGUAGE plpgsql AS \$fn\$
DECLARE n BIGINT; first BIGINT; v TEXT;
BEGIN
    UPDATE $schema.leg_batches SET status = 'completed', token = NULL,
           outcomes = array_fill(0::SMALLINT, ARRAY[(last_leg - first_leg + 1)::INT])
     WHERE run_id = 1 AND status = 'running' AND runner = p_runner
    RETURNING last_leg - first_leg + 1 INTO n;
    n := coalesce(n, 0);
    UPDATE $schema.cohorts SET next_leg = next_leg + 32,
           remaining = remaining - n, n_success = n_success + n
     WHERE run_id = 1 AND base_id = 'leg' RETURNING next_leg - 32 INTO first;
    INSERT INTO $schema.leg_batches
    VALUES (1, 'leg', first, first + 31, 'running', p_runner,
            replace(gen_random_uuid()::TEXT, '-', ''), 1)
    RETURNING json_build_object('first', first_leg, 'last', last_leg, 'token', token)::TEXT INTO v;
    UPDATE $schema.runs SET remaining = remaining - n WHERE id = 1;
    RETURN v;
END \$fn\$;" "SELECT $schema.complete_claim(:client_id::TEXT);"
