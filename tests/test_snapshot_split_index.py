"""The capture's split index (`preloop.snapshot.index`): warm captures keep
their index split against a shared index in the cache entry, never write one
into the workspace's repository, and recover when the shared index is lost,
expired meanwhile, or its memo cannot be trusted; `split_index_base` reads
every index version git writes."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import anyio
import pytest

import preloop.snapshot.workspace as workspace
from preloop.snapshot import Snapshot, capture_workspace, layout
from preloop.snapshot.index import MEMO_NAME, read_trailer, split_index_base
from preloop.snapshot.work import CaptureFaults
from snapshot_support import FakeGit, git, make_repo, oracle_tree, repo_state


def capture(state: Path, workspace: Path, run_id: str, **kwargs: object) -> Snapshot:
    return anyio.run(lambda: capture_workspace(state, workspace, run_id, **kwargs))  # type: ignore[arg-type]


def entry_dir(state: Path, workspace: Path) -> Path:
    return layout.cache_repository(state, layout.cache_key_for_repository(workspace / ".git"))


def persisted_split(state: Path, workspace: Path, fmt: str = "sha1") -> str:
    """The shared index the persisted index is split against, checked against
    its memo and present in the cache entry."""
    key = layout.cache_key_for_repository(workspace / ".git")
    shared = split_index_base(layout.cache_index_path(state, key), fmt)
    assert shared is not None, "the persisted index is not split"
    entry = entry_dir(state, workspace)
    assert json.loads((entry / MEMO_NAME).read_text())["shared_index"] == shared
    assert (entry / f"sharedindex.{shared}").is_file()
    return shared


def shared_indexes(git_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(git_dir) if n.startswith("sharedindex"))


def files(n: int) -> dict[str, str]:
    return {f"d{i % 4}/f{i:02d}.txt": f"file {i}\n" for i in range(n)}


def backdate(*paths: Path) -> None:
    """Files an hour old: no index entry is racily clean (git would move
    those into the split part, smudged, for a later rehash). Only files just
    written: `utime` sets the ctime, which git compares too."""
    past = time.time() - 3600
    for path in paths:
        os.utime(path, (past, past))


def split_on_first_capture(ws: Path) -> None:
    """An untracked file, so that the first capture's index is written (and
    split by write-tree): of a workspace unchanged since its index was
    written, and whose entries git does not see as racily clean (written in
    the same instant as the index, which depends on timing), the copied index
    is already complete and no git command rewrites it."""
    (ws / "untracked.txt").write_text("untracked\n")


def backdate_all(ws: Path) -> None:
    backdate(*(p for p in ws.rglob("*") if ".git" not in p.relative_to(ws).parts and p.is_file()))


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_warm_captures_keep_a_split_index_in_the_cache_entry(tmp_path: Path, fmt: str) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    git("init", "-q", f"--object-format={fmt}", "-b", "main", cwd=ws)
    git("config", "user.email", "dev@example.com", cwd=ws)
    git("config", "user.name", "Dev", cwd=ws)
    make_repo(ws, files(40))
    state = tmp_path / "state"
    (ws / "u.txt").write_text("untracked\n")
    backdate_all(ws)
    first = capture(state, ws, "seed")
    assert first.tree == oracle_tree(ws, tmp_path)
    shared = persisted_split(state, ws, fmt)

    (ws / "d1/f01.txt").write_text("changed\n")
    backdate(ws / "d1/f01.txt")
    before = repo_state(ws)
    fixed_up = capture(state, ws, "fix-up")
    assert repo_state(ws) == before
    assert fixed_up.tree == oracle_tree(ws, tmp_path)
    # A few changed entries: the same shared index, only the split part written.
    assert persisted_split(state, ws, fmt) == shared

    git("add", "-A", cwd=ws)
    git("commit", "-q", "-m", "next", cwd=ws)
    (ws / "d2/f02.txt").unlink()
    before = repo_state(ws)
    reset = capture(state, ws, "reset")
    assert repo_state(ws) == before
    assert reset.tree == oracle_tree(ws, tmp_path)
    persisted_split(state, ws, fmt)

    for i in range(0, 40, 2):  # over a fifth of the entries: a new shared index
        (ws / f"d{i % 4}/f{i:02d}.txt").write_text(f"rewritten {i}\n")
    many = capture(state, ws, "many")
    assert many.tree == oracle_tree(ws, tmp_path)
    assert persisted_split(state, ws, fmt) != shared
    assert shared_indexes(ws / ".git") == []


def test_capture_seeds_when_the_shared_index_is_lost(tmp_path: Path) -> None:
    ws = make_repo(tmp_path / "ws", files(20))
    split_on_first_capture(ws)
    state = tmp_path / "state"
    capture(state, ws, "one")
    entry = entry_dir(state, ws)
    assert shared_indexes(entry), "the first capture left no shared index"
    for name in shared_indexes(entry):
        (entry / name).unlink()
    (ws / "d0/f00.txt").write_text("changed\n")
    again = capture(state, ws, "two")
    assert again.tree == oracle_tree(ws, tmp_path)
    persisted_split(state, ws)


def test_capture_seeds_when_the_memo_does_not_match_a_split_index(tmp_path: Path) -> None:
    """A crash between persisting the index and its memo: the index cannot be
    read without its shared index, which only a trusted memo names; the reset
    fails and the capture seeds from the workspace's index."""
    ws = make_repo(tmp_path / "ws", files(20))
    split_on_first_capture(ws)
    state = tmp_path / "state"
    capture(state, ws, "one")
    memo_path = entry_dir(state, ws) / MEMO_NAME
    memo = json.loads(memo_path.read_text())
    memo["index_checksum"] = "0" * 40
    memo_path.write_text(json.dumps(memo))
    (ws / "d3/f03.txt").write_text("changed\n")
    (ws / "new.txt").write_text("new\n")
    again = capture(state, ws, "two")
    assert again.tree == oracle_tree(ws, tmp_path)
    persisted_split(state, ws)


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_damaged_shared_index_costs_a_seed_not_a_failed_capture(
    tmp_path: Path, damage: str
) -> None:
    """git does not fsync index files by default: after a power loss the
    shared index can be there but empty (its checksum then does not match
    its name: seed), or garbled where no checksum shows it (git fails to
    read it: the capture retries as a seed)."""
    ws = make_repo(tmp_path / "ws", files(40))
    backdate_all(ws)
    state = tmp_path / "state"
    capture(state, ws, "one")
    (ws / "d0/f00.txt").write_text("changed\n")
    capture(state, ws, "two")  # a memo with ws_tree: the next is a fix-up
    shared = entry_dir(state, ws) / f"sharedindex.{persisted_split(state, ws)}"
    if damage == "truncated":
        shared.write_bytes(b"")
    else:
        data = bytearray(shared.read_bytes())
        data[0:4] = b"JUNK"
        shared.write_bytes(bytes(data))
    (ws / "d1/f01.txt").write_text("changed\n")
    assert capture(state, ws, "three").tree == oracle_tree(ws, tmp_path)
    persisted_split(state, ws)


def test_concurrent_persists_never_leave_a_memo_naming_another_shared_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Capture A moves its index into place, capture B moves its own over it
    and saves its memo, then A saves its memo: it must describe A's index (by
    A's checksum, so untrusted now), never B's index with A's shared index."""
    ws = make_repo(tmp_path / "ws", files(40))
    state = tmp_path / "state"
    capture(state, ws, "one")
    (ws / "d0/f00.txt").write_text("small change\n")
    capture(state, ws, "two")

    a_moved, b_saved, b_waiting = threading.Event(), threading.Event(), threading.Event()
    real_move, real_persist = workspace._move_into_place, workspace._persist

    def move(src: Path, dst: Path) -> None:
        real_move(src, dst)
        if "/a-" in str(src):
            a_moved.set()
            assert b_saved.wait(60)

    def persist(index: Path, *args: object) -> None:
        if "/b-" in str(index):
            b_waiting.set()
            assert a_moved.wait(60)
            real_persist(index, *args)  # type: ignore[arg-type]
            b_saved.set()
        else:
            real_persist(index, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(workspace, "_move_into_place", move)
    monkeypatch.setattr(workspace, "_persist", persist)
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            results[name] = capture(state, ws, name)
        except BaseException as exc:
            results[name] = exc

    b = threading.Thread(target=run, args=("b",))
    b.start()
    assert b_waiting.wait(60)
    for i in range(0, 40, 2):  # A sees many changes: a new shared index
        (ws / f"d{i % 4}/f{i:02d}.txt").write_text(f"rewritten {i}\n")
    a = threading.Thread(target=run, args=("a",))
    a.start()
    a.join()
    b.join()
    assert all(isinstance(r, Snapshot) for r in results.values()), results
    monkeypatch.setattr(workspace, "_move_into_place", real_move)
    monkeypatch.setattr(workspace, "_persist", real_persist)

    persisted = layout.cache_index_path(state, layout.cache_key_for_repository(ws / ".git"))
    memo = json.loads((entry_dir(state, ws) / MEMO_NAME).read_text())
    assert memo["index_checksum"] != read_trailer(persisted, "sha1")  # A's memo, B's index
    assert capture(state, ws, "c").tree == oracle_tree(ws, tmp_path)


def test_fsmonitor_in_the_workspace_never_writes_a_shared_index_there(tmp_path: Path) -> None:
    """With fsmonitor on, `git add -A` marks entries fsmonitor-valid, which
    makes git write the index whole and unsplit; a later command run with
    core.splitIndex=true (the update-index dropping paths ignored now) would
    then split it by writing a shared index into the workspace's .git."""
    ws = make_repo(tmp_path / "ws", files(40))
    hook = tmp_path / "fsmonitor-hook"
    # Protocol v2: a new token, then "/": everything may have changed.
    hook.write_text('#!/bin/sh\nprintf "token-%s\\0/\\0" "$(date +%s%N)"\n')
    hook.chmod(0o755)
    git("config", "core.fsmonitor", str(hook), cwd=ws)
    git("config", "core.fsmonitorHookVersion", "2", cwd=ws)
    state = tmp_path / "state"
    capture(state, ws, "one")
    (ws / "u.txt").write_text("untracked\n")
    capture(state, ws, "two")  # u.txt: a path this capture added
    with open(ws / ".gitignore", "a") as fh:
        fh.write("u.txt\n")
    before = repo_state(ws)
    snap = capture(state, ws, "three")  # u.txt is ignored now: dropped
    assert shared_indexes(ws / ".git") == []
    assert repo_state(ws) == before
    assert snap.tree == oracle_tree(ws, tmp_path)
    persisted_split(state, ws)


def test_shared_index_removed_during_a_capture_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """git removes a cache entry's unused shared indexes when another capture
    writes a new one; a capture still using one holds it by its staging link
    and puts it back when it persists, so the next capture takes the cheap
    path instead of seeding."""
    ws = make_repo(tmp_path / "ws", files(20))
    backdate_all(ws)
    state = tmp_path / "state"
    capture(state, ws, "one")
    entry = entry_dir(state, ws)
    shared = persisted_split(state, ws)
    removed: list[str] = []

    def expire(point: str) -> None:
        if point == "write-commit":
            for name in shared_indexes(entry):
                (entry / name).unlink()
                removed.append(name)

    (ws / "d0/f04.txt").write_text("changed\n")
    backdate(ws / "d0/f04.txt")
    second = capture(state, ws, "two", faults=CaptureFaults(stall=expire))
    assert removed == [f"sharedindex.{shared}"]
    assert second.tree == oracle_tree(ws, tmp_path)
    assert persisted_split(state, ws) == shared

    fake = FakeGit(tmp_path, monkeypatch)
    log = tmp_path / "git-calls.log"
    fake.log_to(log)
    (ws / "d1/f05.txt").write_text("changed again\n")
    third = capture(state, ws, "three")
    assert "read-tree" not in log.read_text()
    assert third.tree == oracle_tree(ws, tmp_path)
    fake.close()


def test_workspace_with_its_own_split_index_is_untouched(tmp_path: Path) -> None:
    ws = make_repo(tmp_path / "ws", files(20))
    git("config", "core.splitIndex", "true", cwd=ws)
    git("update-index", "--split-index", cwd=ws)
    (ws / "d2/f06.txt").write_text("changed\n")
    git("add", "d2/f06.txt", cwd=ws)
    theirs = shared_indexes(ws / ".git")
    assert theirs
    state = tmp_path / "state"
    for run in ("one", "two"):
        (ws / "u.txt").write_text(f"untracked {run}\n")
        before = repo_state(ws)
        snap = capture(state, ws, run)
        assert repo_state(ws) == before
        assert snap.tree == oracle_tree(ws, tmp_path)
    assert shared_indexes(ws / ".git") == theirs
    persisted_split(state, ws)


def test_stale_shared_index_temporaries_are_removed(tmp_path: Path) -> None:
    """A `write-tree` killed while writing a shared index leaves git's
    temporary file, which git never removes: a capture removes it once it
    is older than any capture can be."""
    ws = make_repo(tmp_path / "ws", files(10))
    state = tmp_path / "state"
    capture(state, ws, "one")
    entry = entry_dir(state, ws)
    stale, fresh = entry / "sharedindex_AbC123", entry / "sharedindex_XyZ789"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"being written")
    past = time.time() - 2 * 3600
    os.utime(stale, (past, past))
    (ws / "d0/f00.txt").write_text("changed\n")
    capture(state, ws, "two")
    assert not stale.exists() and fresh.exists()


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_split_index_base_reads_every_index_version(tmp_path: Path, version: int, fmt: str) -> None:
    """The split part holds entries (modified, new, intent-to-add: extended
    flags in v3+, prefix-compressed names in v4); the walk past them finds
    the `link` extension git wrote."""
    ws = tmp_path / "ws"
    ws.mkdir()
    git("init", "-q", f"--object-format={fmt}", "-b", "main", cwd=ws)
    make_repo(ws, {**files(12), "deep/er/name-" + "x" * 200 + ".txt": "long\n"}, commit=False)
    git("add", "-A", cwd=ws)
    index = ws / ".git/index"
    git("update-index", "--index-version", str(version), cwd=ws)
    assert split_index_base(index, fmt) is None
    keep = ["-c", "core.splitIndex=true", "-c", "splitIndex.maxPercentChange=100"]
    git(*keep, "update-index", "--split-index", cwd=ws)
    (ws / "d0/f00.txt").write_text("changed\n")
    (ws / ("d1/new-" + "y" * 150 + ".txt")).write_text("new\n")
    (ws / "later.txt").write_text("intent to add\n")
    git(*keep, "add", "d0/f00.txt", "d1", cwd=ws)
    if version >= 3:
        git(*keep, "add", "-N", "later.txt", cwd=ws)
    [shared] = shared_indexes(ws / ".git")
    assert split_index_base(index, fmt) == shared.removeprefix("sharedindex.")
    assert int.from_bytes(index.read_bytes()[4:8], "big") == version
    assert split_index_base(tmp_path / "missing", fmt) is None
    (tmp_path / "garbage").write_bytes(b"DIRC" + b"\0\0\0\2" + b"\xff" * 40)
    assert split_index_base(tmp_path / "garbage", fmt) is None
