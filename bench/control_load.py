"""Scheduler load: the seed's three 200-leg profiles, driven by 2 engine
processes with concurrent claimer threads, on lite and on PostgreSQL; and the
per-completion cost at 200 / 2,000 / 20,000 legs.

Run: `PRELOOP_TEST_PG_URL=postgresql://... pytest bench/control_load.py
--benchmark-only -s` (without the URL only lite runs). Each measurement is one
round (a load run is not repeatable on the same rows); the figures are in the
benchmark's `extra_info` and printed as a table at the end:

- graph loads per completion (target 0 on every path),
- mean settle lock hold and mean `lock_run` wait on PostgreSQL
  (targets <= 1 ms and <= 3 ms with 2 nodes),
- completions per second on one run (targets >= 1,000 pg, >= 5,000 lite),
- per-completion cost at 20,000 legs within 1.5x of 200 legs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from preloop.control import open_store
from preloop.testing.pg import scratch_schema
from preloop.testing.plans import profile_plan, with_runs_on

ENGINES = 2
CAPACITY = int(os.environ.get("PRELOOP_BENCH_CAPACITY", "16"))  # jobs one engine runs at once
THREADS_PER_ENGINE = int(os.environ.get("PRELOOP_BENCH_THREADS", "2"))
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


def run_load(url: str, profile: str, legs: int) -> dict[str, Any]:
    """Submits one run and drives it to the end with ENGINES engine processes."""
    plan = with_runs_on(profile_plan(profile, legs), ("linux",))
    with open_store(url) as store:
        run_id = store.submit_run(plan)
    engines = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "preloop.testing.load",
                url,
                str(run_id),
                str(CAPACITY),
                str(THREADS_PER_ENGINE),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(ENGINES)
    ]
    for e in engines:
        assert e.stdout is not None and e.stdout.readline().strip() == "ready"
    t0 = time.perf_counter()
    for e in engines:
        assert e.stdin is not None
        e.stdin.write("go\n")
        e.stdin.flush()
    reports = []
    for e in engines:
        out, _ = e.communicate(timeout=1800)
        assert e.returncode == 0
        reports.append(json.loads(out.strip().splitlines()[-1]))
    wall = time.perf_counter() - t0
    with open_store(url) as store:
        run = store.get_run(run_id)
        assert run.status == "completed" and run.conclusion == "success", run
    completions = sum(r["completions"] for r in reports)
    assert completions == len(plan.jobs)
    holds = sum(r["settle_lock_holds"] for r in reports)
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
        "mean_lock_run_wait_ms": round(sum(r["lock_run_wait_ns"] for r in reports) / waits / 1e6, 3)
        if waits
        else None,
        "statements_per_completion": round(
            sum(r["complete_statements"] for r in reports) / completions, 3
        ),
        "fast_path_misses": sum(r["fallbacks"] for r in reports),
        "deadlock_retries": sum(r["deadlock_retries"] for r in reports),
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
        "mean_lock_run_wait_ms",
        "statements_per_completion",
    ]
    print("\n" + " | ".join(cols))
    for r in RESULTS:
        print(" | ".join(str(r[c]) for c in cols))
    for store in ("lite", "pg"):
        cost = {
            r["legs"]: r["per_completion_ms"]
            for r in RESULTS
            if r["store"] == store and r["profile"] == "merge" and r["legs"] in (200, 20_000)
        }
        if 200 in cost and 20_000 in cost:
            print(
                f"{store}: per-completion cost 20,000 / 200 legs = {cost[20_000] / cost[200]:.2f}x"
            )
