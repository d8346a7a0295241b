-- The scheduler's SQL, one named statement each (the format of procrastinate's
-- sql/queries.sql): `-- name --`, comment lines saying where it is used, then the
-- statement. Written once with `?` placeholders for both stores (the pg backend
-- rewrites them to %s); statements built at run time (IN lists, dialect
-- fragments, column lists) stay next to their code.

-- pg_call_select_preloop_complete_claim --
-- store: Store._pg_call (run_row and ended: NULL unless in cascade mode)
SELECT settled, claimed, wait_us, hold_us, run_row, ended FROM preloop_complete_claim(?, ?::TEXT[], ?::TEXT[], ?::TEXT[], ?::TEXT[], ?, ?, ?::TEXT[], ?, ?, ?, ?, ?, ?)

-- pg_select_preloop_warm_settle --
-- store: Store._warm_settle (once per connection, before its first batch: schema migration 26)
SELECT preloop_warm_settle() AS paths

-- pg_cascade_select_grouped_job --
-- store: Store._pg_cascade (a run whose jobs meet in a group settles a batch job by job)
SELECT 1 AS grouped FROM jobs WHERE run_id = ? AND (conc_group IS NOT NULL OR conc_group_expr IS NOT NULL) LIMIT 1

-- settle_pg_select_preloop_settle --
-- store: Store._settle_pg
SELECT run_row, job_row, unit_row, admitted, wait_us, refused_used FROM preloop_settle(?, ?, ?, ?, ?, ?, ?, ?)

-- settle_pg_update_jobs_reason --
-- store: Store._settle_pg (outputs over the run's limit)
UPDATE jobs SET reason = ? WHERE run_id = ? AND id = ?

-- submit_run_update_runs_group --
-- store: Store.submit_run.tx_fn (a group that uses github.run_id, known once inserted)
UPDATE runs SET conc_group = ? WHERE id = ?

-- submit_run_insert_runs --
-- store: Store.submit_run.tx_fn
INSERT INTO runs (workflow, name, event, status, remaining_jobs, conc_group, conc_cancel, conc_queue_max, context, created_at) VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?) RETURNING id

-- rerun_select_runs_context --
-- store: Store.rerun.tx_fn (the run's contexts, for the next attempt's; the run it repeats)
SELECT context, rerun_of FROM runs WHERE id = ?

-- rerun_upsert_run_attempts --
-- store: Store.rerun.tx_fn (the next attempt of the first run of a chain of re-runs)
INSERT INTO run_attempts (first_run, last) VALUES (?, ?) ON CONFLICT (first_run) DO UPDATE SET last = run_attempts.last + 1 RETURNING last

-- rerun_select_later_runs --
-- store: Store.rerun.tx_fn (latest_only: a run that re-runs this one already)
SELECT id FROM runs WHERE rerun_of = ? ORDER BY id DESC LIMIT 1

-- rerun_insert_runs --
-- store: Store.rerun.tx_fn
INSERT INTO runs (workflow, name, event, status, remaining_jobs, conc_group, conc_cancel, conc_queue_max, context, created_at, rerun_of) SELECT workflow, name, event, 'running', 0, conc_group, conc_cancel, conc_queue_max, ?, ?, id FROM runs WHERE id = ? RETURNING id

-- number_run_upsert_run_numbers --
-- store: Store._number_run (a workflow's next run number in its repository)
INSERT INTO run_numbers (repository, workflow, last) VALUES (?, ?, 1) ON CONFLICT (repository, workflow) DO UPDATE SET last = run_numbers.last + 1 RETURNING last

-- heartbeat_update_jobs --
-- store: Store.heartbeat.tx_fn
UPDATE jobs SET lease_expires = ? WHERE run_id = ? AND id = ? AND lease_token = ? AND status = 'running' RETURNING cancel_requested

-- name_job_update_jobs --
-- store: Store.name_job
UPDATE jobs SET name = ? WHERE run_id = ? AND id = ? AND lease_token = ? AND status = 'running'

-- job_context_select_jobs --
-- store: Store.job_context.tx_fn
SELECT run_id, id, kind, needs, matrix, strategy, caller FROM jobs WHERE run_id = ? AND id = ?

-- job_context_select_runs --
-- store: Store.job_context.tx_fn
SELECT context FROM runs WHERE id = ?

-- settle_tx_update_runs --
-- store: Store._settle_tx
UPDATE runs SET remaining_jobs = remaining_jobs + 1 WHERE id = ?

-- find_select_jobs --
-- store: Store.expire_leases.find
SELECT run_id, id, runner FROM jobs WHERE status = 'running' AND lease_expires < ? ORDER BY lease_expires LIMIT 500

-- next_lease_expiry_select_jobs --
-- store: Store.next_lease_expiry
SELECT MIN(lease_expires) AS t FROM jobs WHERE status = 'running'

-- rerun_select_runs --
-- store: Store.rerun.tx_fn
SELECT conc_cancel, conc_queue_max FROM runs WHERE id = ?

-- get_run_select_runs --
-- store: Store.get_run
SELECT * FROM runs WHERE id = ?

-- run_context_select_runs --
-- store: Store.run_context
SELECT context FROM runs WHERE id = ?

-- unfinished_run_contexts_select_runs --
-- store: Store.unfinished_run_contexts
SELECT id, context FROM runs WHERE status <> 'completed' ORDER BY id

-- run_outputs_length_select_jobs --
-- batch: run_outputs_length (both stores)
SELECT COALESCE(SUM(LENGTH(outputs)), 0) AS n FROM jobs WHERE run_id = ? AND id <> ?

-- get_job_select_jobs --
-- store: Store.get_job
SELECT * FROM jobs WHERE run_id = ? AND id = ?

-- list_jobs_select_jobs --
-- store: Store.list_jobs
SELECT * FROM jobs WHERE run_id = ? ORDER BY seq, id

-- expire_leases_select_conc_groups --
-- store: Store.expire_leases
SELECT name FROM conc_groups g WHERE holder_run IS NULL AND (EXISTS (SELECT 1 FROM jobs j WHERE j.conc_group = g.name AND j.status = 'waiting') OR EXISTS (SELECT 1 FROM runs r WHERE r.conc_group = g.name AND r.status = 'pending')) UNION SELECT group_name FROM conc_actions

-- retry_groups_select_runs --
-- store: Store._retry_groups (the runs a group's retry writes: its oldest waiter's when the group is free or its holder is to be cancelled, the holders it owes a cancellation, every waiter's when it owes room)
WITH g AS (SELECT ?::TEXT AS name), acts AS (SELECT a.action, a.holder_run FROM conc_actions a JOIN g ON a.group_name = g.name), waiters AS (SELECT j.run_id, j.wait_seq FROM jobs j JOIN g ON j.conc_group = g.name WHERE j.status = 'waiting' UNION ALL SELECT r.id, r.wait_seq FROM runs r JOIN g ON r.conc_group = g.name WHERE r.status = 'pending') SELECT run_id FROM (SELECT run_id FROM waiters ORDER BY wait_seq LIMIT 1) oldest WHERE NOT EXISTS (SELECT 1 FROM conc_groups c JOIN g ON c.name = g.name WHERE c.holder_run IS NOT NULL) OR EXISTS (SELECT 1 FROM acts WHERE action = 'cancel_holder') UNION SELECT holder_run FROM acts WHERE holder_run IS NOT NULL UNION SELECT run_id FROM waiters WHERE EXISTS (SELECT 1 FROM acts WHERE action = 'make_room')

-- retry_groups_select_conc_groups --
-- store: Store._retry_groups.tx_fn
SELECT name FROM conc_groups WHERE name = ? FOR UPDATE

-- acquire_group --
-- cascade: _ACQUIRE
INSERT INTO conc_groups (name, holder_run, holder_job) VALUES (?, ?, ?) ON CONFLICT (name) DO UPDATE SET holder_run = excluded.holder_run, holder_job = excluded.holder_job WHERE conc_groups.holder_run IS NULL AND NOT EXISTS (SELECT 1 FROM jobs w WHERE w.conc_group = ? AND w.status = 'waiting') AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.conc_group = ? AND r.status = 'pending') RETURNING name

-- end_run_update_runs --
-- cascade: _Cascade.end_run
UPDATE runs SET status = 'completed', conclusion = ?, completed_at = ? WHERE id = ?

-- conclude_update_jobs --
-- cascade: _Cascade._do_conclude
UPDATE jobs SET status = 'completed', conclusion = ?, outputs = ?, reason = ?, completed_at = ?, lease_token = NULL WHERE run_id = ? AND id = ? AND status = ? RETURNING id

-- end_unit_update_units --
-- cascade: _Cascade._do_end_unit
UPDATE units SET result = ? WHERE run_id = ? AND base_id = ?

-- fill_cohort_select_cohorts --
-- cascade: _Cascade._do_fill_cohort
SELECT max_parallel - active AS free FROM cohorts WHERE run_id = ? AND id = ?

-- fill_cohort_update_cohorts --
-- cascade: _Cascade._do_fill_cohort
UPDATE cohorts SET active = active + ? WHERE run_id = ? AND id = ?

-- skip_inner_update_jobs --
-- cascade: _Cascade.skip_inner
UPDATE jobs SET status = 'completed', conclusion = ?, completed_at = ? WHERE run_id = ? AND id >= ? AND id < ? AND status = 'blocked' RETURNING id

-- skip_inner_update_units --
-- cascade: _Cascade.skip_inner
UPDATE units SET remaining = 0, result = ? WHERE run_id = ? AND base_id = ?

-- caller_started_update_units --
-- cascade: _Cascade.caller_started
UPDATE units SET remaining = 0, n_success = 1 WHERE run_id = ? AND base_id = ? RETURNING *

-- fold_select_units --
-- cascade: _Cascade._do_fold
SELECT base_id, result, outputs FROM units WHERE run_id = ? AND caller = ?

-- expand_select_jobs --
-- cascade: _Cascade.expand
SELECT * FROM jobs WHERE run_id = ? AND id = ?

-- expand_value_select_cohorts --
-- cascade: _Cascade._expand_value
SELECT max_parallel, fail_fast FROM cohorts WHERE run_id = ? AND id = ?

-- insert_expansion_insert_deps --
-- cascade: _Cascade.insert_expansion
INSERT INTO deps (run_id, need, job_id) VALUES (?, ?, ?)

-- insert_expansion_insert_units --
-- cascade: _Cascade.insert_expansion
INSERT INTO units (run_id, base_id, caller, remaining) VALUES (?, ?, ?, ?)

-- insert_expansion_update_jobs --
-- cascade: _Cascade.insert_expansion
UPDATE jobs SET status = 'expanded', inner_job_ids = ?, completed_at = ? WHERE run_id = ? AND id = ?

-- insert_expansion_update_units --
-- cascade: _Cascade.insert_expansion
UPDATE units SET remaining = remaining + ? WHERE run_id = ? AND base_id = ?

-- admit_update_cohorts --
-- cascade: _Cascade._do_admit
UPDATE cohorts SET admitted = CASE WHEN active < max_parallel THEN 1 ELSE 0 END, active = CASE WHEN active < max_parallel THEN active + 1 ELSE active END WHERE run_id = ? AND id = ? RETURNING admitted

-- through_group_update_jobs --
-- cascade: _Cascade.through_group
UPDATE jobs SET status = 'waiting', holds_slot = ?, conc_group = ?, wait_seq = ? WHERE run_id = ? AND id = ?

-- make_room_select_jobs --
-- cascade: _Cascade.make_room
SELECT run_id, id, wait_seq, 0 AS is_run FROM jobs WHERE conc_group = ? AND status = 'waiting' UNION ALL SELECT id AS run_id, NULL AS id, wait_seq, 1 AS is_run FROM runs WHERE conc_group = ? AND status = 'pending' ORDER BY wait_seq DESC LIMIT 1000000 OFFSET ?

-- cancel_holder_select_conc_groups --
-- cascade: _Cascade.cancel_holder
SELECT holder_run, holder_job FROM conc_groups WHERE name = ?

-- defer_insert_conc_actions --
-- cascade: _Cascade.defer
INSERT INTO conc_actions (group_name, action, queue_max, holder_run, holder_job) VALUES (?, ?, ?, ?, ?)

-- run_deferred_delete_conc_actions --
-- cascade: _Cascade.run_deferred
DELETE FROM conc_actions WHERE group_name = ? RETURNING id, action, queue_max, holder_run, holder_job

-- release_group_update_conc_groups --
-- cascade: _Cascade._do_release_group
UPDATE conc_groups SET holder_run = NULL, holder_job = NULL WHERE name = ? AND holder_run = ? AND holder_job = ? RETURNING name

-- acquire_run_group_update_runs --
-- cascade: _Cascade.acquire_run_group
UPDATE runs SET status = 'pending', wait_seq = ? WHERE id = ?

-- cancel_pending_run_update_jobs --
-- cascade: _Cascade.cancel_pending_run
UPDATE jobs SET status = 'completed', conclusion = 'cancelled', reason = ?, completed_at = ? WHERE run_id = ? AND status = 'blocked' RETURNING id

-- cancel_pending_run_update_units --
-- cascade: _Cascade.cancel_pending_run
UPDATE units SET n_cancelled = n_cancelled + remaining, remaining = 0, result = 'cancelled' WHERE run_id = ?

-- cancel_pending_run_update_runs --
-- cascade: _Cascade.cancel_pending_run
UPDATE runs SET status = 'completed', conclusion = 'cancelled', cancel_requested = 1, remaining_jobs = remaining_jobs - ?, completed_at = ? WHERE id = ?

-- cancel_run_update_runs --
-- cascade: _Cascade.cancel_run
UPDATE runs SET cancel_requested = 1 WHERE id = ?

-- fail_fast_select_cohorts --
-- cascade: _Cascade._do_fail_fast
SELECT fail_fast FROM cohorts WHERE run_id = ? AND id = ?

-- fail_fast_update_jobs --
-- cascade: _Cascade._do_fail_fast
UPDATE jobs SET cancel_requested = 1, reason = COALESCE(reason, ?) WHERE run_id = ? AND cohort = ? AND status = 'running'

-- cancel_caller_update_jobs --
-- cascade: _Cascade.cancel_caller
UPDATE jobs SET cancel_requested = 1, reason = COALESCE(reason, ?) WHERE run_id = ? AND ((id >= ? AND id < ? AND status IN ('running', 'folding')) OR id = ?)

-- context_select_runs --
-- cascade: _Cascade.context
SELECT context FROM runs WHERE id = ?

-- start_run_select_runs --
-- cascade: _Cascade.start_run
SELECT remaining_jobs, failed_jobs, cancelled_jobs, cancel_requested, conc_group FROM runs WHERE id = ?

-- end_run_update_conc_groups --
-- cascade: _Cascade.end_run
UPDATE conc_groups SET holder_run = NULL, holder_job = NULL WHERE name = ? AND holder_run = ? AND holder_job IS NULL RETURNING name

-- insert_expansion_insert_cohorts --
-- cascade: _Cascade.insert_expansion
INSERT INTO cohorts (run_id, id, max_parallel, fail_fast, total) VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_id, id) DO UPDATE SET max_parallel = excluded.max_parallel, fail_fast = excluded.fail_fast, total = excluded.total

-- insert_expansion_update_jobs_2 --
-- cascade: _Cascade.insert_expansion
UPDATE jobs SET anc_fail = ?, anc_bad = ? WHERE run_id = ? AND base_id = ? AND status = 'blocked'

-- insert_expansion_select_jobs --
-- cascade: _Cascade.insert_expansion
SELECT inner_job_ids FROM jobs WHERE run_id = ? AND id = ?

-- admit_update_jobs --
-- cascade: _Cascade._do_admit
UPDATE jobs SET status = 'parked' WHERE run_id = ? AND id = ?

-- release_slot_update_cohorts --
-- cascade: _Cascade._do_release_slot
UPDATE cohorts SET active = active - 1 WHERE run_id = ? AND id = ?

-- cancel_holder_update_jobs --
-- cascade: _Cascade.cancel_holder
UPDATE jobs SET cancel_requested = 1, reason = COALESCE(reason, ?) WHERE run_id = ? AND id = ?

-- promote_group_select_jobs --
-- cascade: _Cascade.promote_group
SELECT run_id, id, wait_seq, 0 AS is_run FROM jobs WHERE conc_group = ? AND status = 'waiting' UNION ALL SELECT id AS run_id, NULL AS id, wait_seq, 1 AS is_run FROM runs WHERE conc_group = ? AND status = 'pending' ORDER BY wait_seq LIMIT 1

-- conclude_update_jobs_2 --
-- cascade: _Cascade._do_conclude
UPDATE jobs SET cancel_requested = 1, reason = COALESCE(reason, ?) WHERE run_id = ? AND id = ? AND status = 'running'

-- end_unit_select_deps --
-- cascade: _Cascade._do_end_unit
SELECT job_id FROM deps WHERE run_id = ? AND need = ?

-- insert_expansion_update_jobs_3 --
-- cascade: _Cascade.insert_expansion
UPDATE jobs SET inner_job_ids = ? WHERE run_id = ? AND id = ?

-- promote_group_update_conc_groups --
-- cascade: _Cascade.promote_group
UPDATE conc_groups SET holder_run = holder_run WHERE name = ? AND holder_run IS NULL RETURNING name

-- promote_group_update_conc_groups_2 --
-- cascade: _Cascade.promote_group
UPDATE conc_groups SET holder_run = ?, holder_job = NULL WHERE name = ?

-- promote_group_update_runs --
-- cascade: _Cascade.promote_group
UPDATE runs SET status = 'running' WHERE id = ?

-- promote_group_update_conc_groups_3 --
-- cascade: _Cascade.promote_group
UPDATE conc_groups SET holder_run = ?, holder_job = ? WHERE name = ?

-- cancel_run_update_jobs --
-- cascade: _Cascade.cancel_run
UPDATE jobs SET cancel_requested = 1, reason = COALESCE(reason, ?) WHERE run_id = ? AND id = ?

-- finish_update_runs --
-- cascade: _Cascade.finish
UPDATE runs SET remaining_jobs = remaining_jobs + ?, failed_jobs = failed_jobs + ?, cancelled_jobs = cancelled_jobs + ? WHERE id = ? RETURNING remaining_jobs, failed_jobs, cancelled_jobs, status, cancel_requested, conc_group

-- complete_lite_fast_savepoint --
-- batch: _complete_lite_fast
SAVEPOINT complete_fast

-- complete_lite_fast_release --
-- batch: _complete_lite_fast
RELEASE complete_fast

-- lite_fast_body_update_runs --
-- batch: _lite_fast_body
UPDATE runs SET remaining_jobs = remaining_jobs - ? WHERE id = ? RETURNING remaining_jobs

-- not_settled_select_jobs --
-- batch: _not_settled
SELECT status, conclusion, kind FROM jobs WHERE run_id = ? AND id = ?

-- lite_fast_body_update_runs_2 --
-- batch: _lite_fast_body
UPDATE runs SET cancelled_jobs = cancelled_jobs + ? WHERE id = ?

-- lite_fast_body_select_jobs --
-- batch: _lite_fast_body
SELECT id, kind, conc_group, conc_group_expr FROM jobs WHERE run_id = ? AND cohort = ? AND status = 'parked' ORDER BY seq LIMIT ?

-- complete_lite_fast_rollback --
-- batch: _complete_lite_fast
ROLLBACK TO complete_fast

-- complete_lite_fast_release_2 --
-- batch: _complete_lite_fast
RELEASE complete_fast

-- lite_fast_body_update_cohorts --
-- batch: _lite_fast_body
UPDATE cohorts SET active = active - ? WHERE run_id = ? AND id = ?

-- insert_job --
-- rows: _INSERT_JOB
INSERT INTO jobs (run_id, id, seq, base_id, name, kind, needs, if_expr, runs_on, cohort, matrix, strategy, continue_on_error, timeout_minutes, conc_group, conc_group_expr, conc_cancel, conc_queue_max, outputs_expr, caller, inner_job_ids, deferred_matrix, spec, status, remaining_needs, remaining_inner, capped) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'blocked', ?, ?, ?)

-- insert_plan_insert_deps --
-- rows: _insert_plan
INSERT INTO deps (run_id, need, job_id) VALUES (?, ?, ?)

-- insert_plan_insert_units --
-- rows: _insert_plan
INSERT INTO units (run_id, base_id, caller, remaining) VALUES (?, ?, ?, ?)

-- insert_plan_insert_cohorts --
-- rows: _insert_plan
INSERT INTO cohorts (run_id, id, max_parallel, fail_fast, total) VALUES (?, ?, ?, ?, ?)

-- recover_claims_select_jobs --
-- store: Store._pg_call (a retry after a lost answer: the claims the lost attempt committed)
SELECT run_id, id, seq, name, attempt, spec, matrix, strategy, timeout_minutes, lease_token FROM jobs WHERE status = 'running' AND runner = ? AND started_at = ? ORDER BY run_id, seq

-- admit_grouped_select_conc_groups --
-- cascade: _Cascade._do_admit_grouped (after the acquire that locked the group row on PostgreSQL)
SELECT holder_run, (SELECT count(*) FROM jobs WHERE conc_group = ? AND status = 'waiting') + (SELECT count(*) FROM runs WHERE conc_group = ? AND status = 'pending') AS waiters FROM conc_groups WHERE name = ?
