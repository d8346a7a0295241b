"""Workspace capture against real repositories: the snapshot is exactly what
`git add -A` would stage (checked against git itself on a copy), and the source
repository is byte-for-byte unchanged."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest

from preloop.fs import tree_bytes
from preloop.snapshot import Snapshot, SnapshotError, capture_workspace, layout
from snapshot_support import (
    FakeGit,
    git,
    make_repo,
    oracle_tree,
    repo_state,
    snapshot_tree,
)


def capture(state: Path, workspace: Path, run_id: str, **kwargs: object) -> Snapshot:
    return anyio.run(lambda: capture_workspace(state, workspace, run_id, **kwargs))  # type: ignore[arg-type]


def listing(snapshot: Snapshot) -> dict[str, tuple[str, str]]:
    """path -> (mode, object id) of the snapshot commit's tree."""
    out = git("ls-tree", "-r", "-z", "refs/heads/snapshot", cwd=snapshot.repository)
    entries = {}
    for record in out.split("\0"):
        if record:
            meta, path = record.split("\t", 1)
            mode, _kind, oid = meta.split()
            entries[path] = (mode, oid)
    return entries


def blob(snapshot: Snapshot, path: str) -> bytes:
    import subprocess

    return subprocess.run(
        ["git", "cat-file", "blob", f"refs/heads/snapshot:{path}"],
        cwd=snapshot.repository,
        check=True,
        capture_output=True,
    ).stdout


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A repository exercising every rule of `git add -A`."""
    sub_origin = make_repo(tmp_path / "sub-origin", {"s.txt": "sub\n"})
    ws = make_repo(
        tmp_path / "ws",
        {
            "a.txt": "alpha\n",
            "dir/b.txt": "beta\n",
            "del.txt": "to be deleted\n",
            "rmcached.log": "tracked, then untracked while ignored\n",
            "name with space é.txt": "unicode\n",
            ".gitattributes": "*.up filter=upper\n*.eol text eol=crlf\n",
        },
    )
    git("config", "core.fileMode", "false", cwd=ws)
    git("config", "core.autocrlf", "true", cwd=ws)
    git("config", "filter.upper.clean", "tr a-z A-Z", cwd=ws)
    global_excludes = tmp_path / "global-excludes"
    global_excludes.write_text("global-ignored.txt\n")
    git("config", "core.excludesFile", str(global_excludes), cwd=ws)
    (ws / ".git/info/exclude").write_text("excluded.txt\n")
    (ws / ".gitignore").write_text("*.log\nbuild/\n")
    (ws / "dir/.gitignore").write_text("local-*\n")
    (ws / "build").mkdir()
    (ws / "build/keep.txt").write_text("force-added although ignored\n")
    git("add", "-f", "build/keep.txt", cwd=ws)
    git("add", ".gitignore", "dir/.gitignore", cwd=ws)
    git(
        "-c",
        "protocol.file.allow=always",
        "submodule",
        "add",
        "-q",
        str(sub_origin),
        "sub",
        cwd=ws,
    )
    git("commit", "-q", "-m", "ignore rules, submodule", cwd=ws)
    # Working-tree changes of every kind.
    (ws / "a.txt").write_text("alpha changed\n")
    (ws / "a.txt").chmod(0o755)  # core.fileMode=false: stays 100644
    (ws / "del.txt").unlink()
    git("rm", "-q", "--cached", "rmcached.log", cwd=ws)
    (ws / "staged.txt").write_text("staged\n")
    git("add", "staged.txt", cwd=ws)
    (ws / "staged.txt").write_text("staged, then changed again\n")
    (ws / "staged-only.txt").write_text("staged, blob only in the workspace's objects\n")
    git("add", "staged-only.txt", cwd=ws)
    (ws / "untracked.txt").write_text("untracked\n")
    (ws / "dir/untracked2.txt").write_text("untracked too\n")
    (ws / "crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    (ws / "shout.up").write_text("quiet words\n")
    (ws / "lines.eol").write_text("x\ny\n")
    (ws / "link").symlink_to("a.txt")
    for ignored in ("x.log", "build/out.bin", "dir/local-x", "excluded.txt", "global-ignored.txt"):
        (ws / ignored).write_text("ignored\n")
    (ws / "emptydir").mkdir()
    git("commit", "-q", "--allow-empty", "-m", "noop", cwd=ws / "sub")
    (ws / "sub/s.txt").write_text("sub changed\n")  # dirty submodule: still its HEAD
    nested = make_repo(ws / "nested", {"n.txt": "nested\n"})
    assert (nested / ".git").is_dir()
    return ws


def test_snapshot_is_what_git_add_all_stages(tmp_path: Path, workspace: Path) -> None:
    state = tmp_path / "state"
    before = repo_state(workspace)
    snap = capture(state, workspace, "run-1")
    after = repo_state(workspace)
    assert after == before, "the source repository changed"

    assert snap.tree == snapshot_tree(snap.repository)
    assert snap.tree == oracle_tree(workspace, tmp_path, drop=("nested",))
    entries = listing(snap)
    for present in (
        "a.txt",
        "dir/b.txt",
        "staged.txt",
        "staged-only.txt",
        "untracked.txt",
        "dir/untracked2.txt",
        "build/keep.txt",
        "name with space é.txt",
        "crlf.txt",
        "shout.up",
        "link",
        "sub",
    ):
        assert present in entries, present
    for absent in (
        "del.txt",
        "rmcached.log",
        "x.log",
        "build/out.bin",
        "dir/local-x",
        "excluded.txt",
        "global-ignored.txt",
        "nested",
        "nested/n.txt",
    ):
        assert absent not in entries, absent
    assert entries["a.txt"][0] == "100644"
    assert entries["link"][0] == "120000"
    sub_head = git("rev-parse", "HEAD", cwd=workspace / "sub").strip()
    assert entries["sub"] == ("160000", sub_head)
    assert blob(snap, "a.txt") == b"alpha changed\n"
    assert blob(snap, "staged.txt") == b"staged, then changed again\n"
    assert blob(snap, "crlf.txt") == b"one\ntwo\n"
    assert blob(snap, "shout.up") == b"QUIET WORDS\n"
    head = git("rev-parse", "HEAD", cwd=workspace).strip()
    assert snap.parents == (head,)
    assert git("rev-parse", "refs/heads/snapshot^", cwd=snap.repository).strip() == head
    git("fsck", "--strict", "--no-dangling", cwd=snap.repository)
    # Leftovers: none; the published repository is accepted.
    assert os.listdir(layout.staging_dir(state)) == []
    assert sorted(os.listdir(layout.snapshots_dir(state))) == [".staging", "run-1"]


def test_warm_capture_follows_the_workspace(tmp_path: Path, workspace: Path) -> None:
    state = tmp_path / "state"
    capture(state, workspace, "run-1")
    assert layout.cache_index_path(state, layout.cache_key_for_repository(workspace / ".git"))
    # Changes after the first capture, including an ignore rule that now hides
    # a file the first snapshot had as untracked, and a new commit.
    (workspace / ".gitignore").write_text("*.log\nbuild/\nuntracked.txt\n")
    (workspace / "dir/b.txt").unlink()
    (workspace / "a.txt").write_text("alpha changed twice\n")
    (workspace / "more.txt").write_text("more\n")
    git("add", "more.txt", cwd=workspace)
    git("commit", "-q", "-m", "more", cwd=workspace)
    (workspace / "after-commit.txt").write_text("new\n")
    before = repo_state(workspace)
    snap = capture(state, workspace, "run-2")
    assert repo_state(workspace) == before
    assert snap.tree == oracle_tree(workspace, tmp_path, drop=("nested",))
    entries = listing(snap)
    assert "untracked.txt" not in entries and "dir/b.txt" not in entries
    assert "build/keep.txt" in entries and "more.txt" in entries
    assert blob(snap, "a.txt") == b"alpha changed twice\n"
    assert snap.parents == (git("rev-parse", "HEAD", cwd=workspace).strip(),)
    git("fsck", "--strict", "--no-dangling", cwd=snap.repository)


def test_same_tree_gives_the_same_commit(tmp_path: Path) -> None:
    ws = make_repo(tmp_path / "ws", {"f.txt": "f\n"})
    (ws / "u.txt").write_text("u\n")
    first = capture(tmp_path / "state", ws, "one")
    second = capture(tmp_path / "state", ws, "two")
    other_state = capture(tmp_path / "state2", ws, "three")
    assert first.commit == second.commit == other_state.commit
    assert first.repository != second.repository


def test_a_clean_work_tree_is_on_head(tmp_path: Path) -> None:
    ws = make_repo(tmp_path / "ws", {"f.txt": "f\n"})
    clean = capture(tmp_path / "state", ws, "clean")
    assert clean.on_head and clean.tree == git("rev-parse", "HEAD^{tree}", cwd=ws).strip()
    (ws / "u.txt").write_text("u\n")
    assert not capture(tmp_path / "state", ws, "dirty").on_head


def test_a_file_whose_working_tree_encoding_git_cannot_convert_keeps_its_commit(
    tmp_path: Path,
) -> None:
    """sphinx-doc/sphinx: `wrongenc.inc working-tree-encoding=iso-8859` (no
    iconv charset). Once git must hash it (a fresh clone's index, a touched
    file), `git add` stops with "fatal: failed to encode"; the capture failed
    the run. The file keeps the committed content; the rest is captured."""
    ws = make_repo(tmp_path / "ws", {"wrongenc.inc": "caf\xe9\n", "a.txt": "a\n"})
    (ws / ".gitattributes").write_text("wrongenc.inc working-tree-encoding=iso-8859\n")
    git("add", ".gitattributes", cwd=ws)
    git("commit", "-qm", "attributes", cwd=ws)
    committed = git("rev-parse", "HEAD:wrongenc.inc", cwd=ws).strip()
    later = time.time() + 5
    os.utime(ws / "wrongenc.inc", (later, later))  # its index entry is stale: rehashed
    (ws / "a.txt").write_text("changed\n")
    snap = capture(tmp_path / "state", ws, "enc")
    entries = listing(snap)
    assert entries["wrongenc.inc"][1] == committed
    assert blob(snap, "a.txt") == b"changed\n"


def test_unborn_head(tmp_path: Path) -> None:
    ws = make_repo(tmp_path / "ws", {"a.txt": "a\n", "b/c.txt": "c\n"}, commit=False)
    git("add", "a.txt", cwd=ws)
    before = repo_state(ws)
    snap = capture(tmp_path / "state", ws, "unborn")
    assert repo_state(ws) == before
    assert snap.parents == ()
    assert git(
        "rev-list", "--parents", "-n1", "refs/heads/snapshot", cwd=snap.repository
    ).split() == [snap.commit]
    assert set(listing(snap)) == {"a.txt", "b/c.txt"}
    assert snap.tree == oracle_tree(ws, tmp_path)
    # The staged blob existed only in the workspace's objects: it was copied.
    git("fsck", "--strict", "--no-dangling", cwd=snap.repository)
    # Warm capture of an unborn repository too.
    (ws / "d.txt").write_text("d\n")
    (ws / "e.txt").write_text("staged after the cache was made\n")
    git("add", "e.txt", cwd=ws)
    again = capture(tmp_path / "state", ws, "unborn-2")
    assert set(listing(again)) == {"a.txt", "b/c.txt", "d.txt", "e.txt"}
    # e.txt's blob was only in the workspace's objects: it was copied.
    git("fsck", "--strict", "--no-dangling", cwd=again.repository)


def test_linked_worktree(tmp_path: Path) -> None:
    main = make_repo(tmp_path / "main", {"m.txt": "m\n"})
    git("worktree", "add", "-q", "-b", "feature", str(tmp_path / "wt"), cwd=main)
    wt = tmp_path / "wt"
    (wt / "m.txt").write_text("changed in worktree\n")
    (wt / "w.txt").write_text("new\n")
    before_main, before_wt = repo_state(main), repo_state(wt)
    snap = capture(tmp_path / "state", wt, "wt-run")
    assert (repo_state(main), repo_state(wt)) == (before_main, before_wt)
    assert set(listing(snap)) == {"m.txt", "w.txt"}
    assert blob(snap, "m.txt") == b"changed in worktree\n"
    # The main worktree and the linked one share one cache entry.
    assert snap.cache_key == layout.cache_key_for_repository(main / ".git")


def test_warm_capture_rehashes_only_changed_files(tmp_path: Path) -> None:
    """The persisted index carries stat data: a clean filter that logs each
    file git hashes shows only the changed file is read again."""
    log = tmp_path / "hashed.log"
    files = {f"f{i:02d}.txt": f"file {i}\n" for i in range(20)}
    ws = make_repo(tmp_path / "ws", {**files, ".gitattributes": "*.txt filter=count\n"})
    git("config", "filter.count.clean", f"echo %f >> {log}; cat", cwd=ws)
    past = time.time() - 3600  # no entry is racily clean
    for name in files:
        os.utime(ws / name, (past, past))
    git("add", "-A", cwd=ws)  # refresh the workspace index's stat data
    state = tmp_path / "state"
    capture(state, ws, "cold")
    log.write_text("")
    (ws / "f07.txt").write_text("changed\n")
    os.utime(ws / "f07.txt", (past + 10, past + 10))
    snap = capture(state, ws, "warm")
    assert log.read_text().split() == ["f07.txt"]
    assert blob(snap, "f07.txt") == b"changed\n"


def test_two_captures_of_a_large_base_share_objects(tmp_path: Path) -> None:
    files = {f"d{i % 10}/f{i:03d}.bin": os.urandom(20_000).hex() for i in range(300)}
    ws = make_repo(tmp_path / "ws", files)
    git("gc", "-q", cwd=ws)
    state = tmp_path / "state"
    state.mkdir()

    def size() -> int:
        return tree_bytes(state).apparent_bytes

    empty = size()
    first = capture(state, ws, "first")
    after_first = size()
    (ws / "d0/f000.bin").write_text("small change\n")
    second = capture(state, ws, "second")
    after_second = size()
    first_cost = after_first - empty
    second_cost = after_second - after_first
    assert first_cost > 6_000_000  # the base itself landed in the cache
    assert second_cost < first_cost / 10, (first_cost, second_cost)
    assert tree_bytes(second.repository).apparent_bytes < first_cost / 10
    alternates = (second.repository / "objects/info/alternates").read_text().split()
    assert alternates == (first.repository / "objects/info/alternates").read_text().split()


def test_not_a_repository_changes_nothing(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    state = tmp_path / "state"
    with pytest.raises(SnapshotError, match="not inside a git work tree"):
        capture(state, plain, "r1")
    assert not state.exists()


def test_run_id_collision_keeps_the_existing_snapshot(tmp_path: Path) -> None:
    ws = make_repo(tmp_path / "ws", {"f.txt": "f\n"})
    state = tmp_path / "state"
    snap = capture(state, ws, "same")
    (ws / "f.txt").write_text("other\n")
    with pytest.raises(SnapshotError, match="already has a snapshot repository"):
        capture(state, ws, "same")
    assert git("rev-parse", "refs/heads/snapshot", cwd=snap.repository).strip() == snap.commit
    assert os.listdir(layout.staging_dir(state)) == []


def test_fixup_path_tracks_ignore_changes_and_reappearing_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cheap path (persisted index fixed up from the memo, no read-tree)
    still gives exactly what `git add -A` stages."""
    ws = make_repo(tmp_path / "ws", {"a.txt": "a\n", "b.txt": "b\n", ".gitignore": "*.log\n"})
    (ws / "keep.log").write_text("tracked although ignored\n")
    git("add", "-f", "keep.log", cwd=ws)
    git("commit", "-q", "-m", "keep", cwd=ws)
    state = tmp_path / "state"
    capture(state, ws, "c1")  # seeded from the workspace index
    (ws / "u.txt").write_text("untracked\n")
    (ws / "keep.log").unlink()
    second = capture(state, ws, "c2")  # reset path; writes the memo
    assert second.tree == oracle_tree(ws, tmp_path)
    assert "u.txt" in listing(second) and "keep.log" not in listing(second)

    fake = FakeGit(tmp_path, monkeypatch)
    log = tmp_path / "git-calls.log"
    fake.log_to(log)
    with (ws / ".git/info/exclude").open("a") as fh:
        fh.write("u.txt\n")
    (ws / "keep.log").write_text("back again\n")
    (ws / "a.txt").write_text("a changed\n")
    third = capture(state, ws, "c3")
    calls = log.read_text()
    assert "check-ignore --no-index" in calls and "read-tree" not in calls
    assert "update-index -z --index-info" in calls  # u.txt ignored now, keep.log is back
    assert third.tree == oracle_tree(ws, tmp_path)
    entries = listing(third)
    assert "u.txt" not in entries and "keep.log" in entries
    assert blob(third, "a.txt") == b"a changed\n"
    log.write_text("")
    fourth = capture(state, ws, "c4")
    assert "read-tree" not in log.read_text()
    assert fourth.commit == third.commit
    fake.close()


def test_sha256_repository(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    git("init", "-q", "--object-format=sha256", "-b", "main", cwd=ws)
    git("config", "user.email", "dev@example.com", cwd=ws)
    git("config", "user.name", "Dev", cwd=ws)
    (ws / "f.txt").write_text("f\n")
    git("add", "f.txt", cwd=ws)
    git("commit", "-q", "-m", "base", cwd=ws)
    (ws / "g.txt").write_text("g\n")
    snap = capture(tmp_path / "state", ws, "sha256")
    assert len(snap.commit) == 64
    assert set(listing(snap)) == {"f.txt", "g.txt"}
    git("fsck", "--strict", "--no-dangling", cwd=snap.repository)
    again = capture(tmp_path / "state", ws, "sha256-warm")
    assert again.commit == snap.commit


@pytest.mark.parametrize(
    ("object_format", "encoding", "born"),
    [
        ("sha1", None, True),
        ("sha1", None, False),
        ("sha256", None, True),
        ("sha1", "ISO-8859-1", True),
        ("sha1", "UTF8", True),
    ],
)
def test_snapshot_commit_is_the_one_git_commit_tree_writes(
    tmp_path: Path, object_format: str, encoding: str | None, born: bool
) -> None:
    """The capture writes the commit object itself: it must be the very object
    `git commit-tree` writes for the same tree, parents and identity, dated as
    HEAD was committed (1970 with no HEAD)."""
    import subprocess

    from preloop.snapshot.workspace import SNAPSHOT_IDENTITY, SNAPSHOT_MESSAGE

    ws = tmp_path / "ws"
    ws.mkdir()
    git("init", "-q", f"--object-format={object_format}", "-b", "main", cwd=ws)
    git("config", "user.email", "dev@example.com", cwd=ws)
    git("config", "user.name", "Dev", cwd=ws)
    if encoding:
        git("config", "i18n.commitEncoding", encoding, cwd=ws)
    (ws / "f.txt").write_text("f\n")
    committed = "@1700000000 +0530"
    if born:
        git("add", "f.txt", cwd=ws)
        subprocess.run(
            ["git", "commit", "-q", "-m", "base"],
            cwd=ws,
            check=True,
            env={**os.environ, "GIT_COMMITTER_DATE": committed},
        )
    (ws / "g.txt").write_text("g\n")
    snap = capture(tmp_path / "state", ws, "commit")
    args = ["git", "commit-tree", snap.tree, "-m", SNAPSHOT_MESSAGE]
    for parent in snap.parents:
        args += ["-p", parent]
    # As the capture ran it: the workspace's repository (its config), objects
    # written aside, the snapshot's objects readable.
    cache_objects = (snap.repository / "objects/info/alternates").read_text().strip()
    (tmp_path / "aside").mkdir()
    env = {
        **os.environ,
        **SNAPSHOT_IDENTITY,
        **({"GIT_AUTHOR_DATE": committed, "GIT_COMMITTER_DATE": committed} if born else {}),
        "GIT_DIR": str(ws / ".git"),
        "GIT_OBJECT_DIRECTORY": str(tmp_path / "aside"),
        "GIT_ALTERNATE_OBJECT_DIRECTORIES": cache_objects,
    }
    expected = subprocess.run(args, env=env, check=True, capture_output=True, text=True)
    assert snap.commit == expected.stdout.strip()
    git("fsck", "--strict", "--no-dangling", cwd=snap.repository)


def test_published_tree_is_checked_without_git_only_when_the_commit_is_loose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publication check reads the loose commit through the published
    repository's alternates; a packed commit (or a ref naming another commit)
    is left to git, so a damaged cache entry is still refused."""
    from preloop.snapshot.capture import _published_tree

    ws = make_repo(tmp_path / "ws", {"f.txt": "f\n"})
    (ws / "f.txt").write_text("changed\n")
    state = tmp_path / "state"
    fake = FakeGit(tmp_path, monkeypatch)
    log = tmp_path / "git-calls.log"
    fake.log_to(log)
    snap = capture(state, ws, "loose")
    assert "rev-parse --verify --quiet refs/heads/snapshot" not in log.read_text()
    assert _published_tree(snap.repository, snap.commit) == snap.tree
    assert _published_tree(snap.repository, "0" * 40) is None
    fake.close()
    cache = layout.cache_repository(state, snap.cache_key)
    # Pack the commit and drop its loose copy.
    git("update-ref", "refs/preloop/test-keep", snap.commit, cwd=cache)
    git("repack", "-a", "-d", "-q", cwd=cache)
    git("prune-packed", cwd=cache)
    assert _published_tree(snap.repository, snap.commit) is None
    # Packed: git resolves the ref, and the next capture of the same content
    # (same commit) is verified that way.
    again = capture(state, ws, "packed")
    assert again.commit == snap.commit and again.tree == snap.tree
