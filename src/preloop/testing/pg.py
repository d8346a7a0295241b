"""Disposable PostgreSQL schemas for tests: each gets its own `search_path`."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["scratch_schema", "wait_until_blocked_by", "with_search_path"]


def with_search_path(url: str, schema: str) -> str:
    """`url` with libpq `options=-csearch_path=<schema>` set (other query args kept)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "options"]
    query.append(("options", f"-csearch_path={schema}"))
    return urlunsplit(parts._replace(query=urlencode(query)))


@contextmanager
def scratch_schema(url: str, prefix: str = "preloop_test") -> Iterator[str]:
    """Creates a fresh schema, yields a URL whose connections use it, drops it after."""
    import psycopg

    schema = f"{prefix}_{secrets.token_hex(6)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield with_search_path(url, schema)
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def wait_until_blocked_by(holder: Any, pid: int, thread: threading.Thread) -> None:
    """Returns once another backend waits for a lock `holder` (backend `pid`)
    holds, or `thread` ended: the server's own lock table, no timing."""
    while thread.is_alive():
        row = holder.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_locks h ON h.pid = %s "
            "AND h.granted AND h.locktype = l.locktype "
            "AND h.database IS NOT DISTINCT FROM l.database "
            "AND h.relation IS NOT DISTINCT FROM l.relation "
            "AND h.transactionid IS NOT DISTINCT FROM l.transactionid "
            "WHERE NOT l.granted AND l.pid <> %s",
            (pid, pid),
        ).fetchone()
        if row and row[0]:
            return
