"""Claims and batch completions: the claim statement on SQLite (PostgreSQL
claims inside `preloop_complete_claim`, schema migration 5), lite's
set-based completion of one run's batch (the counterpart of that function's
completion half, under the same rules), and the guards and lease rows both
stores share."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from preloop.control.db import Row, StoreError, Tx
from preloop.control.queries import Q
from preloop.control.rows import _dumps, _loads, _plain
from preloop.control.types import (
    TERMINAL,
    Completion,
    JobResultItem,
    Lease,
    NonTerminalConclusion,
    UnknownRun,
)

_SLOW_PATH = "PLSLO"  # preloop_complete_claim: this batch needs the Python cascade
_RUN_ROW_BUSY = "PLLCK"  # preloop_complete_claim: the run row was not had in time
# Why a batch left the one-statement path: the end of the PLSLO message
# `preloop_complete_claim` raises when only a unit or the run ending sent it
# to the cascade (schema migration 19), which its cascade mode then takes.
_ENDED_MARK = ": a unit ends"
_SLOW_ENDED = "ended"
_SLOW_OTHER = "other"


def _check_terminal(run_id: int, job_id: str, conclusion: str) -> None:
    if conclusion not in TERMINAL:
        raise NonTerminalConclusion(
            f"run {run_id} job {job_id!r}: {conclusion!r} does not end a job; "
            f"use one of {', '.join(sorted(TERMINAL))}"
        )


@dataclass(slots=True)
class _Claim:
    """What a runner asks for: up to `limit` jobs its `labels` all cover
    (`labels` None: any job, whatever its labels).

    `at` is the claim's time, fixed for every attempt of one operation: the
    jobs it claims start at `at` under `runner`, which is how a retry after
    a lost answer (PostgreSQL) finds the claims the lost attempt committed
    instead of claiming others and orphaning those (`attempts` counts)."""

    runner: str
    labels: list[str] | None
    limit: int
    lease_seconds: float
    run_id: int | None
    at: float = field(default_factory=time.time)
    attempts: int = 0

    @staticmethod
    def of(
        runner: str,
        labels: Sequence[str] | None,
        limit: int,
        lease_seconds: float,
        run_id: int | None,
    ) -> _Claim:
        wanted = (
            None if labels is None else sorted({lb.strip().lower() for lb in labels if lb.strip()})
        )
        return _Claim(runner, wanted, max(0, int(limit)), lease_seconds, run_id)


def _claim_lite(tx: Tx, claim: _Claim) -> list[Lease]:
    """The claim statement on SQLite (one writer: no row locks to skip)."""
    now = time.time()
    if claim.labels is None:
        match = "1 = 1"
    elif claim.labels:
        marks = ", ".join("?" for _ in claim.labels)
        match = f"NOT EXISTS (SELECT 1 FROM json_each(j.runs_on) WHERE value NOT IN ({marks}))"
    else:
        match = "j.runs_on = '[]'"
    only_run = "" if claim.run_id is None else " AND j.run_id = ?"
    rows = tx.execute(
        "UPDATE jobs SET status = 'running', runner = ?, lease_token = lower(hex(randomblob(16))), "
        "lease_expires = ?, started_at = ?, attempt = attempt + 1 "
        "WHERE rowid IN (SELECT j.rowid FROM jobs j "
        f"WHERE j.status = 'queued' AND {match}{only_run} "
        "ORDER BY j.run_id, j.seq LIMIT ?) "
        "RETURNING run_id, id, seq, name, attempt, spec, matrix, strategy, timeout_minutes, "
        "lease_token",
        (
            claim.runner,
            now + claim.lease_seconds,
            now,
            *(claim.labels or ()),
            *(() if claim.run_id is None else (claim.run_id,)),
            claim.limit,
        ),
    )
    rows.sort(key=lambda r: (int(r["run_id"]), int(r["seq"])))
    return [_lease(r, claim, now) for r in rows]


class _SlowPath(Exception):
    """The batch needs the cascade in Python (see `_complete_lite_fast`)."""


def run_outputs_length(tx: Tx, run_id: int, but: str | None = None) -> int:
    """The length of run `run_id`'s recorded job outputs (their stored JSON),
    but job `but`'s. Read with the run row locked, so it stays true until
    the transaction ends."""
    row = tx.one(Q["run_outputs_length_select_jobs"], (run_id, but or ""))
    return int(row["n"]) if row is not None else 0


def _complete_lite_fast(
    tx: Tx, results: Sequence[JobResultItem], outputs_max: int
) -> list[Completion] | None:
    """SQLite's counterpart of `preloop_complete_claim`'s completion half: a
    batch of one run's results as a few set-based statements inside a
    savepoint; None (the savepoint rolled back, nothing written) when the
    batch needs the Python cascade. The same rules decide as on PostgreSQL
    (outputs that take the run's over `outputs_max` included)."""
    run_id = results[0][0].run_id
    tx.execute(Q["complete_lite_fast_savepoint"])
    try:
        done = _lite_fast_body(tx, run_id, results, outputs_max)
    except _SlowPath:
        tx.execute(Q["complete_lite_fast_rollback"])
        tx.execute(Q["complete_lite_fast_release_2"])
        return None
    tx.execute(Q["complete_lite_fast_release"])
    return done


def _lite_fast_body(
    tx: Tx, run_id: int, results: Sequence[JobResultItem], outputs_max: int
) -> list[Completion]:
    n = len(results)
    run = tx.one(
        Q["lite_fast_body_update_runs"],
        (n, run_id),
    )
    if run is None or int(run["remaining_jobs"]) <= 0:
        raise _SlowPath
    values = ", ".join("(?, ?, ?, ?)" for _ in results)
    params: list[Any] = []
    for lease, conclusion, outputs in results:
        params += [lease.job_id, conclusion, _dumps(outputs or {}), lease.token]
    rows = tx.execute(
        "UPDATE jobs SET status = 'completed', conclusion = CASE WHEN jobs.cancel_requested = 1 "
        "AND v.column2 <> 'skipped' THEN 'cancelled' ELSE v.column2 END, outputs = v.column3, "
        "completed_at = ?, lease_token = NULL "
        f"FROM (VALUES {values}) AS v WHERE jobs.run_id = ? AND jobs.id = v.column1 "
        "AND jobs.status = 'running' AND jobs.lease_token = v.column4 "
        "RETURNING jobs.id, base_id, cohort, kind, holds_slot, holds_group, continue_on_error, "
        "anc_fail, anc_bad, conclusion, outputs",
        (time.time(), *params, run_id),
    )
    if len(rows) < n:
        raise _SlowPath  # a lease not held, a duplicate: the slow path says which
    if any(outputs for _, _, outputs in results) and run_outputs_length(tx, run_id) > outputs_max:
        raise _SlowPath  # the slow path refuses the outputs that go over
    units: dict[str, list[int]] = {}  # base -> [count, success, cancelled, skipped, af, ab]
    unit_outputs: dict[str, list[str]] = {}
    slots: dict[str, int] = {}
    cancelled = 0
    for r in rows:
        eff = r["conclusion"]
        if eff == "failure" and r["continue_on_error"]:
            eff = "success"
        if r["kind"] != "job" or r["holds_group"] is not None or eff == "failure":
            raise _SlowPath
        u = units.setdefault(r["base_id"], [0, 0, 0, 0, 0, 0])
        u[0] += 1
        u[1 if eff == "success" else 2 if eff == "cancelled" else 3] += 1
        u[4] = max(u[4], int(r["anc_fail"]))
        u[5] = max(u[5], int(r["anc_bad"]))
        cancelled += eff == "cancelled"
        if r["outputs"] != "{}":
            unit_outputs.setdefault(r["base_id"], []).append(r["outputs"])
        if r["holds_slot"]:
            slots[r["cohort"]] = slots.get(r["cohort"], 0) + 1
    for base, (cnt, ns, nc, nk, af, ab) in units.items():
        outs = unit_outputs.get(base, [])
        if len(outs) > 1:
            raise _SlowPath  # which leg's output wins is the cascade's call
        merge = ", outputs = json_patch(outputs, ?)" if outs else ""
        left = tx.one(
            "UPDATE units SET remaining = remaining - ?, n_success = n_success + ?, "
            "n_cancelled = n_cancelled + ?, n_skipped = n_skipped + ?, "
            f"anc_fail = max(anc_fail, ?), anc_bad = max(anc_bad, ?){merge} "
            "WHERE run_id = ? AND base_id = ? RETURNING remaining",
            (cnt, ns, nc, nk, af, ab, *outs, run_id, base),
        )
        if left is None or int(left["remaining"]) <= 0:
            raise _SlowPath
    if cancelled:
        tx.execute(Q["lite_fast_body_update_runs_2"], (cancelled, run_id))
    for cohort, freed in slots.items():
        nxt = tx.execute(
            Q["lite_fast_body_select_jobs"],
            (run_id, cohort, freed),
        )
        if not all(_plain(j) for j in nxt):
            raise _SlowPath
        if nxt:
            marks = ", ".join("?" for _ in nxt)
            tx.execute(
                "UPDATE jobs SET status = 'queued', holds_slot = 1 WHERE run_id = ? "
                f"AND id IN ({marks})",
                (run_id, *(j["id"] for j in nxt)),
            )
        if len(nxt) < freed:
            tx.execute(
                Q["lite_fast_body_update_cohorts"],
                (freed - len(nxt), run_id, cohort),
            )
    conclusions = {r["id"]: r["conclusion"] for r in rows}
    return [
        Completion(run_id, lease.job_id, conclusions[lease.job_id], True) for lease, _, _ in results
    ]


def _leases_pg(doc: str | None, claim: _Claim, now: float) -> list[Lease]:
    """The leases of a PostgreSQL claim's answer (schema migration 19), in
    claim order (run, seq): a batch that queued jobs under the run row claims
    them after its first claim and appends them (migration 22)."""
    if doc is None:
        return []
    expires = now + claim.lease_seconds
    claimed = json.loads(doc)
    claimed.sort(key=lambda c: (int(c[0][0]), int(c[0][2])))
    return [
        Lease(
            run_id=int(run_id),
            job_id=job_id,
            name=name,
            token=token,
            runner=claim.runner,
            expires_at=expires,
            attempt=int(attempt),
            spec=spec,
            matrix=matrix,
            strategy=strategy,
            timeout_minutes=float(timeout),
        )
        for (run_id, job_id, _seq, name, attempt, timeout, token), spec, matrix, strategy in claimed
    ]


def _lease(row: Row, claim: _Claim, now: float) -> Lease:
    return Lease(
        run_id=int(row["run_id"]),
        job_id=row["id"],
        name=row["name"],
        token=row["lease_token"],
        runner=claim.runner,
        expires_at=now + claim.lease_seconds,
        attempt=int(row["attempt"]),
        spec=_loads(row["spec"]),
        matrix=_loads(row["matrix"]),
        strategy=_loads(row["strategy"]),
        timeout_minutes=float(row["timeout_minutes"]),
    )


def _not_settled(tx: Tx, run_id: int, job_id: str) -> Completion:
    """Why a settle changed nothing: a duplicate (idempotent), or an error."""
    job = tx.one(Q["not_settled_select_jobs"], (run_id, job_id))
    if job is None:
        raise UnknownRun(f"run {run_id} has no job {job_id!r}")
    if job["status"] in ("completed", "expanded"):
        return Completion(run_id, job_id, job["conclusion"] or "skipped", False)
    if job["status"] == "folding":
        raise StoreError(
            f"run {run_id} job {job_id!r} is a reusable-workflow caller: it ends when its "
            "inner jobs end"
        )
    raise StoreError(
        f"run {run_id} job {job_id!r}: this lease is not held (the job is {job['status']}); "
        "stop the job"
    )
