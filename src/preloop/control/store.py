"""The scheduler: one `Store` over lite (SQLite) or pg (PostgreSQL).

Every public operation is one transaction (`Backend.transaction`) and reads
only the rows it involves: the run row, the job rows it changes, the `units`
rows of the needs it evaluates, the cohort and concurrency-group rows it
admits through. Nothing reads a whole run ("graph load") except the
`list_jobs` query, which counts itself in `counters.graph_loads`.

Lock order (PostgreSQL; SQLite has one writer and cannot deadlock)
 1. the operation's own run row (`Tx.lock_run`, `SELECT ... FOR UPDATE`),
    before any job, unit, cohort or group row of that run; a batch of
    several runs' completions takes all their rows, in id order, first;
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
 (`_retry_groups`) takes the runs the group's work writes, waiting for them a
 bounded while (`RETRY_GROUP_LOCK_WAIT`, before the group's row, so in the
 same order), carries out the group's recorded cancellations and
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

Operations: submit_run, claim_job, claim_jobs, heartbeat, name_job, job_context,
complete_job, complete_and_claim, settle_job, cancel_run, expire_leases,
rerun, and the queries get_run, list_runs, get_job, list_jobs.
 On PostgreSQL a batch of one run's completions and the runner's next claims
 is one `preloop_complete_claim` call (schema migration 5; migration 14 for
 the order): the batch's own job rows first (each leased by this runner,
 lease-guarded) and, when none of them frees a slot or a group, the claims
 (`SKIP LOCKED`, never waiting); when they free slots of a capped matrix or
 release concurrency groups, each group handed to its oldest waiter
 (`preloop_promote_group`, migration 27), the next parked legs locked
 (`SKIP LOCKED`) and claimed or sent through their group
 (`preloop_through_group`), then the claims that see what those queued
 (migration 25), every wait there bounded by `schema.COMPLETE_LOCK_WAIT`;
 then the run row, waited for at most as long; under it the run's and the
 units' counters and the slots no parked leg was left for. This is the one
 path that takes job and group rows before their run row: a transaction
 holding the run row that needs one of those rows (cancelling the run,
 fail-fast, the reaper, the cascade releasing a group or `preloop_settle`
 handing a slot to a parked leg), or that holds one the batch waits for,
 makes the batch's wait run out; the batch undoes itself and runs again in
 the order above (run row first), counted as `complete_and_claim.lock_first`. Since migration 19 the
 same holds for the jobs a batch queues when its jobs are the last of a need
 that ended clean and whose dependents are all plain: those blocked rows are
 written before the run row too (their lock waits are also bounded by
 `COMPLETE_LOCK_WAIT`), and that the need ended, and the run was not told to
 cancel, is checked again under the run row (or the batch undoes itself).
 Every other path takes a run row before any job row of that run, so a cycle
 can only pass through such a batch's wait, and lasts no longer than it.
 Before a connection's first batch the store calls `preloop_warm_settle`
 (migration 26), which takes the common paths above once on runs of its own
 and undoes them: PL/pgSQL plans a statement the first time a connection
 runs it, and otherwise planned those after the run row under it.

The rules live in `preloop.control.cascade`, the claim statement and lite's
batch completion in `preloop.control.batch`, every fixed statement by name in
`queries.sql`.

Job statuses: blocked (needs not ended) -> parked (max-parallel cap) ->
waiting (concurrency group) -> queued -> running -> completed; a reusable
caller is admitted the same way and then, instead of queueing, is `folding`
while its inner jobs run (holding its slot and group until it folds); a
deferred job becomes `expanded` once its legs exist. Conclusions: success,
failure, cancelled, skipped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from preloop import config
from preloop.control import types as _types
from preloop.control.batch import (
    _ENDED_MARK,
    _RUN_ROW_BUSY,
    _SLOW_ENDED,
    _SLOW_OTHER,
    _SLOW_PATH,
    _check_terminal,
    _Claim,
    _claim_lite,
    _complete_lite_fast,
    _lease,
    _leases_pg,
    _not_settled,
    run_outputs_length,
)
from preloop.control.cascade import _Cascade
from preloop.control.conditions import evaluate_expr
from preloop.control.counters import Counters
from preloop.control.db import Backend, LiteBackend, PgBackend, Row, StoreError, Tx
from preloop.control.queries import Q
from preloop.control.rerun import _RERUN_SQL, _rerun_statement, attempt_of, with_attempt
from preloop.control.reusable import scoped_inputs
from preloop.control.rows import (
    _JOB,
    _dumps,
    _insert_plan,
    _job_info,
    _loads,
    _needs_view,
    _run_info,
)
from preloop.control.types import (
    DEFAULT_LEASE_SECONDS,
    TERMINAL,
    Completion,
    Heartbeat,
    JobInfo,
    JobResultItem,
    Lease,
    NonTerminalConclusion,
    RunInfo,
    UnknownRun,
    run_outputs_refusal,
)
from preloop.control.wakeups import JOBS
from preloop.errors import PreloopError
from preloop.workflow.plan import ConcurrencySpec, Plan, strategy_context

__all__ = [
    "TERMINAL",
    "USER_CANCEL_REASON",
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

#: Why a run `Store.cancel_run` cancels was cancelled, unless told otherwise.
USER_CANCEL_REASON = "cancelled by the user (preloop cancel)"

#: Follow-up transactions for a group whose promotion or cancellation was put
#: off, and how long each waits for the runs it writes (PostgreSQL): together
#: they outlast a batch's or a cancellation's hold of a run row (a big run's
#: cancellation holds it 150-190 ms); past them the reaper carries it out.
RETRY_GROUP_TRIES = 3
RETRY_GROUP_LOCK_WAIT = "250ms"


def _text_array(items: Sequence[str]) -> str:
    """`items` as a PostgreSQL array literal (each element quoted), for a
    `?::TEXT[]` parameter: psycopg's list adapter inspects every element of
    every list, which the batch path paid per call."""
    return (
        "{" + ",".join('"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"' for x in items) + "}"
    )


def _labels_param(claim: _Claim | None) -> str | None:
    """A claim's labels for `p_labels`. NULL claims any job: in the claim's
    `label <> ALL (p_labels)`, no label is missing from a NULL array."""
    if claim is None:
        return "{}"
    return None if claim.labels is None else _text_array(claim.labels)


def _warm_settle_paths(tx: Tx) -> list[str]:
    """The paths `preloop_warm_settle` saw taken (or the error it met)."""
    row = tx.one(Q["pg_select_preloop_warm_settle"])
    return list(row["paths"]) if row else []


def _server_refused(claim: _Claim | None) -> None:
    """The server refused the batch with a SQLSTATE of its own: nothing of that
    attempt committed (nor of one before it, which it looked for), so the next
    call is a first attempt again."""
    if claim is not None:
        claim.attempts = 0


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

    @property
    def backend(self) -> Backend:
        """The connection layer, for tables beside the scheduler's that share
        its retries (e.g. `preloop.control.blobs`)."""
        return self._db

    def close(self) -> None:
        self._db.close()

    # ------------------------------------------------------------ wake-ups

    def work_token(self, channel: str = JOBS) -> int | None:
        """Take before looking for work, then wait with `on_work` (see
        preloop.control.wakeups); None: this store has no wake-ups (lite): poll."""
        listener = self._db.listener()
        return None if listener is None else listener.token(channel)

    @property
    def listening(self) -> bool:
        """Whether wake-ups are live now (the fallback poll may be slow)."""
        listener = self._db.listener(start=False)
        return listener is not None and listener.listening

    def on_work(
        self, token: int, callback: Callable[[], None], channel: str = JOBS
    ) -> Callable[[], None]:
        """Calls `callback` (from another thread, or at once) when a job may
        have been queued (channel `RUNS`: a run completed) since `token` was
        taken; returns the unsubscribe."""
        listener = self._db.listener()
        assert listener is not None, "on_work needs a token from work_token()"
        return listener.subscribe(token, callback, channel)

    def wait_work(self, token: int, timeout: float, channel: str = JOBS) -> bool:
        """Blocks this thread until a wake-up on `channel` newer than `token`
        (True) or `timeout` seconds (False); `token` from `work_token()`."""
        listener = self._db.listener()
        assert listener is not None, "wait_work needs a token from work_token()"
        return listener.wait(token, timeout, channel)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ submit

    def submit_run(self, plan: Plan, *, github: dict[str, Any] | None = None) -> int:
        """Stores `plan` as a new run and promotes its root jobs; returns the run id.
        Unless `github` has a `run_number`, the run gets its workflow's next one
        in the repository `github.repository` names (from 1, as on GitHub)."""
        github = dict(github or {})
        if "run_number" not in github:
            repository = str(github.get("repository") or "")
            github["run_number"] = str(self._number_run(repository, plan.workflow))
        github.setdefault("run_attempt", "1")  # `if: github.run_attempt == '1'` as on GitHub
        context = {"env": plan.env, "inputs": plan.inputs, "github": github, "vars": plan.vars}
        cascade_groups: set[str] = set()

        def tx_fn(tx: Tx) -> int:
            now = time.time()
            conc = plan.concurrency
            group = conc.group if conc is not None else None
            row = tx.one(
                Q["submit_run_insert_runs"],
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
            if conc is not None and group is None and conc.group_expr:
                # Evaluated with the run's id, as the scheduler's job groups are.
                github_ctx = {"run_id": str(run_id), **context["github"]}
                group = str(evaluate_expr(conc.group_expr, {**context, "github": github_ctx}))
                tx.execute(Q["submit_run_update_runs_group"], (group, run_id))
            _insert_plan(tx, run_id, plan)
            c = _Cascade(tx, self)
            c.admit_run(run_id, group, conc)
            cascade_groups.update(c.retry_groups)
            return run_id

        run_id = self._db.transaction("submit_run", tx_fn)
        self._retry_groups(cascade_groups)
        return run_id

    def _number_run(self, repository: str, workflow: str) -> int:
        """The next run number of `workflow` in `repository`, in a transaction
        of its own: submits of one workflow wait for each other only this
        long, not for each other's whole plan."""

        def tx_fn(tx: Tx) -> int:
            row = tx.one(Q["number_run_upsert_run_numbers"], (repository, workflow))
            assert row is not None
            return int(row["last"])

        return self._db.transaction("number_run", tx_fn)

    def rerun(
        self,
        run_id: int,
        *,
        failed_only: bool = True,
        github: Mapping[str, Any] | None = None,
        latest_only: bool = False,
    ) -> int:
        """A new run from an ended one (GitHub's re-run). With `failed_only`,
        jobs that succeeded with every ancestor succeeding are kept as they
        ended (outputs included) and the rest run again; otherwise every job
        runs again (deferred matrices are expanded anew). `github` replaces
        entries of the run's `github` context (where the re-run's snapshot
        and engine are); `github.run_id` stays the first run's, as GitHub's
        attempts share their run's id. With `latest_only`, a run already
        re-run is refused (GitHub re-runs a run's latest attempt only), in
        the same transaction: two re-runs at once never fork the chain.
        Set-based over the old run's rows: no graph load."""
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
            if latest_only:
                later = tx.one(Q["rerun_select_later_runs"], (run_id,))
                if later is not None:
                    raise StoreError(
                        f"run {run_id} was re-run already, as run {later['id']}: re-run "
                        "the latest attempt (see `preloop status`)"
                    )
            ctx_row = tx.one(Q["rerun_select_runs_context"], (run_id,))
            assert ctx_row is not None
            context = _loads(ctx_row["context"])
            first = run_id  # the first run of the chain: its attempts count up
            while ctx_row is not None and ctx_row["rerun_of"] is not None:
                first = int(ctx_row["rerun_of"])
                ctx_row = tx.one(Q["rerun_select_runs_context"], (first,))
            counted = tx.one(Q["rerun_upsert_run_attempts"], (first, attempt_of(context) + 1))
            assert counted is not None
            context = {
                **context,
                "github": {"run_id": str(first), **(context.get("github") or {}), **(github or {})},
            }
            row = tx.one(
                Q["rerun_insert_runs"],
                (_dumps(with_attempt(context, int(counted["last"]))), time.time(), run_id),
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
                conc = tx.one(Q["rerun_select_runs"], (new,))
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
        labels: Sequence[str] | None,
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        run_id: int | None = None,
    ) -> Lease | None:
        """Claims the first queued job (FIFO by run, then job seq) whose
        `runs-on` labels are all among `labels` (case-insensitive); `labels`
        None takes a job whatever its labels. With `run_id`, only that run's
        jobs: the local runners of a `preloop run` serve their own run, never
        another one sharing the store, and take all of it (labels None: a
        label a reusable workflow's inputs resolve to is known only then)."""
        leases = self.claim_jobs(
            runner, labels, limit=1, lease_seconds=lease_seconds, run_id=run_id
        )
        return leases[0] if leases else None

    def claim_jobs(
        self,
        runner: str,
        labels: Sequence[str] | None,
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

    def name_job(self, lease: Lease, name: str) -> None:
        """Records the display name of a leased job whose `name:` could be
        evaluated only when it started (it uses `needs`), as GitHub shows it."""
        self._db.statement(
            "name_job",
            lambda tx: tx.execute(
                Q["name_job_update_jobs"], (name, lease.run_id, lease.job_id, lease.token)
            ),
        )

    def heartbeat(self, lease: Lease, *, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> Heartbeat:
        """Extends `lease`; tells the runner whether to stop."""

        def tx_fn(tx: Tx) -> Heartbeat:
            row = tx.one(
                Q["heartbeat_update_jobs"],
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
                Q["job_context_select_jobs"],
                (run_id, job_id),
            )
            run = tx.one(Q["job_context_select_runs"], (run_id,))
            if job is None or run is None:
                raise UnknownRun(f"run {run_id} has no job {job_id!r}")
            ctx: dict[str, Any] = dict(json.loads(run["context"]))
            # As the cascade's contexts (a job name may use github.run_id).
            ctx["github"] = {"run_id": str(run_id), **(ctx.get("github") or {})}
            ctx["needs"] = _needs_view(tx, run_id, json.loads(job["needs"]), job["caller"])
            ctx["matrix"] = _loads(job["matrix"])  # null without a matrix, as on GitHub
            ctx["strategy"] = strategy_context(_loads(job["strategy"]))
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
        labels: Sequence[str] | None,
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
        ended = False
        if self.dialect == "pg" and len({lease.run_id for lease, _, _ in results}) <= 1:
            fast = self._complete_fast(op, results, claim)
            if not isinstance(fast, str):
                return fast
            ended = fast == _SLOW_ENDED and len(results) > 1
        groups: set[str] = set()

        one_run = len({lease.run_id for lease, _, _ in results}) == 1

        def tx_fn(tx: Tx) -> tuple[list[Completion | PreloopError], list[Lease]]:
            done: list[Completion | PreloopError] = []
            if tx.dialect == "lite" and one_run:
                fast = _complete_lite_fast(tx, results, _types.RUN_OUTPUTS_MAX_BYTES)
                if fast is not None:
                    claimed = _claim_lite(tx, claim) if claim is not None and claim.limit else []
                    return list(fast), claimed
            # Runs in id order: two batches never wait on each other's run rows.
            order = sorted(range(len(results)), key=lambda i: results[i][0].run_id)
            if not one_run:
                # Every run row before the first run's cascade takes a group:
                # holding a group while waiting for a later run's row would
                # cross a transaction that holds that row and then writes the
                # group (the cascade's order, run row then group).
                tx.lock_runs([lease.run_id for lease, _, _ in results])
            by_index: dict[int, Completion | PreloopError] = {}
            bulk = self._pg_cascade(tx, results, groups) if ended else None
            if bulk is not None:
                by_index = dict(enumerate(bulk))
                order = []
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
                    if claim.attempts == 0:
                        # No attempt of this claim committed: its jobs start
                        # now, not before the completions just written (the
                        # refused one-statement try and its warm-up).
                        claim.at = time.time()
                    leases = self._pg_call(tx, [], claim)[1]
                else:
                    leases = _claim_lite(tx, claim)
            return done, leases

        result = self._db.transaction(op, tx_fn)
        self._retry_groups(groups)
        return result

    def _complete_fast(
        self, op: str, results: Sequence[JobResultItem], claim: _Claim | None
    ) -> tuple[list[Completion | PreloopError], list[Lease]] | str:
        """The PostgreSQL one-statement path; when the batch needs the cascade
        in Python (nothing was written then), why: `_SLOW_ENDED` when a unit
        or the run ends, `_SLOW_OTHER` otherwise."""
        import psycopg

        def call(
            tx: Tx, lock_first: bool = False
        ) -> tuple[list[Completion | PreloopError], list[Lease]]:
            settled, leases, _ = self._pg_call(tx, results, claim, lock_first=lock_first)
            return list(settled), leases

        self._warm_settle()
        try:
            try:
                return self._db.statement(op, call)
            except psycopg.Error as exc:
                if exc.sqlstate != _RUN_ROW_BUSY:
                    raise
                # The run row stayed taken past COMPLETE_LOCK_WAIT while this
                # batch held its job rows (schema migrations 14 and 17):
                # undone; again, taking the run row first.
                self.counters.add_statements(op + ".lock_first", 1)
                _server_refused(claim)
                return self._db.statement(op, lambda tx: call(tx, lock_first=True))
        except psycopg.Error as exc:
            if exc.sqlstate != _SLOW_PATH:
                raise
            self.counters.add_statements(op + ".fallback", 1)
            # The claim after the Python cascade is then a first attempt: no
            # recovery scan while that transaction holds the run row.
            _server_refused(claim)
            primary = exc.diag.message_primary or ""
            return _SLOW_ENDED if primary.endswith(_ENDED_MARK) else _SLOW_OTHER

    def _warm_settle(self) -> None:
        """Before this thread's connection first runs `preloop_complete_claim`:
        `preloop_warm_settle` takes the function's common paths on runs of
        its own and undoes them, so their statements are planned before the
        connection first holds a run row (schema migration 26). A warm-up
        that fails (cancelled, an error it returns) is counted as
        `warm_settle.failed`, never raised: the connection is only slower."""
        import psycopg

        try:
            paths = self._db.once_per_connection("warm_settle", _warm_settle_paths)
        except psycopg.Error:
            paths = ["error"]
        if paths is not None and any(p.startswith("error") for p in paths):
            self.counters.add_statements("warm_settle.failed", 1)

    def _pg_cascade(
        self, tx: Tx, results: Sequence[JobResultItem], groups: set[str]
    ) -> list[Completion] | None:
        """A batch (of one run) of which a unit or the run ends, inside `tx`:
        `preloop_complete_claim` in its cascade mode (schema migration 19)
        writes the jobs, the counters, freed slots and groups in one call,
        taking the run row first, and leaves the units and the run that ended
        to the cascade here, instead of a `preloop_settle` call per job. None
        (and nothing written) when the batch needs those calls (a failure, the
        outputs limit, a parked leg that is not plain), or when a job of the
        run has a concurrency group: this call frees every group and slot of
        the batch before any unit ends, so a group held by the batch's second
        job would be free to the first job's dependents; one job after the
        other, as `complete_job` and lite settle a batch, they queue behind it."""
        import psycopg

        run_id = results[0][0].run_id
        if tx.one(Q["pg_cascade_select_grouped_job"], (run_id,)) is not None:
            return None
        tx.execute("SAVEPOINT preloop_cascade")
        try:
            done, _, row = self._pg_call(tx, results, None, lock_first=True, cascade=True)
        except psycopg.Error as exc:
            if exc.sqlstate != _SLOW_PATH:
                raise
            tx.execute("ROLLBACK TO SAVEPOINT preloop_cascade")
            return None
        c = _Cascade.after_settle(tx, self, row["run_row"])
        # The worklist pops from its end: units end in base-id order.
        ended = sorted(row["ended"] or [], key=lambda u: str(u["base_id"]), reverse=True)
        c.work.extend(("end_unit", (run_id, unit)) for unit in ended)
        c.finish_into(groups)
        return done

    def _pg_call(
        self,
        tx: Tx,
        results: Sequence[JobResultItem],
        claim: _Claim | None,
        *,
        lock_first: bool = False,
        cascade: bool = False,
    ) -> tuple[list[Completion], list[Lease], Row]:
        """One `preloop_complete_claim` call: `results` (all of one run) and
        `claim`, and the function's row (with `cascade`, the run row and the
        units that ended); raises psycopg's error with SQLSTATE PLSLO when the
        batch needs the Python cascade, and PLLCK when the run row was not had
        in time after the batch's job rows (`lock_first`: the run row first,
        waiting as long as it takes)."""
        now = claim.at if claim is not None else time.time()
        if claim is not None and claim.limit > 0:
            claim.attempts += 1
            if claim.attempts > 1:
                # A rerun (a lost answer, a deadlock): if an
                # attempt before committed, its claims are this runner's jobs
                # started at `claim.at`; claiming others would orphan them.
                rows = tx.execute(Q["recover_claims_select_jobs"], (claim.runner, claim.at))
                if rows:
                    done = [_not_settled(tx, lease.run_id, lease.job_id) for lease, _, _ in results]
                    return done, [_lease(r, claim, now) for r in rows], {}
        run_id = results[0][0].run_id if results else None
        t0 = time.perf_counter_ns()
        row = tx.one(
            Q["pg_call_select_preloop_complete_claim"],
            (
                run_id,
                _text_array([lease.job_id for lease, _, _ in results]),
                _text_array([conclusion for _, conclusion, _ in results]),
                _text_array([_dumps(outputs) if outputs else "{}" for _, _, outputs in results]),
                _text_array([lease.token for lease, _, _ in results]),
                now,
                claim.runner if claim else "",
                _labels_param(claim),
                claim.limit if claim else 0,
                now + (claim.lease_seconds if claim else 0.0),
                claim.run_id if claim else None,
                _types.RUN_OUTPUTS_MAX_BYTES,
                lock_first,
                cascade,
            ),
        )
        assert row is not None
        if results:
            tx.note_lock_run_wait(t0, int(row["wait_us"]) * 1000)
            tx.note_lock_hold(int(row["hold_us"]) * 1000)
        conclusions = {job_id: conclusion for job_id, conclusion in row["settled"] or []}
        done = [
            Completion(lease.run_id, lease.job_id, conclusions[lease.job_id], True)
            for lease, _, _ in results
        ]
        leases = _leases_pg(row["claimed"], claim, now) if claim else []
        return done, leases, row

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
        groups to retry after commit are added to `groups`. Outputs that would
        take the run's over `RUN_OUTPUTS_MAX_BYTES` are refused: the job ends
        as a failure without them (`Completion.outputs_refused` says why)."""
        if tx.dialect == "pg":
            # `preloop_settle` checks the limit after its first write took
            # the run row: no statement more.
            return self._settle_pg(tx, run_id, job_id, conclusion, outputs, reason, token, groups)
        refused = None
        if outputs:
            # Lite holds the write lock already: two jobs of the run completing
            # at once cannot both pass the check.
            limit = _types.RUN_OUTPUTS_MAX_BYTES
            size = len(_dumps(outputs))
            used = run_outputs_length(tx, run_id, job_id)
            if used + size > limit:
                refused = run_outputs_refusal(run_id, outputs, size, used, limit)
                conclusion, outputs, reason = "failure", None, reason or refused
        # The common path is three statements: the run row (locked by the
        # write that counts the job as ended), the job row (guarded: only
        # a live job, only the lease holder), and its unit.
        run = tx.lock_run(run_id, settle_delta=-1)
        if run is None:
            raise UnknownRun(f"no run {run_id} in the store {self.url}")
        lease_guard = " AND status = 'running' AND lease_token = ?" if token else ""
        job = tx.one(
            "UPDATE jobs SET status = 'completed', conclusion = CASE WHEN "
            "cancel_requested = 1 AND ? <> 'skipped' THEN 'cancelled' ELSE ? END, "
            # A job told to stop keeps why (a runner's batch result has no reason).
            "outputs = ?, reason = COALESCE(?, reason), completed_at = ?, lease_token = NULL "
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
            tx.execute(Q["settle_tx_update_runs"], (run_id,))
            return _not_settled(tx, run_id, job_id)
        c = _Cascade.after_settle(tx, self, run)
        c.after_conclude(job, job["conclusion"], outputs or {})
        c.finish_into(groups)
        return Completion(run_id, job_id, job["conclusion"], True, outputs_refused=refused)

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
        """The PostgreSQL settle: one `preloop_settle` call (schema migrations
        2, 9 and 12) does the common path and the run outputs limit; the cascade
        continues here when needed."""
        t0 = time.perf_counter_ns()
        limit = _types.RUN_OUTPUTS_MAX_BYTES
        dumped = _dumps(outputs or {})
        row = tx.one(
            Q["settle_pg_select_preloop_settle"],
            (run_id, job_id, conclusion, dumped, reason, token, time.time(), limit),
        )
        if row is None:
            raise UnknownRun(f"no run {run_id} in the store {self.url}")
        tx.note_lock_run_wait(t0, int(row["wait_us"]) * 1000)
        if row["job_row"] is None:
            return _not_settled(tx, run_id, job_id)
        refused = None
        if row["refused_used"] is not None:
            used = int(row["refused_used"])
            refused = run_outputs_refusal(run_id, outputs or {}, len(dumped), used, limit)
            outputs = None
            if reason is None:
                tx.execute(Q["settle_pg_update_jobs_reason"], (refused, run_id, job_id))
        run: Row = row["run_row"]
        job: Row = row["job_row"]
        unit: Row = row["unit_row"]
        c = _Cascade.after_settle(tx, self, run)
        c.after_conclude(
            job,
            job["conclusion"],
            outputs or {},
            unit=unit,
            slot_handed=row["admitted"] is not None,
        )
        c.finish_into(groups)
        return Completion(run_id, job_id, job["conclusion"], True, outputs_refused=refused)

    def cancel_run(self, run_id: int, reason: str = USER_CANCEL_REASON) -> bool:
        """Cancels a run: queued jobs are cancelled, running jobs told to stop,
        `always()` jobs still run; the jobs it ends keep `reason` (why the run
        was cancelled). Returns False when the run had already ended."""
        groups: set[str] = set()

        def tx_fn(tx: Tx) -> bool:
            run = tx.lock_run(run_id)
            if run is None:
                raise UnknownRun(f"no run {run_id}")
            c = _Cascade(tx, self)
            changed = c.cancel_run(run, reason)
            c.finish()
            groups.update(c.retry_groups)
            return changed

        result = self._db.transaction("cancel_run", tx_fn)
        self._retry_groups(groups)
        return result

    def next_lease_expiry(self) -> float | None:
        """When the earliest lease of a running job expires (None: no job is
        running), so a reaper sleeps until then instead of polling."""
        row = self._db.transaction(
            "next_lease_expiry", lambda tx: tx.one(Q["next_lease_expiry_select_jobs"])
        )
        return None if row is None or row["t"] is None else float(row["t"])

    def expire_leases(self, now: float | None = None) -> int:
        """Fails every running job whose lease expired before `now` (cascading),
        retries free concurrency groups with waiters and carries out the
        cancellations groups owe (`_Cascade.defer`). Returns jobs failed."""
        now = time.time() if now is None else now

        def find(tx: Tx) -> list[Row]:
            return tx.execute(
                Q["find_select_jobs"],
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
            lambda tx: [r["name"] for r in tx.execute(Q["expire_leases_select_conc_groups"])],
        )
        groups.update(free)
        self._retry_groups(groups)
        return failed

    def _retry_groups(self, groups: set[str]) -> None:
        """Carries out deferred cancellations and promotes waiters of groups a
        transaction could not reach without waiting on another run's lock
        (see the module docstring)."""
        for _ in range(RETRY_GROUP_TRIES):
            if not groups:
                return
            again: set[str] = set()
            for name in sorted(groups):

                def tx_fn(tx: Tx, name: str = name, again: set[str] = again) -> None:
                    if tx.dialect == "pg":
                        # The runs it writes were held (that is why it was put
                        # off): waited for, a while, before the group's row,
                        # in the cascade's order (the batch's hand-over that
                        # takes a group before its run row gives way after
                        # 50 ms). A held group promotes no one: its waiter's
                        # run is left alone. Each row's wait of
                        # `RETRY_GROUP_LOCK_WAIT` outlasts a batch or a
                        # cancellation; a holder that outlasts every try
                        # leaves the group to the reaper.
                        runs = tx.execute(Q["retry_groups_select_runs"], (name,))
                        if not tx.lock_runs_within(
                            [int(r["run_id"]) for r in runs], RETRY_GROUP_LOCK_WAIT
                        ):
                            again.add(name)
                            return
                        # The group row before its recorded cancellations, as
                        # a release takes them: no two transactions cross.
                        tx.execute(Q["retry_groups_select_conc_groups"], (name,))
                    c = _Cascade(tx, self)
                    c.run_deferred(name)
                    c.promote_group(name)
                    c.finish()
                    again.update(c.retry_groups)

                self._db.transaction("retry_group", tx_fn)
            groups = again

    # ------------------------------------------------------------------ queries

    def get_run(self, run_id: int) -> RunInfo:
        row = self._db.transaction("query", lambda tx: tx.one(Q["get_run_select_runs"], (run_id,)))
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
            "query", lambda tx: tx.one(Q["run_context_select_runs"], (run_id,))
        )
        if row is None:
            raise UnknownRun(f"no run {run_id} in the store {self._db.url}")
        context: dict[str, Any] = json.loads(row["context"])
        return context

    def unfinished_run_contexts(self) -> dict[int, dict[str, Any]]:
        """The run-level contexts (as `run_context`) of every run that has not
        completed, by run id: one query, however many runs."""
        rows = self._db.transaction(
            "query", lambda tx: tx.execute(Q["unfinished_run_contexts_select_runs"], ())
        )
        return {int(r["id"]): json.loads(r["context"]) for r in rows}

    def get_job(self, run_id: int, job_id: str) -> JobInfo:
        row = self._db.transaction(
            "query",
            lambda tx: tx.one(Q["get_job_select_jobs"], (run_id, job_id)),
        )
        if row is None:
            raise UnknownRun(f"run {run_id} has no job {job_id!r}")
        return _job_info(row)

    def list_jobs(self, run_id: int) -> list[JobInfo]:
        """Every job of a run (a whole-run read: counted as a graph load)."""
        self.counters.add_graph_load()
        rows = self._db.transaction(
            "query",
            lambda tx: tx.execute(Q["list_jobs_select_jobs"], (run_id,)),
        )
        return [_job_info(r) for r in rows]
