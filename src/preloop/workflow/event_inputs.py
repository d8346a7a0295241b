"""`--input NAME=VALUE` checked against a workflow's declared inputs, and the
event payload (`github.event`) of a local run.

`check_inputs(workflow, event, given)` types and checks dispatch inputs as
GitHub's "Run workflow" form does: an undeclared name, a value that is not
one of a `choice` input's `options`, a boolean other than true/false, a number
that is not a number, or a required input without value or default is a
`UsageError` naming the workflow and the input. The result is the `inputs`
context (declared defaults filled in, booleans and numbers typed).

`load_payload(path)` reads `--eventpath FILE` (a JSON object); `default_payload`
builds what GitHub would send from the repository: `ref`, `before`/`after`,
`head_commit`, `commits`, `repository`, `sender`, and for pull requests
`number`, `pull_request.head/base` (`ref`, `sha`), so `github.event.*`
expressions that workflows commonly read have values.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from preloop.errors import UsageError
from preloop.workflow import expressions as ex
from preloop.workflow.model import Workflow

if TYPE_CHECKING:
    from preloop.workflow.changes import LocalEvent

__all__ = [
    "check_inputs",
    "default_action",
    "default_payload",
    "load_payload",
    "local_event_payload",
    "parse_pairs",
    "split_pairs",
]

_ZERO = "0" * 40

# The activity of the default payload: a push to a pull request's branch.
_DEFAULT_ACTIONS = {"pull_request": "synchronize", "pull_request_target": "synchronize"}


def default_action(event: str) -> str | None:
    """The activity type (`github.event.action`) of `event`'s default payload,
    which `on.<event>.types` filters are checked against (None: the event has
    no activity types, or its default payload names none)."""
    return _DEFAULT_ACTIONS.get(event)


def split_pairs(option: str, pairs: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """`NAME=VALUE` items of a repeatable option, in order, names repeated."""
    out: list[tuple[str, str]] = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"{option} {pair!r}: expected NAME=VALUE")
        out.append((name.strip(), value))
    return out


def parse_pairs(option: str, pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`NAME=VALUE` items of a repeatable option (a name given twice: the last)."""
    return dict(split_pairs(option, pairs))


def _declared(workflow: Workflow, event: str) -> Mapping[str, Mapping[str, Any]] | None:
    if event == "workflow_dispatch":
        return workflow.workflow_dispatch_inputs
    if event == "workflow_call" and workflow.workflow_call is not None:
        return workflow.workflow_call.inputs
    return None


def check_inputs(workflow: Workflow, event: str, given: Mapping[str, str]) -> dict[str, Any]:
    """The typed `inputs` context for `event`, or a UsageError naming the problem."""
    declared = _declared(workflow, event)
    where = workflow.path
    if declared is None:
        if given:
            names = ", ".join(sorted(given))
            raise UsageError(f"{where}: --input {names}: event {event!r} takes no inputs")
        return {}
    unknown = sorted(set(given) - set(declared))
    if unknown:
        known = ", ".join(sorted(declared)) or "none"
        raise UsageError(f"{where}: --input {unknown[0]}: no such input (declared inputs: {known})")
    out: dict[str, Any] = {}
    for name, spec in declared.items():
        spec = spec or {}
        kind = str(spec.get("type") or "string")
        if name in given:
            out[name] = _typed(where, name, kind, spec, given[name])
        elif spec.get("default") is not None:
            out[name] = _typed(where, name, kind, spec, spec["default"])
        elif spec.get("required") is True:
            hint = f" (one of: {', '.join(map(str, spec['options']))})" if "options" in spec else ""
            raise UsageError(
                f"{where}: input {name!r} is required: pass --input {name}=VALUE{hint}"
            )
        elif kind == "boolean":
            out[name] = False
        else:
            out[name] = ""
    return out


def _typed(where: str, name: str, kind: str, spec: Mapping[str, Any], value: Any) -> Any:
    if kind == "boolean":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text not in ("true", "false"):
            raise UsageError(f"{where}: input {name!r} is a boolean: {value!r} is not true/false")
        return text == "true"
    if kind == "number":
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value
        n = ex.string_to_number(str(value))
        if n != n or str(value).strip() == "":  # NaN: not a number
            raise UsageError(f"{where}: input {name!r} is a number: {value!r} is not a number")
        return int(n) if n.is_integer() else n
    if kind == "choice":
        options = [str(o) for o in spec.get("options") or ()]
        if str(value) not in options:
            raise UsageError(
                f"{where}: input {name!r}: {value!r} is not one of its options "
                f"({', '.join(options)})"
            )
    return str(value) if not isinstance(value, str) else value


def load_payload(path: Path) -> dict[str, Any]:
    """The JSON object of `--eventpath FILE`."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"--eventpath {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"--eventpath {path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--eventpath {path}: the payload must be a JSON object")
    return data


def _git(root: Path, *args: str) -> str:
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def local_event_payload(
    root: Path,
    event: str,
    github: Mapping[str, Any],
    local: LocalEvent,
    default_ref: str,
    *,
    inputs: Mapping[str, Any] | None = None,
    before: str | None = None,
) -> dict[str, Any]:
    """The default payload of `event` as `preloop run` and `preloop plan`
    build it from the local event's facts: a push's `before` is the old
    remote commit when known (`before`: None for a new ref, all zeros in
    git's pre-push input), else the merge base changes count from."""
    base_sha = local.merge_base
    if event == "push" and before is not None:
        base_sha = None if before.strip("0") == "" else before
    return default_payload(
        root,
        event,
        github=github,
        head_ref=local.head_ref,
        base_sha=base_sha,
        base_ref=local.facts.ref if event.startswith("pull_request") else None,
        inputs=inputs,
        default_branch=default_ref,
    )


def default_payload(
    root: Path,
    event: str,
    *,
    github: Mapping[str, Any],
    head_ref: str | None,
    base_sha: str | None,
    base_ref: str | None = None,
    inputs: Mapping[str, Any] | None = None,
    default_branch: str | None = None,
) -> dict[str, Any]:
    """A payload for `event` built from the repository at `root`;
    `default_branch` (a ref) is its `repository.default_branch`."""
    repo_full = str(github.get("repository") or root.name)
    owner = str(github.get("repository_owner") or repo_full.split("/")[0])
    actor = str(github.get("actor") or os.environ.get("USER", "preloop"))
    repository = {
        "name": repo_full.split("/")[-1],
        "full_name": repo_full,
        "owner": {"login": owner, "name": owner},
        "fork": False,
        "private": False,
        "html_url": f"https://github.com/{repo_full}",
        "default_branch": (default_branch or base_ref or "refs/heads/main").removeprefix(
            "refs/heads/"
        ),
    }
    sender = {"login": actor}
    head = _git(root, "rev-parse", "--verify", "-q", "HEAD")
    head_commit: dict[str, Any] | None = None
    if head:
        fmt = "%H%x00%s%x00%B%x00%an%x00%ae%x00%cn%x00%ce%x00%cI%x00%T"
        parts = _git(root, "show", "-s", f"--format={fmt}", "HEAD").split("\0")
        if len(parts) >= 9:
            head_commit = {
                "id": parts[0],
                "tree_id": parts[8],
                "message": parts[2].strip() or parts[1],
                "timestamp": parts[7],
                "author": {"name": parts[3], "email": parts[4], "username": parts[3]},
                "committer": {"name": parts[5], "email": parts[6], "username": parts[5]},
                "distinct": True,
            }
    payload: dict[str, Any] = {"repository": repository, "sender": sender}
    if event == "push":
        payload.update(
            ref=head_ref or "",
            before=base_sha or _ZERO,
            after=head or _ZERO,
            created=base_sha is None,
            deleted=False,
            forced=False,
            base_ref=None,
            compare="",
            head_commit=head_commit,
            commits=[head_commit] if head_commit else [],
            pusher={"name": actor},
        )
    elif event in ("pull_request", "pull_request_target"):
        head_name = (head_ref or "").removeprefix("refs/heads/")
        base_name = (base_ref or "refs/heads/main").removeprefix("refs/heads/")
        payload.update(
            action=default_action(event),
            number=1,
            pull_request={
                "number": 1,
                "title": head_commit["message"].splitlines()[0] if head_commit else "",
                "state": "open",
                "draft": False,
                "merged": False,
                "user": sender,
                "html_url": f"{repository['html_url']}/pull/1",
                # `owner:branch`, as codecov-action reads them.
                "head": {
                    "label": f"{owner}:{head_name}",
                    "ref": head_name,
                    "sha": head or _ZERO,
                    "repo": repository,
                    "user": {"login": owner},
                },
                "base": {
                    "label": f"{owner}:{base_name}",
                    "ref": base_name,
                    "sha": base_sha or _ZERO,
                    "repo": repository,
                    "user": {"login": owner},
                },
                "labels": [],
            },
        )
    elif event == "workflow_dispatch":
        payload.update(ref=head_ref or "", inputs=dict(inputs or {}))
    return payload
