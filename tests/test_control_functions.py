"""`preloop.control.functions`: the server-side functions' text as installed,
checked against what a migrated PostgreSQL schema holds."""

from __future__ import annotations

import re
import subprocess
import sys

import psycopg

from preloop.control import open_store
from preloop.control.functions import current_functions

_BODY = re.compile(r"\bAS (\$\w*\$)(.*)\1", re.S)


def test_current_functions_are_the_installed_ones(pg_url: str) -> None:
    open_store(pg_url).close()  # migrates the fresh schema
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(
            "SELECT p.proname, p.prosrc FROM pg_proc p"
            " JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = current_schema()"
        ).fetchall()
    installed = dict(rows)
    assert len(installed) == len(rows), "an overload was left behind"
    ours = current_functions()
    assert sorted(ours) == sorted(installed)
    for name, sql in ours.items():
        body = _BODY.search(sql)
        assert body is not None, name
        assert body[2] == installed[name], name


def test_module_prints_a_function_and_refuses_an_unknown_name() -> None:
    cmd = [sys.executable, "-m", "preloop.control.functions"]
    listed = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "preloop_complete_claim" in listed.stdout.split()
    shown = subprocess.run([*cmd, "preloop_claim"], capture_output=True, text=True, check=True)
    assert shown.stdout.startswith("CREATE OR REPLACE FUNCTION preloop_claim(")
    bad = subprocess.run([*cmd, "preloop_nope"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.startswith("preloop: error: no function preloop_nope;")
    assert bad.stdout == ""
