"""PostgreSQL: `preloop_warm_settle` (schema migration 26) takes the common
paths of `preloop_complete_claim` once on runs of its own and undoes them, so
that a connection has planned the function's statements before its first
batch holds a run row; the store calls it once per connection."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from preloop.control import Lease, Store, open_store
from preloop.control.db import PgBackend
from preloop.testing.pg import wait_until_blocked_by
from preloop.testing.plans import PlanBuilder
from preloop.workflow.plan import ConcurrencySpec

PATHS = [
    "slots",
    "slot given back",
    "plain",
    "unit ended under the run row",
    "unit ended before the run row",
    "run ended",
    "group",
    "group slot given back",
]

# Every table the warm-up writes (the places its waiters take from the
# `wait_order` sequence are not given back, as any rolled-back waiter's).
_STATE = """
SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM jobs), (SELECT count(*) FROM units),
       (SELECT count(*) FROM cohorts), (SELECT count(*) FROM deps),
       (SELECT count(*) FROM conc_groups)
"""


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    with open_store(pg_url) as s:
        yield s


def _fallbacks(store: Store) -> int:
    return store.counters.snapshot().operations.get("complete_and_claim.fallback", 0)


def _submit(store: Store, legs: int = 6) -> int:
    b = PlanBuilder()
    b.matrix("leg", legs)
    b.job("merge", needs=["leg"], if_expr="always()")
    return store.submit_run(b.plan())


def _merge_ends_the_run(store: Store, run_id: int, done: list[Any], more: list[Lease]) -> None:
    """A batch of `_submit`'s legs ran as it would have: each settled, the
    merge claimed; the merge then ends the run in success."""
    assert all(c.changed for c in done) and [lease.job_id for lease in more] == ["merge"]
    store.complete_and_claim([(more[0], "success", None)], "r", [])
    assert store.get_run(run_id).conclusion == "success"


def test_the_warm_up_takes_every_path_and_leaves_nothing_behind(store: Store, pg_url: str) -> None:
    _submit(store)  # rows of a real run, which the warm-up must not touch
    with (
        psycopg.connect(pg_url, autocommit=True) as conn,
        psycopg.connect(pg_url, autocommit=True) as listener,
    ):
        listener.execute("LISTEN preloop_jobs")
        listener.execute("LISTEN preloop_runs")
        listener.execute("LISTEN preloop_test_done")
        before = conn.execute(_STATE).fetchone()
        assert conn.execute("SELECT preloop_warm_settle()").fetchone() == (PATHS,)
        assert conn.execute(_STATE).fetchone() == before
        # It queued jobs and ended a run: a notice of either would come
        # before this one, sent after it from the same session.
        conn.execute("NOTIFY preloop_test_done")
        channels = []
        for note in listener.notifies():
            channels.append(note.channel)
            if note.channel == "preloop_test_done":
                break
        assert channels == ["preloop_test_done"]


def test_a_warm_up_inside_a_transaction_undoes_only_its_own_work(store: Store, pg_url: str) -> None:
    run_id = _submit(store)
    with psycopg.connect(pg_url) as conn:  # one open transaction
        conn.execute("UPDATE runs SET name = 'renamed' WHERE id = %s", (run_id,))
        assert conn.execute("SELECT preloop_warm_settle()").fetchone() == (PATHS,)
        conn.commit()
    assert store.get_run(run_id).name == "renamed"


def test_a_warm_up_in_progress_does_not_hold_up_another(store: Store, pg_url: str) -> None:
    """One connection's warm-up stopped halfway (its runs written, its group
    row waiting on a row a third session holds) while another's runs from
    start to end: their runs and groups are named after their own backends."""
    with (
        psycopg.connect(pg_url, autocommit=True) as first,
        psycopg.connect(pg_url) as holder,
        psycopg.connect(pg_url, autocommit=True) as second,
    ):
        pid = first.info.backend_pid
        holder.execute("INSERT INTO conc_groups (name) VALUES (%s)", (f"preloop warm-up {pid}",))
        out: dict[str, object] = {}

        def warm_first() -> None:
            out["first"] = first.execute("SELECT preloop_warm_settle()").fetchone()

        t = threading.Thread(target=warm_first)
        t.start()
        wait_until_blocked_by(holder, holder.info.backend_pid, t)
        second.execute("SET lock_timeout = '5s'")  # meeting the first's rows: fails
        assert second.execute("SELECT preloop_warm_settle()").fetchone() == (PATHS,)
        holder.rollback()
        t.join(timeout=60)
        assert out["first"] == (PATHS,)


def test_a_cancelled_warm_up_leaves_the_batch_to_run(store: Store, pg_url: str) -> None:
    """A warm-up cancelled (`pg_cancel_backend`, a `statement_timeout`) raises
    on the server; the store counts it and the batch runs as it would have."""
    run_id = _submit(store, legs=2)
    held = store.claim_jobs("r", [], limit=2)
    out: dict[str, object] = {}
    with psycopg.connect(pg_url) as holder:
        # The warm-up writes a group of its own first: held here, it waits
        # (the batch itself, of a run without groups, writes none).
        holder.execute("LOCK TABLE conc_groups IN EXCLUSIVE MODE")

        def batch() -> None:
            out["result"] = store.complete_and_claim(
                [(lease, "success", None) for lease in held], "r", []
            )

        t = threading.Thread(target=batch)
        t.start()
        wait_until_blocked_by(holder, holder.info.backend_pid, t)
        cancelled = holder.execute(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity"
            " WHERE %s = ANY (pg_blocking_pids(pid))",
            (holder.info.backend_pid,),
        ).fetchall()
        assert cancelled == [(True,)]
        t.join(timeout=60)
        holder.rollback()
    done, more = out["result"]  # type: ignore[misc]
    assert store.counters.snapshot().operations.get("warm_settle.failed") == 1
    _merge_ends_the_run(store, run_id, done, more)


def test_no_connection_to_be_had_leaves_the_warm_up_for_later(pg_url: str) -> None:
    """The pool exhausted (or the server away): the warm-up does not fail the
    batch for want of a connection; the batch's own statement waits for one."""
    backend = PgBackend(pg_url, max_size=1)
    try:
        backend._pool.timeout = 0.2  # the only connection stays with this thread
        backend._connection()
        ran: list[str] = []

        def other_thread() -> None:
            ran.append(str(backend.once_per_connection("warm", lambda tx: "ran")))

        t = threading.Thread(target=other_thread)
        t.start()
        t.join(timeout=60)
        assert ran == ["None"]
    finally:
        backend.close()


def test_a_failed_warm_up_is_reported_and_the_batch_still_runs(store: Store, pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        # Real runs have positive ids; the warm-up's negative ones are refused.
        conn.execute("ALTER TABLE runs ADD CONSTRAINT no_warm_up CHECK (id > 0)")
        (paths,) = conn.execute("SELECT preloop_warm_settle()").fetchone() or (None,)
    assert len(paths) == 1 and paths[0].startswith("error: "), paths
    assert "no_warm_up" in paths[0]
    run_id = _submit(store, legs=2)
    held = store.claim_jobs("r", [], limit=2)
    done, more = store.complete_and_claim([(lease, "success", None) for lease in held], "r", [])
    assert store.counters.snapshot().operations.get("warm_settle") == 1
    _merge_ends_the_run(store, run_id, done, more)


def test_the_store_warms_each_connection_up_once_before_its_first_batch(store: Store) -> None:
    run_id = _submit(store, legs=6)
    held = store.claim_jobs("r", [], limit=2)
    assert store.counters.snapshot().operations.get("warm_settle") is None  # claims alone
    for _ in range(2):
        _, held = store.complete_and_claim(
            [(lease, "success", None) for lease in held], "r", [], limit=2
        )
    assert store.counters.snapshot().operations.get("warm_settle") == 1

    def other_thread() -> None:  # its own connection
        store.complete_and_claim([(lease, "success", None) for lease in held], "r", [])

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert store.counters.snapshot().operations.get("warm_settle") == 2
    assert store.get_run(run_id).status == "running"  # the merge is left


def test_after_the_warm_up_a_batch_plans_nothing_of_its_own(store: Store) -> None:
    """Each path a runner's batches take, on a connection the warm-up has
    seen: PostgreSQL plans nothing inside `preloop_complete_claim` (at most
    the call itself, which psycopg prepares only after a few runs). The
    server's `debug_print_plan`, sent to this client, counts the plans."""
    b = PlanBuilder()
    b.job("setup")
    b.matrix("leg", 4, needs=["setup"], max_parallel=2)  # slots handed over
    b.job("merge", needs=["leg"], if_expr="always()")  # a unit's end; the run's
    capped = store.submit_run(b.plan())
    g = PlanBuilder()
    g.job("setup")
    g.matrix(
        "leg", 4, needs=["setup"], max_parallel=2, concurrency=ConcurrencySpec("g", queue_max=True)
    )
    grouped = store.submit_run(g.plan())
    first = store.claim_jobs("r", [], limit=1)  # `capped`'s setup: the first batch warms up
    _, held = store.complete_and_claim([(first[0], "success", None)], "r", [], limit=1)
    assert store.counters.snapshot().operations.get("warm_settle") == 1

    plans: list[str] = []
    conn = store._db._connection()  # this thread's, as the store's calls use it
    conn.add_notice_handler(
        lambda d: (
            plans.append(d.context or "top level") if d.severity_nonlocalized == "LOG" else None
        )
    )
    conn.execute("SET debug_print_plan = on")
    conn.execute("SET client_min_messages = log")
    fast = 0
    try:
        while held or (held := store.claim_jobs("r", [], limit=1)):
            before, fell_back = len(plans), _fallbacks(store)
            _, held = store.complete_and_claim(
                [(lease, "success", None) for lease in held], "r", [], limit=1
            )
            if _fallbacks(store) == fell_back:  # the cascade's SQL is planned as it goes
                fast += 1
                assert len(plans) - before <= 1, plans[before:]
    finally:
        conn.execute("RESET client_min_messages")
        conn.execute("RESET debug_print_plan")
    assert store.get_run(capped).conclusion == "success"
    assert store.get_run(grouped).conclusion == "success"
    # Every batch but the grouped run's first (its legs enter their group
    # through the cascade).
    assert (fast, _fallbacks(store)) == (9, 1)
