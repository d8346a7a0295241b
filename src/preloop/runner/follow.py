"""Following jobs that runners on other machines run: the submitting
`preloop run` shows their lines live, and their results, through the same
`JobEvents` as its own runners' jobs (PostgreSQL: the lines come from the
store, `preloop.control.joblogs`, with a LOGS wake-up per stored batch).

A remote runner completes its job in the store before it stores the last
lines and the result, so a job that reads completed is shown as ended only
once its result is there, or `RESULT_GRACE` seconds later (a runner that
died: the store failed the job and no result will come).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio

from preloop.control import Lease, Store
from preloop.control.joblogs import JobElsewhere, JobLogStore
from preloop.control.wakeups import LOGS
from preloop.runner.job import JobResult
from preloop.runner.worker import JobEvents, wait_for_work

__all__ = ["RESULT_GRACE", "follow_elsewhere"]

RESULT_GRACE = 5.0
_POLL = 0.5  # seconds between looks when wake-ups are down (a fallback)


def _lease(run_id: int, job: JobElsewhere) -> Lease:
    # What the display reads of a lease: the run, the job and its name.
    return Lease(
        run_id=run_id,
        job_id=job.job_id,
        name=job.name,
        token="",
        runner=job.runner,
        expires_at=0.0,
        attempt=0,
        spec={},
        matrix=None,
        strategy=None,
        timeout_minutes=0.0,
    )


async def follow_elsewhere(
    store: Store,
    run_ids: list[int],
    own_runner_prefix: str,
    events: JobEvents,
    done: anyio.Event,
    on_duration: Callable[[int, str, float], None] | None = None,
) -> None:
    """Shows the jobs of `run_ids` that runners not named `own_runner_prefix...`
    claimed, until `done` is set and every such job that ended was shown."""
    logs = JobLogStore(store)
    printed: dict[tuple[int, str], int] = {}
    started: set[tuple[int, str]] = set()
    ended: set[tuple[int, str]] = set()
    completed_seen: dict[tuple[int, str], float] = {}

    async def look() -> bool:
        """One pass; True while a completed job waits for its result."""
        waiting = False
        for run_id in run_ids:
            jobs = await anyio.to_thread.run_sync(logs.jobs_elsewhere, run_id, own_runner_prefix)
            results: dict[str, dict[str, Any]] | None = None
            for job in jobs:
                key = (run_id, job.job_id)
                if key in ended:
                    continue
                lease = _lease(run_id, job)
                if key not in started:
                    started.add(key)
                    if events.on_start is not None:
                        events.on_start(lease)
                batches = await anyio.to_thread.run_sync(
                    logs.read, run_id, job.job_id, {job.job_id: printed.get(key, -1)}
                )
                for batch in batches:
                    printed[key] = batch.seq
                    if events.on_line is not None:
                        for line in batch.lines:
                            events.on_line(lease, line)
                if job.status != "completed":
                    continue
                if results is None:
                    results = await anyio.to_thread.run_sync(logs.results, run_id)
                doc = (results or {}).get(job.job_id)
                first = completed_seen.setdefault(key, time.monotonic())
                if doc is None and time.monotonic() - first < RESULT_GRACE:
                    waiting = True
                    continue
                if doc is not None:
                    result = JobResult.from_dict(doc)
                else:
                    result = JobResult(
                        job.conclusion or "failure",
                        {},
                        [],
                        [],
                        "",
                        f"runner {job.runner} ended without reporting the job's log",
                    )
                # The store's word on the conclusion is final.
                result.conclusion = job.conclusion or result.conclusion
                ended.add(key)
                if events.on_end is not None:
                    events.on_end(lease, result)
                if on_duration is not None and job.started_at and job.completed_at:
                    on_duration(run_id, job.job_id, job.completed_at - job.started_at)
        return waiting

    while True:
        token = store.work_token(LOGS)  # before the look: no batch is missed
        finished = done.is_set()
        waiting = await look()
        if finished and not waiting:
            return
        wait = _POLL if token is None or not store.listening or finished else 10 * _POLL
        await wait_for_work(store, token, wait, *(() if finished else (done,)), channel=LOGS)
