"""A called workflow may not ask for more `permissions` than its caller grants.

GitHub refuses a run whose reusable workflow (its workflow-level
`permissions`, or a job's own) requests a scope at a higher level than the
calling job has (the caller job's `permissions`, else its workflow's: with
`permissions: {}` at the top of astral-sh/uv's release.yml, its callee's
`contents: read` is refused). When the caller sets none, its token gets the
repository's default policy, which a local checkout cannot know: nothing is
checked then.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from preloop.workflow.model import Workflow
from preloop.workflow.schema_tables import PERMISSION_SCOPES

__all__ = ["SCOPES", "permission_levels", "permission_problems"]

SCOPES = PERMISSION_SCOPES
_RANK = {"none": 0, "read": 1, "write": 2}


def permission_levels(value: Any) -> dict[str, str] | None:
    """`permissions:` as scope -> level (`read-all` expanded; a mapping's
    missing scopes are `none`); None when not set."""
    if value is None:
        return None
    if value == "read-all":
        return dict.fromkeys(SCOPES, "read")
    if value == "write-all":
        return dict.fromkeys(SCOPES, "write")
    out = dict.fromkeys(SCOPES, "none")
    if isinstance(value, Mapping):
        for k, v in value.items():
            out[str(k)] = str(v)
    return out


def _describe(levels: Mapping[str, str], scopes: list[str]) -> str:
    return ", ".join(f"{s}: {levels.get(s, 'none')}" for s in scopes)


def permission_problems(callee: Workflow, granted: Any) -> list[str]:
    """What `callee` (and the workflows it calls) asks beyond `granted`, said
    as GitHub's parser says it: the callee's workflow-level `permissions`
    once (its jobs without their own take those), then each job that sets
    its own, by job id."""
    allowed = permission_levels(granted)
    if allowed is None:
        return []
    problems: list[str] = []

    def check(requested: Any, who: str) -> None:
        wanted = permission_levels(requested)
        if wanted is None:
            return
        over = [s for s in wanted if _RANK.get(wanted[s], 0) > _RANK.get(allowed.get(s, "none"), 0)]
        if over:
            problems.append(
                f"{who} is requesting '{_describe(wanted, over)}', "
                f"but is only allowed '{_describe(allowed, over)}'"
            )

    check(callee.permissions, "the workflow")
    for job in callee.jobs:
        if job.permissions is not None:
            check(job.permissions, f"the nested job '{job.id}'")
        if job.callee is not None:
            inner = job.permissions if job.permissions is not None else callee.permissions
            problems.extend(permission_problems(job.callee, granted if inner is None else inner))
    return problems
