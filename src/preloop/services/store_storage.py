"""Artifacts and actions caches in the shared store, for runners on other machines.

`StoreStorage` implements `ServiceStorage` on an open `Store` (PostgreSQL for
a fleet; the lite store works too): every runner's service, on its own
loopback, reads and writes the same run's artifacts and the same caches.

- The bytes are content-addressed blobs (`preloop.control.blobs`, kinds
  `artifact` and `cache`), pinned by the row that names them
  (`artifact:<id>`, `cache:<id>`), so blob eviction never takes them.
- `preloop_artifacts` holds one row per finalized artifact, unique per
  (run, name): the row is inserted, with its pin, in the transaction that
  publishes it, after the blob is complete. A killed upload leaves staged
  files on the uploading host and at most an incomplete blob (swept), never
  a row: nothing of it is visible.
- `preloop_cache_entries` holds the cache index: a `pending` row from the
  reservation (another runner reserving the same key conflicts) to the
  finalization, which turns it `ready` with its blob. Lookups, ref scoping,
  restore-keys prefixes (newest first), the byte cap
  (`PRELOOP_ACTIONS_CACHE_MAX_BYTES`, least recently used first) are those of
  `LocalStorage`.

Upload blocks are staged on this host (`<state>/service-uploads/<instance>/`,
`StagedUploads`): the client sends them to the service that handed out the
upload URL. `blob_path` materialises a blob under
`<state>/service-blobs/<instance>/<digest>` for the server to send; the
directory is removed on `close`, and leftovers of killed processes are swept
(`sweep_abandoned_uploads`).

Every store call is a short transaction through the store's retries
(`preloop.control.db`); each is idempotent by construction: inserts of rows
that name themselves are `ON CONFLICT DO NOTHING` or check first in the same
transaction, and a rerun after an uncommitted attempt starts from scratch.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from preloop.control.blobs import BlobMissing, BlobStore
from preloop.services.storage import (
    ARTIFACT_ZIP,
    ArtifactRecord,
    CacheEntry,
    CacheMatch,
    StagedUploads,
    StorageConflict,
    StorageError,
    lookup_cache,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from preloop.control.db import Row, Tx
    from preloop.control.store import Store

    # Runs in the transaction that locked the complete blob (its digest given).
    PublishFn = Callable[[Tx, str], Row]

__all__ = ["StoreStorage"]

#: A pending cache reservation older than this was abandoned (as LocalStorage).
_STALE_RESERVATION = 3600.0
#: Materialised blobs of one service beyond this many bytes go, oldest first.
_LOCAL_BLOB_BYTES = 2 * 1024**3
_ARTIFACT_COLS = "id, run, job, name, size, digest, created_at, expires_at, mime_type"
_CACHE_COLS = "id, repo, ref, key, version, size, created, last_used"


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _record(row: Row) -> ArtifactRecord:
    return ArtifactRecord(
        run=str(row["run"]),
        job=str(row["job"]),
        id=int(row["id"]),
        name=str(row["name"]),
        size=int(row["size"]),
        digest=str(row["digest"]),
        created_at=str(row["created_at"]),
        expires_at=None if row["expires_at"] is None else str(row["expires_at"]),
        mime_type=str(row["mime_type"]),
    )


def _entry(row: Row) -> CacheEntry:
    return CacheEntry(
        int(row["id"]),
        str(row["repo"]),
        str(row["ref"]),
        str(row["key"]),
        str(row["version"]),
        int(row["size"]),
        float(row["created"]),
        float(row["last_used"]),
    )


class StoreStorage(StagedUploads):
    """`ServiceStorage` in an open store; `state_dir` is this host's state
    directory (staged uploads, materialised blobs). The caller keeps the
    store open until `close`."""

    remote = True  # store round trips: the server calls it in worker threads

    def __init__(self, store: Store, state_dir: Path, cache_max_bytes: int = 0) -> None:
        super().__init__()
        self.store = store
        self.blobs = BlobStore(store)
        self._db = store.backend
        self._for_update = " FOR UPDATE" if store.dialect == "pg" else ""
        self.cache_max_bytes = cache_max_bytes
        self.state_dir = Path(state_dir)
        instance = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.staging = self.state_dir / "service-uploads" / instance
        self.materialised = self.state_dir / "service-blobs" / instance
        # upload id -> (run, job, name, expires_at, mime_type) of an artifact
        # upload; the server calls from worker threads, so the bookkeeping
        # takes the lock.
        self._artifact_uploads: dict[str, tuple[str, str, str, str | None, str]] = {}
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        """Where the entries live, for `preloop cache status` (no password)."""
        return f"the {'PostgreSQL' if self.store.dialect == 'pg' else 'lite'} store"

    # -- staging -----------------------------------------------------------------
    def _stage(self) -> str:
        """A new upload staged under this service's directory."""
        return self._new_upload(self.staging, self.staging / f"{uuid.uuid4().hex}.data")

    def _abandon(self, upload: str) -> None:
        staged = self._uploads.get(upload)
        self._end_upload(upload)
        if staged is not None:
            staged.target.unlink(missing_ok=True)
            Path(f"{staged.target}.part").unlink(missing_ok=True)
        with self._lock:
            self._artifact_uploads.pop(upload, None)

    def _staged_size(self, upload: str) -> int:
        target = self._uploads[upload].target
        try:
            return target.stat().st_size
        except OSError:
            return -1

    def _publish(self, upload: str, kind: str, fn: PublishFn) -> Row:
        """Stores the upload's file as a blob and runs `fn(tx, digest)` in the
        transaction that locks the complete blob row (so a concurrent eviction
        either comes after `fn`'s pin or before, and the blob is put again)."""
        target = self._uploads[upload].target
        for _ in range(3):
            info = self.blobs.put_file(target, kind)

            def tx_fn(tx: Tx, digest: str = info.digest) -> Row | None:
                locked = tx.one(
                    "SELECT digest FROM preloop_blobs WHERE digest = ? AND complete = 1"
                    + self._for_update,
                    (digest,),
                )
                return None if locked is None else fn(tx, digest)

            try:
                row = self._db.transaction("service_publish", tx_fn)
            except BaseException:
                # Refused (a name taken meanwhile): the bytes go unless
                # something else pins the same content.
                self.blobs.delete(info.digest)
                raise
            if row is not None:
                return row
        raise StorageError("the upload's blob was evicted from the store three times; retry")

    # -- artifacts ---------------------------------------------------------------
    def create_artifact(
        self, run: str, job: str, name: str, expires_at: str | None, mime_type: str = ARTIFACT_ZIP
    ) -> str:
        exists = self._db.transaction(
            "artifact_exists",
            lambda tx: tx.one(
                "SELECT id FROM preloop_artifacts WHERE run = ? AND name = ?", (run, name)
            ),
        )
        if exists is not None:
            raise StorageConflict(
                f"an artifact named {name!r} already exists in run {run}: artifact names "
                "are unique within a run (upload-artifact's `overwrite: true` replaces it)"
            )
        # A pending upload of the same name here (a retried or killed client) is replaced.
        with self._lock:
            stale = [up for up, m in self._artifact_uploads.items() if (m[0], m[2]) == (run, name)]
        for up in stale:
            self._abandon(up)
        upload = self._stage()
        with self._lock:
            self._artifact_uploads[upload] = (run, job, name, expires_at, mime_type)
        return upload

    def finalize_artifact(
        self, run: str, job: str, name: str, size: int, digest: str
    ) -> ArtifactRecord:
        with self._lock:
            match = [up for up, m in self._artifact_uploads.items() if (m[0], m[2]) == (run, name)]
            if not match:
                raise StorageError(f"no upload of artifact {name!r} is in progress in run {run}")
            upload = match[0]
            # taken: a second finalize of the same upload finds none in progress
            _, _, _, expires_at, mime_type = self._artifact_uploads.pop(upload)
        try:
            actual = self._staged_size(upload)
            if actual < 0:
                raise StorageError(f"artifact {name!r}: the upload did not complete")
            if actual != size:
                raise StorageError(
                    f"artifact {name!r}: {actual} bytes were uploaded but the client "
                    f"declared {size}"
                )

            def insert(tx: Tx, blob: str) -> Row:
                row = tx.one(
                    "INSERT INTO preloop_artifacts (run, job, name, size, digest, blob, "
                    "created_at, created, expires_at, mime_type) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    f"ON CONFLICT (run, name) DO NOTHING RETURNING {_ARTIFACT_COLS}",
                    (
                        run,
                        job,
                        name,
                        actual,
                        digest,
                        blob,
                        _now_iso(),
                        time.time(),
                        expires_at,
                        mime_type,
                    ),
                )
                if row is None:
                    # Another runner's job finalized the name first (or this
                    # very insert committed and the answer was lost: the
                    # store's commit check returns the row then, never this).
                    raise StorageConflict(
                        f"an artifact named {name!r} already exists in run {run}: artifact "
                        "names are unique within a run"
                    )
                tx.execute(
                    "INSERT INTO preloop_blob_pins (digest, holder) VALUES (?, ?) "
                    "ON CONFLICT (digest, holder) DO NOTHING",
                    (blob, f"artifact:{row['id']}"),
                )
                return row

            return _record(self._publish(upload, "artifact", insert))
        finally:
            self._abandon(upload)

    def list_artifacts(
        self, run: str, name: str | None = None, id: int | None = None
    ) -> list[ArtifactRecord]:
        sql = f"SELECT {_ARTIFACT_COLS} FROM preloop_artifacts WHERE run = ?"
        params: list[object] = [run]
        if name is not None:
            sql += " AND name = ?"
            params.append(name)
        if id is not None:
            sql += " AND id = ?"
            params.append(id)
        rows = self._db.transaction(
            "artifact_list", lambda tx: tx.execute(sql + " ORDER BY id", params)
        )
        return [_record(r) for r in rows]

    def _delete_artifacts(self, where: str, params: Sequence[object]) -> list[Row]:
        """Removes the artifact rows matching `where` and their pins, then the
        blobs nothing else pins; returns the removed rows."""

        def fn(tx: Tx) -> list[Row]:
            rows = tx.execute(
                f"DELETE FROM preloop_artifacts WHERE {where} RETURNING id, run, blob", params
            )
            for r in rows:
                tx.execute(
                    "DELETE FROM preloop_blob_pins WHERE digest = ? AND holder = ?",
                    (r["blob"], f"artifact:{r['id']}"),
                )
            return rows

        rows = self._db.transaction("artifact_delete", fn)
        for blob in {str(r["blob"]) for r in rows}:
            self.blobs.delete(blob)  # False while another artifact or cache pins the bytes
        return rows

    def delete_artifact(self, run: str, name: str) -> int:
        rows = self._delete_artifacts("run = ? AND name = ?", (run, name))
        if not rows:
            raise StorageError(f"run {run} has no artifact named {name!r}")
        return int(rows[0]["id"])

    def remove_expired_artifacts(self, retention_days: int, now: float | None = None) -> list[str]:
        """Removes artifacts past their `expires_at`, and every artifact of the
        runs whose newest artifact is older than `retention_days` (0 keeps
        them). Returns the runs removed."""
        now = time.time() if now is None else now
        rows = self._db.transaction(
            "artifact_expiry",
            lambda tx: tx.execute(
                "SELECT id, expires_at FROM preloop_artifacts WHERE expires_at IS NOT NULL"
            ),
        )
        for r in rows:
            try:
                when = dt.datetime.fromisoformat(str(r["expires_at"])).timestamp()
            except ValueError:
                continue
            if when < now:
                self._delete_artifacts("id = ?", (int(r["id"]),))
        if retention_days <= 0:
            return []
        cutoff = now - retention_days * 86400
        old = self._db.transaction(
            "artifact_retention",
            lambda tx: tx.execute(
                "SELECT run FROM preloop_artifacts GROUP BY run HAVING MAX(created) < ?",
                (cutoff,),
            ),
        )
        removed = []
        for r in old:
            run = str(r["run"])
            # Only if still old: a job of the run may have uploaded since.
            self._delete_artifacts(
                "run = ? AND NOT EXISTS (SELECT 1 FROM preloop_artifacts n "
                "WHERE n.run = ? AND n.created >= ?)",
                (run, run, cutoff),
            )
            removed.append(run)
        return sorted(removed)

    # -- caches ------------------------------------------------------------------
    def reserve_cache(self, repo: str, ref: str, key: str, version: str) -> tuple[int, str]:
        """A pending entry and the upload that fills it; a key that exists (or
        is being uploaded by a job on any runner) raises `StorageConflict`."""
        upload = self._stage()
        now = time.time()

        def fn(tx: Tx) -> int | None:
            row = tx.one(
                "SELECT id, state, created FROM preloop_cache_entries WHERE repo = ? AND "
                "ref = ? AND key = ? AND version = ?" + self._for_update,
                (repo, ref, key, version),
            )
            if row is not None:
                if row["state"] == "ready" or now - float(row["created"]) < _STALE_RESERVATION:
                    return None
                tx.execute("DELETE FROM preloop_cache_entries WHERE id = ?", (row["id"],))
            got = tx.one(
                "INSERT INTO preloop_cache_entries (repo, ref, key, version, state, upload, "
                "created, last_used) VALUES (?, ?, ?, ?, 'pending', ?, ?, ?) "
                "ON CONFLICT (repo, ref, key, version) DO NOTHING RETURNING id",
                (repo, ref, key, version, upload, now, now),
            )
            return None if got is None else int(got["id"])

        try:
            ident = self._db.transaction("cache_reserve", fn)
        except BaseException:
            self._abandon(upload)
            raise
        if ident is None:
            self._abandon(upload)
            raise StorageConflict(
                f"cache entry {key!r} already exists for {ref or 'this ref'}: "
                "cache entries are immutable; use a new key"
            )
        return ident, upload

    def _drop_pending(self, ident: int, upload: str) -> None:
        self._db.transaction(
            "cache_drop",
            lambda tx: tx.execute(
                "DELETE FROM preloop_cache_entries WHERE id = ? AND state = 'pending'", (ident,)
            ),
        )
        self._abandon(upload)

    def finalize_cache(self, repo: str, ref: str, key: str, version: str, size: int) -> int:
        row = self._db.transaction(
            "cache_pending",
            lambda tx: tx.one(
                "SELECT id, upload FROM preloop_cache_entries WHERE repo = ? AND ref = ? AND "
                "key = ? AND version = ? AND state = 'pending'",
                (repo, ref, key, version),
            ),
        )
        if row is None or str(row["upload"]) not in self._uploads:
            raise StorageError(f"no upload of cache entry {key!r} is in progress")
        ident, upload = int(row["id"]), str(row["upload"])
        actual = self._staged_size(upload)
        if actual != size:
            self._drop_pending(ident, upload)
            raise StorageError(
                f"cache entry {key!r}: {max(actual, 0)} bytes were uploaded but the client "
                f"declared {size}"
            )
        if self.cache_max_bytes and size > self.cache_max_bytes:
            self._drop_pending(ident, upload)
            raise StorageError(
                f"cache entry {key!r} ({size} bytes) is larger than "
                f"PRELOOP_ACTIONS_CACHE_MAX_BYTES ({self.cache_max_bytes})"
            )

        def ready(tx: Tx, blob: str) -> Row:
            now = time.time()
            done = tx.one(
                "UPDATE preloop_cache_entries SET state = 'ready', size = ?, blob = ?, "
                "upload = NULL, created = ?, last_used = ? WHERE id = ? AND state = 'pending' "
                "RETURNING id",
                (size, blob, now, now, ident),
            )
            if done is None:
                raise StorageError(
                    f"cache entry {key!r}: the reservation was dropped (swept as abandoned)"
                )
            tx.execute(
                "INSERT INTO preloop_blob_pins (digest, holder) VALUES (?, ?) "
                "ON CONFLICT (digest, holder) DO NOTHING",
                (blob, f"cache:{ident}"),
            )
            return done

        try:
            self._publish(upload, "cache", ready)
        except StorageError:
            self._drop_pending(ident, upload)
            raise
        self._abandon(upload)
        self._evict(keep=ident)
        return ident

    def _delete_entries(self, ids: Sequence[int]) -> None:
        def fn(tx: Tx) -> list[Row]:
            gone: list[Row] = []
            for ident in ids:
                row = tx.one(
                    "DELETE FROM preloop_cache_entries WHERE id = ? RETURNING id, blob", (ident,)
                )
                if row is not None and row["blob"] is not None:
                    tx.execute(
                        "DELETE FROM preloop_blob_pins WHERE digest = ? AND holder = ?",
                        (row["blob"], f"cache:{ident}"),
                    )
                    gone.append(row)
            return gone

        for row in self._db.transaction("cache_delete", fn):
            self.blobs.delete(str(row["blob"]))

    def _evict(self, keep: int) -> None:
        """Least recently used entries go until the ready bytes fit the cap."""
        if not self.cache_max_bytes:
            return
        rows = self._db.transaction(
            "cache_evict",
            lambda tx: tx.execute(
                "SELECT id, size FROM preloop_cache_entries WHERE state = 'ready' "
                "ORDER BY last_used, id"
            ),
        )
        total = sum(int(r["size"]) for r in rows)
        victims: list[int] = []
        for r in rows:
            if total <= self.cache_max_bytes:
                break
            if int(r["id"]) == keep:
                continue
            victims.append(int(r["id"]))
            total -= int(r["size"])
        if victims:
            self._delete_entries(victims)

    def match_cache(
        self, repo: str, refs: Sequence[str], key: str, restore_keys: Sequence[str], version: str
    ) -> CacheMatch | None:
        """GitHub's lookup: in the run's ref, then in each fallback ref (the
        default branch): the exact key, then each restore key as a prefix,
        newest entry first."""

        def fn(tx: Tx) -> Row | None:
            row = lookup_cache(
                refs,
                key,
                restore_keys,
                lambda ref, k: tx.one(
                    f"SELECT {_CACHE_COLS} FROM preloop_cache_entries WHERE repo = ? AND "
                    "ref = ? AND key = ? AND version = ? AND state = 'ready'",
                    (repo, ref, k, version),
                ),
                lambda ref, prefix: tx.one(
                    f"SELECT {_CACHE_COLS} FROM preloop_cache_entries WHERE repo = ? "
                    "AND ref = ? AND version = ? AND state = 'ready' AND "
                    "substr(key, 1, CAST(? AS INTEGER)) = ? "
                    "ORDER BY created DESC, id DESC LIMIT 1",
                    (repo, ref, version, len(prefix), prefix),
                ),
            )
            if row is not None:
                tx.execute(
                    "UPDATE preloop_cache_entries SET last_used = ? WHERE id = ?",
                    (time.time(), row["id"]),
                )
            return row

        row = self._db.transaction("cache_match", fn)
        if row is None:
            return None
        entry = _entry(row)
        return CacheMatch(entry, entry.key)

    def cache_entries(self) -> list[CacheEntry]:
        rows = self._db.transaction(
            "cache_entries",
            lambda tx: tx.execute(
                f"SELECT {_CACHE_COLS} FROM preloop_cache_entries WHERE state = 'ready' "
                "ORDER BY last_used, id"
            ),
        )
        return [_entry(r) for r in rows]

    # -- serving -----------------------------------------------------------------
    def blob_path(self, kind: str, ref: str) -> Path:
        """A local file with the bytes of an artifact (`ref` = `<run>/<id>`) or
        a cache entry (its id), fetched from the store on first use. A path
        that does not exist when there is no such thing (any more)."""
        if kind == "artifact":
            run, _, ident = ref.partition("/")
            row = self._db.transaction(
                "artifact_blob",
                lambda tx: tx.one(
                    "SELECT blob FROM preloop_artifacts WHERE run = ? AND id = ?",
                    (run, int(ident)),
                ),
            )
        else:
            row = self._db.transaction(
                "cache_blob",
                lambda tx: tx.one(
                    "SELECT blob FROM preloop_cache_entries WHERE id = ? AND state = 'ready'",
                    (int(ref),),
                ),
            )
        missing = self.materialised / "missing"
        if row is None:
            return missing
        digest = str(row["blob"])
        path = self.materialised / digest
        if path.is_file():
            os.utime(path)  # most recently used: pruned last
            return path
        self.materialised.mkdir(parents=True, exist_ok=True)
        tmp = self.materialised / f".{digest}.{uuid.uuid4().hex[:8]}"
        try:
            self.blobs.read_to_file(digest, tmp)
            os.replace(tmp, path)
        except BlobMissing:
            return missing
        finally:
            tmp.unlink(missing_ok=True)
        self._prune_materialised(keep=path)
        return path

    def _prune_materialised(self, keep: Path) -> None:
        """Oldest materialised blobs go while they take more than
        `_LOCAL_BLOB_BYTES` (a download being sent keeps its open file)."""
        files = []
        for path in self.materialised.iterdir():
            if path.name.startswith(".") or path == keep:
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files) + keep.stat().st_size
        for _, size, path in sorted(files):
            if total <= _LOCAL_BLOB_BYTES:
                break
            path.unlink(missing_ok=True)
            total -= size

    # -- upkeep ------------------------------------------------------------------
    def sweep_abandoned_uploads(self, older_than: float = 86400.0) -> int:
        """Removes what uploads of dead services left: staged files and
        materialised blobs on this host, pending cache reservations and
        incomplete blobs in the store, once older than `older_than` seconds.
        Returns how many local directories and rows went."""
        cutoff = time.time() - older_than
        removed = 0
        for root in (self.staging.parent, self.materialised.parent):
            if not root.is_dir():
                continue
            for path in root.iterdir():
                if path in (self.staging, self.materialised):
                    continue
                try:
                    if path.lstat().st_mtime >= cutoff:
                        continue
                except FileNotFoundError:
                    continue
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        rows = self._db.transaction(
            "cache_sweep",
            lambda tx: tx.execute(
                "DELETE FROM preloop_cache_entries WHERE state = 'pending' AND created < ? "
                "RETURNING id",
                (cutoff,),
            ),
        )
        self.blobs.sweep()
        # Complete blobs that no artifact or cache entry pins (a publisher
        # killed between storing the bytes and its row) are removed too.
        orphans = self._db.transaction(
            "service_orphans",
            lambda tx: tx.execute(
                "SELECT digest FROM preloop_blobs b WHERE kind IN ('artifact', 'cache') AND "
                "complete = 1 AND used_at < ? AND NOT EXISTS "
                "(SELECT 1 FROM preloop_blob_pins p WHERE p.digest = b.digest)",
                (cutoff,),
            ),
        )
        gone = sum(self.blobs.delete(str(r["digest"])) for r in orphans)
        return removed + len(rows) + gone

    def close(self) -> None:
        """Abandons the uploads still in progress (their staged files go; a
        pending cache entry of this service is dropped) and removes the
        materialised blobs. The store stays open (its owner closes it)."""
        uploads = list(self._uploads)
        for upload in uploads:
            self._abandon(upload)
        if uploads:
            self._db.transaction(
                "cache_abandon",
                lambda tx: tx.executemany(
                    "DELETE FROM preloop_cache_entries WHERE upload = ? AND state = 'pending'",
                    [(u,) for u in uploads],
                ),
            )
        shutil.rmtree(self.staging, ignore_errors=True)
        shutil.rmtree(self.materialised, ignore_errors=True)
