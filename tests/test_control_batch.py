"""A runner's batch operations on both stores: `claim_jobs` (up to its free
capacity in one statement) and `complete_and_claim` (its results and its next
claims in one transaction)."""

from __future__ import annotations

import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from preloop.control import Lease, Store, open_store
from preloop.control.counters import CountersSnapshot
from preloop.testing.load import reports as load_reports
from preloop.testing.load import start_together
from preloop.testing.pg import wait_until_blocked_by
from preloop.testing.plans import PlanBuilder, with_runs_on
from preloop.workflow.plan import ConcurrencySpec


def _cohort_in_flight(store: Store, run_id: int, cohort: str) -> int:
    rows = store._db.transaction(
        "query",
        lambda tx: tx.execute(
            "SELECT count(*) AS n FROM jobs WHERE run_id = ? AND cohort = ? "
            "AND status IN ('queued', 'running')",
            (run_id, cohort),
        ),
    )
    return int(rows[0]["n"])


def _fallbacks(snapshot: CountersSnapshot) -> int:
    """Batches that left the one-statement path for the Python cascade."""
    return snapshot.operations.get("complete_and_claim.fallback", 0)


def batch_behind_a_run_row_holder(
    store: Store,
    pg_url: str,
    run_id: int,
    held: list[Lease],
    write: str,
    first: str = "",
    limit: int = 2,
) -> tuple[list[Any], list[Lease]]:
    """Completes `held` in one batch (claiming `limit`) while another
    transaction holds the row of run `run_id` (and has run `first`, if
    given); once the batch waits for it, the holder runs `write` (`%s`: the
    run id) and commits. Returns the batch's answer."""
    import psycopg

    out: dict[str, tuple[list[Any], list[Lease]]] = {}
    with psycopg.connect(pg_url) as holder:
        holder.execute("SELECT id FROM runs WHERE id = %s FOR UPDATE", (run_id,))
        if first:
            holder.execute(first, (run_id,))  # type: ignore[arg-type]
        (pid,) = holder.execute("SELECT pg_backend_pid()").fetchone() or (0,)

        def batch() -> None:
            out["result"] = store.complete_and_claim(
                [(lease, "success", None) for lease in held], "r", [], limit=limit
            )

        t = threading.Thread(target=batch)
        t.start()
        wait_until_blocked_by(holder, pid, t)
        holder.execute(write, (run_id,))  # type: ignore[arg-type]
        holder.commit()
        t.join(timeout=60)
    return out["result"]


def test_batch_claim_never_exceeds_the_runners_capacity(store: Store) -> None:
    b = PlanBuilder()
    for i in range(10):
        b.job(f"j{i}")
    run_id = store.submit_run(b.plan())
    assert store.claim_jobs("r", [], limit=0) == []
    first = store.claim_jobs("r", [], limit=3)
    assert [lease.job_id for lease in first] == ["j0", "j1", "j2"]  # claim order
    assert len({lease.token for lease in first}) == 3
    done, more = store.complete_and_claim([(first[0], "success", None)], "r", [], limit=4)
    assert [c.job_id for c in done] == ["j0"] and done[0].changed and done[0].error is None
    assert [lease.job_id for lease in more] == ["j3", "j4", "j5", "j6"]
    # The default refill is one claim per result.
    done, refill = store.complete_and_claim([(lease, "success", None) for lease in more], "r", [])
    assert len(refill) == 3  # only j7, j8, j9 were left
    held = [*first[1:], *refill]
    while held:
        _, held = store.complete_and_claim([(lease, "success", None) for lease in held], "r", [])
    assert store.get_run(run_id).conclusion == "success"
    assert store.counters.snapshot().graph_loads == 0


def test_batch_claim_never_exceeds_max_parallel(store: Store) -> None:
    b = PlanBuilder()
    b.job("setup")
    b.matrix("leg", 30, needs=["setup"], max_parallel=4)
    b.job("merge", needs=["leg"], if_expr="always()")
    run_id = store.submit_run(b.plan())
    held = store.claim_jobs("r", [], limit=50)
    assert [lease.job_id for lease in held] == ["setup"]
    dispatched = ["setup"]
    while held:
        # Finish half of what is held (at least one), keep the rest running.
        finish, keep = held[: max(1, len(held) // 2)], held[max(1, len(held) // 2) :]
        _, claimed = store.complete_and_claim(
            [(lease, "success", {"leg": lease.job_id}) for lease in finish], "r", [], limit=50
        )
        held = keep + claimed
        dispatched += [lease.job_id for lease in claimed]
        legs = [lease for lease in held if lease.job_id.startswith("leg#")]
        assert len(legs) <= 4, [lease.job_id for lease in legs]
        assert _cohort_in_flight(store, run_id, "leg") <= 4
    assert len(dispatched) == 32 and dispatched[-1] == "merge"
    assert store.get_run(run_id).conclusion == "success"
    assert store.counters.snapshot().graph_loads == 0


def test_a_need_ending_in_a_batch_parks_a_capped_matrix_and_fills_its_slots(
    store: Store,
) -> None:
    """The batch that ends the need of a max-parallel matrix parks its legs
    and queues as many as the cap allows, in seq order, each holding a slot
    (on PostgreSQL in the batch's one statement, migration 22); every freed
    slot then admits the next leg."""
    b = PlanBuilder()
    b.job("setup")
    b.matrix("leg", 10, needs=["setup"], max_parallel=3)
    b.job("merge", needs=["leg"])
    run_id = store.submit_run(b.plan())
    setup = store.claim_jobs("r", [], limit=1)
    before = store.counters.snapshot()
    _, held = store.complete_and_claim([(setup[0], "success", None)], "r", [], limit=8)
    after = store.counters.snapshot()
    assert [lease.job_id for lease in held] == ["leg#0", "leg#1", "leg#2"]
    statuses = {j.id: j.status for j in store.list_jobs(run_id)}
    assert [statuses[f"leg#{i}"] for i in range(3, 10)] == ["parked"] * 7
    assert _cohort_in_flight(store, run_id, "leg") == 3
    if store.dialect == "pg":
        assert _fallbacks(after) == _fallbacks(before)
    dispatched = [lease.job_id for lease in held]
    while held:
        _, more = store.complete_and_claim([(held[0], "success", None)], "r", [], limit=1)
        held = held[1:] + more
        dispatched += [lease.job_id for lease in more]
        assert _cohort_in_flight(store, run_id, "leg") <= 3
    assert dispatched == [*(f"leg#{i}" for i in range(10)), "merge"]
    assert store.get_run(run_id).conclusion == "success"


def test_complete_and_claim_runs_the_cascade_like_complete_job(store: Store) -> None:
    """Failures, fail-fast, outputs of several legs in one batch and an
    always() job go through the same rules as one completion at a time."""
    b = PlanBuilder()
    b.job("a")
    b.matrix("m", 6, needs=["a"], fail_fast=True)
    b.job("after", needs=["m"], if_expr="always()")
    b.job("skipped", needs=["m"])
    run_id = store.submit_run(b.plan())
    held = store.claim_jobs("r", [], limit=10)
    conclusions: dict[str, str] = {}
    while held:
        results = [
            (lease, "failure" if lease.job_id == "m#2" else "success", {"o": lease.job_id})
            for lease in held
        ]
        done, held = store.complete_and_claim(results, "r", [], limit=10)
        conclusions.update({c.job_id: c.conclusion for c in done})
    jobs = {j.id: j for j in store.list_jobs(run_id)}
    assert conclusions["m#2"] == "failure"
    assert jobs["after"].conclusion == "success"
    assert jobs["skipped"].conclusion == "skipped"
    assert store.get_run(run_id).conclusion == "failure"
    # Legs completed in one batch: one of their outputs wins, as on GitHub.
    assert store.job_context(run_id, "after")["needs"]["m"]["outputs"]["o"].startswith("m#")


def test_a_lost_lease_in_a_batch_is_reported_and_the_rest_recorded(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("b")
    run_id = store.submit_run(b.plan())
    a, bb = store.claim_jobs("r", [], limit=2)
    forged = Lease(**{**{f: getattr(a, f) for f in a.__slots__}, "token": "not-the-lease"})
    done, claimed = store.complete_and_claim(
        [(forged, "success", None), (bb, "success", None)], "r", []
    )
    assert done[0].error is not None and "not held" in done[0].error and not done[0].changed
    assert done[1].changed and done[1].error is None and done[1].conclusion == "success"
    assert claimed == []
    assert store.get_job(run_id, "a").status == "running"
    # A duplicate is not an error: the completion is idempotent.
    again, _ = store.complete_and_claim([(bb, "success", None)], "r", [])
    assert not again[0].changed and again[0].error is None
    store.complete_job(a, "success")
    assert store.get_run(run_id).conclusion == "success"


def test_complete_and_claim_is_one_transaction(store: Store) -> None:
    """A claim that fails after the completions were written (a trigger
    refusing runner `boom`) leaves the completions unwritten too."""
    b = PlanBuilder()
    b.job("a")
    b.job("b")
    b.job("c")
    run_id = store.submit_run(b.plan())
    (a,) = store.claim_jobs("r", [], limit=1)
    if store.dialect == "pg":
        ddl = [
            "CREATE FUNCTION refuse_boom() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'runner boom refused'; END $$",
            "CREATE TRIGGER refuse_boom BEFORE UPDATE ON jobs FOR EACH ROW "
            "WHEN (NEW.runner = 'boom') EXECUTE FUNCTION refuse_boom()",
        ]
    else:
        ddl = [
            "CREATE TRIGGER refuse_boom BEFORE UPDATE ON jobs FOR EACH ROW "
            "WHEN NEW.runner = 'boom' BEGIN SELECT RAISE(ABORT, 'runner boom refused'); END"
        ]
    store._db.transaction("query", lambda tx: [tx.execute(sql) for sql in ddl])
    with pytest.raises(Exception, match="runner boom refused"):
        store.complete_and_claim([(a, "success", None)], "boom", [], limit=2)
    assert store.get_job(run_id, "a").status == "running"
    assert store.get_job(run_id, "b").status == "queued"
    assert store.get_run(run_id).remaining_jobs == 3
    done, claimed = store.complete_and_claim([(a, "success", None)], "r", [], limit=2)
    assert done[0].changed and [lease.job_id for lease in claimed] == ["b", "c"]


WORKER = r"""
import json, sys
from preloop.control import open_store

url, name, run_id, capacity = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = open_store(url)

def in_flight():
    rows = store._db.transaction("query", lambda tx: tx.execute(
        "SELECT count(*) AS n FROM jobs WHERE run_id = ? AND cohort = 'leg' "
        "AND status IN ('queued', 'running')", (run_id,)))
    return int(rows[0]["n"])

print("ready", flush=True)
sys.stdin.readline()  # the go signal: both workers start together
claimed, completed, over_cap = [], [], 0
held = store.claim_jobs(name, ["linux"], limit=capacity)
while True:
    claimed += [[l.run_id, l.job_id] for l in held]
    if not held:
        if store.get_run(run_id).status == "completed":
            break
        held = store.claim_jobs(name, ["linux"], limit=capacity)
        continue
    results = [(l, "failure" if l.job_id.endswith("7") else "success", {"by": name})
               for l in held]
    done, held = store.complete_and_claim(results, name, ["linux"], limit=capacity)
    completed += [[c.run_id, c.job_id] for c in done if c.changed]
    over_cap += in_flight() > 5
snap = store.counters.snapshot()
print(json.dumps({"claimed": claimed, "completed": completed, "over_cap": over_cap,
                  "deadlocks": snap.deadlock_retries, "graph_loads": snap.graph_loads}),
      flush=True)
store.close()
"""


def test_two_processes_complete_and_claim_atomically(store: Store, store_url: str) -> None:
    """Two runner processes of capacity 4 reporting and refilling at once:
    every job is claimed once and completed once by the runner that claimed
    it, the capped cohort never has more than its 5 legs in flight, and no
    transaction deadlocks."""
    b = PlanBuilder()
    b.job("setup", runs_on=("linux",))
    b.matrix("leg", 60, needs=["setup"], max_parallel=5, runs_on=("linux",))
    b.matrix("free", 40, needs=["setup"], runs_on=("linux",))
    b.job("merge", needs=["leg", "free"], if_expr="always()", runs_on=("linux",))
    run_id = store.submit_run(b.plan())
    reports = load_reports(
        start_together(
            [[sys.executable, "-c", WORKER, store_url, f"w{i}", str(run_id), "4"] for i in range(2)]
        )
    )
    claimed = [tuple(c) for r in reports for c in r["claimed"]]
    completed = [tuple(c) for r in reports for c in r["completed"]]
    assert len(claimed) == len(set(claimed)) == 102, "a job was claimed twice or never"
    assert sorted(completed) == sorted(claimed), "a completion was lost or doubled"
    assert all(r["over_cap"] == 0 for r in reports)
    assert all(r["deadlocks"] == 0 and r["graph_loads"] == 0 for r in reports)
    with open_store(store_url) as check:
        assert check.get_run(run_id).status == "completed"
        jobs = check.list_jobs(run_id)
        assert all(j.outputs.get("by") == j.runner for j in jobs)


def test_a_runner_with_slots_told_to_stop_during_its_claim_returns(
    store: Store, tmp_path: Path
) -> None:
    """`serve` with capacity > 1: a stop that comes while the claim statement
    runs (SIGTERM, or `preloop run`'s runs ending) with no job running ends
    the loop; it once waited for a finished job that could never come."""
    import anyio
    import anyio.from_thread

    from preloop.runner import Runner, RunnerOptions

    runner = Runner(store, RunnerOptions(name="r", labels=[], state_dir=tmp_path, capacity=2))
    stop = anyio.Event()
    claim_jobs = store.claim_jobs
    claims = 0

    def claim_then_stop(*args: object, **kwargs: object) -> list[Lease]:
        nonlocal claims
        claims += 1
        leases = claim_jobs(*args, **kwargs)  # type: ignore[arg-type]
        if store.dialect == "pg":  # the claim runs in a worker thread there
            anyio.from_thread.run_sync(stop.set)
        else:
            stop.set()
        return leases

    store.claim_jobs = claim_then_stop  # type: ignore[method-assign]

    async def main() -> None:
        with anyio.fail_after(20):
            await runner.serve(stop)

    try:
        anyio.run(main)
    finally:
        runner.templates.close()
    assert claims == 1


def test_the_settle_lock_is_counted_once_per_batch_that_takes_it(pg_url: str) -> None:
    """PostgreSQL: a batch completed in one statement holds the run lock once
    (its hold as the server measured it, `Tx.note_lock_hold`); a claim alone
    never takes it."""
    with open_store(pg_url) as store:
        b = PlanBuilder()
        b.job("setup")
        b.matrix("leg", 40, needs=["setup"])
        b.job("merge", needs=["leg"], if_expr="always()")
        run_id = store.submit_run(b.plan())
        _, held = store.complete_and_claim(
            [(lease, "success", None) for lease in store.claim_jobs("r", [], limit=1)],
            "r",
            [],
            limit=8,
        )
        before = store.counters.snapshot()
        claimed = store.claim_jobs("r", [], limit=8)
        assert store.counters.snapshot().settle_lock_holds == before.settle_lock_holds
        done, more = store.complete_and_claim(
            [(lease, "success", None) for lease in [*held, *claimed]], "r", [], limit=8
        )
        after = store.counters.snapshot()
        assert all(c.changed for c in done) and len(more) == 8
        assert _fallbacks(after) == _fallbacks(before)  # one statement
        assert after.settle_lock_holds == before.settle_lock_holds + 1
        assert after.settle_lock_hold_ns >= before.settle_lock_hold_ns
        # The claims come in (run, seq) order off the index, however many are queued.
        assert [lease.job_id for lease in more] == [f"leg#{i}" for i in range(16, 24)]
        assert store.get_run(run_id).status == "running"


def test_a_batch_waiting_for_its_run_row_gives_way_to_the_holder(pg_url: str) -> None:
    """PostgreSQL: a batch writes its jobs before it takes the run row. A
    transaction that holds the run row and then needs one of those jobs (as
    cancelling a run does) is not deadlocked: the batch stops waiting after
    `COMPLETE_LOCK_WAIT`, undoes itself and runs again taking the run row
    first, so the holder's change (the job told to stop) is what it ends."""
    with open_store(pg_url) as store:
        b = PlanBuilder()
        b.matrix("leg", 4)
        run_id = store.submit_run(b.plan())
        held = store.claim_jobs("r", [], limit=2)
        # Once the batch has written its jobs and waits for the run row, the
        # holder needs one of them (the cancel path's write).
        done, claimed = batch_behind_a_run_row_holder(
            store,
            pg_url,
            run_id,
            held,
            f"UPDATE jobs SET cancel_requested = 1 WHERE run_id = %s AND id = '{held[0].job_id}'",
        )
        assert [(c.job_id, c.conclusion) for c in done] == [
            (held[0].job_id, "cancelled"),
            (held[1].job_id, "success"),
        ]
        assert [lease.job_id for lease in claimed] == ["leg#2", "leg#3"]
        snap = store.counters.snapshot()
        assert snap.operations.get("complete_and_claim.lock_first") == 1
        assert snap.deadlock_retries == 0
        assert store.get_run(run_id).remaining_jobs == 2


def test_a_batch_hands_freed_slots_over_before_the_run_row_and_gives_way(pg_url: str) -> None:
    """PostgreSQL (migration 25): a batch that frees a capped matrix's slots
    locks and claims the next parked legs before it takes the run row, so the
    run row is not held for their writes. A transaction holding the run row
    that then needs one of those legs (as a cancellation does) is not
    deadlocked: the batch stops waiting after `COMPLETE_LOCK_WAIT`, undoes its
    hand-over and runs again run row first, and the holder's write stands."""
    with open_store(pg_url) as store:
        b = PlanBuilder()
        b.matrix("leg", 6, max_parallel=2)
        run_id = store.submit_run(b.plan())
        held = store.claim_jobs("r", [], limit=2)
        assert [lease.job_id for lease in held] == ["leg#0", "leg#1"]
        # Once the batch has ended its legs, claimed the next two from parked
        # and waits for the run row, the holder writes leg#2: that waits for
        # the batch's lock until the batch gives up. Had the batch not handed
        # leg#2 over yet, it would not wait and the batch would get the run
        # row on its first try.
        done, claimed = batch_behind_a_run_row_holder(
            store,
            pg_url,
            run_id,
            held,
            "UPDATE jobs SET reason = 'holder' WHERE run_id = %s AND id = 'leg#2'",
        )
        assert [(c.job_id, c.conclusion) for c in done] == [
            ("leg#0", "success"),
            ("leg#1", "success"),
        ]
        assert [lease.job_id for lease in claimed] == ["leg#2", "leg#3"]
        snap = store.counters.snapshot()
        assert snap.operations.get("complete_and_claim.lock_first") == 1
        assert snap.deadlock_retries == 0
        assert _fallbacks(snap) == 0
        jobs = {j.id: j for j in store.list_jobs(run_id)}
        assert jobs["leg#2"].reason == "holder" and jobs["leg#2"].status == "running"
        assert [jobs[f"leg#{i}"].status for i in (4, 5)] == ["parked", "parked"]
        assert _cohort_in_flight(store, run_id, "leg") == 2


def test_a_batch_hands_a_released_group_over_before_the_run_row_and_gives_way(
    pg_url: str,
) -> None:
    """PostgreSQL (migration 27): a batch whose job held a concurrency group
    releases it, hands it to the oldest waiter, sends the freed slot's parked
    leg through the group and claims the waiter before it takes the run row.
    A transaction holding the run row that then writes the group's row (the
    cascade's order: run row, then group) is not deadlocked: the batch stops
    waiting after `COMPLETE_LOCK_WAIT`, undoes its hand-over and runs again
    run row first, and the holder's write stands."""
    with open_store(pg_url) as store:
        b = PlanBuilder()
        b.matrix("leg", 4, max_parallel=2, concurrency=ConcurrencySpec("g", queue_max=True))
        run_id = store.submit_run(b.plan())
        held = store.claim_jobs("r", [], limit=2)
        assert [lease.job_id for lease in held] == ["leg#0"]  # leg#1 waits for the group
        # Had the batch not released the group before the run row, the
        # holder's write would not wait for it and the batch would get the
        # run row on its first try.
        done, claimed = batch_behind_a_run_row_holder(
            store,
            pg_url,
            run_id,
            held,
            "UPDATE conc_groups SET holder_job = holder_job || '' WHERE holder_run = %s",
        )
        assert [(c.job_id, c.conclusion) for c in done] == [("leg#0", "success")]
        assert [lease.job_id for lease in claimed] == ["leg#1"]
        snap = store.counters.snapshot()
        assert snap.operations.get("complete_and_claim.lock_first") == 1
        assert snap.deadlock_retries == 0
        assert _fallbacks(snap) == 0
        jobs = {j.id: j for j in store.list_jobs(run_id)}
        assert [jobs[f"leg#{i}"].status for i in range(4)] == [
            "completed",
            "running",
            "waiting",
            "parked",
        ]
        holders = store._db.transaction(
            "query",
            lambda tx: tx.execute(
                "SELECT name, holder_job FROM conc_groups WHERE holder_run = ?", (run_id,)
            ),
        )
        assert [(r["name"], r["holder_job"]) for r in holders] == [("g", "leg#1")]
        assert _cohort_in_flight(store, run_id, "leg") == 1  # and leg#2 waits on a slot


def test_a_batch_waiting_for_a_group_the_run_row_holder_has_gives_way(pg_url: str) -> None:
    """PostgreSQL (migration 27): the group's hand-over before the run row
    waits for rows other transactions hold (the group's, the waiter's) at
    most `COMPLETE_LOCK_WAIT`, as for the run row. A holder
    of the run row and the group's row that then writes the batch's job (a
    cancellation's order) is not deadlocked: the batch gives up its wait for
    the group, undoes itself and runs again run row first, and ends the job
    as the holder left it."""
    with open_store(pg_url) as store:
        b = PlanBuilder()
        b.matrix("leg", 3, max_parallel=2, concurrency=ConcurrencySpec("g", queue_max=True))
        run_id = store.submit_run(b.plan())
        held = store.claim_jobs("r", [], limit=2)
        assert [lease.job_id for lease in held] == ["leg#0"]
        done, claimed = batch_behind_a_run_row_holder(
            store,
            pg_url,
            run_id,
            held,
            "UPDATE jobs SET cancel_requested = 1 WHERE run_id = %s AND id = 'leg#0'",
            first="UPDATE conc_groups SET holder_job = holder_job || '' WHERE holder_run = %s",
        )
        assert [(c.job_id, c.conclusion) for c in done] == [("leg#0", "cancelled")]
        assert [lease.job_id for lease in claimed] == ["leg#1"]
        snap = store.counters.snapshot()
        assert snap.operations.get("complete_and_claim.lock_first") == 1
        assert snap.deadlock_retries == 0
        jobs = {j.id: j for j in store.list_jobs(run_id)}
        assert [jobs[f"leg#{i}"].status for i in range(3)] == ["completed", "running", "waiting"]


def test_jobs_a_batch_claims_start_after_the_completions_it_wrote(store: Store) -> None:
    """A batch whose completion needs the cascade (a failure, on PostgreSQL
    after its one-statement try was refused) claims the dependent it queued:
    that job starts no earlier than its need completed."""
    b = PlanBuilder()
    b.job("build")
    b.job("report", needs=["build"], if_expr="always()")
    run_id = store.submit_run(b.plan())
    held = store.claim_jobs("r", [], limit=1)
    _, claimed = store.complete_and_claim([(held[0], "failure", None)], "r", [], limit=1)
    assert [lease.job_id for lease in claimed] == ["report"]
    rows = store._db.transaction(
        "query",
        lambda tx: tx.execute(
            "SELECT id, started_at, completed_at FROM jobs WHERE run_id = ? ORDER BY seq",
            (run_id,),
        ),
    )
    times = {r["id"]: (r["started_at"], r["completed_at"]) for r in rows}
    assert times["report"][0] >= times["build"][1]


def test_a_batch_waiting_for_its_run_row_holds_up_no_other_runs_group(pg_url: str) -> None:
    """PostgreSQL (migration 27): a batch that handed its group over and sent
    a leg through it (a waiter, with its place in the group's queue) holds
    only rows of its run and group while it waits for its run row. Another
    run's batch doing the same with another group is never blocked by it:
    the places come from a sequence, not from a counter row every writer of
    a waiter holds until it commits. Its backend is watched for a blocker
    all through its call."""
    import psycopg

    def grouped(group: str) -> Any:
        b = PlanBuilder()
        # leg#0 holds the group, leg#1 waits, leg#2 is parked: ending leg#0
        # hands the group to leg#1 and sends leg#2 to wait behind it.
        b.matrix(group, 3, max_parallel=2, concurrency=ConcurrencySpec(group, queue_max=True))
        return b.plan()

    with open_store(pg_url) as store, open_store(pg_url) as other:
        busy = store.submit_run(grouped("a"))
        free = store.submit_run(grouped("c"))
        a = store.claim_jobs("ra", [], limit=1, run_id=busy)
        c = store.claim_jobs("rc", [], limit=1, run_id=free)
        other._warm_settle()
        (other_pid,) = other._db.transaction(
            "query", lambda tx: [tx.one("SELECT pg_backend_pid() AS p")["p"]]
        )
        with psycopg.connect(pg_url) as holder, psycopg.connect(pg_url, autocommit=True) as watch:
            holder.execute("SELECT id FROM runs WHERE id = %s FOR UPDATE", (busy,))
            (pid,) = holder.execute("SELECT pg_backend_pid()").fetchone() or (0,)
            t = threading.Thread(
                target=lambda: store.complete_and_claim([(a[0], "success", None)], "ra", [])
            )
            t.start()
            wait_until_blocked_by(holder, pid, t)  # handed over, waiting for the run row
            done = threading.Event()
            blockers: set[int] = set()

            def watcher() -> None:
                while not done.is_set():
                    row = watch.execute("SELECT pg_blocking_pids(%s)", (other_pid,)).fetchone()
                    blockers.update(row[0] if row else [])

            w = threading.Thread(target=watcher)
            w.start()
            try:
                finished, claimed = other.complete_and_claim([(c[0], "success", None)], "rc", [])
            finally:
                done.set()
                w.join(timeout=60)
            holder.commit()
            t.join(timeout=60)
        assert blockers == set()
        assert [lease.job_id for lease in claimed] == ["c#1"] and finished[0].changed
        assert other.counters.snapshot().operations.get("complete_and_claim.lock_first") is None
        jobs = {j.id: j.status for j in store.list_jobs(free)}
        assert jobs == {"c#0": "completed", "c#1": "running", "c#2": "waiting"}


def test_a_cancelled_waiter_whose_promotion_was_put_off_passes_the_group_on(
    pg_url: str,
) -> None:
    """PostgreSQL: a batch that releases a group whose oldest waiter is in a
    run another transaction holds puts the promotion off (it never waits on
    another run's row) and, that run still held after its retries, leaves
    the group free. The holder then cancelling that run's waiters looks at
    the group again once it commits: the next waiter, of a third run, gets
    it instead of waiting for a holder that never comes."""
    import psycopg

    def grouped() -> Any:
        b = PlanBuilder()
        b.matrix("g", 2, concurrency=ConcurrencySpec("shared", queue_max=True))
        return b.plan()

    with open_store(pg_url) as store:
        first = store.submit_run(grouped())  # g#0 holds the group, g#1 waits
        second = store.submit_run(grouped())  # both legs wait, behind the first's
        third = store.submit_run(grouped())  # both legs wait, behind the second's
        held = store.claim_jobs("r", [], limit=1)
        assert [(x.run_id, x.job_id) for x in held] == [(first, "g#0")]
        _, claimed = store.complete_and_claim([(held[0], "success", None)], "r", [])
        assert [(x.run_id, x.job_id) for x in claimed] == [(first, "g#1")]
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT id FROM runs WHERE id = %s FOR UPDATE", (second,))
            # The first run's last leg ends; the group's oldest waiter is the
            # second run's g#0, whose run row is held: put off, then given up.
            store.complete_and_claim([(claimed[0], "success", None)], "r", [], limit=0)
            holder.rollback()
        assert store.cancel_run(second)
        jobs = {j.id: j.status for j in store.list_jobs(third)}
        assert jobs == {"g#0": "queued", "g#1": "waiting"}


def test_a_batch_settled_by_the_cascade_hands_its_freed_slots_over(store: Store) -> None:
    """A batch that frees a capped matrix's slot and ends a unit whose
    dependent needs the cascade's gate (on PostgreSQL the function's cascade
    mode, run row first): the freed slot goes to the next parked leg, once,
    and the cohort counts it."""
    b = PlanBuilder()
    b.job("a")
    b.job("gate", needs=["a"], if_expr="failure()")
    b.matrix("leg", 4, max_parallel=2)
    run_id = store.submit_run(b.plan())
    held = store.claim_jobs("r", [], limit=3)
    assert sorted(lease.job_id for lease in held) == ["a", "leg#0", "leg#1"]
    done, _ = store.complete_and_claim(
        [(lease, "success", None) for lease in held if lease.job_id in ("a", "leg#0")],
        "r",
        [],
        limit=0,
    )
    assert all(c.changed for c in done)
    jobs = {j.id: j.status for j in store.list_jobs(run_id)}
    assert [jobs[f"leg#{i}"] for i in range(4)] == ["completed", "running", "queued", "parked"]
    assert jobs["gate"] == "completed"  # skipped: `a` did not fail
    assert _cohort_in_flight(store, run_id, "leg") == 2
    active = store._db.transaction(
        "query",
        lambda tx: tx.execute(
            "SELECT active FROM cohorts WHERE run_id = ? AND id = 'leg'", (run_id,)
        ),
    )
    assert [r["active"] for r in active] == [2]


def test_a_batch_keeps_outputs_with_quotes_backslashes_and_braces(store: Store) -> None:
    """The batch path passes its results as arrays: outputs with the array
    syntax's own characters come back exactly as given."""
    b = PlanBuilder()
    b.matrix("leg", 2)
    b.job("after", needs=["leg"])
    run_id = store.submit_run(b.plan())
    held = store.claim_jobs("r", [], limit=2)
    tricky = {"v": 'a "quoted", {braced} \\ back\\slash \\" NULL', "e": ""}
    done, _ = store.complete_and_claim(
        [(held[0], "success", tricky), (held[1], "success", None)], "r", [], limit=0
    )
    assert all(c.changed and c.error is None for c in done)
    assert store.get_job(run_id, held[0].job_id).outputs == tricky
    assert store.get_job(run_id, held[1].job_id).outputs == {}


def test_a_claim_returns_names_and_matrix_values_exactly(store: Store) -> None:
    """The claim answers one document with the stored matrix and spec texts
    embedded as they are: values with JSON's own characters, non-ASCII text,
    numbers without a JSON literal and huge integers come back as written."""
    values = [
        {"s": 'a "quoted", {braced} [x] \\ back\\slash \\" NULL', "u": "é✓\n\t"},
        {"n": float("inf"), "big": 10**40, "neg": -0.5, "none": None, "list": [1, [2, {}]]},
    ]
    b = PlanBuilder()
    b.matrix("leg", 2, values=values, name='leg "x" \\ {y}')
    run_id = store.submit_run(b.plan())
    held = store.claim_jobs("r", [], limit=2)
    assert [lease.matrix for lease in held] == values
    assert [lease.name for lease in held] == ['leg "x" \\ {y}'] * 2
    assert all(lease.run_id == run_id and lease.attempt == 1 for lease in held)
    _, again = store.complete_and_claim([(held[0], "success", None)], "r", [], limit=1)
    assert again == []


def _statuses(store: Store, run_id: int) -> dict[str, int]:
    rows = store._db.transaction(
        "query",
        lambda tx: tx.execute(
            "SELECT status, count(*) AS n FROM jobs WHERE run_id = ? GROUP BY status", (run_id,)
        ),
    )
    return {r["status"]: int(r["n"]) for r in rows}


def test_a_need_ending_in_a_batch_queues_its_plain_dependents_and_claims_them(
    store: Store,
) -> None:
    """The batch whose job is the last of a need queues the jobs that need
    only it (and the jobs that needed it and something still running keep
    waiting), records the need's result, and claims from them in the same
    call; on PostgreSQL that is still the one statement."""
    b = PlanBuilder()
    b.job("setup")
    b.job("slow")
    b.matrix("leg", 20, needs=["setup"])
    b.job("both", needs=["setup", "slow"])
    b.job("merge", needs=["leg"], if_expr="always()")
    run_id = store.submit_run(b.plan())
    setup, slow = store.claim_jobs("r", [], limit=2)
    before = store.counters.snapshot()
    done, legs = store.complete_and_claim([(setup, "success", {"k": "v"})], "r", [], limit=8)
    after = store.counters.snapshot()
    assert [(c.job_id, c.conclusion, c.changed) for c in done] == [("setup", "success", True)]
    assert [lease.job_id for lease in legs] == [f"leg#{i}" for i in range(8)]
    assert _statuses(store, run_id) == {"completed": 1, "running": 9, "queued": 12, "blocked": 2}
    assert store.get_job(run_id, "both").status == "blocked"
    needs = store.job_context(run_id, "leg#0")["needs"]
    assert needs == {"setup": {"result": "success", "outputs": {"k": "v"}}}
    if store.dialect == "pg":
        assert _fallbacks(after) == _fallbacks(before)
        assert after.settle_lock_holds == before.settle_lock_holds + 1
    # `both` waits for `slow`; then everything runs to the end.
    held = [slow, *legs]
    while held:
        _, held = store.complete_and_claim([(lease, "success", None) for lease in held], "r", [])
    assert store.counters.snapshot().graph_loads == 0
    jobs = {j.id: j for j in store.list_jobs(run_id)}
    assert all(j.conclusion == "success" for j in jobs.values()), jobs
    assert store.get_run(run_id).conclusion == "success"


@pytest.mark.parametrize("result", ["success", "failure"])
def test_a_need_ending_in_a_batch_admits_ifs_that_hold_on_clean_ancestry(
    store: Store, result: str
) -> None:
    """Dependents under `always()`, `success()`, `!cancelled()` and
    `!failure()` are queued like plain ones when their need succeeded, and
    gated as before when it failed: `always()` and `!cancelled()` run, the
    others are skipped (beside them, an `if:` that must be evaluated)."""
    b = PlanBuilder()
    b.job("setup")
    for name, expr in [("al", "always()"), ("su", "success()"), ("nc", "!cancelled()"),
                       ("nf", "!failure()"), ("other", "1 == 1")]:  # fmt: skip
        b.job(name, needs=["setup"], if_expr=expr)
    run_id = store.submit_run(b.plan())
    (setup,) = store.claim_jobs("r", [], limit=1)
    _, claimed = store.complete_and_claim([(setup, result, None)], "r", [], limit=10)
    # An `if:` without a status function is `success() && ...`.
    ran = {"al", "nc"} | ({"su", "nf", "other"} if result == "success" else set())
    assert {lease.job_id for lease in claimed} == ran
    while claimed:
        _, claimed = store.complete_and_claim(
            [(lease, "success", None) for lease in claimed], "r", []
        )
    jobs = {j.id: j.conclusion for j in store.list_jobs(run_id)}
    assert jobs == {"setup": result, **{n: "success" if n in ran else "skipped"
                    for n in ("al", "su", "nc", "nf", "other")}}  # fmt: skip


@pytest.mark.parametrize("expr", ["always()", "success()", "!cancelled()", "!failure()"])
def test_a_batch_admits_an_if_that_holds_on_clean_ancestry_itself(store: Store, expr: str) -> None:
    """The merge job of a matrix under such an `if:`: the legs' batch that
    ends the matrix queues and claims it in the same call, on PostgreSQL
    without the cascade's fallback."""
    b = PlanBuilder()
    b.matrix("leg", 4)
    b.job("merge", needs=["leg"], if_expr=expr)
    run_id = store.submit_run(b.plan())
    legs = store.claim_jobs("r", [], limit=4)
    before = store.counters.snapshot()
    _, claimed = store.complete_and_claim(
        [(lease, "success", None) for lease in legs], "r", [], limit=4
    )
    after = store.counters.snapshot()
    assert [lease.job_id for lease in claimed] == ["merge"]
    if store.dialect == "pg":
        assert _fallbacks(after) == _fallbacks(before)
        assert after.settle_lock_holds == before.settle_lock_holds + 1
    _, none = store.complete_and_claim([(claimed[0], "success", None)], "r", [])
    assert none == []
    assert store.get_run(run_id).conclusion == "success"


def test_two_needs_ending_in_one_batch_queue_the_job_that_needs_both(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("b")
    b.job("c", needs=["a", "b"])
    b.job("d", needs=["a"], if_expr="success()")
    run_id = store.submit_run(b.plan())
    held = store.claim_jobs("r", [], limit=2)
    assert [lease.job_id for lease in held] == ["a", "b"]
    done, claimed = store.complete_and_claim(
        [(lease, "success", None) for lease in held], "r", [], limit=4
    )
    assert [c.conclusion for c in done] == ["success", "success"]
    assert sorted(lease.job_id for lease in claimed) == ["c", "d"]
    _, more = store.complete_and_claim([(lease, "success", None) for lease in claimed], "r", [])
    assert more == []
    assert store.get_run(run_id).conclusion == "success"


def test_a_need_ending_that_leaves_a_dependent_to_a_gate_is_the_cascades(store: Store) -> None:
    """A failed need, a dependent with an `if`, a capped matrix: the same
    results as one completion at a time, whichever path ends the need."""
    b = PlanBuilder()
    b.job("a")
    b.job("ok", needs=["a"])
    b.job("gated", needs=["a"], if_expr="failure()")
    b.matrix("capped", 5, needs=["a"], max_parallel=2)
    run_id = store.submit_run(b.plan())
    (a,) = store.claim_jobs("r", [], limit=1)
    _, claimed = store.complete_and_claim([(a, "success", None)], "r", [], limit=10)
    assert sorted(lease.job_id for lease in claimed) == ["capped#0", "capped#1", "ok"]
    assert store.get_job(run_id, "gated").conclusion == "skipped"
    held = claimed
    while held:
        _, held = store.complete_and_claim([(lease, "failure", None) for lease in held], "r", [])
    assert {j.id: j.conclusion for j in store.list_jobs(run_id)} == {
        "a": "success",
        "ok": "failure",
        "gated": "skipped",
        **{f"capped#{i}": "failure" for i in range(5)},
    }


def test_a_run_cancelled_while_a_batch_admits_a_need_undoes_the_admission(pg_url: str) -> None:
    """PostgreSQL: a batch queues a need's dependents before it takes the run
    row. When the run is told to cancel while the batch waits for that row,
    the batch does not commit what it admitted: the cascade, seeing the
    cancelled run, ends them instead, and nothing is claimed."""
    import psycopg

    with open_store(pg_url) as store:
        b = PlanBuilder()
        b.job("setup")
        b.matrix("leg", 6, needs=["setup"])
        run_id = store.submit_run(b.plan())
        (setup,) = store.claim_jobs("r", [], limit=1)
        out: dict[str, object] = {}
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT id FROM runs WHERE id = %s FOR UPDATE", (run_id,))
            (pid,) = holder.execute("SELECT pg_backend_pid()").fetchone() or (0,)

            def batch() -> None:
                out["result"] = store.complete_and_claim(
                    [(setup, "success", None)], "r", [], limit=4
                )

            t = threading.Thread(target=batch)
            t.start()
            wait_until_blocked_by(holder, pid, t)
            # The batch has queued the legs (uncommitted) and waits for the run row.
            holder.execute("UPDATE runs SET cancel_requested = 1 WHERE id = %s", (run_id,))
            holder.commit()
            t.join(timeout=60)
        done, claimed = out["result"]  # type: ignore[misc]
        assert [(c.job_id, c.conclusion) for c in done] == [("setup", "success")]
        assert claimed == []
        jobs = {j.id: j for j in store.list_jobs(run_id) if j.id != "setup"}
        assert {j.status for j in jobs.values()} == {"completed"}, jobs
        assert {j.conclusion for j in jobs.values()} <= {"cancelled", "skipped"}
        snap = store.counters.snapshot()
        assert _fallbacks(snap) == 1
        assert snap.deadlock_retries == 0
        assert store.get_run(run_id).status == "completed"


def test_a_batch_ending_a_need_with_gated_dependents_settles_in_one_call(store: Store) -> None:
    """The legs that end a matrix whose dependents need a gate (an `always()`
    job), a plain job and a job that also needs another running job: the same
    outcome as one completion at a time; on PostgreSQL the batch's jobs are
    settled by one call, not one per job, before the cascade runs (fewer
    statements than jobs)."""
    b = PlanBuilder()
    b.job("other")
    b.matrix("leg", 24)
    b.job("always", needs=["leg"], if_expr="always()")
    b.job("plain", needs=["leg"])
    b.job("both", needs=["leg", "other"])
    run_id = store.submit_run(b.plan())
    held = store.claim_jobs("r", [], limit=25)
    other = next(lease for lease in held if lease.job_id == "other")
    legs = [lease for lease in held if lease is not other]
    before = store.counters.snapshot()
    done, claimed = store.complete_and_claim(
        [(lease, "success", {"x": "1"} if lease is legs[0] else None) for lease in legs],
        "r",
        [],
        limit=5,
    )
    after = store.counters.snapshot()
    assert all(c.changed and c.conclusion == "success" for c in done)
    assert sorted(lease.job_id for lease in claimed) == ["always", "plain"]
    assert store.get_job(run_id, "both").status == "blocked"
    if store.dialect == "pg":
        op = "complete_and_claim"
        used = after.statements[op] - before.statements.get(op, 0)
        assert used < len(legs)
    assert store.job_context(run_id, "plain")["needs"]["leg"] == {
        "result": "success",
        "outputs": {"x": "1"},
    }
    # The last batch ends `other`, `both` and the run together.
    _, last = store.complete_and_claim(
        [(lease, "success", None) for lease in [other, *claimed]], "r", [], limit=5
    )
    assert [lease.job_id for lease in last] == ["both"]
    _, none = store.complete_and_claim([(last[0], "success", None)], "r", [])
    assert none == []
    run = store.get_run(run_id)
    assert (run.status, run.conclusion) == ("completed", "success")


def test_a_batch_that_ends_the_run_concludes_it(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("b")
    b.job("c", continue_on_error=True)
    run_id = store.submit_run(b.plan())
    held = store.claim_jobs("r", [], limit=3)
    done, claimed = store.complete_and_claim(
        [(held[0], "success", None), (held[1], "skipped", None), (held[2], "failure", None)],
        "r",
        [],
    )
    assert [c.conclusion for c in done] == ["success", "skipped", "failure"]
    assert claimed == []
    run = store.get_run(run_id)
    assert (run.status, run.conclusion, run.remaining_jobs) == ("completed", "success", 0)


@pytest.mark.parametrize("earlier", ["success", "failure", "cancelled"])
def test_the_batch_with_the_runs_last_jobs_concludes_it_in_one_call(
    store: Store, earlier: str
) -> None:
    """The run's last jobs, ending clean: the run concludes as the cascade
    would conclude it (a job that failed before makes it a failure, one
    cancelled a cancelled run); on PostgreSQL in the batch's one statement
    (migration 22), not in a transaction of the cascade's."""
    b = PlanBuilder()
    b.job("first")
    b.job("second")
    b.job("last", needs=["second"])
    run_id = store.submit_run(b.plan())
    held = store.claim_jobs("r", [], limit=2)
    _, claimed = store.complete_and_claim(
        [(held[0], earlier, None), (held[1], "success", None)], "r", [], limit=1
    )
    assert [lease.job_id for lease in claimed] == ["last"]
    before = store.counters.snapshot()
    done, none = store.complete_and_claim([(claimed[0], "success", None)], "r", [])
    after = store.counters.snapshot()
    assert [c.conclusion for c in done] == ["success"] and none == []
    run = store.get_run(run_id)
    assert (run.status, run.conclusion, run.remaining_jobs) == ("completed", earlier, 0)
    row = store._db.transaction(
        "query", lambda tx: tx.one("SELECT completed_at FROM runs WHERE id = ?", (run_id,))
    )
    assert row is not None and row["completed_at"] is not None
    if store.dialect == "pg":
        assert _fallbacks(after) == _fallbacks(before)
        assert after.settle_lock_holds == before.settle_lock_holds + 1


def _end_a_matrix_with_another_runner(pg_url: str, store: Store) -> tuple[int, bool, Any]:
    """Two runners end a four-leg matrix (`merge` needs it) together: the
    other runner's batch is left uncommitted (it holds the run row) while this
    one starts; once this one waits for the run row, the other commits. This
    runner's first claim takes a job of another run whose matrix holds
    `Infinity`. Returns the run, whether this batch found the unit ending
    under the run row (else it ran again run row first: the other commit came
    after COMPLETE_LOCK_WAIT) and the batch's answer."""
    import psycopg

    from preloop.control.queries import Q

    odd = PlanBuilder()
    odd.matrix("odd", 1, values=[{"n": float("inf")}])
    store.submit_run(with_runs_on(odd.plan(), ("special",)))
    b = PlanBuilder()
    b.matrix("leg", 4)
    b.job("merge", needs=["leg"], if_expr="always()")
    run_id = store.submit_run(b.plan())
    mine = store.claim_jobs("mine", [], limit=2, run_id=run_id)
    theirs = store.claim_jobs("theirs", [], limit=2, run_id=run_id)
    out: dict[str, Any] = {}
    with psycopg.connect(pg_url) as other:
        other.execute(
            Q["pg_call_select_preloop_complete_claim"].replace("?", "%s"),
            (run_id, [lease.job_id for lease in theirs], ["success"] * 2, ["{}"] * 2,
             [lease.token for lease in theirs], 0.0, "", [], 0, 0.0, None, None,
             False, False),
        )  # fmt: skip
        (pid,) = other.execute("SELECT pg_backend_pid()").fetchone() or (0,)

        def batch() -> None:
            out["result"] = store.complete_and_claim(
                [(lease, "success", None) for lease in mine], "mine", ["special"], limit=2
            )

        before = store.counters.snapshot()
        t = threading.Thread(target=batch)
        t.start()
        wait_until_blocked_by(other, pid, t)
        other.commit()
        t.join(timeout=60)
    after = store.counters.snapshot()
    assert _fallbacks(after) == _fallbacks(before)
    first = "complete_and_claim.lock_first"
    late = after.operations.get(first, 0) == before.operations.get(first, 0)
    return run_id, late, out["result"]


def test_a_unit_that_ends_only_under_the_run_row_is_admitted_by_the_batch(pg_url: str) -> None:
    """PostgreSQL: a batch that finds the matrix ending only once it has the
    run row admits the dependent itself (migration 22) and, with what is left
    of its runner's capacity, claims it, in its one statement: the leases in
    claim order, a matrix value PostgreSQL's JSON type refuses included."""
    with open_store(pg_url) as store:
        for _ in range(5):  # the other runner's commit must come within 50 ms
            run_id, late, (done, claimed) = _end_a_matrix_with_another_runner(pg_url, store)
            assert [c.conclusion for c in done] == ["success", "success"]
            if late:
                break
            for lease in claimed:  # the run row came too late: again, with new runs
                store.complete_and_claim([(lease, "success", None)], "mine", ["special"])
        assert late, "the other runner never committed within COMPLETE_LOCK_WAIT"
        assert [(lease.job_id, lease.matrix) for lease in claimed] == [
            ("odd#0", {"n": float("inf")}),
            ("merge", None),
        ]
        assert claimed[0].run_id < claimed[1].run_id == run_id
        leg = store._db.transaction(
            "query",
            lambda tx: tx.one(
                "SELECT result FROM units WHERE run_id = ? AND base_id = 'leg'", (run_id,)
            ),
        )
        assert leg is not None and leg["result"] == "success"
        _, none = store.complete_and_claim([(claimed[1], "success", None)], "mine", [])
        assert none == []
        run = store.get_run(run_id)
        assert (run.status, run.conclusion) == ("completed", "success")


def test_the_batch_ending_a_run_that_holds_a_workflow_group_starts_the_waiting_run(
    store: Store,
) -> None:
    """A run holding a workflow-level concurrency group ends with a batch: the
    group goes to the run waiting on it, whose job the same batch claims (on
    PostgreSQL the cascade's work, not the function's)."""
    from preloop.workflow.plan import ConcurrencySpec

    def run() -> int:
        b = PlanBuilder(concurrency=ConcurrencySpec("deploy", queue_max=True))
        b.job("only")
        return store.submit_run(b.plan())

    first, second = run(), run()
    assert store.get_run(second).status != "running"
    held = store.claim_jobs("r", [], limit=2)
    assert [(lease.run_id, lease.job_id) for lease in held] == [(first, "only")]
    _, claimed = store.complete_and_claim([(held[0], "success", None)], "r", [], limit=2)
    assert (store.get_run(first).status, store.get_run(first).conclusion) == (
        "completed",
        "success",
    )
    assert [(lease.run_id, lease.job_id) for lease in claimed] == [(second, "only")]


def test_freed_slots_go_to_the_next_legs_in_the_claims_order_and_labels(store: Store) -> None:
    """A batch freeing a capped matrix's slots hands them to its next legs and
    claims in the same call (on PostgreSQL straight from parked, one write a
    leg, migration 23): an older run's queued job still comes first, a leg on
    labels the runner lacks stays queued holding its slot, and the limit holds."""
    older = PlanBuilder()
    older.job("old", runs_on=("linux",))
    old_run = store.submit_run(older.plan("old"))
    b = PlanBuilder()
    b.matrix("leg", 6, max_parallel=2)
    plan = b.plan()
    plan = replace(
        plan,
        jobs=tuple(
            replace(j, runs_on=("mac",) if j.id == "leg#2" else ("linux",)) for j in plan.jobs
        ),
    )
    run_id = store.submit_run(plan)
    held = store.claim_jobs("r", ["linux"], limit=2, run_id=run_id)
    assert [lease.job_id for lease in held] == ["leg#0", "leg#1"]
    before = store.counters.snapshot()
    _, claimed = store.complete_and_claim(
        [(lease, "success", None) for lease in held], "r", ["linux"], limit=2
    )
    if store.dialect == "pg":  # the batch's own statement, not the cascade
        assert _fallbacks(store.counters.snapshot()) == _fallbacks(before)
    assert [(lease.run_id, lease.job_id) for lease in claimed] == [
        (old_run, "old"),
        (run_id, "leg#3"),
    ]
    statuses = {j.id: j.status for j in store.list_jobs(run_id)}
    assert statuses["leg#2"] == "queued" and statuses["leg#3"] == "running"
    assert [statuses[f"leg#{i}"] for i in (4, 5)] == ["parked", "parked"]
    assert _cohort_in_flight(store, run_id, "leg") == 2
    mac = store.claim_jobs("m", ["mac"], limit=5)
    assert [lease.job_id for lease in mac] == ["leg#2"]
    held = [lease for lease in claimed if lease.run_id == run_id] + mac
    store.complete_and_claim([(lease, "success", None) for lease in claimed[:1]], "r", [], limit=0)
    dispatched = [lease.job_id for lease in held]
    while held:
        _, more = store.complete_and_claim([(held[0], "success", None)], "r", ["linux"], limit=1)
        held = held[1:] + more
        dispatched += [lease.job_id for lease in more]
        assert _cohort_in_flight(store, run_id, "leg") <= 2
    assert sorted(dispatched) == [f"leg#{i}" for i in range(2, 6)]
    assert store.get_run(run_id).conclusion == "success"
    assert store.get_run(old_run).conclusion == "success"


def test_a_queued_job_the_handed_leg_claim_passes_over_is_announced(pg_url: str) -> None:
    """PostgreSQL: the claim that takes a freed slot's leg straight from parked
    locks the queue's next jobs as well; one a leg ahead of it in the claim's
    order displaced stays queued, and runners that skipped it while it was
    locked hear of it when the batch commits instead of waiting for a poll."""
    import psycopg

    with open_store(pg_url) as store:
        b = PlanBuilder()
        b.matrix("leg", 2, max_parallel=1)
        run_id = store.submit_run(b.plan("matrix"))
        other = PlanBuilder()
        other.job("x")
        other_run = store.submit_run(other.plan("other"))
        held = store.claim_jobs("r", [], limit=1)
        assert [(lease.run_id, lease.job_id) for lease in held] == [(run_id, "leg#0")]
        with psycopg.connect(pg_url, autocommit=True) as listener:
            listener.execute("LISTEN preloop_jobs")  # after every earlier notice was sent
            before = store.counters.snapshot()
            _, claimed = store.complete_and_claim([(held[0], "success", None)], "r", [], limit=1)
            assert [(lease.run_id, lease.job_id) for lease in claimed] == [(run_id, "leg#1")]
            # the batch's own statement, not the cascade
            assert _fallbacks(store.counters.snapshot()) == _fallbacks(before)
            assert len(list(listener.notifies(timeout=30, stop_after=1))) == 1
        assert [lease.job_id for lease in store.claim_jobs("r", [], limit=5)] == ["x"]
        assert store.get_run(other_run).status == "running"


def test_a_batch_of_several_runs_takes_their_run_rows_before_any_group(pg_url: str) -> None:
    """PostgreSQL: a runner's batch with jobs of two runs settles them one
    after the other, and the first's cascade releases a concurrency group.
    Another transaction holding the second run's row that then writes the
    group's row (the cascade's order: run row, then group) is not
    deadlocked: the batch takes both run rows, in id order, before any
    group, so it waits for the holder without holding the group."""
    with open_store(pg_url) as store:
        grouped = PlanBuilder()
        grouped.job("a", concurrency=ConcurrencySpec("g"))
        first = store.submit_run(grouped.plan())
        plain = PlanBuilder()
        plain.job("b")
        second = store.submit_run(plain.plan())
        held = store.claim_jobs("r", [], limit=2)
        assert sorted((x.run_id, x.job_id) for x in held) == [(first, "a"), (second, "b")]
        # Had the batch settled the first run (and released its group) before
        # taking the second run's row, the holder's write of that group would
        # wait for the batch while the batch waits for it.
        done, _ = batch_behind_a_run_row_holder(
            store,
            pg_url,
            second,
            held,
            "UPDATE conc_groups SET holder_job = holder_job WHERE holder_run <> %s",
            limit=0,
        )
        assert sorted((c.run_id, c.job_id, c.conclusion) for c in done) == [
            (first, "a", "success"),
            (second, "b", "success"),
        ]
        assert store.counters.snapshot().deadlock_retries == 0
        assert store.get_run(first).status == store.get_run(second).status == "completed"


def test_a_put_off_promotion_waits_for_the_waiters_run_after_commit(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: a batch that releases a group whose oldest waiter is in a
    run another transaction holds puts the promotion off (it never waits on
    another run's row while it holds its own). Right after its commit it
    waits for that run's row, a while, as the cascade takes rows (the run
    first, then the group): once the holder commits, the waiter has the
    group, without the reaper."""
    import psycopg

    def grouped() -> Any:
        b = PlanBuilder()
        b.matrix("g", 2, concurrency=ConcurrencySpec("shared", queue_max=True))
        return b.plan()

    # Long enough that this thread sees the follow-up wait and commits
    # before it gives up, however loaded the machine.
    monkeypatch.setattr("preloop.control.store.RETRY_GROUP_LOCK_WAIT", "30s")
    with open_store(pg_url) as store:
        first = store.submit_run(grouped())  # g#0 holds the group, g#1 waits
        second = store.submit_run(grouped())  # both legs wait, behind the first's
        held = store.claim_jobs("r", [], limit=1)
        _, claimed = store.complete_and_claim([(held[0], "success", None)], "r", [])
        assert [(x.run_id, x.job_id) for x in claimed] == [(first, "g#1")]
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT id FROM runs WHERE id = %s FOR UPDATE", (second,))
            (pid,) = holder.execute("SELECT pg_backend_pid()").fetchone() or (0,)
            t = threading.Thread(
                target=lambda: store.complete_and_claim(
                    [(claimed[0], "success", None)], "r", [], limit=0
                )
            )
            t.start()
            wait_until_blocked_by(holder, pid, t)  # the follow-up, waiting
            holder.commit()
            t.join(timeout=60)
        jobs = {j.id: j.status for j in store.list_jobs(second)}
        assert jobs == {"g#0": "queued", "g#1": "waiting"}
        assert store.get_run(first).status == "completed"
        assert store.counters.snapshot().deadlock_retries == 0


def test_waiting_a_while_for_run_rows_keeps_the_transactions_own_timeout(pg_url: str) -> None:
    """PostgreSQL: `Tx.lock_runs_within` gives up a run row held past its
    wait without undoing the transaction's earlier writes, takes a free one,
    and leaves the transaction's own `lock_timeout` as it was either way
    (a later wait of the transaction is not cut short)."""
    import psycopg

    with open_store(pg_url) as store:
        b = PlanBuilder()
        b.job("a")
        free, held = store.submit_run(b.plan("free")), store.submit_run(b.plan("held"))
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT id FROM runs WHERE id = %s FOR UPDATE", (held,))

            def fn(tx: Any) -> tuple[bool, str, bool, str]:
                tx.execute("SET LOCAL lock_timeout = '7s'")
                tx.execute("UPDATE runs SET name = 'renamed' WHERE id = ?", (free,))
                missed = tx.lock_runs_within([held], "20ms")
                after_miss = tx.one("SELECT current_setting('lock_timeout') AS v")["v"]
                got = tx.lock_runs_within([free], "20ms")
                after = tx.one("SELECT current_setting('lock_timeout') AS v")["v"]
                return missed, after_miss, got, after

            result = store._db.transaction("query", fn)
            holder.rollback()
        assert result == (False, "7s", True, "7s")
        assert store.get_run(free).name == "renamed"


def test_a_held_groups_follow_up_leaves_its_waiters_run_alone(pg_url: str) -> None:
    """PostgreSQL: cancelling a run ends its waiting job, and its group is
    looked at again after commit. The group is held: there is no one to
    promote, so the follow-up does not wait for the oldest waiter's run row
    (held by another transaction) and the cancellation returns at once.
    (Found by review.)"""
    import psycopg

    with open_store(pg_url) as store:
        a = PlanBuilder()
        a.matrix("g", 2, concurrency=ConcurrencySpec("shared", queue_max=True))
        first = store.submit_run(a.plan("a"))  # g#0 holds the group, g#1 its oldest waiter
        c = PlanBuilder()
        c.job("c", concurrency=ConcurrencySpec("shared", queue_max=True))
        other = store.submit_run(c.plan("c"))  # c waits behind g#1
        out: dict[str, Any] = {}
        with psycopg.connect(pg_url) as holder:
            holder.execute("SELECT id FROM runs WHERE id = %s FOR UPDATE", (first,))
            (pid,) = holder.execute("SELECT pg_backend_pid()").fetchone() or (0,)
            t = threading.Thread(target=lambda: out.update(ok=store.cancel_run(other)))
            t.start()
            wait_until_blocked_by(holder, pid, t)
            blocked = t.is_alive()  # returned because the call waits on the holder
            t.join(timeout=60)
            holder.rollback()
        assert out["ok"] and not blocked
        holders = store._db.transaction(
            "query", lambda tx: tx.execute("SELECT holder_run, holder_job FROM conc_groups")
        )
        assert [(r["holder_run"], r["holder_job"]) for r in holders] == [(first, "g#0")]
