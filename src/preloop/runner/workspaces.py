"""Where a job's workspace is: the same path from run to run.

On GitHub every job of a repository works in `/home/runner/work/<repo>/<repo>`,
so what a job caches by absolute path (a `.venv` whose scripts name its
interpreter, a compiler cache) is valid when a later run restores it. Here a
job takes the lowest free numbered slot of this host (`flock` on
`<work>/ws/<n>.lock`, released by the kernel if the runner dies) and works in
`<work>/ws/<n>/<repo>/<repo>`: one job at a time runs with slot 0's path, as
the first of several runners does; side by side jobs get the next slots.

A slot's directory is emptied when it is taken (what a dead runner left) and
when it is given back, before its lock is released. What cannot be removed
(a directory a job made read-only and chmod cannot open) is moved aside to
`<work>/ws/.stale-*` so that it never blocks the slot; the work directory's
sweep (`preloop.runner.checkout.sweep_work_dir`) tries again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import uuid
from pathlib import Path

from preloop.fs import remove_tree

__all__ = [
    "WorkspaceSlot",
    "clear_tree",
    "empty_directory",
    "safe_dir_name",
    "stale_workspaces",
    "take_workspace_slot",
]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class WorkspaceSlot:
    """A held slot: `workspace` is the job's checkout; `release()` empties
    the slot and lets another job take it (once; safe from any thread)."""

    def __init__(self, root: Path, fd: int, workspace: Path) -> None:
        self.root = root
        self.workspace = workspace
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            _remove(self.root)
        finally:
            os.close(fd)  # the lock goes with the descriptor


_STALE = ".stale-"


def stale_workspaces(work: Path) -> list[Path]:
    """What released slots under `work` moved aside (`ws/.stale-*`), for the
    work directory's sweep."""
    try:
        names = os.listdir(work / "ws")
    except FileNotFoundError:
        return []
    return [work / "ws" / n for n in names if n.startswith(_STALE)]


def clear_tree(root: Path) -> bool:
    """Removes `root` like `rm -rf` (`preloop.fs.remove_tree`, the native
    walk), opening read-only directories when they are what stops it (Go's
    module cache makes its directories read-only); whether it is gone."""
    _, error = remove_tree(root)
    if error is not None and error.errno in (errno.EACCES, errno.EPERM):
        _open_directories(root)
        remove_tree(root)
    return not os.path.lexists(root)


def empty_directory(directory: Path) -> Path | None:
    """Removes what `directory` holds (`clear_tree` each entry), keeping the
    directory itself (a shell's working directory, say): None, or the first
    entry that would not go. A missing directory is empty."""
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return None
    for entry in entries:
        if not clear_tree(entry):
            return entry
    return None


def _open_directories(root: Path) -> None:
    """Gives the owner rwx on every directory under `root` (not through
    symlinks), each before it is listed."""
    stack = [os.fspath(root)]
    while stack:
        path = stack.pop()
        with contextlib.suppress(OSError):
            mode = os.lstat(path).st_mode
            if not stat.S_ISDIR(mode):
                continue
            os.chmod(path, stat.S_IMODE(mode) | stat.S_IRWXU)
            with os.scandir(path) as entries:
                stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))


def _remove(root: Path) -> None:
    """`clear_tree`, moving aside what is left (`sweep_work_dir` tries again)."""
    if not clear_tree(root):
        with contextlib.suppress(OSError):  # else the slot's mkdir reports it
            os.rename(root, root.parent / f"{_STALE}{root.name}-{uuid.uuid4().hex[:8]}")


def safe_dir_name(text: str, fallback: str) -> str:
    """`text` as a directory name of characters a `file://` URL takes as
    they are (tools turn paths into URLs; a `#` would become `%23`)."""
    return _UNSAFE.sub("_", text).strip(".")[:64] or fallback


def take_workspace_slot(work: Path, repository: str) -> WorkspaceSlot:
    """Takes the lowest free slot under `work` for a job of `repository`
    (`owner/name`, or "" when unknown) and empties it."""
    slots = work / "ws"
    slots.mkdir(parents=True, exist_ok=True)
    name = safe_dir_name(repository.rsplit("/", 1)[-1], "workspace")
    n = 0
    while True:
        fd = os.open(slots / f"{n}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            n += 1
            continue
        root = slots / str(n)
        try:
            _remove(root)
            root.mkdir()
            (root / name).mkdir()
        except BaseException:
            os.close(fd)
            raise
        return WorkspaceSlot(root, fd, root / name / name)
