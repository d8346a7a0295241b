"""`preloop.control.functions`: the server-side functions' text as installed,
checked against what a migrated PostgreSQL schema holds."""

from __future__ import annotations

import subprocess
import sys

import psycopg

from preloop.control import open_store
from preloop.control.functions import current_functions
from preloop.control.schema import Statement
from preloop.testing.pg import scratch_schema

# Each function's whole definition (arguments, result, settings, body), named
# without its schema.
_DEFINITIONS = """
SELECT p.proname, replace(pg_get_functiondef(p.oid), n.nspname || '.', '')
  FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
 WHERE n.nspname = current_schema()
"""


def _definitions(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(_DEFINITIONS).fetchall()
    found = dict(rows)
    assert len(found) == len(rows), "an overload was left behind"
    return found


def test_current_functions_are_the_installed_ones(pg_server_url: str, pg_url: str) -> None:
    open_store(pg_url).close()  # every migration, on a fresh schema
    migrated = _definitions(pg_url)
    with scratch_schema(pg_server_url) as alone, psycopg.connect(alone, autocommit=True) as conn:
        conn.execute("SET check_function_bodies = off")  # no tables in this schema
        for sql in current_functions().values():
            conn.execute(sql)  # type: ignore[arg-type]  # the statements as written
        assert _definitions(alone) == migrated


def test_a_dropped_function_is_gone_and_the_last_definition_wins() -> None:
    def create(name: str, body: str) -> Statement:
        return {
            "pg": f"CREATE OR REPLACE FUNCTION {name}() RETURNS INT AS $f${body}$f$",
            "lite": None,
        }

    migrations: list[list[Statement]] = [
        [create("f", "1"), create("g", "1")],
        ["ALTER TABLE t ADD COLUMN c INT"],
        [{"pg": "DROP FUNCTION IF EXISTS f()", "lite": None}, create("g", "2")],
    ]
    assert current_functions(migrations) == {"g": create("g", "2")["pg"]}  # type: ignore[index]


def test_module_prints_a_function_and_refuses_an_unknown_name() -> None:
    cmd = [sys.executable, "-m", "preloop.control.functions"]
    listed = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "preloop_complete_claim" in listed.stdout.split()
    shown = subprocess.run([*cmd, "preloop_claim"], capture_output=True, text=True, check=True)
    assert shown.stdout.startswith("CREATE OR REPLACE FUNCTION preloop_claim(")
    usage = subprocess.run([*cmd, "--help"], capture_output=True, text=True, check=True)
    assert "python -m preloop.control.functions NAME" in usage.stdout
    bad = subprocess.run([*cmd, "preloop_nope"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.startswith("preloop: error: no function preloop_nope;")
    assert bad.stdout == ""
