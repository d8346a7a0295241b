"""Scheduler regressions from review, one suite over both stores: a skipped
caller under a punctuation-ignoring collation, how cancelled runs conclude,
reusable callers behind max-parallel, concurrency groups and fail-fast, and
cancellations racing other transactions on PostgreSQL."""

from __future__ import annotations

import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from preloop.control import Store, open_store
from preloop.control.store import Heartbeat, Lease
from preloop.testing.plans import PlanBuilder, drive
from preloop.workflow.plan import ConcurrencySpec


def conclusions(store: Store, run_id: int) -> dict[str, str | None]:
    return {j.id: j.conclusion for j in store.list_jobs(run_id)}


@pytest.fixture
def punct_store(store_url: str) -> Iterator[Store]:
    """The lite store, or a pg store in a database whose default collation
    ignores punctuation (ICU `ka-shifted`, like glibc's en_US), dropped after."""
    if not store_url.startswith("postgresql"):
        with open_store(store_url) as s:
            yield s
        return
    import psycopg

    parts = urlsplit(store_url)
    admin = urlunsplit(parts._replace(query=""))
    name = f"preloop_icu_{secrets.token_hex(6)}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu "
            "ICU_LOCALE 'en-US-u-ka-shifted' LOCALE 'C.UTF-8'"
        )
    try:
        with open_store(urlunsplit(parts._replace(path=f"/{name}", query=""))) as s:
            yield s
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_skipped_caller_ends_inner_jobs_under_any_collation(punct_store: Store) -> None:
    """Inner jobs are found by an id range (`call/` .. `call0`): it must hold
    whatever the database's default collation."""
    store = punct_store
    b = PlanBuilder()
    b.job("a")
    b.job("call", kind="caller", needs=["a"])
    b.job("call/x", caller="call")
    b.job("call/y", caller="call", needs=["call/x"], if_expr="always()")
    b.job("call.z", needs=["a"], if_expr="always()")  # a neighbour id, not inside
    run_id = store.submit_run(b.plan())
    store.counters.reset()
    drive(store, b.plan(), run_id, lambda lease: "failure" if lease.job_id == "a" else "success")
    assert store.counters.snapshot().graph_loads == 0
    assert store.get_run(run_id).status == "completed"
    assert conclusions(store, run_id) == {
        "a": "failure",
        "call": "skipped",
        "call/x": "skipped",
        "call/y": "skipped",
        "call.z": "success",
    }


def test_run_with_a_cancelled_job_and_no_failure_concludes_cancelled(store: Store) -> None:
    """A runner reported `cancelled`; a concurrency group replaced a pending
    job: neither run failed, both conclude cancelled (GitHub's rule)."""
    b = PlanBuilder()
    b.job("a")
    b.job("b")
    store.counters.reset()
    reported = store.submit_run(b.plan())
    drive(
        store, b.plan(), reported, lambda lease: "cancelled" if lease.job_id == "a" else "success"
    )
    assert store.counters.snapshot().graph_loads == 0
    assert conclusions(store, reported) == {"a": "cancelled", "b": "success"}
    assert store.get_run(reported).conclusion == "cancelled"

    store.counters.reset()
    runs = []
    for _ in range(3):
        g = PlanBuilder()
        g.job("a", concurrency=ConcurrencySpec("g"))
        runs.append(store.submit_run(g.plan()))
    replaced = store.get_run(runs[1])  # its only job was replaced by the third run's
    assert (replaced.status, replaced.conclusion) == ("completed", "cancelled")
    for run_id in (runs[0], runs[2]):
        lease = store.claim_job("r", [])
        assert lease is not None and lease.run_id == run_id
        store.complete_job(lease, "success")
        assert store.get_run(run_id).conclusion == "success"
    assert store.counters.snapshot().graph_loads == 0


def claim_all(store: Store) -> list[tuple[int, str]]:
    out = []
    while (lease := store.claim_job("r", [])) is not None:
        out.append((lease.run_id, lease.job_id))
        store.complete_job(lease, "success")
    return out


def test_max_parallel_holds_reusable_caller_legs(store: Store) -> None:
    """A matrix of reusable callers at max-parallel 1: one caller leg runs its
    inner jobs at a time; the slot passes on when the leg folds."""
    b = PlanBuilder()
    b.matrix("call", 3, max_parallel=1, kind="caller")
    for i in range(3):
        b.job(f"call#{i}/x", caller=f"call#{i}")
        b.job(f"call#{i}/y", caller=f"call#{i}", needs=[f"call#{i}/x"])
    store.counters.reset()
    run_id = store.submit_run(b.plan())
    order = []
    while (lease := store.claim_job("r", [])) is not None:
        assert store.claim_job("r", []) is None  # nothing else may run meanwhile
        order.append(lease.job_id)
        store.complete_job(lease, "success")
    assert order == [f"call#{i}/{j}" for i in range(3) for j in "xy"]
    assert store.get_run(run_id).conclusion == "success"
    assert store.counters.snapshot().graph_loads == 0


def test_concurrency_group_holds_reusable_callers(store: Store) -> None:
    """Two runs' callers in one group: the second starts when the first folds."""
    store.counters.reset()
    runs = []
    for _ in range(2):
        b = PlanBuilder()
        b.job("call", kind="caller", concurrency=ConcurrencySpec("deploy"))
        b.job("call/x", caller="call")
        runs.append(store.submit_run(b.plan()))
    first = store.claim_job("r", [])
    assert first is not None and (first.run_id, first.job_id) == (runs[0], "call/x")
    assert store.claim_job("r", []) is None
    store.complete_job(first, "success")
    assert claim_all(store) == [(runs[1], "call/x")]
    assert [store.get_run(r).conclusion for r in runs] == ["success", "success"]

    assert store.counters.snapshot().graph_loads == 0


def test_fail_fast_cancels_started_caller_legs(store: Store) -> None:
    """fail-fast over a matrix of reusable callers: a failed leg stops the
    sibling callers' running inner jobs, ends the rest, and they fold cancelled."""
    b = PlanBuilder()
    b.matrix("call", 2, fail_fast=True, kind="caller")
    for i in range(2):
        b.job(f"call#{i}/x", caller=f"call#{i}")
        b.job(f"call#{i}/y", caller=f"call#{i}", needs=[f"call#{i}/x"])
    b.job("after", needs=["call"], if_expr="always()")
    store.counters.reset()
    run_id = store.submit_run(b.plan())
    failing, sibling = store.claim_job("r", []), store.claim_job("r", [])
    assert failing is not None and sibling is not None and sibling.job_id == "call#1/x"
    store.complete_job(failing, "failure")
    assert store.heartbeat(sibling).cancel_requested
    assert store.get_job(run_id, "call#1/y").conclusion == "cancelled"
    store.complete_job(sibling, "success")
    assert claim_all(store) == [(run_id, "after")]
    assert store.counters.snapshot().graph_loads == 0
    assert conclusions(store, run_id) == {
        "call#0": "failure",
        "call#0/x": "failure",
        "call#0/y": "skipped",
        "call#1": "cancelled",
        "call#1/x": "cancelled",
        "call#1/y": "cancelled",
        "after": "success",
    }


def test_cancel_in_progress_cancels_a_started_caller(store: Store) -> None:
    """A newer caller in a cancel-in-progress group cancels the started one:
    its running inner job is told to stop, the rest end, it folds cancelled."""
    store.counters.reset()
    cancelling = ConcurrencySpec("release", cancel_in_progress=True)
    runs = []
    for _ in range(2):
        b = PlanBuilder()
        b.job("call", kind="caller", concurrency=cancelling)
        b.job("call/x", caller="call")
        b.job("call/y", caller="call", needs=["call/x"])
        runs.append(store.submit_run(b.plan()))
        if len(runs) == 1:
            held = store.claim_job("r", [])
            assert held is not None and held.run_id == runs[0]
    assert store.heartbeat(held).cancel_requested
    store.complete_job(held, "success")
    assert store.get_job(runs[0], "call/y").conclusion == "cancelled"
    assert store.get_job(runs[0], "call").conclusion == "cancelled"
    assert claim_all(store) == [(runs[1], "call/x"), (runs[1], "call/y")]
    assert [store.get_run(r).conclusion for r in runs] == ["cancelled", "success"]
    assert store.counters.snapshot().graph_loads == 0


def _claim_elsewhere(store: Store, run_id: int, job_id: str) -> tuple[Any, Lease]:
    """Another node's claim of `job_id`, written on its own connection and not
    yet committed (lite: committed, as SQLite has one writer)."""
    token = "elsewhere"
    sql = (
        "UPDATE jobs SET status = 'running', runner = 'other', lease_token = ?, "
        "lease_expires = ?, started_at = ?, attempt = attempt + 1 "
        "WHERE run_id = ? AND id = ? AND status = 'queued'"
    )
    now = time.time()
    params = (token, now + 3600, now, run_id, job_id)
    if store.dialect == "pg":
        import psycopg

        conn: Any = psycopg.connect(store.url)
        conn.execute(sql.replace("?", "%s"), params)
    else:
        conn = sqlite3.connect(store.url[len("sqlite://") :], isolation_level=None)
        conn.execute(sql, params)
    lease = Lease(run_id, job_id, job_id, token, "other", now + 3600, 1, {}, None, None, 360.0)
    return conn, lease


def _wait_until_blocked_by(url: str, holder: Any) -> None:
    """Returns once some other backend waits on a lock `holder` (a psycopg
    connection) holds."""
    import psycopg

    pid = holder.info.backend_pid
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(100_000):
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                (pid,),
            ).fetchone()
            if row is not None and row[0]:
                return
    raise AssertionError(f"nothing came to wait on the locks of backend {pid}")


def test_cancel_racing_a_claim_asks_the_runner_to_stop(store: Store) -> None:
    """cancel_run read a job as queued while a runner's claim was in flight:
    once the claim commits, the job is running and must be told to stop."""
    b = PlanBuilder()
    b.job("a")
    b.job("b", needs=["a"])
    run_id = store.submit_run(b.plan())
    conn, lease = _claim_elsewhere(store, run_id, "a")
    try:
        if store.dialect == "pg":
            cancelled: list[bool] = []
            t = threading.Thread(target=lambda: cancelled.append(store.cancel_run(run_id)))
            t.start()
            _wait_until_blocked_by(store.url, conn)  # cancel_run waits on the claimed row
            conn.commit()
            t.join()
            assert cancelled == [True]
        else:
            assert store.cancel_run(run_id)
    finally:
        conn.close()
    assert store.heartbeat(lease) == Heartbeat(held=True, cancel_requested=True)
    assert store.complete_job(lease, "success").conclusion == "cancelled"
    assert conclusions(store, run_id) == {"a": "cancelled", "b": "cancelled"}
    assert store.get_run(run_id).conclusion == "cancelled"


@contextmanager
def run_row_held(store: Store, run_id: int) -> Iterator[None]:
    """Another transaction holds `run_id`'s row lock for the block (pg; lite
    has one writer, so no other transaction can be in the middle of one)."""
    if store.dialect != "pg":
        yield
        return
    import psycopg

    with psycopg.connect(store.url) as conn:
        conn.execute("SELECT id FROM runs WHERE id = %s FOR UPDATE", (run_id,))
        yield
        conn.rollback()


def one_job_run(store: Store, conc: ConcurrencySpec) -> int:
    b = PlanBuilder()
    b.job("a", concurrency=conc)
    return store.submit_run(b.plan())


def test_replacing_a_waiter_whose_run_is_locked_is_not_lost(store: Store) -> None:
    """A newer waiter replaces an older one whose run another transaction holds:
    the replacement is carried out later, before the group promotes anyone."""
    conc = ConcurrencySpec("g")
    store.counters.reset()
    first = one_job_run(store, conc)
    holder = store.claim_job("r", [])
    assert holder is not None and holder.run_id == first
    older = one_job_run(store, conc)
    with run_row_held(store, older):
        newer = one_job_run(store, conc)
    store.complete_job(holder, "success")  # the group frees: the replacement comes first
    assert claim_all(store) == [(newer, "a")]
    assert store.get_job(older, "a").conclusion == "cancelled"
    assert store.get_run(older).conclusion == "cancelled"
    assert store.counters.snapshot().graph_loads == 0
    assert store.counters.snapshot().deadlock_retries == 0


def test_cancel_in_progress_whose_holder_run_is_locked_is_not_lost(store: Store) -> None:
    """cancel-in-progress while another transaction holds the holder's run:
    the reaper carries the cancellation out once the lock is gone."""
    conc = ConcurrencySpec("g", cancel_in_progress=True)
    store.counters.reset()
    first = one_job_run(store, conc)
    holder = store.claim_job("r", [])
    assert holder is not None and holder.run_id == first
    with run_row_held(store, first):
        newer = one_job_run(store, conc)
    store.expire_leases()
    assert store.heartbeat(holder) == Heartbeat(held=True, cancel_requested=True)
    assert store.complete_job(holder, "success").conclusion == "cancelled"
    assert claim_all(store) == [(newer, "a")]
    assert [store.get_run(r).conclusion for r in (first, newer)] == ["cancelled", "success"]
    assert store.counters.snapshot().graph_loads == 0
