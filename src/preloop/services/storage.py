"""Where artifacts and actions caches live: one small interface, two implementations.

`ServiceStorage` is everything the HTTP services need from storage. On the
shared PostgreSQL store, `preloop.services.store_storage.StoreStorage` keeps
them in the store, so runners on other machines share them; `LocalStorage`
(the lite store) keeps them on this host's disk:

```
<state>/artifacts/<run>/<id>.zip          an artifact, zipped as the client uploaded it
<state>/artifacts/<run>/<id>.json         its record (name, size, digest, job, dates)
<state>/artifacts/<run>/run-key           the unique key of the run whose artifacts these are
<state>/artifacts/<run>.<key>/            another store's run <run>, moved aside
<state>/artifacts/<run>/.uploads/<u>/     blocks of an upload in progress
<state>/actions-cache/index.db            cache entries (SQLite): scope, key, version, use
<state>/actions-cache/blobs/<id>.tar      a cache archive
<state>/actions-cache/uploads/<u>/        blocks of a cache upload in progress
```

An upload is written under a temporary name and becomes visible only when
its record is renamed into place after the size check (artifacts) or the
index row turns `ready` (caches), so a killed upload never leaves half an
artifact or cache visible; leftovers are swept.

Run ids repeat across the stores that share a state directory (another
`--store`, a lite store reset), so a run's directory carries the run's unique
key (`github.preloop_engine.run_key`) as the logs directory does: the first
upload of a run whose key differs moves the other run's artifacts aside to
`<run>.<its key>`, and `artifact_run_name` finds the directory of a given run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import itertools
import json
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

__all__ = [
    "ArtifactRecord",
    "CacheEntry",
    "CacheMatch",
    "LocalStorage",
    "ServiceStorage",
    "StagedUploads",
    "StorageConflict",
    "StorageError",
    "artifact_run_name",
]

#: the largest block given a region of the data file before it arrives (see
#: `LocalStorage.write_block`); GitHub's clients send 8 MiB and 32-64 MiB blocks
_RESERVE_MAX = 256 << 20
#: `<state>/artifacts/<run>/run-key` (the name the logs' marker has too)
RUN_KEY_MARKER = "run-key"
_BLOCK_ID = re.compile(r"^[A-Za-z0-9+/=_-]{1,100}$")  # Azure: <= 64 bytes, base64


class StorageError(Exception):
    """A request the storage refuses (bad size, unknown upload, over a cap)."""


class StorageConflict(StorageError):
    """The thing already exists (an artifact name in a run, a cache key)."""


ARTIFACT_ZIP = "application/zip"


def is_zip_type(mime: str) -> bool:
    """Whether an artifact of media type `mime` is a zip, as @actions/artifact
    6.x decides whether to unzip a download (any case, no parameters)."""
    base = mime.split(";", 1)[0].strip().lower()
    return base in ("application/zip", "application/x-zip-compressed", "application/zip-compressed")


@dataclass(frozen=True, slots=True)
class ArtifactRecord:
    run: str
    job: str
    id: int
    name: str
    size: int
    digest: str
    created_at: str
    expires_at: str | None
    # What the client said it uploads (@actions/artifact 2.x always a zip; 6.x
    # a file as it is with upload-artifact's `archive: false`); served as the
    # download's Content-Type, which decides whether the client unzips it.
    mime_type: str = ARTIFACT_ZIP

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class CacheEntry:
    id: int
    repo: str
    ref: str
    key: str
    version: str
    size: int
    created: float
    last_used: float


@dataclass(frozen=True, slots=True)
class CacheMatch:
    entry: CacheEntry
    matched_key: str


T = TypeVar("T")


def lookup_cache(
    refs: Sequence[str],
    key: str,
    restore_keys: Sequence[str],
    exact: Callable[[str, str], T | None],
    newest_with_prefix: Callable[[str, str], T | None],
) -> T | None:
    """GitHub's cache lookup order, for every `ServiceStorage`: in each of
    `refs` in turn (the run's, then its fallbacks), the exact `key`, then
    each of `restore_keys` as a prefix (the newest entry that has it)."""
    for ref in dict.fromkeys(refs):
        found = exact(ref, key)
        for prefix in restore_keys:
            if found is not None:
                break
            found = newest_with_prefix(ref, prefix)
        if found is not None:
            return found
    return None


class ServiceStorage(Protocol):
    """What the artifact and cache services need from storage."""

    # True when calls are network round trips (the shared store): the server
    # runs them in worker threads so one job's upload never stalls another's.
    remote: bool

    # uploads (blob protocol): blocks, then a commit, under an upload id
    async def write_block(
        self, upload: str, block: str | None, body: AsyncIterator[bytes], limit: int
    ) -> int: ...
    async def write_range(
        self, upload: str, offset: int, body: AsyncIterator[bytes], limit: int
    ) -> int: ...
    def commit_blocks(self, upload: str, blocks: Sequence[str]) -> int: ...
    def blob_path(self, kind: str, ref: str) -> Path: ...

    # artifacts
    def create_artifact(
        self, run: str, job: str, name: str, expires_at: str | None, mime_type: str = ARTIFACT_ZIP
    ) -> str: ...
    def finalize_artifact(
        self, run: str, job: str, name: str, size: int, digest: str
    ) -> ArtifactRecord: ...
    def list_artifacts(
        self, run: str, name: str | None = None, id: int | None = None
    ) -> list[ArtifactRecord]: ...
    def delete_artifact(self, run: str, name: str) -> int: ...

    # caches
    def reserve_cache(self, repo: str, ref: str, key: str, version: str) -> tuple[int, str]: ...
    def finalize_cache(self, repo: str, ref: str, key: str, version: str, size: int) -> int: ...
    def match_cache(
        self, repo: str, refs: Sequence[str], key: str, restore_keys: Sequence[str], version: str
    ) -> CacheMatch | None: ...
    def cache_entries(self) -> list[CacheEntry]: ...

    # upkeep
    def sweep_abandoned_uploads(self, older_than: float = 86400.0) -> int: ...
    def remove_expired_artifacts(
        self, retention_days: int, now: float | None = None
    ) -> list[str]: ...
    def close(self) -> None: ...


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass(slots=True)
class _Upload:
    """An upload in progress: the directory of its blocks, the file its commit
    makes, and where each staged block lies (a file of its own, or `None` for
    the data file, at an offset) with the data file's end."""

    directory: Path
    target: Path
    placed: dict[str, tuple[Path | None, int, int]] = field(default_factory=dict)
    end: int = 0
    appending: bool = False

    @property
    def data(self) -> Path:
        return self.directory / "data"  # block files are named in hex: never "data"


async def _stream_to(path: Path, offset: int, body: AsyncIterator[bytes], limit: int) -> int:
    """Writes `body` into `path` from `offset` (creating it); more than
    `limit` bytes raises `StorageError`. Returns the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    size = 0
    try:
        async for chunk in body:
            if size + len(chunk) > limit:
                raise StorageError(f"upload is larger than the limit of {limit} bytes")
            view = memoryview(chunk)
            while view:
                n = os.pwrite(fd, view, offset + size)
                size += n
                view = view[n:]
    finally:
        os.close(fd)
    return size


def _copy_range(src: int, src_at: int, dst: int, dst_at: int, count: int) -> None:
    """Copies `count` bytes between file descriptors in the kernel."""
    done = 0
    while done < count:
        n = os.copy_file_range(src, dst, count - done, src_at + done, dst_at + done)
        if n == 0:
            raise StorageError("a staged block is shorter than when it was written")
        done += n


class _RunLock:
    """flock on `<dir>/.lock`: one writer of a run's artifact records at a time,
    across the processes sharing the state directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


class StagedUploads:
    """Uploads in progress as files on this host: blocks (or ranges) staged
    under a directory per upload, joined into the upload's target file on
    commit. Nothing staged is visible to readers: the storage publishes the
    target when the upload is finalized. Shared by `LocalStorage` and
    `preloop.services.store_storage.StoreStorage` (whose target then goes to
    the store)."""

    def __init__(self) -> None:
        # upload id -> where its blocks are and the file its commit makes
        self._uploads: dict[str, _Upload] = {}

    # -- uploads -----------------------------------------------------------------
    def _upload(self, upload: str) -> _Upload:
        try:
            return self._uploads[upload]
        except KeyError:
            raise StorageError(f"unknown or finished upload {upload!r}") from None

    async def write_block(
        self, upload: str, block: str | None, body: AsyncIterator[bytes], limit: int
    ) -> int:
        """Streams one block (or, with `block=None`, the whole blob) to disk.
        More than `limit` bytes is refused and nothing of it is kept.

        Blocks go into the upload's data file in the order they arrive, so
        that the commit of blocks sent in order (what clients do: GitHub's
        artifact client one after the other, its cache client a few at a
        time in index order) only renames the file. A block of a known
        length (`limit` is its Content-Length, at most `_RESERVE_MAX`) gets
        a region of that length at the end, however many arrive at once; one
        of unknown length is appended when no other is arriving, else it goes
        to a file of its own."""
        up = self._upload(upload)
        if block is not None and not _BLOCK_ID.match(block):
            raise StorageError(f"bad block id {block!r}")
        if block is not None and limit <= _RESERVE_MAX and not up.appending:
            offset = up.end
            up.end += limit  # a block that ends short leaves a gap: its commit copies
            size = await _stream_to(up.data, offset, body, limit)
            up.placed[block] = (None, offset, size)
            return size
        if block is not None and not up.appending:
            up.appending = True
            try:
                offset = up.end
                size = await _stream_to(up.data, offset, body, limit)
                up.placed[block] = (None, offset, size)
                up.end = offset + size
            finally:
                up.appending = False
            return size
        name = block.encode().hex() if block is not None else "whole"
        tmp = up.directory / f".{name}.{uuid.uuid4().hex[:8]}"
        try:
            size = await _stream_to(tmp, 0, body, limit)
            if block is None:
                os.replace(tmp, up.target)
            else:
                os.replace(tmp, up.directory / name)
                up.placed[block] = (up.directory / name, 0, size)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    async def write_range(
        self, upload: str, offset: int, body: AsyncIterator[bytes], limit: int
    ) -> int:
        """Writes a chunk at `offset` of the upload's file (the legacy cache
        protocol's `Content-Range` PATCHes); the file ends at most at `limit`."""
        return await _stream_to(self._upload(upload).target, offset, body, limit - offset)

    def commit_blocks(self, upload: str, blocks: Sequence[str]) -> int:
        """Makes the staged blocks, in `blocks` order, the upload's file: a
        rename when they lie in the data file in that order (the usual case),
        else a copy of each block in turn (in-kernel, `copy_file_range`)."""
        up = self._upload(upload)
        regions: list[tuple[Path | None, int, int]] = []
        for block in blocks:
            try:
                regions.append(up.placed[block])
            except KeyError:
                raise StorageError(f"block {block!r} was never uploaded") from None
        size = sum(n for _, _, n in regions)
        in_order = all(path is None for path, _, _ in regions) and [
            off for _, off, _ in regions
        ] == list(itertools.accumulate((n for _, _, n in regions[:-1]), initial=0))
        if in_order:
            with open(up.data, "ab") as fh:  # created when there were no blocks
                fh.truncate(size)
            os.replace(up.data, up.target)
        else:
            part = Path(f"{up.target}.part")
            with open(part, "wb") as out:
                at = 0
                for path, offset, n in regions:
                    with open(path or up.data, "rb") as src:
                        _copy_range(src.fileno(), offset, out.fileno(), at, n)
                    at += n
            os.replace(part, up.target)
        for path in up.directory.iterdir():
            if not path.name.startswith("."):
                path.unlink(missing_ok=True)
        up.placed.clear()
        up.end = 0
        return size

    def _new_upload(self, root: Path, target: Path) -> str:
        upload = uuid.uuid4().hex
        directory = root / upload
        directory.mkdir(parents=True)
        self._uploads[upload] = _Upload(directory, target)
        return upload

    def _end_upload(self, upload: str) -> None:
        up = self._uploads.pop(upload, None)
        if up is not None:
            shutil.rmtree(up.directory, ignore_errors=True)
            (up.directory.parent / f"{upload}.meta").unlink(missing_ok=True)


class LocalStorage(StagedUploads):
    """`ServiceStorage` on this host's disk under the state directory."""

    remote = False  # local files: the server calls it on its event loop

    def __init__(
        self, state_dir: Path, cache_max_bytes: int = 0, run_key: str | None = None
    ) -> None:
        """`run_key`: the unique key of the runs this storage serves (one
        `preloop run`); their artifact directories are claimed with it."""
        super().__init__()
        self.state_dir = Path(state_dir)
        self.run_key = run_key
        self.artifacts = self.state_dir / "artifacts"
        self.cache_dir = self.state_dir / "actions-cache"
        self.cache_max_bytes = cache_max_bytes
        self._db: sqlite3.Connection | None = None
        self._db_lock = threading.Lock()

    def blob_path(self, kind: str, ref: str) -> Path:
        """The finished file of an artifact (`ref` = `<run>/<id>`) or a cache entry (its id)."""
        if kind == "artifact":
            run, _, ident = ref.partition("/")
            return self.artifacts / _safe(run) / f"{int(ident)}.zip"
        return self.cache_dir / "blobs" / f"{int(ref)}.tar"

    # -- artifacts ---------------------------------------------------------------
    def _run_dir(self, run: str) -> Path:
        return self.artifacts / _safe(run)

    def _records(self, run: str) -> list[ArtifactRecord]:
        directory = self._run_dir(run)
        out: list[ArtifactRecord] = []
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(directory):
                if not name.endswith(".json") or name.startswith("."):
                    continue
                try:
                    data = json.loads((directory / name).read_text(encoding="utf-8"))
                    out.append(ArtifactRecord(**data))
                except (OSError, ValueError, TypeError):
                    continue
        out.sort(key=lambda r: r.id)
        return out

    def _pending(self, run: str) -> dict[str, str]:
        return {
            ident: str(up.target)
            for ident, up in self._uploads.items()
            if up.target.parent == self._run_dir(run) / ".uploads"
        }

    def _claim_run_dir(self, run: str) -> None:
        """Makes `artifacts/<run>` the directory of this storage's run: what
        another run with the same id (another store's) left there is moved
        aside to `<run>.<its key>` first, never mixed in or refused as a
        duplicate name."""
        if not self.run_key:
            return
        directory = self._run_dir(run)
        with _RunLock(self.artifacts).hold():
            current = _read_marker(directory)
            if current == self.run_key:
                return
            if directory.exists():
                aside = self.artifacts / f"{_safe(run)}.{_safe(current or 'unknown')}"
                if aside.exists():
                    shutil.rmtree(aside, ignore_errors=True)
                directory.rename(aside)
            directory.mkdir(parents=True)
            tmp = directory / f".{RUN_KEY_MARKER}.tmp"
            tmp.write_text(self.run_key, encoding="utf-8")
            os.replace(tmp, directory / RUN_KEY_MARKER)

    def create_artifact(
        self, run: str, job: str, name: str, expires_at: str | None, mime_type: str = ARTIFACT_ZIP
    ) -> str:
        self._claim_run_dir(run)
        directory = self._run_dir(run)
        with _RunLock(directory).hold():
            if any(r.name == name for r in self._records(run)):
                raise StorageConflict(
                    f"an artifact named {name!r} already exists in run {run}: artifact names "
                    "are unique within a run (upload-artifact's `overwrite: true` replaces it)"
                )
            # A pending upload of the same name (a retried or killed upload) is replaced.
            for up, target in self._pending(run).items():
                if Path(target).name == f"{_safe(name)}.zip":
                    self._end_upload(up)
            uploads = directory / ".uploads"
            uploads.mkdir(parents=True, exist_ok=True)
            upload = self._new_upload(uploads, uploads / f"{_safe(name)}.zip")
            (uploads / f"{upload}.meta").write_text(
                json.dumps(
                    {"job": job, "name": name, "expires_at": expires_at, "mime_type": mime_type}
                )
            )
            return upload

    def finalize_artifact(
        self, run: str, job: str, name: str, size: int, digest: str
    ) -> ArtifactRecord:
        directory = self._run_dir(run)
        with _RunLock(directory).hold():
            uploads = directory / ".uploads"
            match = [
                up
                for up, target in self._pending(run).items()
                if Path(target).name == f"{_safe(name)}.zip"
            ]
            if not match:
                raise StorageError(f"no upload of artifact {name!r} is in progress in run {run}")
            upload = match[0]
            target = self._uploads[upload].target
            try:
                meta = json.loads((uploads / f"{upload}.meta").read_text(encoding="utf-8"))
                actual = target.stat().st_size
            except (OSError, ValueError):
                self._end_upload(upload)
                raise StorageError(f"artifact {name!r}: the upload did not complete") from None
            if actual != size:
                self._end_upload(upload)
                target.unlink(missing_ok=True)
                raise StorageError(
                    f"artifact {name!r}: {actual} bytes were uploaded but the client "
                    f"declared {size}"
                )
            ident = max((r.id for r in self._records(run)), default=0) + 1
            os.replace(target, directory / f"{ident}.zip")
            record = ArtifactRecord(
                run=run,
                job=job,
                id=ident,
                name=name,
                size=actual,
                digest=digest,
                created_at=_now_iso(),
                expires_at=meta.get("expires_at"),
                mime_type=str(meta.get("mime_type") or ARTIFACT_ZIP),
            )
            tmp = directory / f".{ident}.json.tmp"
            tmp.write_text(json.dumps(record.to_dict()), encoding="utf-8")
            os.replace(tmp, directory / f"{ident}.json")  # visible from here on
            (uploads / f"{upload}.meta").unlink(missing_ok=True)
            self._end_upload(upload)
            return record

    def list_artifacts(
        self, run: str, name: str | None = None, id: int | None = None
    ) -> list[ArtifactRecord]:
        return [
            r
            for r in self._records(run)
            if (name is None or r.name == name) and (id is None or r.id == id)
        ]

    def delete_artifact(self, run: str, name: str) -> int:
        directory = self._run_dir(run)
        with _RunLock(directory).hold():
            for r in self._records(run):
                if r.name == name:
                    (directory / f"{r.id}.json").unlink(missing_ok=True)
                    (directory / f"{r.id}.zip").unlink(missing_ok=True)
                    return r.id
        raise StorageError(f"run {run} has no artifact named {name!r}")

    def sweep_uploads(self, run: str) -> None:
        """Removes what unfinished uploads of `run` left (a killed client, a dead service)."""
        shutil.rmtree(self._run_dir(run) / ".uploads", ignore_errors=True)

    def sweep_abandoned_uploads(self, older_than: float = 86400.0) -> int:
        """Removes what uploads of dead services left (blocks, partial files,
        pending cache rows) once older than `older_than` seconds: a live
        service's uploads are younger. Returns how many were removed."""
        cutoff = time.time() - older_than
        removed = 0
        leftovers = list(self.artifacts.glob("*/.uploads/*")) if self.artifacts.is_dir() else []
        if self.cache_dir.is_dir():
            leftovers += list((self.cache_dir / "uploads").glob("*"))
            leftovers += list((self.cache_dir / "blobs").glob(".*.part"))
        for path in leftovers:
            try:
                if path.lstat().st_mtime >= cutoff:
                    continue
            except FileNotFoundError:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
        if (self.cache_dir / "index.db").exists():
            with self._tx() as db:
                db.execute("DELETE FROM entries WHERE state='pending' AND created < ?", (cutoff,))
        return removed

    def _remove_past_their_expiry(self, now: float) -> None:
        """Artifacts uploaded with `retention-days` (their `expires_at`) go when it passes."""
        with contextlib.suppress(FileNotFoundError):
            for run in os.listdir(self.artifacts):
                if run.startswith("."):
                    continue
                for record in self._records(run):
                    if not record.expires_at:
                        continue
                    try:
                        when = dt.datetime.fromisoformat(record.expires_at).timestamp()
                    except ValueError:
                        continue
                    if when < now:
                        directory = self._run_dir(run)
                        (directory / f"{record.id}.json").unlink(missing_ok=True)
                        (directory / f"{record.id}.zip").unlink(missing_ok=True)

    def remove_expired_artifacts(self, retention_days: int, now: float | None = None) -> list[str]:
        """Removes every run's artifacts whose newest artifact is older than
        `retention_days` (0 keeps everything). Returns the runs removed."""
        now = time.time() if now is None else now
        self._remove_past_their_expiry(now)
        if retention_days <= 0:
            return []
        removed: list[str] = []
        with contextlib.suppress(FileNotFoundError):
            for run in os.listdir(self.artifacts):
                directory = self.artifacts / run
                if run.startswith(".") or not directory.is_dir():
                    continue
                try:
                    newest = max(
                        (p.stat().st_mtime for p in directory.iterdir()),
                        default=directory.stat().st_mtime,
                    )
                except OSError:
                    continue
                if now - newest > retention_days * 86400:
                    shutil.rmtree(directory, ignore_errors=True)
                    removed.append(run)
        return sorted(removed)

    # -- caches ------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            (self.cache_dir / "blobs").mkdir(exist_ok=True)
            db = sqlite3.connect(
                self.cache_dir / "index.db", check_same_thread=False, isolation_level=None
            )
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=30000")
            db.execute(
                "CREATE TABLE IF NOT EXISTS entries (id INTEGER PRIMARY KEY, repo TEXT NOT NULL,"
                " ref TEXT NOT NULL, key TEXT NOT NULL, version TEXT NOT NULL,"
                " size INTEGER NOT NULL DEFAULT 0, state TEXT NOT NULL, upload TEXT,"
                " created REAL NOT NULL, last_used REAL NOT NULL)"
            )
            db.execute(
                "CREATE UNIQUE INDEX IF NOT EXISTS entries_key ON entries(repo, ref, key, version)"
            )
            self._db = db
        return self._db

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._db_lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def reserve_cache(self, repo: str, ref: str, key: str, version: str) -> tuple[int, str]:
        """A pending entry and the upload that fills it; a key that exists
        (or is being uploaded by another job) raises `StorageConflict`."""
        now = time.time()
        with self._tx() as db:
            row = db.execute(
                "SELECT id, state, created FROM entries WHERE repo=? AND ref=? AND key=? "
                "AND version=?",
                (repo, ref, key, version),
            ).fetchone()
            if row is not None:
                if row[1] == "ready" or now - row[2] < 3600:
                    raise StorageConflict(
                        f"cache entry {key!r} already exists for {ref or 'this ref'}: "
                        "cache entries are immutable; use a new key"
                    )
                db.execute("DELETE FROM entries WHERE id=?", (row[0],))  # a stale reservation
            cur = db.execute(
                "INSERT INTO entries (repo, ref, key, version, state, created, last_used) "
                "VALUES (?, ?, ?, ?, 'pending', ?, ?)",
                (repo, ref, key, version, now, now),
            )
            ident = int(cur.lastrowid or 0)
            upload = self._new_upload(
                self.cache_dir / "uploads", self.cache_dir / "blobs" / f".{ident}.tar.part"
            )
            db.execute("UPDATE entries SET upload=? WHERE id=?", (upload, ident))
            return ident, upload

    def finalize_cache(self, repo: str, ref: str, key: str, version: str, size: int) -> int:
        with self._tx() as db:
            row = db.execute(
                "SELECT id, upload FROM entries WHERE repo=? AND ref=? AND key=? AND version=? "
                "AND state='pending'",
                (repo, ref, key, version),
            ).fetchone()
            if row is None:
                raise StorageError(f"no upload of cache entry {key!r} is in progress")
            ident, upload = int(row[0]), str(row[1])
            part = self.cache_dir / "blobs" / f".{ident}.tar.part"
            try:
                actual = part.stat().st_size
            except OSError:
                actual = -1
            if actual != size:
                db.execute("DELETE FROM entries WHERE id=?", (ident,))
                part.unlink(missing_ok=True)
                self._end_upload(upload)
                raise StorageError(
                    f"cache entry {key!r}: {max(actual, 0)} bytes were uploaded but the client "
                    f"declared {size}"
                )
            if self.cache_max_bytes and size > self.cache_max_bytes:
                db.execute("DELETE FROM entries WHERE id=?", (ident,))
                part.unlink(missing_ok=True)
                self._end_upload(upload)
                raise StorageError(
                    f"cache entry {key!r} ({size} bytes) is larger than "
                    f"PRELOOP_ACTIONS_CACHE_MAX_BYTES ({self.cache_max_bytes})"
                )
            os.replace(part, self.blob_path("cache", str(ident)))
            now = time.time()
            db.execute(
                "UPDATE entries SET state='ready', size=?, upload=NULL, created=?, last_used=? "
                "WHERE id=?",
                (size, now, now, ident),
            )
            self._end_upload(upload)
            self._evict(db, keep=ident)
            return ident

    def _evict(self, db: sqlite3.Connection, keep: int) -> None:
        """Least recently used entries go until the ready bytes fit the cap."""
        if not self.cache_max_bytes:
            return
        total = int(
            db.execute("SELECT COALESCE(SUM(size), 0) FROM entries WHERE state='ready'").fetchone()[
                0
            ]
        )
        if total <= self.cache_max_bytes:
            return
        rows = db.execute(
            "SELECT id, size FROM entries WHERE state='ready' AND id != ? ORDER BY last_used, id",
            (keep,),
        ).fetchall()
        for ident, size in rows:
            if total <= self.cache_max_bytes:
                break
            db.execute("DELETE FROM entries WHERE id=?", (ident,))
            self.blob_path("cache", str(ident)).unlink(missing_ok=True)
            total -= int(size)

    def match_cache(
        self, repo: str, refs: Sequence[str], key: str, restore_keys: Sequence[str], version: str
    ) -> CacheMatch | None:
        """GitHub's lookup: in the run's ref, then in each fallback ref (the
        default branch): the exact key, then each restore key as a prefix,
        newest entry first."""
        with self._tx() as db:
            row = lookup_cache(
                refs,
                key,
                restore_keys,
                lambda ref, k: db.execute(
                    "SELECT * FROM entries WHERE repo=? AND ref=? AND key=? AND version=? "
                    "AND state='ready'",
                    (repo, ref, k, version),
                ).fetchone(),
                lambda ref, prefix: db.execute(
                    "SELECT * FROM entries WHERE repo=? AND ref=? AND version=? "
                    "AND state='ready' AND substr(key, 1, ?) = ? "
                    "ORDER BY created DESC, id DESC LIMIT 1",
                    (repo, ref, version, len(prefix), prefix),
                ).fetchone(),
            )
            if row is None:
                return None
            entry = _entry(row)
            db.execute("UPDATE entries SET last_used=? WHERE id=?", (time.time(), entry.id))
        return CacheMatch(entry, entry.key)

    def cache_entries(self) -> list[CacheEntry]:
        if not (self.cache_dir / "index.db").exists():
            return []
        with self._tx() as db:
            rows = db.execute(
                "SELECT * FROM entries WHERE state='ready' ORDER BY last_used, id"
            ).fetchall()
        return [_entry(r) for r in rows]

    def close(self) -> None:
        """Abandons the uploads still in progress (their blocks and partial
        files go; a pending cache entry is dropped) and closes the index."""
        for upload, up in list(self._uploads.items()):
            shutil.rmtree(up.directory, ignore_errors=True)
            (up.directory.parent / f"{upload}.meta").unlink(missing_ok=True)
            up.target.unlink(missing_ok=True)
            Path(f"{up.target}.part").unlink(missing_ok=True)
            if self._db is not None:
                with self._tx() as db:
                    db.execute("DELETE FROM entries WHERE upload=? AND state='pending'", (upload,))
        self._uploads.clear()
        if self._db is not None:
            self._db.close()
            self._db = None


def _read_marker(directory: Path) -> str | None:
    try:
        return (directory / RUN_KEY_MARKER).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def artifact_run_name(state_dir: Path, run: str, run_key: str | None) -> str | None:
    """The name under `<state>/artifacts/` of the artifacts of run `run` with
    `run_key` (pass it as the run to `LocalStorage`'s reads), or None when
    the artifacts there are another store's run's and this one's are not
    kept aside either."""
    artifacts = Path(state_dir) / "artifacts"
    current = _read_marker(artifacts / _safe(run))
    if run_key is None or current is None or current == run_key:
        return run
    aside = f"{run}.{run_key}"
    return aside if (artifacts / _safe(aside)).is_dir() else None


def _entry(row: Sequence[object]) -> CacheEntry:
    ident, repo, ref, key, version, size, _state, _upload, created, last_used = row
    return CacheEntry(
        int(str(ident)),
        str(repo),
        str(ref),
        str(key),
        str(version),
        int(str(size)),
        float(str(created)),
        float(str(last_used)),
    )


def _safe(text: str) -> str:
    """A file name for `text` (a run id or an artifact name): percent-escaped."""
    out = "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02X}" for c in text)
    return out if out not in ("", ".", "..") else out.replace(".", "%2E") or "%00"
