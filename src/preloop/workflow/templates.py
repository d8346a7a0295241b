"""GitHub's template features inside mappings and sequences.

- `${{ insert }}` as a mapping key: its value (an expression evaluating to a
  mapping) is merged into the mapping where the key stands
  (`env: {${{ insert }}: ${{ fromJSON(needs.a.outputs.env) }}}`).
- A mapping key may itself be an expression (`${{ inputs.axis }}: [a, b]` in
  a matrix): it is evaluated with the values.
- In a matrix vector, an item that is one expression evaluating to an array
  is spliced into the vector (`os: [linux, "${{ fromJSON(inputs.more) }}"]`).

`evaluate_data` applies all three to plain data (a matrix as written);
`mapping_items` gives the items of an `env`-like mapping with insertions
expanded, for callers that evaluate values one by one; `overlay` joins two
such mappings (workflow `env` under job `env`) keeping both's insertions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from preloop.workflow import expressions as ex

__all__ = [
    "WHOLE",
    "evaluate_data",
    "is_insert",
    "mapping_items",
    "overlay",
    "template_contexts",
]

_INSERT = re.compile(r"\$\{\{\s*insert\s*\}\}")
#: The key the loader gives a mapping written as one expression (`env: ${{ x }}`).
WHOLE = "${{}}"


def is_insert(key: Any) -> bool:
    """Whether `key` is the `${{ insert }}` directive."""
    return isinstance(key, str) and _INSERT.fullmatch(key.strip()) is not None


def _lone_expression(value: Any) -> bool:
    if not isinstance(value, str) or "${{" not in value:
        return False
    try:
        segs = ex.template_segments(value.strip())
    except ex.ExpressionError:
        return False
    return len(segs) == 1 and segs[0][0]


def template_contexts(value: Any) -> frozenset[str]:
    """The contexts the `${{ }}` inside plain data name (keys included)."""
    out: set[str] = set()
    if isinstance(value, str):
        if "${{" in value and not ("insert" in value and is_insert(value)):
            for expr in ex.expressions_in(value):
                out |= ex.parse(expr).contexts
    elif isinstance(value, Mapping):
        for k, v in value.items():
            out |= template_contexts(k)
            out |= template_contexts(v)
    elif isinstance(value, list | tuple):
        for v in value:
            out |= template_contexts(v)
    return frozenset(out)


def evaluate_data(value: Any, ctx: Mapping[str, Any], *, splice: bool = False) -> Any:
    """Evaluates every template inside plain data (a lone `${{ }}` keeps its
    type); mapping keys and `${{ insert }}` included. With `splice`, a
    sequence item that is one expression evaluating to an array is spliced
    (matrix vectors)."""
    if isinstance(value, str):
        return ex.evaluate_template(value, ctx) if "${{" in value else value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if is_insert(k):
                inserted = evaluate_data(v, ctx)
                if not isinstance(inserted, Mapping):
                    raise ex.ExpressionError(
                        f"`${{{{ insert }}}}` needs a mapping, not {ex.to_json(inserted)}",
                        str(v),
                        1,
                        1,
                    )
                out.update(inserted)
                continue
            key = ex.coerce_string(evaluate_data(k, ctx)) if "${{" in str(k) else str(k)
            splice_items = splice and key not in ("include", "exclude")
            out[key] = evaluate_data(v, ctx, splice=splice_items)
        return out
    if isinstance(value, list | tuple):
        items: list[Any] = []
        for v in value:
            result = evaluate_data(v, ctx)
            if splice and _lone_expression(v) and isinstance(result, list):
                items.extend(result)
            else:
                items.append(result)
        return items
    return value


def mapping_items(
    mapping: Mapping[str, Any], evaluate: Callable[[Any], Any]
) -> Iterator[tuple[str, Any, bool]]:
    """(key, value, evaluated) for each entry: an insertion (or a mapping
    written as one expression, key `WHOLE`) is evaluated with `evaluate` and
    its entries given with `evaluated` True; other values are left to the
    caller (evaluated False), in order, so that later values may see earlier
    ones."""
    for key, value in mapping.items():
        if is_insert(key) or key == WHOLE:
            result = evaluate(value)
            if not isinstance(result, Mapping):
                raise ex.ExpressionError(
                    f"expected a mapping, not {ex.to_json(result)}", str(value), 1, 1
                )
            for k, v in result.items():
                yield str(k), v, True
        elif isinstance(key, str) and "${{" in key:
            yield ex.coerce_string(evaluate(key)), value, False
        else:
            yield key, value, False


def overlay(outer: Mapping[str, Any], inner: Mapping[str, Any]) -> dict[str, Any]:
    """`outer` then `inner` as one mapping for `mapping_items`: every
    insertion of both is kept (a second one under a distinct spelling of the
    directive), and each of `inner`'s entries comes after all of `outer`'s,
    so that it wins over a name `outer` inserts."""
    out: dict[str, Any] = {}
    for mapping in (outer, inner):
        for key, value in mapping.items():
            if (is_insert(key) or key == WHOLE) and key in out:
                key = "${{ insert }}"
                while key in out:
                    key += " "
            else:
                out.pop(key, None)
            out[key] = value
    return out
