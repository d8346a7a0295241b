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

**Split index.** A warm capture's index is a split index: the bulk of its
entries live in a shared index, `<key>.git/sharedindex.<oid>` (where git keeps
them for a `GIT_DIR` of `<key>.git`), and the capture's own index file holds
only the entries changed since, so `git add -A` and `write-tree` each write
a few kB instead of the whole index (two full writes were ~50 ms of SHA-1 at
50k files). `write-tree` runs in the cache entry and makes or renews the
shared index there (`split_index_write`); the commands that run in the
workspace's repository only keep an index split, never writing a shared index
(`SPLIT_INDEX_KEEP`): git writes shared indexes into its `GIT_DIR`, which must
stay untouched. They find the shared index beside the capture's index (git
looks there after its `GIT_DIR`), hard-linked into staging; the memo names it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from preloop.snapshot.gitcmd import git

__all__ = [
    "MEMO_NAME",
    "SPLIT_INDEX_KEEP",
    "IndexBase",
    "TreeChange",
    "changed_entries",
    "link_shared_index",
    "needs_new_shared_index",
    "read_trailer",
    "shared_index_path",
    "split_index_base",
    "split_index_write",
]

MEMO_NAME = "preloop-index-base.json"
# Beyond this many added/dropped paths a fix-up is no cheaper than a reset.
MAX_FIXUP_PATHS = 5000

EMPTY_TREE = {
    "sha1": "4b825dc642cb6eb9a060e54bf8d69288fbee4904",
    "sha256": "6ef19b41225c5369f1c104d45d8d85efa9b057b53b14b4b9b939dd74decc5321",
}
HASH_BYTES = {"sha1": 20, "sha256": 32}

SHARED_INDEX_PREFIX = "sharedindex."
# For commands run in the workspace's repository on a split index: keep it
# split, and never write a shared index (it would go into the workspace's
# git directory). Without them, `core.splitIndex=false` (gitcmd) unsplits it.
# fsmonitor off too: marking an entry fsmonitor-valid sets `cache_changed = 1`
# (outside git's EXTMASK), so git would write the index whole and unsplit,
# and the next command, reading an unsplit index with core.splitIndex=true,
# would write a new shared index into the workspace's git directory. (It
# buys nothing here: write-tree in the cache entry drops the extension.)
SPLIT_INDEX_KEEP: tuple[str, ...] = (
    "-c",
    "core.splitIndex=true",
    "-c",
    "splitIndex.maxPercentChange=100",
    "-c",
    "core.fsmonitor=false",
)
# git removes a cache entry's shared indexes unused for this long when it
# writes a new one; a capture that still uses one holds it by a link in its
# staging directory and puts it back when it persists (`link_shared_index`).
SHARED_INDEX_EXPIRY = "10.minutes.ago"
# A new shared index once the split part holds over this share of the entries.
MAX_SPLIT_SHARE = 0.2


def split_index_write(renew: bool) -> tuple[str, ...]:
    """The config for `write-tree` in the cache entry: split the index (an
    unsplit one gets a shared index), and with `renew` write a new shared
    index. git's own threshold counts only added entries, so a split part of
    modified entries would grow without bound: `needs_new_shared_index`."""
    return (
        "-c",
        "core.splitIndex=true",
        "-c",
        f"splitIndex.maxPercentChange={0 if renew else 100}",
        "-c",
        f"splitIndex.sharedIndexExpire={SHARED_INDEX_EXPIRY}",
    )


def _entry_count(path: Path) -> int | None:
    try:
        with open(path, "rb") as fh:
            header = fh.read(12)
    except OSError:
        return None
    if len(header) != 12 or header[:4] != b"DIRC":
        return None
    return int(struct.unpack_from(">I", header, 8)[0])


def needs_new_shared_index(index: Path, shared: Path) -> bool:
    """Whether the split index `index` holds over MAX_SPLIT_SHARE of the
    entries of its shared index `shared` (two headers read)."""
    own, base = _entry_count(index), _entry_count(shared)
    return own is None or base is None or own > MAX_SPLIT_SHARE * base


# git's temporary shared index (`sharedindex_` and a random suffix) left by a
# killed `write-tree` is removed after this long (git never removes it).
STALE_SHARED_TEMP = 3600.0


@dataclass
class IndexBase:
    """The memo of how the persisted index relates to the workspace index."""

    index_checksum: str
    ws_index_checksum: str | None
    ws_tree: str | None  # None: no fix-up from this memo (a reset instead)
    added: list[str] = field(default_factory=list)
    dropped: list[tuple[str, str, str]] = field(default_factory=list)  # mode, oid, path
    shared_index: str | None = None  # the base of a split index (its oid)

    @classmethod
    def load(cls, path: Path) -> IndexBase | None:
        try:
            doc = json.loads(path.read_text())
            return cls(
                index_checksum=str(doc["index_checksum"]),
                ws_index_checksum=doc["ws_index_checksum"],
                ws_tree=None if doc["ws_tree"] is None else str(doc["ws_tree"]),
                added=[str(p) for p in doc["added"]],
                dropped=[(str(m), str(o), str(p)) for m, o, p in doc["dropped"]],
                shared_index=_oid_or_none(doc.get("shared_index")),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no memo (or a damaged one): take the reset path

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.rename(tmp, path)


def _oid_or_none(value: object) -> str | None:
    """`value` if it is an object id (hex): it becomes part of a path."""
    if isinstance(value, str) and len(value) in (40, 64):
        with contextlib.suppress(ValueError):
            bytes.fromhex(value)
            return value.lower()
    return None


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


def split_index_base(path: Path, object_format: str) -> str | None:
    """The shared index (oid, hex) that the index file at `path` is split
    against, read from its `link` extension; None when it is not a split index
    or cannot be read. A split index file holds only the entries changed since
    its shared index, so the walk to its extensions is short."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    size = HASH_BYTES.get(object_format, 20)
    if len(data) < 12 + size or data[:4] != b"DIRC":
        return None
    version, count = struct.unpack_from(">II", data, 4)
    if version not in (2, 3, 4):
        return None
    # An entry: ctime, mtime, dev, ino, mode, uid, gid, size (40 bytes), the
    # oid, 16-bit flags (name length in the low 12 bits), 16 more flag bits
    # when 0x4000 is set; then the name, NUL-padded to 8 bytes (v2, v3) or,
    # in v4, a varint (bytes of the previous name to keep) and a NUL-ended
    # suffix, unpadded.
    flags_at = 40 + size
    end = len(data) - size
    pos = 12
    try:
        for _ in range(count):
            (flags,) = struct.unpack_from(">H", data, pos + flags_at)
            name = pos + flags_at + (4 if flags & 0x4000 else 2)
            if version == 4:
                while data[name] & 0x80:
                    name += 1
                pos = data.index(b"\0", name + 1) + 1
                continue
            length = flags & 0x0FFF
            if length == 0x0FFF:
                length = data.index(b"\0", name) - name
            pos += ((name - pos) + length + 8) & ~7
        while pos + 8 <= end:
            signature = data[pos : pos + 4]
            (ext_size,) = struct.unpack_from(">I", data, pos + 4)
            if signature == b"link":
                base = data[pos + 8 : pos + 8 + size]
                return base.hex() if len(base) == size and base.strip(b"\0") else None
            pos += 8 + ext_size
    except (struct.error, ValueError, IndexError):
        return None
    return None


def shared_index_path(directory: Path, oid: str) -> Path:
    """Where git looks for shared index `oid` in `directory`."""
    return directory / f"{SHARED_INDEX_PREFIX}{oid}"


def link_shared_index(source_dir: Path, target_dir: Path, oid: str) -> bool:
    """Makes `target_dir/sharedindex.<oid>` name the shared index
    `source_dir/sharedindex.<oid>` (a hard link; already there is fine);
    False when the source is gone."""
    return link_if_exists(shared_index_path(source_dir, oid), shared_index_path(target_dir, oid))


def remove_stale_shared_temps(git_dir: Path) -> None:
    """Removes the temporary shared indexes of `write-tree`s killed long ago."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(git_dir) as it:
        for entry in it:
            if entry.name.startswith("sharedindex_"):
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > STALE_SHARED_TEMP:
                        os.unlink(entry.path)


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
    linked original stays as it was. Keeps the mtime (racy-git) either way.
    A `dst` already there is kept (shared indexes are named by their
    checksum); a copy appears whole, by rename, for readers of `dst`."""
    try:
        os.link(src, dst)
    except (FileNotFoundError, FileExistsError) as exc:
        return isinstance(exc, FileExistsError)
    except OSError:
        tmp = dst.with_name(f".{dst.name}.{secrets.token_hex(4)}.tmp")
        try:
            if not copy_if_exists(src, tmp):
                return False
            os.rename(tmp, dst)
        finally:
            remove_if_exists(tmp)
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
