"""Run repositories over the shared object cache for commits already in it.

`held_run_repository` writes `<state>/snapshots/<name>` (held by this
process) over a pinned cache entry's objects, branch `snapshot` at a commit:
what a runner fetching a run's snapshot from the store (`preloop.snapshot.
transport`) and `preloop rerun`, bringing back an ended run's snapshot
(`restore_snapshot`), both end with. A crash leaves a holder marker of a
dead process: the run-repository sweep removes the repository.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from preloop.snapshot import layout
from preloop.snapshot.cache import missing_objects
from preloop.snapshot.capture import create_run_repository, write_snapshot_ref
from preloop.snapshot.errors import SnapshotError
from preloop.snapshot.holders import hold_run_repository, release_run_repository
from preloop.snapshot.hooks import run_after_capture
from preloop.snapshot.locks import CachePin, acquire_cache_lock_async

__all__ = ["held_run_repository", "object_format_of", "restore_snapshot"]


def object_format_of(commit: str) -> str:
    """The object format of a repository by one of its object names."""
    return "sha256" if len(commit) == 64 else "sha1"


def held_run_repository(state_dir: Path, name: str, entry: Path, commit: str, source: str) -> None:
    """Writes the run repository `<state>/snapshots/<name>`, held by this
    process, over the objects of cache entry `entry` (pinned by the caller),
    branch `snapshot` at `commit`; on failure nothing is left held."""
    try:
        hold_run_repository(state_dir, name)
        create_run_repository(
            layout.run_repository(state_dir, name),
            [entry / "objects"],
            object_format=object_format_of(commit),
            run_id=name,
            nonce=secrets.token_hex(8),
            kind="workspace",
            namespace="default",
            source=source,
        )
        write_snapshot_ref(layout.run_repository(state_dir, name), commit)
    except BaseException:
        release_run_repository(state_dir, name)
        raise


async def restore_snapshot(
    state_dir: Path, repo_key: str, commits: list[str], name: str, where: str
) -> Path:
    """For a re-run: the run repository `<state>/snapshots/<name>` (held by
    this process; `release_run_repository(state_dir, name)` removes it) with
    branch `snapshot` at `commits[0]`, an ended run's snapshot, over the
    objects object-cache entry `repo_key` still has. Every one of `commits`
    must be there (a capture's commits are never pruned from an entry, but a
    whole entry may be evicted): else a `SnapshotError` saying so."""
    state_dir = Path(state_dir).absolute()
    gone = (
        f"{where}: its snapshot {commits[0][:12]} is no longer in this host's object cache "
        "(the cache was pruned, or the run was submitted from another host): run the "
        "workflow again with `preloop run`"
    )
    try:
        repository = layout.cache_repository(state_dir, repo_key)
    except ValueError:
        raise SnapshotError(gone) from None
    lock = await acquire_cache_lock_async(state_dir, repo_key)
    try:
        if not repository.is_dir() or await missing_objects(repository, commits):
            raise SnapshotError(gone)
        pin = CachePin.create(state_dir, repo_key)
    finally:
        lock.release()
    try:
        held_run_repository(state_dir, name, repository, commits[0], f"rerun:{repo_key}")
    finally:
        pin.drop()  # the run repository's alternates protect the entry from here on
    # A use of the entry, for the object-cache cap's LRU order.
    await run_after_capture(state_dir, repo_key)
    return layout.run_repository(state_dir, name)
