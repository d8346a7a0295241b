"""The job queues the scheduler is measured against, driven the way
`preloop.testing.load` drives ours: `python bench/peers.py setup URL KIND N`
installs the queue's schema and enqueues N no-op jobs; `python bench/peers.py
work URL KIND CONCURRENCY` starts one worker process, prints "ready", waits
for a line on stdin, then works until nothing is queued or running (each
queue's own drain mode) and prints one JSON line; `count URL KIND` prints the
jobs still queued or running. KIND is `pgqueuer` or `procrastinate`; both run
plain (no dependencies between jobs), with their stock settings apart from the
batch size / concurrency given; PgQueuer's workers use its default driver,
asyncpg.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.parse
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


async def _asyncpg_connect(url: str) -> Any:
    """An asyncpg connection to `url`: libpq's `options=-cNAME=VALUE ...` (the
    scratch schema's search_path) become asyncpg's server settings."""
    import asyncpg

    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    settings = dict(
        token[2:].split("=", 1)
        for token in query.pop("options", [""])[0].split()
        if token.startswith("-c") and "=" in token
    )
    dsn = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, doseq=True)))
    return await asyncpg.connect(dsn, server_settings=settings)


async def _pgq_work(url: str, concurrency: int) -> dict[str, Any]:
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.models import Job
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    # asyncpg, PgQueuer's default driver (its CLI falls back to psycopg only
    # without it). Its psycopg driver reads notifications on the one connection
    # with `notifies(timeout=1.0)`, holding it up to 1 s when none arrives: the
    # workers' last completion write then waits ~1 s, a stall of the driver,
    # not of the queue, that dominated every earlier PgQueuer figure.
    conn = await _asyncpg_connect(url)
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
