"""The job's checkout of its run's snapshot, and where runners find snapshots.

A run's snapshot is the bare run repository `<state>/snapshots/<run_key>`
(`preloop.snapshot`), published with the run as `SnapshotLocation` in the
run's `github` context under `preloop_snapshot`. A runner checks it out with
`git clone --shared` (no object copy: the clone borrows the run repository's
objects, which borrow the shared object cache's).

Runners on other machines reach the same path: the state directory of the
submitting `preloop run` must be on a filesystem they mount at the same path
(NFS, a cluster filesystem, a bind mount). This is the documented choice for
remote runners; nothing is served over the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preloop.errors import PreloopError
from preloop.process import CommandFailed, run_command

__all__ = ["SNAPSHOT_CONTEXT_KEY", "CheckoutError", "SnapshotLocation", "checkout_snapshot"]

SNAPSHOT_CONTEXT_KEY = "preloop_snapshot"
_CHECKOUT_TIMEOUT = 600.0


class CheckoutError(PreloopError):
    """A job's snapshot could not be checked out."""


@dataclass(frozen=True, slots=True)
class SnapshotLocation:
    """Where a run's snapshot lives: a bare repository path, its branch, commit."""

    repository: str
    branch: str
    commit: str

    def to_dict(self) -> dict[str, str]:
        return {"repository": self.repository, "branch": self.branch, "commit": self.commit}

    @classmethod
    def from_context(cls, github: dict[str, Any], where: str) -> SnapshotLocation:
        data = github.get(SNAPSHOT_CONTEXT_KEY)
        if not isinstance(data, dict):
            raise CheckoutError(
                f"{where}: the run records no snapshot location; it was not submitted by "
                "`preloop run` (resubmit it with `preloop run`)"
            )
        return cls(str(data["repository"]), str(data["branch"]), str(data["commit"]))


async def checkout_snapshot(location: SnapshotLocation, dest: Path, where: str) -> None:
    """Clones the snapshot into `dest` (which must not exist), at its commit."""
    if not Path(location.repository).is_dir():
        raise CheckoutError(
            f"{where}: the run's snapshot {location.repository} is not reachable from this "
            "machine; runners must mount the submitter's state directory at the same path"
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
                "-b",
                location.branch,
                location.repository,
                str(dest),
            ],
            timeout=_CHECKOUT_TIMEOUT,
        )
    except CommandFailed as exc:
        raise CheckoutError(f"{where}: checkout of the run's snapshot failed: {exc}") from None
