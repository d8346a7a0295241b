"""PostgreSQL's server-side functions as the migrations leave them.

Most of them are written in `schema.py` as edits of an earlier version, so
that each migration stays what it was when it shipped; this module adds the
edits up. `python -m preloop.control.functions` lists the functions and
`python -m preloop.control.functions NAME...` prints their text as installed.
"""

from __future__ import annotations

import re
import sys

from preloop.control.schema import MIGRATIONS, Statement, render

__all__ = ["current_functions"]

_CREATE = re.compile(r"\s*CREATE OR REPLACE FUNCTION (\w+)\(")
_DROP = re.compile(r"\s*DROP FUNCTION IF EXISTS (\w+)\(")


def current_functions(migrations: list[list[Statement]] = MIGRATIONS) -> dict[str, str]:
    """Each function `migrations` leave installed, by name: the statement of
    the last migration that creates it (one dropped since is left out)."""
    found: dict[str, str] = {}
    for migration in migrations:
        for statement in migration:
            sql = render(statement, "pg")
            if sql is None:
                continue
            if m := _DROP.match(sql):
                found.pop(m[1], None)
            elif m := _CREATE.match(sql):
                found[m[1]] = sql
    return found


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__.strip())
        return 0
    functions = current_functions()
    if not argv:
        print("\n".join(functions))
        return 0
    unknown = [name for name in argv if name not in functions]
    if unknown:
        print(
            f"preloop: error: no function {', '.join(unknown)}; "
            f"the functions are {', '.join(functions)}",
            file=sys.stderr,
        )
        return 2
    print("\n\n".join(functions[name].strip() + ";" for name in argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
