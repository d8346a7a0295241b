"""Row helpers the store and the cascade share: the job columns the cascade
reads, the rows a plan becomes, the `needs` context of one job, matching job
ids in bulk, the query results' dataclasses, JSON in and out of TEXT columns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from preloop.control.db import Row, Tx
from preloop.control.queries import Q
from preloop.control.types import JobInfo, RunInfo
from preloop.workflow.plan import Plan, PlannedJob

SEQ_STRIDE = 4096  # room below each planned seq for deferred legs


# Columns the cascade needs from a job row.
_JOB = (
    "run_id, id, seq, base_id, kind, needs, if_expr, cohort, continue_on_error, "
    "conc_group, conc_group_expr, conc_cancel, conc_queue_max, caller, status, "
    "anc_fail, anc_bad, holds_slot, holds_group, remaining_needs, remaining_inner, "
    "matrix, strategy, outputs_expr, deferred_matrix, cancel_requested, wait_seq, capped"
)


def _dumps(v: Any) -> str:
    # Keys keep their order: a matrix's keys as written name its legs and
    # order `toJSON(matrix)`, as on GitHub.
    return json.dumps(v, separators=(",", ":"))


def _loads(v: str | None) -> Any:
    return None if v is None else json.loads(v)


def _run_info(row: Row) -> RunInfo:
    return RunInfo(
        id=int(row["id"]),
        workflow=row["workflow"],
        name=row["name"],
        event=row["event"],
        status=row["status"],
        conclusion=row["conclusion"],
        cancel_requested=bool(row["cancel_requested"]),
        remaining_jobs=int(row["remaining_jobs"]),
        rerun_of=None if row["rerun_of"] is None else int(row["rerun_of"]),
        created_at=float(row["created_at"]),
    )


def _job_info(row: Row) -> JobInfo:
    return JobInfo(
        run_id=int(row["run_id"]),
        id=row["id"],
        name=row["name"],
        base_id=row["base_id"],
        kind=row["kind"],
        status=row["status"],
        conclusion=row["conclusion"],
        outputs=_loads(row["outputs"]) or {},
        reason=row["reason"],
        runner=row["runner"],
        cancel_requested=bool(row["cancel_requested"]),
        inner_job_ids=tuple(json.loads(row["inner_job_ids"])),
        completed_at=None if row["completed_at"] is None else float(row["completed_at"]),
    )


def _start_unit(caller: str) -> str:
    """The unit an inner root job of `caller` waits on: the caller's start."""
    return f"^{caller}"


def _insert_plan(tx: Tx, run_id: int, plan: Plan) -> None:
    """Inserts jobs, dependency edges, units and cohorts of a new run."""
    jobs = plan.jobs
    unit_members: dict[str, int] = {}
    unit_caller: dict[str, str | None] = {}
    inner_units: dict[str, set[str]] = {}
    for j in jobs:
        unit_members[j.base_id] = unit_members.get(j.base_id, 0) + 1
        unit_caller[j.base_id] = j.caller
        if j.caller is not None:
            inner_units.setdefault(j.caller, set()).add(j.base_id)
    capped = {c.id for c in plan.cohorts if c.max_parallel is not None}
    job_rows = []
    dep_rows = []
    for j in jobs:
        needs = list(dict.fromkeys(j.needs))
        edges = list(needs)
        if j.caller is not None and not any(unit_caller.get(n) == j.caller for n in needs):
            edges.append(_start_unit(j.caller))
        for need in edges:
            dep_rows.append((run_id, need, j.id))
        job_rows.append(
            (
                *_job_row(run_id, j, len(edges), len(inner_units.get(j.id, ()))),
                int(j.cohort in capped),
            )
        )
    tx.executemany(_INSERT_JOB, job_rows)
    tx.executemany(Q["insert_plan_insert_deps"], dep_rows)
    units = [(run_id, b, unit_caller[b], n) for b, n in unit_members.items()]
    units += [(run_id, _start_unit(c), None, 1) for c in inner_units]
    tx.executemany(Q["insert_plan_insert_units"], units)
    tx.executemany(
        Q["insert_plan_insert_cohorts"],
        [(run_id, c.id, c.max_parallel, int(c.fail_fast), c.total) for c in plan.cohorts],
    )


_INSERT_JOB = Q["insert_job"]


def _job_row(
    run_id: int, j: PlannedJob, remaining_needs: int, remaining_inner: int
) -> tuple[Any, ...]:
    conc = j.concurrency
    return (
        run_id,
        j.id,
        j.seq * SEQ_STRIDE,
        j.base_id,
        j.name,
        j.kind,
        _dumps(list(dict.fromkeys(j.needs))),
        j.if_expr,
        _dumps(sorted({lb.lower() for lb in j.runs_on})),
        j.cohort,
        _dumps(j.matrix) if j.matrix is not None else None,
        _dumps(j.strategy) if j.strategy is not None else None,
        int(j.continue_on_error),
        j.timeout_minutes,
        conc.group if conc else None,
        conc.group_expr if conc else None,
        int(bool(conc and conc.cancel_in_progress)),
        int(bool(conc and conc.queue_max)),
        _dumps(j.outputs),
        j.caller,
        _dumps(list(j.inner_job_ids)),
        j.deferred_matrix,
        _dumps(j.spec),
        remaining_needs,
        remaining_inner,
    )


def _needs_view(tx: Tx, run_id: int, needs: list[str], caller: str | None = None) -> dict[str, Any]:
    """The job-scoped `needs` context: result and outputs of each direct need,
    keyed as the job's own workflow names them (inside a reusable workflow
    `needs.build`, stored as `<caller>/build`)."""
    if not needs:
        return {}
    prefix = f"{caller}/" if caller else ""
    marks = ", ".join("?" for _ in needs)
    rows = tx.execute(
        f"SELECT base_id, result, outputs FROM units WHERE run_id = ? AND base_id IN ({marks})",
        (run_id, *needs),
    )
    return {
        r["base_id"].removeprefix(prefix): {
            "result": r["result"],
            "outputs": json.loads(r["outputs"]),
        }
        for r in rows
    }


def _id_sets(
    tx: Tx, run_id: int, ids: list[str]
) -> Iterator[tuple[str, tuple[Any, ...], str, tuple[Any, ...]]]:
    """Jobs of `run_id` by id, one statement per yield: `(from, its params,
    where, its params)`, `from` going before the statement's WHERE. PostgreSQL
    joins the ids as one array (`unnest`), so the plan is a lookup per id or
    one pass over the run's rows whatever the statistics on fresh rows say
    (a long IN list against a stale plan was a linear search per row); SQLite
    takes IN lists in slices, each id a primary-key lookup."""
    if not ids:
        return
    if tx.dialect == "pg":
        yield (
            "FROM unnest(?::TEXT[]) AS sel(jid)",
            (list(ids),),
            "run_id = ? AND id = sel.jid",
            (run_id,),
        )
        return
    for chunk in _chunks(ids):
        marks = ", ".join("?" for _ in chunk)
        yield "", (), f"run_id = ? AND id IN ({marks})", (run_id, *chunk)


def _chunks(ids: list[str], size: int = 500) -> Iterator[list[str]]:
    """`ids` in slices small enough for any driver's parameter limit."""
    for i in range(0, len(ids), size):
        yield ids[i : i + size]


def _inner_range(caller: str) -> tuple[str, str]:
    """The id range of every job inside `caller` (nested callers' included):
    `caller/` up to `caller0`, '0' sorting right after '/' in byte order (id
    columns are C-collated, schema migration 4)."""
    return caller + "/", caller + "0"


def _plain(job: Row) -> bool:
    """A job that queues as soon as it is admitted: no concurrency group to
    go through, not a reusable caller (which starts instead)."""
    return job["kind"] == "job" and job["conc_group"] is None and job["conc_group_expr"] is None


def _unit_result(u: Row) -> str:
    if u["n_failure"]:
        return "failure"
    if u["n_cancelled"]:
        return "cancelled"
    if u["n_success"]:
        return "success"
    return "skipped"
