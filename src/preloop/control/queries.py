"""The scheduler's named SQL statements, read once from `queries.sql` (the
format of procrastinate's `sql/queries.sql`): `-- name --`, comment lines,
then the statement. `Q["name"]` is the statement's text, with `?`
placeholders for both stores (`preloop.control.db.Tx` rewrites them for
PostgreSQL)."""

from __future__ import annotations

import re
from importlib import resources

__all__ = ["Q", "parse_queries"]

_HEADER = re.compile(r"(?:\n|^)-- ([a-z0-9_]+) --\n(?:--.*\n)*", re.MULTILINE)


def parse_queries(text: str) -> dict[str, str]:
    """The statements of a queries file by name; a name given twice is an error."""
    parts = _HEADER.split(text)
    out: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in out:
            raise ValueError(f"queries.sql: the statement {name!r} is defined twice")
        out[name] = body.strip()
    return out


Q: dict[str, str] = parse_queries(
    resources.files("preloop.control").joinpath("queries.sql").read_text(encoding="utf-8")
)
