"""`actions/checkout` of another repository (`repository: owner/name`).

The run's snapshot holds only its own repository's files; another one is
fetched as GitHub's checkout would fetch it from github.com, from
`$PRELOOP_ACTIONS_URL/<owner>/<name>` (the base actions come from:
`https://github.com` by default, or a mirror such as `file:///srv/mirrors`).
As actions/checkout does: `fetch-depth` 1 unless given (0 fetches every
branch and tag), a branch checked out as a local branch tracking
`origin/<branch>`, a tag or a commit detached, the remote's default branch
when no `ref:` is given.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from preloop import config
from preloop.process import CommandFailed, CommandTimeout
from preloop.snapshot.gitcmd import git, git_env, git_failure

__all__ = ["CheckoutSource", "checkout_repository", "repository_url"]

_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
# GitHub's owner and repository names: no `..`, no URL or option syntax.
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True, slots=True)
class CheckoutSource:
    """What was checked out: the remote's URL, the ref as resolved
    (`refs/heads/x`, `refs/tags/v1` or a commit) and the commit."""

    url: str
    ref: str
    commit: str


def repository_url(repository: str, base: str | None = None) -> str:
    """Where `owner/name` is fetched from: under `base` (default
    `$PRELOOP_ACTIONS_URL`), as actions are. Raises ValueError for anything
    but `owner/name`."""
    parts = repository.strip().removesuffix(".git").split("/")
    if len(parts) != 2 or not all(_NAME.fullmatch(p) and p.strip(".") for p in parts):
        raise ValueError(f"{repository!r} is not an owner/name repository")
    root = (base or config.get("PRELOOP_ACTIONS_URL")).rstrip("/")
    return f"{root}/{parts[0]}/{parts[1]}"


async def _resolve(url: str, ref: str, timeout: float) -> str:
    """`ref` as a full ref name (a branch, then a tag, as GitHub's checkout
    tries them) or a commit; the remote's default branch for ""."""
    if _SHA.fullmatch(ref.lower()):
        return ref.lower()
    if ref.startswith("refs/"):
        return ref
    if ref:
        wanted = [f"refs/heads/{ref}", f"refs/tags/{ref}"]
        out = (await git(["ls-remote", url, *wanted], timeout=timeout)).stdout_text()
        found = {line.partition("\t")[2].strip() for line in out.splitlines()}
        for name in wanted:
            if name in found:
                return name
        raise _NotFound(f"it has no branch or tag {ref!r}")
    out = (await git(["ls-remote", "--symref", url, "HEAD"], timeout=timeout)).stdout_text()
    for line in out.splitlines():
        if line.startswith("ref: ") and line.endswith("\tHEAD"):
            return line[5:].partition("\t")[0].strip()
    raise _NotFound("it has no default branch (HEAD)")


class _NotFound(Exception):
    pass


def _empty(directory: Path) -> None:
    """Removes what a failed checkout left in `directory`, which was empty."""
    with contextlib.suppress(FileNotFoundError):
        for entry in directory.iterdir():
            with contextlib.suppress(OSError):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()


async def checkout_repository(
    repository: str, ref: str, dest: Path, fetch_depth: int, *, timeout: float | None = None
) -> CheckoutSource:
    """Checks `repository` (`owner/name`) out at `ref` into `dest`, an empty
    or absent directory. Raises ValueError with a one-line reason (git's own
    diagnosis, or the ref that is not there); `dest` is then left empty."""
    url = repository_url(repository)  # before anything is written
    limit = float(timeout or config.get("PRELOOP_ACTIONS_FETCH_TIMEOUT"))
    env = git_env({"GIT_DIR": str(dest / ".git"), "GIT_WORK_TREE": str(dest)})
    depth = [f"--depth={fetch_depth}"] if fetch_depth > 0 else []
    try:
        full = await _resolve(url, ref, limit)
        dest.mkdir(parents=True, exist_ok=True)
        await git(["init", "-q", str(dest)], env=git_env())
        await git(["remote", "add", "origin", url], env=env)
        if fetch_depth <= 0:  # everything, as actions/checkout's fetch-depth: 0
            specs = ["+refs/heads/*:refs/remotes/origin/*", "+refs/tags/*:refs/tags/*"]
            await git(["fetch", "-q", "--prune", "origin", *specs], env=env, timeout=limit)
        if full.startswith("refs/heads/"):
            branch = full.removeprefix("refs/heads/")
            tracking = f"refs/remotes/origin/{branch}"
            await git(["fetch", "-q", "--no-tags", *depth, "origin", f"+{full}:{tracking}"],
                      env=env, timeout=limit)  # fmt: skip
            await git(["checkout", "-q", "-B", branch, tracking], env=env)
            await git(["branch", "-q", f"--set-upstream-to=origin/{branch}", branch], env=env)
        else:
            target = full
            if full.startswith("refs/tags/"):
                await git(["fetch", "-q", "--no-tags", *depth, "origin", f"+{full}:{full}"],
                          env=env, timeout=limit)  # fmt: skip
            else:  # a commit or another ref (refs/pull/1/merge): detached
                await git(["fetch", "-q", "--no-tags", *depth, "origin", full],
                          env=env, timeout=limit)  # fmt: skip
                target = "FETCH_HEAD"
            await git(["-c", "advice.detachedHead=false", "checkout", "-q", "--detach", target],
                      env=env)  # fmt: skip
        commit = (await git(["rev-parse", "HEAD"], env=env)).stdout_text().strip()
    except (CommandFailed, CommandTimeout, _NotFound) as exc:
        _empty(dest)
        reason = str(exc) if isinstance(exc, _NotFound) else git_failure(exc)
        raise ValueError(f"{url}: {reason}") from None
    return CheckoutSource(url, full, commit)
