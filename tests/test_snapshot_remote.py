"""Remote checkout and prebuilt merge captures against real repositories."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from preloop.snapshot import (
    CaptureLimits,
    MergeConflict,
    SnapshotCaptureTimeout,
    capture_merge,
    capture_remote,
    layout,
)
from preloop.snapshot.locks import list_pins
from preloop.snapshot.work import CaptureFaults
from snapshot_support import FakeGit, git, make_repo


@pytest.fixture
def fake_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGit]:
    fake = FakeGit(tmp_path, monkeypatch)
    yield fake
    fake.close()


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    work = make_repo(tmp_path / "work", {"r.txt": "remote v1\n"})
    git("tag", "v1", cwd=work)
    (work / "r.txt").write_text("remote v2\n")
    git("commit", "-q", "-am", "v2", cwd=work)
    bare = tmp_path / "origin.git"
    git("clone", "-q", "--bare", str(work), str(bare), cwd=tmp_path)
    return bare


def test_remote_capture_of_branch_tag_and_commit(tmp_path: Path, origin: Path) -> None:
    state = tmp_path / "state"
    url = f"file://{origin}"
    main = anyio.run(lambda: capture_remote(state, url, "main", "r-main"))
    assert main.snapshot is not None and not main.degraded
    snap = main.snapshot
    assert snap.commit == git("rev-parse", "main", cwd=origin).strip()
    assert git("show", "refs/heads/snapshot:r.txt", cwd=snap.repository) == "remote v2\n"
    git("fsck", "--no-dangling", cwd=snap.repository)
    tag = anyio.run(lambda: capture_remote(state, url, "v1", "r-tag"))
    assert tag.snapshot is not None
    assert git("show", "refs/heads/snapshot:r.txt", cwd=tag.snapshot.repository) == "remote v1\n"
    v1 = git("rev-parse", "v1^{commit}", cwd=origin).strip()
    by_oid = anyio.run(lambda: capture_remote(state, url, v1, "r-oid"))
    assert by_oid.snapshot is not None and by_oid.snapshot.commit == v1
    # One cache entry for the URL, no pins left, nothing staged.
    assert tag.snapshot.cache_key == snap.cache_key == by_oid.snapshot.cache_key
    assert list_pins(state, snap.cache_key) == []
    assert os.listdir(layout.staging_dir(state)) == []


def test_unreachable_remote_degrades_with_reason_and_no_credentials(
    tmp_path: Path, fake_git: FakeGit
) -> None:
    state = tmp_path / "state"
    calls = tmp_path / "git-calls.log"
    fake_git.log_to(calls)
    url = "https://builder:s3cr3t-token@127.0.0.1:9/acme/app.git"
    result = anyio.run(lambda: capture_remote(state, url, "main", "r-down"))
    assert result.degraded and result.snapshot is None
    assert result.reason is not None
    assert result.reason.startswith("no snapshot: jobs check out directly: ")
    assert "127.0.0.1" in result.reason and "main" in result.reason
    assert "s3cr3t" not in result.reason and "builder" not in result.reason
    # Not even git's command line (visible in the process list) carries them.
    assert "fetch" in calls.read_text() and "s3cr3t" not in calls.read_text()
    assert not layout.run_repository(state, "r-down").exists()
    assert os.listdir(layout.staging_dir(state)) == []
    # The failed first fetch left no cache entry and no temporary behind.
    assert [n for n in os.listdir(layout.cache_dir(state)) if not n.endswith(".lock")] == []


def test_missing_ref_degrades(tmp_path: Path, origin: Path) -> None:
    result = anyio.run(
        lambda: capture_remote(tmp_path / "state", f"file://{origin}", "no-such-branch", "r-x")
    )
    assert result.degraded and result.reason is not None and "no-such-branch" in result.reason


def test_hanging_remote_times_out_fatally(tmp_path: Path, origin: Path, fake_git: FakeGit) -> None:
    state = tmp_path / "state"
    fake_git.hang_on(r" fetch ")
    url = f"file://{origin}"
    with pytest.raises(SnapshotCaptureTimeout) as info:
        anyio.run(
            lambda: capture_remote(
                state,
                url,
                "main",
                "r-hang",
                limits=CaptureLimits(timeout=600),
                faults=CaptureFaults(deadline_gate=fake_git.wait_for_hang),
            )
        )
    assert "run r-hang" in str(info.value)
    assert fake_git.grandchild_exited()
    assert not layout.run_repository(state, "r-hang").exists()
    assert os.listdir(layout.staging_dir(state)) == []


def test_credentials_never_reach_the_run_repository(tmp_path: Path, origin: Path) -> None:
    # git accepts (and ignores) a user name in a file:// URL with a host part.
    url = f"file://user:pw-secret@localhost{origin}"
    result = anyio.run(lambda: capture_remote(tmp_path / "state", url, "main", "r-cred"))
    assert result.snapshot is not None, result.reason
    config = (result.snapshot.repository / "config").read_text()
    assert "pw-secret" not in config and str(origin) in config
    cache = layout.cache_repository(tmp_path / "state", result.snapshot.cache_key)
    assert "pw-secret" not in (cache / "config").read_text()


@pytest.fixture
def branches(tmp_path: Path) -> Path:
    repo = make_repo(tmp_path / "m", {"shared.txt": "1\n2\n3\n", "c1.txt": "x\n", "c2.txt": "y\n"})
    git("checkout", "-q", "-b", "feature", cwd=repo)
    (repo / "feature.txt").write_text("feature\n")
    (repo / "shared.txt").write_text("1\n2\n3 feature\n")
    (repo / "c1.txt").write_text("feature side\n")
    (repo / "c2.txt").write_text("feature side\n")
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "feature", cwd=repo)
    git("checkout", "-q", "-b", "clean-base", "main", cwd=repo)
    (repo / "shared.txt").write_text("1 base\n2\n3\n")
    git("commit", "-q", "-am", "base side", cwd=repo)
    git("checkout", "-q", "-b", "conflicting", "main", cwd=repo)
    (repo / "c1.txt").write_text("base side\n")
    (repo / "c2.txt").write_text("base side\n")
    git("commit", "-q", "-am", "conflicting", cwd=repo)
    git("checkout", "-q", "main", cwd=repo)
    return repo


def test_merge_capture(tmp_path: Path, branches: Path) -> None:
    from snapshot_support import repo_state

    before = repo_state(branches)
    snap = anyio.run(
        lambda: capture_merge(tmp_path / "state", branches, "clean-base", "feature", "merge-1")
    )
    assert repo_state(branches) == before
    base = git("rev-parse", "clean-base", cwd=branches).strip()
    head = git("rev-parse", "feature", cwd=branches).strip()
    assert snap.parents == (base, head)
    parents = git("rev-list", "--parents", "-n1", "refs/heads/snapshot", cwd=snap.repository)
    assert parents.split() == [snap.commit, base, head]
    shown = git("show", "refs/heads/snapshot:shared.txt", cwd=snap.repository)
    assert shown == "1 base\n2\n3 feature\n"
    assert git("show", "refs/heads/snapshot:feature.txt", cwd=snap.repository) == "feature\n"
    git("fsck", "--no-dangling", cwd=snap.repository)
    again = anyio.run(
        lambda: capture_merge(tmp_path / "state", branches, "clean-base", "feature", "merge-2")
    )
    assert again.commit == snap.commit  # fixed identity and date


def test_merge_conflict_lists_paths_and_leaves_nothing(tmp_path: Path, branches: Path) -> None:
    state = tmp_path / "state"
    with pytest.raises(MergeConflict) as info:
        anyio.run(lambda: capture_merge(state, branches, "conflicting", "feature", "merge-x"))
    assert info.value.paths == ["c1.txt", "c2.txt"]
    assert "c1.txt, c2.txt" in str(info.value) and "conflicting" in str(info.value)
    assert not layout.run_repository(state, "merge-x").exists()
    assert os.listdir(layout.staging_dir(state)) == []
    assert list_pins(state, layout.cache_key_for_repository(branches / ".git")) == []
