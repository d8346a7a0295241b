"""The cascade rules: the work one transaction does after a state change
(concluding jobs, ending units, promoting dependents, admitting max-parallel
legs, taking and releasing concurrency groups, folding reusable callers,
ending runs). `Store` drives it; the lock order it keeps is documented in
`preloop.control.store`."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from preloop.control.conditions import (
    ExpressionError,
    MatrixError,
    ancestor_status,
    evaluate_expr,
    expand_matrix_value,
    should_run,
)
from preloop.control.db import Row, Tx
from preloop.control.queries import Q
from preloop.control.reusable import callee_inputs, scoped_inputs, start_caller
from preloop.control.rows import (
    _INSERT_JOB,
    _JOB,
    SEQ_STRIDE,
    _dumps,
    _id_sets,
    _inner_range,
    _job_row,
    _loads,
    _needs_view,
    _plain,
    _start_unit,
    _unit_result,
)
from preloop.control.schema import QUEUE_MAX, if_true_when_clean
from preloop.workflow.expressions import interpolate
from preloop.workflow.plan import (
    TRUE_WHEN_CLEAN,
    Cohort,
    ConcurrencySpec,
    PlannedJob,
    strategy_context,
)
from preloop.workflow.planner import PlanError, expand_deferred

if TYPE_CHECKING:
    from preloop.control.store import Store

#: Why a job that had not started when its run was cancelled ends cancelled
#: (the run's own cause is on the jobs the cancellation reached).
RUN_CANCELLED = "the run was cancelled"

# Takes a concurrency group for a job (or, holder_job NULL, a run) when it is
# free and nobody waits; the row is created on first use. On PostgreSQL the
# group row stays locked either way until commit.
_ACQUIRE = Q["acquire_group"]


def _queue_limit(queue_max: object) -> int:
    """How many legs or runs may wait for a group: one (a newer waiter
    replaces the older), or QUEUE_MAX with `queue: max`."""
    return QUEUE_MAX if queue_max else 1


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

    @classmethod
    def after_settle(cls, tx: Tx, store: Store, run: Row) -> _Cascade:
        """A cascade continuing a settle that locked and counted `run`: when
        that left it no job, the run ends as the cascade finishes."""
        c = cls(tx, store)
        c.note_run(run)
        if int(run["remaining_jobs"]) == 0:
            c.pending_end[int(run["id"])] = run
        return c

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
            row = self.tx.one(Q["context_select_runs"], (run_id,))
            assert row is not None
            ctx = json.loads(row["context"])
            assert isinstance(ctx, dict)
            # A job's concurrency group may use github.run_id (GitHub's has it).
            ctx["github"] = {"run_id": str(run_id), **(ctx.get("github") or {})}
            run["_ctx"] = ctx
        assert isinstance(ctx, dict)
        return ctx

    def job_contexts(self, job: Row) -> dict[str, Any]:
        ctx = dict(self.context(int(job["run_id"])))
        ctx["needs"] = _needs_view(
            self.tx, int(job["run_id"]), json.loads(job["needs"]), job["caller"]
        )
        ctx["matrix"] = _loads(job["matrix"])  # null without a matrix, as on GitHub
        ctx["strategy"] = strategy_context(_loads(job["strategy"]))
        if (inputs := scoped_inputs(self.tx, job)) is not None:
            ctx["inputs"] = inputs  # inside a reusable workflow: the callee's
        return ctx

    # -- driving

    def finish_into(self, groups: set[str]) -> None:
        """`finish`, then adds the groups whose waiters are retried after
        commit to `groups`."""
        self.finish()
        groups.update(self.retry_groups)

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
                        Q["finish_update_runs"],
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
                Q["start_run_select_runs"],
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
            Q["end_run_update_runs"],
            (conclusion, time.time(), run_id),
        )
        self.run(run_id)["status"] = "completed"
        group = row["conc_group"]
        if group is not None:
            released = self.tx.one(
                Q["end_run_update_conc_groups"],
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
            Q["conclude_update_jobs"],
            (conclusion, _dumps(outputs), reason, time.time(), run_id, job["id"], job["status"]),
        )
        if changed is None:
            # Ended by another path of this cascade, or (pg) a runner's claim
            # committed after `job` was read: the job is running now, so a
            # cancellation becomes a request to stop it instead of being lost.
            if conclusion == "cancelled" and job["status"] == "queued":
                self.tx.execute(
                    Q["conclude_update_jobs_2"],
                    (reason, run_id, job["id"]),
                )
            return
        self.run_delta.setdefault(run_id, [0, 0, 0])[0] -= 1
        if job["status"] == "waiting" and job["conc_group"] is not None:
            # A waiter that goes may be why another transaction's promotion
            # gave up (this one held the waiter's run row): the group is
            # looked at again after commit (Store._retry_groups).
            self.retry_groups.add(str(job["conc_group"]))
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
        tx.execute(Q["end_unit_update_units"], (result, run_id, base))
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
        dependents = [r["job_id"] for r in tx.execute(Q["end_unit_select_deps"], (run_id, base))]
        # With clean ancestry in a run not cancelled, a dependent this need
        # was the last of, that `ready` would queue (or park) without looking
        # at it, changes status in the same write: one pass over the rows,
        # and only the others (and a leg per parked cohort) come back.
        simple = not fail and not bad and not self.run(run_id)["cancel_requested"]
        status = (
            ", status = CASE WHEN remaining_needs = 1 AND kind = 'job' AND "
            f"{if_true_when_clean('if_expr')} "
            "AND anc_fail = 0 AND anc_bad = 0 AND conc_group IS NULL "
            "AND conc_group_expr IS NULL THEN CASE WHEN capped <> 0 THEN 'parked' "
            "ELSE 'queued' END ELSE status END"
            if simple
            else ""
        )
        rows = []
        for sel, sel_args, where, where_args in _id_sets(tx, run_id, dependents):
            update = (
                "UPDATE jobs SET remaining_needs = remaining_needs - 1, "
                "anc_fail = CASE WHEN ? = 1 THEN 1 ELSE anc_fail END, "
                f"anc_bad = CASE WHEN ? = 1 THEN 1 ELSE anc_bad END{status} "
                f"{sel} WHERE {where} AND status = 'blocked' "
                f"RETURNING {_JOB}"
            )
            if tx.dialect == "pg":
                update = (
                    f"WITH u AS ({update}) SELECT * FROM u WHERE remaining_needs = 0 AND "
                    "status = 'blocked' UNION ALL (SELECT DISTINCT ON (cohort) * FROM u "
                    "WHERE remaining_needs = 0 AND status = 'parked' ORDER BY cohort, seq)"
                )
            rows += tx.execute(update, (int(fail), int(bad), *sel_args, *where_args))
        rows = [j for j in rows if int(j["remaining_needs"]) == 0 and j["status"] != "queued"]
        rows.sort(key=lambda j: (j["seq"], j["id"]))
        if not simple:
            self.ready(run_id, rows)
            return
        # As `ready` orders its work: parked cohorts filled after the gates.
        parked = [j["cohort"] for j in rows if j["status"] == "parked"]
        for cohort in dict.fromkeys(parked):
            self.work.append(("fill_cohort", (run_id, cohort)))
        self.ready(run_id, [j for j in rows if j["status"] == "blocked"])

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
        groups: set[str | None] = set()
        for job in jobs:
            simple = (
                job["kind"] == "job"
                and (job["if_expr"] is None or job["if_expr"] in TRUE_WHEN_CLEAN)
                and not job["anc_fail"]
                and not job["anc_bad"]
                and not cancelled
                and job["conc_group_expr"] is None
            )
            if not simple or job["conc_group"] is not None:
                gated.append(job)
                # A job that only needs its (named) group: admitted in bulk
                # below when every gated job is one of those, of one group.
                groups.add(job["conc_group"] if simple and not job["conc_cancel"] else None)
            elif job["capped"]:
                parked.setdefault(job["cohort"], []).append(job["id"])
            else:
                plain.append(job["id"])
        self._bulk_status(run_id, plain, "queued")
        for cohort, ids in parked.items():
            self._bulk_status(run_id, ids, "parked")
            self.work.append(("fill_cohort", (run_id, cohort)))
        if len(gated) > 1 and len(groups) == 1 and None not in groups:
            self.work.append(("admit_grouped", (run_id, gated)))
            return
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
            Q["fill_cohort_select_cohorts"],
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
            Q["fill_cohort_update_cohorts"],
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
            if status == "cancelled":
                self.skip(job, "cancelled", RUN_CANCELLED)
            else:
                self.skip(job, "skipped")
            return
        if job["kind"] == "deferred":
            self.expand(job)
        else:
            # A reusable caller is admitted like a job (its matrix's
            # max-parallel, its `concurrency:`): it starts where a job queues.
            self.admit(job)

    def skip(self, job: Row, conclusion: str, reason: str | None = None) -> None:
        if job["kind"] == "caller":
            self.skip_inner(int(job["run_id"]), job["id"], conclusion)
        self.conclude(job, conclusion, {}, reason)

    def skip_inner(self, run_id: int, caller: str, conclusion: str) -> None:
        """A caller that will not run: every job inside it (nested callers
        included, by id prefix) ends with the caller's conclusion at once."""
        lo, hi = _inner_range(caller)
        rows = self.tx.execute(
            Q["skip_inner_update_jobs"],
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
            Q["skip_inner_update_units"],
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
        contexts = self.job_contexts(row)
        self._name_caller(row, contexts)
        try:
            start_caller(self.tx, row, contexts)
        except (ExpressionError, PlanError) as exc:
            self.skip_inner(run_id, row["id"], "skipped")
            self.conclude(row, "failure", {}, f"caller {row['id']!r}: with: {exc}")
            return
        if int(row["remaining_inner"]) == 0:
            self.work.append(("fold", (row,)))
            return
        unit = self.tx.one(
            Q["caller_started_update_units"],
            (run_id, _start_unit(row["id"])),
        )
        if unit is not None:
            self.work.append(("end_unit", (run_id, unit)))

    def _name_caller(self, row: Row, contexts: dict[str, Any]) -> None:
        """A caller's name using its `needs` (yarl's `Build dists v${{
        needs.pre-setup.outputs.dist-version }}`), known once it starts: its
        own row's, and the prefix of every job inside it (`<caller> /
        <job>`, nested ones too), as GitHub shows them; as written when it
        cannot be evaluated."""
        run_id, caller = int(row["run_id"]), str(row["id"])
        named = self.tx.one("SELECT name FROM jobs WHERE run_id = ? AND id = ?", (run_id, caller))
        if named is None or "${{" not in named["name"]:
            return
        template = str(named["name"])
        try:
            name = interpolate(template, contexts)
        except ExpressionError:
            return
        self.tx.execute(
            "UPDATE jobs SET name = ? WHERE run_id = ? AND id = ?", (name, run_id, caller)
        )
        inside, prefix = f"{caller}/", f"{template} / "
        self.tx.execute(
            "UPDATE jobs SET name = ? || substr(name, ?) WHERE run_id = ? "
            "AND substr(id, 1, ?) = ? AND substr(name, 1, ?) = ?",
            (f"{name} / ", len(prefix) + 1, run_id, len(inside), inside, len(prefix), prefix),
        )

    def _do_fold(self, caller: Row) -> None:
        """A caller whose inner jobs all ended: its conclusion and outputs."""
        run_id = int(caller["run_id"])
        cid = caller["id"]
        rows = self.tx.execute(
            Q["fold_select_units"],
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
        full = tx.one(Q["expand_select_jobs"], (run_id, jid))
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
            Q["expand_value_select_cohorts"],
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
        tx.executemany(Q["insert_expansion_insert_deps"], deps)
        units = [(run_id, b, unit_caller[b], n) for b, n in unit_members.items() if b != jid]
        units += [(run_id, _start_unit(c), None, 1) for c in inner_units]
        tx.executemany(Q["insert_expansion_insert_units"], units)
        if cohort is not None:
            tx.execute(
                Q["insert_expansion_insert_cohorts"],
                (run_id, jid, cohort.max_parallel, int(cohort.fail_fast), len(top)),
            )
        if full["anc_fail"] or full["anc_bad"]:
            tx.execute(
                Q["insert_expansion_update_jobs_2"],
                (full["anc_fail"], full["anc_bad"], run_id, jid),
            )
        tx.execute(
            Q["insert_expansion_update_jobs"],
            (_dumps(top), time.time(), run_id, jid),
        )
        tx.execute(
            Q["insert_expansion_update_units"],
            (len(top) - 1, run_id, jid),
        )
        self.run_delta.setdefault(run_id, [0, 0, 0])[0] += len(jobs) - 1
        if full["caller"] is not None:
            # Splice the legs into the caller's persisted inner job ids.
            c = tx.one(
                Q["insert_expansion_select_jobs"],
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
                    Q["insert_expansion_update_jobs_3"],
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
            Q["admit_update_cohorts"],
            (run_id, job["cohort"]),
        )
        if slot is None or not slot["admitted"]:
            self.tx.execute(Q["admit_update_jobs"], (run_id, job["id"]))
            return
        self.through_group(job, holds_slot=True)

    def _do_admit_grouped(self, run_id: int, jobs: list[Row]) -> None:
        """Gates and admits `jobs` (seq order; each would run on `success()`
        with clean ancestors, has no `if:` or one in `TRUE_WHEN_CLEAN`, and
        goes through the one named concurrency group they share, without
        cancel-in-progress) as `_do_gate` and `_do_admit` would one by one,
        in a few statements whatever their number: cohort slots in seq
        order, the first leg with
        a slot tries the group, the rest become its waiters in seq order.
        When that is not all that would happen (the group is free with
        waiters, or the waiters would go over the group's queue limit, so
        older ones are replaced), the jobs are admitted one by one."""
        tx = self.tx
        if self.run(run_id)["status"] == "completed":
            return
        # Cohort rows change only under their run's lock, held here: a read
        # stays true until the slots taken are written back.
        free: dict[str, int] = {}
        for cohort in dict.fromkeys(j["cohort"] for j in jobs if j["capped"]):
            c = tx.one(Q["fill_cohort_select_cohorts"], (run_id, cohort))
            free[cohort] = max(0, int(c["free"])) if c is not None else 0
        through: list[tuple[Row, bool]] = []  # (job, holds a slot), seq order
        parked: list[str] = []
        taken: dict[str, int] = {}
        for job in jobs:
            if not job["capped"]:
                through.append((job, False))
            elif free[job["cohort"]] > taken.get(job["cohort"], 0):
                taken[job["cohort"]] = taken.get(job["cohort"], 0) + 1
                through.append((job, True))
            else:
                parked.append(job["id"])
        if not through:
            self._bulk_status(run_id, parked, "parked")
            return
        group = str(jobs[0]["conc_group"])
        first, first_slot = through[0]
        got = tx.one(_ACQUIRE, (group, run_id, first["id"], group, group)) is not None
        waiters = through[1:] if got else through
        bulk = True
        if waiters:
            g = tx.one(Q["admit_grouped_select_conc_groups"], (group, group, group))
            if g is None or g["holder_run"] is None:
                bulk = False  # free with waiters: the oldest one is promoted
            else:
                have = int(g["waiters"])
                for k, (job, _) in enumerate(waiters, 1):
                    if have + k > _queue_limit(job["conc_queue_max"]):
                        bulk = False  # an older waiter would be replaced
                        break
        if not bulk:
            rest = jobs
            if got:
                # The first leg is through: the others go one by one after it.
                if first_slot:
                    tx.execute(Q["fill_cohort_update_cohorts"], (1, run_id, first["cohort"]))
                self.enqueue(first, first_slot, group)
                rest = [j for j in jobs if j is not first]
            for job in reversed(rest):
                self.work.append(("gate", (job,)))
            return
        for cohort, n in taken.items():
            tx.execute(Q["fill_cohort_update_cohorts"], (n, run_id, cohort))
        self._bulk_status(run_id, parked, "parked")
        if got:
            self.enqueue(first, first_slot, group)
        if waiters:
            seqs = tx.next_wait_seqs(len(waiters))
            self._bulk_waiting(
                run_id,
                group,
                [(j["id"], int(slot), seq) for (j, slot), seq in zip(waiters, seqs, strict=True)],
            )

    def _bulk_waiting(self, run_id: int, group: str, rows: list[tuple[str, int, int]]) -> None:
        """Jobs `(id, holds_slot, wait_seq)` of `run_id` become waiters of `group`."""
        if self.tx.dialect == "pg":
            self.tx.execute(
                "UPDATE jobs SET status = 'waiting', holds_slot = sel.hs, conc_group = ?, "
                "wait_seq = sel.ws FROM unnest(?::TEXT[], ?::INT[], ?::BIGINT[]) "
                "AS sel(jid, hs, ws) WHERE run_id = ? AND id = sel.jid",
                (
                    group,
                    [r[0] for r in rows],
                    [r[1] for r in rows],
                    [r[2] for r in rows],
                    run_id,
                ),
            )
            return
        for i in range(0, len(rows), 300):
            chunk = rows[i : i + 300]
            values = ", ".join("(?, ?, ?)" for _ in chunk)
            self.tx.execute(
                "UPDATE jobs SET status = 'waiting', holds_slot = v.column2, conc_group = ?, "
                f"wait_seq = v.column3 FROM (VALUES {values}) AS v "
                "WHERE jobs.run_id = ? AND jobs.id = v.column1",
                (group, *(x for r in chunk for x in r), run_id),
            )

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
                Q["release_slot_update_cohorts"],
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
        (seq,) = tx.next_wait_seqs()
        tx.execute(
            Q["through_group_update_jobs"],
            (int(holds_slot), group, seq, run_id, job["id"]),
        )
        self.make_room(group, bool(job["conc_queue_max"]), keep=(run_id, job["id"]))
        if job["conc_cancel"]:
            self.cancel_holder(group)
        self.promote_group(group)

    def make_room(self, group: str, queue_max: bool, keep: tuple[int, Any] | None) -> None:
        """One pending waiter per group (a newer one replaces the older), or up
        to QUEUE_MAX with `queue: max` (the oldest beyond it is cancelled)."""
        limit = _queue_limit(queue_max)
        excess = self.tx.execute(
            Q["make_room_select_jobs"],
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
            self.cancel_pending_run(
                run_id, f"replaced by a newer run in concurrency group {group!r}"
            )
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
        g = self.tx.one(Q["cancel_holder_select_conc_groups"], (group,))
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
        reason = f"cancelled in progress by concurrency group {group!r}"
        if g["holder_job"] is None:
            self.cancel_run(self.run(run_id), reason)
            return
        job = self.tx.one(
            f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND id = ?", (run_id, g["holder_job"])
        )
        if job is None:
            return
        if job["status"] == "running":
            self.tx.execute(
                Q["cancel_holder_update_jobs"],
                (reason, run_id, job["id"]),
            )
        elif job["status"] == "folding":
            self.cancel_caller(job, reason)
        elif job["status"] == "queued":
            self.conclude(job, "cancelled", {}, reason)

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
            Q["defer_insert_conc_actions"],
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
            Q["run_deferred_delete_conc_actions"],
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
            Q["release_group_update_conc_groups"],
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
                    Q["promote_group_update_conc_groups"],
                    (group,),
                )
                if g is None:
                    return
            locked = False
            w = tx.one(
                Q["promote_group_select_jobs"],
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
                    Q["promote_group_update_conc_groups_2"],
                    (run_id, group),
                )
                tx.execute(Q["promote_group_update_runs"], (run_id,))
                self.run(run_id)["status"] = "running"
                self.start_run(run_id)
                return
            job = tx.one(
                f"SELECT {_JOB} FROM jobs WHERE run_id = ? AND id = ? AND status = 'waiting'",
                (run_id, w["id"]),
            )
            if job is not None:
                tx.execute(
                    Q["promote_group_update_conc_groups_3"],
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
        (seq,) = tx.next_wait_seqs()
        tx.execute(Q["acquire_run_group_update_runs"], (seq, run_id))
        self.run(run_id)["status"] = "pending"
        self.make_room(group, bool(conc.queue_max), keep=(run_id, None))
        if conc.cancel_in_progress:
            self.cancel_holder(group)
        self.promote_group(group)
        return False

    def cancel_pending_run(self, run_id: int, reason: str) -> None:
        """A run that never started (waiting on its workflow-level group) ends
        cancelled; its jobs keep `reason`."""
        tx = self.tx
        rows = tx.execute(
            Q["cancel_pending_run_update_jobs"],
            (reason, time.time(), run_id),
        )
        tx.execute(
            Q["cancel_pending_run_update_units"],
            (run_id,),
        )
        tx.execute(
            Q["cancel_pending_run_update_runs"],
            (len(rows), time.time(), run_id),
        )
        self.run(run_id)["status"] = "completed"

    # -- cancellation

    def cancel_run(self, run: Row, reason: str) -> bool:
        """Cancels `run` (`preloop cancel`, Ctrl-C, a workflow-level group's
        cancel-in-progress): every job it ends or tells to stop keeps `reason`
        (a running job's is kept when its runner reports it ended)."""
        tx = self.tx
        run_id = int(run["id"])
        self.note_run(run)
        if run["status"] == "completed":
            return False
        if run["status"] == "pending":
            self.cancel_pending_run(run_id, reason)
            return True
        if int(run["cancel_requested"]):
            return False
        tx.execute(Q["cancel_run_update_runs"], (run_id,))
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
                    Q["cancel_run_update_jobs"],
                    (reason, run_id, job["id"]),
                )
            else:
                # Concluded at once (see _do_fail_fast).
                self._do_conclude(job, "cancelled", {}, reason)
        return True

    def _do_fail_fast(self, run_id: int, cohort: str, failed_id: str) -> None:
        """fail-fast: the other in-progress and queued legs of the matrix are cancelled."""
        c = self.tx.one(Q["fail_fast_select_cohorts"], (run_id, cohort))
        if c is None or not c["fail_fast"]:
            return
        reason = f"fail-fast: leg {failed_id!r} failed"
        self.tx.execute(
            Q["fail_fast_update_jobs"],
            (reason, run_id, cohort),
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
            Q["cancel_caller_update_jobs"],
            (reason, run_id, lo, hi, caller["id"]),
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
