"""A called workflow may not ask for more `permissions` than its caller grants.

GitHub refuses a run whose reusable workflow (its workflow-level
`permissions`, or a job's own) requests a scope at a higher level than the
calling job has (the caller job's `permissions`, else its workflow's). When
the caller sets none, its token gets the repository's default policy, which a
local checkout cannot know: nothing is checked then.
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
    """What the jobs of `callee` (and the workflows they call) ask beyond `granted`."""
    allowed = permission_levels(granted)
    if allowed is None:
        return []
    problems: list[str] = []
    wf_level = callee.permissions
    for job in callee.jobs:
        requested = job.permissions if job.permissions is not None else wf_level
        wanted = permission_levels(requested)
        if wanted is not None:
            over = [
                s for s in wanted if _RANK.get(wanted[s], 0) > _RANK.get(allowed.get(s, "none"), 0)
            ]
            if over:
                problems.append(
                    f"the nested job '{job.name or job.id}' is requesting "
                    f"'{_describe(wanted, over)}', but is only allowed '{_describe(allowed, over)}'"
                )
                continue
        if job.callee is not None:
            inner = requested if requested is not None else granted
            problems.extend(permission_problems(job.callee, inner))
    return problems
