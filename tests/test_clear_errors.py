"""Clear errors, not tracebacks: a bad PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES
stops `preloop run` at start with exit 2 (it used to exit 0 while the
post-capture hook printed a traceback and eviction silently stopped); a
nested repository with no commit is left out of the capture (it made the
capture fail)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from tests.run_support import git, make_repo, workflow
from tests.test_run_cli import _env

from preloop.snapshot import capture_workspace

PRELOOP = [sys.executable, "-m", "preloop"]


@pytest.mark.parametrize(
    "command",
    [
        ["run", "-j", "1"],
        ["snapshot"],
        ["sweep"],
        ["cache", "status"],
        ["cache", "prune"],
        # Never reaches the store: the knob is checked before anything else.
        ["runner", "--store", "postgresql://nobody@127.0.0.1:1/none", "--once"],
    ],
    ids=" ".join,
)
def test_bad_cache_cap_stops_every_command_using_it(tmp_path: Path, command: list[str]) -> None:
    """`preloop run` used to exit 0 while the post-capture hook printed a
    traceback, and `preloop snapshot` to capture, warn and exit 0: every command
    that uses the cap fails at start instead."""
    state = tmp_path / "state"
    repo = make_repo(
        tmp_path / "repo",
        {"a.txt": "a\n"}
        | workflow("on: push\njobs:\n  a:\n    runs-on: x\n    steps: [{run: echo hi}]\n"),
    )
    proc = subprocess.run(
        [*PRELOOP, *command],
        cwd=repo,
        env=_env(state, PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES="lots"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("preloop: error: PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES:")
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stdout == ""
    assert not (state / "snapshots").exists()  # nothing captured


def test_nested_repository_without_a_commit_is_left_out(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"top.txt": "top\n"})
    nested = repo / "vendor" / "fresh"
    nested.mkdir(parents=True)
    git(nested, "init", "-q")
    (nested / "inside.txt").write_text("not committed anywhere\n")
    (repo / "new.txt").write_text("untracked\n")
    snap = anyio.run(lambda: capture_workspace(tmp_path / "state", repo, "run-nested"))
    files = git(
        repo, "--git-dir", str(snap.repository), "ls-tree", "-r", "--name-only", snap.commit
    )
    assert files.split() == ["new.txt", "top.txt"]
