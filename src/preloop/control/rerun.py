"""A re-run (GitHub's "re-run failed jobs" / "re-run all jobs") as set-based
statements over the old run's rows: no graph load."""

from __future__ import annotations

import re
from typing import Any


def attempt_of(context: dict[str, Any]) -> int:
    """The `github.run_attempt` a run's contexts hold (1 when none)."""
    try:
        return int((context.get("github") or {}).get("run_attempt") or 1)
    except (TypeError, ValueError):
        return 1


def with_attempt(context: dict[str, Any], attempt: int) -> dict[str, Any]:
    """A re-run's contexts: the run's, with `github.run_attempt` (GitHub
    counts a run's attempts from 1; the run number stays)."""
    return {**context, "github": {**(context.get("github") or {}), "run_attempt": str(attempt)}}


# A job of the old run that a failed-only re-run keeps: it succeeded with
# every ancestor succeeding, or an enclosing reusable caller is kept whole.
# (`:keep` is 1 for a failed-only re-run, 0 to re-run everything.)
_KEPT = (
    "(:keep = 1 AND ((o.conclusion = 'success' AND o.anc_bad = 0) OR EXISTS ("
    "SELECT 1 FROM jobs c WHERE c.run_id = o.run_id AND c.kind = 'caller' "
    "AND c.conclusion = 'success' AND c.anc_bad = 0 "
    "AND substr(o.id, 1, length(c.id) + 1) = c.id || '/')))"
)


# A leg of a deferred matrix (its parent row is `expanded`): re-run-all drops
# it, and the parent expands again.
_DEFERRED_LEG = (
    "EXISTS (SELECT 1 FROM jobs p WHERE p.run_id = o.run_id AND p.status = 'expanded' "
    "AND p.id = o.base_id AND o.id <> o.base_id)"
)


_RERUN_SQL = [
    # Jobs: kept ones as they ended, the rest back to blocked.
    "INSERT INTO jobs (run_id, id, seq, base_id, name, kind, needs, if_expr, runs_on, cohort, "
    "matrix, strategy, continue_on_error, timeout_minutes, conc_group, conc_group_expr, "
    "conc_cancel, conc_queue_max, outputs_expr, caller, inner_job_ids, deferred_matrix, spec, "
    "status, conclusion, outputs, reason, remaining_needs, capped, completed_at) "
    "SELECT :new, o.id, o.seq, o.base_id, o.name, o.kind, o.needs, o.if_expr, o.runs_on, "
    "o.cohort, o.matrix, o.strategy, o.continue_on_error, o.timeout_minutes, "
    "CASE WHEN o.conc_group_expr IS NULL THEN o.conc_group END, o.conc_group_expr, "
    "o.conc_cancel, o.conc_queue_max, o.outputs_expr, o.caller, "
    f"CASE WHEN o.status = 'expanded' AND NOT {_KEPT} AND :keep = 0 THEN '[]' "
    "ELSE o.inner_job_ids END, o.deferred_matrix, o.spec, "
    f"CASE WHEN {_KEPT} THEN o.status "
    "WHEN o.status = 'expanded' AND :keep = 1 THEN 'expanded' ELSE 'blocked' END, "
    f"CASE WHEN {_KEPT} THEN o.conclusion END, CASE WHEN {_KEPT} THEN o.outputs END, "
    f"CASE WHEN {_KEPT} THEN o.reason END, 0, o.capped, "
    f"CASE WHEN {_KEPT} THEN o.completed_at END "
    f"FROM jobs o WHERE o.run_id = :old AND NOT (:keep = 0 AND {_DEFERRED_LEG})",
    "INSERT INTO deps (run_id, need, job_id) SELECT :new, need, job_id FROM deps "
    "WHERE run_id = :old",
    "INSERT INTO cohorts (run_id, id, max_parallel, fail_fast, total) "
    "SELECT :new, id, max_parallel, fail_fast, total FROM cohorts WHERE run_id = :old",
    # Units: members still to run; a unit whose members are all kept keeps its result.
    "INSERT INTO units (run_id, base_id, caller, remaining, n_success, outputs, result) "
    "SELECT :new, u.base_id, u.caller, k.pending, k.kept, "
    "CASE WHEN k.pending = 0 THEN u.outputs ELSE '{}' END, "
    "CASE WHEN k.pending = 0 THEN u.result END FROM units u JOIN ("
    "SELECT base_id, SUM(CASE WHEN status = 'blocked' THEN 1 ELSE 0 END) AS pending, "
    "SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END) AS kept FROM jobs "
    "WHERE run_id = :new AND status <> 'expanded' GROUP BY base_id) k ON k.base_id = u.base_id "
    "WHERE u.run_id = :old",
    # A caller's start unit: done when the caller is kept, else it starts again.
    "INSERT INTO units (run_id, base_id, remaining, n_success, result) "
    "SELECT :new, '^' || id, CASE WHEN status = 'blocked' THEN 1 ELSE 0 END, "
    "CASE WHEN status = 'blocked' THEN 0 ELSE 1 END, "
    "CASE WHEN status = 'blocked' THEN NULL ELSE 'success' END "
    "FROM jobs WHERE run_id = :new AND kind = 'caller'",
    "UPDATE jobs SET remaining_needs = (SELECT COUNT(*) FROM deps d JOIN units u "
    "ON u.run_id = d.run_id AND u.base_id = d.need WHERE d.run_id = jobs.run_id "
    "AND d.job_id = jobs.id AND u.remaining > 0), "
    "remaining_inner = (SELECT COUNT(*) FROM units i WHERE i.run_id = jobs.run_id "
    "AND i.caller = jobs.id AND i.remaining > 0) "
    "WHERE run_id = :new AND status = 'blocked'",
    "UPDATE runs SET remaining_jobs = (SELECT COUNT(*) FROM jobs WHERE run_id = :new "
    "AND status = 'blocked') WHERE id = :new",
]


def _rerun_statement(sql: str, new: int, old: int, keep: int) -> tuple[str, tuple[Any, ...]]:
    """A `_RERUN_SQL` statement with its named markers made positional."""
    marker = re.compile(r":(new|old|keep)\b")
    values = {"new": new, "old": old, "keep": keep}
    params = tuple(values[n] for n in marker.findall(sql))
    return marker.sub("?", sql), params
