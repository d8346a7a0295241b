"""What every capture kind shares: the owner marker and staging directory, the
run repository and its publication, and the aggregate deadline with its
bounded cleanup (seed 000, "Aggregate capture timeout").

A capture's life on disk:

1. `snapshots/.staging/<run_id>-<nonce>.owner` (pid + process start time) is
   written, then `snapshots/<run_id>` is reserved (an empty directory, created
   exclusively: a second capture of the same run fails here), then the staging
   directory `snapshots/.staging/<run_id>-<nonce>/` is created.
2. The run repository is built at `<staging>/repository.git` (bare, its
   `objects/info/alternates` naming the cache entry) and published by renaming
   it onto the reserved `snapshots/<run_id>`.
3. Accepted: the staging directory, then the owner marker are removed. A run
   repository without an owner marker is accepted and never swept.

On expiry of the deadline the cleanup is bounded by `cleanup_grace`: it waits at
most `cleanup_wait` for blocking copies; when they drained, ownership is certain
and the staging directory and this run's repository are removed; otherwise
both are left (with their owner marker) for `sweep_workspace_snapshots`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio

from preloop.snapshot import layout
from preloop.snapshot.errors import SnapshotCaptureTimeout, SnapshotError
from preloop.snapshot.gitcmd import git, git_env
from preloop.snapshot.hooks import AfterCapture, run_after_capture
from preloop.snapshot.limits import (
    SNAPSHOT_CAPTURE_CLEANUP_GRACE,
    SNAPSHOT_CAPTURE_CLEANUP_WAIT,
    SNAPSHOT_CAPTURE_TIMEOUT,
)
from preloop.snapshot.locks import CachePin
from preloop.snapshot.owner import write_marker
from preloop.snapshot.permits import NamespacePermits, default_permits, validate_namespace
from preloop.snapshot.work import BlockingWork, CaptureFaults

__all__ = [
    "CAPTURE_FILE",
    "SNAPSHOT_REF",
    "CaptureKind",
    "CaptureLimits",
    "Snapshot",
    "create_run_repository",
    "run_capture",
]

CaptureKind = Literal["workspace", "remote", "merge"]

# The branch of a run repository that holds the snapshot commit.
SNAPSHOT_REF = "refs/heads/snapshot"
# Inside a run repository: the nonce of the capture that published it, so the
# sweep removes `snapshots/<run_id>` only on behalf of the capture that made it.
CAPTURE_FILE = "preloop-capture"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A published run repository: `commit` is at `refs/heads/snapshot` of the
    bare repository `repository`, whose objects live in cache entry `cache_key`.
    `on_head`: the tree is that of the workspace's HEAD (`parents[0]`): the
    work tree was clean, and HEAD itself is what was submitted."""

    run_id: str
    kind: CaptureKind
    repository: Path
    commit: str
    tree: str
    parents: tuple[str, ...]
    cache_key: str
    namespace: str
    source: str
    ref: str = SNAPSHOT_REF
    on_head: bool = False


@dataclass(frozen=True, slots=True)
class CaptureLimits:
    """The aggregate deadline and the cleanup bounds (seconds); the defaults
    are the seed's constants, tests shorten them."""

    timeout: float = SNAPSHOT_CAPTURE_TIMEOUT
    cleanup_grace: float = SNAPSHOT_CAPTURE_CLEANUP_GRACE
    cleanup_wait: float = SNAPSHOT_CAPTURE_CLEANUP_WAIT


@dataclass
class CaptureState:
    """One capture in progress: its files and what it holds."""

    state_dir: Path
    run_id: str
    kind: CaptureKind
    namespace: str
    work: BlockingWork
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    pins: list[CachePin] = field(default_factory=list)
    reserved: bool = False
    published: bool = False
    staging_created: bool = False

    @property
    def staging(self) -> Path:
        return layout.staging_path(self.state_dir, self.run_id, self.nonce)

    @property
    def marker(self) -> Path:
        return layout.owner_marker_path(self.staging)

    @property
    def run_repository(self) -> Path:
        return layout.run_repository(self.state_dir, self.run_id)

    @property
    def staging_repository(self) -> Path:
        return layout.staging_repository(self.staging)

    def leftovers(self) -> list[str]:
        """The run-scoped paths this capture may have left."""
        found = [str(self.staging), str(self.marker)]
        if self.reserved:
            found.append(str(self.run_repository))
        return found


def _start(cap: CaptureState) -> None:
    staging_root = layout.staging_dir(cap.state_dir)
    staging_root.mkdir(parents=True, exist_ok=True)
    write_marker(
        cap.marker,
        {"run_id": cap.run_id, "nonce": cap.nonce, "kind": cap.kind, "namespace": cap.namespace},
    )
    try:
        cap.run_repository.mkdir()
    except FileExistsError:
        raise SnapshotError(
            f"run {cap.run_id} already has a snapshot repository at {cap.run_repository}: "
            "use a new run id, or run `preloop sweep` if an earlier capture of this run crashed"
        ) from None
    cap.reserved = True
    cap.staging.mkdir()
    cap.staging_created = True


def _accept(cap: CaptureState) -> None:
    shutil.rmtree(cap.staging)
    cap.marker.unlink()


def _rmtree(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


def _remove_all(cap: CaptureState) -> None:
    """Removes everything this capture created; only called when no blocking
    step of it is still running (ownership is certain)."""
    for pin in cap.pins:
        pin.drop()
    if cap.reserved:
        _rmtree(cap.run_repository)
    _rmtree(cap.staging)
    with contextlib.suppress(FileNotFoundError):
        cap.marker.unlink()


async def _bounded_cleanup(cap: CaptureState, limits: CaptureLimits) -> list[str]:
    """Removes the capture's files if its blocking work drains in time; returns
    what is left. Returns within `limits.cleanup_grace`, whatever the filesystem does."""
    left = cap.leftovers()
    with anyio.move_on_after(limits.cleanup_grace, shield=True):
        drained = await cap.work.wait_idle(min(limits.cleanup_wait, limits.cleanup_grace))
        if not drained:
            return left  # a copy may still write into staging: leave it, never race it
        await cap.work.run("remove", _remove_all, cap)
        left = []
    return left


async def run_capture(
    state_dir: Path,
    run_id: str,
    kind: CaptureKind,
    namespace: str,
    body: Callable[[CaptureState], Awaitable[Snapshot]],
    *,
    limits: CaptureLimits | None = None,
    permits: NamespacePermits | None = None,
    after_capture: AfterCapture | None = None,
    faults: CaptureFaults | None = None,
    elapsed: float = 0.0,
) -> Snapshot:
    """Runs `body` under a namespace permit and the aggregate deadline (of which
    `elapsed` seconds were already spent by the caller's preparation), with the
    bounded cleanup on expiry or failure, then the post-capture hooks."""
    layout.validate_run_id(run_id)
    validate_namespace(namespace)
    limits = limits or CaptureLimits()
    permits = permits or default_permits()
    faults = faults or CaptureFaults()
    state_dir = Path(state_dir).absolute()
    async with permits.hold(namespace):
        nonce = secrets.token_hex(8)
        work = BlockingWork(f"{run_id}-{nonce}", faults)
        cap = CaptureState(state_dir, run_id, kind, namespace, work, nonce=nonce)
        snapshot = await _deadline(cap, body, limits, faults, elapsed)
    await run_after_capture(state_dir, snapshot.cache_key, after_capture)
    return snapshot


async def _deadline(
    cap: CaptureState,
    body: Callable[[CaptureState], Awaitable[Snapshot]],
    limits: CaptureLimits,
    faults: CaptureFaults,
    elapsed: float,
) -> Snapshot:
    async def steps() -> Snapshot:
        await cap.work.run("start", _start, cap)
        snapshot = await body(cap)
        await cap.work.run("accept", _accept, cap)
        return snapshot

    result: list[Snapshot] = []
    failure: list[Exception] = []
    try:
        with anyio.move_on_after(max(0.0, limits.timeout - elapsed)) as deadline:
            gate = faults.deadline_gate
            if gate is None:
                result.append(await steps())
            else:
                async with anyio.create_task_group() as tg:

                    async def fire() -> None:
                        await gate()
                        deadline.cancel()

                    tg.start_soon(fire)
                    try:
                        result.append(await steps())
                    except Exception as exc:  # re-raised below, outside the task group
                        failure.append(exc)
                    tg.cancel_scope.cancel()
        if failure:
            raise failure[0]
    except BaseException:
        # A failure (or the caller's own cancellation): the same bounded cleanup.
        await _bounded_cleanup(cap, limits)
        cap.work.finish()
        raise
    if result:
        for pin in cap.pins:
            pin.drop()
        cap.work.finish()
        return result[0]
    assert deadline.cancel_called
    leftovers = await _bounded_cleanup(cap, limits)
    cap.work.finish()
    raise SnapshotCaptureTimeout(cap.run_id, limits.timeout, leftovers)


def create_run_repository(
    path: Path,
    alternates: Sequence[Path],
    *,
    object_format: str,
    run_id: str,
    nonce: str,
    kind: CaptureKind,
    namespace: str,
    source: str,
) -> None:
    """Writes a bare repository at `path` whose objects come from `alternates`
    (real paths of `objects` directories), HEAD -> refs/heads/snapshot. Built by
    hand: `git init` would copy templates and cost a process."""
    path.mkdir()
    for sub in ("objects/info", "objects/pack", "refs/heads", "refs/tags"):
        (path / sub).mkdir(parents=True)
    (path / "HEAD").write_text(f"ref: {SNAPSHOT_REF}\n")
    version = 0 if object_format == "sha1" else 1
    extensions = "" if version == 0 else f"[extensions]\n\tobjectformat = {object_format}\n"
    quoted_source = source.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    (path / "config").write_text(
        "[core]\n"
        f"\trepositoryformatversion = {version}\n"
        "\tfilemode = true\n"
        "\tbare = true\n"
        "[gc]\n"
        "\tauto = 0\n"
        f"{extensions}"
        "[preloop]\n"
        f"\trunId = {run_id}\n"
        f"\tkind = {kind}\n"
        f"\tnamespace = {namespace}\n"
        f'\tsource = "{quoted_source}"\n'
    )
    (path / CAPTURE_FILE).write_text(nonce + "\n")
    # The alternates file is what protects the cache entry from eviction once
    # the capture's pin is dropped: write it atomically.
    tmp = path / "objects/info/alternates.tmp"
    tmp.write_text("".join(f"{os.path.realpath(a)}\n" for a in alternates))
    os.rename(tmp, path / "objects/info/alternates")


def write_snapshot_ref(repository: Path, commit: str) -> None:
    """Points `refs/heads/snapshot` of `repository` at `commit`."""
    (repository / SNAPSHOT_REF).write_text(commit + "\n")


def publish(cap: CaptureState) -> None:
    """Renames the staging repository onto the reserved `snapshots/<run_id>`
    (replacing the empty reservation atomically)."""
    os.rename(cap.staging_repository, cap.run_repository)
    cap.published = True


def _loose_object(repository: Path, oid: str) -> bytes | None:
    """The inflated loose object `oid` as `repository` finds it (its own
    objects, then its alternates), or None when no object directory has it
    loose (it may be packed) or it cannot be read."""
    objects = [repository / "objects"]
    with contextlib.suppress(OSError):
        alternates = (repository / "objects/info/alternates").read_text().splitlines()
        objects += [Path(a) for a in alternates if a and not a.startswith("#")]
    for directory in objects:
        try:
            raw = (directory / oid[:2] / oid[2:]).read_bytes()
        except OSError:
            continue
        try:
            return zlib.decompress(raw)
        except zlib.error:
            return None
    return None


def _published_tree(repository: Path, commit: str) -> str | None:
    """The tree of `refs/heads/snapshot` of `repository` read without git, when
    the ref names `commit` and that commit is a loose object (what
    `commit-tree` just wrote); None when that cannot be told this way."""
    try:
        ref = (repository / SNAPSHOT_REF).read_text().strip()
    except OSError:
        return None
    body = _loose_object(repository, commit) if ref == commit else None
    if body is None or not body.startswith(b"commit "):
        return None
    _, _, rest = body.partition(b"\0")
    first = rest.split(b"\n", 1)[0]
    if not first.startswith(b"tree "):
        return None
    return first[5:].decode("ascii", "replace")


def _write_ref_and_publish(cap: CaptureState, commit: str) -> str | None:
    write_snapshot_ref(cap.staging_repository, commit)
    publish(cap)
    return _published_tree(cap.run_repository, commit)


async def publish_verified(cap: CaptureState, commit: str, tree: str, cache: Path) -> None:
    """Points the staging repository's snapshot ref at `commit`, publishes it as
    `snapshots/<run_id>`, and checks the published ref resolves to `tree`: jobs
    must never be handed another tree because the cache entry `cache` is damaged.
    The check reads the loose commit (what `commit-tree` wrote) through the
    published repository's alternates in the same blocking step; only when
    that does not confirm `tree` does git resolve the ref (a process less on
    the common path, the same verdict on the others)."""
    found = await cap.work.run("publish", _write_ref_and_publish, cap, commit)
    if found == tree:
        return
    verified = await git(
        ["rev-parse", "--verify", "--quiet", "refs/heads/snapshot^{tree}"],
        env=git_env({"GIT_DIR": str(cap.run_repository)}),
        check=False,
    )
    if verified.stdout_text().strip() != tree:
        raise SnapshotError(
            f"published snapshot {cap.run_repository} of run {cap.run_id} does not resolve to "
            f"tree {tree}: the cache entry {cache} is damaged; remove it and retry"
        )
