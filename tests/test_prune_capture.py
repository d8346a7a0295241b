"""The prune against real captures: what a timed-out capture leaves behind is
reclaimable exactly when its ownership is certain, and the startup maintenance
(sweep, then prune) reclaims what only dead captures used."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import anyio
import pytest

from preloop.snapshot import layout
from preloop.snapshot.capture import CaptureLimits
from preloop.snapshot.errors import SnapshotCaptureTimeout
from preloop.snapshot.locks import list_pins
from preloop.snapshot.prune import (
    PruneOutcome,
    PruneReport,
    SkipReason,
    SnapshotObjectCacheSweep,
    prune_snapshot_object_cache_sync,
    startup_snapshot_maintenance,
)
from preloop.snapshot.work import CaptureFaults, wait_for_abandoned_work
from preloop.snapshot.workspace import capture_workspace
from preloop.testing.object_cache import make_cache_entry, make_run_repository

WAIT = 60.0


def git(*args: str | Path) -> None:
    subprocess.run(["git", *map(str, args)], check=True, capture_output=True)


def workspace(path: Path) -> Path:
    path.mkdir(parents=True)
    git("init", "-q", "-b", "main", path)
    (path / "a.txt").write_text(f"{path.name}\n")
    git("-C", path, "add", "-A")
    git("-C", path, "-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-q", "-m", "b")
    (path / "untracked.txt").write_text("work in progress\n")
    return path


def key_of(ws: Path) -> str:
    return layout.cache_key_for_repository(ws / ".git")


def fsck(repo: Path) -> None:
    git("-C", repo, "fsck", "--connectivity-only", "--no-dangling")


def prune(state: Path) -> PruneReport:
    # Background prunes started by the post-capture hook must not absorb ours.
    assert SnapshotObjectCacheSweep.for_state_dir(state).wait_idle(WAIT)
    return prune_snapshot_object_cache_sync(state, 1)


class AfterPublication:
    """Fires the capture deadline while the step after publication (persisting
    the index sidecar) is parked; `drain` decides whether that step finishes
    before the bounded cleanup looks (ownership certain) or only later."""

    def __init__(self, drain: bool) -> None:
        self.parked = threading.Event()
        self.release = threading.Event()
        self.drain = drain

    def stall(self, point: str) -> None:
        if point == "persist-index":
            self.parked.set()
            assert self.release.wait(WAIT)

    async def gate(self) -> None:
        assert await anyio.to_thread.run_sync(self.parked.wait, WAIT)
        if self.drain:
            self.release.set()

    def faults(self) -> CaptureFaults:
        return CaptureFaults(stall=self.stall, deadline_gate=self.gate)


def test_timeout_after_publication_leaves_the_backing_entry_reclaimable(tmp_path: Path) -> None:
    state = tmp_path / "state"
    other_ws, late_ws = workspace(tmp_path / "other"), workspace(tmp_path / "late")
    other = anyio.run(capture_workspace, state, other_ws, "run-other")
    fault = AfterPublication(drain=True)
    with pytest.raises(SnapshotCaptureTimeout):
        anyio.run(lambda: capture_workspace(state, late_ws, "run-late", faults=fault.faults()))
    assert not layout.run_repository(state, "run-late").exists()
    assert list_pins(state, key_of(late_ws)) == []

    report = prune(state)
    assert report.outcome is PruneOutcome.COMPLETED
    assert [e.key for e in report.evicted] == [key_of(late_ws)]
    assert [(s.key, s.reason) for s in report.skipped] == [
        (key_of(other_ws), SkipReason.REFERENCED)
    ]
    fsck(other.repository)


def test_uncertain_staging_ownership_keeps_the_published_repository_and_its_entry(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    ws = workspace(tmp_path / "ws")
    fault = AfterPublication(drain=False)
    limits = CaptureLimits(cleanup_grace=5.0, cleanup_wait=0.2)
    try:
        with pytest.raises(SnapshotCaptureTimeout):
            anyio.run(
                lambda: capture_workspace(
                    state, ws, "run-stuck", faults=fault.faults(), limits=limits
                )
            )
        published = layout.run_repository(state, "run-stuck")
        assert published.is_dir()  # a copy may still write: nothing was removed
        report = prune(state)
        assert report.evicted == ()
        assert report.skipped[0].reason is SkipReason.REFERENCED
        fsck(published)
    finally:
        fault.release.set()

    async def startup() -> None:
        async with anyio.create_task_group() as tg:
            swept, started = await startup_snapshot_maintenance(state, tg, 1, on_done=done.append)
            assert published in swept.removed and started

    done: list[PruneReport] = []
    # The parked step is released; once it has drained, the startup maintenance
    # sweeps the dead capture's leftovers and then reclaims its entry.
    assert wait_for_abandoned_work(WAIT)
    anyio.run(startup)
    assert [e.key for e in done[0].evicted] == [key_of(ws)]


def test_startup_maintenance_sweeps_before_it_prunes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    key = make_cache_entry(state, "crashed", payload=4096)
    # A staging directory without an owner marker is a crash leftover the sweep
    # removes; until then its nested repository protects the entry.
    leftover = layout.staging_dir(state) / "run-9-0123abcd"
    make_run_repository(
        leftover / layout.STAGING_REPOSITORY_NAME, layout.cache_repository(state, key)
    )
    assert prune(state).skipped[0].reason is SkipReason.REFERENCED
    done: list[PruneReport] = []

    async def startup() -> None:
        async with anyio.create_task_group() as tg:
            swept, started = await startup_snapshot_maintenance(state, tg, 1, on_done=done.append)
            assert leftover in swept.removed and started

    anyio.run(startup)
    assert [e.key for e in done[0].evicted] == [key]
