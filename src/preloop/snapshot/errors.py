"""Errors of the snapshot subsystem; each names the run, path or lock it is about."""

from __future__ import annotations

from preloop.errors import PreloopError

__all__ = [
    "CacheLockTimeout",
    "MergeConflict",
    "SnapshotCaptureTimeout",
    "SnapshotError",
]


class SnapshotError(PreloopError):
    """A capture failed; nothing was queued for the run."""


class CacheLockTimeout(SnapshotError):
    """The per-entry cache lock stayed busy for the whole bounded wait."""

    def __init__(self, lock_path: str, waited: float) -> None:
        self.lock_path = lock_path
        self.waited = waited
        super().__init__(
            f"timed out after {waited:g}s waiting for the snapshot cache lock {lock_path}: "
            "another capture or cache prune holds it; if it is hung, find it with "
            f"`fuser -v {lock_path}` and stop it (a dead holder releases the lock by itself)"
        )


class SnapshotCaptureTimeout(SnapshotError):
    """The aggregate capture deadline expired; the capture was aborted."""

    def __init__(self, run_id: str, deadline: float, leftovers: list[str]) -> None:
        self.run_id = run_id
        self.deadline = deadline
        self.leftovers = leftovers
        left = (
            f"; leftovers for the startup sweep (`preloop sweep`): {', '.join(leftovers)}"
            if leftovers
            else ""
        )
        super().__init__(
            f"snapshot capture for run {run_id} exceeded the {deadline:g}s capture deadline "
            "(SNAPSHOT_CAPTURE_TIMEOUT) and was aborted; no jobs were queued. Likely causes: "
            "a wedged or very slow filesystem, a dead or hung holder of a snapshot cache lock, "
            f"or a git transfer that stopped making progress{left}"
        )


class MergeConflict(SnapshotError):
    """`head` does not merge cleanly into `base`."""

    def __init__(self, repo: str, base: str, head: str, paths: list[str]) -> None:
        self.repo = repo
        self.base = base
        self.head = head
        self.paths = paths
        shown = ", ".join(paths[:50]) + (f" and {len(paths) - 50} more" if len(paths) > 50 else "")
        super().__init__(
            f"cannot build the merge snapshot of {head} into {base} in {repo}: "
            f"{len(paths)} conflicting path(s): {shown}; resolve the conflict or pick other refs"
        )
