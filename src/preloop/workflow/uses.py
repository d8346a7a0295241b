"""`uses:` references: their syntax and where local ones may point.

Pure functions (no I/O beyond resolving a path), shared by the loader (steps
and reusable-workflow jobs) and whatever resolves actions:
- `step_uses_error(uses)`: GitHub's rule for a step's `uses:`
  (`docker://image`, `./path`, `$/path`, `owner/repo[/path]@ref`);
- `workflow_uses_error(uses)`: a job's `uses:` (`./.github/workflows/x.yml`,
  `$/...`, `owner/repo/.github/workflows/x.yml@ref`);
- `local_path_error(uses, repo, within=None, where=...)`: a local reference,
  read from `repo`, must stay inside `within` (default: `repo`; no `..` out
  of it, no symlink out of it).

GitHub's parser does not check where a step's local action points: its runner
joins the path to GITHUB_WORKSPACE, so `./../action/init` (github/codeql-action
checks itself out beside the workspace) is a valid step. Only what resolves
the action at step time bounds it (see preloop.actions.steps).
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

__all__ = ["is_local", "local_path_error", "step_uses_error", "workflow_uses_error"]


def is_local(uses: str) -> bool:
    """A reference into the workflow's own repository (`./x`, `.\\x`, `$/x`)."""
    return uses.startswith(("./", ".\\", "$/"))


def _local_part(uses: str) -> str:
    return uses[2:].replace("\\", "/")


def step_uses_error(uses: str) -> str | None:
    """Why `uses` is not a valid step reference (None when it is)."""
    if uses.startswith("docker://") or is_local(uses):
        return None
    parts = uses.split("@")
    segments = [s for s in parts[0].replace("\\", "/").split("/") if s]
    if len(parts) != 2 or len(segments) < 2 or not parts[1]:
        return f"expected format {{org}}/{{repo}}[/path]@ref, not '{uses}'"
    return None


def workflow_uses_error(uses: str) -> str | None:
    """Why `uses` is not a valid reusable-workflow reference (None when it is)."""
    if is_local(uses):
        path = _local_part(uses)
        if "@" in path:
            return f"a local reusable workflow takes no `@ref`: '{uses}'"
    else:
        parts = uses.split("@")
        segments = [s for s in parts[0].split("/") if s]
        if len(parts) != 2 or len(segments) < 3 or not parts[1]:
            return (
                "expected format {owner}/{repo}/.github/workflows/{file}@{ref} or "
                f"./.github/workflows/{{file}}, not '{uses}'"
            )
        path = "/".join(segments[2:])
    directory, name = posixpath.split(posixpath.normpath(path))
    if directory != ".github/workflows" or not name.endswith((".yml", ".yaml")):
        return (
            f"a reusable workflow is a .yml/.yaml file directly in .github/workflows, not '{uses}'"
        )
    return None


def local_path_error(
    uses: str, repo: Path, within: Path | None = None, where: str = "the repository"
) -> str | None:
    """Why local reference `uses`, a path from `repo`, leaves `within` (default:
    `repo`), which the message calls `where`; None when it stays."""
    rel = _local_part(uses)
    bound = repo if within is None else within
    # Lexically first (`..` past the bound), then through symlinks.
    lexical = posixpath.normpath(posixpath.join(os.path.relpath(repo, bound), rel or "."))
    if posixpath.isabs(rel) or lexical == ".." or lexical.startswith("../"):
        return f"'{uses}' points outside {where}"
    try:
        target = (repo / posixpath.normpath(rel or ".")).resolve()
        root = bound.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return f"'{uses}' cannot be resolved (a symlink loop?)"
    if target != root and not str(target).startswith(str(root) + os.sep):
        return f"'{uses}' points outside {where} (through a symlink)"
    return None
