"""`actions/checkout` of another repository (`repository: owner/name`).

The run's snapshot holds only its own repository's files; another one is
fetched as GitHub's checkout would fetch it from github.com, from
`$PRELOOP_ACTIONS_URL/<owner>/<name>` (the base actions come from:
`https://github.com` by default, or a mirror such as `file:///srv/mirrors`).
As actions/checkout does: `fetch-depth` 1 unless given (0 fetches every
branch and tag), a branch checked out as a local branch tracking
`origin/<branch>`, a tag or a commit detached, the remote's default branch
when no `ref:` is given.

`submodules: true|recursive` (`update_submodules`, for the run's own
repository too): the checkout's submodules at the commits its tree records,
from the URLs `.gitmodules` gives, with `https://github.com/` read as
`$PRELOOP_ACTIONS_URL` and relative URLs resolved against the repository's
own `$PRELOOP_ACTIONS_URL/<owner>/<name>`, as GitHub resolves them against
github.com.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

from preloop import config
from preloop.process import CommandFailed, CommandTimeout
from preloop.runner.workspaces import empty_directory
from preloop.snapshot.gitcmd import git, git_env, git_failure

__all__ = [
    "CheckoutSource",
    "RefNotFound",
    "checkout_repository",
    "repository_url",
    "update_submodules",
]

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
        raise RefNotFound(f"it has no branch or tag {ref!r}")
    out = (await git(["ls-remote", "--symref", url, "HEAD"], timeout=timeout)).stdout_text()
    for line in out.splitlines():
        if line.startswith("ref: ") and line.endswith("\tHEAD"):
            return line[5:].partition("\t")[0].strip()
    raise RefNotFound("it has no default branch (HEAD)")


class RefNotFound(ValueError):
    """The repository has no such ref (or no default branch): no network
    problem, the workflow's `ref:`."""


def _check_ref(ref: str) -> None:
    """A ref that reaches git only as a ref: no option text, nothing git's
    ref names refuse (`git check-ref-format`'s rules, roughly)."""
    name = ref.removeprefix("refs/heads/").removeprefix("refs/tags/")
    if (
        name.startswith(("-", "/"))
        or ".." in ref
        or "@{" in ref
        or any(c in ref for c in " ~^:?*[\\\t\n")
        or ref.endswith((".", "/", ".lock"))
    ):
        raise RefNotFound(f"{ref!r} is not a ref name git takes")


async def checkout_repository(
    repository: str, ref: str, dest: Path, fetch_depth: int, *, timeout: float | None = None
) -> CheckoutSource:
    """Checks `repository` (`owner/name`) out at `ref` into `dest`, an empty
    or absent directory. Raises ValueError with a one-line reason, git's own
    diagnosis (RefNotFound: the ref is not there or is no ref name); `dest`
    is then left empty. OSError where `dest` cannot be made."""
    url = repository_url(repository)  # before anything is written
    if ref:
        _check_ref(ref)
    limit = float(timeout or config.get("PRELOOP_ACTIONS_FETCH_TIMEOUT"))
    env = git_env({"GIT_DIR": str(dest / ".git"), "GIT_WORK_TREE": str(dest)})
    depth = [f"--depth={fetch_depth}"] if fetch_depth > 0 else []
    try:
        full = await _resolve(url, ref, limit)
        if not _SHA.fullmatch(full):
            _check_ref(full)  # also what the remote named as its default branch
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
    except (CommandFailed, CommandTimeout, RefNotFound) as exc:
        empty_directory(dest)  # it was empty: what the failed checkout left
        if isinstance(exc, RefNotFound):
            raise RefNotFound(f"{url}: {exc}") from None
        raise ValueError(f"{url}: {git_failure(exc)}") from None
    return CheckoutSource(url, full, commit)


_GITHUB = "https://github.com"


async def update_submodules(
    dest: Path, *, recursive: bool, repository: str | None, timeout: float | None = None
) -> list[str]:
    """`git submodule update --init` in the checkout `dest`, as actions/checkout
    does for `submodules: true` (`recursive`: theirs too, at any depth); the
    submodule paths checked out, relative to `dest`. `repository`
    (`owner/name`, or None: the checkout's own origin) is what relative
    submodule URLs are resolved against. Raises ValueError with git's
    one-line diagnosis and what to do."""
    limit = float(timeout or config.get("PRELOOP_ACTIONS_FETCH_TIMEOUT"))
    origin = None
    if repository is not None:
        with contextlib.suppress(ValueError):  # a local repository: as git resolves them
            origin = repository_url(repository)
    try:
        return await _update_submodules(dest, Path(), recursive, origin, limit)
    except (CommandFailed, CommandTimeout) as exc:
        raise ValueError(
            f"submodules could not be checked out: {git_failure(exc)}; a submodule's commit "
            "must be fetchable from its URL (pushed), or give the step `submodules: false`"
        ) from None


async def _update_submodules(
    root: Path, rel: Path, recursive: bool, origin: str | None, limit: float
) -> list[str]:
    checkout = root / rel
    if not (checkout / ".gitmodules").is_file():
        return []
    base = config.get("PRELOOP_ACTIONS_URL").rstrip("/")
    options: list[str] = []
    if base.startswith(("file:", "/")):
        # git refuses file:// submodules unless told (CVE-2022-39253); the
        # mirror is the user's own, as PRELOOP_ACTIONS_URL says.
        options += ["-c", "protocol.file.allow=always"]
    if origin is not None:
        options += ["-c", f"remote.origin.url={origin}"]
    env = git_env()
    await git([*options, "submodule", "init"], env=env, cwd=checkout)
    urls = await git(
        ["config", "--get-regexp", r"^submodule\..*\.url$"], env=env, cwd=checkout, check=False
    )
    for line in urls.stdout_text().splitlines():
        key, _, url = line.partition(" ")
        for prefix in {_GITHUB, base}:
            rest = url.removeprefix(f"{prefix}/")
            if rest != url and url != (mirrored := f"{base}/{rest.removesuffix('.git')}"):
                # <base>/<owner>/<name>, where actions and repositories come from
                await git(["config", key, mirrored], env=env, cwd=checkout)
                break
    await git([*options, "submodule", "update", "--init", "--force"],
              env=env, cwd=checkout, timeout=limit)  # fmt: skip
    # The gitlinks of the index: each submodule's path, spaces and all.
    listed = await git(["ls-files", "-z", "--stage"], env=env, cwd=checkout)
    paths = [
        rel / entry.partition("\t")[2]
        for entry in listed.stdout_text().split("\0")
        if entry.startswith("160000 ")
    ]
    done = [str(p) for p in paths]
    if recursive:
        for path in paths:
            done += await _update_submodules(root, path, recursive, None, limit)
    return done
