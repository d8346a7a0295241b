"""The private index of a workspace capture, and how it is prepared cheaply.

A capture's index must track exactly the workspace index's paths (that is what
`git add -A` in the workspace starts from) while carrying stat data that lets
`git add -A` skip files unchanged since the last capture. Three ways, cheapest
first:

1. **Fix-up.** The persisted `<key>.index` is the last capture's result; a memo
   (`<key>.git/preloop-index-base.json`) records which workspace-index tree it was
   built from (`ws_tree`) and the paths that capture added (untracked files) or
   dropped (deleted files) relative to it. When the workspace index still has
   the same tree, removing the added paths and restoring the dropped entries
   (one `update-index --index-info`) gives the right tracked set; entries that
   were modified keep their stat data, so `git add -A` rehashes only what
   changed since. The memo is trusted only for the exact index file it was
   written with (the index's trailing checksum).
2. **Reset.** Otherwise the workspace index's tree is written from a copy of it
   and the persisted index is `read-tree --reset` to it (stat data kept for
   unchanged entries).
3. **Seed.** Without a persisted index (or when the workspace index has
   unmerged entries), a copy of the workspace index itself: its stat data is
   the user's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from preloop.snapshot.gitcmd import git

__all__ = ["MEMO_NAME", "IndexBase", "TreeChange", "changed_entries", "read_trailer"]

MEMO_NAME = "preloop-index-base.json"
# Beyond this many added/dropped paths a fix-up is no cheaper than a reset.
MAX_FIXUP_PATHS = 5000

EMPTY_TREE = {
    "sha1": "4b825dc642cb6eb9a060e54bf8d69288fbee4904",
    "sha256": "6ef19b41225c5369f1c104d45d8d85efa9b057b53b14b4b9b939dd74decc5321",
}
HASH_BYTES = {"sha1": 20, "sha256": 32}


@dataclass
class IndexBase:
    """The memo of how the persisted index relates to the workspace index."""

    index_checksum: str
    ws_index_checksum: str | None
    ws_tree: str
    added: list[str] = field(default_factory=list)
    dropped: list[tuple[str, str, str]] = field(default_factory=list)  # mode, oid, path

    @classmethod
    def load(cls, path: Path) -> IndexBase | None:
        try:
            doc = json.loads(path.read_text())
            return cls(
                index_checksum=str(doc["index_checksum"]),
                ws_index_checksum=doc["ws_index_checksum"],
                ws_tree=str(doc["ws_tree"]),
                added=[str(p) for p in doc["added"]],
                dropped=[(str(m), str(o), str(p)) for m, o, p in doc["dropped"]],
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no memo (or a damaged one): take the reset path

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.rename(tmp, path)


def read_trailer(path: Path, object_format: str) -> str | None:
    """The trailing checksum of an index file (hex), or None when the file is
    missing, too short, or has no checksum (all zeros)."""
    size = HASH_BYTES.get(object_format, 20)
    try:
        with open(path, "rb") as fh:
            fh.seek(-size, os.SEEK_END)
            raw = fh.read(size)
    except (FileNotFoundError, OSError):
        return None
    if len(raw) != size or not raw.strip(b"\0"):
        return None
    return raw.hex()


def copy_if_exists(src: Path, dst: Path) -> bool:
    """Copies `src` keeping its mtime (racy-git checks compare entry mtimes
    against the index file's)."""
    try:
        shutil.copy2(src, dst)
    except FileNotFoundError:
        return False
    return True


def link_if_exists(src: Path, dst: Path) -> bool:
    """Hard-links `src` (an index only preloop writes) at `dst`, copying it
    when a link is impossible (another filesystem). Safe because git never
    writes an index in place: it writes `<index>.lock` and renames it, so the
    linked original stays as it was. Keeps the mtime (racy-git) either way."""
    try:
        os.link(src, dst)
    except FileNotFoundError:
        return False
    except OSError:
        return copy_if_exists(src, dst)
    return True


def remove_if_exists(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class TreeChange(NamedTuple):
    """One line of `git diff-tree --raw`."""

    old_mode: str
    new_mode: str
    old_oid: str
    new_oid: str
    status: str
    path: str

    @property
    def is_tree(self) -> bool:
        return self.old_mode == "040000" or self.new_mode == "040000"


async def changed_entries(
    env: dict[str, str], old: str, new: str, *, trees: bool, only_added_dropped: bool = False
) -> list[TreeChange]:
    """`git diff-tree -r` between two trees (or commits); unchanged subtrees
    are not read. `trees` also lists the changed trees themselves."""
    args = ["diff-tree", "-r", "-z", "--no-renames", "--raw", "--no-commit-id"]
    if trees:
        args.append("-t")
    if only_added_dropped:
        args.append("--diff-filter=AD")
    # git 2.39's diff-tree reads the index although a tree-to-tree raw diff
    # never uses it (12 ms at 50k entries): point it next to the capture's
    # private index, at a name nothing creates (a missing index reads as empty).
    if "GIT_INDEX_FILE" in env:
        env = {**env, "GIT_INDEX_FILE": env["GIT_INDEX_FILE"] + ".absent"}
    out = (await git([*args, old, new], env=env)).stdout.decode("utf-8", "surrogateescape")
    fields = out.split("\0")
    entries = []
    for i in range(0, len(fields) - 1, 2):
        meta = fields[i]
        if not meta.startswith(":"):
            break
        old_mode, new_mode, old_oid, new_oid, status = meta[1:].split(" ")
        entries.append(TreeChange(old_mode, new_mode, old_oid, new_oid, status, fields[i + 1]))
    return entries
