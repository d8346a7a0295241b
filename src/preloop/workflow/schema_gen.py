"""Derives `preloop.workflow.schema_tables` from GitHub's workflow schema.

GitHub's parser (`@actions/workflow-parser`) validates a workflow against
`workflow-v1.0.json`: which contexts each value may use, which filters and
activity types each event takes. Those tables are derived from that file, not
written by hand:

    node_modules/@actions/workflow-parser/dist/workflow-v1.0.json
      -> python -m preloop.workflow.schema_gen SCHEMA > src/preloop/workflow/schema_tables.py

Only the generated module is read at run time (users do not install the npm
package); tests/test_workflow_schema.py regenerates the tables from the npm
package's schema and fails when they differ, so the two cannot drift.

Paths name where a value sits: mapping keys joined with `.`, `*` for any key
of a free-form mapping (`jobs.*`), `[]` for the items of a sequence
(`jobs.*.steps[].with.*`). A context set applies to its path and everything
below it, up to a deeper path that has its own (GitHub's reader accumulates
contexts the same way: a definition adds its own to its parent's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["derive", "render"]

_ROOT = "workflow-root-strict"
_MAX_DEPTH = 24


def _contexts(parent: tuple[str, ...], definition: dict[str, Any]) -> tuple[str, ...]:
    own = definition.get("context") or []
    if not own:
        return parent
    out = list(parent)
    seen = {c.upper() for c in parent}
    for c in own:
        if c.upper() not in seen:
            out.append(c)
            seen.add(c.upper())
    return tuple(out)


def _prop_type(spec: Any) -> str:
    return spec if isinstance(spec, str) else str(spec["type"])


def derive(schema: dict[str, Any]) -> dict[str, Any]:
    """The tables: `contexts` (path -> allowed contexts and functions, sorted)
    and `events` (event -> {filters, types, forms})."""
    defs: dict[str, dict[str, Any]] = schema["definitions"]
    contexts: dict[str, set[str]] = {}

    def walk(
        name: str, path: str, parent: tuple[str, ...], depth: int, seen: frozenset[str]
    ) -> None:
        # A definition inside itself (steps in `parallel` steps) adds no new context.
        if depth > _MAX_DEPTH or (name, path) in _visited or name in seen:
            return
        _visited.add((name, path))
        d = defs.get(name)
        if d is None:  # a built-in type (string, null, any, ...)
            return
        allowed = _contexts(parent, d)
        seen = seen | {name}
        if d.get("context"):
            contexts.setdefault(path, set()).update(allowed)
        for alt in d.get("one-of", []):
            walk(alt, path, allowed, depth + 1, seen)
        m = d.get("mapping")
        if m is not None:
            for key, spec in (m.get("properties") or {}).items():
                walk(_prop_type(spec), f"{path}.{key}" if path else key, allowed, depth + 1, seen)
            if "loose-value-type" in m:
                walk(m["loose-value-type"], f"{path}.*" if path else "*", allowed, depth + 1, seen)
        s = d.get("sequence")
        if s is not None:
            walk(s["item-type"], f"{path}[]", allowed, depth + 1, seen)

    _visited: set[tuple[str, str]] = set()
    walk(_ROOT, "", (), 0, frozenset())

    events: dict[str, dict[str, Any]] = {}
    on_mapping = defs["on-mapping-strict"]["mapping"]["properties"]
    for event, spec in on_mapping.items():
        filters: set[str] = set()
        types: set[str] = set()
        forms: set[str] = set()
        for alt in _alternatives(defs, _prop_type(spec)):
            d = defs.get(alt, {alt: {}})
            if "null" in d:
                forms.add("null")
            if "sequence" in d:
                forms.add("sequence")
            if "mapping" in d:
                forms.add("mapping")
                props = d["mapping"].get("properties") or {}
                filters.update(props)
                if "types" in props:
                    for t in _alternatives(defs, _prop_type(props["types"])):
                        td = defs.get(t, {})
                        if "sequence" in td:
                            for item in _alternatives(defs, td["sequence"]["item-type"]):
                                types.update(defs.get(item, {}).get("allowed-values") or [])
                        types.update(td.get("allowed-values") or [])
        events[event] = {
            "filters": sorted(filters),
            "types": sorted(types),
            "forms": sorted(forms),
        }
    scopes = sorted(defs["permissions-mapping"]["mapping"]["properties"])
    return {
        "contexts": {p: sorted(c) for p, c in sorted(contexts.items())},
        "events": dict(sorted(events.items())),
        "permission_scopes": scopes,
    }


def _alternatives(defs: dict[str, dict[str, Any]], name: str) -> list[str]:
    """A definition and, through `one-of`, every definition it may be."""
    out: list[str] = []
    todo = [name]
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.append(n)
        todo.extend(defs.get(n, {}).get("one-of", []))
    return out


def _q(text: str) -> str:
    return json.dumps(text)


def _tuple(items: list[str], indent: str) -> list[str]:
    """A tuple, one item per line (what `ruff format` keeps as is)."""
    if not items:
        return ["()"]
    if len(items) == 1:
        return [f"({_q(items[0])},)"]
    return ["(", *(f"{indent}    {_q(x)}," for x in items), f"{indent})"]


def render(tables: dict[str, Any]) -> str:
    """The Python source of `schema_tables.py` (already `ruff format`ted)."""
    lines = [
        '"""Tables derived from GitHub\'s workflow schema (workflow-v1.0.json of',
        "@actions/workflow-parser) by `python -m preloop.workflow.schema_gen`.",
        "",
        "Generated: do not edit. tests/test_workflow_schema.py checks that these",
        'equal what the npm package\'s schema gives."""',
        "",
        "from __future__ import annotations",
        "",
        "#: path -> contexts (and special functions, as `name(min,max)`) a value there may use.",
        "CONTEXTS: dict[str, tuple[str, ...]] = {",
    ]
    for path, ctx in tables["contexts"].items():
        t = _tuple(ctx, "    ")
        if len(t) == 1:
            lines.append(f"    {_q(path)}: {t[0]},")
        else:
            lines.append(f"    {_q(path)}: {t[0]}")
            lines.extend(t[1:-1])
            lines.append(f"{t[-1]},")
    lines.append("}")
    lines.append("")
    lines.append("#: event -> (filter keys, activity types, accepted forms of its value).")
    lines.append("EVENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {")
    for event, e in tables["events"].items():
        lines.append(f"    {_q(event)}: (")
        for part in ("filters", "types", "forms"):
            t = _tuple(e[part], "        ")
            if len(t) == 1:
                lines.append(f"        {t[0]},")
            else:
                lines.append(f"        {t[0]}")
                lines.extend(t[1:-1])
                lines.append(f"{t[-1]},")
        lines.append("    ),")
    lines.append("}")
    lines.append("")
    lines.append("#: Every scope `permissions:` may name.")
    lines.append(
        f"PERMISSION_SCOPES: tuple[str, ...] = {_tuple(tables['permission_scopes'], '')[0]}"
    )
    lines.extend(_tuple(tables["permission_scopes"], "")[1:])
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m preloop.workflow.schema_gen path/to/workflow-v1.0.json")
        return 2
    schema = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    sys.stdout.write(render(derive(schema)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
