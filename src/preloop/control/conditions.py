"""Job gates: the aggregate ancestor status, `if:` and deferred matrices.

The scheduler keeps two flags per job row, folded in from its needs as they
end: `anc_fail` (some ancestor failed, continue-on-error aside) and `anc_bad`
(some ancestor did not succeed: failed, skipped or cancelled). From those and
the run's cancel flag `ancestor_status` gives the status the status functions
see: "cancelled", "failure", "skipped" (an ancestor was skipped or cancelled
without a failure: `success()` and `failure()` are both false, as on GitHub
where a skipped need skips its dependents unless `always()`/`!failure()`),
or "success".
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from preloop.workflow.expressions import ExpressionError, evaluate, evaluate_if

__all__ = [
    "MatrixError",
    "ancestor_status",
    "evaluate_expr",
    "expand_matrix_value",
    "should_run",
]

MAX_LEGS = 256


class MatrixError(ValueError):
    """A deferred matrix value that cannot be expanded; the message is the reason."""


def ancestor_status(*, run_cancelled: bool, anc_fail: bool, anc_bad: bool) -> str:
    if run_cancelled:
        return "cancelled"
    if anc_fail:
        return "failure"
    if anc_bad:
        return "skipped"
    return "success"


def should_run(if_expr: str | None, contexts: Mapping[str, Any], status: str) -> bool:
    """GitHub's job `if:` over `status` (see `ancestor_status`). An expression
    that cannot be evaluated does not run the job (GitHub fails it; the
    caller records the reason)."""
    return evaluate_if(if_expr, contexts, status=status)


def evaluate_expr(expr: str, contexts: Mapping[str, Any]) -> Any:
    """Evaluates `expr`, with or without its `${{ }}` wrapper."""
    text = expr.strip()
    if text.startswith("${{") and text.endswith("}}"):
        text = text[3:-2]
    return evaluate(text, contexts)


def expand_matrix_value(value: Any) -> list[dict[str, Any]]:
    """The legs of an evaluated deferred matrix (GitHub's rules: the cartesian
    product of the vectors, then `exclude`, then `include`).

    `preloop.workflow` does not expose `expand_deferred` yet, so the scheduler
    expands the evaluated value here. Raises MatrixError with the reason for a
    value that is not a matrix.
    """
    if isinstance(value, str):
        raise MatrixError(f"the matrix evaluated to the string {value!r}, not an object")
    if not isinstance(value, dict):
        raise MatrixError(f"the matrix evaluated to {type(value).__name__}, not an object")
    include = value.get("include", [])
    exclude = value.get("exclude", [])
    if not isinstance(include, list) or not all(isinstance(i, dict) for i in include):
        raise MatrixError("matrix `include` must be a list of objects")
    if not isinstance(exclude, list) or not all(isinstance(e, dict) for e in exclude):
        raise MatrixError("matrix `exclude` must be a list of objects")
    vectors = {k: v for k, v in value.items() if k not in ("include", "exclude")}
    for key, vec in vectors.items():
        if not isinstance(vec, list):
            raise MatrixError(f"matrix vector `{key}` must be a list")
        if not vec:
            raise MatrixError(f"matrix vector `{key}` is empty")
    legs: list[dict[str, Any]] = []
    if vectors:
        keys = list(vectors)
        for combo in itertools.product(*(vectors[k] for k in keys)):
            legs.append(dict(zip(keys, combo, strict=True)))
    legs = [
        leg
        for leg in legs
        if not any(all(leg.get(k) == v for k, v in ex.items()) for ex in exclude)
    ]
    pairs = [(leg, dict(leg)) for leg in legs]
    extra: list[dict[str, Any]] = []
    for inc in include:
        matched = False
        for leg, orig in pairs:
            # An include extends every leg whose original values it does not overwrite.
            if all(orig.get(k, v) == v for k, v in inc.items() if k in vectors):
                leg.update(inc)
                matched = True
        if not matched:
            extra.append(dict(inc))
    legs += extra
    if len(legs) > MAX_LEGS:
        raise MatrixError(f"the matrix has {len(legs)} legs; GitHub's limit is {MAX_LEGS}")
    return legs


__all__ += ["ExpressionError"]
