"""The aggregate capture deadline and its bounded cleanup, with a fake `git`
that hangs where told (leaving a grandchild) and stalls injected into the
blocking copies. The deadline is fired through the test gate exactly when the
hang or stall is in place, so no test depends on timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from preloop import process
from preloop.snapshot import (
    CaptureLimits,
    SnapshotCaptureTimeout,
    capture_workspace,
    layout,
    sweep_workspace_snapshots,
)
from preloop.snapshot.locks import list_pins, try_acquire_cache_lock
from preloop.snapshot.work import CaptureFaults, wait_for_abandoned_work
from snapshot_support import FakeGit, Stall, alive, gate, git, make_repo

LONG = CaptureLimits(timeout=600, cleanup_grace=30, cleanup_wait=10)


@pytest.fixture
def fake_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGit]:
    fake = FakeGit(tmp_path, monkeypatch)
    yield fake
    fake.close()


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    repo = make_repo(tmp_path / "ws", {"a.txt": "a\n", "dir/b.txt": "b\n"})
    (repo / "a.txt").write_text("changed\n")
    return repo


def key_of(ws: Path) -> str:
    return layout.cache_key_for_repository(ws / ".git")


def timed_out_capture(
    state: Path, ws: Path, run_id: str, limits: CaptureLimits, faults: CaptureFaults
) -> SnapshotCaptureTimeout:
    with pytest.raises(SnapshotCaptureTimeout) as info:
        anyio.run(lambda: capture_workspace(state, ws, run_id, limits=limits, faults=faults))
    return info.value


def staging_entries(state: Path) -> list[str]:
    try:
        return sorted(os.listdir(layout.staging_dir(state)))
    except FileNotFoundError:
        return []


@pytest.mark.parametrize("group_kill", [True, False], ids=["group-kill", "group-kill-disabled"])
def test_outer_timeout_kills_git_group_and_cleans_up(
    tmp_path: Path,
    ws: Path,
    fake_git: FakeGit,
    monkeypatch: pytest.MonkeyPatch,
    group_kill: bool,
) -> None:
    monkeypatch.setattr(process, "_KILL_WHOLE_GROUP", group_kill)
    state = tmp_path / "state"
    fake_git.hang_on(r" add --all")
    error = timed_out_capture(
        state, ws, "hang-1", LONG, CaptureFaults(deadline_gate=fake_git.wait_for_hang)
    )
    if not group_kill:
        # Without the group kill the fake git's grandchild outlives the
        # deadline: the assertion below is what catches that.
        assert alive(fake_git.pids[-1])
        return
    assert fake_git.grandchild_exited(), "git's descendant survived the deadline"
    message = str(error)
    assert "run hang-1" in message and "600s capture deadline" in message
    assert "no jobs were queued" in message and "dead or hung holder" in message
    assert staging_entries(state) == []
    assert not layout.run_repository(state, "hang-1").exists()
    assert list_pins(state, key_of(ws)) == []
    lock = try_acquire_cache_lock(state, key_of(ws))
    assert lock is not None, "the cache lock is still held after the timeout"
    lock.release()
    # The cache entry is usable by the next capture.
    monkeypatch.delenv("PRELOOP_FAKE_GIT_HANG")
    snap = anyio.run(lambda: capture_workspace(state, ws, "after"))
    assert git("cat-file", "-p", "refs/heads/snapshot:a.txt", cwd=snap.repository) == "changed\n"


def test_real_timer_expires(tmp_path: Path, ws: Path, fake_git: FakeGit) -> None:
    fake_git.hang_on(r" add --all")
    error = timed_out_capture(
        tmp_path / "state",
        ws,
        "timer",
        CaptureLimits(timeout=1.5, cleanup_grace=30),
        CaptureFaults(),
    )
    assert "1.5s capture deadline" in str(error)
    assert staging_entries(tmp_path / "state") == []


def test_timeout_during_cache_clone_leaves_no_temporary(
    tmp_path: Path, ws: Path, fake_git: FakeGit
) -> None:
    state = tmp_path / "state"
    fake_git.hang_on(r" clone --bare")
    timed_out_capture(state, ws, "clone", LONG, CaptureFaults(deadline_gate=fake_git.wait_for_hang))
    assert fake_git.grandchild_exited()
    assert [n for n in os.listdir(layout.cache_dir(state)) if ".tmp-" in n] == []
    assert not layout.cache_repository(state, key_of(ws)).exists()


def test_timeout_after_publication_removes_only_this_run(tmp_path: Path, ws: Path) -> None:
    """The deadline fires once the run repository is published (the capture
    is persisting its index): the blocking step drains, so this run's
    repository goes and another run's stays."""
    state = tmp_path / "state"
    other = anyio.run(lambda: capture_workspace(state, ws, "other-run"))
    stall = Stall("persist-index")  # runs after publication

    async def published() -> None:
        await stall.wait_entered()
        assert layout.run_repository(state, "late").is_dir()
        stall.release()  # the deadline fires before the capture resumes

    try:
        timed_out_capture(
            state, ws, "late", LONG, CaptureFaults(stall=stall, deadline_gate=published)
        )
    finally:
        stall.release()
    assert not layout.run_repository(state, "late").exists()
    assert staging_entries(state) == []
    # Another run's snapshot and the shared cache survive, and nothing pins it.
    assert git("rev-parse", "refs/heads/snapshot", cwd=other.repository).strip() == other.commit
    git("fsck", "--no-dangling", cwd=other.repository)
    assert layout.cache_repository(state, key_of(ws)).is_dir()
    assert list_pins(state, key_of(ws)) == []


def test_uncertain_ownership_keeps_published_repository_until_the_sweep(
    tmp_path: Path, ws: Path
) -> None:
    """A blocking copy that does not drain within the wait keeps both staging
    and the published repository; the sweep removes them once it drained."""
    state = tmp_path / "state"
    stall = Stall("persist-index")  # runs after publication
    limits = CaptureLimits(timeout=600, cleanup_grace=5, cleanup_wait=0.05)
    try:
        error = timed_out_capture(
            state,
            ws,
            "stuck",
            limits,
            CaptureFaults(stall=stall, deadline_gate=stall.wait_entered),
        )
        # The error came back while the copy is still blocked.
        assert not stall._release.is_set()
        run_repo = layout.run_repository(state, "stuck")
        assert run_repo.is_dir()
        leftovers = staging_entries(state)
        assert len(leftovers) == 2 and all(n.startswith("stuck-") for n in leftovers)
        assert str(run_repo) in error.leftovers
        assert "preloop sweep" in str(error)
        # While the copy may still write, the sweep keeps everything.
        report = sweep_workspace_snapshots(state)
        assert report.removed == [] and run_repo.is_dir()
    finally:
        stall.release()
    assert wait_for_abandoned_work(30)
    report = sweep_workspace_snapshots(state)
    assert not run_repo.exists()
    assert staging_entries(state) == []
    assert run_repo in report.removed


def test_cleanup_is_bounded_when_removal_stalls(
    tmp_path: Path, ws: Path, fake_git: FakeGit
) -> None:
    """A wedged removal: the error still returns after the grace, and the
    run-scoped leftovers stay identifiable for the sweep."""
    state = tmp_path / "state"
    fake_git.hang_on(r" add --all")
    stall = Stall("remove")
    limits = CaptureLimits(timeout=600, cleanup_grace=0.2, cleanup_wait=0.1)
    try:
        error = timed_out_capture(
            state,
            ws,
            "wedged",
            limits,
            CaptureFaults(stall=stall, deadline_gate=fake_git.wait_for_hang),
        )
        assert stall.entered.is_set() and not stall._release.is_set()
        assert fake_git.grandchild_exited()
        leftovers = staging_entries(state)
        assert leftovers and all(n.startswith("wedged-") for n in leftovers)
        assert any(p.endswith(".owner") for p in error.leftovers)
    finally:
        stall.release()
    assert wait_for_abandoned_work(30)
    sweep_workspace_snapshots(state)
    assert staging_entries(state) == []
    assert not layout.run_repository(state, "wedged").exists()


CRASHER = """
import sys, anyio
from pathlib import Path
from preloop.snapshot import capture_workspace
anyio.run(lambda: capture_workspace(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
"""


def test_sweep_removes_a_crashed_capture_but_never_a_live_one(
    tmp_path: Path, ws: Path, fake_git: FakeGit
) -> None:
    state = tmp_path / "state"
    fake_git.hang_on(r" add --all")
    # A capture in another process hangs in git; it is SIGKILLed like a crash.
    crashed = subprocess.Popen([sys.executable, "-c", CRASHER, str(state), str(ws), "crashed"])
    fake_git.wait_for_hang_blocking()
    os.kill(crashed.pid, signal.SIGKILL)
    crashed.wait()
    os.killpg(os.getpgid(fake_git.pids[-1]), signal.SIGKILL)  # the crash left git's group
    assert layout.run_repository(state, "crashed").exists()  # the reservation

    async def live_capture_and_sweep() -> list[Path]:
        reports: list[list[Path]] = []
        async with anyio.create_task_group() as tg:

            async def live() -> None:
                with pytest.raises(SnapshotCaptureTimeout):
                    await capture_workspace(
                        state,
                        ws,
                        "live",
                        limits=LONG,
                        faults=CaptureFaults(deadline_gate=gate(fake_git.wait_for_hang, sweep)),
                    )

            async def sweep() -> None:
                report = await anyio.to_thread.run_sync(sweep_workspace_snapshots, state)
                reports.append(report.removed)
                live_staging = [n for n in staging_entries(state) if n.startswith("live-")]
                assert len(live_staging) == 2, "the sweep touched a live capture"
                assert layout.run_repository(state, "live").exists()

            tg.start_soon(live)
        return reports[0]

    removed = anyio.run(live_capture_and_sweep)
    assert layout.run_repository(state, "crashed") in removed
    assert not layout.run_repository(state, "crashed").exists()
    assert staging_entries(state) == []
