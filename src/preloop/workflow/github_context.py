"""The `github` context a local run sees, read from the repository's git state.

GitHub fills `github.*` from the event; locally the nearest equivalents come
from git: `sha` (HEAD), `ref` / `ref_name` / `ref_type` (the checked-out
branch, else a tag at HEAD), `repository` / `repository_owner` (from the
`origin` remote when it is a GitHub-style URL) and `workspace` (the root).
Anything git cannot tell is left out (and reads as null in expressions).

`event_github_context` is a run's context for an event (`preloop run` and
`preloop plan` alike: a pull request's merge ref, head and base branches);
`default_branch_ref` the repository's default branch.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from preloop.workflow.changes import LocalEvent

__all__ = [
    "default_branch_ref",
    "event_github_context",
    "local_github_context",
    "workflow_github_context",
]

_REMOTE = re.compile(r"(?:[:/])([^/:]+)/([^/]+?)(?:\.git)?/?$")


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = proc.stdout.strip()
    return out if proc.returncode == 0 and out else None


def local_github_context(root: str | Path) -> dict[str, Any]:
    """`github.*` values for a run of the repository at `root`."""
    root = Path(root)
    ctx: dict[str, Any] = {"workspace": str(root.resolve())}
    sha = _git(root, "rev-parse", "--verify", "-q", "HEAD")
    if sha is None:
        return ctx
    ctx["sha"] = sha
    branch = _git(root, "symbolic-ref", "-q", "HEAD")
    if branch is not None:
        ctx.update(ref=branch, ref_name=branch.removeprefix("refs/heads/"), ref_type="branch")
    else:
        tag = _git(root, "describe", "--tags", "--exact-match", "HEAD")
        if tag is not None:
            ctx.update(ref=f"refs/tags/{tag}", ref_name=tag, ref_type="tag")
    url = _git(root, "remote", "get-url", "origin")
    # A host's URL (`https://host/o/r`, `git@host:o/r`), not a local path or
    # `file://` clone, whose last two directories name no repository.
    hosted = url is not None and not url.startswith(("/", ".", "~", "file:"))
    m = _REMOTE.search(url) if url and hosted else None
    if m:
        ctx.update(repository=f"{m.group(1)}/{m.group(2)}", repository_owner=m.group(1))
    return ctx


def event_github_context(root: Path, event: str, local: LocalEvent) -> dict[str, Any]:
    """A run's `github` context for `event` (`preloop run`, and what
    `preloop plan` shows): the repository's, with the event's refs (a pull
    request's `refs/pull/1/merge`, `head_ref`, `base_ref`)."""
    gh = {k: v for k, v in local_github_context(root).items() if k != "workspace"}
    # Always `owner/name` as on GitHub: @actions/github's `context.repo`
    # throws on a name without an owner (a repository with no GitHub origin).
    gh.setdefault("repository", f"local/{root.name}")
    gh.setdefault("repository_owner", str(gh["repository"]).split("/", 1)[0])
    gh.setdefault("actor", os.environ.get("USER", "preloop"))
    for key in ("ref", "ref_name", "ref_type"):
        gh.pop(key, None)
    head = local.head_ref
    if event.startswith("pull_request"):
        base = (local.facts.ref or "").removeprefix("refs/heads/")
        gh.update(
            ref="refs/pull/1/merge",
            ref_name="1/merge",
            ref_type="branch",
            head_ref=(head or "").removeprefix("refs/heads/"),
            base_ref=base,
        )
    elif head:
        is_tag = head.startswith("refs/tags/")
        gh.update(
            ref=head,
            ref_name=head.removeprefix("refs/tags/" if is_tag else "refs/heads/"),
            ref_type="tag" if is_tag else "branch",
        )
    return gh


def workflow_github_context(
    github: Mapping[str, Any], root: Path, path: str | Path, sha: str | None = None
) -> dict[str, Any]:
    """`github` for a run of the workflow file `path` (under `root`), with
    what GitHub says of that file: `workflow_ref`, `owner/repo/<path>@<ref>`
    (a concurrency group or an attestation reads it), and `workflow_sha`,
    the commit the file was read from (`sha`, default `github.sha`)."""
    rel = Path(path).as_posix()  # a workflow's path is relative to the repository
    if Path(path).is_absolute():
        with contextlib.suppress(ValueError):
            rel = Path(path).relative_to(root.absolute()).as_posix()
    return {
        **github,
        "workflow_ref": f"{github.get('repository', '')}/{rel}@{github.get('ref', '')}",
        "workflow_sha": sha if sha is not None else str(github.get("sha") or ""),
    }


def default_branch_ref(root: Path) -> str:
    """The ref of `root`'s default branch (caches saved there are readable from
    every ref, as on GitHub): origin's HEAD, else `init.defaultBranch`, else main."""
    name = _git(root, "symbolic-ref", "-q", "refs/remotes/origin/HEAD") or _git(
        root, "config", "init.defaultBranch"
    )
    if name is None:
        return "refs/heads/main"
    return f"refs/heads/{name.removeprefix('refs/remotes/origin/').removeprefix('refs/heads/')}"
