"""The names GitHub's workflow parser gives steps (`github.action`,
`GITHUB_ACTION`): WorkflowTemplateConverter's generated ids (IdBuilder)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["step_action_names"]

_ACTION_ID_CHAR = re.compile(r"[^A-Za-z0-9_-]")


def step_action_names(steps: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each step's `github.action` (GITHUB_ACTION), as GitHub's workflow
    parser names them (WorkflowTemplateConverter, IdBuilder): its `id`, else
    `__run` for a script, `__owner_repo` for `owner/repo[/path]@ref`,
    `__self` for `./path`, `__image` for `docker://image`, characters other
    than letters, digits, `_` and `-` made `_`; a name already taken (an
    `id`, an earlier default) gets `_2`, `_3`..."""
    taken = {str(step["id"]) for step in steps if step.get("id")}
    names = []
    for step in steps:
        if step.get("id"):
            names.append(str(step["id"]))
            continue
        uses = str(step.get("uses") or "")
        kind = ""
        if uses.startswith("docker://"):
            kind = uses.removeprefix("docker://")
        elif uses.startswith(("./", ".\\")):
            kind = "self"
        elif uses:
            path, at, ref = uses.partition("@")
            parts = [p for p in re.split(r"[/\\]", path) if p]
            if at and ref and len(parts) >= 2 and "@" not in ref:
                kind = f"{parts[0]}/{parts[1]}"
        base = "__" + _ACTION_ID_CHAR.sub("_", kind or "run")
        name, attempt = base, 1
        while name in taken:
            attempt += 1
            name = f"{base}_{attempt}"
        taken.add(name)
        names.append(name)
    return names
