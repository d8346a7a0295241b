"""The shared fixtures behave as later suites rely on."""

from __future__ import annotations

from pathlib import Path

import psycopg

from preloop.testing.trees import TreeSpec, make_tree


def test_pg_url_has_its_own_schema(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        schema = conn.execute("SELECT current_schema()").fetchone()
        assert schema is not None and schema[0].startswith("preloop_test_")
        conn.execute("CREATE TABLE probe (x int)")
        conn.execute("INSERT INTO probe VALUES (1)")
        assert conn.execute("SELECT count(*) FROM probe").fetchone() == (1,)


def test_make_tree_is_deterministic(tmp_path: Path) -> None:
    spec = TreeSpec("det", 50, 5, 0, 100)
    a = make_tree(tmp_path / "a", spec)
    b = make_tree(tmp_path / "b", spec)
    files_a = sorted(p.relative_to(a) for p in a.rglob("*"))
    assert files_a == sorted(p.relative_to(b) for p in b.rglob("*"))
    for rel in files_a:
        if (a / rel).is_file():
            assert (a / rel).read_bytes() == (b / rel).read_bytes()
