"""Fixtures shared by every test: PostgreSQL schemas and generated trees."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from preloop.testing.pg import scratch_schema

PG_ENV = "PRELOOP_TEST_PG_URL"

# The scheduler suite's `store` fixture (lite and pg).
pytest_plugins = ["preloop.testing.control_fixtures"]


def _require_pg() -> bool:
    return os.environ.get("PRELOOP_REQUIRE_PG", "") not in ("", "0")


@pytest.fixture(scope="session")
def pg_server_url() -> str:
    """The PostgreSQL server for tests: skipped without PRELOOP_TEST_PG_URL,
    failing instead when PRELOOP_REQUIRE_PG=1 (CI)."""
    url = os.environ.get(PG_ENV)
    if not url:
        if _require_pg():
            pytest.fail(f"PRELOOP_REQUIRE_PG=1 but {PG_ENV} is not set")
        pytest.skip(f"{PG_ENV} is not set: PostgreSQL tests need a server")
    return url


@pytest.fixture
def pg_url(pg_server_url: str) -> Iterator[str]:
    """A URL whose connections use a fresh schema, dropped after the test."""
    try:
        with scratch_schema(pg_server_url) as url:
            yield url
    except Exception as exc:
        if isinstance(exc, pytest.skip.Exception | pytest.fail.Exception):
            raise
        if _require_pg():
            raise
        pytest.skip(f"PostgreSQL at {PG_ENV} is unusable: {exc}")


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A 0755 temporary directory outside pytest's 0700 tree (for tests that
    drop privileges to `nobody`)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="preloop-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
