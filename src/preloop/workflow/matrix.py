"""Matrix expansion with GitHub's rules (docs: "Running variations of jobs in a
workflow").

1. The vectors' cartesian product, the first vector varying slowest.
2. `exclude`: a combination is removed when it matches an entry partially
   (every key of the entry has the entry's value).
3. `include`, after exclude: an entry is merged into every combination whose
   *original* (vector) values it does not overwrite; values added by an
   earlier include may be overwritten. An entry that fits no combination is
   appended as a new one (and later entries are not merged into it).
4. At most 256 legs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from preloop.errors import PreloopError
from preloop.workflow.model import Matrix, frozen_map, thaw

__all__ = ["MAX_MATRIX_LEGS", "MatrixError", "expand_matrix", "leg_suffix", "matrix_from_data"]

MAX_MATRIX_LEGS = 256
# Refuse to materialise an absurd product before exclude can shrink it.
_MAX_PRODUCT = 65536


class MatrixError(PreloopError):
    """A matrix that cannot be expanded. `where` locates the problem inside
    the matrix: ("matrix",), ("vector", key), ("exclude", i) or ("include", i)."""

    def __init__(self, message: str, where: tuple[Any, ...] = ("matrix",)) -> None:
        super().__init__(message)
        self.where = where


def matrix_from_data(data: Any) -> Matrix:
    """A Matrix from plain data (an evaluated `${{ fromJSON(...) }}`)."""
    if not isinstance(data, Mapping):
        raise MatrixError(f"a matrix must be a mapping, not {_kind(data)}")
    vectors: list[tuple[str, tuple[Any, ...]]] = []
    include: tuple[Mapping[str, Any], ...] = ()
    exclude: tuple[Mapping[str, Any], ...] = ()
    for key, value in data.items():
        if key in ("include", "exclude"):
            if not isinstance(value, list | tuple) or not all(
                isinstance(e, Mapping) for e in value
            ):
                raise MatrixError(f"matrix `{key}` must be a list of mappings", (key,))
            entries = tuple(frozen_map(e) for e in value)
            if key == "include":
                include = entries
            else:
                exclude = entries
        elif isinstance(value, list | tuple):
            vectors.append((str(key), tuple(thaw(v) for v in value)))
        else:
            raise MatrixError(
                f"matrix vector '{key}' must be a list of values, not {_kind(value)}",
                ("vector", key),
            )
    return Matrix(vectors=tuple(vectors), include=include, exclude=exclude)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, Mapping):
        return "a mapping"
    return "a list"


@dataclass(slots=True)
class _Combo:
    values: dict[str, Any]


def expand_matrix(matrix: Matrix, *, allow_empty: bool = False) -> list[dict[str, Any]]:
    """The matrix's combinations, in GitHub's order.

    Raises MatrixError for a vector without values, an `exclude` entry that
    matches nothing, more than 256 legs, or (unless `allow_empty`) no legs.
    """
    if not matrix.vectors and not matrix.include:
        if allow_empty:
            return []
        raise MatrixError("a matrix needs at least one vector or an `include` list")
    product = 1
    for key, values in matrix.vectors:
        if not values:
            raise MatrixError(f"matrix vector '{key}' has no values", ("vector", key))
        product *= len(values)
    if product > _MAX_PRODUCT:
        raise MatrixError(
            f"the matrix has {product} combinations before `exclude`; "
            f"at most {MAX_MATRIX_LEGS} legs are allowed"
        )
    combos: list[dict[str, Any]] = [{}] if matrix.vectors else []
    for key, values in matrix.vectors:
        combos = [{**c, key: thaw(v)} for c in combos for v in values]

    for i, entry in enumerate(matrix.exclude):
        plain = thaw(entry)
        if not any(_matches(c, plain) for c in combos):
            raise MatrixError(
                f"matrix `exclude` entry {_show(plain)} matches no combination", ("exclude", i)
            )
    if matrix.exclude:
        excludes = [thaw(e) for e in matrix.exclude]
        combos = [c for c in combos if not any(_matches(c, e) for e in excludes)]

    base = {k for k, _ in matrix.vectors}
    extra: list[dict[str, Any]] = []
    for entry in matrix.include:
        plain = thaw(entry)
        original = {k: v for k, v in plain.items() if k in base}
        added = {k: v for k, v in plain.items() if k not in base}
        merged = False
        for c in combos:
            if _matches(c, original):
                c.update(added)
                merged = True
        if not merged:
            extra.append(dict(plain))
    combos.extend(extra)
    if len(combos) > MAX_MATRIX_LEGS:
        raise MatrixError(
            f"the matrix expands to {len(combos)} legs; at most {MAX_MATRIX_LEGS} are allowed"
        )
    if not combos and not allow_empty:
        raise MatrixError("the matrix has no combinations left after `exclude`")
    return combos


def _matches(combo: Mapping[str, Any], entry: Mapping[str, Any]) -> bool:
    return all(k in combo and combo[k] == v for k, v in entry.items())


def _show(v: Any) -> str:
    return json.dumps(v, separators=(", ", ": "), sort_keys=False, default=str)


def leg_suffix(values: Mapping[str, Any]) -> str:
    """The `(v1, v2)` part of a leg's display name: values in matrix order."""
    parts = []
    for v in values.values():
        if isinstance(v, str):
            parts.append(v)
        elif v is None:
            parts.append("")
        elif isinstance(v, bool):
            parts.append("true" if v else "false")
        elif isinstance(v, int | float):
            from preloop.workflow.expressions import coerce_string

            parts.append(coerce_string(v))
        else:
            parts.append(json.dumps(thaw(v), separators=(",", ":")))
    return "(" + ", ".join(parts) + ")"
