"""Matrix expansion with GitHub's rules (docs: "Running variations of jobs in a
workflow").

1. The vectors' cartesian product, the first vector varying slowest.
2. `exclude`: a combination is removed when it matches an entry: every leaf
   of the entry (nested mappings and lists walked) equals the combination's
   value at that path, by the expression language's `==` (see `_matches`).
3. `include`, after exclude: an entry is merged into every combination its
   vector keys match (the same comparison); values added by an earlier
   include may be overwritten. An entry that fits no combination is appended
   as a new one (and later entries are not merged into it), its vector keys
   first.
4. At most 256 legs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from preloop.errors import PreloopError
from preloop.workflow.expressions import coerce_string, index_value, loose_equals
from preloop.workflow.model import Matrix, frozen_map, thaw

__all__ = [
    "MAX_JOB_NAME",
    "MAX_MATRIX_LEGS",
    "Leg",
    "MatrixError",
    "default_job_name",
    "expand_legs",
    "expand_matrix",
    "leg_suffix",
    "matrix_from_data",
    "max_parallel_limit",
]

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


@dataclass(frozen=True, slots=True)
class Leg:
    """One leg: `values` (its `matrix` context) and `named`, the values GitHub
    names it by: a combination's vector values only (what an `include` adds is
    not in the name: pytest-dev/pytest's test.yml legs are `build
    (ubuntu-py312)`); for an `include` entry that fits no combination, all of
    the entry's values, its vector keys first."""

    values: dict[str, Any]
    named: dict[str, Any]


def expand_matrix(matrix: Matrix, *, allow_empty: bool = False) -> list[dict[str, Any]]:
    """The matrix's combinations, in GitHub's order (see `expand_legs`)."""
    return [leg.values for leg in expand_legs(matrix, allow_empty=allow_empty)]


def expand_legs(matrix: Matrix, *, allow_empty: bool = False) -> list[Leg]:
    """The matrix's legs, in GitHub's order.

    Raises MatrixError for a vector without values, an empty `exclude` entry
    or one with a key that is not a vector's, more than 256 legs, or (unless
    `allow_empty`) no legs.
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

    # GitHub's checks of an `exclude` entry (its MatrixBuilder): not empty, and
    # only the vectors' keys. One that matches no combination is fine: the
    # values may come from expressions (microsoft/playwright's tests_bidi.yml
    # excludes `isPullRequest: true`, a vector of `github.event_name ==
    # 'pull_request'`, and runs on schedule too).
    vector_keys = [k for k, _ in matrix.vectors]
    for i, entry in enumerate(matrix.exclude):
        if not entry:
            raise MatrixError("a matrix `exclude` entry must not be empty", ("exclude", i))
        unknown = [k for k in entry if k not in vector_keys]
        if unknown:
            raise MatrixError(
                f"matrix `exclude` key '{unknown[0]}' is not one of the matrix's vectors "
                f"({', '.join(vector_keys) or 'none'})",
                ("exclude", i),
            )
    if matrix.exclude:
        excludes = [thaw(e) for e in matrix.exclude]
        combos = [c for c in combos if not any(_matches(c, e) for e in excludes)]

    legs = [Leg(c, dict(c)) for c in combos]
    base = {k for k, _ in matrix.vectors}
    extra: list[Leg] = []
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
            # GitHub's GetUnmatchedVectors builds the new leg from the entry's
            # filter (its vector keys) and then its extra keys, each in the
            # entry's order; the leg's name and `matrix` follow that order.
            fresh = {**original, **added}
            extra.append(Leg(fresh, dict(fresh)))
    legs.extend(extra)
    if len(legs) > MAX_MATRIX_LEGS:
        raise MatrixError(
            f"the matrix expands to {len(legs)} legs; at most {MAX_MATRIX_LEGS} are allowed"
        )
    if not legs and not allow_empty:
        raise MatrixError("the matrix has no combinations left after `exclude`")
    return legs


def max_parallel_limit(n: float) -> int | None:
    """The cap a finite `max-parallel` number sets, None for no cap. GitHub's
    parser casts the number to a 32-bit integer (truncating: 1.5 caps at 1)
    and caps only when that is positive: 0 or less runs every leg at once
    (nodejs/undici's ci.yml says `max-parallel: 0`); so does a number past
    the 32-bit range (saturated or wrapped, never a smaller cap)."""
    capped = int(n)
    return capped if 0 < capped < 2**31 else None


def _matches(combo: Mapping[str, Any], entry: Mapping[str, Any]) -> bool:
    """Whether `combo` passes the filter `entry`, as GitHub's MatrixFilter
    decides for both `include` and `exclude`: one expression per leaf of the
    entry, `matrix['cfg']['node'] == 12`, all truthy. So the expression
    language's coercion applies (`py: 3.10`, the number 3.1, matches '3.10';
    'Ubuntu-Latest' matches 'ubuntu-latest'), nested values match leaf by leaf
    (a subset of a mapping matches), and an empty mapping or list is no
    constraint at all."""

    def leaves(value: Any, at: Any) -> bool:
        if isinstance(value, Mapping):
            return all(leaves(v, index_value(at, k)) for k, v in value.items())
        if isinstance(value, list | tuple):
            return all(leaves(v, index_value(at, i)) for i, v in enumerate(value))
        return loose_equals(at, value)

    return leaves(entry, combo)


#: GitHub shortens a job's default display name to this many characters.
MAX_JOB_NAME = 100


def leg_suffix(values: Mapping[str, Any]) -> str:
    """The ` (v1, v2)` part of a leg's display name, as GitHub's JobNameBuilder
    makes it: every string, number and boolean in the leg's values, depth
    first (an object's or a list's too: astral-sh/ruff's `platform: {target:
    ..., arch: ...}` legs are `windows (x86_64-pc-windows-msvc, x64)`), empty
    strings and nulls left out; '' when nothing is left."""
    parts: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, Mapping):
            for item in v.values():
                walk(item)
        elif isinstance(v, list | tuple):
            for item in v:
                walk(item)
        elif isinstance(v, str | int | float) and v != "":
            parts.append(coerce_string(v))

    for v in values.values():
        walk(v)
    return f" ({', '.join(parts)})" if parts else ""


def default_job_name(name: str) -> str:
    """A job's default display name (its `name`, else its id, and a leg's
    values), shortened as GitHub does past MAX_JOB_NAME characters."""
    if len(name) <= MAX_JOB_NAME:
        return name
    return name[: MAX_JOB_NAME - 3] + "..."
