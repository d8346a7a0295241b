"""Two processes claiming and settling against one store at once: no double
claim, no lost completion, no deadlock (both stores; on PostgreSQL this is
the lock-order test: run rows, cross-run concurrency groups, SKIP LOCKED)."""

from __future__ import annotations

import sys

import pytest

from preloop.control import Store, open_store
from preloop.control.schema import SCHEMA_VERSION
from preloop.testing.load import reports as load_reports
from preloop.testing.load import start_together
from preloop.testing.plans import PlanBuilder
from preloop.workflow.plan import ConcurrencySpec

WORKER = r"""
import json, sys
from preloop.control import open_store

url, name = sys.argv[1], sys.argv[2]
runs = [int(r) for r in sys.argv[3].split(",")]
store = open_store(url)
print("ready", flush=True)
sys.stdin.readline()  # the go signal: both workers start together
claimed = []
while True:
    lease = store.claim_job(name, ["linux"])
    if lease is None:
        if all(store.get_run(r).status == "completed" for r in runs):
            break
        store.expire_leases()  # the reaper pass an engine makes when idle
        continue
    claimed.append([lease.run_id, lease.job_id])
    store.complete_job(lease, "failure" if lease.job_id.endswith("7") else "success", {"by": name})
snap = store.counters.snapshot()
print(json.dumps({"claimed": claimed, "deadlocks": snap.deadlock_retries,
                  "graph_loads": snap.graph_loads}), flush=True)
store.close()
"""


def test_two_processes_settle_and_claim_concurrently(store: Store, store_url: str) -> None:
    # Run A: a capped matrix with an always-run merge; run B: legs in a
    # job-level group shared with run C's legs (cross-run waiters).
    a = PlanBuilder()
    a.job("setup", runs_on=("Linux",))
    a.matrix("leg", 60, needs=["setup"], max_parallel=5, runs_on=("linux",))
    a.job("merge", needs=["leg"], if_expr="always()", runs_on=("linux",))
    shared = ConcurrencySpec("shared", queue_max=True)
    b = PlanBuilder()
    b.matrix("g", 20, concurrency=shared)
    b.job("after", needs=["g"], if_expr="always()")
    runs = [
        store.submit_run(a.plan("a")),
        store.submit_run(b.plan("b")),
        store.submit_run(b.plan("c")),
    ]
    reports = load_reports(
        start_together(
            [
                [sys.executable, "-c", WORKER, store_url, f"w{i}", ",".join(map(str, runs))]
                for i in range(2)
            ]
        )
    )
    claimed = [tuple(c) for r in reports for c in r["claimed"]]
    assert len(claimed) == len(set(claimed)), "a job was claimed twice"
    assert all(r["deadlocks"] == 0 and r["graph_loads"] == 0 for r in reports)
    with open_store(store_url) as check:
        total = 0
        for run_id in runs:
            assert check.get_run(run_id).status == "completed"
            jobs = check.list_jobs(run_id)
            assert all(j.conclusion is not None for j in jobs)
            ran = [j for j in jobs if j.runner is not None]
            assert all(j.outputs.get("by") == j.runner for j in ran), "a completion was lost"
            total += len(ran)
        assert total == len(claimed) == 62 + 21 + 21


def test_two_nodes_migrating_together_migrate_once(store_url: str) -> None:
    """Stores opened at the same moment on an empty database: both succeed
    (PostgreSQL serialises migrations on an advisory lock) and the schema
    version is recorded once."""
    import threading

    barrier = threading.Barrier(2)
    errors: list[BaseException] = []
    opened: list[Store] = []

    def node() -> None:
        try:
            barrier.wait()
            opened.append(open_store(store_url))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=node) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = opened[0]
    rows = s._db.transaction(
        "query", lambda tx: tx.execute("SELECT version FROM preloop_schema_version")
    )
    assert [r["version"] for r in rows] == [SCHEMA_VERSION]
    for o in opened:
        o.close()


# One statement, so every figure comes from the same snapshot: the most jobs
# holding one group at once, the capped cohorts whose legs in flight (queued,
# running or waiting for their group, each on a slot) exceed max-parallel or
# differ from the cohort's count of them.
_GROUP_INVARIANTS = """
SELECT
  (SELECT coalesce(max(n), 0) FROM (
     SELECT count(*) AS n FROM jobs
      WHERE holds_group IS NOT NULL AND status IN ('queued', 'running')
      GROUP BY holds_group) h) AS most_holders,
  (SELECT count(*) FROM (
     SELECT co.max_parallel, co.active, count(j.id) AS n FROM cohorts co
       LEFT JOIN jobs j ON j.run_id = co.run_id AND j.cohort = co.id
        AND j.status IN ('queued', 'running', 'waiting')
      GROUP BY co.run_id, co.id, co.max_parallel, co.active) c
    WHERE c.n > c.max_parallel OR c.n <> c.active) AS bad_cohorts
"""


@pytest.mark.parametrize("capacity", [1, 3])
def test_engines_batching_grouped_matrices_keep_groups_and_slots(
    store_url: str, capacity: int
) -> None:
    """Four engine processes of `capacity` completing and claiming in batches
    (at 3, of several jobs and runs) with `complete_and_claim`, the path that
    hands a released group over before the run row on PostgreSQL, through
    capped matrices in concurrency groups: one run's own group and one shared
    by two runs (cross-run waiters, the cascade's path), one of which is
    cancelled mid-way, and two matrices of one run in groups of their own
    (batches of one run handing over at once). Sampled all along: no group
    ever has two holders, no cohort more legs in flight than its max-parallel
    or than its count of them; at the end every leg ran once or was
    cancelled, no group is held and no batch deadlocked."""
    own = PlanBuilder()
    own.job("setup", runs_on=("linux",))
    own.matrix(
        "leg",
        30,
        needs=["setup"],
        max_parallel=10,
        concurrency=ConcurrencySpec("own", queue_max=True),
        runs_on=("linux",),
    )
    own.matrix(
        "side",
        20,
        needs=["setup"],
        max_parallel=4,
        concurrency=ConcurrencySpec("own-side", queue_max=True),
        runs_on=("linux",),
    )
    own.job("merge", needs=["leg", "side"], if_expr="always()", runs_on=("linux",))
    shared = PlanBuilder()
    shared.matrix("g", 15, max_parallel=5, concurrency=ConcurrencySpec("shared", queue_max=True))
    cancelled = PlanBuilder()
    cancelled.matrix("g", 15, max_parallel=5, concurrency=ConcurrencySpec("shared", queue_max=True))
    # No engine serves this label: the run ends only by its cancellation.
    cancelled.job("stuck", runs_on=("nowhere",))
    with open_store(store_url) as store:
        runs = [
            store.submit_run(own.plan("own")),
            store.submit_run(shared.plan("shared")),
            store.submit_run(cancelled.plan("cancelled")),
        ]
        engine = [sys.executable, "-m", "preloop.testing.load", store_url, ",".join(map(str, runs))]
        procs = start_together([[*engine, str(capacity)] for _ in range(4)])
        samples = 0
        cancel_sent = False
        while any(p.poll() is None for p in procs):
            row = store._db.transaction("query", lambda tx: tx.execute(_GROUP_INVARIANTS))[0]
            assert row["most_holders"] <= 1 and row["bad_cohorts"] == 0, row
            samples += 1
            if samples % 20 == 0:
                # The reaper's pass a runner makes when idle: a promotion put
                # off past its retries (the waiter's run row held throughout)
                # is carried out here, as in a fleet.
                store.expire_leases()
            if not cancel_sent:
                ended = store._db.transaction(
                    "query",
                    lambda tx: tx.execute(
                        "SELECT count(*) AS n FROM jobs WHERE run_id = ? AND status = 'completed'",
                        (runs[2],),
                    ),
                )[0]["n"]
                if ended >= 3:
                    assert store.cancel_run(runs[2])
                    cancel_sent = True
        reports = load_reports(procs)
        assert cancel_sent and samples > 0
        assert all(r["deadlock_retries"] == 0 and r["graph_loads"] == 0 for r in reports)
        assert [store.get_run(r).conclusion for r in runs] == ["success", "success", "cancelled"]
        ran = 0
        for run_id in runs:
            jobs = store.list_jobs(run_id)
            assert all(j.status == "completed" for j in jobs), run_id
            ran += sum(1 for j in jobs if j.runner is not None)
        # Each completion an engine reported is one job that ran: none twice.
        assert sum(r["completions"] for r in reports) == ran
        held = store._db.transaction(
            "query",
            lambda tx: tx.execute("SELECT name FROM conc_groups WHERE holder_run IS NOT NULL"),
        )
        assert held == []
