"""Workspace capture of sparse-checkout repositories (cone, non-cone, sparse
index): the snapshot holds what `git add -A --sparse` stages (untracked and
modified files outside the sparse patterns included, entries not checked out
kept as the index has them), cold and warm, and when the sparse patterns
change between captures; the source repository stays untouched."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import anyio
import pytest

from preloop.snapshot import Snapshot, capture_workspace
from snapshot_support import FakeGit, git, make_repo, oracle_tree, repo_state

BASE = {"a/x": "in the cone\n", "b/y": "outside the cone\n", "top": "top level\n"}


def capture(state: Path, workspace: Path, run_id: str) -> Snapshot:
    return anyio.run(lambda: capture_workspace(state, workspace, run_id))


def listing(snapshot: Snapshot) -> dict[str, str]:
    """path -> blob content of the snapshot commit's tree."""
    out = git("ls-tree", "-r", "-z", "--name-only", "refs/heads/snapshot", cwd=snapshot.repository)
    return {
        path: git("cat-file", "blob", f"refs/heads/snapshot:{path}", cwd=snapshot.repository)
        for path in out.split("\0")
        if path
    }


def sparse_oracle(workspace: Path, scratch: Path) -> str:
    """The tree `git add -A --sparse` stages in a copy of `workspace` (plain
    `git add -A` refuses paths outside the sparse patterns)."""
    copy = scratch / "sparse-oracle"
    shutil.copytree(workspace, copy, symlinks=True)
    git("add", "-A", "--sparse", cwd=copy)
    tree = git("write-tree", cwd=copy).strip()
    shutil.rmtree(copy)
    return tree


def untouched_capture(state: Path, ws: Path, run_id: str, scratch: Path) -> dict[str, str]:
    """Captures `ws`, checks that nothing in it changed and that the snapshot
    is the oracle's tree; returns the snapshot's files."""
    before = repo_state(ws)
    snap = capture(state, ws, run_id)
    assert repo_state(ws) == before, "the source repository changed"
    assert not [n for n in os.listdir(ws / ".git") if n.startswith("sharedindex")]
    assert snap.tree == sparse_oracle(ws, scratch)
    return listing(snap)


def sparse_repo(path: Path, *set_args: str) -> Path:
    ws = make_repo(path, BASE)
    git("sparse-checkout", "set", *set_args, cwd=ws)
    assert not (ws / "b/y").exists()
    assert "S b/y" in git("ls-files", "-t", cwd=ws).splitlines()
    return ws


@pytest.mark.parametrize(
    "set_args",
    [("a",), ("--no-cone", "/a/", "/top"), ("--sparse-index", "a")],
    ids=["cone", "non-cone", "sparse-index"],
)
def test_untracked_file_outside_the_patterns_is_captured_cold_and_warm(
    tmp_path: Path, set_args: tuple[str, ...]
) -> None:
    ws = sparse_repo(tmp_path / "ws", *set_args)
    if "--sparse-index" in set_args:
        assert "b/" in git("ls-files", "--sparse", cwd=ws).splitlines()
    (ws / "b").mkdir()
    (ws / "b/untracked").write_text("untracked\n")
    (ws / "a/x").write_text("in the cone, changed\n")
    state = tmp_path / "state"
    files = untouched_capture(state, ws, "cold", tmp_path)
    assert files == {**BASE, "a/x": "in the cone, changed\n", "b/untracked": "untracked\n"}

    (ws / "b/untracked").write_text("untracked, changed\n")
    files = untouched_capture(state, ws, "modified", tmp_path)
    assert files["b/untracked"] == "untracked, changed\n"

    (ws / "b/untracked").unlink()
    files = untouched_capture(state, ws, "deleted", tmp_path)
    assert files == {**BASE, "a/x": "in the cone, changed\n"}

    (ws / "b/untracked").write_text("back\n")
    files = untouched_capture(state, ws, "back", tmp_path)
    assert files["b/untracked"] == "back\n" and files["b/y"] == BASE["b/y"]


def test_modified_tracked_file_outside_the_patterns_is_captured(tmp_path: Path) -> None:
    """git leaves a modified file checked out (no skip-worktree bit) when the
    patterns exclude it; plain `git add -A` then skips it without a word."""
    ws = make_repo(tmp_path / "ws", BASE)
    (ws / "b/y").write_text("modified before the patterns changed\n")
    git("sparse-checkout", "set", "a", cwd=ws)
    assert "H b/y" in git("ls-files", "-t", cwd=ws).splitlines()
    state = tmp_path / "state"
    files = untouched_capture(state, ws, "cold", tmp_path)
    assert files["b/y"] == "modified before the patterns changed\n"
    (ws / "b/y").write_text("modified again\n")
    files = untouched_capture(state, ws, "warm", tmp_path)
    assert files["b/y"] == "modified again\n"


def test_file_not_checked_out_that_appears_and_goes_again(tmp_path: Path) -> None:
    """git clears the skip-worktree bit of a file it finds in the work tree
    (in the index it reads, not in the workspace's): once that file is gone
    again the workspace index still has the bit, so the file is kept."""
    ws = sparse_repo(tmp_path / "ws", "a")
    (ws / "b").mkdir()
    (ws / "b/y").write_text("appeared\n")
    (ws / "b/untracked").write_text("untracked\n")
    state = tmp_path / "state"
    files = untouched_capture(state, ws, "appeared", tmp_path)
    assert files == {**BASE, "b/y": "appeared\n", "b/untracked": "untracked\n"}
    (ws / "b/y").unlink()
    assert "S b/y" in git("ls-files", "-t", cwd=ws).splitlines()
    files = untouched_capture(state, ws, "gone", tmp_path)
    assert files == {**BASE, "b/untracked": "untracked\n"}


# The index's skip-worktree bits decide what is read and are in no tree: an
# index persisted by an earlier capture, under other patterns, must not decide.


def test_narrowed_patterns_keep_the_files_no_longer_checked_out(tmp_path: Path) -> None:
    ws = make_repo(tmp_path / "ws", BASE)
    state = tmp_path / "state"
    assert untouched_capture(state, ws, "full", tmp_path) == BASE
    git("sparse-checkout", "set", "a", cwd=ws)
    assert not (ws / "b/y").exists()
    (ws / "b").mkdir()
    (ws / "b/new").write_text("new\n")
    assert untouched_capture(state, ws, "narrowed", tmp_path) == {**BASE, "b/new": "new\n"}


def test_widened_patterns_read_the_files_checked_out_again(tmp_path: Path) -> None:
    ws = sparse_repo(tmp_path / "ws", "a")
    # Else git itself clears the skip-worktree bit of every file it finds in
    # the work tree when it reads an index (`clear_skip_worktree_from_present_files`).
    git("config", "sparse.expectFilesOutsideOfPatterns", "true", cwd=ws)
    state = tmp_path / "state"
    assert untouched_capture(state, ws, "narrow", tmp_path) == BASE
    git("sparse-checkout", "set", "a", "b", cwd=ws)
    (ws / "b/y").write_text("outside no more\n")
    assert untouched_capture(state, ws, "widened", tmp_path)["b/y"] == "outside no more\n"


def test_sparse_checkout_disabled_reads_every_file_again(tmp_path: Path) -> None:
    ws = sparse_repo(tmp_path / "ws", "a")
    state = tmp_path / "state"
    assert untouched_capture(state, ws, "sparse", tmp_path) == BASE
    git("sparse-checkout", "disable", cwd=ws)
    (ws / "b/y").write_text("sparse checkout off\n")
    before = repo_state(ws)
    snap = capture(state, ws, "disabled")
    assert repo_state(ws) == before
    assert snap.tree == oracle_tree(ws, tmp_path)
    assert listing(snap)["b/y"] == "sparse checkout off\n"


def test_skip_worktree_set_by_hand_without_sparse_checkout_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without sparse checkout the capture runs `git add --all` as before:
    a file marked skip-worktree by hand is captured as its index entry."""
    ws = make_repo(tmp_path / "ws", BASE)
    git("update-index", "--skip-worktree", "b/y", cwd=ws)
    (ws / "b/y").write_text("ignored: skip-worktree\n")
    fake = FakeGit(tmp_path, monkeypatch)
    log = tmp_path / "git-calls.log"
    fake.log_to(log)
    state = tmp_path / "state"
    for run in ("cold", "warm"):
        (ws / "u.txt").write_text(f"untracked {run}\n")
        before = repo_state(ws)
        snap = capture(state, ws, run)
        assert repo_state(ws) == before
        assert snap.tree == oracle_tree(ws, tmp_path)
        assert listing(snap)["b/y"] == BASE["b/y"]
    assert "--sparse" not in log.read_text()
    fake.close()
