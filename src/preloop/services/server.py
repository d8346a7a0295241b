"""The HTTP services GitHub's clients talk to: artifacts (v4) and the actions cache.

One aiohttp application on 127.0.0.1 (a free port), in its own thread and
event loop so that uploads never wait for the engine's loop:

- `POST /twirp/github.actions.results.api.v1.ArtifactService/<Method>`:
  CreateArtifact, FinalizeArtifact, ListArtifacts, GetSignedArtifactURL,
  DeleteArtifact (twirp, JSON), what `@actions/artifact` 2.x speaks;
- `POST /twirp/github.actions.results.api.v1.CacheService/<Method>`:
  CreateCacheEntry, FinalizeCacheEntryUpload, GetCacheEntryDownloadURL
  (`@actions/cache` 4.x with `ACTIONS_CACHE_SERVICE_V2`);
- `/_apis/artifactcache/...`: the older cache REST protocol (reserve, PATCH
  chunks with `Content-Range`, commit, lookup) for `actions/cache` v3;
- `PUT /blob/upload/<id>`: the Azure block-blob calls the clients make with
  the signed upload URLs we hand out (`comp=block`, `comp=blocklist`, or the
  whole blob in one PUT); `GET /blob/artifact/<run>/<id>`, `GET
  /blob/cache/<id>`: downloads with the signed download URLs.

Every twirp and REST call carries `Authorization: Bearer <ACTIONS_RUNTIME_TOKEN>`
signed by this service (`preloop.services.tokens`); the run, job, repository
and ref come from the token. Blob URLs are signed (HMAC, expiry) instead, as
Azure SAS URLs are. Anything else gets 401/403/404.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import socket
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

from aiohttp import web

from preloop.services.listener import BACKLOG
from preloop.services.storage import (
    ARTIFACT_ZIP,
    ArtifactRecord,
    ServiceStorage,
    StorageConflict,
    StorageError,
    is_zip_type,
)
from preloop.services.tokens import Claims, TokenError, verify

__all__ = ["ServiceServer"]

# Above any id a store gives an artifact (see `ServiceServer._artifacts`).
_RUN_ID_STRIDE = 10**12

_log = logging.getLogger(__name__)
T = TypeVar("T")

ARTIFACT_SERVICE = "github.actions.results.api.v1.ArtifactService"
CACHE_SERVICE = "github.actions.results.api.v1.CacheService"
_URL_TTL = 6 * 3600
MAX_BLOCK = 4000 * 1024 * 1024  # Azure's limit for one block
MAX_BLOB = 50 * 1024**3  # an upload larger than this is refused
# how much of a body aiohttp buffers before it stops reading the socket (64 KiB
# by default: a 200 MB upload paused and resumed thousands of times)
_READ_BUFSIZE = 4 << 20


class _TwirpError(Exception):
    def __init__(self, status: int, code: str, msg: str) -> None:
        super().__init__(msg)
        self.status, self.code, self.msg = status, code, msg


# A media type as a client may name it (`type/subtype`, no parameters).
_MIME = re.compile(r"[A-Za-z0-9][\w.+-]*/[A-Za-z0-9][\w.+-]*", re.ASCII)


def _field(body: dict[str, Any], name: str) -> Any:
    """A field of a twirp JSON message by its JSON (lowerCamel) name or its
    proto (snake_case) name: GitHub's clients send the proto names."""
    if name in body:
        return body[name]
    return body.get(re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name))


def _twirp_error(status: int, code: str, msg: str) -> web.Response:
    return web.json_response({"code": code, "msg": msg}, status=status)


async def _chunks(request: web.Request) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_any():
        yield chunk


class ServiceServer:
    """The application and its signing secret. `start()` binds (or takes the
    listening `sock`, see `preloop.services.listener`) and serves in a thread;
    `stop()` closes it. `url` is `http://127.0.0.1:<port>/`."""

    def __init__(
        self,
        storage: ServiceStorage,
        secret: bytes | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        self.storage = storage
        self.secret = secret or secrets.token_bytes(32)
        self.port = 0
        self._sock = sock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        # legacy cache ids -> the upload that fills them
        self._legacy: dict[int, tuple[str, Claims, str, str]] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    # -- lifecycle ---------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/twirp/{service}/{method}", self._twirp)
        app.router.add_put("/blob/upload/{upload}", self._blob_put)
        app.router.add_get("/blob/{kind}/{ref:.+}", self._blob_get)
        app.router.add_get("/_apis/artifactcache/cache", self._legacy_lookup)
        app.router.add_post("/_apis/artifactcache/caches", self._legacy_reserve)
        app.router.add_patch("/_apis/artifactcache/caches/{id}", self._legacy_upload)
        app.router.add_post("/_apis/artifactcache/caches/{id}", self._legacy_commit)
        return app

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="preloop-services", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            runner = web.AppRunner(
                self.app(), access_log=None, handle_signals=False, read_bufsize=_READ_BUFSIZE
            )
            loop.run_until_complete(runner.setup())
            site: web.BaseSite
            if self._sock is not None:
                site = web.SockSite(runner, self._sock, backlog=BACKLOG)
            else:
                site = web.TCPSite(runner, "127.0.0.1", 0, backlog=BACKLOG)
            loop.run_until_complete(site.start())
            server = site._server
            assert isinstance(server, asyncio.base_events.Server)
            self.port = int(server.sockets[0].getsockname()[1])
            self._runner = runner
        except BaseException as exc:
            self._error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._loop = self._thread = None

    # -- signing -----------------------------------------------------------------
    def _sig(self, what: str, expires: int) -> str:
        return hmac.new(self.secret, f"{what}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def signed(self, what: str) -> str:
        """A URL for blob path `what` (e.g. `upload/<id>`) that works without a token."""
        expires = int(time.time()) + _URL_TTL
        return f"{self.url}blob/{what}?se={expires}&sig={self._sig(what, expires)}"

    def _check_sig(self, request: web.Request, what: str) -> None:
        try:
            expires = int(request.query.get("se", "0"))
        except ValueError:
            expires = 0
        sig = request.query.get("sig", "")
        if expires < time.time() or not hmac.compare_digest(sig, self._sig(what, expires)):
            raise web.HTTPForbidden(text="signature does not match or has expired")

    def _claims(self, request: web.Request) -> Claims:
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        try:
            return verify(self.secret, token)
        except TokenError as exc:
            raise _TwirpError(
                401, "unauthenticated", f"ACTIONS_RUNTIME_TOKEN refused: {exc}"
            ) from None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs a storage call: inline for local files, in a worker thread when
        it is a round trip to the shared store (`ServiceStorage.remote`), so
        one job's finalize never stalls another job's requests."""
        if self.storage.remote:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    # -- twirp -------------------------------------------------------------------
    async def _twirp(self, request: web.Request) -> web.Response:
        service = request.match_info["service"]
        method = request.match_info["method"]
        handlers: dict[str, Callable[[Claims, dict[str, Any]], Awaitable[dict[str, Any]]]]
        if service == ARTIFACT_SERVICE:
            handlers = {
                "CreateArtifact": self._create_artifact,
                "FinalizeArtifact": self._finalize_artifact,
                "ListArtifacts": self._list_artifacts,
                "GetSignedArtifactURL": self._signed_artifact_url,
                "DeleteArtifact": self._delete_artifact,
            }
        elif service == CACHE_SERVICE:
            handlers = {
                "CreateCacheEntry": self._create_cache,
                "FinalizeCacheEntryUpload": self._finalize_cache,
                "GetCacheEntryDownloadURL": self._cache_url,
            }
        else:
            return _twirp_error(404, "bad_route", f"no service {service!r}")
        handler = handlers.get(method)
        if handler is None:
            return _twirp_error(404, "bad_route", f"{service} has no method {method!r}")
        try:
            claims = self._claims(request)
            try:
                body = await request.json()
            except ValueError:
                raise _TwirpError(400, "malformed", "the request body is not JSON") from None
            if not isinstance(body, dict):
                raise _TwirpError(400, "malformed", "the request body is not a JSON object")
            return web.json_response(await handler(claims, body))
        except _TwirpError as exc:
            return _twirp_error(exc.status, exc.code, exc.msg)
        except StorageConflict as exc:
            return _twirp_error(409, "already_exists", str(exc))
        except StorageError as exc:
            return _twirp_error(400, "invalid_argument", str(exc))

    @staticmethod
    def _same_run(claims: Claims, body: dict[str, Any], *, reading: bool = False) -> str:
        """The run the request names (its token's own when none); a write
        is to its own run only, a read also to a run it re-runs."""
        run = str(_field(body, "workflowRunBackendId") or "") or claims.run
        if run != claims.run and not (reading and run in claims.earlier):
            raise _TwirpError(403, "permission_denied", "the token does not belong to that run")
        return run

    @staticmethod
    def _name(body: dict[str, Any]) -> str:
        name = str(body.get("name") or "")
        if not name:
            raise _TwirpError(400, "invalid_argument", "an artifact name is required")
        return name

    async def _create_artifact(self, c: Claims, body: dict[str, Any]) -> dict[str, Any]:
        self._same_run(c, body)
        name = self._name(body)
        for run in c.earlier:
            # GitHub's attempts share the run's artifacts: a re-run job's
            # upload of a name an earlier attempt has is refused alike.
            if await self._call(self.storage.list_artifacts, run, name):
                raise StorageConflict(
                    f"an artifact named {name!r} already exists in run {run.split('.')[0]}, "
                    "which this run re-runs: upload-artifact's `overwrite: true` replaces it"
                )
        expires = _field(body, "expiresAt")
        mime = _field(body, "mimeType")  # a StringValue: the string, or {"value": ...}
        if isinstance(mime, dict):
            mime = mime.get("value")
        # None from a client before 6.x, which always uploads a zip.
        if mime is None or mime == "":
            mime = ARTIFACT_ZIP
        elif not _MIME.fullmatch(str(mime)):
            mime = "application/octet-stream"  # served as it is, never unzipped
        upload = await self._call(
            self.storage.create_artifact,
            c.run,
            c.job,
            name,
            str(expires) if expires else None,
            mime,
        )
        return {"ok": True, "signedUploadUrl": self.signed(f"upload/{upload}")}

    async def _finalize_artifact(self, c: Claims, body: dict[str, Any]) -> dict[str, Any]:
        self._same_run(c, body)
        digest = body.get("hash")
        if isinstance(digest, dict):
            digest = digest.get("value")
        record = await self._call(
            self.storage.finalize_artifact,
            c.run,
            c.job,
            self._name(body),
            int(body.get("size") or 0),
            str(digest or ""),
        )
        return {"ok": True, "artifactId": str(record.id)}

    async def _list_artifacts(self, c: Claims, body: dict[str, Any]) -> dict[str, Any]:
        self._same_run(c, body, reading=True)
        name = _field(body, "nameFilter")
        ident = _field(body, "idFilter")
        if isinstance(name, dict):
            name = name.get("value")
        if isinstance(ident, dict):
            ident = ident.get("value")
        records = await self._call(
            self._artifacts, c, str(name) if name else None, int(ident) if ident else None
        )
        return {
            "artifacts": [
                {
                    "workflowRunBackendId": r.run,
                    "workflowJobRunBackendId": r.job,
                    "databaseId": str(ident),
                    "name": r.name,
                    "size": str(r.size),
                    "createdAt": r.created_at,
                    **({"digest": r.digest} if r.digest else {}),
                }
                for r, ident in records
            ]
        }

    async def _signed_artifact_url(self, c: Claims, body: dict[str, Any]) -> dict[str, Any]:
        run = self._same_run(c, body, reading=True)
        if run == c.run:
            found = [r for r, _ in await self._call(self._artifacts, c, self._name(body), None)]
        else:  # a listed artifact of a run it re-runs, by that run
            found = await self._call(self.storage.list_artifacts, run, self._name(body))
        if not found:
            raise _TwirpError(404, "not_found", f"run {c.run} has no artifact {body['name']!r}")
        return {"signedUrl": self.signed(f"artifact/{quote(found[0].run, safe='')}/{found[0].id}")}

    def _artifacts(
        self, c: Claims, name: str | None, ident: int | None
    ) -> list[tuple[ArtifactRecord, int]]:
        """The artifacts the token's run sees, with the id each is listed
        under: its own, then those of the runs it re-runs (on GitHub the
        attempts of a run share its artifacts). Ids count per run on disk:
        the k-th run's are listed as k * _RUN_ID_STRIDE + the id."""
        runs = c.artifact_runs()
        if ident is not None:
            k, own = divmod(ident, _RUN_ID_STRIDE)
            if k >= len(runs):
                return []
            return [(r, ident) for r in self.storage.list_artifacts(runs[k], name, own)]
        seen: set[str] = set()
        out: list[tuple[ArtifactRecord, int]] = []
        for k, run in enumerate(runs):
            found = self.storage.list_artifacts(run, name, None)
            out += [(r, k * _RUN_ID_STRIDE + r.id) for r in found if r.name not in seen]
            seen.update(r.name for r in found)
        return out

    async def _delete_artifact(self, c: Claims, body: dict[str, Any]) -> dict[str, Any]:
        """Deletes the run's own artifact of that name, else (upload-artifact's
        `overwrite: true` in a re-run) the one of an earlier attempt."""
        self._same_run(c, body)
        name = self._name(body)
        for run in c.artifact_runs():
            try:
                ident = await self._call(self.storage.delete_artifact, run, name)
            except StorageError:
                continue
            return {"ok": True, "artifactId": str(ident)}
        raise _TwirpError(404, "not_found", f"run {c.run} has no artifact named {name!r}")

    async def _create_cache(self, c: Claims, body: dict[str, Any]) -> dict[str, Any]:
        key, version = str(body.get("key") or ""), str(body.get("version") or "")
        if not key or not version:
            raise _TwirpError(400, "invalid_argument", "key and version are required")
        try:
            _, upload = await self._call(self.storage.reserve_cache, c.repo, c.ref, key, version)
        except StorageConflict as exc:
            return {"ok": False, "signedUploadUrl": "", "message": str(exc)}
        return {"ok": True, "signedUploadUrl": self.signed(f"upload/{upload}")}

    async def _finalize_cache(self, c: Claims, body: dict[str, Any]) -> dict[str, Any]:
        key, version = str(body.get("key") or ""), str(body.get("version") or "")
        try:
            ident = await self._call(
                self.storage.finalize_cache,
                c.repo,
                c.ref,
                key,
                version,
                int(_field(body, "sizeBytes") or 0),
            )
        except StorageError as exc:
            return {"ok": False, "entryId": "0", "message": str(exc)}
        return {"ok": True, "entryId": str(ident)}

    async def _cache_url(self, c: Claims, body: dict[str, Any]) -> dict[str, Any]:
        key, version = str(body.get("key") or ""), str(body.get("version") or "")
        restore = [str(k) for k in _field(body, "restoreKeys") or []]
        # as GitHub (and the REST lookup): the exact key, then the key itself
        # as a prefix, then each restore key
        match = await self._call(
            self.storage.match_cache, c.repo, c.cache_refs(), key, [key, *restore], version
        )
        if match is None:
            return {"ok": False, "signedDownloadUrl": "", "matchedKey": ""}
        return {
            "ok": True,
            "signedDownloadUrl": self.signed(f"cache/{match.entry.id}"),
            "matchedKey": match.matched_key,
        }

    # -- blobs -------------------------------------------------------------------
    async def _blob_put(self, request: web.Request) -> web.Response:
        upload = request.match_info["upload"]
        self._check_sig(request, f"upload/{upload}")
        comp = request.query.get("comp")
        headers = {"x-ms-request-id": secrets.token_hex(8), "x-ms-version": "2024-11-04"}
        try:
            if comp == "block":
                block = request.query.get("blockid", "")
                # aiohttp ends the body at Content-Length: the block is at most that
                limit = min(MAX_BLOCK, request.content_length or MAX_BLOCK)
                await self.storage.write_block(upload, block, _chunks(request), limit)
            elif comp == "blocklist":
                blocks = _block_list(await request.read())
                # joining 200 MB of blocks must not stall the other jobs' requests
                await asyncio.to_thread(self.storage.commit_blocks, upload, blocks)
            elif comp is None:
                await self.storage.write_block(upload, None, _chunks(request), MAX_BLOB)
            else:
                return web.Response(status=400, text=f"unsupported comp={comp}")
        except StorageError as exc:
            return web.Response(status=400, text=str(exc), headers=headers)
        except ConnectionError:
            # the client went away mid-body: the partial block was discarded
            return web.Response(status=400, text="the upload was interrupted", headers=headers)
        return web.Response(status=201, headers=headers)

    async def _blob_get(self, request: web.Request) -> web.StreamResponse:
        kind, ref = request.match_info["kind"], request.match_info["ref"]
        if kind not in ("artifact", "cache"):
            raise web.HTTPNotFound()
        self._check_sig(request, f"{kind}/{ref}")
        try:
            path = await self._call(self.storage.blob_path, kind, ref.replace("%2F", "/"))
        except ValueError:
            raise web.HTTPNotFound() from None
        if not path.is_file():
            raise web.HTTPNotFound(text="gone")
        headers = {"Content-Type": "application/octet-stream"}
        if kind == "artifact":
            headers = await self._call(self._artifact_headers, ref.replace("%2F", "/"))
        return web.FileResponse(path, headers=headers)

    def _artifact_headers(self, ref: str) -> dict[str, str]:
        """An artifact download's type as its client uploaded it: @actions/artifact
        6.x unzips only a zip type, and names a file served as it is after
        Content-Disposition (else `artifact`)."""
        run, _, ident = ref.partition("/")
        found = self.storage.list_artifacts(run, id=int(ident))
        mime = found[0].mime_type if found else ARTIFACT_ZIP
        headers = {"Content-Type": mime}
        if found and not is_zip_type(mime):
            headers["Content-Disposition"] = (
                f"attachment; filename*=UTF-8''{quote(found[0].name, safe='')}"
            )
        return headers

    # -- legacy cache REST (actions/cache v3) --------------------------------------
    def _rest_claims(self, request: web.Request) -> Claims:
        try:
            return self._claims(request)
        except _TwirpError as exc:
            raise web.HTTPUnauthorized(text=exc.msg) from None

    async def _legacy_lookup(self, request: web.Request) -> web.Response:
        c = self._rest_claims(request)
        keys = [k for k in request.query.get("keys", "").split(",") if k]
        version = request.query.get("version", "")
        if not keys:
            return web.json_response({"message": "keys are required"}, status=400)
        match = await self._call(
            self.storage.match_cache, c.repo, c.cache_refs(), keys[0], keys, version
        )
        if match is None:
            return web.Response(status=204)
        return web.json_response(
            {
                "cacheKey": match.matched_key,
                "scope": match.entry.ref,
                "archiveLocation": self.signed(f"cache/{match.entry.id}"),
            }
        )

    async def _legacy_reserve(self, request: web.Request) -> web.Response:
        c = self._rest_claims(request)
        body = await request.json()
        key, version = str(body.get("key") or ""), str(body.get("version") or "")
        try:
            ident, upload = await self._call(
                self.storage.reserve_cache, c.repo, c.ref, key, version
            )
        except StorageConflict as exc:
            return web.json_response({"message": str(exc)}, status=409)
        self._legacy[ident] = (upload, c, key, version)
        return web.json_response({"cacheId": ident})

    def _legacy_entry(self, request: web.Request) -> tuple[int, str, Claims, str, str]:
        c = self._rest_claims(request)
        try:
            ident = int(request.match_info["id"])
            upload, owner, key, version = self._legacy[ident]
        except (ValueError, KeyError):
            raise web.HTTPNotFound(text="no such cache reservation") from None
        if (owner.repo, owner.ref) != (c.repo, c.ref):
            raise web.HTTPForbidden(text="the reservation belongs to another scope")
        return ident, upload, c, key, version

    async def _legacy_upload(self, request: web.Request) -> web.Response:
        _, upload, _, _, _ = self._legacy_entry(request)
        rng = request.headers.get("Content-Range", "")
        try:
            start = int(rng.split()[1].split("-")[0])
        except (IndexError, ValueError):
            return web.json_response({"message": "Content-Range is required"}, status=400)
        try:
            await self.storage.write_range(upload, start, _chunks(request), MAX_BLOB)
        except StorageError as exc:
            return web.json_response({"message": str(exc)}, status=400)
        return web.Response(status=204)

    async def _legacy_commit(self, request: web.Request) -> web.Response:
        ident, _, c, key, version = self._legacy_entry(request)
        body = await request.json()
        try:
            await self._call(
                self.storage.finalize_cache, c.repo, c.ref, key, version, int(body.get("size") or 0)
            )
        except StorageError as exc:
            return web.json_response({"message": str(exc)}, status=400)
        finally:
            self._legacy.pop(ident, None)
        return web.Response(status=204)


def _block_list(body: bytes) -> list[str]:
    """The block ids of an Azure `Put Block List` body, in order."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise StorageError(f"bad block list: {exc}") from None
    return [el.text or "" for el in root if el.tag in ("Latest", "Committed", "Uncommitted")]
