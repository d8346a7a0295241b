"""The job's checkout of its run's snapshot, and where runners find snapshots.

A run's snapshot is the bare run repository `<state>/snapshots/<run_key>`
(`preloop.snapshot`), published with the run as `SnapshotLocation` in the
run's `github` context under `preloop_snapshot`. A runner checks it out with
`git clone --shared` (no object copy: the clone borrows the run repository's
objects, which borrow the shared object cache's).

How a runner on another machine gets it is the location's `transport`
(`preloop.snapshot.transport`, `PRELOOP_SNAPSHOT_TRANSPORT`):

- `store` (the default on PostgreSQL): the snapshot is also a chain of git
  bundles in the store; a runner that cannot find the commit at the
  recorded path fetches the bundles it lacks into its own object cache and
  clones from a run repository it makes there;
- `path`: the runner clones the recorded path, so the submitter's state
  directory must be mounted at the same path on the runner's machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from preloop.errors import PreloopError
from preloop.process import CommandFailed, CommandTimeout, run_command
from preloop.runner.remote_checkout import (
    RefNotFound,
    checkout_repository,
    repository_url,
    update_submodules,
)
from preloop.runner.workspaces import clear_tree, empty_directory, stale_workspaces
from preloop.snapshot.bundles import SnapshotBundles
from preloop.snapshot.gitcmd import git, git_env
from preloop.snapshot.holders import release_run_repository
from preloop.snapshot.layout import run_repository
from preloop.snapshot.owner import pid_exists
from preloop.snapshot.transport import fetch_snapshot

if TYPE_CHECKING:
    from preloop.control.store import Store

__all__ = [
    "SNAPSHOT_CONTEXT_KEY",
    "CheckoutError",
    "CheckoutTemplates",
    "SnapshotLocation",
    "checkout_snapshot",
    "checkout_step",
    "sweep_work_dir",
    "work_dir",
]

SNAPSHOT_CONTEXT_KEY = "preloop_snapshot"
_CHECKOUT_TIMEOUT = 600.0


class CheckoutError(PreloopError):
    """A job's snapshot could not be checked out."""


@dataclass(frozen=True, slots=True)
class SnapshotLocation:
    """Where a run's snapshot lives: a bare repository path, its branch,
    commit; with the `store` transport also the object-cache key of the
    submitter's repository and the chain of bundle digests (root first).

    What the job's checkout is given besides, as GitHub's would have it:
    `tags`, the submitted repository's tags in the snapshot's history as
    (name, object, commit) (`snapshot_tags`); `head_branch`, the branch
    pushed (the checkout's branch is named after it; "" keeps `branch`);
    `checkout`, the commit the job's branch is moved to when it is not
    `commit`: the submitted HEAD, when the snapshot's tree is HEAD's (a
    clean work tree), so that `git describe` and versions from git see the
    commit itself, not a snapshot commit on top of it; `branches`, the
    submitted repository's branches as (name, commit), for `origin/<name>`
    as `fetch-depth: 0` fetches them (`snapshot_branches`)."""

    repository: str
    branch: str
    commit: str
    transport: str = "path"
    repo_key: str = ""
    bundles: tuple[str, ...] = ()
    tags: tuple[tuple[str, str, str], ...] = ()
    head_branch: str = ""
    checkout: str = ""
    branches: tuple[tuple[str, str], ...] = ()

    @property
    def checked_out(self) -> str:
        """The commit a job's checkout is at."""
        return self.checkout or self.commit

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "repository": self.repository,
            "branch": self.branch,
            "commit": self.commit,
            "transport": self.transport,
        }
        if self.repo_key:  # a re-run finds the snapshot's objects by it
            out["repo_key"] = self.repo_key
        if self.transport == "store":
            out["bundles"] = list(self.bundles)
        if self.tags:
            out["tags"] = [list(tag) for tag in self.tags]
        if self.head_branch:
            out["head_branch"] = self.head_branch
        if self.checkout:
            out["checkout"] = self.checkout
        if self.branches:
            out["branches"] = [list(b) for b in self.branches]
        return out

    @classmethod
    def from_context(cls, github: dict[str, Any], where: str) -> SnapshotLocation:
        data = github.get(SNAPSHOT_CONTEXT_KEY)
        if not isinstance(data, dict):
            raise CheckoutError(
                f"{where}: the run records no snapshot location; it was not submitted by "
                "`preloop run` (resubmit it with `preloop run`)"
            )
        bundles = data.get("bundles") or []
        tags = data.get("tags") or []
        branches = data.get("branches") or []
        return cls(
            str(data["repository"]),
            str(data["branch"]),
            str(data["commit"]),
            str(data.get("transport") or "path"),
            str(data.get("repo_key") or ""),
            tuple(str(d) for d in bundles) if isinstance(bundles, list) else (),
            tuple(
                (str(t[0]), str(t[1]), str(t[2]))
                for t in (tags if isinstance(tags, list) else [])
                if isinstance(t, list) and len(t) == 3
            ),
            str(data.get("head_branch") or ""),
            str(data.get("checkout") or ""),
            tuple(
                (str(b[0]), str(b[1]))
                for b in (branches if isinstance(branches, list) else [])
                if isinstance(b, list) and len(b) == 2
            ),
        )


# A run's context carries them (~60 bytes each); `git describe` wants the
# nearest tag, which is among the newest. A repository with more keeps its newest.
_MAX_REFS = 1_000


def _for_each_ref(root: Path, args: list[str]) -> list[list[str]]:
    """`git for-each-ref ARGS` in `root` with a three-field `--format`, each
    line split in three; [] when git cannot list them (no repository, an
    unborn HEAD). A line that is not UTF-8 (the run's context is JSON) is
    left out; a refname holds no spaces."""
    try:
        listed = subprocess.run(
            ["git", "for-each-ref", *args],
            cwd=root,
            env=git_env(),
            capture_output=True,
            check=False,
            timeout=_CHECKOUT_TIMEOUT,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if listed.returncode != 0:
        return []
    lines = []
    for raw in listed.stdout.splitlines():
        with contextlib.suppress(UnicodeDecodeError):
            parts = raw.decode().split(" ", 2)
            if len(parts) == 3:
                lines.append(parts)
    return lines


def snapshot_tags(root: Path, commit: str) -> tuple[tuple[str, str, str], ...]:
    """The tags of the repository at `root` whose commit `commit` contains
    (newest first, at most `_MAX_REFS`), each as (name, its object: an
    annotated tag's own, else the commit; the commit), for the job's
    checkout (`git describe`, setuptools-scm and hatch-vcs read them)."""
    listed = _for_each_ref(
        root,
        [f"--merged={commit}", "--sort=-creatordate", f"--count={_MAX_REFS}",
         "--format=%(objectname) %(*objectname) %(refname)", "refs/tags"],
    )  # fmt: skip
    return tuple(
        (ref.removeprefix("refs/tags/"), oid, peeled or oid)  # "" peeled unless annotated
        for oid, peeled, ref in listed
        if ref.startswith("refs/tags/")
    )


def snapshot_branches(root: Path) -> tuple[tuple[str, str], ...]:
    """The branches of the repository at `root` as its origin has them
    (`refs/remotes/origin/*`), then its local ones origin lacks, each as
    (name, commit), at most `_MAX_REFS` of each: what a checkout with
    `fetch-depth: 0` has as `origin/<name>` (a pull request's base, for
    `git diff origin/main...`)."""
    listed = _for_each_ref(
        root,
        [f"--count={2 * _MAX_REFS}", "--sort=-committerdate",
         "--format=%(objectname) %(objecttype) %(refname)", "refs/remotes/origin", "refs/heads"],
    )  # fmt: skip
    remote: dict[str, str] = {}
    local: dict[str, str] = {}
    for oid, kind, ref in listed:
        if kind != "commit":
            continue
        if ref.startswith("refs/remotes/origin/") and ref != "refs/remotes/origin/HEAD":
            remote.setdefault(ref.removeprefix("refs/remotes/origin/"), oid)
        elif ref.startswith("refs/heads/"):
            local.setdefault(ref.removeprefix("refs/heads/"), oid)
    names = list(remote)[:_MAX_REFS] + [n for n in local if n not in remote][:_MAX_REFS]
    return tuple((n, remote.get(n) or local[n]) for n in names)


async def checkout_snapshot(location: SnapshotLocation, dest: Path, where: str) -> None:
    """Clones the snapshot into `dest` (which must not exist), at its commit."""
    if not Path(location.repository).is_dir():
        raise CheckoutError(
            f"{where}: the run's snapshot {location.repository} is not reachable from this "
            "machine: with PRELOOP_SNAPSHOT_TRANSPORT=path runners must mount the submitter's "
            "state directory at the same path (or submit with the store transport)"
        )
    try:
        await run_command(
            [
                "git",
                "-c",
                "advice.detachedHead=false",
                "clone",
                "-q",
                "--shared",
                "--no-tags",
                "--template=",  # no sample hooks: fewer files to copy per job
                "-b",
                location.branch,
                location.repository,
                str(dest),
            ],
            timeout=_CHECKOUT_TIMEOUT,
        )
    except CommandFailed as exc:
        raise CheckoutError(f"{where}: checkout of the run's snapshot failed: {exc}") from None


# An actions/checkout input that changes what is checked out and that preloop
# cannot honour: the snapshot has the run's files, not a ref's.
_REF_INPUT_NOTE = (
    "actions/checkout: ref {ref!r} is not checked out: preloop runs the job on the "
    "run's snapshot (the working tree as submitted)"
)


async def checkout_step(
    inputs: Mapping[str, str],
    workspace: Path,
    github: Mapping[str, Any],
    log: Callable[[str], None],
    recheckout: Callable[[Path], Awaitable[None]] | None = None,
) -> None:
    """`uses: actions/checkout`: the workspace already holds the run's
    snapshot. `path:` gets a checkout of its own (a `--shared` clone of the
    workspace's repository) under the workspace, as GitHub's would. Where
    an earlier step moved or removed the workspace's checkout, GitHub's
    fetches the repository again: `recheckout` (a fresh copy of the job's
    checkout at a path that does not exist) stands in for it. Another
    `repository:` is fetched from where actions come from
    (`preloop.runner.remote_checkout`); for the run's own one a `ref:` is
    checked out into a `path:` when the snapshot has it, and only noted for
    the workspace itself (the job runs on the snapshot). The checkout always
    has the history and tags `fetch-depth: 0` would fetch (`_name_refs`).
    Raises `CheckoutError` with a one-line message (the caller names the step)."""
    repository = inputs.get("repository", "").strip()
    current = str(github.get("repository") or "")
    other: str | None = None  # another repository, fetched
    if repository and not _same_repository(repository, current):
        if current.startswith("local/"):  # no GitHub remote: the name may differ
            log(
                f"actions/checkout: cannot tell whether {repository!r} is this repository "
                "(it has no GitHub remote); the run's snapshot is what is checked out"
            )
        else:
            other = repository
    ref = inputs.get("ref", "").strip()
    path = inputs.get("path", "").strip()
    if ref in _current_refs(github):
        ref = ""
    if ref and other is None and _destination(path, workspace) == workspace.resolve():
        log(_REF_INPUT_NOTE.format(ref=ref))
        ref = ""
    try:
        if other is not None:
            await _checkout_other(other, inputs, workspace, log)
        else:
            await _checkout_into(path, workspace, log, recheckout, ref)
        own = None if current.startswith("local/") else current  # no GitHub remote
        await _submodules(inputs, _destination(path, workspace), other or own, log)
    except CommandTimeout:
        raise CheckoutError(
            f"actions/checkout into {path!r} timed out after {_CHECKOUT_TIMEOUT:g} s"
        ) from None
    except OSError as exc:
        raise CheckoutError(
            f"actions/checkout into {path!r} failed: {exc.strerror or exc} "
            f"({exc.filename or path}); check the step's `path:`"
        ) from None


# In the `.git` of a workspace an actions/checkout of another repository
# replaced: the snapshot's checkout is no longer there.
_OTHER_REPOSITORY = "preloop-other-repository"


def _holds_run_checkout(root: Path) -> bool:
    """Whether the workspace holds the run's checkout: a `.git`, not one an
    actions/checkout of another repository put there."""
    return (root / ".git").exists() and not (root / ".git" / _OTHER_REPOSITORY).exists()


def _check_empty(dest: Path, path: str) -> None:
    """A `path:` to check out into: absent, or an empty directory."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise CheckoutError(
            f"actions/checkout path {path!r} exists and is not an empty directory: remove "
            "it first or check out to another path"
        )


def _destination(path: str, workspace: Path) -> Path:
    """Where a checkout's `path:` is: under the workspace, never outside it."""
    root = workspace.resolve()
    dest = (workspace / path).resolve() if path else root
    if dest != root and root not in dest.parents:
        raise CheckoutError(
            f"actions/checkout path {path!r} is not under the workspace {root}: give a "
            "path relative to it"
        )
    return dest


async def _checkout_other(
    repository: str, inputs: Mapping[str, str], workspace: Path, log: Callable[[str], None]
) -> None:
    """Another repository, fetched into `path:` (an empty or new directory)
    or, without one, into the workspace in place of the snapshot, as
    GitHub's checkout replaces a workspace holding another repository."""
    path = inputs.get("path", "").strip()
    dest = _destination(path, workspace)
    try:
        repository_url(repository)  # a name that is no repository changes nothing
    except ValueError as exc:
        raise CheckoutError(f"actions/checkout: {exc}; give `repository:` as owner/name") from None
    if dest == workspace.resolve():
        if (left := empty_directory(dest)) is not None:
            raise CheckoutError(
                f"actions/checkout of {repository!r}: the workspace's {left.name} "
                "cannot be removed to make room for it; give the step a `path:`"
            )
    else:
        _check_empty(dest, path)
    depth_text = inputs.get("fetch-depth", "").strip() or "1"
    try:
        depth = int(depth_text)
    except ValueError:
        raise CheckoutError(
            f"actions/checkout: fetch-depth {depth_text!r} is not a whole number"
        ) from None
    ref = inputs.get("ref", "").strip()
    try:
        source = await checkout_repository(repository, ref, dest, depth)
    except RefNotFound as exc:
        raise CheckoutError(f"actions/checkout of repository {repository!r}: {exc}") from None
    except ValueError as exc:
        raise CheckoutError(
            f"actions/checkout of repository {repository!r} failed: {exc}; check the network "
            "or PRELOOP_ACTIONS_URL (its base), or check it out in a `run:` step"
        ) from None
    if dest == workspace.resolve():
        # The workspace holds another repository now: a later checkout of
        # the run's own one checks the snapshot out again (`_holds_run_checkout`).
        (dest / ".git" / _OTHER_REPOSITORY).write_text(repository + "\n", encoding="utf-8")
    where = path or "the workspace"
    log(f"actions/checkout: {repository}@{source.ref} ({source.commit[:12]}) into {where}")
    unhonoured = [
        name
        for name in ("lfs", "sparse-checkout")
        if inputs.get(name, "").strip().lower() not in ("", "false")
    ]
    if unhonoured:
        log(f"actions/checkout: {', '.join(unhonoured)} not honoured for {repository}")


async def _submodules(
    inputs: Mapping[str, str], dest: Path, repository: str | None, log: Callable[[str], None]
) -> None:
    """`submodules: true|recursive` of a checkout at `dest`: its submodules
    checked out (`update_submodules`); any other value leaves them empty, as
    actions/checkout does."""
    mode = inputs.get("submodules", "").strip().lower()
    if mode not in ("true", "recursive"):
        return
    try:
        paths = await update_submodules(dest, recursive=mode == "recursive", repository=repository)
    except ValueError as exc:
        raise CheckoutError(f"actions/checkout: {exc}") from None
    if paths:
        log(f"actions/checkout: submodules checked out: {', '.join(paths)}")


async def _checkout_into(
    path: str,
    workspace: Path,
    log: Callable[[str], None],
    recheckout: Callable[[Path], Awaitable[None]] | None,
    ref: str = "",
) -> None:
    """`path:` of `checkout_step`: the workspace itself, or a clone of its
    checkout (its HEAD when the step runs, or `ref`, another ref of the
    run's repository, when the checkout has it) at `path` under it; a fresh
    checkout (`recheckout`) where the workspace's is gone."""
    root = workspace.resolve()
    dest = _destination(path, workspace)
    has_checkout = _holds_run_checkout(root)
    if dest == root and (has_checkout or recheckout is None):
        log("actions/checkout: satisfied by the snapshot checkout in the workspace")
        return
    if dest != root and (dest / ".git").exists():
        log(f"actions/checkout: {path} already holds a checkout; left as it is")
        return
    if dest != root:
        _check_empty(dest, path)
    if not has_checkout:
        if recheckout is None:
            raise CheckoutError(
                f"actions/checkout: the workspace {root} holds no git checkout to clone into "
                f"{path!r}; drop the step's `path:`"
            )
        await _fresh_checkout(dest, recheckout)
        log(
            "actions/checkout: the workspace's checkout was moved or removed by an earlier "
            f"step; the run's snapshot checked out again into {path or root}"
        )
        if ref:
            log(_REF_INPUT_NOTE.format(ref=ref))
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        dest.rmdir()  # an empty directory: git clone makes its own
    clone = ["git", "-c", "advice.detachedHead=false", "clone", "-q", "--shared",
             "--template=", str(root), str(dest)]  # fmt: skip
    try:
        await run_command(clone, timeout=_CHECKOUT_TIMEOUT)
    except CommandFailed as exc:
        raise CheckoutError(f"actions/checkout into {path!r} failed: {exc}") from None
    with contextlib.suppress(FileNotFoundError):
        (dest / ".git/refs/remotes/origin/HEAD").unlink()  # as in the workspace's
    if ref and await _checkout_ref(root, dest, ref, path, log):
        return
    if ref:
        log(_REF_INPUT_NOTE.format(ref=ref))
    log(f"actions/checkout: the snapshot checked out into {path}")


async def _checkout_ref(
    root: Path, dest: Path, ref: str, path: str, log: Callable[[str], None]
) -> bool:
    """Checks `ref` out in the clone `dest` of the workspace `root`, as
    actions/checkout does: a branch (`origin/<name>` in the workspace, as
    `fetch-depth: 0` fetches them, or a local one) as a local branch of that
    name, a tag or a commit (a pull request's base SHA, say) detached.
    False when the workspace's checkout has no such ref or commit."""
    name = ref.removeprefix("refs/heads/")
    candidates: list[tuple[str, str | None]] = []
    if not ref.startswith("refs/tags/"):
        candidates += [(f"refs/remotes/origin/{name}", name), (f"refs/heads/{name}", name)]
    if not ref.startswith("refs/heads/"):
        tag = ref.removeprefix("refs/tags/")
        candidates += [(f"refs/tags/{tag}", None)]
    if not ref.startswith(("refs/heads/", "refs/tags/")):
        candidates += [(ref, None)]
    for candidate, branch in candidates:
        if candidate.startswith("-"):
            continue
        found = await run_command(
            ["git", "-C", str(root), "rev-parse", "--verify", "-q", f"{candidate}^{{commit}}"],
            timeout=_CHECKOUT_TIMEOUT,
            check=False,
        )
        if found.returncode != 0:
            continue
        commit = found.stdout.decode().strip()
        # a clone --shared borrows the workspace's objects: the commit is there
        target = ["--detach", commit]
        if branch:
            # As GitHub's `checkout -B <b> refs/remotes/origin/<b>`: the local
            # branch tracks `origin/<b>`.
            await run_command(
                ["git", "-C", str(dest), "update-ref", f"refs/remotes/origin/{branch}", commit],
                timeout=_CHECKOUT_TIMEOUT,
            )
            target = ["-B", branch, "--track", f"origin/{branch}"]
        try:
            await run_command(
                ["git", "-C", str(dest), "-c", "advice.detachedHead=false", "checkout", "-q",
                 "--force", *target],
                timeout=_CHECKOUT_TIMEOUT,
            )  # fmt: skip
        except CommandFailed as exc:
            raise CheckoutError(
                f"actions/checkout of {ref!r} into {path!r} failed: {exc}"
            ) from None
        log(f"actions/checkout: {ref} ({commit[:12]}) checked out into {path}")
        return True
    return False


async def _fresh_checkout(dest: Path, recheckout: Callable[[Path], Awaitable[None]]) -> None:
    """A fresh checkout of the run's snapshot at `dest`, an empty or missing
    directory, or the workspace itself, whose contents GitHub's checkout
    deletes first when it holds no repository. Made beside `dest` and moved
    into it, so the directory itself (a step's or a shell's working
    directory) stays."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fresh = dest.parent / f".{dest.name}.checkout-{uuid.uuid4().hex[:12]}"
    try:
        await recheckout(fresh)
        dest.mkdir(exist_ok=True)
        if (left := await anyio.to_thread.run_sync(empty_directory, dest)) is not None:
            raise CheckoutError(
                f"actions/checkout: {left} cannot be removed to check the snapshot "
                "out again; remove it in the step that made it"
            )
        for entry in list(fresh.iterdir()):
            entry.rename(dest / entry.name)
    finally:
        await anyio.to_thread.run_sync(clear_tree, fresh)


def _same_repository(wanted: str, current: str) -> bool:
    """Whether `owner/name` names the run's repository `current` (any case,
    an optional `.git`). Both parts count when `current` came from a
    host's remote URL: a fork's workflow checking out `upstream/proj` gets
    upstream's, as on GitHub. A repository with no such remote
    (`local/<dir>`) has no known owner, so only the names are compared."""

    def parts(repository: str) -> list[str]:
        return repository.strip().lower().removesuffix(".git").rsplit("/", 1)

    if current.startswith("local/"):
        return parts(wanted)[-1] == parts(current)[-1]
    return parts(wanted) == parts(current)


def _current_refs(github: Mapping[str, Any]) -> set[str]:
    """The refs an `actions/checkout` `ref:` may name and still mean the
    run's own commit: the run's ref, its snapshot commit, and the submitted
    HEAD as the event payload gives it (`after`, a pull request's head)."""
    refs = {str(github.get(k) or "") for k in ("ref", "ref_name", "sha", "head_ref")}
    for name in ("ref_name", "head_ref"):
        if value := str(github.get(name) or ""):
            refs |= {f"refs/heads/{value}", f"refs/tags/{value}"}
    event = github.get("event")
    if isinstance(event, dict):
        refs.add(str(event.get("after") or ""))
        pull_request = event.get("pull_request")
        head = pull_request.get("head") if isinstance(pull_request, dict) else None
        if isinstance(head, dict):
            refs |= {str(head.get("sha") or ""), str(head.get("ref") or "")}
    return refs - {""}


async def _name_refs(checkout: Path, location: SnapshotLocation, where: str) -> None:
    """Gives a fresh clone of the snapshot what GitHub's checkout has: its
    branch at the submitted HEAD when the snapshot's tree is HEAD's
    (`SnapshotLocation.checkout`), named after the pushed branch, with
    `origin/<branch>`, the tags in its history (`SnapshotLocation.tags`)
    and the repository's other branches as `origin/<name>`
    (`SnapshotLocation.branches`), those whose commits it has. The refs go
    into `packed-refs`, one file rather than one per ref (each job copies
    the checkout)."""
    env = git_env({"GIT_DIR": str(checkout / ".git")})
    refs: dict[str, str] = {}  # name -> object id
    drop: set[str] = set()
    branch = location.head_branch
    renamed = bool(branch) and branch != location.branch
    try:
        if location.checkout and location.checkout != location.commit:
            # The same tree: the index and the files already match it.
            await git(["update-ref", f"refs/heads/{location.branch}", location.checkout], env=env)
        if renamed:
            await git(["branch", "-m", location.branch, branch], env=env)
            await git(["config", f"branch.{branch}.merge", f"refs/heads/{branch}"], env=env)
            refs[f"refs/remotes/origin/{branch}"] = location.checked_out
            # GitHub's checkout sets no origin/HEAD, and the run repository's
            # own branch name is no branch of the user's.
            drop = {"refs/remotes/origin/HEAD", f"refs/remotes/origin/{location.branch}"}
        else:  # its upstream where it is: not "behind 1"
            refs[f"refs/remotes/origin/{location.branch}"] = location.checked_out
        if location.tags or location.branches:
            have = await _object_types(
                env, {o for _, obj, commit in location.tags for o in (obj, commit)}
                | {commit for _, commit in location.branches},
            )  # fmt: skip
            for name, obj, commit in location.tags:
                # An annotated tag whose object this clone lacks (a tag made
                # after the object cache's first copy, a store snapshot's
                # bundles) stays a tag, lightweight.
                if have.get(commit) == "commit":
                    refs.setdefault(f"refs/tags/{name}", obj if have.get(obj) == "tag" else commit)
            # The others as origin has them, when this clone has their
            # commits, and none where a ref would be a directory of another
            # (origin's `a` beside a local `a/b`, a user's `snapshot/x`
            # beside the clone's own `origin/snapshot`): no remote has both.
            files = set(refs) | {
                "refs/remotes/origin/HEAD",
                f"refs/remotes/origin/{location.branch}",
            }
            dirs = {d for ref in files for d in _ref_dirs(ref)}
            for name, commit in location.branches:
                ref = f"refs/remotes/origin/{name}"
                parents = _ref_dirs(ref)
                if have.get(commit) == "commit" and ref not in files | dirs and not parents & files:
                    refs[ref] = commit
                    files.add(ref)
                    dirs |= parents
        # One transaction, then packed: each job copies the checkout, and a
        # thousand tags are one file rather than a thousand.
        lines = [f"delete {name}\n" for name in drop]
        lines += [f"update {name} {oid}\n" for name, oid in refs.items()]
        await git(["update-ref", "--no-deref", "--stdin"], env=env, stdin="".join(lines).encode())
        await git(["pack-refs", "--all"], env=env)
        await _origin_view(checkout, refs, branch or location.branch)
    except (CommandFailed, OSError) as exc:
        raise CheckoutError(
            f"{where}: naming the checkout's branch and tags failed: {exc}"
        ) from None


# The checkout's `origin`: a bare repository in its `.git` borrowing its objects.
_ORIGIN = "preloop-origin.git"


async def _origin_view(checkout: Path, refs: Mapping[str, str], default: str) -> None:
    """Makes the checkout's `origin` offer what its `origin/<name>` and tags
    name, as GitHub's checkout's remote (the repository on github.com) does:
    `git fetch origin main --depth=1` (coveragepy's docs job), `git fetch
    --tags` or `git fetch --prune` then see the branches the checkout has.
    It is `.git/preloop-origin.git`, its objects the checkout's (a relative
    alternate), its URL relative to the work tree, so that the copies of a
    checkout each have their own; a push to it stays in the job."""
    origin = checkout / ".git" / _ORIGIN
    heads = {
        f"refs/heads/{name.removeprefix('refs/remotes/origin/')}": oid
        for name, oid in refs.items()
        if name.startswith("refs/remotes/origin/")
    }
    tags = {name: oid for name, oid in refs.items() if name.startswith("refs/tags/")}
    # Written as `git init --bare` and `pack-refs` would (one git call a job,
    # not five): HEAD, config, the objects' alternate, the refs in
    # `packed-refs` (no header: git peels the tags itself when asked).
    (origin / "objects" / "info").mkdir(parents=True, exist_ok=True)
    (origin / "refs").mkdir(exist_ok=True)
    (origin / "objects" / "info" / "alternates").write_text("../../objects\n")
    (origin / "config").write_text("[core]\n\trepositoryformatversion = 0\n\tbare = true\n")
    head = default if f"refs/heads/{default}" in heads else "main"
    (origin / "HEAD").write_text(f"ref: refs/heads/{head}\n")
    packed = "".join(f"{oid} {name}\n" for name, oid in sorted({**heads, **tags}.items()))
    (origin / "packed-refs").write_text(packed)
    work = git_env({"GIT_DIR": str(checkout / ".git")})
    await git(["config", "remote.origin.url", f".git/{_ORIGIN}"], env=work)


async def _object_types(env: dict[str, str], oids: set[str]) -> dict[str, str]:
    """The type of each of `oids` the repository of `env` has (`commit`, `tag`...)."""
    found = await git(["cat-file", "--batch-check=%(objectname) %(objecttype)"],
                      env=env, stdin="".join(f"{oid}\n" for oid in oids).encode())  # fmt: skip
    return dict(line.split(" ", 1) for line in found.stdout_text().splitlines())


def _ref_dirs(ref: str) -> set[str]:
    """The directories `ref` is under (`refs`, `refs/remotes`, ...)."""
    return {ref.rsplit("/", i)[0] for i in range(1, ref.count("/") + 1)}


_KEEP_TEMPLATES = 4
_INLINE_COPY_MAX = 256  # entries; larger checkouts are copied in a worker thread


def _count_entries(root: Path, limit: int) -> int:
    n = 0
    for _, dirs, files in os.walk(root):
        n += len(dirs) + len(files)
        if n >= limit:
            break
    return n


class CheckoutTemplates:
    """One clone of each run's snapshot per process; each job gets a copy.

    Copying a checkout is cheaper than cloning it again and gives
    every job its own files. Templates live in `<work>/<pid>-template-*`
    (the pid lets `sweep_work_dir` remove those of dead processes); at most
    a few are kept, the least recent removed when not being copied.

    A `store` snapshot whose commit is not at its recorded path (another
    machine's) is fetched from `store` into `state_dir`'s object cache
    first; the run repository made for it lives as long as its template.

    A job's directory (its temp, its tool cache) and its workspace slot (its
    copy, see `preloop.runner.workspaces`) are emptied in the background once
    the job ended (`remove_later`), so the next claim need not wait for it;
    `close` waits for those removals: when the owner's runs have ended,
    nothing of their jobs is left behind, half deleted."""

    def __init__(
        self, root: Path, *, store: Store | None = None, state_dir: Path | None = None
    ) -> None:
        self.work_dir = root
        self._store = store
        self._state_dir = state_dir
        self._locks: dict[SnapshotLocation, anyio.Lock] = {}
        self._paths: dict[SnapshotLocation, Path] = {}
        self._copying: dict[SnapshotLocation, int] = {}
        self._small: dict[SnapshotLocation, bool] = {}
        self._fetched: dict[SnapshotLocation, str] = {}
        self._removals: list[threading.Thread] = []

    def remove_later(self, path: Path, then: Callable[[], None] | None = None) -> None:
        """Removes the job directory `path` in a thread of its own, then calls
        `then` there (the job's workspace slot is emptied and given back)."""
        self._removals = [t for t in self._removals if t.is_alive()]

        def remove() -> None:
            shutil.rmtree(path, ignore_errors=True)
            if then is not None:
                then()

        removal = threading.Thread(target=remove)
        removal.start()
        self._removals.append(removal)

    async def checkout(self, location: SnapshotLocation, dest: Path, where: str) -> None:
        lock = self._locks.setdefault(location, anyio.Lock())
        async with lock:
            template = self._paths.get(location)
            if template is None:
                template = self.work_dir / f"{os.getpid()}-template-{uuid.uuid4().hex[:12]}"
                self.work_dir.mkdir(parents=True, exist_ok=True)
                source, fetched = await self._source(location, where)
                try:
                    await checkout_snapshot(source, template, where)
                    await _name_refs(template, location, where)
                except BaseException:
                    if fetched is not None:
                        self._release(fetched)
                    raise
                if fetched is not None:
                    self._fetched[location] = fetched
                # Reflogs are of no use in a job and cost a copy each.
                shutil.rmtree(template / ".git" / "logs", ignore_errors=True)
                self._paths[location] = template
                self._small[location] = _count_entries(template, _INLINE_COPY_MAX) < (
                    _INLINE_COPY_MAX
                )
                self._evict(keep=location)
            self._copying[location] = self._copying.get(location, 0) + 1
        try:
            # In a worker thread rather than `cp`: no fork of this process.
            await anyio.to_thread.run_sync(lambda: shutil.copytree(template, dest, symlinks=True))
        except OSError as exc:
            raise CheckoutError(f"{where}: copying the checkout failed: {exc}") from None
        finally:
            self._copying[location] -= 1

    async def _source(
        self, location: SnapshotLocation, where: str
    ) -> tuple[SnapshotLocation, str | None]:
        """What to clone for `location`: itself, or for a `store` snapshot
        not at its path here, a run repository fetched from the store (and
        its name, to release with the template)."""
        if location.transport != "store" or await _has_commit(location):
            return location, None
        if self._store is None or self._state_dir is None:
            raise CheckoutError(
                f"{where}: the run's snapshot is in the store and this runner has no store "
                "to fetch it from; run it with `preloop runner --store postgresql://...`"
            )
        name = await fetch_snapshot(
            SnapshotBundles(self._store),
            self._state_dir,
            location.repo_key,
            location.bundles,
            location.commit,
            where,
        )
        path = run_repository(self._state_dir, name)
        return SnapshotLocation(str(path), "snapshot", location.commit), name

    def _release(self, fetched: str) -> None:
        assert self._state_dir is not None
        release_run_repository(self._state_dir, fetched)

    def _evict(self, keep: SnapshotLocation) -> None:
        idle = [k for k in self._paths if k != keep and not self._copying.get(k)]
        while len(self._paths) > _KEEP_TEMPLATES and idle:
            old = idle.pop(0)
            shutil.rmtree(self._paths.pop(old), ignore_errors=True)
            self._locks.pop(old, None)
            self._small.pop(old, None)
            if (fetched := self._fetched.pop(old, None)) is not None:
                self._release(fetched)

    def close(self) -> None:
        """Removes every template (the owner's runs have ended) and the run
        repositories fetched for them, and waits for the job directories
        still being removed."""
        for removal in self._removals:
            removal.join()
        self._removals.clear()
        for path in self._paths.values():
            shutil.rmtree(path, ignore_errors=True)
        self._paths.clear()
        self._locks.clear()
        for fetched in self._fetched.values():
            self._release(fetched)
        self._fetched.clear()


async def _has_commit(location: SnapshotLocation) -> bool:
    """Whether the commit is at the location's recorded path on this machine
    (the submitter's own runners, or a shared state directory)."""
    if not Path(location.repository).is_dir():
        return False
    found = await git(
        ["cat-file", "-e", f"{location.commit}^{{commit}}"],
        env=git_env({"GIT_DIR": location.repository}),
        check=False,
    )
    return found.returncode == 0


def work_dir(state_dir: Path) -> Path:
    """This host's job directories and checkout templates: `<state>/work/<host>`.
    Per host, because the state directory may be shared by runners on several
    machines and a pid means something only on its own host."""
    return Path(state_dir) / "work" / (socket.gethostname() or "localhost")


def sweep_work_dir(state_dir: Path) -> list[Path]:
    """Removes this host's job directories and templates whose process died (a
    crashed runner): entries of `work_dir(state_dir)` are named `<pid>-...`.

    A dead runner's job may have left step processes (its watchdog normally
    kills them): they are SIGKILLed first by the tracking id recorded in the
    directory (`watchdog.TRACKING_FILE`). A directory that some process still
    has as its working directory (or under it) is then left alone: it is
    never removed under a live process.

    So are the workspace contents a released slot moved aside when they
    would not go at once (`<work>/ws/.stale-*`: a step's leftover process
    still writing there, say): nothing uses them."""
    from preloop.runner.watchdog import TRACKING_FILE, kill_tracked_ids

    root = work_dir(state_dir)
    removed: list[Path] = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    dead = []
    for name in names:
        head = name.split("-", 1)[0]
        if head.isdigit() and not pid_exists(int(head)):
            dead.append(root / name)
    stale = stale_workspaces(root)
    if not dead and not stale:
        return removed
    ids = []
    for path in dead:
        with contextlib.suppress(OSError):
            ids.append((path / TRACKING_FILE).read_text(encoding="utf-8").strip())
    kill_tracked_ids(ids)
    in_use = _working_directories()
    for path in [*dead, *stale]:
        prefix = str(path) + os.sep
        if any(cwd == str(path) or cwd.startswith(prefix) for cwd in in_use):
            continue
        if path in stale:
            if clear_tree(path):
                removed.append(path)
            continue
        with contextlib.suppress(OSError):
            shutil.rmtree(path)
            removed.append(path)
    return removed


def _working_directories() -> set[str]:
    """The working directories of this host's processes (those we may read)."""
    out: set[str] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                out.add(os.readlink(f"/proc/{entry}/cwd"))
    return out
