"""Remote checkout capture: fetch a URL's ref into the cache entry keyed by the
URL, then publish a run repository pointing at that commit.

An ordinary fetch error degrades: the result says "no snapshot: jobs check out
directly" with the reason. A timeout is fatal (`SnapshotCaptureTimeout`):
queueing jobs against a capture that never finished would silently change what
is tested. Credentials in the URL never appear in errors, logs or the run
repository.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from preloop.snapshot import layout
from preloop.snapshot.cache import RemoteFetchFailed, ensure_remote_cache
from preloop.snapshot.capture import (
    CaptureLimits,
    CaptureState,
    Snapshot,
    create_run_repository,
    publish_verified,
    run_capture,
)
from preloop.snapshot.errors import SnapshotError
from preloop.snapshot.gitcmd import git, git_env
from preloop.snapshot.hooks import AfterCapture
from preloop.snapshot.permits import NamespacePermits, namespace_from_url
from preloop.snapshot.work import CaptureFaults

__all__ = ["RemoteCapture", "capture_remote"]

DEGRADED = "no snapshot: jobs check out directly"


@dataclass(frozen=True, slots=True)
class RemoteCapture:
    """Either a snapshot, or None with the reason jobs check out directly."""

    snapshot: Snapshot | None
    reason: str | None = None

    @property
    def degraded(self) -> bool:
        return self.snapshot is None


async def _remote_body(cap: CaptureState, url: str, ref: str) -> Snapshot:
    entry, commit = await ensure_remote_cache(
        cap.state_dir, url, ref, run_id=cap.run_id, work=cap.work
    )
    cap.pins.append(entry.pin)
    cache_env = git_env({"GIT_DIR": str(entry.repository)})
    info = await git(["rev-parse", "--show-object-format", f"{commit}^{{tree}}"], env=cache_env)
    object_format, tree = info.stdout_text().split()
    clean_url = layout.strip_url_credentials(url)
    await cap.work.run(
        "create-repository",
        lambda: create_run_repository(
            cap.staging_repository,
            [entry.objects],
            object_format=object_format,
            run_id=cap.run_id,
            nonce=cap.nonce,
            kind="remote",
            namespace=cap.namespace,
            source=f"{clean_url} {ref}",
        ),
    )
    entry.pin.drop()
    await publish_verified(cap, commit, tree, entry.repository)
    return Snapshot(
        run_id=cap.run_id,
        kind="remote",
        repository=cap.run_repository,
        commit=commit,
        tree=tree,
        parents=(),
        cache_key=entry.key,
        namespace=cap.namespace,
        source=f"{clean_url} {ref}",
    )


async def capture_remote(
    state_dir: Path,
    url: str,
    ref: str,
    run_id: str,
    *,
    namespace: str | None = None,
    limits: CaptureLimits | None = None,
    permits: NamespacePermits | None = None,
    after_capture: AfterCapture | None = None,
    faults: CaptureFaults | None = None,
) -> RemoteCapture:
    """Fetches `ref` (branch, tag or commit) of `url` and snapshots that commit.
    The namespace defaults to the URL's owner, else `default`."""
    layout.validate_run_id(run_id)
    if not ref or ref.startswith("-") or any(c.isspace() for c in ref):
        raise SnapshotError(f"ref {ref!r} for run {run_id} is not a valid git ref or commit")
    if namespace is None:
        namespace = namespace_from_url(layout.strip_url_credentials(url))
    started = time.monotonic()
    try:
        snapshot = await run_capture(
            state_dir,
            run_id,
            "remote",
            namespace,
            lambda cap: _remote_body(cap, url, ref),
            limits=limits,
            permits=permits,
            after_capture=after_capture,
            faults=faults,
            elapsed=time.monotonic() - started,
        )
    except RemoteFetchFailed as exc:
        return RemoteCapture(None, f"{DEGRADED}: {exc.reason}")
    return RemoteCapture(snapshot)
