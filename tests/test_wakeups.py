"""Wake-ups: an idle runner is woken by PostgreSQL LISTEN/NOTIFY, not its poll.

The runners here poll every 60 s (both the fallback and the plain poll), so
only a notification can make them claim a job queued while they wait; the
tests wait at most 30 s for the claim.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import psycopg
import pytest

from preloop.control import Store, open_store
from preloop.control.wakeups import JOBS, Listener
from preloop.runner import Runner, RunnerOptions
from preloop.testing.plans import PlanBuilder

LONG_POLL = 60.0
WITHIN = 30.0


def _one_job_plan(name: str = "wf") -> PlanBuilder:
    b = PlanBuilder()
    b.job("a", runs_on=("ubuntu-latest",))
    return b


def _watch_idle(store: Store) -> threading.Event:
    """An event set when a runner subscribes for a wake-up while the listener
    is live and its token is current (it is idle and waiting)."""
    idle = threading.Event()
    original = store.on_work

    def on_work(
        token: int, callback: Callable[[], None], channel: str = JOBS
    ) -> Callable[[], None]:
        unsubscribe = original(token, callback, channel)
        if channel == JOBS and store.listening and store.work_token() == token:
            idle.set()
        return unsubscribe

    store.on_work = on_work  # type: ignore[method-assign]
    return idle


def _serve_in_thread(runner: Runner) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def main() -> None:
        async def serve() -> None:
            await runner.serve(anyio.Event())

        try:
            anyio.run(serve)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, errors


def _runner(store: Store, tmp_path: Path, capacity: int) -> Runner:
    return Runner(
        store,
        RunnerOptions(
            name="waker",
            labels=[],
            state_dir=tmp_path / "state",
            idle_poll=LONG_POLL,
            listen_poll=LONG_POLL,
            max_jobs=1,
            capacity=capacity,
            # Completed `skipped` without a checkout: only the claim matters here.
            skip=lambda lease, contexts: "claimed by the wake-up test",
        ),
    )


def _terminate(server_url: str, pid: int) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_terminate_backend(%s) AS ok", (pid,)).fetchone()
    assert row is not None and row[0]


@pytest.mark.parametrize("capacity", [1, 2])
@pytest.mark.parametrize("terminated", [False, True], ids=["listening", "after-terminate"])
def test_idle_runner_claims_a_queued_job_on_notification(
    pg_url: str, pg_server_url: str, tmp_path: Path, capacity: int, terminated: bool
) -> None:
    store = open_store(pg_url)
    try:
        idle = _watch_idle(store)
        if terminated:
            # The listening connection is killed before the runner waits: the
            # listener reconnects and LISTENs again, without a traceback.
            store.work_token()
            listener = store._db.listener()
            assert isinstance(listener, Listener)
            assert listener.wait_connected(WITHIN)
            first = listener.backend_pid
            assert first is not None
            _terminate(pg_server_url, first)
            assert listener.wait_connected(WITHIN, after=1)
            assert listener.backend_pid not in (None, first)
        runner = _runner(store, tmp_path, capacity)
        thread, errors = _serve_in_thread(runner)
        assert idle.wait(WITHIN), "the runner never waited for work"
        run_id = store.submit_run(_one_job_plan().plan())
        thread.join(WITHIN)
        assert not thread.is_alive(), "the queued job was not claimed: no wake-up"
        assert errors == []
        assert runner.jobs_run == 1
        assert [j.conclusion for j in store.list_jobs(run_id)] == ["skipped"]
    finally:
        store.close()


def test_listener_reconnects_while_a_runner_waits(
    pg_url: str, pg_server_url: str, tmp_path: Path
) -> None:
    """`pg_terminate_backend` of the listening connection while a runner is
    idle: the reconnect wakes it (to look again), and a job queued afterwards
    is claimed on its notification."""
    store = open_store(pg_url)
    try:
        idle = _watch_idle(store)
        runner = _runner(store, tmp_path, 1)
        thread, errors = _serve_in_thread(runner)
        assert idle.wait(WITHIN)
        listener = store._db.listener()
        assert isinstance(listener, Listener)
        connects = listener.connects
        pid = listener.backend_pid
        assert pid is not None
        idle.clear()
        _terminate(pg_server_url, pid)
        assert listener.wait_connected(WITHIN, after=connects)
        assert idle.wait(WITHIN), "the runner did not wait again after the reconnect"
        run_id = store.submit_run(_one_job_plan().plan())
        thread.join(WITHIN)
        assert not thread.is_alive()
        assert errors == []
        assert [j.conclusion for j in store.list_jobs(run_id)] == ["skipped"]
    finally:
        store.close()


def test_lite_store_has_no_wake_ups_and_keeps_polling(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'preloop.db'}")
    try:
        assert store.work_token() is None
        assert not store.listening
    finally:
        store.close()


def test_a_job_becoming_queued_notifies_once_per_transaction(pg_url: str) -> None:
    """The triggers: a submission of several queued jobs is one notification
    at commit; a blocked job released by its need is another; the run's
    completion is one on preloop_runs."""
    store = open_store(pg_url)
    try:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("LISTEN preloop_jobs")
            b = PlanBuilder()
            b.job("a", runs_on=("ubuntu-latest",))
            b.job("b", runs_on=("ubuntu-latest",))
            b.job("c", needs=["a"], runs_on=("ubuntu-latest",))
            run_id = store.submit_run(b.plan())
            got = list(conn.notifies(timeout=WITHIN, stop_after=1))
            assert [n.channel for n in got] == ["preloop_jobs"]
            lease = store.claim_job("r", ["ubuntu-latest"], run_id=run_id)
            assert lease is not None
            other = store.claim_job("r", ["ubuntu-latest"], run_id=run_id)
            assert other is not None
            done = lease if lease.job_id == "a" else other
            store.complete_job(done, "success", {})
            got = list(conn.notifies(timeout=WITHIN, stop_after=1))
            assert [n.channel for n in got] == ["preloop_jobs"]
            # The run's completion is one notification on preloop_runs.
            conn.execute("LISTEN preloop_runs")
            store.complete_job(lease if done is other else other, "success", {})
            last = store.claim_job("r", ["ubuntu-latest"], run_id=run_id)
            assert last is not None and last.job_id == "c"
            store.complete_job(last, "success", {})
            assert store.get_run(run_id).status == "completed"
            got = list(conn.notifies(timeout=WITHIN, stop_after=1))
            assert [n.channel for n in got] == ["preloop_runs"]
    finally:
        store.close()
