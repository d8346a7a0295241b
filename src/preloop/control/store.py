"""The scheduler: one `Store` over lite (SQLite) or pg (PostgreSQL).

Every public operation is one transaction (`Backend.transaction`) and reads
only the rows it involves: the run row, the job rows it changes, the `units`
rows of the needs it evaluates, the cohort and concurrency-group rows it
admits through. Nothing reads a whole run ("graph load") except the
`list_jobs` query, which counts itself in `counters.graph_loads`.

Lock order (PostgreSQL; SQLite has one writer and cannot deadlock)
 1. the operation's own run row (`Tx.lock_run`, `SELECT ... FOR UPDATE`),
    before any job, unit, cohort or group row of that run;
 2. concurrency-group rows, each locked by the statement that changes it;
 3. cohort rows, units rows, job rows of the locked run.
 On PostgreSQL the settle fast path is the `preloop_settle` function
 (schema migration 2), which takes the run row first too, then the job, its
 unit, and the next parked leg of its cohort.
 A path that must touch another run (a job-level waiter or a pending run in a
 shared concurrency group, a holder to cancel) takes that run's row with
 `FOR UPDATE SKIP LOCKED` only, never waiting: whoever holds that run row
 commits without waiting on us, and we remember the group; a cancellation
 the group owes that run (replacing an older waiter, cancel-in-progress) is
 recorded in `conc_actions`. Right after our commit a follow-up transaction
 (`_retry_groups`) carries out the group's recorded cancellations and
 re-examines it; a group being released does the same before promoting; and
 `expire_leases` (the reaper) re-examines every free group with waiters or
 recorded cancellations, so a skipped waiter or cancellation is retried,
 never lost. Claims lock a single job row with
 `FOR UPDATE SKIP LOCKED` and nothing else; heartbeats update one job row;
 a re-run locks the old run, then the new one no one else can see yet.
 The one ordering not fixed up front: a cascade that reaches two concurrency
 groups takes them in the order it reaches them. Should two such cascades
 cross, PostgreSQL detects it and the transaction is retried whole (counted
 in `counters.deadlock_retries`; the concurrency tests assert it stays 0).

Operations: submit_run, claim_job, heartbeat, job_context, complete_job,
settle_job, cancel_run, expire_leases, rerun, and the queries get_run,
list_runs, get_job, list_jobs.

Job statuses: blocked (needs not ended) -> parked (max-parallel cap) ->
waiting (concurrency group) -> queued -> running -> completed; a reusable
caller is admitted the same way and then, instead of queueing, is `folding`
while its inner jobs run (holding its slot and group until it folds); a
deferred job becomes `expanded` once its legs exist. Conclusions: success,
failure, cancelled, skipped.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from preloop import config
from preloop.control.conditions import (
    ExpressionError,
    MatrixError,
    ancestor_status,
    evaluate_expr,
    expand_matrix_value,
    should_run,
)
from preloop.control.counters import Counters
from preloop.control.db import Backend, LiteBackend, PgBackend, Row, StoreError, Tx
from preloop.control.reusable import callee_inputs, scoped_inputs, start_caller
from preloop.control.schema import QUEUE_MAX
from preloop.errors import PreloopError
from preloop.workflow.plan import Cohort, ConcurrencySpec, Plan, PlannedJob
from preloop.workflow.planner import PlanError, expand_deferred

__all__ = [
    "TERMINAL",
    "Completion",
    "Heartbeat",
    "JobInfo",
    "JobResultItem",
    "Lease",
    "NonTerminalConclusion",
    "RunInfo",
    "Store",
    "StoreError",
    "UnknownRun",
    "open_store",
]

Conclusion = Literal["success", "failure", "cancelled", "skipped"]
TERMINAL: frozenset[str] = frozenset({"success", "failure", "cancelled", "skipped"})
SEQ_STRIDE = 4096  # room below each planned seq for deferred legs
DEFAULT_LEASE_SECONDS = 60.0

# Takes a concurrency group for a job (or, holder_job NULL, a run) when it is
# free and nobody waits; the row is created on first use. On PostgreSQL the
# group row stays locked either way until commit.
_ACQUIRE = (
    "INSERT INTO conc_groups (name, holder_run, holder_job) VALUES (?, ?, ?) "
    "ON CONFLICT (name) DO UPDATE SET holder_run = excluded.holder_run, "
    "holder_job = excluded.holder_job WHERE conc_groups.holder_run IS NULL "
    "AND NOT EXISTS (SELECT 1 FROM jobs w WHERE w.conc_group = ? AND w.status = 'waiting') "
    "AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.conc_group = ? AND r.status = 'pending') "
    "RETURNING name"
)

# Columns the cascade needs from a job row.
_JOB = (
    "run_id, id, seq, base_id, kind, needs, if_expr, cohort, continue_on_error, "
    "conc_group, conc_group_expr, conc_cancel, conc_queue_max, caller, status, "
    "anc_fail, anc_bad, holds_slot, holds_group, remaining_needs, remaining_inner, "
    "matrix, strategy, outputs_expr, deferred_matrix, cancel_requested, wait_seq, capped"
)


class NonTerminalConclusion(PreloopError):
    """complete_job/settle_job was given a status that does not end a job."""

    exit_code = 2


class UnknownRun(PreloopError):
    """No run or job with that id exists in the store."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A claimed job. The runner heartbeats it and completes it."""

    run_id: int
    job_id: str
    name: str
    token: str
    runner: str
    expires_at: float
    attempt: int
    spec: dict[str, Any]
    matrix: dict[str, Any] | None
    strategy: dict[str, Any] | None
    timeout_minutes: float


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """`held` is False when the lease is gone (job ended or expired);
    `cancel_requested` tells the runner to stop the job."""

    held: bool
    cancel_requested: bool


@dataclass(frozen=True, slots=True)
class Completion:
    run_id: int
    job_id: str
    conclusion: str
    changed: bool  # False for a duplicate completion
    # `complete_and_claim` only: why this result was not recorded (the lease
    # is no longer held, the run is gone); `complete_job` raises instead.
    error: str | None = None


#: One runner result for `Store.complete_and_claim`: the lease, its
#: conclusion and its outputs (None: no outputs).
JobResultItem = tuple["Lease", str, "dict[str, Any] | None"]


@dataclass(frozen=True, slots=True)
class RunInfo:
    id: int
    workflow: str
    name: str
    event: str
    status: str
    conclusion: str | None
    cancel_requested: bool
    remaining_jobs: int


@dataclass(frozen=True, slots=True)
class JobInfo:
    run_id: int
    id: str
    name: str
    base_id: str
    kind: str
    status: str
    conclusion: str | None
    outputs: dict[str, Any]
    reason: str | None
    runner: str | None
    cancel_requested: bool
    inner_job_ids: tuple[str, ...]


def open_store(url: str | None = None) -> Store:
    """Opens (creating and migrating) a store.

    `url`: `postgresql://...` (or `postgres://`), `sqlite:///path`, a plain
    path, or None for `$PRELOOP_STORE_URL`, else the lite store at
    `<state dir>/preloop.db`.
    """
    if url is None:
        url = config.get("PRELOOP_STORE_URL") or None
    if url is None:
        return Store(LiteBackend(config.state_dir() / "preloop.db"))
    if url.startswith(("postgresql://", "postgres://")):
        return Store(PgBackend(url))
    if url.startswith("sqlite:///"):
        return Store(LiteBackend(Path(url[len("sqlite://") :])))
    if "://" in url:
        raise StoreError(
            f"unsupported store URL {url!r}: use postgresql://... or sqlite:///path "
            "(PRELOOP_STORE_URL)"
        )
    return Store(LiteBackend(Path(url)))


def _dumps(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def _loads(v: str | None) -> Any:
    return None if v is None else json.loads(v)


class Store:
    """The scheduler API. Thread-safe; each method is one transaction."""

    def __init__(self, backend: Backend) -> None:
        self._db = backend

    @property
    def dialect(self) -> str:
        return self._db.dialect

    @property
    def url(self) -> str:
        """The store's URL (`sqlite:///...` or `postgresql://...`)."""
        return self._db.url

    @property
    def counters(self) -> Counters:
        return self._db.counters

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ submit

    def submit_run(self, plan: Plan, *, github: dict[str, Any] | None = None) -> int:
        """Stores `plan` as a new run and promotes its root jobs; returns the run id."""
        context = {"env": plan.env, "inputs": plan.inputs, "github": github or {}}
        cascade_groups: set[str] = set()

        def tx_fn(tx: Tx) -> int:
            now = time.time()
            conc = plan.concurrency
            group = None
            if conc is not None:
                group = conc.group
                if group is None and conc.group_expr:
                    group = str(evaluate_expr(conc.group_expr, context))
            row = tx.one(
                "INSERT INTO runs (workflow, name, event, status, remaining_jobs, conc_group, "
                "conc_cancel, conc_queue_max, context, created_at) "
                "VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?) RETURNING id",
                (
                    plan.workflow,
                    plan.name,
                    plan.event,
                    len(plan.jobs),
                    group,
                    int(bool(conc and conc.cancel_in_progress)),
                    int(bool(conc and conc.queue_max)),
                    _dumps(context),
                    now,
                ),
            )
            assert row is not None
            run_id = int(row["id"])
            tx.lock_run(run_id)
            _insert_plan(tx, run_id, plan)
            c = _Cascade(tx, self)
            c.admit_run(run_id, group, conc)
            cascade_groups.update(c.retry_groups)
            return run_id

        run_id = self._db.transaction("submit_run", tx_fn)
        self._retry_groups(cascade_groups)
        return run_id

    def rerun(self, run_id: int, *, failed_only: bool = True) -> int:
        """A new run from an ended one (GitHub's re-run). With `failed_only`,
        jobs that succeeded with every ancestor succeeding are kept as they
        ended (outputs included) and the rest run again; otherwise every job
        runs again (deferred matrices are expanded anew). Set-based over the
        old run's rows: no graph load."""
        groups: set[str] = set()
        keep = 1 if failed_only else 0

        def tx_fn(tx: Tx) -> int:
            old = tx.lock_run(run_id)
            if old is None:
                raise UnknownRun(f"no run {run_id} in the store {self.url}")
            if old["status"] != "completed":
                raise StoreError(
                    f"run {run_id} is still {old['status']}: cancel it or wait for it to end "
                    "before re-running"
                )
            row = tx.one(
                "INSERT INTO runs (workflow, name, event, status, remaining_jobs, conc_group, "
                "conc_cancel, conc_queue_max, context, created_at, rerun_of) "
                "SELECT workflow, name, event, 'running', 0, conc_group, conc_cancel, "
                "conc_queue_max, context, ?, id FROM runs WHERE id = ? RETURNING id",
                (time.time(), run_id),
            )
            assert row is not None
            new = int(row["id"])
            tx.lock_run(new)
            for sql in _RERUN_SQL:
                tx.execute(*_rerun_statement(sql, new, run_id, keep))
            c = _Cascade(tx, self)
            group = old["conc_group"]
            spec = None
            if group is not None:
                conc = tx.one("SELECT conc_cancel, conc_queue_max FROM runs WHERE id = ?", (new,))
                assert conc is not None
                spec = ConcurrencySpec(
                    group, None, bool(conc["conc_cancel"]), bool(conc["conc_queue_max"])
                )
            c.admit_run(new, group, spec)
            groups.update(c.retry_groups)
            return new

        new_id = self._db.transaction("rerun", tx_fn)
        self._retry_groups(groups)
        return new_id

    # ------------------------------------------------------------------ claims

    def claim_job(
        self,
        runner: str,
        labels: Sequence[str],
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        run_id: int | None = None,
    ) -> Lease | None:
        """Claims the first queued job (FIFO by run, then job seq) whose
        `runs-on` labels are all among `labels` (case-insensitive). With
        `run_id`, only that run's jobs: the local runners of a `preloop run`
        serve their own run, never another one sharing the store."""
        leases = self.claim_jobs(
            runner, labels, limit=1, lease_seconds=lease_seconds, run_id=run_id
        )
        return leases[0] if leases else None

    def claim_jobs(
        self,
        runner: str,
        labels: Sequence[str],
        *,
        limit: int,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        run_id: int | None = None,
    ) -> list[Lease]:
        """Claims up to `limit` queued jobs (a runner's free capacity) in one
        statement, in the order `claim_job` takes them; fewer (or none) when
        fewer are claimable. A max-parallel matrix never has more legs queued
        than its free slots, so a batch never exceeds the cap either."""
        claim = _Claim.of(runner, labels, limit, lease_seconds, run_id)
        if claim.limit <= 0:
            return []
        if self.dialect == "pg":
            return self._db.statement("claim_job", lambda tx: self._pg_call(tx, [], claim)[1])
        return self._db.transaction("claim_job", lambda tx: _claim_lite(tx, claim))

    def heartbeat(self, lease: Lease, *, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> Heartbeat:
        """Extends `lease`; tells the runner whether to stop."""

        def tx_fn(tx: Tx) -> Heartbeat:
            row = tx.one(
                "UPDATE jobs SET lease_expires = ? WHERE run_id = ? AND id = ? "
                "AND lease_token = ? AND status = 'running' RETURNING cancel_requested",
                (time.time() + lease_seconds, lease.run_id, lease.job_id, lease.token),
            )
            if row is None:
                return Heartbeat(held=False, cancel_requested=True)
            return Heartbeat(held=True, cancel_requested=bool(row["cancel_requested"]))

        return self._db.statement("heartbeat", tx_fn)

    def job_context(self, run_id: int, job_id: str) -> dict[str, Any]:
        """The contexts a runner evaluates steps with: `needs` (direct needs:
        result and outputs), `env`, `inputs`, `github`, `matrix`, `strategy`."""

        def tx_fn(tx: Tx) -> dict[str, Any]:
            job = tx.one(
                "SELECT run_id, id, kind, needs, matrix, strategy, caller FROM jobs "
                "WHERE run_id = ? AND id = ?",
                (run_id, job_id),
            )
            run = tx.one("SELECT context FROM runs WHERE id = ?", (run_id,))
            if job is None or run is None:
                raise UnknownRun(f"run {run_id} has no job {job_id!r}")
            ctx: dict[str, Any] = dict(json.loads(run["context"]))
            ctx["needs"] = _needs_view(tx, run_id, json.loads(job["needs"]), job["caller"])
            ctx["matrix"] = _loads(job["matrix"]) or {}
            ctx["strategy"] = _loads(job["strategy"]) or {}
            if (inputs := scoped_inputs(tx, job)) is not None:
                ctx["inputs"] = inputs  # inside a reusable workflow: the callee's
            return ctx

        return self._db.transaction("job_context", tx_fn)

    # ------------------------------------------------------------------ settle

    def complete_job(
        self, lease: Lease, conclusion: str, outputs: dict[str, Any] | None = None
    ) -> Completion:
        """A runner's result for its leased job. Idempotent; a job that was
        cancelled (or told to stop) stays cancelled."""
        done, _ = self._complete_many("complete_job", [(lease, conclusion, outputs)], None)
        if isinstance(done[0], Exception):
            raise done[0]
        return done[0]

    def complete_and_claim(
        self,
        results: Sequence[JobResultItem],
        runner: str,
        labels: Sequence[str],
        *,
        limit: int | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        run_id: int | None = None,
    ) -> tuple[list[Completion], list[Lease]]:
        """A runner's results and its next claims in one transaction: every
        `(lease, conclusion, outputs)` is completed as `complete_job` would,
        then up to `limit` queued jobs (default: one per result, the capacity
        the results freed) are claimed as `claim_jobs` would. On PostgreSQL
        the common case is one statement (`preloop_complete_claim`, one round
        trip); a result whose cascade needs more (a unit or the run ending, a
        failure, a concurrency group) runs the batch as one ordinary
        transaction. A result that cannot be recorded (its lease is gone)
        comes back with `error` set instead of raising."""
        claim = _Claim.of(
            runner, labels, len(results) if limit is None else limit, lease_seconds, run_id
        )
        done, leases = self._complete_many("complete_and_claim", results, claim)
        return [
            d
            if isinstance(d, Completion)
            else Completion(lease.run_id, lease.job_id, conclusion, False, str(d))
            for d, (lease, conclusion, _) in zip(done, results, strict=True)
        ], leases

    def _complete_many(
        self, op: str, results: Sequence[JobResultItem], claim: _Claim | None
    ) -> tuple[list[Completion | PreloopError], list[Lease]]:
        for lease, conclusion, _ in results:
            _check_terminal(lease.run_id, lease.job_id, conclusion)
        if self.dialect == "pg" and len({lease.run_id for lease, _, _ in results}) <= 1:
            fast = self._complete_fast(op, results, claim)
            if fast is not None:
                return fast
        groups: set[str] = set()

        one_run = len({lease.run_id for lease, _, _ in results}) == 1

        def tx_fn(tx: Tx) -> tuple[list[Completion | PreloopError], list[Lease]]:
            done: list[Completion | PreloopError] = []
            if tx.dialect == "lite" and one_run:
                fast = _complete_lite_fast(tx, results)
                if fast is not None:
                    claimed = _claim_lite(tx, claim) if claim is not None and claim.limit else []
                    return list(fast), claimed
            # Runs in id order: two batches never wait on each other's run rows.
            order = sorted(range(len(results)), key=lambda i: results[i][0].run_id)
            by_index: dict[int, Completion | PreloopError] = {}
            for i in order:
                lease, conclusion, outputs = results[i]
                try:
                    by_index[i] = self._settle_tx(
                        tx,
                        lease.run_id,
                        lease.job_id,
                        conclusion,
                        outputs,
                        None,
                        lease.token,
                        groups,
                    )
                except (UnknownRun, StoreError) as exc:
                    by_index[i] = exc
            done = [by_index[i] for i in range(len(results))]
            leases: list[Lease] = []
            if claim is not None and claim.limit > 0:
                if tx.dialect == "pg":
                    leases = self._pg_call(tx, [], claim)[1]
                else:
                    leases = _claim_lite(tx, claim)
            return done, leases

        result = self._db.transaction(op, tx_fn)
        self._retry_groups(groups)
        return result

    def _complete_fast(
        self, op: str, results: Sequence[JobResultItem], claim: _Claim | None
    ) -> tuple[list[Completion | PreloopError], list[Lease]] | None:
        """The PostgreSQL one-statement path; None when the batch needs the
        cascade in Python (nothing was written then)."""
        import psycopg

        def fn(tx: Tx) -> tuple[list[Completion | PreloopError], list[Lease]]:
            settled, leases = self._pg_call(tx, results, claim)
            return list(settled), leases

        try:
            return self._db.statement(op, fn)
        except psycopg.Error as exc:
            if exc.sqlstate != _SLOW_PATH:
                raise
            self.counters.add_statements(op + ".fallback", 1)
            return None

    def _pg_call(
        self, tx: Tx, results: Sequence[JobResultItem], claim: _Claim | None
    ) -> tuple[list[Completion], list[Lease]]:
        """One `preloop_complete_claim` call: `results` (all of one run) and
        `claim`; raises psycopg's error with SQLSTATE PLSLO when the batch
        needs the Python cascade."""
        now = time.time()
        run_id = results[0][0].run_id if results else None
        t0 = time.perf_counter_ns()
        row = tx.one(
            "SELECT settled, claimed, wait_us FROM preloop_complete_claim("
            "?, ?::TEXT[], ?::TEXT[], ?::TEXT[], ?::TEXT[], ?, ?, ?::TEXT[], ?, ?, ?)",
            (
                run_id,
                [lease.job_id for lease, _, _ in results],
                [conclusion for _, conclusion, _ in results],
                [_dumps(outputs or {}) for _, _, outputs in results],
                [lease.token for lease, _, _ in results],
                now,
                claim.runner if claim else "",
                claim.labels if claim else [],
                claim.limit if claim else 0,
                now + (claim.lease_seconds if claim else 0.0),
                claim.run_id if claim else None,
            ),
        )
        assert row is not None
        if results:
            tx.note_lock_run_wait(t0, int(row["wait_us"]) * 1000)
        conclusions = {job_id: conclusion for job_id, conclusion in row["settled"] or []}
        done = [
            Completion(lease.run_id, lease.job_id, conclusions[lease.job_id], True)
            for lease, _, _ in results
        ]
        leases = [_lease(r, claim, now) for r in row["claimed"] or []] if claim else []
        return done, leases

    def settle_job(
        self,
        run_id: int,
        job_id: str,
        conclusion: str,
        outputs: dict[str, Any] | None = None,
        *,
        reason: str | None = None,
    ) -> Completion:
        """Ends any not-yet-ended job (the engine's path: a job that could not
        start, a local failure). Same guards as `complete_job`."""
        _check_terminal(run_id, job_id, conclusion)
        groups: set[str] = set()
        result = self._db.transaction(
            "settle_job",
            lambda tx: self._settle_tx(
                tx, run_id, job_id, conclusion, outputs, reason, None, groups
            ),
        )
        self._retry_groups(groups)
        return result

    def _settle_tx(
        self,
        tx: Tx,
        run_id: int,
        job_id: str,
        conclusion: str,
        outputs: dict[str, Any] | None,
        reason: str | None,
        token: str | None,
        groups: set[str],
    ) -> Completion:
        """Ends one job inside `tx` and runs its cascade; the concurrency
        groups to retry after commit are added to `groups`."""
        # The common path is three statements: the run row (locked by the
        # write that counts the job as ended), the job row (guarded: only
        # a live job, only the lease holder), and its unit.
        if tx.dialect == "pg":
            return self._settle_pg(tx, run_id, job_id, conclusion, outputs, reason, token, groups)
        run = tx.lock_run(run_id, settle_delta=-1)
        if run is None:
            raise UnknownRun(f"no run {run_id} in the store {self.url}")
        lease_guard = " AND status = 'running' AND lease_token = ?" if token else ""
        job = tx.one(
            "UPDATE jobs SET status = 'completed', conclusion = CASE WHEN "
            "cancel_requested = 1 AND ? <> 'skipped' THEN 'cancelled' ELSE ? END, "
            "outputs = ?, reason = ?, completed_at = ?, lease_token = NULL "
            "WHERE run_id = ? AND id = ? AND status NOT IN ('completed', 'expanded', 'folding')"
            f"{lease_guard} RETURNING {_JOB}, conclusion",
            (
                conclusion,
                conclusion,
                _dumps(outputs or {}),
                reason,
                time.time(),
                run_id,
                job_id,
                *((token,) if token else ()),
            ),
        )
        if job is None:
            tx.execute(
                "UPDATE runs SET remaining_jobs = remaining_jobs + 1 WHERE id = ?", (run_id,)
            )
            return _not_settled(tx, run_id, job_id)
        c = _Cascade(tx, self)
        c.note_run(run)
        if int(run["remaining_jobs"]) == 0:
            c.pending_end[run_id] = run
        c.after_conclude(job, job["conclusion"], outputs or {})
        c.finish()
        groups.update(c.retry_groups)
        return Completion(run_id, job_id, job["conclusion"], True)

    def _settle_pg(
        self,
        tx: Tx,
        run_id: int,
        job_id: str,
        conclusion: str,
        outputs: dict[str, Any] | None,
        reason: str | None,
        token: str | None,
        groups: set[str],
    ) -> Completion:
        """The PostgreSQL settle: one `preloop_settle` call (schema migration
        2) does the common path; the cascade continues here when needed."""
        t0 = time.perf_counter_ns()
        row = tx.one(
            "SELECT run_row, job_row, unit_row, admitted, wait_us "
            "FROM preloop_settle(?, ?, ?, ?, ?, ?, ?)",
            (run_id, job_id, conclusion, _dumps(outputs or {}), reason, token, time.time()),
        )
        if row is None:
            raise UnknownRun(f"no run {run_id} in the store {self.url}")
        tx.note_lock_run_wait(t0, int(row["wait_us"]) * 1000)
        if row["job_row"] is None:
            return _not_settled(tx, run_id, job_id)
        run: Row = row["run_row"]
        job: Row = row["job_row"]
        unit: Row = row["unit_row"]
        c = _Cascade(tx, self)
        c.note_run(run)
        if int(run["remaining_jobs"]) == 0:
            c.pending_end[run_id] = run
        c.after_conclude(
            job,
            job["conclusion"],
            outputs or {},
            unit=unit,
            slot_handed=row["admitted"] is not None,
        )
        c.finish()
        groups.update(c.retry_groups)
        return Completion(run_id, job_id, job["conclusion"], True)

    def cancel_run(self, run_id: int) -> bool:
        """Cancels a run: queued jobs are cancelled, running jobs told to stop,
        `always()` jobs still run. Returns False when the run had already ended."""
        groups: set[str] = set()

        def tx_fn(tx: Tx) -> bool:
            run = tx.lock_run(run_id)
            if run is None:
                raise UnknownRun(f"no run {run_id}")
            c = _Cascade(tx, self)
            changed = c.cancel_run(run)
            c.finish()
            groups.update(c.retry_groups)
            return changed

        result = self._db.transaction("cancel_run", tx_fn)
        self._retry_groups(groups)
        return result

    def expire_leases(self, now: float | None = None) -> int:
        """Fails every running job whose lease expired before `now` (cascading),
        retries free concurrency groups with waiters and carries out the
        cancellations groups owe (`_Cascade.defer`). Returns jobs failed."""
        now = time.time() if now is None else now

        def find(tx: Tx) -> list[Row]:
            return tx.execute(
                "SELECT run_id, id, runner FROM jobs WHERE status = 'running' AND "
                "lease_expires < ? "
                "ORDER BY lease_expires LIMIT 500",
                (now,),
            )

        expired = self._db.transaction("expire_leases", find)
        failed = 0
        groups: set[str] = set()
        for item in expired:

            def tx_fn(tx: Tx, item: Row = item) -> int:
                run = tx.lock_run(int(item["run_id"]))
                job = tx.one(
                    f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND id = ? AND status = 'running' "
                    "AND lease_expires < ?",
                    (item["run_id"], item["id"], now),
                )
                if run is None or job is None:
                    return 0
                c = _Cascade(tx, self)
                c.note_run(run)
                final = "cancelled" if job["cancel_requested"] else "failure"
                c.conclude(
                    job,
                    final,
                    {},
                    f"the lease of runner {item['runner']!r} expired: it stopped heart-beating",
                )
                c.finish()
                groups.update(c.retry_groups)
                return 1

            failed += self._db.transaction("expire_leases", tx_fn)
        free = self._db.transaction(
            "expire_leases",
            lambda tx: [
                r["name"]
                for r in tx.execute(
                    "SELECT name FROM conc_groups g WHERE holder_run IS NULL AND ("
                    "EXISTS (SELECT 1 FROM jobs j WHERE j.conc_group = g.name AND j.status = "
                    "'waiting') "
                    "OR EXISTS (SELECT 1 FROM runs r WHERE r.conc_group = g.name AND r.status "
                    "= 'pending')) UNION SELECT group_name FROM conc_actions"
                )
            ],
        )
        groups.update(free)
        self._retry_groups(groups)
        return failed

    def _retry_groups(self, groups: set[str]) -> None:
        """Carries out deferred cancellations and promotes waiters of groups a
        transaction could not reach without waiting on another run's lock
        (see the module docstring)."""
        for _ in range(3):
            if not groups:
                return
            again: set[str] = set()
            for name in sorted(groups):

                def tx_fn(tx: Tx, name: str = name, again: set[str] = again) -> None:
                    if tx.dialect == "pg":
                        # The group row before its recorded cancellations, as
                        # a release takes them: no two transactions cross.
                        tx.execute(
                            "SELECT name FROM conc_groups WHERE name = ? FOR UPDATE", (name,)
                        )
                    c = _Cascade(tx, self)
                    c.run_deferred(name)
                    c.promote_group(name)
                    c.finish()
                    again.update(c.retry_groups)

                self._db.transaction("retry_group", tx_fn)
            groups = again

    # ------------------------------------------------------------------ queries

    def get_run(self, run_id: int) -> RunInfo:
        row = self._db.transaction(
            "query", lambda tx: tx.one("SELECT * FROM runs WHERE id = ?", (run_id,))
        )
        if row is None:
            raise UnknownRun(f"no run {run_id} in the store {self._db.url}")
        return _run_info(row)

    def list_runs(self, limit: int | None = 50, *, unfinished: bool = False) -> list[RunInfo]:
        """The newest runs first (`limit` None: all of them); with `unfinished`,
        only runs that have not completed."""
        where = " WHERE status <> 'completed'" if unfinished else ""
        bound = "" if limit is None else " LIMIT ?"
        sql = f"SELECT * FROM runs{where} ORDER BY id DESC{bound}"
        args: tuple[int, ...] = () if limit is None else (limit,)
        rows = self._db.transaction("query", lambda tx: tx.execute(sql, args))
        return [_run_info(r) for r in rows]

    def run_context(self, run_id: int) -> dict[str, Any]:
        """The run-level contexts recorded at submit (`github`, `env`, `inputs`,
        ...), without any job's `needs`/`matrix`: one row read."""
        row = self._db.transaction(
            "query", lambda tx: tx.one("SELECT context FROM runs WHERE id = ?", (run_id,))
        )
        if row is None:
            raise UnknownRun(f"no run {run_id} in the store {self._db.url}")
        context: dict[str, Any] = json.loads(row["context"])
        return context

    def run_outputs_bytes(self, run_id: int) -> int:
        """Length of the outputs the run's jobs recorded so far (one aggregate
        row; GitHub caps a run's outputs at 50 MB)."""
        row = self._db.transaction(
            "query",
            lambda tx: tx.one(
                "SELECT COALESCE(SUM(LENGTH(outputs)), 0) AS n FROM jobs WHERE run_id = ?",
                (run_id,),
            ),
        )
        return int(row["n"]) if row is not None else 0

    def get_job(self, run_id: int, job_id: str) -> JobInfo:
        row = self._db.transaction(
            "query",
            lambda tx: tx.one("SELECT * FROM jobs WHERE run_id = ? AND id = ?", (run_id, job_id)),
        )
        if row is None:
            raise UnknownRun(f"run {run_id} has no job {job_id!r}")
        return _job_info(row)

    def list_jobs(self, run_id: int) -> list[JobInfo]:
        """Every job of a run (a whole-run read: counted as a graph load)."""
        self.counters.add_graph_load()
        rows = self._db.transaction(
            "query",
            lambda tx: tx.execute(
                "SELECT * FROM jobs WHERE run_id = ? ORDER BY seq, id", (run_id,)
            ),
        )
        return [_job_info(r) for r in rows]


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


_SLOW_PATH = "PLSLO"  # preloop_complete_claim: this batch needs the Python cascade


def _check_terminal(run_id: int, job_id: str, conclusion: str) -> None:
    if conclusion not in TERMINAL:
        raise NonTerminalConclusion(
            f"run {run_id} job {job_id!r}: {conclusion!r} does not end a job; "
            f"use one of {', '.join(sorted(TERMINAL))}"
        )


@dataclass(frozen=True, slots=True)
class _Claim:
    """What a runner asks for: up to `limit` jobs its `labels` all cover."""

    runner: str
    labels: list[str]
    limit: int
    lease_seconds: float
    run_id: int | None

    @staticmethod
    def of(
        runner: str, labels: Sequence[str], limit: int, lease_seconds: float, run_id: int | None
    ) -> _Claim:
        wanted = sorted({lb.strip().lower() for lb in labels if lb.strip()})
        return _Claim(runner, wanted, max(0, int(limit)), lease_seconds, run_id)


def _claim_lite(tx: Tx, claim: _Claim) -> list[Lease]:
    """The claim statement on SQLite (one writer: no row locks to skip)."""
    now = time.time()
    if claim.labels:
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
            *claim.labels,
            *(() if claim.run_id is None else (claim.run_id,)),
            claim.limit,
        ),
    )
    rows.sort(key=lambda r: (int(r["run_id"]), int(r["seq"])))
    return [_lease(r, claim, now) for r in rows]


class _SlowPath(Exception):
    """The batch needs the cascade in Python (see `_complete_lite_fast`)."""


def _complete_lite_fast(tx: Tx, results: Sequence[JobResultItem]) -> list[Completion] | None:
    """SQLite's counterpart of `preloop_complete_claim`'s completion half: a
    batch of one run's results as a few set-based statements inside a
    savepoint; None (the savepoint rolled back, nothing written) when the
    batch needs the Python cascade. The same rules decide as on PostgreSQL."""
    run_id = results[0][0].run_id
    tx.execute("SAVEPOINT complete_fast")
    try:
        done = _lite_fast_body(tx, run_id, results)
    except _SlowPath:
        tx.execute("ROLLBACK TO complete_fast")
        tx.execute("RELEASE complete_fast")
        return None
    tx.execute("RELEASE complete_fast")
    return done


def _lite_fast_body(tx: Tx, run_id: int, results: Sequence[JobResultItem]) -> list[Completion]:
    n = len(results)
    run = tx.one(
        "UPDATE runs SET remaining_jobs = remaining_jobs - ? WHERE id = ? RETURNING remaining_jobs",
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
        tx.execute(
            "UPDATE runs SET cancelled_jobs = cancelled_jobs + ? WHERE id = ?", (cancelled, run_id)
        )
    for cohort, freed in slots.items():
        nxt = tx.execute(
            "SELECT id, kind, conc_group, conc_group_expr FROM jobs WHERE run_id = ? "
            "AND cohort = ? AND status = 'parked' ORDER BY seq LIMIT ?",
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
                "UPDATE cohorts SET active = active - ? WHERE run_id = ? AND id = ?",
                (freed - len(nxt), run_id, cohort),
            )
    conclusions = {r["id"]: r["conclusion"] for r in rows}
    return [
        Completion(run_id, lease.job_id, conclusions[lease.job_id], True) for lease, _, _ in results
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
    job = tx.one(
        "SELECT status, conclusion, kind FROM jobs WHERE run_id = ? AND id = ?", (run_id, job_id)
    )
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
    tx.executemany("INSERT INTO deps (run_id, need, job_id) VALUES (?, ?, ?)", dep_rows)
    units = [(run_id, b, unit_caller[b], n) for b, n in unit_members.items()]
    units += [(run_id, _start_unit(c), None, 1) for c in inner_units]
    tx.executemany(
        "INSERT INTO units (run_id, base_id, caller, remaining) VALUES (?, ?, ?, ?)", units
    )
    tx.executemany(
        "INSERT INTO cohorts (run_id, id, max_parallel, fail_fast, total) VALUES (?, ?, ?, ?, ?)",
        [(run_id, c.id, c.max_parallel, int(c.fail_fast), c.total) for c in plan.cohorts],
    )


_INSERT_JOB = (
    "INSERT INTO jobs (run_id, id, seq, base_id, name, kind, needs, if_expr, runs_on, cohort, "
    "matrix, strategy, continue_on_error, timeout_minutes, conc_group, conc_group_expr, "
    "conc_cancel, conc_queue_max, outputs_expr, caller, inner_job_ids, deferred_matrix, spec, "
    "status, remaining_needs, remaining_inner, capped) VALUES "
    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'blocked', ?, ?, ?)"
)


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


class _Cascade:
    """The work one transaction does after a state change: concluding jobs,
    ending units, promoting dependents, admitting cohort legs, waking waiters,
    folding callers and ending runs. Runs a worklist (no recursion depth)."""

    def __init__(self, tx: Tx, store: Store) -> None:
        self.tx = tx
        self.store = store
        self.runs: dict[int, Row] = {}  # locked run rows (with parsed context)
        # run -> [remaining delta, failed delta, cancelled delta]
        self.run_delta: dict[int, list[int]] = {}
        self.retry_groups: set[str] = set()
        self.deferred: set[tuple[Any, ...]] = set()  # cancellations recorded (`defer`)
        self.work: list[tuple[str, tuple[Any, ...]]] = []
        # Runs whose settle write already brought remaining_jobs to 0.
        self.pending_end: dict[int, Row] = {}

    # -- run rows

    def note_run(self, run: Row) -> None:
        self.runs[int(run["id"])] = dict(run)

    def run(self, run_id: int) -> Row:
        row = self.runs.get(run_id)
        if row is None:
            locked = self.tx.lock_run(run_id)
            assert locked is not None
            row = self.runs[run_id] = dict(locked)
        return row

    def context(self, run_id: int) -> dict[str, Any]:
        run = self.run(run_id)
        ctx = run.get("_ctx")
        if ctx is None:
            row = self.tx.one("SELECT context FROM runs WHERE id = ?", (run_id,))
            assert row is not None
            ctx = run["_ctx"] = json.loads(row["context"])
        assert isinstance(ctx, dict)
        return ctx

    def job_contexts(self, job: Row) -> dict[str, Any]:
        ctx = dict(self.context(int(job["run_id"])))
        ctx["needs"] = _needs_view(
            self.tx, int(job["run_id"]), json.loads(job["needs"]), job["caller"]
        )
        ctx["matrix"] = _loads(job["matrix"]) or {}
        ctx["strategy"] = _loads(job["strategy"]) or {}
        if (inputs := scoped_inputs(self.tx, job)) is not None:
            ctx["inputs"] = inputs  # inside a reusable workflow: the callee's
        return ctx

    # -- driving

    def finish(self) -> None:
        """Drains the worklist and flushes run counters (which may end runs,
        which may resume other runs: loop until quiet)."""
        while True:
            while self.work:
                kind, args = self.work.pop()
                getattr(self, "_do_" + kind)(*args)
            if not self.run_delta and not self.pending_end:
                return
            deltas, self.run_delta = self.run_delta, {}
            for run_id in sorted(set(deltas) | set(self.pending_end)):
                rem, failed, cancelled = deltas.get(run_id, (0, 0, 0))
                row: Row | None
                if rem or failed or cancelled:
                    row = self.tx.one(
                        "UPDATE runs SET remaining_jobs = remaining_jobs + ?, failed_jobs = "
                        "failed_jobs + ?, cancelled_jobs = cancelled_jobs + ? WHERE id = ? "
                        "RETURNING remaining_jobs, failed_jobs, cancelled_jobs, status, "
                        "cancel_requested, conc_group",
                        (rem, failed, cancelled, run_id),
                    )
                else:
                    row = self.pending_end.get(run_id)
                self.pending_end.pop(run_id, None)
                ended = row is not None and int(row["remaining_jobs"]) == 0
                if ended and self.run(run_id)["status"] != "completed":
                    assert row is not None
                    self.end_run(run_id, row)

    def admit_run(self, run_id: int, group: str | None, conc: Any) -> None:
        """A new run (submitted or re-run) starts, unless its workflow-level
        `group` holds it back; either way the cascade is settled."""
        if group is None or self.acquire_run_group(run_id, group, conc):
            self.start_run(run_id)
        self.finish()

    def start_run(self, run_id: int) -> None:
        """Gates every root job of a run that may start (submit, or resume
        after waiting on a workflow-level group)."""
        roots = self.tx.execute(
            f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND status = 'blocked' AND "
            "remaining_needs = 0 ORDER BY seq",
            (run_id,),
        )
        self.ready(run_id, roots)
        if not roots:
            row = self.tx.one(
                "SELECT remaining_jobs, failed_jobs, cancelled_jobs, cancel_requested, conc_group "
                "FROM runs WHERE id = ?",
                (run_id,),
            )
            if row is not None and int(row["remaining_jobs"]) == 0:
                self.end_run(run_id, row)

    def end_run(self, run_id: int, row: Row) -> None:
        """Concludes a run whose jobs all ended: failure if one failed, else
        cancelled if the run was cancelled or one of its jobs was (replaced
        in a concurrency group, cancelled in progress, stopped by fail-fast,
        reported cancelled), else success, as on GitHub."""
        if int(row["failed_jobs"]):
            conclusion = "failure"
        elif int(row["cancel_requested"]) or int(row["cancelled_jobs"]):
            conclusion = "cancelled"
        else:
            conclusion = "success"
        self.tx.execute(
            "UPDATE runs SET status = 'completed', conclusion = ?, completed_at = ? WHERE id = ?",
            (conclusion, time.time(), run_id),
        )
        self.run(run_id)["status"] = "completed"
        group = row["conc_group"]
        if group is not None:
            released = self.tx.one(
                "UPDATE conc_groups SET holder_run = NULL, holder_job = NULL "
                "WHERE name = ? AND holder_run = ? AND holder_job IS NULL RETURNING name",
                (group, run_id),
            )
            if released is not None:
                self.run_deferred(group)
                self.promote_group(group)

    # -- concluding

    def conclude(
        self, job: Row, conclusion: str, outputs: dict[str, Any], reason: str | None
    ) -> None:
        self.work.append(("conclude", (job, conclusion, outputs, reason)))

    def _do_conclude(
        self, job: Row, conclusion: str, outputs: dict[str, Any], reason: str | None
    ) -> None:
        run_id = int(job["run_id"])
        changed = self.tx.one(
            "UPDATE jobs SET status = 'completed', conclusion = ?, outputs = ?, reason = ?, "
            "completed_at = ?, lease_token = NULL "
            "WHERE run_id = ? AND id = ? AND status = ? RETURNING id",
            (conclusion, _dumps(outputs), reason, time.time(), run_id, job["id"], job["status"]),
        )
        if changed is None:
            # Ended by another path of this cascade, or (pg) a runner's claim
            # committed after `job` was read: the job is running now, so a
            # cancellation becomes a request to stop it instead of being lost.
            if conclusion == "cancelled" and job["status"] == "queued":
                self.tx.execute(
                    "UPDATE jobs SET cancel_requested = 1 WHERE run_id = ? AND id = ? "
                    "AND status = 'running'",
                    (run_id, job["id"]),
                )
            return
        self.run_delta.setdefault(run_id, [0, 0, 0])[0] -= 1
        self.after_conclude(job, conclusion, outputs)

    def after_conclude(
        self,
        job: Row,
        conclusion: str,
        outputs: dict[str, Any],
        *,
        unit: Row | None = None,
        slot_handed: bool = False,
    ) -> None:
        """What a job's end sets off: its slot, its group, fail-fast, its unit.
        `unit`: the unit row already counted (pg `preloop_settle`);
        `slot_handed`: its cohort slot already went to the next parked leg."""
        tx = self.tx
        run_id = int(job["run_id"])
        if job["kind"] == "caller" and int(job["remaining_inner"]):
            # A caller ended before it started (settled by the engine): its
            # inner jobs will never start either.
            self.skip_inner(
                run_id, job["id"], "cancelled" if conclusion == "cancelled" else "skipped"
            )
        coe = bool(job["continue_on_error"])
        effective = "success" if conclusion == "failure" and coe else conclusion
        if effective == "failure":
            self.run_delta.setdefault(run_id, [0, 0, 0])[1] += 1
        elif effective == "cancelled":
            self.run_delta.setdefault(run_id, [0, 0, 0])[2] += 1
        if job["holds_slot"] and not slot_handed:
            self.work.append(("release_slot", (run_id, job["cohort"])))
        if job["holds_group"]:
            self.work.append(("release_group", (job["holds_group"], run_id, job["id"])))
        if conclusion == "failure" and not coe and job["cohort"] is not None:
            self.work.append(("fail_fast", (run_id, job["cohort"], job["id"])))
        if unit is not None:
            if int(unit["remaining"]) == 0:
                self.work.append(("end_unit", (run_id, unit)))
            return
        column = {"success": "n_success", "failure": "n_failure", "cancelled": "n_cancelled"}.get(
            effective, "n_skipped"
        )
        merge = ""
        params: list[Any] = [int(job["anc_fail"]), int(job["anc_bad"])]
        if outputs:
            # A matrix's outputs: the last leg to set a name wins, as on GitHub.
            if tx.dialect == "pg":
                merge = ", outputs = (outputs::jsonb || CAST(? AS jsonb))::text"
            else:
                merge = ", outputs = json_patch(outputs, ?)"
            params.append(_dumps(outputs))
        unit = tx.one(
            f"UPDATE units SET remaining = remaining - 1, {column} = {column} + 1, "
            "anc_fail = CASE WHEN ? = 1 THEN 1 ELSE anc_fail END, "
            f"anc_bad = CASE WHEN ? = 1 THEN 1 ELSE anc_bad END{merge} "
            "WHERE run_id = ? AND base_id = ? RETURNING *",
            (*params, run_id, job["base_id"]),
        )
        if unit is not None and int(unit["remaining"]) == 0:
            self.work.append(("end_unit", (run_id, unit)))

    def _do_end_unit(self, run_id: int, unit: Row) -> None:
        tx = self.tx
        result = _unit_result(unit)
        base = unit["base_id"]
        tx.execute(
            "UPDATE units SET result = ? WHERE run_id = ? AND base_id = ?", (result, run_id, base)
        )
        fail = result == "failure" or bool(unit["anc_fail"])
        bad = result != "success" or bool(unit["anc_bad"])
        if unit["caller"] is not None:
            caller = tx.one(
                "UPDATE jobs SET remaining_inner = remaining_inner - 1 WHERE run_id = ? AND id "
                "= ? "
                f"AND status = 'folding' RETURNING {_JOB}",
                (run_id, unit["caller"]),
            )
            if caller is not None and int(caller["remaining_inner"]) == 0:
                self.work.append(("fold", (caller,)))
        # Two statements with obvious plans (a deps range, then primary-key
        # lookups): one join lets a planner without statistics on fresh rows
        # pick a nested loop over every blocked job of the run.
        dependents = [
            r["job_id"]
            for r in tx.execute(
                "SELECT job_id FROM deps WHERE run_id = ? AND need = ?", (run_id, base)
            )
        ]
        ready = []
        for sel, sel_args, where, where_args in _id_sets(tx, run_id, dependents):
            ready += tx.execute(
                "UPDATE jobs SET remaining_needs = remaining_needs - 1, "
                "anc_fail = CASE WHEN ? = 1 THEN 1 ELSE anc_fail END, "
                "anc_bad = CASE WHEN ? = 1 THEN 1 ELSE anc_bad END "
                f"{sel} WHERE {where} AND status = 'blocked' "
                f"RETURNING {_JOB}",
                (int(fail), int(bad), *sel_args, *where_args),
            )
        ready = [j for j in ready if int(j["remaining_needs"]) == 0]
        ready.sort(key=lambda j: (j["seq"], j["id"]))
        self.ready(run_id, ready)

    # -- gates

    def ready(self, run_id: int, jobs: list[Row]) -> None:
        """Jobs (seq order) whose needs all ended. A plain job that runs on
        `success()` with clean ancestors and no concurrency group needs no
        evaluation: those are queued (or parked behind their cohort cap) in
        bulk, so a need that unblocks 20,000 legs costs a few statements."""
        cancelled = bool(self.run(run_id)["cancel_requested"])
        plain: list[str] = []
        parked: dict[str, list[str]] = {}
        gated: list[Row] = []
        for job in jobs:
            simple = (
                job["kind"] == "job"
                and job["if_expr"] is None
                and not job["anc_fail"]
                and not job["anc_bad"]
                and not cancelled
                and job["conc_group"] is None
                and job["conc_group_expr"] is None
            )
            if not simple:
                gated.append(job)
            elif job["capped"]:
                parked.setdefault(job["cohort"], []).append(job["id"])
            else:
                plain.append(job["id"])
        self._bulk_status(run_id, plain, "queued")
        for cohort, ids in parked.items():
            self._bulk_status(run_id, ids, "parked")
            self.work.append(("fill_cohort", (run_id, cohort)))
        for job in reversed(gated):
            self.work.append(("gate", (job,)))

    def _bulk_status(self, run_id: int, ids: list[str], status: str) -> None:
        for sel, sel_args, where, where_args in _id_sets(self.tx, run_id, ids):
            self.tx.execute(
                f"UPDATE jobs SET status = ? {sel} WHERE {where} AND status = 'blocked'",
                (status, *sel_args, *where_args),
            )

    def _do_fill_cohort(self, run_id: int, cohort: str) -> None:
        """Admits parked legs into the cohort's free slots (seq order)."""
        c = self.tx.one(
            "SELECT max_parallel - active AS free FROM cohorts WHERE run_id = ? AND id = ?",
            (run_id, cohort),
        )
        if c is None or int(c["free"]) <= 0:
            return
        legs = self.tx.execute(
            f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND cohort = ? AND status = 'parked' "
            "ORDER BY seq LIMIT ?",
            (run_id, cohort, int(c["free"])),
        )
        if not legs:
            return
        self.tx.execute(
            "UPDATE cohorts SET active = active + ? WHERE run_id = ? AND id = ?",
            (len(legs), run_id, cohort),
        )
        plain = [j["id"] for j in legs if _plain(j)]
        for sel, sel_args, where, where_args in _id_sets(self.tx, run_id, plain):
            self.tx.execute(
                f"UPDATE jobs SET status = 'queued', holds_slot = 1 {sel} WHERE {where}",
                (*sel_args, *where_args),
            )
        for job in legs:
            if not _plain(job):
                self.through_group(job, holds_slot=True)

    def _do_gate(self, job: Row) -> None:
        """A job whose needs have all ended: decide skip/run, then admit."""
        run_id = int(job["run_id"])
        run = self.run(run_id)
        if run["status"] == "completed":
            return
        status = ancestor_status(
            run_cancelled=bool(run["cancel_requested"]),
            anc_fail=bool(job["anc_fail"]),
            anc_bad=bool(job["anc_bad"]),
        )
        if job["if_expr"] is None:
            go = status == "success"
        else:
            try:
                go = should_run(job["if_expr"], self.job_contexts(job), status)
            except ExpressionError as exc:
                self.conclude(job, "failure", {}, f"job {job['id']!r}: if: {exc}")
                return
        if not go:
            self.skip(job, "cancelled" if status == "cancelled" else "skipped")
            return
        if job["kind"] == "deferred":
            self.expand(job)
        else:
            # A reusable caller is admitted like a job (its matrix's
            # max-parallel, its `concurrency:`): it starts where a job queues.
            self.admit(job)

    def skip(self, job: Row, conclusion: str) -> None:
        if job["kind"] == "caller":
            self.skip_inner(int(job["run_id"]), job["id"], conclusion)
        self.conclude(job, conclusion, {}, None)

    def skip_inner(self, run_id: int, caller: str, conclusion: str) -> None:
        """A caller that will not run: every job inside it (nested callers
        included, by id prefix) ends with the caller's conclusion at once."""
        lo, hi = _inner_range(caller)
        rows = self.tx.execute(
            "UPDATE jobs SET status = 'completed', conclusion = ?, completed_at = ? "
            "WHERE run_id = ? AND id >= ? AND id < ? AND status = 'blocked' RETURNING id",
            (conclusion, time.time(), run_id, lo, hi),
        )
        column = "n_cancelled" if conclusion == "cancelled" else "n_skipped"
        self.tx.execute(
            f"UPDATE units SET {column} = {column} + remaining, remaining = 0, result = ? "
            "WHERE run_id = ? AND ((base_id >= ? AND base_id < ?) OR (base_id >= ? AND base_id "
            "< ?))",
            (conclusion, run_id, lo, hi, "^" + lo, "^" + hi),
        )
        self.tx.execute(
            "UPDATE units SET remaining = 0, result = ? WHERE run_id = ? AND base_id = ?",
            (conclusion, run_id, _start_unit(caller)),
        )
        delta = self.run_delta.setdefault(run_id, [0, 0, 0])
        delta[0] -= len(rows)
        if conclusion == "cancelled":
            delta[2] += len(rows)

    def enqueue(self, job: Row, holds_slot: bool, group: str | None) -> None:
        """An admitted job queues for a runner; an admitted reusable caller
        starts (folding, holding its slot and group until it folds)."""
        row = self.tx.one(
            "UPDATE jobs SET status = CASE WHEN kind = 'caller' THEN 'folding' ELSE 'queued' END, "
            "holds_slot = ?, holds_group = ?, conc_group = COALESCE(?, conc_group) "
            "WHERE run_id = ? AND id = ? AND status IN ('blocked', 'parked', 'waiting') "
            f"RETURNING {_JOB}",
            (int(holds_slot), group, group, int(job["run_id"]), job["id"]),
        )
        if row is not None and row["kind"] == "caller":
            self.caller_started(row)

    def caller_started(self, row: Row) -> None:
        """A caller now folding: its `with:` is evaluated, its inner root jobs
        may start."""
        run_id = int(row["run_id"])
        try:
            start_caller(self.tx, row, self.job_contexts(row))
        except (ExpressionError, PlanError) as exc:
            self.skip_inner(run_id, row["id"], "skipped")
            self.conclude(row, "failure", {}, f"caller {row['id']!r}: with: {exc}")
            return
        if int(row["remaining_inner"]) == 0:
            self.work.append(("fold", (row,)))
            return
        unit = self.tx.one(
            "UPDATE units SET remaining = 0, n_success = 1 WHERE run_id = ? AND base_id = ? "
            "RETURNING *",
            (run_id, _start_unit(row["id"])),
        )
        if unit is not None:
            self.work.append(("end_unit", (run_id, unit)))

    def _do_fold(self, caller: Row) -> None:
        """A caller whose inner jobs all ended: its conclusion and outputs."""
        run_id = int(caller["run_id"])
        cid = caller["id"]
        rows = self.tx.execute(
            "SELECT base_id, result, outputs FROM units WHERE run_id = ? AND caller = ?",
            (run_id, cid),
        )
        inner = {
            r["base_id"][len(cid) + 1 :]: {
                "result": r["result"],
                "outputs": json.loads(r["outputs"]),
            }
            for r in rows
        }
        results = {v["result"] for v in inner.values()}
        conclusion = (
            "failure"
            if "failure" in results
            else "cancelled"
            if "cancelled" in results or int(caller["cancel_requested"])
            else "success"
        )
        ctx = dict(self.context(run_id))
        ctx["jobs"] = inner
        if (inputs := callee_inputs(self.tx, caller)) is not None:
            ctx["inputs"] = inputs
        outputs: dict[str, Any] = {}
        reason = None
        for name, expr in json.loads(caller["outputs_expr"]).items():
            try:
                outputs[name] = evaluate_expr(expr, ctx)
            except ExpressionError as exc:
                conclusion, reason = "failure", f"caller {cid!r} output {name!r}: {exc}"
        self.conclude(caller, conclusion, outputs, reason)

    def expand(self, job: Row) -> None:
        """A deferred matrix job whose needs ended: evaluate the matrix, insert
        its legs (ids persisted on the job and its caller), admit them.

        A plan from `preloop.workflow.plan` carries what `expand_deferred`
        needs (legs exactly as the planner makes them, reusable-caller legs
        with their inner jobs); a plan built by hand with only
        `deferred_matrix` is expanded by `expand_matrix_value`."""
        tx = self.tx
        run_id = int(job["run_id"])
        jid = job["id"]
        full = tx.one("SELECT * FROM jobs WHERE run_id = ? AND id = ?", (run_id, jid))
        assert full is not None
        spec = json.loads(full["spec"])
        contexts = self.job_contexts(job)
        cohort: Cohort | None
        try:
            if "deferred" in spec:
                legs, cohort = self._expand_planned(full, spec, contexts)
            else:
                legs, cohort = self._expand_value(full, contexts)
        except (ExpressionError, MatrixError, PlanError) as exc:
            self.conclude(job, "failure", {}, f"job {jid!r}: matrix: {exc}")
            return
        if not legs:
            self.conclude(job, "skipped", {}, f"job {jid!r}: the matrix expanded to no legs")
            return
        self.insert_expansion(full, legs, cohort)

    def _expand_planned(
        self, full: Row, spec: dict[str, Any], contexts: dict[str, Any]
    ) -> tuple[list[tuple[PlannedJob, int]], Cohort | None]:
        planned = PlannedJob(
            id=full["id"],
            seq=int(full["seq"]) // SEQ_STRIDE,
            base_id=full["base_id"],
            name=full["name"],
            kind="deferred",
            needs=tuple(json.loads(full["needs"])),
            if_expr=full["if_expr"],
            caller=full["caller"],
            deferred_matrix=full["deferred_matrix"],
            timeout_minutes=float(full["timeout_minutes"]),
            spec=spec,
        )
        expansion = expand_deferred(planned, contexts)
        return [(j, j.seq * SEQ_STRIDE) for j in expansion.jobs], expansion.cohort

    def _expand_value(
        self, full: Row, contexts: dict[str, Any]
    ) -> tuple[list[tuple[PlannedJob, int]], Cohort | None]:
        jid = full["id"]
        legs = expand_matrix_value(evaluate_expr(full["deferred_matrix"] or "", contexts))
        c = self.tx.one(
            "SELECT max_parallel, fail_fast FROM cohorts WHERE run_id = ? AND id = ?",
            (int(full["run_id"]), jid),
        )
        cohort = Cohort(
            jid,
            c["max_parallel"] if c else None,
            bool(c["fail_fast"]) if c else True,
            len(legs),
        )
        base = _loads(full["strategy"]) or {}
        out = []
        for i, matrix in enumerate(legs):
            strategy = {
                **base,
                "job-index": i,
                "job-total": len(legs),
                "fail-fast": cohort.fail_fast,
                "max-parallel": cohort.max_parallel or len(legs),
            }
            leg = PlannedJob(
                id=f"{jid}#{i}",
                seq=0,
                base_id=jid,
                name=f"{full['name']} ({', '.join(str(v) for v in matrix.values())})",
                needs=tuple(json.loads(full["needs"])),
                if_expr=full["if_expr"],
                runs_on=tuple(json.loads(full["runs_on"])),
                cohort=jid,
                matrix=matrix,
                strategy=strategy,
                continue_on_error=bool(full["continue_on_error"]),
                timeout_minutes=float(full["timeout_minutes"]),
                concurrency=ConcurrencySpec(
                    full["conc_group"],
                    full["conc_group_expr"],
                    bool(full["conc_cancel"]),
                    bool(full["conc_queue_max"]),
                )
                if full["conc_group"] is not None or full["conc_group_expr"] is not None
                else None,
                outputs=json.loads(full["outputs_expr"]),
                caller=full["caller"],
                spec=json.loads(full["spec"]),
            )
            out.append((leg, int(full["seq"]) + i + 1))
        return out, cohort

    def insert_expansion(
        self, full: Row, legs: list[tuple[PlannedJob, int]], cohort: Cohort | None
    ) -> None:
        """Inserts a deferred job's legs (and, for reusable-caller legs, their
        inner jobs) with counters from the expansion alone: the deferred job's
        needs have ended, so only needs inside the expansion are counted."""
        tx = self.tx
        run_id = int(full["run_id"])
        jid = full["id"]
        jobs = [j for j, _ in legs]
        new_ids = {j.id for j in jobs}
        top = [j.id for j in jobs if j.base_id == jid]
        unit_members: dict[str, int] = {}
        unit_caller: dict[str, str | None] = {}
        inner_units: dict[str, set[str]] = {}
        for j in jobs:
            unit_members[j.base_id] = unit_members.get(j.base_id, 0) + 1
            unit_caller[j.base_id] = j.caller
            if j.caller in new_ids:
                inner_units.setdefault(j.caller, set()).add(j.base_id)
        capped = int(bool(cohort and cohort.max_parallel is not None))
        rows, deps = [], []
        for j, stored_seq in legs:
            edges = [n for n in dict.fromkeys(j.needs) if n in unit_members and n != jid]
            if j.caller in new_ids and not any(unit_caller.get(n) == j.caller for n in edges):
                edges.append(_start_unit(j.caller))
            deps += [(run_id, n, j.id) for n in edges]
            row = list(_job_row(run_id, j, len(edges), len(inner_units.get(j.id, ()))))
            row[2] = stored_seq
            rows.append((*row, int(j.base_id == jid and bool(capped))))
        tx.executemany(_INSERT_JOB, rows)
        tx.executemany("INSERT INTO deps (run_id, need, job_id) VALUES (?, ?, ?)", deps)
        units = [(run_id, b, unit_caller[b], n) for b, n in unit_members.items() if b != jid]
        units += [(run_id, _start_unit(c), None, 1) for c in inner_units]
        tx.executemany(
            "INSERT INTO units (run_id, base_id, caller, remaining) VALUES (?, ?, ?, ?)", units
        )
        if cohort is not None:
            tx.execute(
                "INSERT INTO cohorts (run_id, id, max_parallel, fail_fast, total) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_id, id) DO UPDATE SET "
                "max_parallel = excluded.max_parallel, fail_fast = excluded.fail_fast, "
                "total = excluded.total",
                (run_id, jid, cohort.max_parallel, int(cohort.fail_fast), len(top)),
            )
        if full["anc_fail"] or full["anc_bad"]:
            tx.execute(
                "UPDATE jobs SET anc_fail = ?, anc_bad = ? WHERE run_id = ? AND base_id = ? "
                "AND status = 'blocked'",
                (full["anc_fail"], full["anc_bad"], run_id, jid),
            )
        tx.execute(
            "UPDATE jobs SET status = 'expanded', inner_job_ids = ?, completed_at = ? "
            "WHERE run_id = ? AND id = ?",
            (_dumps(top), time.time(), run_id, jid),
        )
        tx.execute(
            "UPDATE units SET remaining = remaining + ? WHERE run_id = ? AND base_id = ?",
            (len(top) - 1, run_id, jid),
        )
        self.run_delta.setdefault(run_id, [0, 0, 0])[0] += len(jobs) - 1
        if full["caller"] is not None:
            # Splice the legs into the caller's persisted inner job ids.
            c = tx.one(
                "SELECT inner_job_ids FROM jobs WHERE run_id = ? AND id = ?",
                (run_id, full["caller"]),
            )
            if c is not None:
                inner = [x for x in json.loads(c["inner_job_ids"]) if not x.startswith(jid + "#")]
                spliced: list[str] = []
                for x in inner:
                    spliced.extend(top if x == jid else [x])
                if jid not in inner:
                    spliced.extend(top)
                tx.execute(
                    "UPDATE jobs SET inner_job_ids = ? WHERE run_id = ? AND id = ?",
                    (_dumps(spliced), run_id, full["caller"]),
                )
        fresh: list[Row] = []
        for sel, sel_args, where, where_args in _id_sets(tx, run_id, top):
            fresh += tx.execute(
                f"SELECT {_JOB} FROM jobs {sel.replace('FROM', ',')} WHERE {where} "
                "AND status = 'blocked'",
                (*sel_args, *where_args),
            )
        fresh.sort(key=lambda j: (j["seq"], j["id"]))
        self.ready(run_id, fresh)

    # -- admission: cohort slot, then concurrency group

    def admit(self, job: Row) -> None:
        self.work.append(("admit", (job,)))

    def _do_admit(self, job: Row) -> None:
        run_id = int(job["run_id"])
        if not job["capped"]:
            self.through_group(job, holds_slot=False)
            return
        # SET expressions all read the old row, so `admitted` says whether
        # this statement took a slot.
        slot = self.tx.one(
            "UPDATE cohorts SET admitted = CASE WHEN active < max_parallel THEN 1 ELSE 0 END, "
            "active = CASE WHEN active < max_parallel THEN active + 1 ELSE active END "
            "WHERE run_id = ? AND id = ? RETURNING admitted",
            (run_id, job["cohort"]),
        )
        if slot is None or not slot["admitted"]:
            self.tx.execute(
                "UPDATE jobs SET status = 'parked' WHERE run_id = ? AND id = ?", (run_id, job["id"])
            )
            return
        self.through_group(job, holds_slot=True)

    def _do_release_slot(self, run_id: int, cohort: str) -> None:
        """A leg gave its slot back: hand it to the next parked leg (seq order),
        or return it to the cohort."""
        nxt = self.tx.one(
            f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND cohort = ? AND status = 'parked' "
            "ORDER BY seq LIMIT 1",
            (run_id, cohort),
        )
        if nxt is None:
            self.tx.execute(
                "UPDATE cohorts SET active = active - 1 WHERE run_id = ? AND id = ?",
                (run_id, cohort),
            )
            return
        self.through_group(nxt, holds_slot=True)

    def through_group(self, job: Row, *, holds_slot: bool) -> None:
        """The concurrency gate; ends by queueing the job or parking it as a waiter."""
        tx = self.tx
        run_id = int(job["run_id"])
        group = job["conc_group"]
        if group is None and job["conc_group_expr"]:
            try:
                group = str(evaluate_expr(job["conc_group_expr"], self.job_contexts(job)))
            except ExpressionError as exc:
                job = {**job, "holds_slot": int(holds_slot)}
                self.conclude(job, "failure", {}, f"job {job['id']!r}: concurrency: {exc}")
                return
        if group is None:
            self.enqueue(job, holds_slot, None)
            return
        got = tx.one(_ACQUIRE, (group, run_id, job["id"], group, group))
        if got is not None:
            self.enqueue(job, holds_slot, group)
            return
        seq = tx.next_wait_seq()
        tx.execute(
            "UPDATE jobs SET status = 'waiting', holds_slot = ?, conc_group = ?, wait_seq = ? "
            "WHERE run_id = ? AND id = ?",
            (int(holds_slot), group, seq, run_id, job["id"]),
        )
        self.make_room(group, bool(job["conc_queue_max"]), keep=(run_id, job["id"]))
        if job["conc_cancel"]:
            self.cancel_holder(group)
        self.promote_group(group)

    def make_room(self, group: str, queue_max: bool, keep: tuple[int, Any] | None) -> None:
        """One pending waiter per group (a newer one replaces the older), or up
        to QUEUE_MAX with `queue: max` (the oldest beyond it is cancelled)."""
        limit = QUEUE_MAX if queue_max else 1
        excess = self.tx.execute(
            "SELECT run_id, id, wait_seq, 0 AS is_run FROM jobs WHERE conc_group = ? AND "
            "status = 'waiting' "
            "UNION ALL SELECT id AS run_id, NULL AS id, wait_seq, 1 AS is_run FROM runs "
            "WHERE conc_group = ? AND status = 'pending' ORDER BY wait_seq DESC "
            "LIMIT 1000000 OFFSET ?",
            (group, group, limit),
        )
        for w in excess:
            if (int(w["run_id"]), w["id"]) == keep:
                continue
            self.cancel_waiter(group, w, queue_max)

    def cancel_waiter(self, group: str, w: Row, queue_max: bool) -> None:
        run_id = int(w["run_id"])
        if run_id not in self.runs and self.tx.try_lock_run(run_id) is None:
            self.defer(group, "make_room", queue_max=queue_max)
            return
        if w["is_run"]:
            self.cancel_pending_run(run_id)
            return
        job = self.tx.one(
            f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND id = ? AND status = 'waiting'",
            (run_id, w["id"]),
        )
        if job is not None:
            self.run(run_id)
            # Concluded now, not queued: the promotion that may follow must
            # not pick the replaced waiter.
            self._do_conclude(
                job, "cancelled", {}, f"replaced by a newer job in concurrency group {group!r}"
            )

    def cancel_holder(self, group: str, expect: tuple[int, str | None] | None = None) -> None:
        """`cancel-in-progress`: the group's holder (a job or a run) is cancelled.
        `expect`: a deferred request, for that holder only (one that has
        ended since released the group: nothing is left to cancel)."""
        g = self.tx.one("SELECT holder_run, holder_job FROM conc_groups WHERE name = ?", (group,))
        if g is None or g["holder_run"] is None:
            return
        run_id = int(g["holder_run"])
        if expect is not None and (run_id, g["holder_job"]) != expect:
            return
        if run_id not in self.runs:
            locked = self.tx.try_lock_run(run_id)
            if locked is None:
                self.defer(group, "cancel_holder", holder=(run_id, g["holder_job"]))
                return
            self.note_run(locked)
        if g["holder_job"] is None:
            self.cancel_run(self.run(run_id))
            return
        job = self.tx.one(
            f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND id = ?", (run_id, g["holder_job"])
        )
        if job is None:
            return
        if job["status"] == "running":
            self.tx.execute(
                "UPDATE jobs SET cancel_requested = 1 WHERE run_id = ? AND id = ?",
                (run_id, job["id"]),
            )
        elif job["status"] == "folding":
            self.cancel_caller(job, f"cancelled in progress by concurrency group {group!r}")
        elif job["status"] == "queued":
            self.conclude(
                job, "cancelled", {}, f"cancelled in progress by concurrency group {group!r}"
            )

    def defer(
        self,
        group: str,
        action: str,
        *,
        queue_max: bool = False,
        holder: tuple[int, str | None] | None = None,
    ) -> None:
        """Records a cancellation `group` owes (`make_room`: replace older
        waiters; `cancel_holder`: cancel-in-progress) whose run row another
        transaction holds; `run_deferred` carries it out, right after commit
        (`Store._retry_groups`) or from the reaper, so it is never lost."""
        key = (group, action, queue_max, holder)
        if key in self.deferred:
            return
        self.deferred.add(key)
        self.tx.execute(
            "INSERT INTO conc_actions (group_name, action, queue_max, holder_run, holder_job) "
            "VALUES (?, ?, ?, ?, ?)",
            (
                group,
                action,
                int(queue_max),
                holder[0] if holder else None,
                holder[1] if holder else None,
            ),
        )
        self.retry_groups.add(group)

    def run_deferred(self, group: str) -> None:
        """Carries out the cancellations `group` owes (see `defer`); one that
        still cannot lock its run is recorded again."""
        rows = self.tx.execute(
            "DELETE FROM conc_actions WHERE group_name = ? "
            "RETURNING id, action, queue_max, holder_run, holder_job",
            (group,),
        )
        rows.sort(key=lambda r: int(r["id"]))
        room = [r for r in rows if r["action"] == "make_room"]
        if room:  # one pass makes room for every request; the newest says how much
            self.make_room(group, bool(room[-1]["queue_max"]), keep=None)
        holders = {
            (int(r["holder_run"]), r["holder_job"]) for r in rows if r["action"] == "cancel_holder"
        }
        for holder in sorted(holders, key=lambda h: (h[0], h[1] or "")):
            self.cancel_holder(group, expect=holder)

    def _do_release_group(self, group: str, run_id: int, job_id: str) -> None:
        released = self.tx.one(
            "UPDATE conc_groups SET holder_run = NULL, holder_job = NULL "
            "WHERE name = ? AND holder_run = ? AND holder_job = ? RETURNING name",
            (group, run_id, job_id),
        )
        if released is not None:
            # Cancellations the group still owes come first: a replaced
            # waiter must not be the one promoted.
            self.run_deferred(group)
            self.promote_group(group, locked=True)

    def promote_group(self, group: str, *, locked: bool = False) -> None:
        """A free group takes its oldest waiter: a job (queued) or a run
        (resumed). `locked`: this transaction has just freed the group row."""
        tx = self.tx
        while True:
            if not locked:
                g = tx.one(
                    "UPDATE conc_groups SET holder_run = holder_run WHERE name = ? "
                    "AND holder_run IS NULL RETURNING name",
                    (group,),
                )
                if g is None:
                    return
            locked = False
            w = tx.one(
                "SELECT run_id, id, wait_seq, 0 AS is_run FROM jobs WHERE conc_group = ? AND "
                "status = 'waiting' "
                "UNION ALL SELECT id AS run_id, NULL AS id, wait_seq, 1 AS is_run FROM runs "
                "WHERE conc_group = ? AND status = 'pending' ORDER BY wait_seq LIMIT 1",
                (group, group),
            )
            if w is None:
                return
            run_id = int(w["run_id"])
            if run_id not in self.runs:
                other = tx.try_lock_run(run_id)
                if other is None:
                    self.retry_groups.add(group)
                    return
                self.note_run(other)
            if w["is_run"]:
                tx.execute(
                    "UPDATE conc_groups SET holder_run = ?, holder_job = NULL WHERE name = ?",
                    (run_id, group),
                )
                tx.execute("UPDATE runs SET status = 'running' WHERE id = ?", (run_id,))
                self.run(run_id)["status"] = "running"
                self.start_run(run_id)
                return
            job = tx.one(
                f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND id = ? AND status = 'waiting'",
                (run_id, w["id"]),
            )
            if job is not None:
                tx.execute(
                    "UPDATE conc_groups SET holder_run = ?, holder_job = ? WHERE name = ?",
                    (run_id, w["id"], group),
                )
                self.enqueue(job, bool(job["holds_slot"]), group)
                return

    # -- workflow-level concurrency

    def acquire_run_group(self, run_id: int, group: str, conc: Any) -> bool:
        """True when the new run holds its workflow-level group and may start."""
        tx = self.tx
        got = tx.one(_ACQUIRE, (group, run_id, None, group, group))
        if got is not None:
            return True
        seq = tx.next_wait_seq()
        tx.execute("UPDATE runs SET status = 'pending', wait_seq = ? WHERE id = ?", (seq, run_id))
        self.run(run_id)["status"] = "pending"
        self.make_room(group, bool(conc.queue_max), keep=(run_id, None))
        if conc.cancel_in_progress:
            self.cancel_holder(group)
        self.promote_group(group)
        return False

    def cancel_pending_run(self, run_id: int) -> None:
        """A run that never started (waiting on its workflow-level group) ends cancelled."""
        tx = self.tx
        rows = tx.execute(
            "UPDATE jobs SET status = 'completed', conclusion = 'cancelled', completed_at = ? "
            "WHERE run_id = ? AND status = 'blocked' RETURNING id",
            (time.time(), run_id),
        )
        tx.execute(
            "UPDATE units SET n_cancelled = n_cancelled + remaining, remaining = 0, result = "
            "'cancelled' "
            "WHERE run_id = ?",
            (run_id,),
        )
        tx.execute(
            "UPDATE runs SET status = 'completed', conclusion = 'cancelled', cancel_requested = 1, "
            "remaining_jobs = remaining_jobs - ?, completed_at = ? WHERE id = ?",
            (len(rows), time.time(), run_id),
        )
        self.run(run_id)["status"] = "completed"

    # -- cancellation

    def cancel_run(self, run: Row) -> bool:
        tx = self.tx
        run_id = int(run["id"])
        self.note_run(run)
        if run["status"] == "completed":
            return False
        if run["status"] == "pending":
            self.cancel_pending_run(run_id)
            return True
        if int(run["cancel_requested"]):
            return False
        tx.execute("UPDATE runs SET cancel_requested = 1 WHERE id = ?", (run_id,))
        self.runs[run_id]["cancel_requested"] = 1
        active = tx.execute(
            f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND status IN ('queued', 'parked', "
            "'waiting', 'running') "
            "ORDER BY seq DESC",
            (run_id,),
        )
        for job in active:
            keep = False
            if job["if_expr"] is not None:
                try:
                    keep = should_run(job["if_expr"], self.job_contexts(job), "cancelled")
                except ExpressionError:
                    keep = False
            if keep:
                continue  # always() jobs still run, as on GitHub
            if job["status"] == "running":
                tx.execute(
                    "UPDATE jobs SET cancel_requested = 1 WHERE run_id = ? AND id = ?",
                    (run_id, job["id"]),
                )
            else:
                # Concluded at once (see _do_fail_fast).
                self._do_conclude(job, "cancelled", {}, "the run was cancelled")
        return True

    def _do_fail_fast(self, run_id: int, cohort: str, failed_id: str) -> None:
        """fail-fast: the other in-progress and queued legs of the matrix are cancelled."""
        c = self.tx.one(
            "SELECT fail_fast FROM cohorts WHERE run_id = ? AND id = ?", (run_id, cohort)
        )
        if c is None or not c["fail_fast"]:
            return
        reason = f"fail-fast: leg {failed_id!r} failed"
        self.tx.execute(
            "UPDATE jobs SET cancel_requested = 1 WHERE run_id = ? AND cohort = ? AND status = "
            "'running'",
            (run_id, cohort),
        )
        for leg in self.tx.execute(
            f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND cohort = ? AND status = 'folding'",
            (run_id, cohort),
        ):
            self.cancel_caller(leg, reason)
        legs = self.tx.execute(
            f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND cohort = ? "
            "AND status IN ('queued', 'parked', 'waiting') ORDER BY seq DESC",
            (run_id, cohort),
        )
        # Concluded here, not queued: a slot freed by one of them must not
        # admit a sibling that is about to be cancelled.
        for leg in legs:
            self._do_conclude(leg, "cancelled", {}, reason)

    def cancel_caller(self, caller: Row, reason: str) -> None:
        """A started reusable caller is cancelled (fail-fast, cancel-in-progress):
        its running inner jobs (nested callers' too, by id prefix) are told to
        stop, the rest end cancelled now, and it folds cancelled unless an
        inner job failed."""
        tx = self.tx
        run_id = int(caller["run_id"])
        lo, hi = _inner_range(caller["id"])
        tx.execute(
            "UPDATE jobs SET cancel_requested = 1 WHERE run_id = ? AND ((id >= ? AND id < ? "
            "AND status IN ('running', 'folding')) OR id = ?)",
            (run_id, lo, hi, caller["id"]),
        )
        rest = tx.execute(
            f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND id >= ? AND id < ? "
            "AND status IN ('blocked', 'parked', 'waiting', 'queued') ORDER BY seq DESC",
            (run_id, lo, hi),
        )
        # Concluded here, not queued (see _do_fail_fast); deepest first, so a
        # nested caller that never started finds its inner jobs ended.
        for job in rest:
            self._do_conclude(job, "cancelled", {}, reason)
