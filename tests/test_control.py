"""The scheduler, one suite over both stores: every test runs on lite (SQLite)
and on PostgreSQL (`pg_url`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from preloop.control import NonTerminalConclusion, Store, UnknownRun, open_store
from preloop.control.db import Tx
from preloop.testing.plans import PlanBuilder, drive, profile_plan
from preloop.workflow.plan import ConcurrencySpec, Plan


def statuses(store: Store, run_id: int) -> dict[str, str | None]:
    return {j.id: j.conclusion for j in store.list_jobs(run_id)}


def run_plan(
    store: Store, plan: Plan, fail: set[str] = frozenset(), **kw: object
) -> dict[str, str | None]:  # type: ignore[assignment]
    """Submits and drives `plan` (jobs in `fail` fail); asserts the run ended
    and that no operation loaded the whole run."""
    store.counters.reset()
    run_id = store.submit_run(plan)
    drive(store, plan, run_id, lambda lease: "failure" if lease.job_id in fail else "success", **kw)  # type: ignore[arg-type]
    assert store.counters.snapshot().graph_loads == 0
    assert store.get_run(run_id).status == "completed"
    return statuses(store, run_id)


def test_linear_needs(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("b", needs=["a"])
    b.job("c", needs=["b"])
    run_id = store.submit_run(b.plan())
    res = drive(store, b.plan(), run_id)
    assert res.dispatched == ["a", "b", "c"]
    assert store.get_run(run_id).conclusion == "success"
    assert store.counters.snapshot().graph_loads == 0


def test_failed_need_skips_dependents_and_always_runs(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("b", needs=["a"])
    b.job("c", needs=["b"])  # transitive skip
    b.job("d", needs=["b"], if_expr="failure()")  # an ancestor failed
    b.job("e", needs=["a"], if_expr="always()")
    b.job("f", needs=["a"], if_expr="success()")
    got = run_plan(store, b.plan(), fail={"a"})
    assert got == {
        "a": "failure",
        "b": "skipped",
        "c": "skipped",
        "d": "success",
        "e": "success",
        "f": "skipped",
    }


def test_diamond_with_one_failing_leg(store: Store) -> None:
    b = PlanBuilder()
    b.job("top")
    b.matrix("mid", 3, needs=["top"])
    b.job("bottom", needs=["mid"])
    b.job("report", needs=["mid"], if_expr="always() && needs.mid.result == 'failure'")
    got = run_plan(store, b.plan(), fail={"mid#1"})
    assert got["mid#0"] == got["mid#2"] == "success"
    assert got["bottom"] == "skipped"
    assert got["report"] == "success"


def test_need_on_matrix_waits_for_every_leg(store: Store) -> None:
    b = PlanBuilder()
    b.matrix("m", 5)
    b.job("after", needs=["m"])
    plan = b.plan()
    run_id = store.submit_run(plan)
    leases = [store.claim_job("r", ["ubuntu-latest"]) for _ in range(5)]
    assert all(lease is not None for lease in leases)
    for lease in leases[:4]:
        assert lease is not None
        store.complete_job(lease, "success")
        assert store.claim_job("r", ["ubuntu-latest"]) is None
    assert leases[4] is not None
    store.complete_job(leases[4], "success")
    last = store.claim_job("r", ["ubuntu-latest"])
    assert last is not None and last.job_id == "after"
    store.complete_job(last, "success")
    assert store.get_run(run_id).conclusion == "success"


def test_max_parallel_20_over_200_legs(store: Store) -> None:
    plan = profile_plan("capped", 200)
    store.counters.reset()
    run_id = store.submit_run(plan)
    res = drive(store, plan, run_id, rng=random.Random(7), check_needs=False)
    assert res.max_running_per_cohort["leg"] == 20
    assert len(res.dispatched) == 202
    assert store.get_run(run_id).conclusion == "success"
    assert store.counters.snapshot().graph_loads == 0


def test_capped_workload_finishes_603_of_603(store: Store) -> None:
    """The seed's capped workload: three 200-leg matrices at max-parallel 20,
    a setup job, an always-run merge and a report (603 jobs)."""
    b = PlanBuilder()
    b.job("setup")
    for name in ("unit", "lint", "e2e"):
        b.matrix(name, 200, needs=["setup"], max_parallel=20)
    b.job("merge", needs=["unit", "lint", "e2e"], if_expr="always()")
    b.job("report", needs=["merge"])
    plan = b.plan()
    assert len(plan.jobs) == 603
    store.counters.reset()
    run_id = store.submit_run(plan)
    fail = {"unit#17", "e2e#150"}
    res = drive(
        store,
        plan,
        run_id,
        lambda lease: "failure" if lease.job_id in fail else "success",
        rng=random.Random(3),
        check_needs=False,
    )
    assert len(res.dispatched) == 602  # every job but the skipped report ran
    assert all(v <= 20 for v in res.max_running_per_cohort.values())
    got = statuses(store, run_id)
    assert sum(1 for v in got.values() if v is not None) == 603
    assert got["merge"] == "success" and got["report"] == "skipped"
    snap = store.counters.snapshot()
    assert snap.graph_loads == 1  # the statuses() listing above, nothing else


def test_leg_failing_its_gate_frees_its_slot(store: Store) -> None:
    b = PlanBuilder()
    values = [{"g": '"ok0"'}, {"g": "{broken"}, {"g": '"ok2"'}, {"g": "{broken"}, {"g": '"ok4"'}]
    b.matrix(
        "m",
        5,
        max_parallel=1,
        values=values,
        concurrency=ConcurrencySpec(None, group_expr="fromJSON(matrix.g)"),
    )
    got = run_plan(store, b.plan())
    assert got == {
        "m#0": "success",
        "m#1": "failure",
        "m#2": "success",
        "m#3": "failure",
        "m#4": "success",
    }


def test_cohort_waiter_is_retried_when_group_frees(store: Store) -> None:
    """Legs hold cohort slots while waiting on a concurrency group; the next
    parked leg is admitted as each one ends, one holder at a time."""
    b = PlanBuilder()
    conc = ConcurrencySpec("shared", queue_max=True)
    b.matrix("m", 6, max_parallel=2, concurrency=conc)
    plan = b.plan()
    run_id = store.submit_run(plan)
    res = drive(store, plan, run_id)
    assert res.max_running_per_group["shared"] == 1
    assert res.max_running_per_cohort["m"] == 1
    assert res.dispatched == [f"m#{i}" for i in range(6)]
    assert store.get_run(run_id).conclusion == "success"


def test_concurrency_single_holder_and_pending_replacement(store: Store) -> None:
    b = PlanBuilder()
    conc = ConcurrencySpec("deploy")
    b.job("a", concurrency=conc)
    b.job("b", concurrency=conc)
    b.job("c", concurrency=conc)
    plan = b.plan()
    run_id = store.submit_run(plan)
    first = store.claim_job("r", [])
    assert first is not None and first.job_id == "a"
    assert store.claim_job("r", []) is None  # b was replaced by c; c waits
    assert store.get_job(run_id, "b").conclusion == "cancelled"
    assert store.get_job(run_id, "c").status == "waiting"
    store.complete_job(first, "success")
    nxt = store.claim_job("r", [])
    assert nxt is not None and nxt.job_id == "c"
    store.complete_job(nxt, "success")
    assert store.get_run(run_id).conclusion == "cancelled"  # b was cancelled, as on GitHub


def test_concurrency_cancel_in_progress(store: Store) -> None:
    b = PlanBuilder()
    conc = ConcurrencySpec("deploy", cancel_in_progress=True)
    b.job("a", concurrency=conc)
    b.job("b", needs=["gate"], concurrency=conc)
    b.job("gate")
    plan = b.plan()
    run_id = store.submit_run(plan)
    a = store.claim_job("r", [])
    gate = store.claim_job("r", [])
    assert a is not None and gate is not None and a.job_id == "a"
    store.complete_job(gate, "success")  # b arrives: the running holder a is told to stop
    hb = store.heartbeat(a)
    assert hb.held and hb.cancel_requested
    assert store.claim_job("r", []) is None
    done = store.complete_job(a, "success")
    assert done.conclusion == "cancelled"
    b_lease = store.claim_job("r", [])
    assert b_lease is not None and b_lease.job_id == "b"
    store.complete_job(b_lease, "success")
    assert store.get_run(run_id).status == "completed"


def test_concurrency_queue_max_keeps_every_waiter(store: Store) -> None:
    b = PlanBuilder()
    conc = ConcurrencySpec("q", queue_max=True)
    for i in range(5):
        b.job(f"j{i}", concurrency=conc)
    plan = b.plan()
    run_id = store.submit_run(plan)
    res = drive(store, plan, run_id)
    assert res.dispatched == [f"j{i}" for i in range(5)]
    assert res.max_running_per_group["q"] == 1
    assert set(statuses(store, run_id).values()) == {"success"}


def test_queue_max_caps_at_100_waiters(store: Store) -> None:
    b = PlanBuilder()
    conc = ConcurrencySpec("q", queue_max=True)
    for i in range(103):
        b.job(f"j{i:03}", concurrency=conc)
    run_id = store.submit_run(b.plan())
    got = statuses(store, run_id)
    assert [k for k, v in got.items() if v == "cancelled"] == ["j001", "j002"]


def test_workflow_concurrency_holds_and_resumes_runs(store: Store) -> None:
    def plan(name: str) -> Plan:
        b = PlanBuilder(concurrency=ConcurrencySpec("wf-group"))
        b.job("only", name=name)
        return b.plan(name)

    r1 = store.submit_run(plan("one"))
    r2 = store.submit_run(plan("two"))
    r3 = store.submit_run(plan("three"))  # replaces r2 as the pending run
    assert store.get_run(r2).conclusion == "cancelled"
    assert store.get_run(r3).status == "pending"
    lease = store.claim_job("r", [])
    assert lease is not None and lease.run_id == r1
    assert store.claim_job("r", []) is None
    store.complete_job(lease, "success")
    assert store.get_run(r1).conclusion == "success"
    lease = store.claim_job("r", [])
    assert lease is not None and lease.run_id == r3
    store.complete_job(lease, "success")
    assert store.get_run(r3).conclusion == "success"


def test_workflow_concurrency_cancel_in_progress(store: Store) -> None:
    def plan(name: str) -> Plan:
        b = PlanBuilder(concurrency=ConcurrencySpec("wf", cancel_in_progress=True))
        b.job("only", name=name)
        b.job("cleanup", needs=["only"], if_expr="always()")
        return b.plan(name)

    r1 = store.submit_run(plan("one"))
    first = store.claim_job("r", [])
    assert first is not None
    r2 = store.submit_run(plan("two"))
    assert store.get_run(r1).cancel_requested
    assert store.heartbeat(first).cancel_requested
    store.complete_job(first, "failure")
    cleanup = store.claim_job("r", [])
    assert cleanup is not None and (cleanup.run_id, cleanup.job_id) == (r1, "cleanup")
    store.complete_job(cleanup, "success")
    assert store.get_run(r1).conclusion == "cancelled"
    lease = store.claim_job("r", [])
    assert lease is not None and lease.run_id == r2


def test_fail_fast_cancels_siblings_but_not_for_continue_on_error(store: Store) -> None:
    b = PlanBuilder()
    b.matrix("ff", 4, max_parallel=2, fail_fast=True)
    b.matrix("coe", 3, fail_fast=True, continue_on_error=True)
    plan = b.plan()
    run_id = store.submit_run(plan)
    l0 = store.claim_job("r", [])
    l1 = store.claim_job("r", [])
    assert l0 is not None and l1 is not None and (l0.job_id, l1.job_id) == ("ff#0", "ff#1")
    store.complete_job(l0, "failure")
    assert store.heartbeat(l1).cancel_requested
    assert store.get_job(run_id, "ff#2").conclusion == "cancelled"
    assert store.get_job(run_id, "ff#3").conclusion == "cancelled"
    store.complete_job(l1, "success")
    assert store.get_job(run_id, "ff#1").conclusion == "cancelled"
    rest = drive(
        store, plan, run_id, lambda lease: "failure" if lease.job_id == "coe#0" else "success"
    )
    assert rest.dispatched == ["coe#0", "coe#1", "coe#2"]
    assert store.get_job(run_id, "coe#2").conclusion == "success"


def test_cancel_run_cancels_queued_and_keeps_always(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("b")
    b.job("c", needs=["a"])
    b.job("cleanup", needs=["a", "b"], if_expr="always()")
    run_id = store.submit_run(b.plan())
    a = store.claim_job("r", [])
    assert a is not None and a.job_id == "a"
    assert store.cancel_run(run_id)
    assert store.get_job(run_id, "b").conclusion == "cancelled"
    assert store.heartbeat(a).cancel_requested
    assert store.complete_job(a, "success").conclusion == "cancelled"
    assert store.get_job(run_id, "c").conclusion == "cancelled"
    cleanup = store.claim_job("r", [])
    assert cleanup is not None and cleanup.job_id == "cleanup"
    store.complete_job(cleanup, "success")
    assert store.get_run(run_id).conclusion == "cancelled"
    assert not store.cancel_run(run_id)


def test_nested_reusable_callers_fold(store: Store) -> None:
    """outer -> mid -> leaf; `mid` folds while `outer` is still incomplete
    (its sibling `outer/slow` still runs)."""
    b = PlanBuilder()
    b.job("outer", kind="caller", outputs={"v": "jobs.mid.outputs.v"})
    b.job("outer/mid", caller="outer", kind="caller", outputs={"v": "jobs.leaf.outputs.v"})
    b.job("outer/mid/leaf", caller="outer/mid")
    b.job("outer/slow", caller="outer")
    b.job("after", needs=["outer"], if_expr="needs.outer.outputs.v == 'leaf-value'")
    plan = b.plan()
    run_id = store.submit_run(plan)
    l1 = store.claim_job("r", [])
    l2 = store.claim_job("r", [])
    assert l1 is not None and l2 is not None
    assert {l1.job_id, l2.job_id} == {"outer/mid/leaf", "outer/slow"}
    leaf, slow = (l1, l2) if l1.job_id == "outer/mid/leaf" else (l2, l1)
    store.complete_job(leaf, "success", {"v": "leaf-value"})
    mid = store.get_job(run_id, "outer/mid")
    assert mid.conclusion == "success" and mid.outputs == {"v": "leaf-value"}
    assert store.get_job(run_id, "outer").status == "folding"
    store.complete_job(slow, "success")
    outer = store.get_job(run_id, "outer")
    assert outer.conclusion == "success" and outer.outputs == {"v": "leaf-value"}
    after = store.claim_job("r", [])
    assert after is not None and after.job_id == "after"
    store.complete_job(after, "success")
    assert store.get_run(run_id).conclusion == "success"


def _deferred_plan() -> Plan:
    b = PlanBuilder()
    b.job("setup")
    b.job(
        "call",
        kind="caller",
        needs=["setup"],
        outputs={"n": "jobs.test.outputs.n", "r": "jobs.test.result"},
        inner_job_ids=("call/prep", "call/test", "call/after"),
    )
    b.job("call/prep", caller="call")
    b.job(
        "call/test",
        caller="call",
        kind="deferred",
        needs=["call/prep"],
        deferred_matrix="fromJSON(needs.prep.outputs.matrix)",
    )
    b.job("call/after", caller="call", needs=["call/test"], if_expr="always()")
    b.job("final", needs=["call"], if_expr="always()")
    return b.plan()


@pytest.mark.parametrize(
    ("matrix", "expect"),
    [
        ('{"os": ["a", "b", "c"]}', "legs"),
        ('{"include": [{"os": "x", "v": 1}, {"os": "y", "v": 2}]}', "include"),
        ("[]", "empty"),
        ('"not a matrix"', "invalid"),
    ],
)
def test_deferred_reusable_caller_matrix_from_needs(store: Store, matrix: str, expect: str) -> None:
    plan = _deferred_plan()
    run_id = store.submit_run(plan)

    def outcome(lease: object) -> tuple[str, dict[str, str]]:
        job_id = lease.job_id  # type: ignore[attr-defined]
        if job_id == "call/prep":
            return "success", {"matrix": matrix if expect != "empty" else '{"include": []}'}
        if job_id.startswith("call/test#"):
            return "success", {"n": job_id}
        return "success", {}

    store.counters.reset()
    drive(store, plan, run_id, outcome)
    assert store.counters.snapshot().graph_loads == 0
    caller = store.get_job(run_id, "call")
    test = store.get_job(run_id, "call/test")
    final = store.get_job(run_id, "final")
    assert final.conclusion == "success"
    if expect in ("legs", "include"):
        n = 3 if expect == "legs" else 2
        ids = tuple(f"call/test#{i}" for i in range(n))
        assert test.status == "expanded" and test.inner_job_ids == ids
        assert caller.inner_job_ids == ("call/prep", *ids, "call/after")
        assert caller.conclusion == "success"
        assert caller.outputs["r"] == "success"
        assert caller.outputs["n"] in ids
        assert store.get_job(run_id, "call/after").conclusion == "success"
    elif expect == "empty":
        assert test.conclusion == "skipped"
        assert caller.conclusion == "success"
    else:
        assert test.conclusion == "failure"
        assert test.reason is not None and "matrix" in test.reason
        assert caller.conclusion == "failure"
        assert store.get_job(run_id, "call/after").conclusion == "success"
    assert store.get_run(run_id).status == "completed"


def test_skipped_caller_skips_its_inner_jobs(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("call", kind="caller", needs=["a"])
    b.job("call/x", caller="call")
    b.job("call/y", caller="call", needs=["call/x"], if_expr="always()")
    got = run_plan(store, b.plan(), fail={"a"})
    assert got == {"a": "failure", "call": "skipped", "call/x": "skipped", "call/y": "skipped"}


def test_non_terminal_completion_rejected_without_write(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    run_id = store.submit_run(b.plan())
    lease = store.claim_job("r", [])
    assert lease is not None
    before = store.counters.snapshot().statements.get("complete_job", 0)
    for bad in ("in_progress", "queued", "running", ""):
        with pytest.raises(NonTerminalConclusion, match="does not end a job"):
            store.complete_job(lease, bad)
        with pytest.raises(NonTerminalConclusion):
            store.settle_job(run_id, "a", bad)
    assert store.counters.snapshot().statements.get("complete_job", 0) == before
    assert store.get_job(run_id, "a").status == "running"
    store.complete_job(lease, "success")


def test_duplicate_completion_is_idempotent(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("b", needs=["a"])
    run_id = store.submit_run(b.plan())
    lease = store.claim_job("r", [])
    assert lease is not None
    assert store.complete_job(lease, "success").changed
    again = store.complete_job(lease, "failure")
    assert not again.changed and again.conclusion == "success"
    b_lease = store.claim_job("r", [])
    assert b_lease is not None and b_lease.job_id == "b"
    assert store.claim_job("r", []) is None
    store.complete_job(b_lease, "success")
    assert store.get_run(run_id).conclusion == "success"


def test_late_success_cannot_overwrite_cancelled(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    run_id = store.submit_run(b.plan())
    lease = store.claim_job("r", [])
    assert lease is not None
    store.settle_job(run_id, "a", "cancelled", reason="stopped by the engine")
    late = store.complete_job(lease, "success")
    assert not late.changed and late.conclusion == "cancelled"
    assert store.get_job(run_id, "a").conclusion == "cancelled"
    assert (
        store.get_run(run_id).conclusion == "success" or store.get_run(run_id).status == "completed"
    )


def test_lease_expiry_fails_the_job_and_cascades(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("b", needs=["a"])
    b.job("c", needs=["a"], if_expr="failure()")
    run_id = store.submit_run(b.plan())
    assert store.next_lease_expiry() is None  # nothing running: a reaper may sleep long
    lease = store.claim_job("r", [], lease_seconds=30)
    assert lease is not None
    assert store.next_lease_expiry() == pytest.approx(lease.expires_at)
    assert store.expire_leases(now=lease.expires_at - 1) == 0
    assert store.expire_leases(now=lease.expires_at + 1) == 1
    a = store.get_job(run_id, "a")
    assert a.conclusion == "failure" and a.reason is not None and "lease" in a.reason
    assert store.get_job(run_id, "b").conclusion == "skipped"
    assert not store.heartbeat(lease).held
    assert not store.complete_job(lease, "success").changed
    c = store.claim_job("r", [])
    assert c is not None and c.job_id == "c"
    store.complete_job(c, "success")
    assert store.get_run(run_id).conclusion == "failure"


def test_labels_case_insensitive_and_fifo(store: Store) -> None:
    b = PlanBuilder()
    b.job("gpu", runs_on=("Self-Hosted", "GPU"))
    b.job("plain", runs_on=("ubuntu-latest",))
    b.job("any")
    r1 = store.submit_run(b.plan())
    r2 = store.submit_run(b.plan())
    assert store.claim_job("r", []).job_id == "any"  # type: ignore[union-attr]
    got = store.claim_job("r", ["UBUNTU-LATEST", "gpu", "self-hosted"])
    assert got is not None and (got.run_id, got.job_id) == (r1, "gpu")
    got = store.claim_job("r", ["Ubuntu-Latest"])
    assert got is not None and (got.run_id, got.job_id) == (r1, "plain")
    got = store.claim_job("r", ["gpu"])
    assert got is None or (got.run_id == r2 and got.job_id == "any")


def test_claim_restricted_to_one_run_skips_earlier_runs(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("b")
    r1 = store.submit_run(b.plan())
    r2 = store.submit_run(b.plan())
    got = store.claim_job("local", ["ubuntu-latest"], run_id=r2)
    assert got is not None and (got.run_id, got.job_id) == (r2, "a")
    got = store.claim_job("local", ["ubuntu-latest"], run_id=r2)
    assert got is not None and (got.run_id, got.job_id) == (r2, "b")
    assert store.claim_job("local", ["ubuntu-latest"], run_id=r2) is None
    assert {j.status for j in store.list_jobs(r1)} == {"queued"}
    got = store.claim_job("any", ["ubuntu-latest"])  # unrestricted: FIFO from run 1
    assert got is not None and (got.run_id, got.job_id) == (r1, "a")


def test_unfinished_runs_and_run_context_read_no_jobs(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    done = store.submit_run(PlanBuilder().plan())  # empty: completes at once
    older = store.submit_run(b.plan(), github={"sha": "old"})
    for _ in range(3):
        store.submit_run(PlanBuilder().plan())
    newer = store.submit_run(b.plan(), github={"sha": "new"})
    store.counters.reset()
    unfinished = store.list_runs(None, unfinished=True)
    assert [r.id for r in unfinished] == [newer, older]
    assert [r.id for r in store.list_runs(2)] == [newer, newer - 1]
    assert done in [r.id for r in store.list_runs(None)]
    assert store.run_context(older)["github"]["sha"] == "old"
    assert store.counters.snapshot().graph_loads == 0
    with pytest.raises(UnknownRun):
        store.run_context(newer + 100)


def test_runs_are_numbered_per_workflow_and_repository(store: Store) -> None:
    """`github.run_number` counts a workflow's runs in its repository from 1;
    a re-run keeps the number and counts its attempt (`run_attempt`)."""
    b = PlanBuilder()
    b.job("a")
    ci, docs = b.plan("ci"), b.plan("docs")
    gh = {"repository": "o/r"}
    first = store.submit_run(ci, github=gh)
    second = store.submit_run(ci, github=gh)
    other_repo = store.submit_run(ci, github={"repository": "o/other"})
    other_wf = store.submit_run(docs, github=gh)
    given = store.submit_run(ci, github={**gh, "run_number": "41"})

    def number(run_id: int) -> tuple[str, str | None]:
        github = store.run_context(run_id)["github"]
        return github["run_number"], github.get("run_attempt")

    assert [number(r)[0] for r in (first, second, other_repo, other_wf, given)] == [
        "1",
        "2",
        "1",
        "1",
        "41",
    ]
    drive(store, ci, second)
    again = store.rerun(second, failed_only=False)
    drive(store, ci, again)
    assert number(again) == ("2", "2")
    third = store.rerun(again, failed_only=False)
    drive(store, ci, third)
    assert number(third) == ("2", "3")
    # Attempts only count up, whichever attempt is re-run (GitHub's too).
    assert number(store.rerun(second, failed_only=False)) == ("2", "4")
    assert number(store.submit_run(ci, github=gh))[0] == "3"


def test_a_store_from_before_run_numbers_numbers_on_after_its_runs(store_url: str) -> None:
    """A store upgraded from before `github.run_number` (schema 29) goes on
    counting after the runs it has, re-runs not counted, not from 1 again."""
    b = PlanBuilder()
    b.job("a")
    ci = b.plan("ci")
    with open_store(store_url) as store:
        runs = [store.submit_run(ci, github={"repository": "o/r"}) for _ in range(3)]
        drive(store, ci, runs[0])
        store.rerun(runs[0], failed_only=False)
        store.submit_run(ci)  # no repository

        # As schema 29 left a store whose runs came before it: no numbers.
        def before_numbers(tx: Tx) -> None:
            tx.execute("DELETE FROM run_numbers")
            tx.execute("UPDATE preloop_schema_version SET version = 29")

        store._db.transaction("test", before_numbers)
    with open_store(store_url) as store:
        github = store.run_context(store.submit_run(ci, github={"repository": "o/r"}))["github"]
        assert github["run_number"] == "4"
        assert store.run_context(store.submit_run(ci))["github"]["run_number"] == "2"


def test_runs_submitted_at_once_get_distinct_numbers(store_url: str) -> None:
    """Four processes' worth of stores submitting the same workflow at once:
    every run a number of its own, none skipped."""
    import threading

    b = PlanBuilder()
    b.job("a")
    plan = b.plan("ci")
    numbers: list[str] = []
    go = threading.Barrier(4)

    def submitter() -> None:
        with open_store(store_url) as mine:
            go.wait()
            for _ in range(5):
                run_id = mine.submit_run(plan, github={"repository": "o/r"})
                numbers.append(mine.run_context(run_id)["github"]["run_number"])

    threads = [threading.Thread(target=submitter) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(numbers, key=int) == [str(n) for n in range(1, 21)]


def test_submit_empty_plan_completes(store: Store) -> None:
    run_id = store.submit_run(PlanBuilder().plan())
    assert store.get_run(run_id).conclusion == "success"


def test_profiles_finish_without_graph_loads(store: Store) -> None:
    for profile in ("capped", "group", "merge"):
        plan = profile_plan(profile, 40)
        store.counters.reset()
        run_id = store.submit_run(plan)
        res = drive(store, plan, run_id, rng=random.Random(1), check_needs=False)
        assert len(res.dispatched) == 42
        assert store.counters.snapshot().graph_loads == 0
        assert store.get_run(run_id).conclusion == "success"
        if profile == "group":
            assert res.max_running_per_group["load-group"] == 1


def test_schema_version_and_reopen(store: Store, tmp_path: Path) -> None:
    url = store.url
    again = open_store(url if store.dialect == "pg" else url[len("sqlite://") :])
    again.close()


def test_default_lite_store_lives_in_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRELOOP_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PRELOOP_STATE_DIR", raising=False)
    monkeypatch.delenv("PRELOOP_STORE_URL", raising=False)
    with open_store() as s:
        assert s.dialect == "lite"
    assert (tmp_path / "home" / "state" / "preloop.db").is_file()


def test_job_level_group_across_runs(store: Store) -> None:
    """Waiters in other runs are promoted, replaced and cancelled in progress
    from their own rows."""

    def plan(name: str, cancel: bool = False) -> Plan:
        b = PlanBuilder()
        b.job("deploy", concurrency=ConcurrencySpec("prod", cancel_in_progress=cancel))
        return b.plan(name)

    r1 = store.submit_run(plan("one"))
    first = store.claim_job("r", [])
    assert first is not None and first.run_id == r1
    r2 = store.submit_run(plan("two"))
    assert store.get_job(r2, "deploy").status == "waiting"
    r3 = store.submit_run(plan("three"))  # replaces r2's pending job
    assert store.get_job(r2, "deploy").conclusion == "cancelled"
    assert store.get_run(r2).conclusion == "cancelled" or store.get_run(r2).status == "completed"
    store.complete_job(first, "success")  # r3's waiter is promoted across runs
    third = store.claim_job("r", [])
    assert third is not None and third.run_id == r3
    r4 = store.submit_run(plan("four", cancel=True))  # cancels r3's running holder
    assert store.heartbeat(third).cancel_requested
    assert store.complete_job(third, "success").conclusion == "cancelled"
    fourth = store.claim_job("r", [])
    assert fourth is not None and fourth.run_id == r4
    store.complete_job(fourth, "success")
    assert [store.get_run(r).status for r in (r1, r2, r3, r4)] == ["completed"] * 4
    assert store.counters.snapshot().graph_loads == 0


def test_rerun_failed_jobs_keeps_what_succeeded(store: Store) -> None:
    b = PlanBuilder()
    b.job("setup")
    b.matrix("test", 3, needs=["setup"], max_parallel=2)
    b.job("report", needs=["test"], if_expr="always()")
    b.job("deploy", needs=["test"])
    plan = b.plan()
    first = store.submit_run(plan)
    drive(
        store,
        plan,
        first,
        lambda lease: ("success", {"v": lease.job_id}) if lease.job_id != "test#1" else "failure",
    )
    assert store.get_run(first).conclusion == "failure"
    store.counters.reset()
    again = store.rerun(first)
    res = drive(store, plan, again)
    assert store.counters.snapshot().graph_loads == 0
    assert res.dispatched == ["test#1", "report", "deploy"]
    assert store.get_job(again, "setup").outputs == {"v": "setup"}
    assert store.get_run(again).conclusion == "success"
    everything = store.rerun(again, failed_only=False)
    assert drive(store, plan, everything).dispatched == [j.id for j in plan.jobs]
    assert store.get_run(everything).conclusion == "success"


def test_rerun_deferred_caller(store: Store) -> None:
    plan = _deferred_plan()
    first = store.submit_run(plan)
    matrix = '{"os": ["a", "b"]}'

    def outcome(lease: object) -> tuple[str, dict[str, str]]:
        job_id = lease.job_id  # type: ignore[attr-defined]
        if job_id == "call/prep":
            return "success", {"matrix": matrix}
        return ("failure" if job_id == "call/test#1" else "success"), {}

    drive(store, plan, first, outcome)
    assert store.get_job(first, "call").conclusion == "failure"
    again = store.rerun(first)
    res = drive(store, plan, again)
    assert res.dispatched == ["call/test#1", "call/after", "final"]
    assert store.get_job(again, "call").conclusion == "success"
    assert store.get_job(again, "final").conclusion == "success"
    whole = store.rerun(again, failed_only=False)
    res = drive(store, plan, whole, outcome)
    assert res.dispatched[:2] == ["setup", "call/prep"]
    assert store.get_job(whole, "call/test").inner_job_ids == ("call/test#0", "call/test#1")
    assert store.get_job(whole, "call").inner_job_ids.count("call/test#0") == 1
    assert store.get_run(whole).status == "completed"


def test_settling_a_caller_before_it_starts_ends_its_inner_jobs(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("call", kind="caller", needs=["a"])
    b.job("call/x", caller="call")
    b.job("after", needs=["call"], if_expr="always()")
    run_id = store.submit_run(b.plan())
    store.settle_job(run_id, "call", "cancelled", reason="stopped by the engine")
    assert store.get_job(run_id, "call/x").conclusion == "cancelled"
    drive(store, b.plan(), run_id)
    assert store.get_job(run_id, "after").conclusion == "success"
    assert store.get_run(run_id).status == "completed"


def test_group_legs_admitted_together_keep_seq_order(store: Store) -> None:
    """A need that ends and readies a matrix whose legs share a named group
    admits them at once: cohort slots in seq order, the first leg holds the
    group, the others wait in seq order, the rest park; then one runs at a
    time in seq order. Admitting 60 legs costs a few statements, not a few
    per leg."""
    b = PlanBuilder()
    b.job("setup")
    conc = ConcurrencySpec("together", queue_max=True)
    b.matrix("m", 60, needs=["setup"], max_parallel=40, concurrency=conc)
    plan = b.plan()
    run_id = store.submit_run(plan)
    setup = store.claim_job("r", [])
    assert setup is not None and setup.job_id == "setup"
    store.counters.reset()
    store.complete_job(setup, "success")
    assert store.counters.snapshot().statements["complete_job"] <= 20
    jobs = {j.id: j.status for j in store.list_jobs(run_id)}
    assert jobs["m#0"] == "queued"
    assert [jobs[f"m#{i}"] for i in range(1, 40)] == ["waiting"] * 39
    assert [jobs[f"m#{i}"] for i in range(40, 60)] == ["parked"] * 20
    res = drive(store, plan, run_id)
    assert res.dispatched == [f"m#{i}" for i in range(60)]
    assert res.max_running_per_group["together"] == 1
    assert store.get_run(run_id).conclusion == "success"


def test_group_legs_wait_behind_another_runs_waiters(store: Store) -> None:
    """Legs readied together join a group another run holds behind its
    waiters, in seq order, and run after them."""
    conc = ConcurrencySpec("shared-legs", queue_max=True)
    first = PlanBuilder()
    for i in range(3):
        first.job(f"a{i}", concurrency=conc)
    run_a = store.submit_run(first.plan("first"))
    b = PlanBuilder()
    b.job("setup")
    b.matrix("m", 4, needs=["setup"], concurrency=conc)
    run_b = store.submit_run(b.plan("second"))
    holder = store.claim_job("r", [], run_id=run_a)
    setup = store.claim_job("r", [], run_id=run_b)
    assert holder is not None and holder.job_id == "a0"
    assert setup is not None and setup.job_id == "setup"
    store.complete_job(setup, "success")
    assert {j.id: j.status for j in store.list_jobs(run_b)} == {
        "setup": "completed",
        **{f"m#{i}": "waiting" for i in range(4)},
    }
    store.complete_job(holder, "success")
    order = []
    while (lease := store.claim_job("r", [])) is not None:
        order.append(lease.job_id)
        store.complete_job(lease, "success")
    assert order == ["a1", "a2", "m#0", "m#1", "m#2", "m#3"]
    assert store.get_run(run_a).conclusion == "success"
    assert store.get_run(run_b).conclusion == "success"


def test_group_legs_over_the_queue_limit_replace_as_one_by_one(store: Store) -> None:
    """Without `queue: max` a group keeps one waiter: legs readied together
    are admitted one by one, each newer waiter replacing the older."""
    b = PlanBuilder()
    b.job("setup")
    b.matrix("m", 4, needs=["setup"], concurrency=ConcurrencySpec("one-waiter"))
    run_id = store.submit_run(b.plan())
    setup = store.claim_job("r", [])
    assert setup is not None
    store.complete_job(setup, "success")
    jobs = {j.id: (j.status, j.conclusion) for j in store.list_jobs(run_id)}
    assert jobs["m#0"] == ("queued", None)
    assert jobs["m#1"] == ("completed", "cancelled")
    assert jobs["m#2"] == ("completed", "cancelled")
    assert jobs["m#3"] == ("waiting", None)


def test_a_need_that_ends_queues_parks_and_gates_its_dependents_at_once(store: Store) -> None:
    """One need ending readies plain jobs (queued), capped legs (up to the
    cap queued, the rest parked), gated jobs (evaluated), and leaves jobs
    with another need blocked, in one write for the plain and capped ones;
    with a failed need nothing is queued without its gate."""
    b = PlanBuilder()
    b.job("setup")
    b.job("other")
    b.job("plain", needs=["setup"])
    b.matrix("cap", 5, needs=["setup"], max_parallel=2)
    b.job("gated", needs=["setup"], if_expr="success() && true")
    b.job("skips", needs=["setup"], if_expr="failure()")
    b.job("both", needs=["setup", "other"])
    run_id = store.submit_run(b.plan())
    leases = {lease.job_id: lease for lease in store.claim_jobs("r", [], limit=2)}
    assert set(leases) == {"setup", "other"}
    store.counters.reset()
    store.complete_job(leases["setup"], "success")
    assert store.counters.snapshot().graph_loads == 0
    jobs = {j.id: (j.status, j.conclusion) for j in store.list_jobs(run_id)}
    assert jobs["plain"] == ("queued", None)
    assert [jobs[f"cap#{i}"][0] for i in range(5)] == ["queued"] * 2 + ["parked"] * 3
    assert jobs["gated"] == ("queued", None)
    assert jobs["skips"] == ("completed", "skipped")
    assert jobs["both"] == ("blocked", None)
    claimed = [lease.job_id for lease in store.claim_jobs("r", [], limit=10)]
    assert claimed == ["plain", "cap#0", "cap#1", "gated"]
    store.complete_job(leases["other"], "failure")
    assert store.get_job(run_id, "both").conclusion == "skipped"
