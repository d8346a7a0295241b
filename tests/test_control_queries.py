"""The named statements file: every statement the scheduler names exists,
every statement in the file is used, and no name is defined twice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import preloop.control
from preloop.control.queries import Q, parse_queries


def test_every_named_statement_is_defined_and_used() -> None:
    folder = Path(preloop.control.__file__).parent
    used = set()
    for path in folder.glob("*.py"):
        if path.name == "queries.py":
            continue  # its docstring shows the syntax
        used |= set(re.findall(r'Q\["([a-z0-9_]+)"\]', path.read_text()))
    assert used - set(Q) == set(), "named in code, missing from queries.sql"
    assert set(Q) - used == set(), "in queries.sql, used nowhere"


def test_a_name_defined_twice_is_refused() -> None:
    text = "-- a --\nSELECT 1\n\n-- a --\n-- again\nSELECT 2\n"
    with pytest.raises(ValueError, match="'a' is defined twice"):
        parse_queries(text)
    assert parse_queries("-- head\n\n-- b --\n-- doc\nSELECT ?\n") == {"b": "SELECT ?"}
