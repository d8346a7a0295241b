"""Content-addressed blobs in the store (preloop.control.blobs), on both stores."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from preloop.control import Store, open_store
from preloop.control.blobs import BlobMissing, BlobStore
from preloop.testing.control_fixtures import store, store_url

__all__ = ["store", "store_url"]


@pytest.fixture
def blobs(store: Store) -> BlobStore:
    b = BlobStore(store)
    b.CHUNK = 7  # several chunks per test blob
    return b


def _chunk_rows(store: Store, digest: str) -> int:
    row = store.backend.transaction(
        "t",
        lambda tx: tx.one(
            "SELECT count(*) AS n FROM preloop_blob_chunks WHERE digest = ?", (digest,)
        ),
    )
    assert row is not None
    return int(row["n"])


def test_bytes_round_trip_in_chunks_and_are_named_by_their_sha256(
    blobs: BlobStore, store: Store, tmp_path: Path
) -> None:
    data = b"hello, content-addressed world\n" * 3
    info = blobs.put_bytes(data, "artifact")
    assert info.digest == hashlib.sha256(data).hexdigest()
    assert (info.size, info.kind) == (len(data), "artifact")
    assert _chunk_rows(store, info.digest) == -(-len(data) // 7)
    assert blobs.read_bytes(info.digest) == data
    out = tmp_path / "out"
    out.mkdir()
    blobs.read_to_file(info.digest, out / "a.bin")
    assert (out / "a.bin").read_bytes() == data
    assert [p.name for p in out.iterdir()] == ["a.bin"]  # no temp file left
    src = tmp_path / "in.bin"
    src.write_bytes(data)
    assert blobs.put_file(src, "artifact") == info  # the same bytes: the same blob
    assert blobs.total_bytes() == len(data) and blobs.total_bytes("bundle") == 0


def test_an_empty_blob_is_a_blob(blobs: BlobStore) -> None:
    info = blobs.put_bytes(b"", "cache")
    assert blobs.has(info.digest) and blobs.read_bytes(info.digest) == b""


def test_storing_the_same_bytes_again_uploads_nothing(blobs: BlobStore, store: Store) -> None:
    first = blobs.put_bytes(b"x" * 30, "bundle")
    before = store.counters.snapshot().operations.get("blob_put", 0)
    again = blobs.put_bytes(b"x" * 30, "bundle")
    assert again == first
    # One transaction (the lookup), no chunk writes.
    assert store.counters.snapshot().operations["blob_put"] - before == 1


def test_an_interrupted_upload_is_invisible_and_swept(blobs: BlobStore, store: Store) -> None:
    data = b"0123456789" * 5
    digest = hashlib.sha256(data).hexdigest()

    def dying() -> Iterator[bytes]:
        yield data[:7]
        yield data[7:14]
        raise OSError("the writer died")

    with pytest.raises(OSError):
        blobs._put(digest, len(data), "artifact", dying)
    assert not blobs.has(digest) and blobs.info(digest) is None
    with pytest.raises(BlobMissing):
        blobs.read_bytes(digest)
    with pytest.raises(BlobMissing):
        blobs.pin(digest, "run:x")
    assert blobs.sweep() == 0  # not stale yet: it may still be uploading
    assert blobs.sweep(stale_after=-1) == 1
    assert _chunk_rows(store, digest) == 0
    assert blobs.put_bytes(data, "artifact").digest == digest  # a retry completes it
    assert blobs.read_bytes(digest) == data


def test_a_retry_completes_an_interrupted_upload_without_a_sweep(blobs: BlobStore) -> None:
    data = b"abcdefghij" * 4
    digest = hashlib.sha256(data).hexdigest()

    def dying() -> Iterator[bytes]:
        yield data[:7]
        raise OSError("cut")

    with pytest.raises(OSError):
        blobs._put(digest, len(data), "bundle", dying)
    assert blobs.put_bytes(data, "bundle").digest == digest
    assert blobs.read_bytes(digest) == data


def test_pins_keep_blobs_from_deletion_and_eviction(blobs: BlobStore) -> None:
    a = blobs.put_bytes(b"a" * 10, "bundle")
    b = blobs.put_bytes(b"b" * 10, "bundle")
    c = blobs.put_bytes(b"c" * 10, "bundle")
    blobs.pin(a.digest, "run:1")
    blobs.pin(a.digest, "run:2")
    assert blobs.holders(a.digest) == ["run:1", "run:2"]
    assert not blobs.delete(a.digest)
    # Oldest first (a, b, c), a is pinned, c is vetoed: only b can go.
    removed = blobs.evict(0, "bundle", keep=lambda cands: {c.digest})
    assert removed == [b]
    assert blobs.has(a.digest) and blobs.has(c.digest) and not blobs.has(b.digest)
    assert blobs.unpin("run:1") == 1
    assert not blobs.delete(a.digest)  # run:2 still holds it
    assert blobs.unpin("run:2", a.digest) == 1
    assert blobs.evict(10, "bundle") == [a]  # 20 bytes down to 10: a goes (LRU)
    assert blobs.has(c.digest)


def test_eviction_goes_least_recently_used_first_and_stops_under_the_cap(
    blobs: BlobStore,
) -> None:
    old = blobs.put_bytes(b"old" * 4, "cache")
    new = blobs.put_bytes(b"new" * 4, "cache")
    other = blobs.put_bytes(b"other kind", "artifact")
    blobs.touch(old.digest)  # used after `new`: `new` is now least recent
    assert blobs.evict(12, "cache") == [new]
    assert blobs.has(old.digest) and blobs.has(other.digest)
    assert blobs.evict(1000) == []


def test_blobs_are_shared_by_two_connections_to_one_store(store_url: str) -> None:
    with open_store(store_url) as one, open_store(store_url) as two:
        info = BlobStore(one).put_bytes(b"between machines", "artifact")
        assert BlobStore(two).read_bytes(info.digest) == b"between machines"
        with pytest.raises(BlobMissing, match="not in the store"):
            BlobStore(two).read_bytes("0" * 64)


def test_an_upload_survives_its_connections_being_terminated(
    pg_url: str, pg_server_url: str
) -> None:
    from tests.test_store_faults import _terminate, _with_app_name

    app = "preloop_blob_fault"
    data = bytes(range(256)) * 40
    digest = hashlib.sha256(data).hexdigest()
    with open_store(_with_app_name(pg_url, app)) as s:
        b = BlobStore(s)
        b.CHUNK = 1000
        cuts = 0

        def chunks() -> Iterator[bytes]:
            nonlocal cuts
            for i in range(0, len(data), 1000):
                if i in (2000, 7000):  # between chunk transactions
                    cuts += _terminate(pg_server_url, app)
                yield data[i : i + 1000]

        info = b._put(digest, len(data), "artifact", chunks)
        assert cuts >= 2 and info.digest == digest
        assert b.read_bytes(digest) == data
