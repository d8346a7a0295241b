"""The context-availability, event and permission tables are GitHub's: they
are regenerated from the schema shipped in `@actions/workflow-parser` (npm)
and must equal the committed `preloop.workflow.schema_tables` (regenerate
with `python -m preloop.workflow.schema_gen <schema> > .../schema_tables.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def _mapping_contexts(schema: dict[str, Any]) -> dict[str, set[bool]]:
    """Every mapping the schema reaches, by path: whether GitHub's reader lets
    it have expression keys (`${{ insert }}`), i.e. whether the contexts its
    reader definition has accumulated (a `one-of`'s own, not its
    alternatives') are non-empty. Written independently of `schema_gen`."""
    defs: dict[str, dict[str, Any]] = schema["definitions"]
    out: dict[str, set[bool]] = {}
    seen: set[tuple[str, str, bool]] = set()

    def visit(name: str, path: str, has_context: bool, depth: int) -> None:
        d = defs.get(name)
        if d is None or depth > 24:
            return
        has_context = has_context or bool(d.get("context"))
        if (name, path, has_context) in seen:
            return
        seen.add((name, path, has_context))
        alternatives = [name]
        if "one-of" in d:
            alternatives = list(d["one-of"])
        for alt in alternatives:
            a = defs.get(alt, {})
            # The reader keeps the outer definition for an alternative's
            # mapping: an alternative's own context is not added.
            own = has_context
            if "mapping" in a:
                out.setdefault(path, set()).add(own)
                m = a["mapping"]
                for key, spec in (m.get("properties") or {}).items():
                    t = spec if isinstance(spec, str) else spec["type"]
                    visit(t, f"{path}.{key}" if path else key, own, depth + 1)
                if "loose-value-type" in m:
                    visit(m["loose-value-type"], f"{path}.*" if path else "*", own, depth + 1)
            if "sequence" in a:
                visit(a["sequence"]["item-type"], f"{path}[]", own, depth + 1)
            if alt != name and "one-of" in a:
                visit(alt, path, own, depth + 1)

    visit("workflow-root-strict", "", False, 0)
    return out


def test_insert_placement_is_the_schemas() -> None:
    """`expression_keys_allowed` (from the generated tables) agrees with the
    schema for every mapping GitHub's reader can meet."""
    from preloop.workflow.availability import expression_keys_allowed

    mappings = _mapping_contexts(json.loads(SCHEMA.read_text(encoding="utf-8")))
    assert len(mappings) > 50
    wrong = {
        path: allowed
        for path, allowed in mappings.items()
        if len(allowed) == 1
        and expression_keys_allowed(path) not in allowed
        and "parallel" not in path
    }
    assert not wrong, wrong
    # Where the schema reaches one path as two mappings that disagree, there
    # is nothing to derive; there are none today.
    assert [p for p, allowed in mappings.items() if len(allowed) > 1] == []
