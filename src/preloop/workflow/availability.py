"""Which contexts and special functions a value may use, by where it sits.

The answer comes from GitHub's workflow schema through the generated
`schema_tables.CONTEXTS` (see `schema_gen`): a path such as
`jobs.*.environment.url` gets the set of the longest table path that is a
prefix of it (contexts accumulate downwards, as in GitHub's reader). A path
with no table entry above it allows no expression at all.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from types import MappingProxyType

from preloop.workflow.schema_tables import CONTEXTS, EVENTS

__all__ = ["EVENTS", "allowed_at", "expression_keys_allowed"]

_FUNCTION = re.compile(r"([A-Za-z]+)\(\d+,(\d+|MAX)\)")


@functools.lru_cache(maxsize=512)
def allowed_at(path: str) -> tuple[frozenset[str], Mapping[str, int]]:
    """(contexts, special functions in lower case -> most arguments) allowed
    at `path`."""
    probe = path
    while True:
        entry = CONTEXTS.get(probe)
        if entry is not None:
            break
        cut = max(probe.rfind("."), probe.rfind("["))
        if cut <= 0:
            return frozenset(), MappingProxyType({})
        probe = probe[:cut]
    contexts: set[str] = set()
    functions: dict[str, int] = {}
    for item in entry:
        m = _FUNCTION.fullmatch(item)
        if m:
            functions[m.group(1).lower()] = 2**53 if m.group(2) == "MAX" else int(m.group(2))
        else:
            contexts.add(item)
    return frozenset(contexts), MappingProxyType(functions)


def expression_keys_allowed(path: str) -> bool:
    """Whether the mapping at `path` may have `${{ insert }}` or expression
    keys: GitHub's reader allows them exactly where the mapping's definition
    (with those above it) makes some context available."""
    contexts, functions = allowed_at(path)
    return bool(contexts or functions)


def _prefixes() -> frozenset[str]:
    out: set[str] = set()
    for path in CONTEXTS:
        for i, ch in enumerate(path):
            if ch in ".[":
                out.add(path[:i])
        out.add(path)
    return frozenset(out)


_PREFIXES = _prefixes()


def child(path: str, key: str) -> str:
    """The table path of mapping key `key` under `path`: the key itself where
    the schema names it (`credentials`), `*` where the mapping's keys are free
    (`env.*`, `services.*`)."""
    named = f"{path}.{key}"
    if named in _PREFIXES:
        return named
    loose = f"{path}.*"
    return loose if loose in _PREFIXES else named
