"""The `github` context a local run sees, read from the repository's git state.

GitHub fills `github.*` from the event; locally the nearest equivalents come
from git: `sha` (HEAD), `ref` / `ref_name` / `ref_type` (the checked-out
branch, else a tag at HEAD), `repository` / `repository_owner` (from the
`origin` remote when it is a GitHub-style URL) and `workspace` (the root).
Anything git cannot tell is left out (and reads as null in expressions).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["local_github_context"]

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
    m = _REMOTE.search(url) if url else None
    if m:
        ctx.update(repository=f"{m.group(1)}/{m.group(2)}", repository_owner=m.group(1))
    return ctx
