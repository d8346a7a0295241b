"""`StoreStorage`: artifacts and the actions cache in the store, on both stores.

Two `StoreStorage`s on two connections to one store, each with its own state
directory, stand for two runners on two machines: what one publishes the
other sees, and nothing unfinished is ever visible. The HTTP tests put each
behind its own `ServiceServer`, as `preloop runner` does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from preloop.control import Store, open_store
from preloop.control.blobs import BlobStore
from preloop.services import ServiceAccess, ServiceEndpoint
from preloop.services.server import ServiceServer
from preloop.services.storage import StorageConflict, StorageError
from preloop.services.store_storage import StoreStorage
from preloop.services.tokens import Claims, mint

pytest_plugins = ["preloop.testing.control_fixtures"]

ART = "/twirp/github.actions.results.api.v1.ArtifactService/"
CACHE = "/twirp/github.actions.results.api.v1.CacheService/"


async def _body(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def _upload(storage: StoreStorage, upload: str, *blocks: bytes) -> int:
    """Stages `blocks` as Azure blocks and commits them; returns the size."""
    ids = [f"b{i:04d}" for i in range(len(blocks))]
    for block_id, data in zip(ids, blocks, strict=True):
        asyncio.run(storage.write_block(upload, block_id, _body(data), 1 << 30))
    return storage.commit_blocks(upload, ids)


def _artifact(storage: StoreStorage, run: str, name: str, data: bytes) -> int:
    upload = storage.create_artifact(run, "job", name, None)
    size = _upload(storage, upload, data[: len(data) // 2], data[len(data) // 2 :])
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return storage.finalize_artifact(run, "job", name, size, digest).id


def _cache(storage: StoreStorage, key: str, data: bytes, ref: str = "refs/heads/feat") -> int:
    _, upload = storage.reserve_cache("/repo", ref, key, "v1")
    _upload(storage, upload, data)
    return storage.finalize_cache("/repo", ref, key, "v1", len(data))


@pytest.fixture
def two_stores(store_url: str) -> Iterator[tuple[Store, Store]]:
    a, b = open_store(store_url), open_store(store_url)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture
def machines(
    two_stores: tuple[Store, Store], tmp_path: Path
) -> Iterator[tuple[StoreStorage, StoreStorage]]:
    """Runner A and runner B: one store, two state directories."""
    a = StoreStorage(two_stores[0], tmp_path / "a")
    b = StoreStorage(two_stores[1], tmp_path / "b")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_an_artifact_uploaded_on_one_runner_is_read_on_another(
    machines: tuple[StoreStorage, StoreStorage],
) -> None:
    a, b = machines
    data = os.urandom(3 * BlobStore.CHUNK + 12345)  # several store chunks
    ident = _artifact(a, "7", "build", data)
    [record] = b.list_artifacts("7")
    assert (record.name, record.size, record.job, record.id) == ("build", len(data), "job", ident)
    assert record.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    path = b.blob_path("artifact", f"7/{ident}")
    assert path.read_bytes() == data
    assert path.is_relative_to(b.state_dir)  # materialised on B's side
    assert b.list_artifacts("7", name="build", id=ident) == [record]
    assert b.list_artifacts("7", name="other") == []
    # another run sees none of it, not even by guessing the id
    assert b.list_artifacts("8") == []
    assert not b.blob_path("artifact", f"8/{ident}").exists()


def test_the_same_name_twice_in_a_run_is_a_conflict_from_any_runner(
    machines: tuple[StoreStorage, StoreStorage],
) -> None:
    a, b = machines
    _artifact(a, "7", "dist", b"first")
    with pytest.raises(StorageConflict):
        b.create_artifact("7", "job", "dist", None)
    # two runners uploading the same name at once: the first finalize wins
    up_a = a.create_artifact("7", "job", "race", None)
    up_b = b.create_artifact("7", "job", "race", None)
    size = _upload(b, up_b, b"from b")
    _upload(a, up_a, b"from a!")
    b.finalize_artifact("7", "job", "race", size, "")
    with pytest.raises(StorageConflict):
        a.finalize_artifact("7", "job", "race", 7, "")
    [race] = a.list_artifacts("7", name="race")
    assert a.blob_path("artifact", f"7/{race.id}").read_bytes() == b"from b"
    # the same name in another run is fine, and deleting frees the name
    _artifact(b, "8", "dist", b"other run")
    assert a.delete_artifact("7", "dist") > 0
    _artifact(b, "7", "dist", b"again")
    assert b.blob_path(
        "artifact", f"7/{b.list_artifacts('7', name='dist')[0].id}"
    ).read_bytes() == (b"again")


def test_a_killed_upload_leaves_nothing_visible(
    machines: tuple[StoreStorage, StoreStorage], store: Store, tmp_path: Path
) -> None:
    a, b = machines
    upload = a.create_artifact("9", "job", "half", None)
    asyncio.run(a.write_block(upload, "b0000", _body(b"x" * 1000), 1 << 30))
    # the uploading runner dies here: its staged blocks are on its own disk only
    assert b.list_artifacts("9") == []
    assert (
        store.backend.transaction("t", lambda tx: tx.execute("SELECT id FROM preloop_artifacts"))
        == []
    )
    # a finalize with a size other than the bytes uploaded publishes nothing either
    upload = b.create_artifact("9", "job", "short", None)
    size = _upload(b, upload, b"12345")
    with pytest.raises(StorageError, match="5 bytes were uploaded but the client declared 6"):
        b.finalize_artifact("9", "job", "short", size + 1, "")
    assert b.list_artifacts("9") == []
    # a publisher killed between storing the bytes and its row leaves an
    # unpinned blob: invisible, and swept with the other leftovers
    orphan = BlobStore(store).put_bytes(b"orphaned bytes", "artifact")
    assert b.list_artifacts("9") == []
    dead = StoreStorage(store, tmp_path / "a")
    dead.create_artifact("9", "job", "never", None)
    dead.reserve_cache("/repo", "refs/heads/x", "pending-key", "v1")
    assert b.sweep_abandoned_uploads(older_than=-1) >= 2  # the orphan, the reservation
    assert not BlobStore(store).has(orphan.digest)
    assert b.match_cache("/repo", ["refs/heads/x"], "pending-key", [], "v1") is None


def test_caches_cross_runners_with_restore_keys_newest_first_and_ref_scoping(
    machines: tuple[StoreStorage, StoreStorage],
) -> None:
    a, b = machines
    old = _cache(a, "deps-1", b"old bytes")
    # reserved on A, not yet finalized: B cannot take the same key
    _, pending = a.reserve_cache("/repo", "refs/heads/feat", "deps-2", "v1")
    with pytest.raises(StorageConflict):
        b.reserve_cache("/repo", "refs/heads/feat", "deps-2", "v1")
    _upload(a, pending, b"new bytes")
    new = a.finalize_cache("/repo", "refs/heads/feat", "deps-2", "v1", 9)
    with pytest.raises(StorageConflict):  # entries are immutable
        b.reserve_cache("/repo", "refs/heads/feat", "deps-1", "v1")

    hit = b.match_cache("/repo", ["refs/heads/feat"], "deps-1", [], "v1")
    assert hit is not None and hit.entry.id == old
    assert b.blob_path("cache", str(old)).read_bytes() == b"old bytes"
    newest = b.match_cache("/repo", ["refs/heads/feat"], "nope", ["deps-"], "v1")
    assert newest is not None and (newest.entry.id, newest.matched_key) == (new, "deps-2")
    assert b.match_cache("/repo", ["refs/heads/feat"], "deps-1", [], "v2") is None
    # another ref sees nothing, unless it falls back to the ref the entry is on
    assert b.match_cache("/repo", ["refs/heads/other"], "deps-1", ["deps-"], "v1") is None
    main = _cache(a, "deps-1", b"main bytes", ref="refs/heads/main")
    via = b.match_cache("/repo", ["refs/heads/other", "refs/heads/main"], "deps-1", [], "v1")
    assert via is not None and via.entry.id == main
    # the run's own ref comes first
    own = b.match_cache("/repo", ["refs/heads/feat", "refs/heads/main"], "deps-1", [], "v1")
    assert own is not None and own.entry.id == old
    # another repository sees nothing
    assert b.match_cache("/other", ["refs/heads/feat"], "deps-1", ["d"], "v1") is None
    assert sorted(e.key for e in a.cache_entries()) == ["deps-1", "deps-1", "deps-2"]


def test_cache_cap_evicts_least_recently_used_across_runners(
    two_stores: tuple[Store, Store], tmp_path: Path
) -> None:
    a = StoreStorage(two_stores[0], tmp_path / "a", cache_max_bytes=2_600_000)
    b = StoreStorage(two_stores[1], tmp_path / "b", cache_max_bytes=2_600_000)
    blobs = {k: os.urandom(1_000_000) for k in "abc"}
    ids = {k: _cache(a if k != "b" else b, f"key-{k}", blobs[k]) for k in "ab"}
    assert b.match_cache("/repo", ["refs/heads/feat"], "key-a", [], "v1") is not None  # a used
    ids["c"] = _cache(b, "key-c", blobs["c"])
    assert sorted(e.key for e in a.cache_entries()) == ["key-a", "key-c"]
    assert a.match_cache("/repo", ["refs/heads/feat"], "key-b", [], "v1") is None
    # the evicted entry's bytes left the store
    store_blobs = BlobStore(two_stores[0])
    assert not store_blobs.has(hashlib.sha256(blobs["b"]).hexdigest())
    assert store_blobs.has(hashlib.sha256(blobs["c"]).hexdigest())
    # an entry larger than the cap is refused and leaves no reservation
    with pytest.raises(StorageError, match="PRELOOP_ACTIONS_CACHE_MAX_BYTES"):
        _cache(a, "huge", os.urandom(2_700_000))
    assert a.match_cache("/repo", ["refs/heads/feat"], "huge", [], "v1") is None
    _cache(b, "huge", b"small now")  # the key is free again
    a.close()
    b.close()


def test_retention_removes_expired_artifacts_and_their_bytes(
    machines: tuple[StoreStorage, StoreStorage], store: Store
) -> None:
    a, b = machines
    upload = a.create_artifact("4", "job", "short", "2026-01-01T00:00:00.000Z")
    size = _upload(a, upload, b"short-lived")
    a.finalize_artifact("4", "job", "short", size, "")
    _artifact(a, "4", "kept", b"kept bytes")
    _artifact(a, "5", "same", b"kept bytes")  # the same bytes: one blob, two pins
    now = time.time()
    assert b.remove_expired_artifacts(0, now=now) == []
    assert [r.name for r in b.list_artifacts("4")] == ["kept"]
    assert not BlobStore(store).has(hashlib.sha256(b"short-lived").hexdigest())
    assert b.remove_expired_artifacts(1, now=now + 3 * 86400) == ["4", "5"]
    assert b.list_artifacts("4") == [] and b.list_artifacts("5") == []
    assert not BlobStore(store).has(hashlib.sha256(b"kept bytes").hexdigest())


# -- HTTP: two runners' services over one store ---------------------------------


@pytest.fixture
def endpoints(
    machines: tuple[StoreStorage, StoreStorage],
) -> Iterator[tuple[ServiceEndpoint, ServiceEndpoint]]:
    servers = [ServiceServer(m) for m in machines]
    for s in servers:
        s.start()
    try:
        yield (
            ServiceEndpoint(servers[0].url, servers[0].secret),
            ServiceEndpoint(servers[1].url, servers[1].secret),
        )
    finally:
        for s in servers:
            s.stop()


_SCOPE = {"preloop_services": {"repo": "/repo", "ref": "refs/heads/f", "default_ref": "x"}}


def _token(acc: ServiceAccess, run: str) -> str:
    return mint(acc.secret, Claims(run, "job", acc.repo, acc.ref, acc.default_ref))


def _call(url: str, path: str, body: dict[str, Any], token: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url.rstrip("/") + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _put(url: str, data: bytes) -> int:
    with urllib.request.urlopen(urllib.request.Request(url, data=data, method="PUT")) as r:
        return int(r.status)


def test_runners_services_share_a_run_and_refuse_other_runs(
    endpoints: tuple[ServiceEndpoint, ServiceEndpoint],
) -> None:
    a, b = (e.access(_SCOPE) for e in endpoints)
    assert (a.repo, a.ref, a.default_ref) == ("/repo", "refs/heads/f", "x")
    token_a = _token(a, "11")
    status, created = _call(a.url, ART + "CreateArtifact", {"name": "n", "version": 4}, token_a)
    assert status == 200, created
    assert _put(created["signedUploadUrl"], b"PK zip bytes") == 201
    status, done = _call(a.url, ART + "FinalizeArtifact", {"name": "n", "size": "12"}, token_a)
    assert status == 200, done
    # run 11's job on runner B lists and downloads it through B's own service
    token_b = _token(b, "11")
    status, listed = _call(b.url, ART + "ListArtifacts", {}, token_b)
    assert [x["name"] for x in listed["artifacts"]] == ["n"]
    status, signed = _call(b.url, ART + "GetSignedArtifactURL", {"name": "n"}, token_b)
    assert signed["signedUrl"].startswith(b.url)
    with urllib.request.urlopen(signed["signedUrl"]) as resp:
        assert resp.read() == b"PK zip bytes"
    # run 12's token reads nothing of run 11, on either runner
    other = _token(b, "12")
    assert _call(b.url, ART + "ListArtifacts", {}, other) == (200, {"artifacts": []})
    assert _call(b.url, ART + "GetSignedArtifactURL", {"name": "n"}, other)[0] == 404
    body = {"workflowRunBackendId": "11", "name": "n"}
    assert _call(b.url, ART + "ListArtifacts", body, other)[0] == 403
    assert _call(b.url, ART + "DeleteArtifact", {"name": "n"}, other)[0] == 404
    # a token of runner A's service is no token for runner B's
    assert _call(b.url, ART + "ListArtifacts", {}, token_a)[0] == 401
    # a cache saved through A restores through B
    body = {"key": "k-1", "version": "v"}
    status, made = _call(a.url, CACHE + "CreateCacheEntry", body, token_a)
    assert made["ok"], made
    assert _put(made["signedUploadUrl"], b"tar") == 201
    status, fin = _call(
        a.url, CACHE + "FinalizeCacheEntryUpload", {**body, "sizeBytes": "3"}, token_a
    )
    assert fin["ok"], fin
    status, got = _call(
        b.url,
        CACHE + "GetCacheEntryDownloadURL",
        {"key": "x", "restoreKeys": ["k-"], "version": "v"},
        token_b,
    )
    assert got["ok"] and got["matchedKey"] == "k-1", got
    with urllib.request.urlopen(got["signedDownloadUrl"]) as resp:
        assert resp.read() == b"tar"
