"""Workspace, remote and merge snapshots of git repositories (DESIGN.md section 3).

- `capture_workspace`, `capture_remote`, `capture_merge`: publish a bare run
  repository `<state>/snapshots/<run_id>` whose `refs/heads/snapshot` is the
  captured commit, sharing objects with `<state>/snapshot-object-cache/<key>.git`.
- `ensure_object_cache`: the shared cache entry, refreshed under its lock, pinned.
- `sweep_workspace_snapshots`: the startup sweep of leftovers of dead captures.
- `NamespacePermits`: at most `PRELOOP_SNAPSHOT_CONCURRENCY_PER_NAMESPACE`
  concurrent captures per namespace.

- `prune_snapshot_object_cache`, `SnapshotObjectCacheSweep`,
  `startup_snapshot_maintenance`: the object cache's byte cap. Importing this
  package registers the best-effort post-capture prune, so library users get
  the cap without wiring anything.

Paths: `preloop.snapshot.layout`; cache lock and pins: `preloop.snapshot.locks`;
time limits: `preloop.snapshot.limits`; post-capture hooks: `preloop.snapshot.hooks`.
"""

from preloop.snapshot.cache import CacheEntry, ensure_object_cache
from preloop.snapshot.capture import SNAPSHOT_REF, CaptureLimits, Snapshot
from preloop.snapshot.errors import (
    CacheLockTimeout,
    MergeConflict,
    SnapshotCaptureTimeout,
    SnapshotError,
)
from preloop.snapshot.hooks import register_after_capture, unregister_after_capture
from preloop.snapshot.limits import (
    SNAPSHOT_CAPTURE_CLEANUP_GRACE,
    SNAPSHOT_CAPTURE_CLEANUP_WAIT,
    SNAPSHOT_CAPTURE_TIMEOUT,
)
from preloop.snapshot.locks import CachePin
from preloop.snapshot.merge import capture_merge
from preloop.snapshot.permits import NamespacePermits, default_permits
from preloop.snapshot.prune import (
    SnapshotObjectCacheSweep,
    prune_snapshot_object_cache,
    startup_snapshot_maintenance,
)
from preloop.snapshot.remote import RemoteCapture, capture_remote
from preloop.snapshot.sweep import SweepReport, sweep_workspace_snapshots
from preloop.snapshot.workspace import capture_workspace

__all__ = [
    "SNAPSHOT_CAPTURE_CLEANUP_GRACE",
    "SNAPSHOT_CAPTURE_CLEANUP_WAIT",
    "SNAPSHOT_CAPTURE_TIMEOUT",
    "SNAPSHOT_REF",
    "CacheEntry",
    "CacheLockTimeout",
    "CachePin",
    "CaptureLimits",
    "MergeConflict",
    "NamespacePermits",
    "RemoteCapture",
    "Snapshot",
    "SnapshotCaptureTimeout",
    "SnapshotError",
    "SnapshotObjectCacheSweep",
    "SweepReport",
    "capture_merge",
    "capture_remote",
    "capture_workspace",
    "default_permits",
    "ensure_object_cache",
    "prune_snapshot_object_cache",
    "register_after_capture",
    "startup_snapshot_maintenance",
    "sweep_workspace_snapshots",
    "unregister_after_capture",
]
