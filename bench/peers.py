"""The job queues the scheduler is measured against, driven the way
`preloop.testing.load` drives ours: `python bench/peers.py setup URL KIND N`
installs the queue's schema and enqueues N no-op jobs; `python bench/peers.py
work URL KIND CONCURRENCY` starts one worker process, prints "ready", waits
for a line on stdin, then works until nothing is queued or running (each
queue's own drain mode) and prints one JSON line; `count URL KIND` prints the
jobs still queued or running. KIND is `pgqueuer` or `procrastinate`; both run
plain (no dependencies between jobs), with their stock settings apart from the
batch size / concurrency given and PgQueuer's dequeue timeout (0.2 s instead of
30 s: a worker whose queue is briefly empty looks again sooner); PgQueuer's
workers use asyncpg, the driver its CLI takes first.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import timedelta
from typing import Any


async def _pgq_setup(url: str, n: int) -> None:
    import psycopg
    from pgqueuer.queries import Queries

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        queries = Queries.from_psycopg_connection(conn)
        await queries.install(create_schema=False)
        for i in range(0, n, 5000):
            k = min(5000, n - i)
            await queries.enqueue(["noop"] * k, [None] * k, [0] * k)


async def _pgq_work(url: str, concurrency: int) -> dict[str, Any]:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.models import Job
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    # asyncpg, the driver PgQueuer's CLI takes first (psycopg only without
    # it). Its psycopg driver waits for notifications on the worker's one
    # connection with `notifies(timeout=1.0)`, holding the connection up to
    # 1 s when none arrives: a worker's first dequeue or last completion write
    # then waits up to a second, a stall of the driver, not of the queue.
    # libpq's `options` in the URL (the scratch schema's search_path) reach
    # the server through asyncpg as they are.
    conn = await asyncpg.connect(url)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    done = 0

    @qm.entrypoint("noop")
    async def noop(job: Job) -> None:
        nonlocal done
        done += 1

    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t0 = time.perf_counter()
    await qm.run(
        mode=QueueExecutionMode.drain,
        batch_size=concurrency,
        dequeue_timeout=timedelta(seconds=0.2),
    )
    elapsed = time.perf_counter() - t0
    await conn.close()
    return {"completions": done, "elapsed": elapsed}


def _procrastinate_app(url: str) -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    @app.task(name="noop")
    async def noop() -> None:
        return None

    return app


async def _proc_setup(url: str, n: int) -> None:
    app = _procrastinate_app(url)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        task = app.tasks["noop"]
        for i in range(0, n, 5000):
            await task.batch_defer_async(*([{}] * min(5000, n - i)))


async def _proc_work(url: str, concurrency: int) -> dict[str, Any]:
    app = _procrastinate_app(url)
    async with app.open_async():
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        t0 = time.perf_counter()
        await app.run_worker_async(
            concurrency=concurrency, wait=False, install_signal_handlers=False
        )
        elapsed = time.perf_counter() - t0
    return {"completions": None, "elapsed": elapsed}


def _count(url: str, kind: str) -> int:
    import psycopg

    sql = {
        "pgqueuer": "SELECT count(*) FROM pgqueuer WHERE status IN ('queued', 'picked')",
        "procrastinate": "SELECT count(*) FROM procrastinate_jobs "
        "WHERE status IN ('todo', 'doing')",
    }[kind]
    with psycopg.connect(url) as conn:
        row = conn.execute(sql).fetchone()
        assert row is not None
        return int(row[0])


def main(argv: list[str]) -> int:
    cmd, url, kind, arg = argv
    if cmd == "setup":
        setup = _pgq_setup if kind == "pgqueuer" else _proc_setup
        asyncio.run(setup(url, int(arg)))
    elif cmd == "work":
        work = _pgq_work if kind == "pgqueuer" else _proc_work
        print(json.dumps(asyncio.run(work(url, int(arg)))), flush=True)
    elif cmd == "count":
        print(_count(url, kind))
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
