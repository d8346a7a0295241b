"""Helpers for the snapshot tests: real repositories, a fake `git` on PATH that
delegates to the real one and hangs where told, and a byte-for-byte picture of
a directory tree."""

from __future__ import annotations

import hashlib
import os
import select
import shutil
import signal
import stat
import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

REAL_GIT = shutil.which("git") or "/usr/bin/git"

# Hangs when "$*" matches $PRELOOP_FAKE_GIT_HANG (an extended regex): starts a
# grandchild, reports its pid on the FIFO $PRELOOP_FAKE_GIT_FIFO, waits.
# With $PRELOOP_FAKE_GIT_LOG set, every call's arguments are appended to it.
FAKE_GIT = f"""#!/bin/sh
if [ -n "$PRELOOP_FAKE_GIT_LOG" ]; then printf '%s\\n' "$*" >> "$PRELOOP_FAKE_GIT_LOG"; fi
if [ -n "$PRELOOP_FAKE_GIT_HANG" ] && printf '%s\\n' "$*" | grep -Eq -- "$PRELOOP_FAKE_GIT_HANG"
then
    sleep 100000 </dev/null >/dev/null 2>&1 &
    if [ -n "$PRELOOP_FAKE_GIT_FIFO" ]; then echo $! > "$PRELOOP_FAKE_GIT_FIFO"; fi
    wait
fi
exec {REAL_GIT} "$@"
"""


def git(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Runs the real git and returns its stdout."""
    result = subprocess.run(
        [REAL_GIT, *args], cwd=cwd, check=True, capture_output=True, text=True, env=env
    )
    return result.stdout


def make_repo(path: Path, files: dict[str, str] | None = None, *, commit: bool = True) -> Path:
    """A new repository at `path` with `files` committed (when `commit`)."""
    path.mkdir(parents=True, exist_ok=True)
    git("init", "-q", "-b", "main", cwd=path)
    git("config", "user.email", "dev@example.com", cwd=path)
    git("config", "user.name", "Dev", cwd=path)
    for name, content in (files or {}).items():
        target = path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    if files and commit:
        git("add", "-A", cwd=path)
        git("commit", "-q", "-m", "base", cwd=path)
    return path


def tree_picture(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every entry under `root` (`.git` included): mode and content digest (or
    symlink target), byte for byte."""
    picture: dict[str, tuple[int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            rel = os.path.relpath(full, root)
            if stat.S_ISLNK(st.st_mode):
                picture[rel] = (st.st_mode, os.readlink(full).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(full, "rb") as fh:
                    picture[rel] = (st.st_mode, hashlib.sha256(fh.read()).digest())
            else:
                picture[rel] = (st.st_mode, b"")
    return picture


def repo_state(repo: Path) -> dict[str, object]:
    """What must not change in a source repository: every byte under it, its
    status, refs and config as git reports them."""
    return {
        "files": tree_picture(repo),
        "status": git("--no-optional-locks", "status", "--porcelain=v2", "--branch", cwd=repo),
        "refs": git("for-each-ref", "--format=%(refname) %(objectname)", cwd=repo),
        "config": git("config", "--local", "--list", cwd=repo),
    }


def oracle_tree(workspace: Path, scratch: Path, *, drop: tuple[str, ...] = ()) -> str:
    """The tree `git add -A` stages in a copy of `workspace` (minus `drop`,
    the unregistered nested repositories a snapshot leaves out)."""
    copy = scratch / "oracle"
    shutil.copytree(workspace, copy, symlinks=True)
    git("add", "-A", cwd=copy)
    for path in drop:
        git("update-index", "--force-remove", "--", path, cwd=copy)
    tree = git("write-tree", cwd=copy).strip()
    shutil.rmtree(copy)
    return tree


def snapshot_tree(repository: Path) -> str:
    return git("rev-parse", "refs/heads/snapshot^{tree}", cwd=repository).strip()


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return False
    return data[data.rindex(b")") + 2 : data.rindex(b")") + 3] != b"Z"


class FakeGit:
    """A `git` wrapper first on PATH; `hang_on(regex)` makes matching calls
    hang after starting a grandchild whose pid `wait_for_hang` returns."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bin = tmp / "fake-bin"
        self.bin.mkdir()
        script = self.bin / "git"
        script.write_text(FAKE_GIT)
        script.chmod(0o755)
        self.fifo = tmp / "fake-git.fifo"
        os.mkfifo(self.fifo)
        self._monkeypatch = monkeypatch
        self.pids: list[int] = []
        self._pidfds: list[int] = []
        monkeypatch.setenv("PATH", f"{self.bin}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("PRELOOP_FAKE_GIT_FIFO", str(self.fifo))

    def log_to(self, path: Path) -> None:
        self._monkeypatch.setenv("PRELOOP_FAKE_GIT_LOG", str(path))

    def hang_on(self, pattern: str) -> None:
        self._monkeypatch.setenv("PRELOOP_FAKE_GIT_HANG", pattern)

    def wait_for_hang_blocking(self) -> int:
        pid = int(self.fifo.read_text())
        self.pids.append(pid)
        self._pidfds.append(os.pidfd_open(pid))
        return pid

    async def wait_for_hang(self) -> None:
        """Returns once a matching call hangs: usable as a deadline gate."""
        await anyio.to_thread.run_sync(self.wait_for_hang_blocking)

    def grandchild_exited(self, wait: float = 30.0) -> bool:
        """True once the last hanging call's grandchild has exited."""
        readable, _, _ = select.select([self._pidfds[-1]], [], [], wait)
        return bool(readable) and not alive(self.pids[-1])

    def close(self) -> None:
        for pid in self.pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for fd in self._pidfds:
            os.close(fd)


class Stall:
    """A blocking-step stall for `CaptureFaults.stall`: blocks the worker thread
    at `point` until `release()`; `entered` is set when it started blocking."""

    def __init__(self, point: str) -> None:
        self.point = point
        self.entered = threading.Event()
        self._release = threading.Event()

    def __call__(self, point: str) -> None:
        if point == self.point:
            self.entered.set()
            self._release.wait()

    def release(self) -> None:
        self._release.set()

    async def wait_entered(self) -> None:
        await anyio.to_thread.run_sync(self.entered.wait)


def gate(*events: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """A deadline gate that fires after all `events` happened."""

    async def fire() -> None:
        for event in events:
            await event()

    return fire
