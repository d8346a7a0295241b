"""Job gates: the aggregate ancestor status, `if:` and deferred matrices.

The scheduler keeps two flags per job row, folded in from its needs as they
end: `anc_fail` (some ancestor failed, continue-on-error aside) and `anc_bad`
(some ancestor did not succeed: failed, skipped or cancelled). From those and
the run's cancel flag `ancestor_status` gives the status the status functions
see: "cancelled", "failure", "skipped" (an ancestor was skipped or cancelled
without a failure: `success()` and `failure()` are both false, as on GitHub
where a skipped need skips its dependents unless `always()`/`!failure()`),
or "success".

In a job's `if:`, `success('a', 'b')` and `failure('a')` look at the named
jobs only (each must be one of the job's `needs`, matched case-insensitively
as job ids are): `success` is true when the run is not cancelled and every
named job succeeded, `failure` when the run is not cancelled and one of them
failed, from the results in the job's `needs` context.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from preloop.workflow.expressions import (
    ExpressionError,
    NamedStatus,
    coerce_string,
    evaluate,
    evaluate_if,
)
from preloop.workflow.matrix import MatrixError as WorkflowMatrixError
from preloop.workflow.matrix import expand_matrix
from preloop.workflow.model import Matrix

__all__ = [
    "MatrixError",
    "ancestor_status",
    "evaluate_expr",
    "expand_matrix_value",
    "named_status",
    "should_run",
]


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
    caller records the reason). Status functions naming jobs look at those
    jobs' results in `contexts["needs"]` (see `named_status`)."""
    needs = contexts.get("needs") or {}
    named = named_status(needs, run_cancelled=status == "cancelled")
    return evaluate_if(if_expr, contexts, status=status, named_status=named)


def named_status(needs: Mapping[str, Any], *, run_cancelled: bool) -> NamedStatus:
    """The status `success('a', ...)`/`failure('a', ...)` see in a job's `if:`:
    `ancestor_status` over the named needs' results (a `needs` context)."""
    by_name = {str(k).lower(): v for k, v in needs.items()}

    def status_of(names: Sequence[Any]) -> str:
        results = []
        for name in names:
            need = by_name.get(coerce_string(name).lower())
            if not isinstance(need, Mapping):
                known = ", ".join(repr(k) for k in needs) or "none"
                raise ValueError(
                    f"{coerce_string(name)!r} is not one of this job's needs ({known})"
                )
            results.append(need.get("result"))
        return ancestor_status(
            run_cancelled=run_cancelled,
            anc_fail=any(r == "failure" for r in results),
            anc_bad=any(r != "success" for r in results),
        )

    return status_of


def evaluate_expr(expr: str, contexts: Mapping[str, Any]) -> Any:
    """Evaluates `expr`, with or without its `${{ }}` wrapper."""
    text = expr.strip()
    if text.startswith("${{") and text.endswith("}}"):
        text = text[3:-2]
    return evaluate(text, contexts)


def expand_matrix_value(value: Any) -> list[dict[str, Any]]:
    """The legs of an evaluated deferred matrix, for a plan built by hand with
    only `deferred_matrix` (plans from `preloop.workflow.plan` go through
    `expand_deferred`). Checks the value's shape, then expands it with
    `preloop.workflow.expand_matrix` (GitHub's rules and 256-leg limit).
    Raises MatrixError with the reason."""
    if not isinstance(value, dict):
        kind = "the string " + repr(value) if isinstance(value, str) else type(value).__name__
        raise MatrixError(f"the matrix evaluated to {kind}, not an object")
    include = value.get("include", [])
    exclude = value.get("exclude", [])
    if not isinstance(include, list) or not all(isinstance(i, dict) for i in include):
        raise MatrixError("matrix `include` must be a list of objects")
    if not isinstance(exclude, list) or not all(isinstance(e, dict) for e in exclude):
        raise MatrixError("matrix `exclude` must be a list of objects")
    vectors = []
    for key, vec in value.items():
        if key in ("include", "exclude"):
            continue
        if not isinstance(vec, list):
            raise MatrixError(f"matrix vector `{key}` must be a list")
        vectors.append((key, tuple(vec)))
    matrix = Matrix(vectors=tuple(vectors), include=tuple(include), exclude=tuple(exclude))
    try:
        return expand_matrix(matrix, allow_empty=True)
    except WorkflowMatrixError as exc:
        raise MatrixError(str(exc)) from None


__all__ += ["ExpressionError"]
