"""Filesystem measurements: the native byte walker's Python face."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from preloop import _native

__all__ = ["TreeSize", "remove_tree", "tree_bytes", "write_text_atomic"]


@dataclass(frozen=True, slots=True)
class TreeSize:
    """What `du` reports for a tree.

    `apparent_bytes` matches `du -sb`, `allocated_bytes` matches
    `du -s --block-size=1` (st_blocks * 512). A hard-linked inode is counted
    once, in bytes and in `files`/`symlinks`.
    """

    apparent_bytes: int
    allocated_bytes: int
    files: int
    dirs: int
    symlinks: int


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Writes `text` to `path` through a temporary file beside it renamed into
    place: a reader, or a crash, sees the old file or the whole new one."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        # A full disk or an interrupt: no temporary file left that nothing sweeps.
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def tree_bytes(path: str | os.PathLike[str], *, one_file_system: bool = True) -> TreeSize:
    """Sums the tree at `path` without following symlinks.

    The walk is iterative (any depth), runs without the GIL, and with
    `one_file_system` skips mount points and everything below them
    (like `du -x`). An entry that vanishes during the walk is
    skipped; any other error raises `OSError` whose `filename` is the exact path.
    """
    return TreeSize(*_native.tree_bytes(os.fspath(path), one_file_system))


def remove_tree(path: str | os.PathLike[str]) -> tuple[int, OSError | None]:
    """Removes the tree (or single entry) at `path`, like `rm -rf`, in one native
    bottom-up `unlinkat` walk without the GIL: symlinks are never followed and
    other filesystems mounted below are left alone.

    Returns the allocated bytes really removed (a hard-linked inode counted once)
    and None, or the `OSError` of the first entry that could not be removed: the
    walk goes on past it, so everything removable is gone. A missing path removes
    nothing and is not an error.
    """
    allocated, _apparent, error = _native.remove_tree(os.fspath(path))
    return allocated, error
