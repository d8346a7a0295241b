"""Reusable workflows at run time: the `inputs` a called workflow's jobs see.

A caller's `with:` may use what is only known once the caller starts (its
`needs.*` outputs); the planner then leaves those inputs pending
(`spec["with_pending"]`). When the caller starts, `start_caller` evaluates
them with the caller's own contexts, types them by the callee's declarations,
and hands them to the caller's direct inner jobs: a runner job's (or deferred
matrix job's) `spec["inputs"]`, a nested caller's `spec["scope_inputs"]`,
and the runs-on labels and display names that only waited for them. From
then on the scheduler's `if:`, `concurrency` and matrix evaluation of those
jobs, the runner's steps and the caller's fold (its `outputs`) all see the
typed inputs (`scoped_inputs`).

Only the rows of the starting caller and its direct inner jobs are read or
written (graph-free).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from preloop.control.db import Row, Tx
from preloop.workflow import expressions as ex
from preloop.workflow.plan import strategy_context
from preloop.workflow.planner import caller_inputs
from preloop.workflow.templates import mapping_items

__all__ = ["callee_inputs", "passed_secrets", "scoped_inputs", "start_caller"]

_KNOWN_AT_START = frozenset({"github", "vars", "inputs", "matrix", "strategy"})


def _spec(tx: Tx, run_id: int, job_id: str) -> dict[str, Any]:
    row = tx.one("SELECT spec FROM jobs WHERE run_id = ? AND id = ?", (run_id, job_id))
    spec = json.loads(row["spec"]) if row is not None else {}
    return spec if isinstance(spec, dict) else {}


def scoped_inputs(tx: Tx, job: Row) -> Any:
    """The `inputs` context of a job inside a reusable workflow (None for a
    top-level job: the run's inputs apply)."""
    if job["caller"] is None:
        return None
    spec = _spec(tx, int(job["run_id"]), job["id"])
    if job["kind"] == "caller":
        return spec.get("scope_inputs")
    if job["kind"] == "deferred":
        return ((spec.get("deferred") or {}).get("contexts") or {}).get("inputs")
    return spec.get("inputs")


def callee_inputs(tx: Tx, caller: Row) -> Any:
    """The `inputs` a caller's callee sees (for its `outputs` at the fold)."""
    return _spec(tx, int(caller["run_id"]), caller["id"]).get("inputs")


def start_caller(tx: Tx, caller: Row, contexts: dict[str, Any]) -> None:
    """Evaluates a starting caller's pending `with:` (see the module doc).
    `contexts` are the caller's job contexts (`needs`, `matrix`, its scope's
    `inputs`, ...). Raises PlanError or ExpressionError with the reason."""
    run_id = int(caller["run_id"])
    spec = _spec(tx, run_id, caller["id"])
    if not spec.get("with_pending"):
        return
    inputs = caller_inputs(spec, contexts)
    spec["inputs"] = inputs
    spec["with_pending"] = []
    tx.execute(
        "UPDATE jobs SET spec = ? WHERE run_id = ? AND id = ?",
        (json.dumps(spec), run_id, caller["id"]),
    )
    rows = tx.execute(
        "SELECT id, kind, name, spec, matrix, strategy FROM jobs WHERE run_id = ? AND caller = ?",
        (run_id, caller["id"]),
    )
    base = {k: v for k, v in contexts.items() if k in ("github", "vars")}
    for row in rows:
        inner = json.loads(row["spec"])
        runs_on: str | None = None
        ctx = {
            **base,
            "inputs": inputs,
            "matrix": json.loads(row["matrix"]) if row["matrix"] else None,
            "strategy": strategy_context(json.loads(row["strategy"]) if row["strategy"] else None),
        }
        name = _name(row["name"], ctx)
        if name is not None:
            tx.execute(
                "UPDATE jobs SET name = ? WHERE run_id = ? AND id = ?", (name, run_id, row["id"])
            )
        if row["kind"] == "caller":
            inner["scope_inputs"] = inputs
        elif row["kind"] == "deferred":
            d = inner.get("deferred") or {}
            d.setdefault("contexts", {})["inputs"] = inputs
            d["available"] = sorted({*d.get("available", ()), "inputs"})
        else:
            inner["inputs"] = inputs
            labels = _labels(inner.get("runs-on"), ctx)
            if labels is not None:
                runs_on = json.dumps(sorted({lb.lower() for lb in labels}))
        if runs_on is None:
            tx.execute(
                "UPDATE jobs SET spec = ? WHERE run_id = ? AND id = ?",
                (json.dumps(inner), run_id, row["id"]),
            )
        else:
            tx.execute(
                "UPDATE jobs SET spec = ?, runs_on = ? WHERE run_id = ? AND id = ?",
                (json.dumps(inner), runs_on, run_id, row["id"]),
            )


def _known_at_start(template: str) -> bool:
    """Whether `template` uses only contexts a starting caller knows."""
    contexts: set[str] = set()
    for expr in ex.expressions_in(template):
        contexts |= ex.parse(expr).contexts
    return contexts <= _KNOWN_AT_START


def _name(name: str, ctx: dict[str, Any]) -> str | None:
    """A display name that waited for the inputs (`build on ${{ inputs.os
    }}`), now evaluated; None when it has no template or one that waits for
    more, or cannot be evaluated (the name as written is kept)."""
    if "${{" not in name:
        return None
    try:
        return ex.interpolate(name, ctx) if _known_at_start(name) else None
    except ex.ExpressionError:
        return None


def _labels(value: Any, ctx: dict[str, Any]) -> list[str] | None:
    """`runs-on` labels that waited for the inputs, now evaluated (None when
    nothing changes: no template, or one that still waits for `needs`)."""
    if isinstance(value, dict):
        value = value.get("labels") or []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not any(isinstance(v, str) and "${{" in v for v in value):
        return None
    labels: list[str] = []
    for v in value:
        if isinstance(v, str) and "${{" in v:
            if not _known_at_start(v):
                return None
            result = ex.evaluate_template(v, ctx)
            items = result if isinstance(result, list) else [result]
            labels.extend(ex.coerce_string(x) for x in items if ex.coerce_string(x))
        elif v is not None:
            labels.append(str(v))
    return labels


def passed_secrets(
    chain: list[dict[str, Any]],
    secrets: dict[str, str],
    caller_context: Callable[[str], dict[str, Any]],
) -> dict[str, str]:
    """The secrets a job inside reusable workflows sees: only what each
    enclosing caller passes on, outermost first (`spec["secrets_chain"]`):
    `secrets: inherit` passes its own, a mapping passes the named values
    (templates over the caller's contexts and its secrets), none passes none.
    `caller_context(caller_id)` gives a caller's job contexts. The job's
    token, `GITHUB_TOKEN`, reaches every called workflow whatever its caller
    passes, as on GitHub."""
    current = dict(secrets)
    token = {"GITHUB_TOKEN": secrets["GITHUB_TOKEN"]} if "GITHUB_TOKEN" in secrets else {}
    for link in chain:
        passed = link.get("secrets")
        if passed == "inherit":
            continue
        if not isinstance(passed, dict) or not passed:
            current = dict(token)
            continue
        ctx = dict(caller_context(str(link["caller"])))
        ctx["secrets"] = {**current, "GITHUB_TOKEN": current.get("GITHUB_TOKEN", "")}

        def evaluate(value: Any, ctx: dict[str, Any] = ctx) -> Any:
            return ex.evaluate_template(value, ctx) if isinstance(value, str) else value

        current = {
            **token,
            **{
                name: ex.coerce_string(value if evaluated else evaluate(value))
                for name, value, evaluated in mapping_items(passed, evaluate)
            },
        }
    return current
