"""PostgreSQL: `preloop_warm_settle` (schema migration 26) takes each path of
`preloop_complete_claim` once on runs of its own and undoes it, so that a
connection has planned the function's statements before its first batch
holds a run row; the store calls it once per connection."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest

from preloop.control import Store, open_store
from preloop.testing.plans import PlanBuilder

PATHS = [
    "slots",
    "plain",
    "unit ended under the run row",
    "unit ended before the run row",
    "run ended",
    "group",
]

# Every table the warm-up writes, and the shared group counter it must not.
_STATE = """
SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM jobs), (SELECT count(*) FROM units),
       (SELECT count(*) FROM cohorts), (SELECT count(*) FROM deps),
       (SELECT count(*) FROM conc_groups), (SELECT value FROM wait_seq WHERE id = 1)
"""


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    with open_store(pg_url) as s:
        yield s


def _submit(store: Store, legs: int = 6) -> int:
    b = PlanBuilder()
    b.matrix("leg", legs)
    b.job("merge", needs=["leg"], if_expr="always()")
    return store.submit_run(b.plan())


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


def test_two_connections_warm_up_on_rows_that_never_meet(store: Store, pg_url: str) -> None:
    """One connection in the middle of its warm-up (its rows written, not
    committed) does not hold up another's: their run ids and group come from
    their own backend pids."""
    with (
        psycopg.connect(pg_url) as first,
        psycopg.connect(pg_url, autocommit=True) as second,
    ):
        pid = first.info.backend_pid
        first.execute(
            "INSERT INTO runs (id, workflow, name, event, status, remaining_jobs, context,"
            " created_at) VALUES (%s, '', '', '', 'running', 1, '{}', 0), (%s, '', '', '',"
            " 'running', 1, '{}', 0)",
            (-2 * pid, -2 * pid - 1),
        )
        first.execute(
            "INSERT INTO conc_groups (name, holder_run, holder_job) VALUES (%s, %s, 'g1')",
            (f"preloop warm-up {pid}", -2 * pid - 1),
        )
        second.execute("SET lock_timeout = '5s'")  # a clash fails, not hangs
        assert second.execute("SELECT preloop_warm_settle()").fetchone() == (PATHS,)
        first.rollback()


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
    assert all(c.changed for c in done) and [lease.job_id for lease in more] == ["merge"]
    assert store.counters.snapshot().operations.get("warm_settle") == 1
    store.complete_and_claim([(more[0], "success", None)], "r", [])
    assert store.get_run(run_id).conclusion == "success"


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
