"""The `store` fixture every scheduler test uses: parametrised over lite
(SQLite in `tmp_path`) and pg (a fresh schema from the `pg_url` fixture).

Import it into a test module: `from preloop.testing.control_fixtures import store`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from preloop.control import Store, open_store

__all__ = ["store", "store_url"]


@pytest.fixture(params=["lite", "pg"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL for an empty store of each kind."""
    if request.param == "lite":
        return f"sqlite:///{tmp_path / 'preloop.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_store(store_url)
    try:
        yield s
    finally:
        s.close()
