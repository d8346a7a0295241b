"""Claim latency: LISTEN/NOTIFY wake-ups vs polling (issue 16).

One `Runner.serve` (capacity 1) waits idle on a PostgreSQL store; the bench
submits a one-job run and measures the time from just before `submit_run`
(so the submission's own round trips are included) to the runner's claim
(its `on_start`). Each job is completed `skipped` at once (no checkout).

- notify: the runner waits on the store's wake-up listener; its fallback
  poll is 60 s, so every claim here comes from a notification.
- poll: wake-ups are switched off and the runner polls every 0.5 s (the
  `RunnerOptions.idle_poll` default); submissions come at a uniformly random
  moment of the poll period, as jobs do.

Run: `PRELOOP_TEST_PG_URL=postgresql://... pytest bench/test_claim_latency.py -s`
(one run; the table goes to stdout and into `extra_info`).
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from preloop.control import Store, open_store
from preloop.control.wakeups import JOBS
from preloop.runner import JobEvents, Runner, RunnerOptions
from preloop.testing.pg import scratch_schema
from preloop.testing.plans import PlanBuilder

SAMPLES = {"notify": 200, "poll": 40}
POLL = 0.5


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _measure(store: Store, tmp_path: Path, mode: str, submits: list[float]) -> list[float]:
    claimed: dict[int, float] = {}
    ended = threading.Event()
    idle = threading.Event()
    if mode == "poll":
        store.work_token = lambda: None  # type: ignore[method-assign]
    else:
        original = store.on_work

        def on_work(
            token: int, callback: Callable[[], None], channel: str = JOBS
        ) -> Callable[[], None]:
            unsubscribe = original(token, callback, channel)
            if channel == JOBS and store.listening and store.work_token() == token:
                idle.set()
            return unsubscribe

        store.on_work = on_work  # type: ignore[method-assign]

    def start(lease: object) -> None:
        claimed[lease.run_id] = time.perf_counter()  # type: ignore[attr-defined]

    runner = Runner(
        store,
        RunnerOptions(
            name=f"bench-{mode}",
            labels=[],
            state_dir=tmp_path / mode,
            idle_poll=POLL,
            listen_poll=60.0,
            skip=lambda lease, contexts: "bench",
        ),
        JobEvents(on_start=start, on_end=lambda lease, result: ended.set()),
    )
    stop: list[anyio.Event] = []
    portal_ready = threading.Event()

    async def serve() -> None:
        stop.append(anyio.Event())
        portal_ready.set()
        await runner.serve(stop[0])

    token: list[object] = []

    def main() -> None:
        async def with_token() -> None:
            token.append(anyio.lowlevel.current_token())
            await serve()

        anyio.run(with_token)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert portal_ready.wait(30)
    b = PlanBuilder()
    b.job("a", runs_on=("ubuntu-latest",))
    plan = b.plan()
    rng = random.Random(16)
    latencies: list[float] = []
    try:
        for _ in range(SAMPLES[mode]):
            if mode == "notify":
                assert idle.wait(30)
                idle.clear()
            else:
                time.sleep(rng.uniform(0, POLL))
            ended.clear()
            t0 = time.perf_counter()
            run_id = store.submit_run(plan)
            submits.append(time.perf_counter() - t0)
            assert ended.wait(30), f"{mode}: the job was not claimed"
            latencies.append(claimed[run_id] - t0)
    finally:
        anyio.from_thread.run_sync(stop[0].set, token=token[0])  # type: ignore[arg-type]
        thread.join(30)
    return latencies


@pytest.mark.parametrize("mode", ["notify", "poll"])
def test_claim_latency(mode: str, tmp_path: Path, record_property: Callable[..., None]) -> None:
    url = os.environ.get("PRELOOP_TEST_PG_URL")
    if not url:
        pytest.skip("PRELOOP_TEST_PG_URL is not set")
    submits: list[float] = []
    with scratch_schema(url) as schema_url:
        store = open_store(schema_url)
        try:
            latencies = _measure(store, tmp_path, mode, submits)
        finally:
            store.close()
    median = statistics.median(latencies) * 1000
    p99 = _percentile(latencies, 0.99) * 1000
    record_property("median_ms", round(median, 2))
    record_property("p99_ms", round(p99, 2))
    print(
        f"\nclaim latency, {mode}: n={len(latencies)} median {median:.1f} ms, "
        f"p99 {p99:.1f} ms, max {max(latencies) * 1000:.1f} ms "
        f"(of which submit_run itself: median {statistics.median(submits) * 1000:.1f} ms)"
    )
