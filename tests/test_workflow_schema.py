"""The context-availability, event and permission tables are GitHub's: they
are regenerated from the schema shipped in `@actions/workflow-parser` (npm)
and must equal the committed `preloop.workflow.schema_tables` (regenerate
with `python -m preloop.workflow.schema_gen <schema> > .../schema_tables.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preloop.workflow import schema_tables
from preloop.workflow.availability import allowed_at, child
from preloop.workflow.schema_gen import derive, render

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "node_modules" / "@actions" / "workflow-parser" / "dist" / "workflow-v1.0.min.json"

pytestmark = pytest.mark.skipif(
    not SCHEMA.is_file(), reason="needs `npm ci` (the CI installs @actions/workflow-parser)"
)


def test_tables_equal_the_npm_schema() -> None:
    tables = derive(json.loads(SCHEMA.read_text(encoding="utf-8")))
    generated = render(tables)
    committed = Path(schema_tables.__file__).read_text(encoding="utf-8")
    assert generated == committed, (
        "schema_tables.py differs from @actions/workflow-parser's schema: regenerate it"
    )
    assert {k: tuple(v) for k, v in tables["contexts"].items()} == schema_tables.CONTEXTS
    assert set(tables["events"]) == set(schema_tables.EVENTS)


def test_the_schema_as_the_docs_describe_it() -> None:
    # The GitHub Pages deploy pattern and registry credentials (issue 14).
    url, _ = allowed_at("jobs.*.environment.url")
    assert {"steps", "env", "job", "runner", "needs", "matrix", "strategy", "inputs", "vars"} <= url
    assert "secrets" not in url
    for path in ("jobs.*.container.credentials", "jobs.*.services.*.credentials"):
        contexts, _ = allowed_at(path + ".password")
        assert {"secrets", "env"} <= contexts
    path = child(child(child("jobs.*.services", "redis"), "env"), "X")
    assert path == "jobs.*.services.*.env.*"
    assert allowed_at(path)[0] >= {"secrets", "env"}
    _, functions = allowed_at("jobs.*.if")
    assert functions["success"] > 0 and functions["always"] == 0
    _, functions = allowed_at("jobs.*.steps[].if")
    assert functions["success"] == 0 and "hashfiles" in functions
    assert allowed_at("jobs.*.steps[].uses") == (frozenset(), {})
    assert "branches" in schema_tables.EVENTS["merge_group"][0]
    assert {"names", "versions"} <= set(schema_tables.EVENTS["image_version"][0])
