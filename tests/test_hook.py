"""`preloop hook install`: a real `git push` to a local bare remote is blocked
by a failing run, allowed by a passing one, and skipped with PRELOOP_SKIP=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.run_support import GIT_ID, make_repo

FAILING = """\
on:
  push:
    branches: [main]
jobs:
  check:
    runs-on: ubuntu-latest
    steps:
      - run: test ! -e BROKEN
"""


def _env(state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRELOOP_")}
    env.update(PRELOOP_STATE_DIR=str(state), **extra)
    return env


def sh(repo: Path, state: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), cwd=repo, env=_env(state, **extra), capture_output=True, text=True, timeout=300
    )


def remote_head(remote: Path) -> str:
    out = subprocess.run(
        ["git", "rev-parse", "-q", "--verify", "refs/heads/main"],
        cwd=remote,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def test_pre_push_hook_blocks_allows_skips_and_chains(tmp_path: Path) -> None:
    remote = tmp_path / "remote.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(remote)], check=True)
    repo = make_repo(tmp_path / "repo", {".github/workflows/ci.yml": FAILING, "BROKEN": "x"})
    state = tmp_path / "state"
    git = ["git", *GIT_ID]
    assert sh(repo, state, *git, "remote", "add", "origin", str(remote)).returncode == 0
    hooks = repo / ".git" / "hooks"
    hooks.mkdir(exist_ok=True)
    chained_log = tmp_path / "chained.log"
    (hooks / "pre-push").write_text(
        f'#!/bin/sh\necho "chained $1" >> {chained_log}\ncat >/dev/null\n'
    )
    (hooks / "pre-push").chmod(0o755)

    preloop = [sys.executable, "-m", "preloop"]
    res = sh(repo, state, *preloop, "hook", "install")
    assert res.returncode == 0, res.stderr
    assert "existing hook runs first" in res.stdout
    assert (hooks / "pre-push.preloop-chained").exists()
    assert sh(repo, state, *preloop, "hook", "install").stdout.startswith(
        "preloop: the pre-push hook is already installed"
    )

    # A failing run blocks the push; nothing reaches the remote.
    res = sh(repo, state, *git, "push", "-q", "origin", "main")
    assert res.returncode != 0, (res.stdout, res.stderr)
    assert "push blocked: a workflow run failed or a workflow is invalid" in res.stderr
    assert "✗ failure" in res.stdout
    assert remote_head(remote) == ""
    assert chained_log.read_text() == "chained origin\n"

    # PRELOOP_SKIP=1 bypasses it once.
    res = sh(repo, state, *git, "push", "-q", "origin", "main", PRELOOP_SKIP="1")
    assert res.returncode == 0, res.stderr
    assert "PRELOOP_SKIP=1" in res.stderr
    assert (
        remote_head(remote)
        == subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
        ).stdout.strip()
    )

    # Fixed: the run passes and the push goes through.
    assert sh(repo, state, *git, "rm", "-q", "BROKEN").returncode == 0
    assert sh(repo, state, *git, "commit", "-q", "-m", "fix").returncode == 0
    res = sh(repo, state, *git, "push", "-q", "origin", "main")
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "✓ success" in res.stdout
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    assert remote_head(remote) == head.stdout.strip()

    # A ref no workflow is triggered by passes (branches: [main] only).
    res = sh(repo, state, *git, "push", "-q", "origin", "main:other")
    assert res.returncode == 0, res.stderr
    assert "nothing to run" in res.stdout

    res = sh(repo, state, *preloop, "hook", "uninstall")
    assert res.returncode == 0 and "previous hook is back" in res.stdout
    assert "chained" in (hooks / "pre-push").read_text()
    assert not (hooks / "pre-push.preloop-chained").exists()
    res = sh(repo, state, *preloop, "hook", "uninstall")
    assert res.returncode == 2 and "no preloop pre-push hook" in res.stderr


ON_PUSH = FAILING.replace("  push:\n    branches: [main]\n", "  push:\n") + (
    '      - run: echo "before=${{ github.event.before }} created=${{ github.event.created }}"\n'
)


def test_pre_push_runs_the_pushed_commits_not_the_work_tree(tmp_path: Path) -> None:
    """Each pushed ref runs on its own commit: pushing a failing branch from a
    clean main is blocked, and uncommitted edits never decide the outcome."""
    remote = tmp_path / "remote.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(remote)], check=True)
    repo = make_repo(tmp_path / "repo", {".github/workflows/ci.yml": ON_PUSH})
    state = tmp_path / "state"
    git = ["git", *GIT_ID]
    preloop = [sys.executable, "-m", "preloop"]
    assert sh(repo, state, *git, "remote", "add", "origin", str(remote)).returncode == 0
    assert sh(repo, state, *preloop, "hook", "install").returncode == 0
    assert sh(repo, state, *git, "checkout", "-q", "-b", "feat").returncode == 0
    (repo / "BROKEN").write_text("x")
    assert sh(repo, state, *git, "add", "BROKEN").returncode == 0
    assert sh(repo, state, *git, "commit", "-q", "-m", "broken").returncode == 0
    assert sh(repo, state, *git, "checkout", "-q", "main").returncode == 0
    assert not (repo / "BROKEN").exists()  # main's clean tree would pass

    res = sh(repo, state, *git, "push", "-q", "origin", "feat")
    assert res.returncode != 0, (res.stdout, res.stderr)
    assert "push blocked: a workflow run failed or a workflow is invalid" in res.stderr
    assert "to refs/heads/feat on origin" in res.stdout
    assert "✗ failure" in res.stdout
    assert sh(remote, state, "git", "rev-parse", "-q", "--verify", "refs/heads/feat").stdout == ""

    # main's commit passes even with an uncommitted file that would fail it.
    (repo / "BROKEN").write_text("uncommitted")
    res = sh(repo, state, *git, "push", "-q", "origin", "main")
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "✓ success" in res.stdout
    assert f"before={'0' * 40} created=true" in res.stdout  # a new ref
    first = remote_head(remote)
    (repo / "BROKEN").unlink()
    (repo / "more.txt").write_text("more")
    assert sh(repo, state, *git, "add", "more.txt").returncode == 0
    assert sh(repo, state, *git, "commit", "-q", "-m", "more").returncode == 0
    (repo / "BROKEN").write_text("uncommitted")
    res = sh(repo, state, *git, "push", "-q", "origin", "main")
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert f"before={first} created=false" in res.stdout  # the remote's old commit
    # ... and the fixed feat passes with the broken file left in the work tree.
    (repo / "BROKEN").unlink()
    assert sh(repo, state, *git, "checkout", "-q", "feat").returncode == 0
    assert sh(repo, state, *git, "rm", "-q", "--cached", "BROKEN").returncode == 0
    assert sh(repo, state, *git, "commit", "-q", "-m", "fix").returncode == 0
    assert (repo / "BROKEN").exists()  # untracked, in the work tree only
    res = sh(repo, state, *git, "push", "-q", "origin", "feat")
    assert res.returncode == 0, (res.stdout, res.stderr)
    # No temporary worktree is left registered.
    listed = sh(repo, state, "git", "worktree", "list", "--porcelain").stdout
    assert listed.count("worktree ") == 1
    # A deletion runs nothing and passes.
    res = sh(repo, state, *git, "push", "-q", "origin", ":feat")
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "✗" not in res.stdout and "✓" not in res.stdout
