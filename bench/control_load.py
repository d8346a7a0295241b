"""Scheduler load: the seed's three 200-leg profiles and the per-completion
cost at 200 / 2,000 / 20,000 legs, on lite and on PostgreSQL; and, on
PostgreSQL, ours against PgQueuer and procrastinate.

Each engine is one runner process (`preloop.testing.load`) with
THREADS_PER_ENGINE loops of CAPACITY jobs each: it claims up to its free
capacity in one statement and reports finished jobs with its next claims in
one transaction (`Store.complete_and_claim`). The peers get the same number of
worker processes and as many jobs in flight per process.

Run: `PRELOOP_TEST_PG_URL=postgresql://... pytest bench/control_load.py
--benchmark-only -s` (without the URL only lite runs; the peers need the
`bench` extra). Each measurement is one round (a load run is not repeatable on
the same rows); every run, lite or PostgreSQL, is timed to the end condition every queue
shares (no queued or running rows, polled every 2 ms). The figures are in the
benchmark's `extra_info` and printed as a table at the end (issue 17 targets):

- graph loads per completion (0 on every path),
- mean settle lock hold on PostgreSQL (<= 0.5 ms; per lock-holding
  transaction, a batch of up to CAPACITY completions, as the server measures
  it for the one-statement path: `Tx.note_lock_hold`), the same for the
  one-statement batches alone (without the Python cascade's transactions,
  such as the one admitting every leg), the hold per completion, and mean
  `lock_run` wait,
- completions per second on one run (>= 2,500 pg at 2,000 and 20,000 legs,
  >= 10,000 lite),
- per-completion cost at 20,000 legs within 1.2x of 2,000 legs,
- statements per completion (the group profile: <= 4),
- ours / PgQueuer and ours / procrastinate (>= 2.5x each; PgQueuer, on its
  default driver asyncpg, over three alternating rounds, the median),
- the vCPU time the host stole while the run was timed (`bench/hoststats.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hoststats import steal_between, steal_ms
from preloop.control import open_store
from preloop.testing.load import let_go, start_ready
from preloop.testing.pg import scratch_schema
from preloop.testing.plans import profile_plan, with_runs_on

ENGINES = 2
CAPACITY = int(os.environ.get("PRELOOP_BENCH_CAPACITY", "32"))  # jobs one engine runs at once
THREADS_PER_ENGINE = int(os.environ.get("PRELOOP_BENCH_THREADS", "1"))
RESULTS: list[dict[str, Any]] = []


@pytest.fixture(params=["lite", "pg"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "lite":
        yield f"sqlite:///{tmp_path / 'preloop.db'}"
        return
    url = os.environ.get("PRELOOP_TEST_PG_URL")
    if not url:
        pytest.skip("PRELOOP_TEST_PG_URL is not set")
    with scratch_schema(url, prefix="preloop_bench") as scoped:
        yield scoped


def _connect(url: str) -> Any:
    """A connection for the end condition: autocommit on PostgreSQL; on lite a
    read-only one, whose WAL snapshot never blocks the engines' writes."""
    if url.startswith("sqlite:///"):
        import sqlite3

        path = url.removeprefix("sqlite:///")
        return contextlib.closing(
            sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
        )
    import psycopg

    return psycopg.connect(url, autocommit=True)


def _race(
    procs: list[subprocess.Popen[str]], url: str, end_sql: str
) -> tuple[float, list[str], float | None]:
    """Lets `procs` go together and times them to the end condition every
    queue shares: `end_sql` (no queued or running rows) answers true, polled
    every 2 ms on its own connection. Returns the wall time, each process's
    last output line and the vCPU time the host stole meanwhile (ms). The
    processes' exit (closing the store, interpreter teardown) is not a
    completion and is not timed."""
    with _connect(url) as conn:
        steal_before = steal_ms()
        t0 = time.perf_counter()
        let_go(procs)
        while True:
            row = conn.execute(end_sql).fetchone()
            if row is not None and row[0]:
                wall = time.perf_counter() - t0
                steal = steal_between(steal_before, steal_ms())
                break
            time.sleep(0.002)
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        assert p.returncode == 0
        outs.append(out.strip().splitlines()[-1])
    return wall, outs, steal


def run_load(url: str, profile: str, legs: int) -> dict[str, Any]:
    """Submits one run and drives it to the end with ENGINES engine processes."""
    plan = with_runs_on(profile_plan(profile, legs), ("linux",))
    with open_store(url) as store:
        run_id = store.submit_run(plan)
    engine = [sys.executable, "-m", "preloop.testing.load", url, str(run_id), str(CAPACITY)]
    engines = start_ready([[*engine, str(THREADS_PER_ENGINE)] for _ in range(ENGINES)])
    wall, outs, steal = _race(
        engines, url, f"SELECT status = 'completed' FROM runs WHERE id = {int(run_id)}"
    )
    reports = [json.loads(o) for o in outs]
    with open_store(url) as store:
        run = store.get_run(run_id)
        assert run.status == "completed" and run.conclusion == "success", run
    completions = sum(r["completions"] for r in reports)
    assert completions == len(plan.jobs)
    holds = sum(r["settle_lock_holds"] for r in reports)
    batch_holds = sum(r["statement_lock_holds"] for r in reports)
    waits = sum(r["lock_run_waits"] for r in reports)
    return {
        "store": "pg" if url.startswith("postgres") else "lite",
        "profile": profile,
        "legs": legs,
        "completions": completions,
        "wall_s": round(wall, 3),
        "completions_per_s": round(completions / wall, 1),
        "per_completion_ms": round(wall / completions * 1000, 4),
        "graph_loads_per_completion": sum(r["graph_loads"] for r in reports) / completions,
        "mean_settle_lock_hold_ms": round(
            sum(r["settle_lock_hold_ns"] for r in reports) / holds / 1e6, 3
        )
        if holds
        else None,
        # The one-statement batches alone (`preloop_complete_claim`), without
        # the transactions of the Python cascade (a unit ending: admitting
        # every leg of a matrix, ending the run) that the mean above includes.
        "mean_batch_lock_hold_ms": round(
            sum(r["statement_lock_hold_ns"] for r in reports) / batch_holds / 1e6, 3
        )
        if batch_holds
        else None,
        # The same hold spread over the completions (a batch of CAPACITY jobs
        # holds the lock once): what one completion costs the run's other writers.
        "settle_lock_hold_per_completion_ms": round(
            sum(r["settle_lock_hold_ns"] for r in reports) / completions / 1e6, 4
        ),
        "mean_lock_run_wait_ms": round(sum(r["lock_run_wait_ns"] for r in reports) / waits / 1e6, 3)
        if waits
        else None,
        "statements_per_completion": round(
            sum(r["complete_statements"] for r in reports) / completions, 3
        ),
        "fast_path_misses": sum(r["fallbacks"] for r in reports),
        # Batches whose run row stayed taken past COMPLETE_LOCK_WAIT after
        # their job rows were written, rerun run-row-first (migration 14).
        "lock_first_retries": sum(r["lock_first_retries"] for r in reports),
        "deadlock_retries": sum(r["deadlock_retries"] for r in reports),
        # vCPU time the host took while the run was timed: a lock holder it
        # descheduled holds the lock through the stall.
        "host_steal_ms": steal,
    }


@pytest.mark.parametrize("profile", ["capped", "group", "merge"])
def test_profile_200_legs(benchmark: Any, store_url: str, profile: str) -> None:
    benchmark.group = f"control-load {profile} 200 legs"
    result: dict[str, Any] = {}

    def once() -> None:
        result.update(run_load(store_url, profile, 200))

    benchmark.pedantic(once, rounds=1, iterations=1)
    benchmark.extra_info.update(result, impl=f"preloop-{result['store']}")
    RESULTS.append(result)
    print("\n" + json.dumps(result), flush=True)
    assert result["graph_loads_per_completion"] == 0
    assert result["deadlock_retries"] == 0


@pytest.mark.parametrize("legs", [200, 2_000, 20_000])
def test_per_completion_cost(benchmark: Any, store_url: str, legs: int) -> None:
    benchmark.group = f"control-load scaling {legs} legs"
    result: dict[str, Any] = {}

    def once() -> None:
        result.update(run_load(store_url, "merge", legs))

    benchmark.pedantic(once, rounds=1, iterations=1)
    benchmark.extra_info.update(result, impl=f"preloop-{result['store']}")
    RESULTS.append(result)
    print("\n" + json.dumps(result), flush=True)
    assert result["graph_loads_per_completion"] == 0


# Each end condition is polled every 2 ms on the database the queue runs on,
# so it must cost that queue as little as ours costs us (a primary-key read,
# ~0.02 ms of server time): `NOT EXISTS` over the queue's own partial
# indexes of open jobs. A `count(*)` over the table (1.7 ms at 20,000
# PgQueuer rows, 2.6 ms for procrastinate's) took a third to most of a core
# from the queue it was timing.
PEERS = {
    "pgqueuer": "SELECT NOT EXISTS (SELECT 1 FROM pgqueuer WHERE status = 'queued') "
    "AND NOT EXISTS (SELECT 1 FROM pgqueuer WHERE status = 'picked')",
    "procrastinate": "SELECT NOT EXISTS (SELECT 1 FROM procrastinate_jobs "
    "WHERE status IN ('todo', 'doing'))",
}
PEERS_SCRIPT = str(Path(__file__).with_name("peers.py"))


def run_peer(kind: str, legs: int) -> dict[str, Any]:
    """`legs + 2` plain jobs (as many as the merge profile has) on a peer
    queue in a fresh schema of the same PostgreSQL: ENGINES worker processes,
    each running CAPACITY * THREADS_PER_ENGINE jobs at once."""
    url = os.environ["PRELOOP_TEST_PG_URL"]
    jobs = legs + 2
    with scratch_schema(url, prefix=f"preloop_bench_{kind}") as scoped:
        subprocess.run([sys.executable, PEERS_SCRIPT, "setup", scoped, kind, str(jobs)], check=True)
        workers = start_ready(
            [
                [
                    sys.executable,
                    PEERS_SCRIPT,
                    "work",
                    scoped,
                    kind,
                    str(CAPACITY * THREADS_PER_ENGINE),
                ]
                for _ in range(ENGINES)
            ]
        )
        wall, _, steal = _race(workers, scoped, PEERS[kind])
    return {
        "store": kind,
        "profile": "plain",
        "legs": legs,
        "completions": jobs,
        "wall_s": round(wall, 3),
        "completions_per_s": round(jobs / wall, 1),
        "per_completion_ms": round(wall / jobs * 1000, 4),
        "host_steal_ms": steal,
    }


# Rounds of ours and a peer, alternating: PgQueuer, close to ours, three
# (the ratio is their median, so one burst of host steal on one side decides
# nothing); procrastinate, tens of times slower and a minute a run at 20,000
# jobs, one.
PEER_ROUNDS = {"pgqueuer": 3, "procrastinate": 1}


@pytest.mark.parametrize("legs", [2_000, 20_000])
def test_against_job_queues(benchmark: Any, legs: int) -> None:
    """Ours (the merge profile: setup -> legs -> always-run merge, DAG
    semantics on) and PgQueuer and procrastinate (as many plain jobs), back
    to back on the same PostgreSQL, each timed to "no queued or running
    rows"; the ratios are ours / theirs in completions per second, the
    median over `PEER_ROUNDS` alternating rounds."""
    url = os.environ.get("PRELOOP_TEST_PG_URL")
    if not url:
        pytest.skip("PRELOOP_TEST_PG_URL is not set")
    pytest.importorskip("pgqueuer", reason="pip install -e '.[bench]'")
    pytest.importorskip("procrastinate", reason="pip install -e '.[bench]'")
    benchmark.group = f"control-load vs job queues {legs} legs"
    pairs: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}

    def once() -> None:
        for kind in PEERS:
            pairs[kind] = []
            for _ in range(PEER_ROUNDS[kind]):
                with scratch_schema(url, prefix="preloop_bench") as scoped:
                    ours = run_load(scoped, "merge", legs)
                pairs[kind].append((ours, run_peer(kind, legs)))

    benchmark.pedantic(once, rounds=1, iterations=1)
    each = {
        kind: [ours["completions_per_s"] / theirs["completions_per_s"] for ours, theirs in runs]
        for kind, runs in pairs.items()
    }
    ratios = {f"x_{kind}": round(statistics.median(r), 2) for kind, r in each.items()}
    benchmark.extra_info.update(**ratios, legs=legs)
    benchmark.extra_info["paired"] = "; ".join(
        f"ours / {kind} " + ", ".join(f"{x:.2f}" for x in r) + f" (median {ratios['x_' + kind]})"
        for kind, r in each.items()
    )
    for runs in pairs.values():
        for ours, theirs in runs:
            for r in (ours, theirs):
                RESULTS.append({**r, "suite": "vs-queues"})
                print("\n" + json.dumps(r), flush=True)
    print(json.dumps({"legs": legs, **ratios}), flush=True)


def teardown_module() -> None:
    if not RESULTS:
        return
    cols = [
        "store",
        "profile",
        "legs",
        "completions_per_s",
        "per_completion_ms",
        "graph_loads_per_completion",
        "mean_settle_lock_hold_ms",
        "mean_batch_lock_hold_ms",
        "settle_lock_hold_per_completion_ms",
        "mean_lock_run_wait_ms",
        "statements_per_completion",
        "host_steal_ms",
    ]
    print("\n" + " | ".join(cols))
    for r in RESULTS:
        print(" | ".join(str(r.get(c, "")) for c in cols))
    for store in ("lite", "pg"):
        cost = {
            r["legs"]: r["per_completion_ms"]
            for r in RESULTS
            if r["store"] == store and r["profile"] == "merge" and "suite" not in r
        }
        for small in (200, 2_000):
            if small in cost and 20_000 in cost:
                print(
                    f"{store}: per-completion cost 20,000 / {small:,} legs = "
                    f"{cost[20_000] / cost[small]:.2f}x"
                )
