"""Disposable PostgreSQL schemas for tests: each gets its own `search_path`."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["scratch_schema", "with_search_path"]


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
