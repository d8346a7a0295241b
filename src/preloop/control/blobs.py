"""Content-addressed blobs in the store: what machines that share only the
database pass to each other (snapshot bundles, artifacts, cache archives).

A blob is named by the sha256 of its bytes and kept as rows of at most
`BlobStore.CHUNK` bytes (`preloop_blob_chunks`) under one `preloop_blobs`
row. Writing is idempotent by construction, so the store's retry of a lost
connection (`preloop.control.db`) may rerun any step:

- the blob row is inserted first, `complete = 0`, and readers ignore it;
- each chunk is its own short transaction, `(digest, seq)` keyed, inserted
  with ON CONFLICT DO NOTHING: a rerun, or two machines uploading the same
  bytes at once, write the same rows;
- the row turns `complete = 1` only after every chunk committed.

A crash mid-upload leaves an incomplete row and some chunks, invisible to
readers; `sweep` removes them once nothing has touched them for
`STALE_UPLOAD_SECONDS` (an upload in progress touches its row per chunk).

Pins (`preloop_blob_pins`: digest, holder) keep a blob from eviction; a
holder is a free-form name such as `run:<run key>`. Pinning and deleting
both lock the blob row first, so a blob pinned concurrently with its
eviction is either pinned (and kept) or already gone (and `pin` says so).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from preloop.errors import PreloopError

if TYPE_CHECKING:
    from preloop.control.db import Row, Tx
    from preloop.control.store import Store

__all__ = ["BlobInfo", "BlobMissing", "BlobStore"]

#: An incomplete upload untouched for this long was abandoned (its writer died).
STALE_UPLOAD_SECONDS = 3600.0


class BlobMissing(PreloopError):
    """The blob is not stored (never uploaded, or evicted since)."""


@dataclass(frozen=True, slots=True)
class BlobInfo:
    digest: str  # sha256 hex of the bytes
    size: int
    kind: str  # namespace: "bundle", "artifact", "cache", ...
    created_at: float


def _info(row: Row) -> BlobInfo:
    return BlobInfo(str(row["digest"]), int(row["size"]), str(row["kind"]), row["created_at"])


class BlobStore:
    """Blobs in one open `Store` (lite or PostgreSQL). Thread-safe as the
    store is; every method is one or more short transactions."""

    CHUNK = 1 << 20

    def __init__(self, store: Store) -> None:
        self._db = store.backend
        self._for_update = " FOR UPDATE" if store.dialect == "pg" else ""

    # ------------------------------------------------------------------ write

    def put_file(self, path: Path, kind: str) -> BlobInfo:
        """Stores the file's bytes (read twice: to name them, then to upload
        them); nothing is uploaded when the blob is already stored."""
        digest = hashlib.sha256()
        size = 0
        with open(path, "rb") as fh:
            while block := fh.read(self.CHUNK):
                digest.update(block)
                size += len(block)

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as fh:
                while block := fh.read(self.CHUNK):
                    yield block

        return self._put(digest.hexdigest(), size, kind, chunks)

    def put_bytes(self, data: bytes, kind: str) -> BlobInfo:
        view = memoryview(data)
        return self._put(
            hashlib.sha256(data).hexdigest(),
            len(data),
            kind,
            lambda: (bytes(view[i : i + self.CHUNK]) for i in range(0, len(data), self.CHUNK)),
        )

    def _put(
        self, digest: str, size: int, kind: str, chunks: Callable[[], Iterator[bytes]]
    ) -> BlobInfo:
        now = time.time()

        def begin(tx: Tx) -> Row | None:
            row = tx.one(
                "SELECT digest, kind, size, complete, created_at FROM preloop_blobs "
                "WHERE digest = ?",
                (digest,),
            )
            if row is None:
                tx.execute(
                    "INSERT INTO preloop_blobs (digest, kind, size, complete, created_at, "
                    "used_at) VALUES (?, ?, ?, 0, ?, ?) ON CONFLICT (digest) DO NOTHING",
                    (digest, kind, size, now, now),
                )
            elif row["complete"]:
                tx.execute("UPDATE preloop_blobs SET used_at = ? WHERE digest = ?", (now, digest))
            return row

        row = self._db.transaction("blob_put", begin)
        if row is not None and row["complete"]:
            return _info(row)
        for seq, block in enumerate(chunks()):
            self._db.transaction("blob_put", functools.partial(_insert_chunk, digest, seq, block))

        def finish(tx: Tx) -> Row | None:
            tx.execute(
                "UPDATE preloop_blobs SET complete = 1, used_at = ? WHERE digest = ?",
                (time.time(), digest),
            )
            return tx.one(
                "SELECT digest, kind, size, created_at FROM preloop_blobs WHERE digest = ?",
                (digest,),
            )

        done = self._db.transaction("blob_put", finish)
        if done is None:  # swept or evicted in between: very unlikely, never silent
            raise BlobMissing(f"blob {digest[:12]} vanished while it was being stored; retry")
        return _info(done)

    # ------------------------------------------------------------------- read

    def info(self, digest: str) -> BlobInfo | None:
        row = self._db.transaction(
            "blob_info",
            lambda tx: tx.one(
                "SELECT digest, kind, size, created_at FROM preloop_blobs "
                "WHERE digest = ? AND complete = 1",
                (digest,),
            ),
        )
        return None if row is None else _info(row)

    def has(self, digest: str) -> bool:
        return self.info(digest) is not None

    def iter_chunks(self, digest: str) -> Iterator[bytes]:
        """The blob's bytes, one chunk per query (a large blob is never held
        whole in memory). Marks it used (LRU)."""
        info = self.info(digest)
        if info is None:
            raise BlobMissing(f"blob {digest[:12]} is not in the store (evicted or never stored)")
        self.touch(digest)
        seq = 0
        got = 0
        while got < info.size:
            row = self._db.transaction("blob_read", functools.partial(_chunk, digest, seq))
            if row is None:
                raise BlobMissing(f"blob {digest[:12]} was evicted while it was being read")
            data = bytes(row["data"])
            got += len(data)
            seq += 1
            yield data

    def read_bytes(self, digest: str) -> bytes:
        data = b"".join(self.iter_chunks(digest))
        if hashlib.sha256(data).hexdigest() != digest:
            raise BlobMissing(f"blob {digest[:12]} is corrupt in the store (sha256 mismatch)")
        return data

    def read_to_file(self, digest: str, dest: Path) -> None:
        """Writes the blob to `dest` atomically (a temp file renamed into
        place once its sha256 matched)."""
        dest = Path(dest)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        check = hashlib.sha256()
        try:
            with open(tmp, "wb") as fh:
                for block in self.iter_chunks(digest):
                    check.update(block)
                    fh.write(block)
            if check.hexdigest() != digest:
                raise BlobMissing(f"blob {digest[:12]} is corrupt in the store (sha256 mismatch)")
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def touch(self, digest: str) -> None:
        self._db.transaction(
            "blob_touch",
            lambda tx: tx.execute(
                "UPDATE preloop_blobs SET used_at = ? WHERE digest = ?", (time.time(), digest)
            ),
        )

    def total_bytes(self, kind: str | None = None) -> int:
        sql = "SELECT COALESCE(SUM(size), 0) AS n FROM preloop_blobs"
        params: tuple[str, ...] = ()
        if kind is not None:
            sql += " WHERE kind = ?"
            params = (kind,)
        row = self._db.transaction("blob_total", lambda tx: tx.one(sql, params))
        return int(row["n"]) if row else 0

    # ------------------------------------------------------------ pins, eviction

    def pin(self, digest: str, holder: str) -> None:
        """Keeps the blob from eviction until `unpin(holder)`."""

        def fn(tx: Tx) -> bool:
            # The row lock orders this against a concurrent `delete`.
            row = tx.one(
                "SELECT digest FROM preloop_blobs WHERE digest = ? AND complete = 1"
                + self._for_update,
                (digest,),
            )
            if row is None:
                return False
            tx.execute(
                "INSERT INTO preloop_blob_pins (digest, holder) VALUES (?, ?) "
                "ON CONFLICT (digest, holder) DO NOTHING",
                (digest, holder),
            )
            return True

        if not self._db.transaction("blob_pin", fn):
            raise BlobMissing(f"blob {digest[:12]} is not in the store (evicted or never stored)")

    def unpin(self, holder: str, digest: str | None = None) -> int:
        """Removes `holder`'s pin of `digest` (None: all its pins); returns how many."""

        def fn(tx: Tx) -> int:
            if digest is None:
                rows = tx.execute(
                    "DELETE FROM preloop_blob_pins WHERE holder = ? RETURNING digest", (holder,)
                )
            else:
                rows = tx.execute(
                    "DELETE FROM preloop_blob_pins WHERE holder = ? AND digest = ? "
                    "RETURNING digest",
                    (holder, digest),
                )
            return len(rows)

        return self._db.transaction("blob_unpin", fn)

    def holders(self, digest: str) -> list[str]:
        rows = self._db.transaction(
            "blob_holders",
            lambda tx: tx.execute(
                "SELECT holder FROM preloop_blob_pins WHERE digest = ? ORDER BY holder",
                (digest,),
            ),
        )
        return [str(r["holder"]) for r in rows]

    def delete(self, digest: str) -> bool:
        """Removes an unpinned blob; False when it is pinned or absent."""

        def fn(tx: Tx) -> bool:
            row = tx.one(
                "SELECT digest FROM preloop_blobs WHERE digest = ?" + self._for_update, (digest,)
            )
            if row is None:
                return False
            # A fresh statement after the row lock sees every committed pin.
            if tx.one("SELECT 1 AS x FROM preloop_blob_pins WHERE digest = ?", (digest,)):
                return False
            tx.execute("DELETE FROM preloop_blob_chunks WHERE digest = ?", (digest,))
            tx.execute("DELETE FROM preloop_blobs WHERE digest = ?", (digest,))
            return True

        return self._db.transaction("blob_delete", fn)

    def evict(
        self,
        max_bytes: int,
        kind: str | None = None,
        keep: Callable[[list[BlobInfo]], set[str]] | None = None,
    ) -> list[BlobInfo]:
        """Removes unpinned complete blobs (of `kind`), least recently used
        first, until the total (of `kind`) is at most `max_bytes`. `keep`
        sees the candidates and may veto digests (e.g. bundles that a pinned
        bundle builds on). Returns what was removed."""
        total = self.total_bytes(kind)
        if total <= max_bytes:
            return []
        where = (
            "complete = 1 AND NOT EXISTS "
            "(SELECT 1 FROM preloop_blob_pins p WHERE p.digest = b.digest)"
        )
        params: tuple[str, ...] = ()
        if kind is not None:
            where += " AND kind = ?"
            params = (kind,)
        rows = self._db.transaction(
            "blob_evict",
            lambda tx: tx.execute(
                "SELECT digest, kind, size, created_at FROM preloop_blobs b "
                f"WHERE {where} ORDER BY used_at, digest",
                params,
            ),
        )
        candidates = [_info(r) for r in rows]
        vetoed = keep(candidates) if keep is not None else set()
        removed: list[BlobInfo] = []
        for blob in candidates:
            if total <= max_bytes:
                break
            if blob.digest in vetoed:
                continue
            if self.delete(blob.digest):
                removed.append(blob)
                total -= blob.size
        return removed

    def sweep(self, stale_after: float = STALE_UPLOAD_SECONDS) -> int:
        """Removes uploads abandoned by a crashed writer (incomplete rows
        untouched for `stale_after` seconds, and their chunks); returns how many."""
        cutoff = time.time() - stale_after

        def fn(tx: Tx) -> int:
            rows = tx.execute(
                "SELECT digest FROM preloop_blobs WHERE complete = 0 AND used_at < ?"
                + self._for_update,
                (cutoff,),
            )
            for r in rows:
                tx.execute("DELETE FROM preloop_blob_chunks WHERE digest = ?", (r["digest"],))
                tx.execute("DELETE FROM preloop_blobs WHERE digest = ?", (r["digest"],))
            # Chunks with no row at all (a row removed by hand): nothing reads them.
            tx.execute(
                "DELETE FROM preloop_blob_chunks WHERE NOT EXISTS "
                "(SELECT 1 FROM preloop_blobs b WHERE b.digest = preloop_blob_chunks.digest)"
            )
            return len(rows)

        return self._db.transaction("blob_sweep", fn)


def _chunk(digest: str, seq: int, tx: Tx) -> Row | None:
    return tx.one(
        "SELECT data FROM preloop_blob_chunks WHERE digest = ? AND seq = ?", (digest, seq)
    )


def _insert_chunk(digest: str, seq: int, block: bytes, tx: Tx) -> None:
    tx.execute(
        "INSERT INTO preloop_blob_chunks (digest, seq, data) VALUES (?, ?, ?) "
        "ON CONFLICT (digest, seq) DO NOTHING",
        (digest, seq, block),
    )
    # Touching the row per chunk tells `sweep` this upload is alive.
    tx.execute("UPDATE preloop_blobs SET used_at = ? WHERE digest = ?", (time.time(), digest))
