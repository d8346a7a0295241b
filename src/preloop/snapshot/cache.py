"""The shared object cache: `snapshot-object-cache/<key>.git`, one bare
repository per source (a local repository or a remote URL).

`ensure_object_cache` makes an entry hold the commits a capture needs:

- first use clones into `<key>.tmp-<nonce>` and renames it into place (a crash
  leaves only a temporary the sweep removes under the entry's lock);
- later uses fetch only when the wanted commit differs from `<key>.last-head`;
- the per-entry lock is held for the refresh, and a `CachePin` is created before
  it is released. The caller drops the pin once its run repository's
  `objects/info/alternates` is written.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from preloop.fs import write_text_atomic
from preloop.process import CommandFailed
from preloop.snapshot import layout
from preloop.snapshot.gitcmd import git, git_env, redact
from preloop.snapshot.limits import CACHE_LOCK_TIMEOUT
from preloop.snapshot.locks import CachePin, acquire_cache_lock_async
from preloop.snapshot.work import BlockingWork

__all__ = [
    "CacheEntry",
    "RemoteFetchFailed",
    "ensure_object_cache",
    "ensure_remote_cache",
]

T = TypeVar("T")

# The remote name a fetch uses; its URL is passed in the environment.
_FETCH_REMOTE = "preloop-source"


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A refreshed cache entry and the capture's pin on it."""

    key: str
    repository: Path
    pin: CachePin

    @property
    def objects(self) -> Path:
        return self.repository / "objects"


class RemoteFetchFailed(Exception):
    """An ordinary fetch error (not a timeout): the capture degrades."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def _read_last_head(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def _cache_repo_env(repository: Path) -> dict[str, str]:
    return git_env({"GIT_DIR": str(repository)})


async def init_cache_entry(path: Path) -> None:
    """Makes `path` (a temporary name, renamed into place by the caller) an empty
    object-cache repository: bare, no template, never auto-gc'ed (the prune owns
    its lifetime)."""
    await git(["init", "--bare", "--quiet", "--template=", path])
    await git(["config", "gc.auto", "0"], env=_cache_repo_env(path))


async def _inline(work: BlockingWork | None, point: str, fn: Callable[..., T], *args: Any) -> T:
    if work is None:
        return fn(*args)
    return await work.run(point, fn, *args)


async def missing_objects(repository: Path, oids: Sequence[str]) -> list[str]:
    """Which of `oids` the repository at `repository` (with its alternates) lacks."""
    if not oids:
        return []
    result = await git(
        ["cat-file", "--batch-check=%(objectname)"],
        env=_cache_repo_env(repository),
        stdin="".join(f"{o}\n" for o in oids).encode(),
    )
    return [line.split()[0] for line in result.stdout_text().splitlines() if "missing" in line]


async def ensure_object_cache(
    state_dir: Path,
    source: Path,
    want: Sequence[str],
    *,
    key: str | None = None,
    run_id: str | None = None,
    lock_timeout: float = CACHE_LOCK_TIMEOUT,
    work: BlockingWork | None = None,
    record_head: bool = True,
) -> CacheEntry:
    """Makes the cache entry of the local repository `source` (its common git
    directory) contain the commits `want`, and returns it pinned. With
    `record_head`, `want[0]` is the source's HEAD: it is recorded in
    `<key>.last-head`, and nothing is fetched while it equals the recorded one."""
    state_dir = Path(state_dir).absolute()
    key = key or layout.cache_key_for_repository(source)
    repository = layout.cache_repository(state_dir, key)
    last_head_path = layout.cache_last_head_path(state_dir, key)
    lock = await acquire_cache_lock_async(state_dir, key, lock_timeout)
    try:
        if not repository.is_dir():
            tmp = layout.cache_tmp_clone_path(state_dir, key, secrets.token_hex(6))
            try:
                # A local clone copies (hardlinks) the whole object store, so
                # every commit the source has, HEAD included, is there after it.
                await git(
                    [
                        "clone",
                        "--bare",
                        "--local",
                        "--quiet",
                        "--no-tags",
                        "--config",
                        "gc.auto=0",
                        source,
                        tmp,
                    ]
                )
                await _inline(work, "publish-cache", os.rename, tmp, repository)
            finally:
                await _inline(work, "remove-tmp-clone", _rmtree, tmp)
            cloned = True
            last_head = None
        else:
            cloned = False
            last_head = _read_last_head(last_head_path)
        if cloned:
            if want and record_head:
                await _inline(work, "last-head", write_text_atomic, last_head_path, want[0] + "\n")
        elif want and not (record_head and want[0] == last_head and len(want) == 1):
            missing = await missing_objects(repository, want)
            if missing:
                refspecs = [f"+{oid}:refs/preloop/want/{oid}" for oid in missing]
                await git(
                    ["fetch", "--quiet", "--no-tags", "--no-write-fetch-head", source, *refspecs],
                    env=_cache_repo_env(repository),
                )
            if record_head:
                await _inline(work, "last-head", write_text_atomic, last_head_path, want[0] + "\n")
        pin = CachePin.create(state_dir, key, run_id)
    finally:
        lock.release()
    return CacheEntry(key, repository, pin)


def _rmtree(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


def _fetch_reason(url: str, ref: str, exc: CommandFailed) -> str:
    lines = [ln for ln in exc.result.stderr_text().splitlines() if ln.strip()]
    detail = lines[-1] if lines else f"git fetch exited with status {exc.result.returncode}"
    return redact(
        f"fetch of {ref} from {layout.strip_url_credentials(url)} failed: {detail}", [url]
    )


async def ensure_remote_cache(
    state_dir: Path,
    url: str,
    ref: str,
    *,
    run_id: str | None = None,
    lock_timeout: float = CACHE_LOCK_TIMEOUT,
    work: BlockingWork | None = None,
) -> tuple[CacheEntry, str]:
    """Fetches `ref` of `url` into the entry keyed by the URL (credentials not
    part of the key); returns the pinned entry and the fetched commit. An
    ordinary fetch error raises `RemoteFetchFailed` with a redacted reason."""
    state_dir = Path(state_dir).absolute()
    key = layout.cache_key_for_url(url)
    repository = layout.cache_repository(state_dir, key)
    fetched_ref = "refs/preloop/fetched"
    lock = await acquire_cache_lock_async(state_dir, key, lock_timeout)
    try:
        target = repository
        tmp: Path | None = None
        if not repository.is_dir():
            tmp = target = layout.cache_tmp_clone_path(state_dir, key, secrets.token_hex(6))
            await init_cache_entry(tmp)
        try:
            try:
                # The URL reaches git through the environment, not argv, so
                # credentials in it are not visible in the process list.
                await git(
                    [
                        "fetch",
                        "--quiet",
                        "--no-tags",
                        "--no-write-fetch-head",
                        _FETCH_REMOTE,
                        f"+{ref}:{fetched_ref}",
                    ],
                    env={
                        **_cache_repo_env(target),
                        "GIT_CONFIG_COUNT": "1",
                        "GIT_CONFIG_KEY_0": f"remote.{_FETCH_REMOTE}.url",
                        "GIT_CONFIG_VALUE_0": url,
                    },
                    secrets=[url],
                )
            except CommandFailed as exc:
                raise RemoteFetchFailed(_fetch_reason(url, ref, exc)) from None
            resolved = await git(
                ["rev-parse", "--verify", "--quiet", f"{fetched_ref}^{{commit}}"],
                env=_cache_repo_env(target),
                check=False,
            )
            if resolved.returncode != 0:
                raise RemoteFetchFailed(redact(f"{ref} of {url} does not name a commit", [url]))
            commit = resolved.stdout_text().strip()
            if tmp is not None:
                await _inline(work, "publish-cache", os.rename, tmp, repository)
                tmp = None
        finally:
            if tmp is not None:
                await _inline(work, "remove-tmp-clone", _rmtree, tmp)
        await _inline(
            work,
            "last-head",
            write_text_atomic,
            layout.cache_last_head_path(state_dir, key),
            commit + "\n",
        )
        pin = CachePin.create(state_dir, key, run_id)
    finally:
        lock.release()
    return CacheEntry(key, repository, pin), commit
